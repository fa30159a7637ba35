"""Cold compile time of one grammar with the default model's tokenizer (xgrammar, one thread).

The grammar caps (`constrained/limits.py`) and the small-grammar thread
(`constrained/base_grammar_backend.py`) were sized with it:

    python -m bench.grammar_compile --probe deep-array 200
    python -m bench.grammar_compile --probe optional-properties 1000
    python -m bench.grammar_compile --probe regex-alternations 50
    python -m bench.grammar_compile --json-schema schema.json
    python -m bench.grammar_compile --regex '[a-z]{1,20}'

A compile cannot be interrupted; a probe too big for the machine runs until it ends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from constrained.base_grammar_backend import GrammarKey


def deep_array(n: int) -> GrammarKey:
    schema = '{"type": "integer"}'
    for _ in range(n):
        schema = '{"type": "array", "items": ' + schema + "}"
    return GrammarKey("json_schema", schema)


def optional_properties(n: int) -> GrammarKey:
    props = {f"p{i}": {"type": "string"} for i in range(n)}
    return GrammarKey("json_schema", json.dumps({"type": "object", "properties": props}))


def regex_alternations(n: int) -> GrammarKey:
    return GrammarKey("regex", "|".join(f"(x{i}[a-z]{{1,8}})" for i in range(n)))


PROBES: dict[str, Callable[[int], GrammarKey]] = {
    "deep-array": deep_array,
    "optional-properties": optional_properties,
    "regex-alternations": regex_alternations,
}


def grammar_key(args: argparse.Namespace) -> GrammarKey:
    if args.probe is not None:
        name, size = args.probe
        return PROBES[name](int(size))
    if args.json_schema is not None:
        return GrammarKey("json_schema", Path(args.json_schema).read_text())
    return GrammarKey("regex", args.regex)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--probe", nargs=2, metavar=("KIND", "SIZE"), help=", ".join(PROBES))
    what.add_argument("--json-schema", metavar="FILE")
    what.add_argument("--regex")
    p.add_argument("--repeat", type=int, default=3, help="compiles; the median is printed")
    args = p.parse_args(argv)
    if args.probe is not None and args.probe[0] not in PROBES:
        p.error(f"--probe: KIND is one of {', '.join(PROBES)}")
    key = grammar_key(args)

    from constrained.xgrammar_backend import XGrammarBackend
    from srt.configs.model_config import ModelConfig
    from srt.model_loader.sources import get_tokenizer

    cfg = ModelConfig.from_path(None)
    backend = XGrammarBackend(get_tokenizer(cfg.model_path), cfg.vocab_size, cfg.eos_token_ids)
    times = []
    for _ in range(args.repeat):
        tic = time.perf_counter()
        backend.compile(key)  # the backend keeps no cache of its own: each is cold
        times.append(time.perf_counter() - tic)
    backend.shutdown()
    size = len(key.spec.encode())
    print(f"{key.kind}, {size} bytes: median {statistics.median(times):.3f} s of {args.repeat}")


if __name__ == "__main__":
    main()
