"""Cost of constrained decoding, in-process with the default model.

Output tokens/s with and without a JSON schema at each batch size (same prompts; the
unconstrained run decodes, with ignore_eos, as many tokens per request as the constrained run
produced on average), and the grammar compile time: cold (a fresh backend) and cached.

Usage: ``python -m bench.bench_grammar [--dtype bfloat16] [--batch-sizes 1 16] [--repeat 2]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from constrained.base_grammar_backend import GrammarKey
from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs

# A topic and four named facts, strings of at most 20 characters: outputs of about 100 tokens,
# long enough to time per token.
S20 = {"type": "string", "maxLength": 20}
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": S20,
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": S20, "fact": {**S20, "minLength": 10}},
                "required": ["name", "fact"],
                "additionalProperties": False,
            },
            "minItems": 4,
            "maxItems": 4,
        },
    },
    "required": ["topic", "items"],
    "additionalProperties": False,
}
TOPICS = [
    *("fruits", "cities", "animals", "colors", "sports", "planets", "tools", "rivers"),
    *("books", "songs", "flowers", "countries", "games", "birds", "metals", "painters"),
]


def prompts(driver: InProcessDriver, n: int) -> list[str]:
    asks = [
        f"Give me a JSON object with four {TOPICS[i % len(TOPICS)]}, each with a name and a "
        "short fact."
        for i in range(n)
    ]
    chat = driver.tokenizer.apply_chat_template
    return [
        chat([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True)
        for a in asks
    ]


def best_run(
    driver: InProcessDriver, texts: list[str], params: Any, repeat: int
) -> tuple[float, list[int]]:
    """(output tokens/s of the fastest of `repeat` runs, output lengths); prompts uncached."""
    best, lens = 0.0, []
    for _ in range(repeat):
        driver.scheduler.flush_cache()
        tic = time.perf_counter()
        outs = driver.generate(texts, params)
        lens = [len(o["output_ids"]) for o in outs]
        best = max(best, sum(lens) / (time.perf_counter() - tic))
    return best, lens


def throughput(driver: InProcessDriver, batch: int, repeat: int) -> dict[str, Any]:
    texts = prompts(driver, batch)
    base = {"temperature": 0.0, "max_new_tokens": 256}
    tps_c, lens = best_run(driver, texts, {**base, "json_schema": json.dumps(SCHEMA)}, repeat)
    free = {**base, "max_new_tokens": max(1, round(sum(lens) / batch)), "ignore_eos": True}
    tps_f = best_run(driver, texts, free, repeat)[0]
    # Each request its constrained length: the batch shrinks as in the constrained run, so this
    # ratio isolates the grammar's per-step cost.
    same = [{**base, "max_new_tokens": n, "ignore_eos": True} for n in lens]
    tps_same = best_run(driver, texts, same, repeat)[0]
    return {
        "batch": batch,
        "mean_output_len": sum(lens) / batch,
        "tok_s_schema": tps_c,
        "tok_s_free": tps_f,
        "tok_s_free_same_lens": tps_same,
        "schema_over_free": tps_c / tps_f,
        "schema_over_free_same_lens": tps_c / tps_same,
    }


def compile_times(driver: InProcessDriver, repeat: int) -> dict[str, float]:
    from constrained.xgrammar_backend import XGrammarBackend

    key = GrammarKey("json_schema", json.dumps(SCHEMA))
    sched = driver.scheduler
    cold, cached, init = [], [], []
    for _ in range(repeat):
        tic = time.perf_counter()
        backend = XGrammarBackend(driver.tokenizer, sched.vocab_size, sched.eos_token_ids)
        init.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        backend.compile(key)
        cold.append(time.perf_counter() - tic)
        backend.compile_async(key).result()  # now in the backend's cache
        tic = time.perf_counter()
        backend.compile_async(key).result()
        cached.append(time.perf_counter() - tic)
        backend.executor.shutdown()
    return {
        "backend_init_ms": 1e3 * statistics.median(init),
        "compile_cold_ms": 1e3 * statistics.median(cold),
        "compile_cached_ms": 1e3 * statistics.median(cached),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeat", type=int, default=2, help="runs per point; the best counts")
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    args = parser.parse_args()

    driver = InProcessDriver(ServerArgs(dtype=args.dtype, max_total_tokens=args.max_total_tokens))
    # Warm up the model, and compile the schema so no run below includes its compile.
    driver.generate(prompts(driver, 2), {"max_new_tokens": 8, "json_schema": json.dumps(SCHEMA)})
    rows = [throughput(driver, b, args.repeat) for b in args.batch_sizes]
    compiles = compile_times(driver, max(args.repeat, 3))
    driver.scheduler.check_memory()

    print(f"device {driver.scheduler.server_args.resolved_device()}, dtype {args.dtype}")
    print("tok/s. free: ignore_eos, all the mean length; free*: each its constrained length")
    print(f"{'batch':>5}{'len':>7}{'schema':>9}{'free':>9}{'ratio':>7}{'free*':>9}{'ratio*':>8}")
    for r in rows:
        print(
            f"{r['batch']:>5}{r['mean_output_len']:>7.1f}{r['tok_s_schema']:>9.1f}"
            f"{r['tok_s_free']:>9.1f}{r['schema_over_free']:>7.3f}"
            f"{r['tok_s_free_same_lens']:>9.1f}{r['schema_over_free_same_lens']:>8.3f}"
        )
    print(
        f"compile: cold {compiles['compile_cold_ms']:.2f} ms, cached "
        f"{compiles['compile_cached_ms']:.4f} ms (backend init {compiles['backend_init_ms']:.0f} ms)"
    )
    print(json.dumps({"dtype": args.dtype, "throughput": rows, **compiles}))


if __name__ == "__main__":
    main()
