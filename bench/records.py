"""Throughput fields shared by every W1 runner (ours and the peers'). Standard library only:
`bench/peers/vllm_offline.py` imports it inside the vLLM venv."""

from __future__ import annotations


def throughput_fields(num_prompts: int, n_in: int, n_out: int, seconds: float) -> dict:
    return {
        "num_prompts": num_prompts,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "seconds": round(seconds, 2),
        "output_tok_per_s": round(n_out / seconds, 1),
        "total_tok_per_s": round((n_in + n_out) / seconds, 1),
    }
