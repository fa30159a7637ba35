"""A response's output items, built from the pieces of one `ChoiceReader`: a reasoning
item, a message and function calls in the order the model wrote them, and the Responses
stream events that build them."""

from __future__ import annotations

import copy
import uuid
from typing import Any

from srt.entrypoints.openai.tool_use import ChoicePiece, ChoiceReader, new_call_id
from srt.function_call.core import ToolCallDelta


class OutputItems:
    """A response's output items, built from one `ChoiceReader`'s pieces, with the stream
    events that build them (`take_events`). Text opens a message (reasoning a reasoning item)
    or continues the open one; a call's first piece closes what is open and opens a
    function call; `finish` closes everything."""

    def __init__(self, reader: ChoiceReader) -> None:
        self.reader = reader
        self.items: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._open: int | None = None  # index of the open reasoning or message item
        self._calls: dict[int, int] = {}  # call index -> its item's index, while open

    def feed(self, text: str) -> None:
        if text:
            self._apply(self.reader.feed(text))

    def finish(self, status: str) -> None:
        self._apply(self.reader.finish())
        if not self.items:
            self._text("message", "")  # a response always says something, if only ""
        self._close_text(status)
        self._close_calls(status)

    def take_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def reasoning_text(self) -> str:
        return "".join(
            part["text"]
            for item in self.items
            if item["type"] == "reasoning"
            for part in item["content"]
        )

    def assistant_message(self) -> dict[str, Any]:
        """The output as the chat message a next turn's template renders."""
        text = "".join(
            part["text"]
            for item in self.items
            if item["type"] == "message"
            for part in item["content"]
        )
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [item for item in self.items if item["type"] == "function_call"]
        if calls:
            message["tool_calls"] = [
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
                for call in calls
            ]
        if reasoning := self.reasoning_text():
            message["reasoning_content"] = reasoning
        return message

    def _apply(self, piece: ChoicePiece) -> None:
        if piece.reasoning:
            self._text("reasoning", piece.reasoning)
        if piece.content:
            self._text("message", piece.content)
        for delta in piece.calls:
            self._call(delta)

    def _emit(self, kind: str, **fields: Any) -> None:
        self._events.append({"type": kind, **fields})

    def _where(self, index: int) -> dict[str, Any]:
        """Where a text event belongs: the item, its place in the output, its one part."""
        return {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}

    def _add(self, item: dict[str, Any]) -> int:
        self.items.append(item)
        index = len(self.items) - 1
        self._emit("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        return index

    def _text(self, kind: str, delta: str) -> None:
        index = self._open
        if index is None or self.items[index]["type"] != kind:
            self._close_text("completed")
            self._close_calls("completed")
            if kind == "message":
                item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant"}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": []}
                part = {"type": "reasoning_text", "text": ""}
            index = self._open = self._add({**item, "status": "in_progress", "content": []})
            self.items[index]["content"].append(part)
            if kind == "message":
                self._emit("response.content_part.added", **self._where(index), part=dict(part))
        item = self.items[index]
        item["content"][0]["text"] += delta
        if not delta:
            return
        where = self._where(index)
        if kind == "message":
            self._emit("response.output_text.delta", **where, delta=delta, logprobs=[])
        else:
            self._emit("response.reasoning_text.delta", **where, delta=delta)

    def _close_text(self, status: str) -> None:
        index, self._open = self._open, None
        if index is None:
            return
        item = self.items[index]
        part = item["content"][0]
        where = self._where(index)
        if item["type"] == "message":
            self._emit("response.output_text.done", **where, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **where, part=dict(part))
        else:
            self._emit("response.reasoning_text.done", **where, text=part["text"])
        item["status"] = status
        self._emit("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def _call(self, delta: ToolCallDelta) -> None:
        index = self._calls.get(delta.index)
        if index is None:
            self._close_text("completed")
            self._close_calls("completed")
            item = {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "call_id": new_call_id(),
                "name": delta.name or "",
                "arguments": "",
                "status": "in_progress",
            }
            index = self._calls[delta.index] = self._add(item)
        item = self.items[index]
        if delta.name and not item["name"]:
            item["name"] = delta.name
        if delta.arguments:
            item["arguments"] += delta.arguments
            self._emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=delta.arguments,
            )

    def _close_calls(self, status: str) -> None:
        for index in sorted(self._calls.values()):
            item = self.items[index]
            self._emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            item["status"] = status
            self._emit("response.output_item.done", output_index=index, item=copy.deepcopy(item))
        self._calls.clear()
