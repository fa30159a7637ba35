"""Workloads for `bench.bench_serving`: random text, random ids, generated shared prefix and
ShareGPT. Each builder returns `DatasetRow`s; lengths are counted with the target tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

DATASETS = ("random", "random-ids", "generated-shared-prefix", "sharegpt")
# ShareGPT filters, as in SGLang's bench_serving: drop very short or very long conversations.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
# Re-encoding decoded random ids drifts by a token or two; a few rounds of trim/extend settle it.
EXACT_LEN_ROUNDS = 20


@dataclass(slots=True)
class DatasetRow:
    prompt: str | list[int]  # text, or token ids for the native backends
    prompt_len: int
    output_len: int
    group: int | None = None  # shared-prefix group, for generated-shared-prefix


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def ordinary_token_ids(tokenizer: Any) -> list[int]:
    """Vocabulary ids that are not special tokens: random prompts draw from these."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def random_text(tokenizer: Any, num_tokens: int, rng: random.Random, vocab: list[int]) -> str:
    """Text of random tokens that re-encodes to exactly `num_tokens` tokens.

    Decoding random ids and encoding the text again merges or splits a few tokens, so trim
    or extend the re-encoded ids and repeat until the count holds.
    """
    if num_tokens <= 0:
        return ""
    ids = rng.choices(vocab, k=num_tokens)
    for _ in range(EXACT_LEN_ROUNDS):
        text = tokenizer.decode(ids)
        ids = encode(tokenizer, text)
        if len(ids) == num_tokens:
            return text
        ids = ids[:num_tokens] + rng.choices(vocab, k=max(0, num_tokens - len(ids)))
    raise RuntimeError(f"could not build random text of exactly {num_tokens} tokens")


def uniform_lens(full: int, ratio: float, num: int, rng: random.Random) -> list[int]:
    """`num` lengths uniform in [full * ratio, full], at least 1 (SGLang's `random`)."""
    low = max(int(full * ratio), 1)
    return [rng.randint(low, max(full, low)) for _ in range(num)]


def sample_random(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    as_ids: bool = False,
) -> list[DatasetRow]:
    """Prompts of random tokens; with `as_ids` the ids themselves are sent (native only)."""
    rng = random.Random(seed)
    vocab = ordinary_token_ids(tokenizer)
    in_lens = uniform_lens(input_len, range_ratio, num_prompts, rng)
    out_lens = uniform_lens(output_len, range_ratio, num_prompts, rng)
    rows = []
    for n_in, n_out in zip(in_lens, out_lens):
        prompt: str | list[int]
        prompt = rng.choices(vocab, k=n_in) if as_ids else random_text(tokenizer, n_in, rng, vocab)
        rows.append(DatasetRow(prompt, n_in, n_out))
    return rows


def seamless_question(
    tokenizer: Any, system: str, question_len: int, rng: random.Random, vocab: list[int]
) -> str:
    """A random question that leaves the system prompt's tokens intact when appended.

    Tokens can merge across the seam of two texts; redraw until they do not, so the prompt
    has exactly system + question tokens and its group's system tokens as a prefix.
    """
    system_ids = encode(tokenizer, system)
    for _ in range(EXACT_LEN_ROUNDS):
        question = random_text(tokenizer, question_len, rng, vocab)
        ids = encode(tokenizer, system + question)
        if len(ids) == len(system_ids) + question_len and ids[: len(system_ids)] == system_ids:
            return question
    raise RuntimeError("could not build a question that keeps the system prompt's tokens")


def sample_generated_shared_prefix(
    tokenizer: Any,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[DatasetRow]:
    """Per group one random system prompt shared by `prompts_per_group` random questions.

    Every prompt has exactly `system_prompt_len + question_len` tokens, the first ones its
    group's system prompt. All prompts are shuffled with the seed, so that the members of a
    group arrive interleaved with other groups.
    """
    rng = random.Random(seed)
    vocab = ordinary_token_ids(tokenizer)
    rows = []
    for group in range(num_groups):
        system = random_text(tokenizer, system_prompt_len, rng, vocab)
        for _ in range(prompts_per_group):
            question = seamless_question(tokenizer, system, question_len, rng, vocab)
            prompt_len = system_prompt_len + question_len
            rows.append(DatasetRow(system + question, prompt_len, output_len, group))
    rng.shuffle(rows)
    return rows


def first_turns(conversation: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The first human turn and the first gpt turn after it, or None."""
    human = next((i for i, t in enumerate(conversation) if t.get("from") == "human"), None)
    if human is None:
        return None
    reply = next((t for t in conversation[human + 1 :] if t.get("from") == "gpt"), None)
    if reply is None:
        return None
    return conversation[human]["value"], reply["value"]


def sample_sharegpt(
    tokenizer: Any,
    path: str,
    num_prompts: int,
    output_len: int | None,
    seed: int,
) -> list[DatasetRow]:
    """`num_prompts` conversations of a ShareGPT JSON file, shuffled with the seed."""
    with open(path) as f:
        data = json.load(f)
    pairs = [p for entry in data if (p := first_turns(entry.get("conversations", [])))]
    random.Random(seed).shuffle(pairs)
    rows: list[DatasetRow] = []
    for prompt, completion in pairs:
        if len(rows) == num_prompts:
            break
        prompt_len = len(encode(tokenizer, prompt))
        out_len = output_len if output_len is not None else len(encode(tokenizer, completion))
        too_short = prompt_len < SHAREGPT_MIN_LEN or out_len < SHAREGPT_MIN_LEN
        too_long = (
            prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + out_len > SHAREGPT_MAX_TOTAL_LEN
        )
        if not (too_short or too_long):
            rows.append(DatasetRow(prompt, prompt_len, out_len))
    return rows


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", choices=DATASETS, default="random")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--sharegpt-output-len", type=int, default=None)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--gsp-num-groups", type=int, default=64)
    parser.add_argument("--gsp-prompts-per-group", type=int, default=16)
    parser.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    parser.add_argument("--gsp-question-len", type=int, default=128)
    parser.add_argument("--gsp-output-len", type=int, default=256)


def build_dataset(args: argparse.Namespace, tokenizer: Any) -> list[DatasetRow]:
    """The rows that the parsed flags ask for."""
    name = args.dataset_name
    if name in ("random", "random-ids"):
        return sample_random(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
            as_ids=name == "random-ids",
        )
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix(
            tokenizer,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            args.seed,
        )
    if name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        return sample_sharegpt(
            tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed
        )
    raise ValueError(f"unknown dataset {name!r}")


def server_json(base_url: str, path: str) -> dict[str, Any] | None:
    """GET `path` of the server as JSON, or None when it fails."""
    try:
        resp = requests.get(base_url + path, timeout=10)
        return resp.json() if resp.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def load_tokenizer(path: str | None, base_url: str) -> Any:
    """`path` (a local folder), else the server's tokenizer as /get_model_info names it."""
    from transformers import AutoTokenizer

    from srt.model_loader.sources import resolve_model_path
    from srt.server_args import DEFAULT_MODEL_NAME

    if path is None:
        info = server_json(base_url, "/get_model_info") or {}
        path = info.get("tokenizer_path") or info.get("model_path")
    if not path:
        raise SystemExit("no tokenizer: pass --tokenizer (the server did not name one)")
    if path == DEFAULT_MODEL_NAME and not Path(path).exists():
        # Servers name their model, not its local folder: this one is the bundled default.
        path = resolve_model_path(None)
    local = Path(path)
    if local.suffix == ".gguf" and local.is_file():
        return AutoTokenizer.from_pretrained(local.parent, gguf_file=local.name)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
