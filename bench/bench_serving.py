"""Online serving benchmark: an asyncio HTTP client with SGLang bench_serving's flags and report.

    python -m bench.bench_serving --backend radixrt --base-url http://127.0.0.1:30000 \\
        --dataset-name generated-shared-prefix --gsp-num-groups 8 --max-concurrency 16

`radixrt`/`sglang` stream the native `POST /generate` (cumulative events), `openai`/`vllm`
`/v1/completions` and `openai-chat` `/v1/chat/completions` (deltas, usage last). Failed
requests are counted and reported, never raised.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import time
from collections import Counter
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from bench.datasets import (
    DatasetRow,
    add_dataset_args,
    build_dataset,
    load_tokenizer,
    server_json,
)
from bench.serving_backends import (
    BACKENDS,
    MAX_ERRORS_KEPT,
    NATIVE,
    READ_BUFSIZE,
    REQUEST_TIMEOUT,
    RequestResult,
    send_request,
)

logger = logging.getLogger(__name__)


def percentiles(values: list[float], name: str) -> dict[str, float]:
    """mean/median/p90/p99 of seconds, as `{stat}_{name}_ms`."""
    arr = np.asarray(values or [0.0]) * 1000
    return {
        f"mean_{name}_ms": float(arr.mean()),
        f"median_{name}_ms": float(np.median(arr)),
        f"p90_{name}_ms": float(np.percentile(arr, 90)),
        f"p99_{name}_ms": float(np.percentile(arr, 99)),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """The run's metrics from its per-request results (successful requests only)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    errors = Counter(r.error for r in results if not r.success)
    per_s = 1.0 / duration if duration > 0 else 0.0
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common(MAX_ERRORS_KEPT)),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) * per_s,
        "input_throughput": total_in * per_s,
        "output_throughput": total_out * per_s,
        "total_throughput": (total_in + total_out) * per_s,
        "concurrency": sum(r.latency for r in ok) * per_s,
        **percentiles([r.latency for r in ok], "e2e_latency"),
        **percentiles([r.ttft for r in ok], "ttft"),
        **percentiles(tpots, "tpot"),
        **percentiles([x for r in ok for x in r.itl], "itl"),
        "cached_tokens": cached,
        "prefix_cache_hit_rate": cached / total_in if total_in else 0.0,
    }


async def flush_server_cache(session: aiohttp.ClientSession, base_url: str) -> None:
    try:
        async with session.post(base_url + "/flush_cache") as resp:
            if resp.status != 200:
                logger.warning("flush_cache: HTTP %d %s", resp.status, await resp.text())
    except aiohttp.ClientError as e:
        logger.warning("flush_cache failed (not a native server?): %s", e)


async def benchmark(
    backend: str,
    base_url: str,
    rows: list[DatasetRow],
    *,
    model: str | None = None,
    tokenizer: Any = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    warmup_requests: int = 1,
    flush_cache: bool = False,
    disable_tqdm: bool = True,
) -> dict[str, Any]:
    """Send `rows` with Poisson arrivals at `request_rate`, at most `max_concurrency` at once."""
    api = BACKENDS[backend]
    url = base_url.rstrip("/") + api.path
    # Concurrency is ours to limit, not the pool's. Idle connections are dropped after 2 s,
    # before any server would (uvicorn's and llama-server's default is 5 s): a request sent
    # into a server's close of a pooled connection fails, and is not retried.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
    session_args = {"timeout": REQUEST_TIMEOUT, "read_bufsize": READ_BUFSIZE}
    async with aiohttp.ClientSession(connector=connector, **session_args) as session:
        if warmup_requests > 0 and rows:
            warm = [send_request(session, api, url, rows[0], model) for _ in range(warmup_requests)]
            failed = [r.error for r in await asyncio.gather(*warm) if not r.success]
            if failed:
                logger.warning("%d warmup request(s) failed: %s", len(failed), failed[0])
        if flush_cache:
            await flush_server_cache(session, base_url.rstrip("/"))

        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = tqdm(total=len(rows), disable=disable_tqdm)

        async def one(row: DatasetRow) -> RequestResult:
            if limit is None:
                out = await send_request(session, api, url, row, model, tokenizer)
            else:
                async with limit:
                    out = await send_request(session, api, url, row, model, tokenizer)
            pbar.update(1)
            return out

        rng = np.random.default_rng(seed)
        start, cpu_start = time.perf_counter(), time.process_time()
        tasks = []
        for i, row in enumerate(rows):
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
            tasks.append(asyncio.create_task(one(row)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu_start
        pbar.close()
    config = {"backend": backend, "request_rate": request_rate, "max_concurrency": max_concurrency}
    # Per-request TTFTs (successful requests), for distribution plots such as bench/ab.py's.
    ttfts = {"ttfts_s": [r.ttft for r in results if r.success]}
    # The client's own CPU seconds over the run: one Python thread reads every event, so at
    # its ceiling (1 s per s) the client, not the server, bounds the throughput.
    return {**config, **summarize(results, duration), "client_cpu_s": client_cpu, **ttfts}


SUMMARY_ROWS = [
    ("Backend:", "backend"),
    ("Traffic request rate:", "request_rate"),
    ("Max request concurrency:", "max_concurrency"),
    ("Successful requests:", "completed"),
    ("Failed requests:", "failed"),
    ("Benchmark duration (s):", "duration"),
    ("Total input tokens:", "total_input_tokens"),
    ("Total generated tokens:", "total_output_tokens"),
    ("Request throughput (req/s):", "request_throughput"),
    ("Input token throughput (tok/s):", "input_throughput"),
    ("Output token throughput (tok/s):", "output_throughput"),
    ("Total token throughput (tok/s):", "total_throughput"),
    ("Concurrency:", "concurrency"),
    ("Prefix cache hit rate:", "prefix_cache_hit_rate"),
    ("Client CPU seconds:", "client_cpu_s"),
]
LATENCY_SECTIONS = [
    ("End-to-End Latency", "e2e_latency", "E2E Latency"),
    ("Time to First Token", "ttft", "TTFT"),
    ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
    ("Inter-token Latency", "itl", "ITL"),
]


def print_summary(m: dict[str, Any]) -> None:
    """The metrics in SGLang bench_serving's layout."""

    def line(name: str, value: Any) -> None:
        if isinstance(value, float) and math.isfinite(value):
            value = f"{value:.2f}"
        print(f"{name:<40} {'not set' if value is None else value:<10}")

    print(f"{' Serving Benchmark Result ':=^50}")
    for name, key in SUMMARY_ROWS:
        line(name, m[key])
    for title, key, label in LATENCY_SECTIONS:
        print(f"{title:-^50}")
        for stat in ("mean", "median", "p90", "p99"):
            line(f"{stat.capitalize()} {label} (ms):", m[f"{stat}_{key}_ms"])
    for error, count in m["errors"].items():
        print(f"failed x{count}: {error}")
    print("=" * 50)


def default_model(base_url: str) -> str | None:
    """The first model id that the server lists, if it lists any."""
    models = (server_json(base_url, "/v1/models") or {}).get("data") or []
    return models[0].get("id") if models else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=sorted(BACKENDS), default="radixrt")
    p.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--tokenizer", default=None, help="default: the server's, from its info")
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson; inf: burst")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache first")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append one JSON line of results")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def json_safe(value: Any) -> Any:
    """inf/nan as strings, so the output file is strict JSON."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Build the workload, run it, print the summary, append it to --output-file."""
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    model = args.model or default_model(base_url)
    if args.dataset_name == "random-ids" and BACKENDS[args.backend] is not NATIVE:
        raise SystemExit("--dataset-name random-ids needs a native backend (radixrt, sglang)")
    tokenizer = load_tokenizer(args.tokenizer, base_url)
    rows = build_dataset(args, tokenizer)
    options = ("request_rate", "max_concurrency", "seed", "warmup_requests", "flush_cache")
    kwargs = {k: getattr(args, k) for k in (*options, "disable_tqdm")}
    metrics = asyncio.run(
        benchmark(args.backend, base_url, rows, model=model, tokenizer=tokenizer, **kwargs)
    )
    metrics["dataset_name"] = args.dataset_name
    print_summary(metrics)
    if args.output_file:
        record = {k: json_safe(v) for k, v in {**vars(args), **metrics}.items()}
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return metrics


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    run_benchmark(build_parser().parse_args())


if __name__ == "__main__":
    main()
