"""Incremental detokenization: the pure per-request logic the detokenizer process runs.

The scheduler sends each request's growing output token list once per step; `IncrementalDecoder`
turns it into text deltas that are safe to stream. Three things make that harder than
`tokenizer.decode(ids[-1:])`:

* **Characters split across tokens.** A byte-level BPE emits one emoji or CJK character as several
  tokens, each alone an invalid UTF-8 fragment that decodes to "\\ufffd". We keep two offsets into
  the ids: `surr_offset` (start of a small window giving the decoder context, so leading spaces
  and merges decode as they do in the full text) and `read_offset` (end of what was already
  turned into text). Each step decodes `ids[surr:]` and `ids[surr:read]`; the difference is the
  new text. If it ends in "\\ufffd" a character is still incomplete, so nothing moves and the
  next step retries with more bytes; otherwise the text is committed and the window slides to
  `surr, read = read, len(ids)`. Only that window is decoded, so a step costs O(new tokens), not
  O(output length).
* **Stop strings.** A stop string may arrive spread over several tokens. While running we hold
  back the longest tail of the committed text that is a proper prefix of a stop string (it may
  still complete) and anything from a complete occurrence on; held text is released once it can
  no longer match. On a stop finish the text is cut at the matched string (or, for a stop token
  id, the last token is dropped) unless `no_stop_trim`, so a client never sees a stop string
  that a later step would have to take back.
* **Special tokens.** transformers' fast tokenizer accepts `spaces_between_special_tokens` but
  silently ignores it (its `_decode` swallows unknown kwargs), so `decode_ids` rebuilds the text
  from segments the way vLLM/SGLang users expect. The common case, no added token in the ids, stays
  a single `tokenizer.decode` call.

On finish everything left is released, partial characters included, and later calls return "".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from managers.io_struct import FinishReason

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True, slots=True)
class _AddedTokens:
    """A tokenizer's added tokens: id -> text, and which of them are special (skippable)."""

    content: dict[int, str]
    all_ids: frozenset[int]
    non_special_ids: frozenset[int]

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> _AddedTokens:
        decoder = tokenizer.added_tokens_decoder
        content = {i: tok.content for i, tok in decoder.items()}
        non_special = frozenset(i for i, tok in decoder.items() if not tok.special)
        return cls(content, frozenset(content), non_special)


def decode_ids(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    """`tokenizer.decode` that honours `spaces_between_special_tokens` (see the module doc)."""
    added = _AddedTokens.of(tokenizer)
    return _decode(tokenizer, ids, added, skip_special_tokens, spaces_between_special_tokens)


def _decode(
    tokenizer: PreTrainedTokenizerBase,
    ids: Sequence[int],
    added: _AddedTokens,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> str:
    # Added tokens that survive skipping each become a segment of their own; the runs of
    # ordinary tokens between them are decoded together and the segments joined with " ".
    splitters = added.non_special_ids if skip_special_tokens else added.all_ids
    if not spaces_between_special_tokens or splitters.isdisjoint(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    segments: list[str] = []
    run: list[int] = []
    for token_id in ids:
        if token_id not in splitters:
            run.append(token_id)  # skipped specials are dropped by decode, not split on
            continue
        if run:
            segments.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
            run = []
        segments.append(added.content[token_id])
    if run:
        segments.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
    return " ".join(segments)


def _stop_hold_start(text: str, stops: Sequence[str]) -> int:
    """Index in `text` from which it must be held back: a full stop string, or a tail that is a
    proper prefix of one. `len(text)` when nothing needs holding."""
    cut = len(text)
    for stop in stops:
        found = text.find(stop)
        if found != -1:
            cut = min(cut, found)
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


class IncrementalDecoder:
    """Streams one request's output text, one `step` per scheduler step (module doc)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        no_stop_trim: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop: tuple[str, ...] = tuple(s for s in stop or () if s)
        self.no_stop_trim = no_stop_trim
        self.text = ""  # everything released so far
        self.finished = False
        self.surr_offset = 0
        self.read_offset = 0
        self._pending = ""  # committed (whole characters) but held back for stop strings
        self._surr_text: str | None = None  # decode of ids[surr:read], kept while it is valid
        self._added = _AddedTokens.of(tokenizer)

    def _decode(self, ids: Sequence[int]) -> str:
        return _decode(
            self.tokenizer,
            ids,
            self._added,
            self.skip_special_tokens,
            self.spaces_between_special_tokens,
        )

    def step(self, output_ids: list[int], finished_reason: FinishReason | None) -> str:
        """The text delta safe to release now; `output_ids` is the whole output so far."""
        if self.finished:
            return ""
        end = len(output_ids)
        matched = finished_reason.matched if finished_reason else None
        trim_stop = (
            finished_reason is not None and finished_reason.type == "stop" and not self.no_stop_trim
        )
        if trim_stop and isinstance(matched, int) and not isinstance(matched, bool):
            end = max(end - 1, self.read_offset)  # the stop token is not part of the text

        if end > self.read_offset:  # no new token: keep the window (and its context) as is
            if self._surr_text is None:
                self._surr_text = self._decode(output_ids[self.surr_offset : self.read_offset])
            new_text = self._decode(output_ids[self.surr_offset : end])[len(self._surr_text) :]
            if finished_reason is None and new_text.endswith(REPLACEMENT_CHAR):
                return ""  # a character is still incomplete: wait for its remaining bytes
            self._pending += new_text
            self.surr_offset, self.read_offset = self.read_offset, end
            self._surr_text = None

        if finished_reason is None:
            cut = _stop_hold_start(self._pending, self.stop)
            return self._release(cut)
        self.finished = True
        if trim_stop and isinstance(matched, str) and matched:
            return self._release(self._stop_cut(matched))
        return self._release(len(self._pending))

    def _stop_cut(self, matched: str) -> int:
        """How much of `_pending` to release when the request stopped on string `matched`."""
        found = self._pending.find(matched)
        if found != -1:
            return found
        # Otherwise the match began in text already released (it straddles the boundary, e.g.
        # the scheduler saw a decode we did not): release nothing more. Absent entirely: all.
        return 0 if matched in self.text + self._pending else len(self._pending)

    def _release(self, cut: int) -> str:
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += delta
        return delta
