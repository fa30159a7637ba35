"""Request validation, in one place: the tokenizer manager (HTTP and `Engine`), the
`InProcessDriver` and the scheduler all check prompts and sampling parameters here, so a
limit cannot differ between entry points. Failures raise `RequestError` (a 400).

The sampling limits themselves (`MAX_TEMPERATURE`, `MAX_N`, ...) live beside the fields
they bound, in `srt/sampling/sampling_params.py`; the OpenAI request models
(`srt/entrypoints/openai/protocol.py`) declare the same constants, so they refuse a value
before tokenizing exactly when this module would refuse it afterwards."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from constrained.limits import GrammarLimitError, GrammarLimits, check_grammar_limits
from managers.errors import RequestError
from managers.io_struct import GenerateReqInput
from srt.sampling.sampling_params import InvalidSamplingParam, SamplingParams

if TYPE_CHECKING:
    from srt.server_args import ServerArgs

MAX_TOP_LOGPROBS = 20


def check_token_ids(input_ids: list[int], vocab_size: int) -> None:
    if any(t < 0 or t >= vocab_size for t in input_ids):
        raise RequestError(f"Input token ids must be in [0, {vocab_size}).", param="input_ids")


def check_prompt(input_ids: list[int], context_len: int, vocab_size: int) -> None:
    """A prompt the model can take: non-empty, known token ids, shorter than the context."""
    check_token_ids(input_ids, vocab_size)
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


def grammar_limits(server_args: Any) -> GrammarLimits:
    """`--grammar-max-schema-bytes`, `--grammar-max-depth` and `--grammar-max-properties`."""
    return GrammarLimits.from_server_args(server_args)


def check_grammar(params: SamplingParams, limits: GrammarLimits) -> None:
    """The grammar caps (`constrained/limits.py`), here so that a client gets its 400 before
    the request reaches the scheduler; the scheduler applies them again before compiling."""
    for field in ("json_schema", "regex", "ebnf"):
        spec = getattr(params, field)
        if isinstance(spec, str):
            try:
                check_grammar_limits(field, spec, limits)
            except GrammarLimitError as e:
                raise RequestError(e.message, param=e.field) from None


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


def check_batch_size(num_prompts: int, num_sequences: int, limit: int, prompt_field: str) -> None:
    """The one limit (`--max-batch-size`) on the sequences a request creates: its prompts
    times their n, on every route. Over it: a 400 naming the field to shrink."""
    if num_sequences <= limit:
        return
    raise RequestError(
        f"This request would run {num_sequences} sequences ({num_prompts} prompt(s) times n); "
        f"this server runs at most {limit} per request (--max-batch-size).",
        param=prompt_field if num_prompts > limit else "n",
    )


def prepare_prompt(
    obj: GenerateReqInput,
    tokenizer: Any,
    context_len: int,
    vocab_size: int,
    max_batch_size: int,
    grammar_limits: GrammarLimits | None = None,
) -> tuple[list[int], SamplingParams]:
    """One prompt of a native request: its token ids and checked sampling parameters."""
    if (obj.text is None) == (obj.input_ids is None):
        raise RequestError("Give exactly one of `text` and `input_ids`.", param="text")
    if obj.text is not None:
        if not isinstance(obj.text, str):
            raise RequestError("`text` must be a string or a list of strings.", param="text")
        if tokenizer is None:
            raise RequestError("This server has no tokenizer; send `input_ids`.", "text")
        input_ids = tokenizer.encode(obj.text)
    else:
        input_ids = obj.input_ids
        if not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            raise RequestError("`input_ids` must be a list of integers.", param="input_ids")
    check_prompt(input_ids, context_len, vocab_size)
    params = parse_sampling_params(obj.sampling_params, vocab_size)
    if tokenizer is None and params.stop_regex:
        # Matched against decoded text: without a tokenizer it could never apply.
        raise RequestError(
            "`stop_regex` needs the server's tokenizer (this one runs with --skip-tokenizer-init).",
            param="stop_regex",
        )
    if grammar_limits is not None:
        check_grammar(params, grammar_limits)
    check_batch_size(1, params.n, max_batch_size, "n")
    fit_max_new_tokens(len(input_ids), params, context_len)
    if obj.return_logprob:
        check_logprob_args(obj.logprob_start_len, obj.top_logprobs_num, len(input_ids))
    return list(input_ids), params


# Chat templates shipped with RadixRT, by name (`--chat-template smollm2-tools`).
CHAT_TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "srt" / "chat_templates"


def load_chat_template(spec: str | None) -> str | None:
    """`--chat-template`: a shipped template's name, a path to a Jinja file, or the template
    text itself."""
    if spec is None:
        return None
    shipped = CHAT_TEMPLATES_DIR / f"{spec}.jinja"
    if "/" not in spec and shipped.is_file():
        return shipped.read_text()
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text()
    if "{%" in spec or "{{" in spec:
        return spec
    names = sorted(p.stem for p in CHAT_TEMPLATES_DIR.glob("*.jinja"))
    raise FileNotFoundError(
        f"--chat-template {spec!r} is neither a shipped template ({', '.join(names)}), a file "
        "nor a Jinja template"
    )


def embedding_mismatch(embedding_server: bool) -> str:
    """The refusal of a generation request on an embedding server, or the reverse."""
    if embedding_server:
        return (
            "This server serves embeddings (--is-embedding): use /v1/embeddings or /encode; "
            "it generates no text."
        )
    return "This server generates text: start it with --is-embedding to serve embeddings."


def check_admission_fields(obj: GenerateReqInput, server_args: ServerArgs) -> None:
    """The request suits the server's mode (generation or `--is-embedding`); `timeout` is a
    number of seconds > 0; `priority` an integer, and other than 0 only on a server that
    schedules by it (a field that would change nothing is refused)."""
    if (obj.embed is not None) != server_args.is_embedding:
        raise RequestError(embedding_mismatch(server_args.is_embedding))
    timeout = obj.timeout
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise RequestError("`timeout` must be a number of seconds > 0.", "timeout")
    priority = obj.priority
    if priority is None:
        return
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestError("`priority` must be an integer.", "priority")
    if priority != 0 and not server_args.enable_priority_scheduling:
        raise RequestError(
            "`priority` needs a server started with --enable-priority-scheduling.", "priority"
        )
