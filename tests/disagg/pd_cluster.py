"""A prefill server, a decode server and sglang-router in PD mode, as real processes."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import requests

from bench.launch import router_command
from tests.ports import free_port
from tests.server.server_process import ServerProcess, die_with_parent

ROUTER_TIMEOUT_S = 120.0


class PDCluster:
    def __init__(self, backend: str, log_dir: Path, *extra: str) -> None:
        self.backend = backend
        self.log_dir = log_dir
        self.bootstrap_port = free_port()
        self.extra = extra
        # Both servers start at once (each start is mostly imports and loading).
        self.prefill = self.start_prefill(wait=False)
        try:
            self.decode = ServerProcess(
                *self.common(),
                "--disaggregation-mode", "decode",
                log_path=log_dir / "decode.log",
                wait=False,
            )  # fmt: skip
        except BaseException:
            self.prefill.stop()
            raise
        try:
            self.prefill.wait_ready()
            self.decode.wait_ready()
        except BaseException:
            self.prefill.stop()
            self.decode.stop()
            raise
        self.router_port = free_port()
        self.url = f"http://127.0.0.1:{self.router_port}"
        cmd = router_command(
            "--pd-disaggregation",
            "--prefill", self.prefill.url, str(self.bootstrap_port),
            "--decode", self.decode.url,
            "--host", "127.0.0.1", "--port", str(self.router_port),
            "--disable-retries", "--disable-circuit-breaker",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        )  # fmt: skip
        self.router_log = open(log_dir / "router.log", "w")  # noqa: SIM115
        self.router = subprocess.Popen(
            cmd,
            stdout=self.router_log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only a prctl
        )
        try:
            self.wait_router()
        except BaseException:
            self.stop()  # never leave servers behind a failed start
            raise

    def common(self) -> tuple[str, ...]:
        return (
            "--dtype", "float32", "--max-total-tokens", "16384",
            "--disaggregation-transfer-backend", self.backend,
            "--disaggregation-bootstrap-port", str(self.bootstrap_port),
            *self.extra,
        )  # fmt: skip

    def start_prefill(self, port: int | None = None, wait: bool = True) -> ServerProcess:
        args = [*self.common(), "--disaggregation-mode", "prefill"]
        log = self.log_dir / f"prefill-{time.monotonic_ns()}.log"
        return ServerProcess(*args, log_path=log, port=port, wait=wait)

    def wait_router(self) -> None:
        deadline = time.monotonic() + ROUTER_TIMEOUT_S
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"router exited: {self.router.returncode}")
            try:
                r = requests.post(self.url + "/generate", json=body, timeout=30)
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError("router never served a request")

    def stop(self) -> None:
        if self.router.poll() is None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(20)
            except subprocess.TimeoutExpired:
                self.router.kill()
        self.router_log.close()
        for srv in (self.prefill, self.decode):
            srv.stop()
