"""CPU seconds each server process spends while `bench_serving` streams a workload through it.

Where a serving run is bound by a process other than the scheduler (the front process, which
runs HTTP and the tokenizer manager on one Python thread, or the detokenizer), that process's
CPU time per output token is its ceiling: one core carries 1e6 / (µs per token) tokens a
second. The script starts a server, reads each of its processes' CPU time (/proc) before and
after one `bench_serving` run, and prints seconds and µs per output token per process, and
the client's own (`bench_serving` times its CPU over the run): a client at one CPU second per
second bounds the run, not the server.

    python -m bench.serving_cpu --model-path MODEL --num-prompts 128 --output-len 256
    python -m bench.serving_cpu --server-args "--dtype bfloat16 --attention-backend flashinfer" \\
        --num-prompts 256 --input-len 1024 --output-len 1024 --range-ratio 0.098  # the GPU run
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

STARTUP_TIMEOUT_S = 300


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def add_stream_args(p: argparse.ArgumentParser, port: int, num_prompts: int) -> None:
    """The flags of the streamed random workload, shared with `bench.front_capacity`."""
    p.add_argument("--model-path", default=None, help="default: the default model")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)


def wait_until_healthy(port: int, alive: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
            return
        except OSError:
            if time.monotonic() > deadline or not alive():
                raise SystemExit("the server did not start") from None
            time.sleep(0.5)


def stream_random(args: argparse.Namespace, *extra: str, dataset: str = "random") -> str:
    """Run `bench_serving` on the random workload of `add_stream_args` (`dataset`: "random",
    texts, or "random-ids", token ids); its report."""
    cmd = [sys.executable, "-m", "bench.bench_serving", "--port", str(args.port)]
    cmd += ["--dataset-name", dataset, "--num-prompts", str(args.num_prompts)]
    cmd += ["--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(args.output_len), "--disable-tqdm", *extra]
    cmd += ["--tokenizer", args.model_path] if args.model_path else []
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def reported(report: str, label: str) -> float:
    """A figure of `bench_serving`'s report, by its label."""
    return float(re.search(rf"{re.escape(label)}:?\s+([\d.]+)", report).group(1))


def processes(server: subprocess.Popen) -> dict[int, str]:
    """The server's own process and its children, by name."""
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(server.pid)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    named = {server.pid: "front (HTTP + tokenizer manager)"}
    for line in out.splitlines():
        pid, args = line.split(None, 1)
        if "resource_tracker" not in args:
            named[int(pid)] = f"child {pid}"
    return named


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_stream_args(p, port=31555, num_prompts=128)
    p.add_argument("--range-ratio", type=float, default=1.0, help="bench_serving's random range")
    p.add_argument("--backend", default="radixrt", help="bench_serving's --backend")
    p.add_argument("--server-args", default="--dtype float32", help="extra launch_server args")
    p.add_argument("--server-log", default=None, help="the server's output (default: dropped)")
    args = p.parse_args(argv)
    model = ["--model-path", args.model_path] if args.model_path else []
    log = open(args.server_log, "wb") if args.server_log else subprocess.DEVNULL  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "-m", "srt.launch_server", *model, "--port", str(args.port)]
        + args.server_args.split(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until_healthy(args.port, lambda: server.poll() is None, STARTUP_TIMEOUT_S)
        named = processes(server)
        before = {pid: cpu_seconds(pid) for pid in named}
        extra = ["--backend", args.backend, "--random-range-ratio", str(args.range_ratio)]
        report = stream_random(args, *extra)
        after = {pid: cpu_seconds(pid) for pid in named}
    finally:
        server.terminate()
        server.wait()
        if log is not subprocess.DEVNULL:
            log.close()
    print(report, end="")
    tokens = int(reported(report, "Total generated tokens"))
    if tokens == 0:
        raise SystemExit("no token was generated")
    print(f"CPU time per output token ({tokens} tokens):")
    for pid, name in named.items():
        spent = after[pid] - before[pid]
        print(f"{spent:7.2f} s CPU  {spent / tokens * 1e6:6.1f} µs/token  {name}")
    client = reported(report, "Client CPU seconds")
    print(f"{client:7.2f} s CPU  {client / tokens * 1e6:6.1f} µs/token  client (bench_serving)")


if __name__ == "__main__":
    main()
