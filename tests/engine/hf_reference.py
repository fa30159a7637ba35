"""HF transformers as the oracle: greedy generation, and the near-tie rule for comparing it."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-4


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
