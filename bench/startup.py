"""How long `launch_server` takes to answer `/health`, and the CPU seconds each of its processes
spent getting there (the main process, the scheduler, the detokenizer). On a small CPU a start
is mostly imports, in three processes on two cores, so the CPU split says where it goes.

    python -m bench.startup                                  # the default model, 3 starts
    python -m bench.startup --repeat 5 -- --model-path /models/tiny --dtype float32

Arguments after `--` go to `launch_server`. Each start is stopped with SIGTERM before the next.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench.launch import free_port
from bench.serving_cpu import cpu_seconds, processes

READY_TIMEOUT_S = 300.0


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def scheduler_pid(url: str) -> int:
    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as r:
        return json.loads(r.read())["internal_states"][0]["pid"]


def one_start(server_args: list[str]) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "srt.launch_server", "--port", str(port), *server_args]
    with tempfile.TemporaryFile() as log:
        tic = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            while not healthy(url):
                if proc.poll() is not None or time.perf_counter() - tic > READY_TIMEOUT_S:
                    log.seek(0)
                    raise RuntimeError(f"server did not start: {log.read()[-2000:]!r}")
                time.sleep(0.05)
            ready = time.perf_counter() - tic
            scheduler = scheduler_pid(url)
            [detokenizer] = [pid for pid in processes(proc) if pid not in (proc.pid, scheduler)]
            return {
                "ready_s": ready,
                "main_cpu_s": cpu_seconds(proc.pid),
                "scheduler_cpu_s": cpu_seconds(scheduler),
                "detokenizer_cpu_s": cpu_seconds(detokenizer),
            }
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    server_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, server_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    runs = [one_start(server_args) for _ in range(args.repeat)]
    report = {
        "server_args": server_args,
        "starts": args.repeat,
        **{key: round(statistics.median(r[key] for r in runs), 2) for key in runs[0]},
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
