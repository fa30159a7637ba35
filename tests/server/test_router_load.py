"""Two RadixRT servers behind the real sglang-router with `--policy power_of_two`.

The router's load monitor reads `GET /get_load` from every worker (a JSON array, one entry
per data-parallel rank; it sums `num_tokens`) and power_of_two sends each request to the
lighter of two workers by that number. It registers a worker from `GET /server_info`
(`model_path` is its tokenizer source). Checked here: the router reads a real load (not
-1) from both, the load moves with the queue (on the worker and in the router's own
`/get_loads`), requests avoid the loaded worker, and the router logs no load-fetch or
tokenizer-path warning once the workers are registered. Last, a trimmed `bench/chaos.py`:
the busy worker is killed under streaming load behind a router with its retries on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from bench import chaos
from bench.launch import router_command
from tests.ports import free_port
from tests.server.server_process import ServerProcess, die_with_parent

pytestmark = pytest.mark.slow

SERVER_ARGS = (
    "--dtype", "float32", "--max-total-tokens", "4096", "--max-running-requests", "1",
    "--enable-metrics",
)  # fmt: skip
LOAD_INTERVAL_S = 1  # the router polls /get_load every --worker-startup-check-interval
ROUTER_TIMEOUT_S = 120.0
# Warnings the router logs about loads or a worker's tokenizer source.
BAD_LINES = ("No loads fetched from workers", "No tokenizer_path or model_path found")


class Router:
    def __init__(self, worker_urls: list[str], log_path: Path, *extra: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        cmd = router_command(
            "--worker-urls", *worker_urls, "--policy", "power_of_two",
            "--worker-startup-check-interval", str(LOAD_INTERVAL_S),
            "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            *(extra or ("--disable-retries", "--disable-circuit-breaker")),
        )  # fmt: skip
        self.log = open(log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only a prctl
        )

    def wait_ready(self, num_workers: int) -> None:
        """Until it serves a request and its load monitor has a real load for every worker."""
        deadline = time.monotonic() + ROUTER_TIMEOUT_S
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"router exited: {self.tail()}"
            try:
                served = requests.post(self.url + "/generate", json=body, timeout=30).ok
                loads = self.loads()
            except requests.RequestException:
                served, loads = False, {}
            if served and len(loads) == num_workers and min(loads.values()) >= 0:
                return
            time.sleep(0.5)
        raise AssertionError(f"router not ready: {self.tail()}")

    def loads(self) -> dict[str, int]:
        """What the router last read from each worker's /get_load (-1: nothing usable)."""
        workers = requests.get(self.url + "/get_loads", timeout=10).json()["workers"]
        return {w["worker"]: w["load"] for w in workers}

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def get_load(url: str) -> dict[str, int]:
    loads = requests.get(url + "/get_load", timeout=10).json()
    assert isinstance(loads, list) and len(loads) == 1, loads
    return loads[0]


def finished_requests(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "sglang:e2e_request_latency_seconds_count":
                return s.value
    raise AssertionError("no e2e latency histogram")


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, server):
    """A busy worker (one running request at a time) started here, and the session's shared
    server as the idle one (it has metrics on, and nothing else runs while this module does)."""
    pytest.importorskip("sglang_router")
    logs = tmp_path_factory.mktemp("router-load")
    busy = ServerProcess(*SERVER_ARGS, log_path=logs / "server-busy.log")
    router = Router([busy.url, server.url], logs / "router.log")
    try:
        router.wait_ready(num_workers=2)
        yield (busy, server), router
    finally:
        router.stop()
        busy.stop()


def test_load_moves_with_the_queue(cluster) -> None:
    (busy, idle), router = cluster
    ready_log_len = len(router.log_path.read_text())
    # The router's readiness probes ran here: their report arrives with the scheduler's
    # next stats, right after it went idle. (A probe's response can reach the client ~0.1 s
    # before the scheduler's next stats drop it from the running count; its KV goes first.)
    zero = {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    wait_for(lambda: get_load(busy.url) == zero, 10, "the probes to leave the load")

    # Six long requests straight to one server that runs one at a time: five wait.
    body = {
        "text": "Write a long story about the sea. " * 8,
        "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
    }
    with cf.ThreadPoolExecutor(6) as pool:
        queued = [
            pool.submit(requests.post, busy.url + "/generate", json=body, timeout=300)
            for _ in range(6)
        ]
        load = wait_for(
            lambda: (x := get_load(busy.url))["num_waiting_reqs"] >= 2 and x,
            timeout=60,
            what="a queue on the busy server",
        )
        assert load["num_reqs"] >= 3 and load["num_tokens"] > 0, load
        seen = wait_for(
            lambda: (x := router.loads())[busy.url] > 0 and x,
            timeout=10 * LOAD_INTERVAL_S,
            what="the router to read the busy server's load",
        )
        assert seen[idle.url] < seen[busy.url], seen
        # /get_loads asks the workers now; power_of_two routes on the load monitor's last
        # reading, which may be up to one interval older: let it take a reading of the queue.
        time.sleep(2 * LOAD_INTERVAL_S)

        # power_of_two compares the two loads it read: requests go to the idle server.
        before = finished_requests(idle.url)
        short = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
        for _ in range(3):
            assert router.loads()[busy.url] > 0  # still loaded when this one is routed
            r = requests.post(router.url + "/generate", json=short, timeout=60)
            assert r.status_code == 200, r.text
        assert finished_requests(idle.url) - before == 3

        for f in queued:
            assert f.result().status_code == 200

    # Idle again: nothing held, nothing waiting, on the server and in the router's view.
    wait_for(lambda: get_load(busy.url)["num_tokens"] == 0, 30, "the busy server to drain")
    wait_for(lambda: router.loads()[busy.url] == 0, 10 * LOAD_INTERVAL_S, "the router to see it")

    log = router.log_path.read_text()
    after_ready = log[ready_log_len:]
    # 0.3.2's load monitor also ticks once at start, before any worker is registered, and
    # then warns "No loads fetched"; after registration there must be none.
    assert not [line for line in after_ready.splitlines() if BAD_LINES[0] in line]
    assert BAD_LINES[1] not in log


def test_router_registers_model_path(cluster) -> None:
    """The router labels each worker with the `model_path` /server_info reports (the served
    model name: local paths stay private), so it registers the worker without a warning."""
    servers, router = cluster
    workers = requests.get(router.url + "/workers", timeout=10).json()["workers"]
    name = requests.get(servers[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert {w["url"] for w in workers} == {s.url for s in servers}
    for w in workers:
        assert w["metadata"]["model_path"] == name, w
        assert w["model_id"] == name, w


def test_a_worker_killed_under_streaming_load(cluster, tmp_path) -> None:
    """Last in the module (it kills the busy worker): eight streams through a second router,
    with the router's retries and circuit breaker on, and `kill -9` of the busy worker while
    they run. Every stream either completes or visibly fails (an error event, or a transfer
    cut off), none is silently short or repeats a token; after the kill the router soon
    stops sending requests to the dead worker (until then one may fail with its own
    error, once its retries met only the dead worker), and they complete on the live one."""
    (busy, _idle), _ = cluster
    router = Router(
        [s.url for s in cluster[0]], tmp_path / "router.log", "--retry-max-retries", "3"
    )
    try:
        router.wait_ready(num_workers=2)
        during, after = asyncio.run(streams_across_a_kill(router.url, busy))
    finally:
        router.stop()
    outcomes = [s.outcome for s in during]
    assert "truncated" not in outcomes and "corrupted" not in outcomes, during
    assert "complete" in outcomes, during  # the live worker's
    assert [s.outcome for s in after[-4:]] == ["complete"] * 4, after
    assert all(s.outcome in ("complete", "failed_before_start") for s in after), after


async def streams_across_a_kill(url: str, victim: ServerProcess):
    timeout = aiohttp.ClientTimeout(total=ROUTER_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        running = [asyncio.create_task(chaos.one_stream(session, url, i, 32)) for i in range(8)]
        await asyncio.sleep(1.5)  # streams on both workers; the busy one's queued behind one
        victim.proc.kill()  # its scheduler and detokenizer die with it (PR_SET_PDEATHSIG)
        during = await asyncio.gather(*running)
        after: list[chaos.Stream] = []
        while len(after) < 20 and [s.outcome for s in after[-4:]] != ["complete"] * 4:
            after.append(await chaos.one_stream(session, url, len(after), 8))
    return during, after
