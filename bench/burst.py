"""How fast a burst over the admission bound is refused: N concurrent requests at once
against `--max-running-requests R --max-queued-requests Q`; the requests beyond what can run
or wait get 503, and this reports how long each refusal took, whether the admitted ones
completed, and the memory-integrity verdict once the server is idle again.

    python -m bench.burst                       # starts the default model's server
    python -m bench.burst --url http://...      # a running server started with the bounds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.launch import start_radixrt, stop
from bench.soak import idle_integrity


async def one(session: aiohttp.ClientSession, url: str, ids: list[int], new: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "ignore_eos": True}}
    t0 = time.perf_counter()
    async with session.post(url + "/generate", json=body) as r:
        await r.read()
        return {"status": r.status, "latency_s": time.perf_counter() - t0}


def summary(latencies: list[float]) -> dict[str, float | None]:
    if not latencies:
        return {"median_ms": None, "p90_ms": None, "max_ms": None}
    ms = sorted(1000 * x for x in latencies)
    return {
        "median_ms": statistics.median(ms),
        "p90_ms": ms[int(0.9 * (len(ms) - 1))],
        "max_ms": ms[-1],
    }


async def burst(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        prompts = [
            [rng.randrange(100, 20000) for _ in range(args.input_len)] for _ in range(args.n)
        ]
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(one(session, args.url, ids, args.output_len) for ids in prompts)
        )
        refused = [r["latency_s"] for r in results if r["status"] == 503]
        done = [r["latency_s"] for r in results if r["status"] == 200]
        first_done = min(done) if done else None
        return {
            "requests": args.n,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "completed": len(done),
            "refused_503": len(refused),
            "other": sorted({r["status"] for r in results} - {200, 503}),
            "refusal": summary(refused),
            "refused_after_first_completion": sum(x > first_done for x in refused)
            if first_done
            else 0,
            "first_completion_ms": 1000 * first_done if first_done else None,
            "wall_s": time.perf_counter() - t0,
            "memory_integrity": await idle_integrity(session, args.url, 120),
        }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="a running server; default: start one")
    p.add_argument("--server-args", default="--dtype float32", help="for a server started here")
    p.add_argument("--max-running-requests", type=int, default=2)
    p.add_argument("--max-queued-requests", type=int, default=4)
    p.add_argument("--n", type=int, default=40, help="concurrent requests")
    p.add_argument("--input-len", type=int, default=1500, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the record here as JSON")
    args = p.parse_args(argv)
    server = None
    if args.url is None:
        bounds = [
            "--max-running-requests", str(args.max_running_requests),
            "--max-queued-requests", str(args.max_queued_requests),
        ]  # fmt: skip
        server, args.url = start_radixrt([*args.server_args.split(), *bounds])
    try:
        record = asyncio.run(burst(args))
    finally:
        if server is not None:
            stop(server)
    print(json.dumps(record, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
