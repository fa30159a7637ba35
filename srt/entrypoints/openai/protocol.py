"""OpenAI request models (pydantic, validated); the response shapes are in `responses.py`.

Every request field is honoured, accepted as a documented no-op, or refused with a 400 that
says why, as the tables of `fields.py` say (applied by each model's `_screen_fields`); a
field in no table is unrecognized, a 400 too. Known fields are strict, as on `/generate`:
no string -> number / bool coercion, and an int field takes no float (not even 2.0). Range
checks live here so a bad value is a 400 naming its field before any tokenization; the
bounds are the constants `SamplingParams.verify` and `managers/validation.py` enforce, so
both paths accept and refuse the same values.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from managers.validation import MAX_TOP_LOGPROBS
from srt.entrypoints.openai.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    CONTENT_PART_TYPES,
    EMBEDDING_FIELDS,
    MESSAGE_FIELDS,
    RESPONSES_FIELDS,
    STREAM_OPTIONS_FIELDS,
    TEXT_PART_FIELDS,
    FieldTable,
    Treatment,
    screen,
)
from srt.sampling.sampling_params import (
    MAX_N,
    MAX_PENALTY,
    MAX_STOP_SEQUENCES,
    MAX_TEMPERATURE,
    check_stop,
)

# A request's model name is echoed in every response and chunk: a long one is refused rather
# than copied into each (a local path as the served name stays well under this).
MAX_MODEL_NAME_CHARS = 1024


class _Strict(BaseModel):
    """Known fields strictly typed; a field the model does not declare is refused. A model
    with a `field_table` first screens its input with it (no-op fields are dropped there,
    refused ones raise), so `extra="forbid"` only sees what no table names."""

    model_config = ConfigDict(extra="forbid", strict=True)

    field_table: ClassVar[FieldTable | None] = None
    top_level: ClassVar[bool] = False  # a whole request body: errors name the field itself

    @model_validator(mode="before")
    @classmethod
    def _screen_fields(cls, data: Any) -> Any:
        if cls.field_table is None:
            return data
        return screen(cls.field_table, cls.model_fields, data, nested=not cls.top_level)


class StreamOptions(_Strict):
    field_table = STREAM_OPTIONS_FIELDS

    include_usage: bool = False
    # vLLM's extra (sent by load generators): with include_usage, usage on every chunk.
    continuous_usage_stats: bool = False


class ResponseFormat(_Strict):
    """`text`, `json_object` (any JSON object), or `json_schema` with `{"schema": {...}}`."""

    type: str
    json_schema: dict[str, Any] | None = None


class SamplingRequest(_Strict):
    """Fields shared by completions and chat: OpenAI sampling plus SGLang extras."""

    top_level = True

    # Prefill/decode disaggregation, as sglang-router's PD mode sends them.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    def bootstrap(self) -> tuple[str, int, int] | None:
        if self.bootstrap_room is None or self.bootstrap_host is None:
            return None
        return (self.bootstrap_host, self.bootstrap_port or 0, self.bootstrap_room)

    # SGLang extras of admission: seconds the request may take in all, and its priority
    # (other than 0 only on a server started with --enable-priority-scheduling).
    timeout: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    priority: int | None = None

    # Any name: the one loaded model serves it (SGLang's rule); the response echoes it.
    model: str | None = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # SGLang extras of structured output, as `/generate`'s sampling params take them (at
    # most one, and not with a response_format that constrains the output).
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None  # a JSON schema, as a string
    # SGLang extras, passed through under their native names.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_PENALTY)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # checked by SamplingParams.verify
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # OpenAI: token id (a string, as JSON keys are) -> bias added to its logit, -100..100.
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_entries(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # /generate's rules (decimal token-id keys, values in [-100, 100], an entry cap);
        # the vocabulary bound is checked after, by `SamplingParams.verify`.
        from srt.sampling.sampling_params import check_logit_bias

        if value is not None:
            check_logit_bias(value)
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        is_list = isinstance(value, list) and all(isinstance(s, str) for s in value)
        if value is not None and not isinstance(value, str) and not is_list:
            raise ValueError(
                f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES} strings"
            )
        check_stop(value)  # the same count and emptiness rules as /generate
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def usage_per_chunk(self) -> bool:
        """Usage on every streamed chunk. vLLM's meaning: continuous_usage_stats counts only
        with include_usage (alone it asks for nothing)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    field_table = COMPLETION_FIELDS

    prompt: PromptField
    # OpenAI's default for the legacy completions endpoint.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        return check_prompt_shape(value, "prompt")


class EmbeddingRequest(_Strict):
    """`/v1/embeddings` (a server started with `--is-embedding`)."""

    field_table = EMBEDDING_FIELDS
    top_level = True

    model: str | None = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    input: PromptField
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        return check_prompt_shape(value, "input")


class ResponsesRequest(_Strict):
    """`/v1/responses`. `input` items and `tools` are read item by item in
    `serving_responses.py`, which says which shapes are taken."""

    field_table = RESPONSES_FIELDS
    top_level = True

    model: str | None = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None


def check_prompt_shape(value: Any, name: str) -> Any:
    """A prompt field's four shapes, checked by hand: a 4-way union's pydantic errors would
    be unreadable."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return value
        if all(_is_token_id(p) for p in value):
            return value
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
            return value
    raise ValueError(
        f"{name} must be a string, a non-empty list of strings, a non-empty list of token "
        "ids or a non-empty list of non-empty token id lists"
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class TextContentPart(_Strict):
    field_table = TEXT_PART_FIELDS

    type: Literal["text"]
    text: str


class ToolCallFunctionIn(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCallIn(_Strict):
    """A call in an earlier assistant message, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunctionIn
    # A streamed call's position, as a client that accumulated a stream sends it back: no
    # effect (the list order is the calls' order).
    index: int | None = None


class ChatMessage(_Strict):
    field_table = MESSAGE_FIELDS

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = Field(None, validate_default=True)
    # Passed to the chat template as they are (it decides what to render).
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    reasoning_content: str | None = None  # assistant messages of a reasoning model

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role") != "assistant":
            raise ValueError("content is required except for assistant messages")
        if value is None or isinstance(value, str):
            return value
        for part in value if isinstance(value, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            rule = CONTENT_PART_TYPES.get(kind) if isinstance(kind, str) else None
            if rule is not None and rule.treatment is Treatment.REFUSED:
                raise ValueError(f"content part type `{kind}`: {rule.why}")
        if isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value
        ):
            # Screened here: in the str | list union, pydantic's own error would be the
            # str member's ("should be a valid string"), not the part's field.
            fields = TextContentPart.model_fields
            return [screen(TEXT_PART_FIELDS, fields, p, nested=True) for p in value]
        raise ValueError('content must be a string or a list of {"type": "text", "text"} parts')

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingRequest):
    field_table = CHAT_FIELDS

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # SGLang extras: keyword arguments for the chat template (e.g. {"enable_thinking": false}),
    # and whether a reasoning parser splits the thinking off (on a server with one).
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
