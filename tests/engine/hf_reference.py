"""HF transformers as the oracle: greedy generation, and the near-tie rule for comparing it."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import torch

NEAR_TIE = 1e-4
# Prompts of the default model's HF comparisons (engine, HTTP), and how far HF generates them.
DEFAULT_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "List three primary colors:",
    "1, 2, 3, 4, 5,",
    "Translate to French: I like apples.",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Photosynthesis is the process by which plants",
]
DEFAULT_NEW_TOKENS = 64


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy tokens that never stop at EOS (the same as our ignore_eos)."""
    return hf_greedy_batch(model, [prompt], max_new_tokens)[0]


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`hf_greedy` of several prompts at once, left-padded into one batch: a decode step of 8
    rows costs about what one row's does, so the default model's reference takes seconds
    instead of a minute. Padding moves HF's float sums a little, so its tokens can differ
    from one-prompt runs only at a near-tie, which `assert_greedy_equal` accepts (it scores
    the unpadded prompt)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[:, width:].tolist()


def assert_greedy_equal(model, prompt: list[int], ours: list[int], ref: list[int]) -> None:
    """Tokens must be identical, except after a genuine float near-tie in HF's logits.

    At the first differing position, the gap between HF's top-2 logits must be below 1e-4;
    anything else is a failure.
    """
    assert len(ours) == len(ref), (len(ours), len(ref))
    for pos, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + ref[:pos]])).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        gap = float(top2[0] - top2[1])
        assert gap < NEAR_TIE, (
            f"first difference at output position {pos}: ours {a}, HF {b}, "
            f"HF top-2 logit gap {gap:.3g} is not a near-tie"
        )
        return


class DefaultModelReference:
    """HF's greedy tokens of the default model (float32) for `DEFAULT_TEXTS`, generated in one
    batch when built (or read from `shared`, see `__init__`); the model itself is loaded only
    if a comparison needs its logits (a difference to check for a near-tie)."""

    def __init__(self, model_path: str, shared: Path | None = None) -> None:
        """`shared`: a file the test workers of one run share. The first worker to get here
        generates the tokens and writes them there (under a lock beside it); the others read
        them, instead of each running HF's generation (20 s on one core)."""
        self.model_path = model_path
        self._model = None
        if shared is None:
            self.prompts, self.refs = self._generate()
            return
        with open(shared.with_name(shared.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if shared.exists():
                saved = json.loads(shared.read_text())
                assert saved["model_path"] == model_path, (saved["model_path"], model_path)
                self.prompts, self.refs = saved["prompts"], saved["refs"]
                return
            self.prompts, self.refs = self._generate()
            saved = {"model_path": model_path, "prompts": self.prompts, "refs": self.refs}
            shared.write_text(json.dumps(saved))

    def _generate(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        prompts = {text: tokenizer.encode(text) for text in DEFAULT_TEXTS}
        refs = hf_greedy_batch(self._load(), list(prompts.values()), DEFAULT_NEW_TOKENS)
        return prompts, dict(zip(DEFAULT_TEXTS, refs, strict=True))

    def _load(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()

    def assert_greedy_equal(self, text: str, ours: list[int]) -> None:
        """`ours` (at most `DEFAULT_NEW_TOKENS` greedy tokens of `text`) equals HF's prefix,
        but after a near-tie."""
        ref = self.refs[text][: len(ours)]
        if ours == ref:
            return
        if self._model is None:
            self._model = self._load()
        assert_greedy_equal(self._model, self.prompts[text], ours, ref)
