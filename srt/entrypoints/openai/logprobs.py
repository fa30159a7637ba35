"""Tokenizer-manager logprob lists -> the OpenAI completions and chat logprob shapes.

Entries arrive as `[logprob, token_id, token_text | None]`; top lists as a list of such
entries per position, or None (the first prompt token has no logprob and no alternatives).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Entry = list[Any]  # [logprob | None, token_id, token_text | None]


@dataclass(slots=True)
class LogprobSlice:
    """Token-aligned logprobs of one stretch of text (prompt and/or output)."""

    tokens: list[Entry] = field(default_factory=list)
    # Same length as `tokens`; None where there are no alternatives.
    tops: list[list[Entry] | None] = field(default_factory=list)

    def __add__(self, other: LogprobSlice) -> LogprobSlice:
        return LogprobSlice(self.tokens + other.tokens, self.tops + other.tops)

    def __len__(self) -> int:
        return len(self.tokens)


def take(meta: dict[str, Any], kind: str, start: int = 0) -> LogprobSlice:
    """`kind` is "input" or "output"; entries from position `start` on."""
    tokens = list(meta.get(f"{kind}_token_logprobs") or [])[start:]
    tops = list(meta.get(f"{kind}_top_logprobs") or [])[start:]
    return LogprobSlice(tokens, (tops + [None] * len(tokens))[: len(tokens)])


def _text(tokenizer: Any, entry: Entry) -> str:
    if len(entry) > 2 and entry[2] is not None:
        return str(entry[2])
    return str(tokenizer.decode([entry[1]]))


def completion_logprobs(tokenizer: Any, lps: LogprobSlice, text_offset: int) -> dict[str, Any]:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; offsets from `text_offset`.

    As OpenAI does, each top dict also holds the sampled token (up to k + 1 entries).
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry, top in zip(lps.tokens, lps.tops):
        text = _text(tokenizer, entry)
        tokens.append(text)
        token_logprobs.append(entry[0])
        offsets.append(text_offset)
        text_offset += len(text)
        if entry[0] is None:
            top_logprobs.append(None)
            continue
        alternatives = {_text(tokenizer, alt): alt[0] for alt in top or []}
        alternatives.setdefault(text, entry[0])
        top_logprobs.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _chat_entry(tokenizer: Any, entry: Entry) -> dict[str, Any]:
    text = _text(tokenizer, entry)
    return {"token": text, "logprob": entry[0], "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, lps: LogprobSlice) -> dict[str, Any]:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`."""
    content = []
    for entry, top in zip(lps.tokens, lps.tops):
        item = _chat_entry(tokenizer, entry)
        item["top_logprobs"] = [_chat_entry(tokenizer, alt) for alt in top or []]
        content.append(item)
    return {"content": content}
