"""Speculative decoding against plain decoding, side by side in one run, in-process.

Workloads (both on the default model unless `--model-path`):
- `copy`: a chat turn asking to repeat a paragraph with one word changed ("Repeat this text
  exactly, changing 'five' to 'six'"): the answer quotes its prompt, as code edits, RAG
  answers and summaries quoting their sources do. 8 paragraphs x 4 changes = 32 prompts,
  greedy, up to 160 new tokens, stopping at EOS.
- `w1`: W1's prompts (random ids, 64-512 tokens, 128 new tokens, ignore_eos, greedy). Nothing
  in them is worth copying, but the default model falls into repeating itself on random ids,
  so drafts are accepted here too.
- `w1-sampled`: the same prompts sampled (temperature 1, seeded): the output rarely repeats,
  drafts rarely match, and the controller must keep speculation from costing anything.

Each (workload, concurrency) runs plain decoding and each `--algorithm`, alternating over
`--repeats` rounds so that drift hits all alike; `--concurrency C` keeps C requests in flight
(a new one starts when one finishes). Reported: output tokens/s, the ratio to plain, and the
accept length (tokens a request gains per verify step). Outputs are compared too: speculation
must give plain decoding's tokens (seeded sampling draws the same tokens too).

    python -m bench.spec_decode --concurrency 1 16 --repeats 2 --out bench/results/spec.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any

from bench.bench_offline import w1_prompts
from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs

PARAGRAPHS = [
    (
        "The library opens at nine in the morning and closes at six in the evening. Members may "
        "borrow up to five books at a time for three weeks, and renew them twice online."
    ),
    (
        "Our team meets every Monday at ten to plan the week. Each person shares what they "
        "finished, what they will work on next, and anything that blocks them."
    ),
    (
        "To reset the router, hold the small button on the back for ten seconds until the green "
        "light blinks. Wait two minutes, then connect again with the password on the label."
    ),
    (
        "The bakery on Main Street sells fresh bread every morning. Its sourdough sells out by "
        "noon, so regular customers call ahead to reserve a loaf for the afternoon."
    ),
    (
        "Please submit the report by Friday. It should include the sales figures for March, a "
        "short summary of the new customers, and the plan for the next quarter."
    ),
    (
        "The hiking trail is eight miles long and climbs about two thousand feet. Bring plenty "
        "of water, wear sturdy shoes, and start early to avoid the afternoon heat."
    ),
    (
        "The museum offers free guided tours on Saturdays at eleven. Tours last about an hour "
        "and cover the main hall, the sculpture garden and the new photography wing."
    ),
    (
        "Water the tomato plants every other day in summer, early in the morning. Add compost "
        "once a month, and pinch off the side shoots so the main stem grows strong."
    ),
]
CHANGES = [
    ("five", "six"),
    ("every", "each"),
    ("morning", "evening"),
    ("and", "plus"),
]


def copy_prompts(tokenizer: Any) -> list[list[int]]:
    prompts = []
    for old, new in CHANGES:
        for text in PARAGRAPHS:
            ask = f"Repeat this text exactly, changing '{old}' to '{new}':\n\n{text}"
            messages = [{"role": "user", "content": ask}]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            prompts.append(tokenizer.encode(text))
    return prompts


def run(
    driver: InProcessDriver, prompts: list[list[int]], params: dict, concurrency: int
) -> tuple[float, int, list[list[int]]]:
    """(seconds, output tokens, outputs) with `concurrency` requests in flight."""
    queue = list(enumerate(prompts))
    live: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    start = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            i, prompt = queue.pop(0)
            [rid] = driver.submit(prompt, dict(params))
            live[rid] = i
        driver.step()
        for rid in [r for r in live if driver.outputs[r]["meta_info"].get("finish_reason")]:
            outputs[live.pop(rid)] = driver.result(rid)["output_ids"]
    seconds = time.perf_counter() - start
    driver.run_until_idle()  # one more step drops the finished requests from the batch
    ordered = [outputs[i] for i in range(len(prompts))]
    return seconds, sum(map(len, ordered)), ordered


def run_vllm(
    args: argparse.Namespace, prompts: list[list[int]], params: dict, name: str, concurrency: int
) -> list[dict]:
    """vLLM-CPU on the same prompt ids, without and with its n-gram speculation, given both
    cores (`VLLM_CPU_OMP_THREADS_BIND=0-1`)."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from srt.model_loader.sources import resolve_model_path

    script = Path(__file__).resolve().parent / "peers" / "vllm_spec.py"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    rows, rates = [], {}
    for ngram in (False, True):
        cmd = [
            str(Path(args.vllm_venv) / "bin" / "python"),
            str(script),
            "--model",
            resolve_model_path(None),
            "--prompts",
            f.name,
            "--dtype",
            args.vllm_dtype,
            "--concurrency",
            str(concurrency),
            "--max-tokens",
            str(params["max_new_tokens"]),
            "--num-draft-tokens",
            str(args.num_draft_tokens),
        ]
        cmd += ["--ignore-eos"] if params.get("ignore_eos") else []
        cmd += ["--ngram"] if ngram else []
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        label = "vllm-ngram" if ngram else "vllm-off"
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            row = {"workload": name, "concurrency": concurrency, "speculation": label}
            row["error"] = " | ".join(tail)
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
            continue
        out = json.loads(lines[-1])
        rates[label] = out["output_tok_s"]
        row = {
            "workload": name,
            "concurrency": concurrency,
            "speculation": label,
            "output_tok_s": out["output_tok_s"],
            "vs_off": round(out["output_tok_s"] / rates["vllm-off"], 3)
            if "vllm-off" in rates
            else None,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument(
        "--workload", nargs="+", default=["copy", "w1"], choices=["copy", "w1", "w1-sampled"]
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--algorithm", nargs="+", default=["ngram", "suffix"])
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--w1-prompts", type=int, default=32)
    p.add_argument(
        "--max-prompts", type=int, default=None, help="the first N prompts of each workload only"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="instead of each workload's own"
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None, help="write the results as JSON")
    p.add_argument(
        "--vllm-venv", default=None, help="also run vLLM-CPU off / ngram (bench/peers/vllm_spec.py)"
    )
    p.add_argument("--vllm-dtype", default="float32")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    base = {"model_path": args.model_path, "dtype": args.dtype, "quantization": args.quantization}
    from managers.model_worker import ModelWorker

    worker = ModelWorker(ServerArgs(**base, max_total_tokens=65536))

    def driver(algorithm: str | None) -> InProcessDriver:
        return InProcessDriver(
            ServerArgs(
                **base,
                max_total_tokens=65536,
                speculative_algorithm=algorithm,
                speculative_num_draft_tokens=args.num_draft_tokens,
            ),
            worker=worker,
        )

    tokenizer = driver(None).tokenizer
    workloads = {
        "copy": (copy_prompts(tokenizer), {"max_new_tokens": 160, "temperature": 0}),
        "w1": (
            w1_prompts(args.w1_prompts, 64, 512, worker.model_config.vocab_size, seed=0),
            {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True},
        ),
    }
    workloads["w1-sampled"] = (
        workloads["w1"][0],
        {**workloads["w1"][1], "temperature": 1.0, "seed": 0},
    )
    warm = driver(None)
    warm.generate([workloads["copy"][0][0]], {"max_new_tokens": 8})
    warm.scheduler.flush_cache()
    results = []
    for name in args.workload:
        prompts, params = workloads[name]
        prompts = prompts[: args.max_prompts]
        if args.max_new_tokens is not None:
            params = {**params, "max_new_tokens": args.max_new_tokens}
        for concurrency in args.concurrency:
            rates: dict[str, list[float]] = {}
            accept: dict[str, float] = {}
            same = True
            for _ in range(args.repeats):
                reference = None
                for algorithm in [None, *args.algorithm]:
                    d = driver(algorithm)
                    seconds, tokens, outs = run(d, prompts, params, concurrency)
                    label = algorithm or "off"
                    rates.setdefault(label, []).append(tokens / seconds)
                    if algorithm is None:
                        reference = outs
                    else:
                        same &= outs == reference
                        accept[label] = d.scheduler.output.spec.accept_length()
                    assert d.scheduler.flush_cache()
            off = statistics.median(rates["off"])
            for label, values in rates.items():
                rate = statistics.median(values)
                row = {
                    "workload": name,
                    "concurrency": concurrency,
                    "speculation": label,
                    "output_tok_s": round(rate, 2),
                    "vs_off": round(rate / off, 3),
                    "accept_length": round(accept[label], 2) if label in accept else None,
                    "runs": [round(v, 2) for v in values],
                    "same_tokens_as_off": same,
                }
                results.append(row)
                print(json.dumps(row), flush=True)
            print(f"# {name} c={concurrency}: outputs equal to plain decoding: {same}")
            if args.vllm_venv and params["temperature"] == 0:  # the peer script is greedy
                results += run_vllm(args, prompts, params, name, concurrency)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
