"""Tool calls in model output: one parser per model family, behind one registry.

`--tool-call-parser NAME` picks the parser that `tool_choice="auto"` uses to find calls in
free text (`TOOL_PARSERS`). `tool_choice="required"` and a named function do not depend on
it: the output is forced by a JSON-schema grammar (`forced.py`) and read by
`ForcedToolCallParser`, whatever the model family.

Every parser is fed text deltas of one choice (`feed`, then `finish`) and answers content
deltas and tool-call deltas; `parse` on a whole text is the same walk, so a stream and a
non-streamed response always agree. This package imports no torch (the server's argument
parser lists the registry's names).
"""

from __future__ import annotations

from srt.function_call.core import (
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolSpec,
)
from srt.function_call.forced import ForcedToolCallParser, tool_choice_schema
from srt.utils.registry import Registry

TOOL_PARSERS: Registry[ToolCallParser] = Registry("tool-call parser")
TOOL_PARSERS.register("hermes", "srt.function_call.hermes:HermesParser")
TOOL_PARSERS.register("qwen25", "srt.function_call.hermes:HermesParser")
TOOL_PARSERS.register("llama3", "srt.function_call.llama3:Llama3JsonParser")
TOOL_PARSERS.register("mistral", "srt.function_call.mistral:MistralParser")

__all__ = [
    "TOOL_PARSERS",
    "ForcedToolCallParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolSpec",
    "tool_choice_schema",
]
