"""Accuracy of the weights kept quantized (`--quantization`), measured on the default model:
perplexity of a text, and greedy agreement with float32.

    python -m bench.quant_accuracy --out bench/results/quant-accuracy.json
    python -m bench.quant_accuracy --llama-perplexity ~/llama.cpp/build/bin/llama-perplexity

Perplexity is computed as llama.cpp's `llama-perplexity` computes it, so the two compare:
the text's tokens cut into chunks of `--ctx` tokens, each chunk run on its own, and only the
second half of each chunk scored (every scored token sees at least ctx / 2 tokens before
it); PPL = exp(mean negative log-likelihood). The text defaults to Newton's *Opticks*, which
xgrammar's dependency apache-tvm-ffi ships (in libbacktrace's test data): public domain, on
every machine this project installs on, and unlike the prompts of the tests.

Greedy agreement: `--prompts` windows of the same text (`--prompt-tokens` each, after the
scored chunks), `--new-tokens` greedy tokens each, against float32's tokens: the share of
sequences identical throughout, and the mean share of tokens before the first difference.

With `--llama-perplexity`, llama.cpp's own tool runs on the same GGUF file and text, with the
same context and chunk count (its tokenizer, the file's; a float32 GGUF of the same weights
for its float32 row, when `--f32-gguf` names one).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from managers.inprocess import InProcessDriver
from srt.model_loader.default_model import find_default_gguf
from srt.server_args import ServerArgs


def default_text() -> Path:
    import tvm_ffi

    path = Path(tvm_ffi.__file__).parent / "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not there: give --text")
    return path


def driver_for(quantization: str, model: str | None) -> InProcessDriver:
    args = ServerArgs(
        model_path=model,
        dtype="float32",
        quantization=quantization,
        max_total_tokens=16384,
        max_prefill_tokens=4096,
        chunked_prefill_size=4096,
    )
    return InProcessDriver(args)


def perplexity(driver: InProcessDriver, tokens: list[int], ctx: int, chunks: int) -> float:
    """llama-perplexity's estimate over the first `chunks` chunks of `ctx` tokens."""
    prompts = [tokens[i * ctx : (i + 1) * ctx] for i in range(chunks)]
    first = ctx // 2
    outs = driver.generate(
        prompts, {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=first
    )
    nll, count = 0.0, 0
    for out in outs:
        scored = [lp for lp, *_ in out["meta_info"]["input_token_logprobs"] if lp is not None]
        assert len(scored) == ctx - first, len(scored)
        nll -= sum(scored)
        count += len(scored)
    return math.exp(nll / count)


def greedy(driver: InProcessDriver, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    return [out["output_ids"] for out in driver.generate(prompts, params)]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict[str, float]:
    same_prefix = []
    for a, b in zip(ours, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        same_prefix.append(n / len(b))
    return {
        "identical_sequences": sum(p == 1.0 for p in same_prefix) / len(same_prefix),
        "mean_prefix_share": sum(same_prefix) / len(same_prefix),
    }


def llama_cpp_perplexity(binary: str, gguf: Path, text: Path, ctx: int, chunks: int) -> float:
    cmd = [binary, "-m", str(gguf), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks)]
    cmd += ["-t", "2", "-b", str(ctx)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    if match is None:
        raise RuntimeError(f"no estimate in llama-perplexity's output:\n{result.stderr[-2000:]}")
    return float(match.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a .gguf file; default: the default model")
    p.add_argument("--text", type=Path, help="default: Newton's Opticks (see above)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=40)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--methods", nargs="+", default=["none", "int8", "gguf"])
    p.add_argument("--llama-perplexity", help="llama.cpp's llama-perplexity binary")
    p.add_argument("--f32-gguf", type=Path, help="a float32 GGUF of the model, for llama.cpp")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    text_path = args.text or default_text()
    gguf = Path(args.model) if args.model else find_default_gguf()
    report: dict[str, Any] = {"model": gguf.name, "text": text_path.name, "ctx": args.ctx}
    report["chunks"] = args.chunks
    results: dict[str, dict[str, Any]] = {}
    reference: list[list[int]] | None = None
    for method in args.methods:
        start = time.perf_counter()
        driver = driver_for(method, str(gguf))
        tokens = driver.tokenizer.encode(text_path.read_text())
        need = args.ctx * args.chunks + args.prompts * args.prompt_tokens
        if len(tokens) < need:
            raise ValueError(f"the text has {len(tokens)} tokens; these settings need {need}")
        ppl = perplexity(driver, tokens, args.ctx, args.chunks)
        rest = tokens[args.ctx * args.chunks :]
        prompts = [
            rest[i * args.prompt_tokens : (i + 1) * args.prompt_tokens] for i in range(args.prompts)
        ]
        outs = greedy(driver, prompts, args.new_tokens)
        if reference is None:
            reference = outs
        results[method] = {
            "perplexity": round(ppl, 4),
            **agreement(outs, reference),
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(method, results[method], flush=True)
    if "none" in results:
        base = results["none"]["perplexity"]
        for r in results.values():
            r["ppl_vs_float32"] = round(r["perplexity"] / base - 1, 5)
    report["radixrt"] = results
    if args.llama_perplexity:
        peer = {
            "Q4_1": llama_cpp_perplexity(
                args.llama_perplexity, gguf, text_path, args.ctx, args.chunks
            )
        }
        if args.f32_gguf:
            peer["F32"] = llama_cpp_perplexity(
                args.llama_perplexity, args.f32_gguf, text_path, args.ctx, args.chunks
            )
        report["llama_cpp"] = peer
        print("llama.cpp", peer, flush=True)
        if "gguf" in results:
            report["radixrt_gguf_vs_llama_cpp"] = round(
                results["gguf"]["perplexity"] / peer["Q4_1"] - 1, 5
            )
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
