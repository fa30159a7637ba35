"""A mixture-of-experts decode step, side by side: the grouped expert path (`SparseMoE.forward`:
tokens sorted by expert, one GEMM pair per active expert) against the same model with its
experts run one token at a time (`SparseMoE.forward_per_token`), in one process, on one
Qwen3-MoE-shaped model with random weights.

The default shape is Qwen3-0.6B's (hidden 1024, 16 query and 8 KV heads of 128, q/k norms)
with every MLP made 8 experts of its size (intermediate 3072), top 2, over `--layers` layers
(default 4: the step time is per layer times layers, and 28 layers of 8 experts would take
~8 GB of float32 weights). Each batch size runs a prefill of `--input-len` tokens per request
and `--output-len` decode steps (`bench.bench_one_batch.run_one_batch`), first grouped, then
per token, and the median decode step of each is printed.

    python -m bench.moe_step --batch-size 1 8 32 --input-len 128 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.bench_one_batch import pool_tokens, run_one_batch
from managers.model_worker import ModelWorker
from srt.layers.moe import SparseMoE
from srt.server_args import ServerArgs


def qwen3_moe_config(layers: int, experts: int, top_k: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "moe_intermediate_size": 3072,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--result-filename", default=None, help="append one JSON line per run")
    args = p.parse_args(argv)

    folder = Path(tempfile.mkdtemp(prefix="moe-step-"))
    config = qwen3_moe_config(args.layers, args.experts, args.top_k)
    (folder / "config.json").write_text(json.dumps(config))
    server_args = ServerArgs(
        model_path=str(folder),
        load_format="dummy",
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_total_tokens=pool_tokens(max(args.batch_size), args.input_len, args.output_len, 1),
    )
    worker = ModelWorker(server_args)
    grouped = SparseMoE.forward
    print(
        f"Qwen3-MoE shape, {args.layers} layers of {args.experts} experts (top {args.top_k}), "
        f"{args.dtype}, input {args.input_len}, {args.output_len} decode steps"
    )
    print("| batch | grouped decode step | per-token decode step | speed-up |")
    print("|---|---|---|---|")
    for bs in args.batch_size:
        rows = {}
        for name, forward in (("grouped", grouped), ("per_token", SparseMoE.forward_per_token)):
            SparseMoE.forward = forward  # the baseline runs the same model, token by token
            try:
                r = run_one_batch(worker, bs, args.input_len, args.output_len, run_name=name)
            finally:
                SparseMoE.forward = grouped
            rows[name] = r
            if args.result_filename:
                with open(args.result_filename, "a") as f:
                    f.write(json.dumps({k: v for k, v in r.items() if k != "output_ids"}) + "\n")
        assert rows["grouped"]["output_ids"] == rows["per_token"]["output_ids"]
        g = rows["grouped"]["median_decode_latency"]
        t = rows["per_token"]["median_decode_latency"]
        print(f"| {bs} | {g * 1e3:.1f} ms | {t * 1e3:.1f} ms | {t / g:.2f}x |")


if __name__ == "__main__":
    main()
