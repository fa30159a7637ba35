"""One shared server (the default model, float32, metrics on) for the HTTP tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.server_process import ServerProcess

SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "32768", "--enable-metrics")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = Path(tmp_path_factory.mktemp("server")) / "server.log"
    srv = ServerProcess(*SERVER_ARGS, log_path=log)
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM: {srv.tail()}"


@pytest.fixture(scope="session")
def url(server: ServerProcess) -> str:
    return server.url
