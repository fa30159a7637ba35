"""Request limits against the shared tiny server (a batch limit of `TINY_SERVER_BATCH`, behind an
API key): prompts times n over the limit is a 400 naming the field on every route, a batch at
the limit runs, operators behind the key see the model's local path; and an idle keep-alive
connection outlives the pools clients keep. tests/server/test_request_limits.py has the
default limits, on the shared default-model server."""

from __future__ import annotations

import time

import pytest
import requests

from tests.conftest import TINY_SERVER_KEY
from tests.entrypoints.helpers import assert_error

AUTH = {"Authorization": f"Bearer {TINY_SERVER_KEY}"}


@pytest.fixture(scope="module")
def guarded_url(tiny_server) -> str:
    return tiny_server.url


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 9}, "n"),
        ("/v1/completions", {"prompt": ["a"] * 3, "n": 3}, "n"),
        ("/v1/completions", {"prompt": ["a"] * 9}, "prompt"),
        ("/generate", {"text": "a", "sampling_params": {"n": 9}}, "n"),
        ("/generate", {"text": ["a"] * 3, "sampling_params": {"n": 3}}, "n"),
        ("/generate", {"text": ["a"] * 9}, "text"),
    ],
)
def test_small_batch_limit_on_every_route(
    guarded_url: str, route: str, body: dict, param: str
) -> None:
    limited = {**body, "max_tokens": 1} if route.startswith("/v1") else body
    r = requests.post(guarded_url + route, json=limited, headers=AUTH, timeout=60)
    assert_error(r, 400, param)


def test_batch_at_the_limit_runs(guarded_url: str) -> None:
    for route, body in (
        ("/v1/completions", {"prompt": ["a", "b"], "n": 4, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "n": 8, "max_tokens": 1},
        ),
        ("/generate", {"text": ["a", "b"], "sampling_params": {"n": 4, "max_new_tokens": 1}}),
    ):
        r = requests.post(guarded_url + route, json=body, headers=AUTH, timeout=120)
        assert r.status_code == 200, (route, r.text)


def test_operators_see_the_local_path_behind_the_api_key(
    guarded_url: str, tiny_served_model: str
) -> None:
    server = requests.get(guarded_url + "/get_server_info", headers=AUTH, timeout=30).json()
    assert server["model_path"] == tiny_served_model
    info = requests.get(guarded_url + "/get_model_info", headers=AUTH, timeout=30).json()
    assert info["model_path"] == info["served_model_name"]


def test_an_idle_keep_alive_connection_outlives_client_pools(tiny_server) -> None:
    """A connection left idle longer than uvicorn's default keep-alive (5 s) still takes the
    next request: clients pool idle connections for longer (aiohttp 15 s), and a server that
    closed first would reset the request they send on it (seen in `bench/soak.py` runs)."""
    import http.client
    from urllib.parse import urlsplit

    from srt.entrypoints.serve import KEEP_ALIVE_S

    assert KEEP_ALIVE_S > 15
    where = urlsplit(tiny_server.url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() is not None
        local = conn.sock.getsockname()
        time.sleep(6)
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        assert conn.sock.getsockname() == local  # the same connection, not a new one
    finally:
        conn.close()
