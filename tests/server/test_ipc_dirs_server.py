"""A real server's IPC socket files: in one private 0700 directory; a
`kill -9` of the main process leaves that directory, the next start removes it, and a
normal stop leaves nothing. The servers run a tiny model: only their processes matter."""

from __future__ import annotations

import signal
import stat
import time
from pathlib import Path

import pytest
import requests

from srt.utils.process import IPC_DIR_PREFIX
from tests.server.server_process import ServerProcess, alive

pytestmark = pytest.mark.slow

SMALL = ("--max-total-tokens", "4096")


def ipc_entries(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("radixrt-*"))


def test_kill_9_leftovers_removed_at_next_start(
    tmp_path: Path, short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_served_model: str
) -> None:
    tmp = short_tmp_path
    monkeypatch.setenv("TMPDIR", str(tmp))  # the server's tempfile.gettempdir()

    small = (*SMALL, "--model-path", tiny_served_model)
    first = ServerProcess(*small, log_path=tmp_path / "first.log")
    # The tokenizer manager binds its socket at the first request.
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
    assert requests.post(first.url + "/generate", json=body, timeout=60).status_code == 200
    [ipc_dir] = ipc_entries(tmp)
    assert ipc_dir.name.startswith(f"{IPC_DIR_PREFIX}{first.proc.pid}-")
    assert stat.S_IMODE(ipc_dir.stat().st_mode) == 0o700
    assert sorted(p.name for p in ipc_dir.iterdir()) == ["detokenizer", "scheduler", "tokenizer"]

    first.stop(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in first.children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ipc_entries(tmp) == [ipc_dir], "kill -9 cannot clean up; the next start must"

    second = ServerProcess(*small, log_path=tmp_path / "second.log")
    try:
        [new_dir] = ipc_entries(tmp)
        assert new_dir != ipc_dir and not ipc_dir.exists()
    finally:
        code = second.stop(signal.SIGTERM)
    assert code == 0, second.tail()
    assert ipc_entries(tmp) == []
