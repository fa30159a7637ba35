"""What a chat request's `tools`, `tool_choice` and reasoning settings mean for its prompt,
its sampling params and the reading of its output.

`ToolUse.from_request` checks the request against the server (`--tool-call-parser`,
`--reasoning-parser`) and decides once, before anything is generated:

- `tool_choice="none"`: the tools are not shown to the model and no call is read;
- `"auto"` (the default when there are tools): the template shows the tools and the server's
  tool-call parser reads calls out of free text; without a parser this is a 400, since the
  calls would come back as plain text;
- `"required"` or a named function: a JSON-schema grammar forces the output to be calls of
  the request's tools (`srt/function_call/forced.py`), read by `ForcedToolCallParser`, with
  or without a parser. The reasoning parser is off for such requests: the grammar leaves no
  room for thinking.

`ChoiceReader` then reads one choice's output, delta by delta: reasoning first (when
separated), then tool calls out of what remains.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from managers.errors import RequestError
from srt.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from srt.entrypoints.openai.responses import DeltaToolCall, FunctionCallOut
from srt.entrypoints.openai.serving_utils import json_schema_source
from srt.function_call import (
    TOOL_PARSERS,
    ForcedToolCallParser,
    ToolCallDelta,
    ToolCallParser,
    ToolSpec,
    tool_choice_schema,
)
from srt.reasoning_parser import REASONING_PARSERS, ReasoningParser

# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# Keyword arguments of `apply_chat_template` a request may not set through
# `chat_template_kwargs`: the server sets them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True, slots=True)
class ServerToolConfig:
    """The server's side: `--tool-call-parser` and `--reasoning-parser` (None when unset)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass(slots=True)
class ToolUse:
    template_tools: list[dict[str, Any]] | None  # what the chat template is given
    specs: list[ToolSpec] = field(default_factory=list)
    parser: str | None = None  # the model-format parser reading calls (tool_choice auto)
    forced: bool = False  # a grammar forces the calls: tool_choice required or a named one
    named: str | None = None  # the function a named tool_choice forces
    reasoning: str | None = None  # the reasoning parser, when reasoning is separated

    @classmethod
    def from_request(cls, req: ChatCompletionRequest, server: ServerToolConfig) -> ToolUse:
        reasoning = server.reasoning_parser if req.separate_reasoning else None
        choice = req.tool_choice
        if not req.tools:
            if choice is not None and choice != "none":
                raise RequestError("tool_choice needs a non-empty list of tools", "tool_choice")
            return cls(template_tools=None, reasoning=reasoning)
        specs = _tool_specs(req)
        template_tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
        if choice == "none":
            return cls(template_tools=None, reasoning=reasoning)
        if isinstance(choice, NamedToolChoice) or choice == "required":
            named = choice.function.name if isinstance(choice, NamedToolChoice) else None
            if named is not None and named not in {s.name for s in specs}:
                raise RequestError(
                    f"tool_choice names `{named}`, which is not in tools", "tool_choice"
                )
            _check_no_other_grammar(req)
            return cls(template_tools=template_tools, specs=specs, forced=True, named=named)
        if server.tool_call_parser is None:
            raise RequestError(
                "tool_choice auto (the default when tools are given) needs a server started "
                "with --tool-call-parser; use tool_choice required or a named function, or "
                '"none"',
                "tool_choice" if choice is not None else "tools",
            )
        return cls(
            template_tools=template_tools,
            specs=specs,
            parser=server.tool_call_parser,
            reasoning=reasoning,
        )

    def apply(self, params: dict[str, Any], parallel: bool) -> None:
        """Sampling params for the reading: the forcing grammar; special tokens kept where
        the parser's markers are special tokens."""
        if self.forced:
            schema = tool_choice_schema(self.specs, self.named, parallel)
            params["json_schema"] = json.dumps(schema)
        elif self.parser is not None and TOOL_PARSERS.get(self.parser).needs_special_tokens:
            params["skip_special_tokens"] = False

    def schema_source(self, req: ChatCompletionRequest) -> str:
        """The request field a grammar refusal names: `tools` when they built it."""
        return "tools" if self.forced else json_schema_source(req)

    def reader(self) -> ChoiceReader:
        tools: ToolCallParser | None = None
        if self.forced:
            tools = ForcedToolCallParser(self.specs, self.named)
        elif self.parser is not None:
            tools = TOOL_PARSERS.create(self.parser, self.specs)
        reasoning = REASONING_PARSERS.create(self.reasoning) if self.reasoning else None
        return ChoiceReader(reasoning, tools)


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise RequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets it",
            "chat_template_kwargs",
        )
    return kwargs


def _tool_specs(req: ChatCompletionRequest) -> list[ToolSpec]:
    assert req.tools is not None
    specs: list[ToolSpec] = []
    for tool in req.tools:
        name = tool.function.name
        if not _FUNCTION_NAME.match(name):
            raise RequestError(
                f"tool name {name!r} must be 1 to 64 letters, digits, underscores or dashes",
                "tools",
            )
        if any(s.name == name for s in specs):
            raise RequestError(f"tool name `{name}` appears twice", "tools")
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise RequestError(f"the parameters of tool `{name}` must be an object schema", "tools")
        specs.append(ToolSpec(name=name, parameters=params))
    return specs


def _check_no_other_grammar(req: ChatCompletionRequest) -> None:
    """A forced tool choice is a grammar of its own: it cannot be combined with another."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        raise RequestError(
            "response_format cannot be combined with tool_choice required or a named function",
            "response_format",
        )
    for name in ("regex", "ebnf", "json_schema"):
        if getattr(req, name, None) is not None:
            raise RequestError(
                f"{name} cannot be combined with tool_choice required or a named function", name
            )


@dataclass(slots=True)
class ChoicePiece:
    """What one step of a choice's output adds, split the way the response shows it."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ChoicePiece) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)


class ChoiceReader:
    """Reads one choice: reasoning parser first, tool-call parser on the rest. Without
    either, text passes through as content."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.saw_reasoning = False
        self.call_ids: dict[int, str] = {}  # call index -> its id, fixed at its first piece

    def feed(self, text: str) -> ChoicePiece:
        return self._read(text, final=False)

    def finish(self) -> ChoicePiece:
        return self._read("", final=True)

    def _read(self, text: str, final: bool) -> ChoicePiece:
        piece = ChoicePiece()
        content = text
        if self.reasoning is not None:
            split = self.reasoning.finish() if final else self.reasoning.feed(text)
            piece.reasoning = split.reasoning
            content = split.content
            self.saw_reasoning = self.saw_reasoning or bool(split.reasoning)
        if self.tools is None:
            piece.content = content
            return piece
        out = self.tools.feed(content) if content else None
        if out is not None:
            piece.content, piece.calls = out.content, out.calls
        if final:
            rest = self.tools.finish()
            piece.content += rest.content
            piece.calls.extend(rest.calls)
        return piece

    def call_outs(self, deltas: list[ToolCallDelta]) -> list[DeltaToolCall]:
        """Stream pieces -> `delta.tool_calls` entries: the first of a call carries its id,
        type and name; later ones argument fragments."""
        outs: list[DeltaToolCall] = []
        for d in deltas:
            first = d.index not in self.call_ids
            if first:
                self.call_ids[d.index] = new_call_id()
            outs.append(
                DeltaToolCall(
                    id=self.call_ids[d.index] if first else None,
                    type="function" if first else None,
                    index=d.index,
                    function=FunctionCallOut(name=d.name, arguments=d.arguments),
                )
            )
        return outs


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
