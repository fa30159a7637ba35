"""Request validation, in one place: the tokenizer manager (HTTP and `Engine`), the
`InProcessDriver` and the scheduler all check prompts and sampling parameters here, so a
limit cannot differ between entry points. Failures raise `RequestError` (a 400).

The sampling limits themselves (`MAX_TEMPERATURE`, `MAX_N`, ...) live beside the fields
they bound, in `srt/sampling/sampling_params.py`; the OpenAI request models
(`srt/entrypoints/openai/protocol.py`) declare the same constants, so they refuse a value
before tokenizing exactly when this module would refuse it afterwards."""

from __future__ import annotations

from typing import Any

from managers.errors import RequestError
from srt.sampling.sampling_params import InvalidSamplingParam, SamplingParams

MAX_TOP_LOGPROBS = 20


def check_prompt(input_ids: list[int], context_len: int, vocab_size: int) -> None:
    """A prompt the model can take: non-empty, known token ids, shorter than the context."""
    if any(t < 0 or t >= vocab_size for t in input_ids):
        raise RequestError(f"Input token ids must be in [0, {vocab_size}).", param="input_ids")
    if not input_ids:
        raise RequestError("The input is empty.", param="text")
    if len(input_ids) >= context_len:
        raise RequestError(
            f"The input ({len(input_ids)} tokens) is longer than the model's context length "
            f"({context_len} tokens).",
            param="input_ids",
        )


def check_sampling_params(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """Canonicalise and verify `params` in place; return them."""
    try:
        params.check_types()  # before normalize(), which assumes the types
        params.normalize()
        params.verify(vocab_size)
    except InvalidSamplingParam as e:
        raise RequestError(str(e), param=e.param) from None
    return params


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """`sampling_params` as a client sent it (a JSON object or None), checked."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError("`sampling_params` must be an object.", param="sampling_params")
    return check_sampling_params(SamplingParams.from_dict(raw), vocab_size)


def fit_max_new_tokens(prompt_len: int, params: SamplingParams, context_len: int) -> None:
    """Default `max_new_tokens` to what the context leaves; refuse more than that."""
    if params.max_new_tokens is None:
        params.max_new_tokens = context_len - prompt_len
    elif prompt_len + params.max_new_tokens > context_len:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_len} tokens. You requested a total of "
            f"{prompt_len + params.max_new_tokens} tokens: {prompt_len} tokens from the "
            f"input and {params.max_new_tokens} tokens for the completion. Reduce the "
            "input or the requested completion length.",
            param="max_new_tokens",
        )


def check_logprob_args(logprob_start_len: Any, top_logprobs_num: Any, prompt_len: int) -> None:
    if not isinstance(logprob_start_len, int):
        raise RequestError("`logprob_start_len` must be an integer.", "logprob_start_len")
    if not -1 <= logprob_start_len < prompt_len:
        raise RequestError(
            f"`logprob_start_len` must be in [-1, {prompt_len}), got {logprob_start_len}.",
            param="logprob_start_len",
        )
    if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"`top_logprobs_num` must be an integer in [0, {MAX_TOP_LOGPROBS}].",
            param="top_logprobs_num",
        )
