"""The API key (issue 16, item 7): where it comes from (`--api-key`, `--api-key-file`,
`RADIXRT_API_KEY`) and how `ApiKeyMiddleware` checks it, driven as plain ASGI (no server)."""

from __future__ import annotations

import asyncio
import hmac
import json
from pathlib import Path
from typing import Any

import pytest

from srt.entrypoints.auth import ApiKeyError, ApiKeyMiddleware, resolve_api_key
from srt.environ import API_KEY
from srt.server_args import ServerArgs

KEY = "s3cret-key"


async def _ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def call(path: str, authorization: str | None = None) -> tuple[int, bytes]:
    """One GET through the middleware: (status, body)."""
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    scope = {"type": "http", "method": "GET", "path": path, "headers": headers}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(ApiKeyMiddleware(_ok_app, KEY)(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(scheme: str) -> None:
    assert call("/generate", f"{scheme} {KEY}") == (200, b"ok")


@pytest.mark.parametrize(
    "authorization",
    [None, "", f"Bearer {KEY}x", "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer{KEY}", "Bearer "],
)
def test_missing_or_wrong_key_is_a_json_401(authorization: str | None) -> None:
    status, body = call("/v1/models", authorization)
    assert status == 401
    error = json.loads(body)["error"]
    assert error["code"] == 401 and error["type"] == "AuthenticationError"
    assert KEY not in body.decode()


def test_health_stays_open() -> None:
    assert call("/health") == (200, b"ok")
    assert call("/health_generate")[0] == 401


def test_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert call("/generate", f"Bearer {KEY}")[0] == 200
    assert call("/generate", "Bearer nope")[0] == 401
    assert compared == [(KEY.encode(), KEY.encode()), (b"nope", KEY.encode())]


# ---- resolve_api_key: the flag, then the file, then the environment ------------------------


def key_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "key"
    path.write_text(text)
    return str(path)


def test_no_key_anywhere_is_an_open_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY.name, raising=False)
    assert resolve_api_key(ServerArgs()) is None
    monkeypatch.setenv(API_KEY.name, "")
    assert resolve_api_key(ServerArgs()) is None


def test_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY.name, "from-env")
    assert API_KEY.name == "RADIXRT_API_KEY"
    assert resolve_api_key(ServerArgs()) == "from-env"


def test_file_first_line_stripped_wins_over_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY.name, "from-env")
    args = ServerArgs(api_key_file=key_file(tmp_path, "  from-file \nsecond line\n"))
    assert resolve_api_key(args) == "from-file"


def test_flag_wins_over_file_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY.name, "from-env")
    args = ServerArgs(api_key="from-flag", api_key_file=key_file(tmp_path, "from-file\n"))
    assert resolve_api_key(args) == "from-flag"


def test_missing_key_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ApiKeyError, match=r"--api-key-file .*nope: cannot read it"):
        resolve_api_key(ServerArgs(api_key_file=str(missing)))


@pytest.mark.parametrize("text", ["", "\n", "   \nkey-on-line-two\n"])
def test_empty_key_file_is_a_clear_error(
    tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY.name, KEY)  # the file, once named, is not skipped for it
    with pytest.raises(ApiKeyError, match="first line is empty"):
        resolve_api_key(ServerArgs(api_key_file=key_file(tmp_path, text)))
