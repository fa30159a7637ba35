"""`ReqState`: what the tokenizer manager knows of one running sample.

The receive loop `apply`s each `BatchStrOut` entry (text, ids, logprobs accumulate) and
`notify`s; the waiting caller takes a cumulative `snapshot`. A state is queued at most once
at a time, so a slow consumer of a stream gets the latest snapshot, not a backlog.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from managers.io_struct import BatchTokenIDOut

TokenText = Callable[[int], str | None]
LOGPROB_FIELDS = (
    "input_token_logprobs",
    "input_top_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
)


class ReqState:
    def __init__(
        self,
        rid: str,
        parent_rid: str,
        index: int,
        ready: asyncio.Queue[ReqState],
        stream: bool,
        return_logprob: bool = False,
        return_text_in_logprobs: bool = False,
    ) -> None:
        self.rid = rid
        self.parent_rid = parent_rid
        self.index = index
        self.ready = ready
        self.stream = stream
        self.return_text_in_logprobs = return_text_in_logprobs
        self.text = ""
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {"id": rid, "finish_reason": None}
        self.logprobs: dict[str, list[Any]] | None = (
            {f: [] for f in LOGPROB_FIELDS} if return_logprob else None
        )
        self.finish_reason: dict[str, Any] | None = None
        self.finished = False
        self.queued = False
        self.created_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time = self.created_time

    def apply(self, out: BatchTokenIDOut, i: int, new_text: str, token_text: TokenText) -> None:
        self.text += new_text
        self.output_ids.extend(out.new_token_ids[i])
        self.meta["prompt_tokens"] = out.prompt_tokens[i]
        self.meta["completion_tokens"] = out.completion_tokens[i]
        self.meta["cached_tokens"] = out.cached_tokens[i]
        if self.logprobs is not None:
            text = token_text if self.return_text_in_logprobs else _no_text
            for f in ("input_token_logprobs", "output_token_logprobs"):
                self.logprobs[f].extend([lp, t, text(t)] for lp, t in getattr(out, f)[i])
            for f in ("input_top_logprobs", "output_top_logprobs"):
                self.logprobs[f].extend(
                    None if tops is None else [[lp, t, text(t)] for lp, t in tops]
                    for tops in getattr(out, f)[i]
                )
        reason = out.finished_reasons[i]
        if reason is not None:
            self.finish(reason)

    def finish(self, reason: dict[str, Any]) -> None:
        self.finish_reason = reason
        self.finished = True
        self.meta["finish_reason"] = reason
        self.meta["e2e_latency"] = time.perf_counter() - self.created_time

    def fail(self, message: str) -> None:
        self.finish({"type": "abort", "message": message, "status_code": 503})
        self.notify()

    def notify(self) -> None:
        if (self.stream or self.finished) and not self.queued:
            self.queued = True
            self.ready.put_nowait(self)

    def snapshot(self) -> dict[str, Any]:
        meta = dict(self.meta)
        if self.logprobs is not None:
            meta.update({k: list(v) for k, v in self.logprobs.items()})
        return {
            "index": self.index,
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": meta,
        }


def _no_text(token_id: int) -> None:
    return None
