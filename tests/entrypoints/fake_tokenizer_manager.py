"""`FakeTokenizerManager`: scripted outputs in the tokenizer manager's contract shape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request

from managers.errors import RequestError
from managers.io_struct import GenerateReqInput

# Substrings of a prompt that switch the double to a scripted failure or behaviour.
TRIGGER_REQUEST_ERROR = "TRIGGER_REQUEST_ERROR"  # RequestError before the first output
TRIGGER_ABORT = "TRIGGER_ABORT"  # two tokens, then an abort finish reason
TRIGGER_SLOW = "TRIGGER_SLOW"  # streams forever, one token every 20 ms
TRIGGER_CRASH = "TRIGGER_CRASH"  # an unexpected exception (a bug) before the first output

CACHED_TOKENS = 3


class FakeTokenizerManager:
    """A test double for the TokenizerManager, so the OpenAI layer is tested alone.

    It has the real tokenizer but no scheduler: sample j of a prompt replies with
    `reply_text(prompt, j)`, one token per streamed output, honouring `max_new_tokens`, `stop`
    and `no_stop_trim`, with made-up logprobs. It records every `GenerateReqInput` it
    receives and the rids of generators closed before they finished (the abort path).
    """

    def __init__(self, tokenizer: Any, model_path: str) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = "fake-model"
        self.model_path = model_path
        self.context_len = 512
        self.vocab_size = len(tokenizer)
        self.chat_template: str | None = None
        self.received: list[GenerateReqInput] = []
        self.closed_early: list[str] = []

    async def off_loop(self, work: Any) -> Any:
        return work()  # the real manager runs it on a worker thread

    def reset(self) -> None:
        self.received.clear()
        self.closed_early.clear()
        self.chat_template = None

    @staticmethod
    def reply_text(prompt: str, j: int) -> str:
        return f"[{prompt.strip()[-6:]}#{j}] Hello world, this is a scripted reply."

    async def generate_request(
        self, obj: GenerateReqInput, request: Request | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        self.received.append(obj)
        assert (obj.text is None) != (obj.input_ids is None), "exactly one of text / input_ids"
        prompt = obj.text if obj.text is not None else self.tokenizer.decode(obj.input_ids)
        if TRIGGER_REQUEST_ERROR in prompt:
            raise RequestError("The prompt is too long for the context", "prompt", 400)
        if TRIGGER_CRASH in prompt:
            raise RuntimeError("a bug in the tokenizer manager")
        input_ids = obj.input_ids or self.tokenizer.encode(prompt)
        params = obj.sampling_params
        n = params.get("n", 1)
        max_new = params.get("max_new_tokens")
        max_new = self.context_len - len(input_ids) if max_new is None else max_new
        replies = [self.tokenizer.encode(self.reply_text(prompt, j)) for j in range(n)]
        if TRIGGER_SLOW in prompt:
            replies = [reply * 10_000 for reply in replies]
        finished = False
        try:
            states = [
                self._sample_state(obj, j, input_ids, r, max_new) for j, r in enumerate(replies)
            ]
            step = 0
            while not all(s["done"] for s in states):
                step += 1
                for state in states:
                    if state["done"]:
                        continue
                    out = self._advance(state, abort=TRIGGER_ABORT in prompt and step == 3)
                    if obj.stream:
                        yield out
                    elif state["done"]:
                        reason = out["meta_info"]["finish_reason"]
                        if reason["type"] == "abort" and "status_code" in reason:
                            raise RequestError(reason["message"], None, reason["status_code"])
                        yield out
                if TRIGGER_SLOW in prompt:
                    await asyncio.sleep(0.02)
                else:
                    await asyncio.sleep(0)
            finished = True
        finally:
            if not finished:
                self.closed_early.append(str(obj.rid))

    def _sample_state(
        self, obj: GenerateReqInput, j: int, input_ids: list[int], reply: list[int], max_new: int
    ) -> dict[str, Any]:
        return {"obj": obj, "j": j, "input": input_ids, "reply": reply, "max_new": max_new,
                "k": 0, "done": False}  # fmt: skip

    def _advance(self, state: dict[str, Any], abort: bool) -> dict[str, Any]:
        """One more token of one sample, as a cumulative output."""
        obj: GenerateReqInput = state["obj"]
        params = obj.sampling_params
        reply, k = state["reply"], state["k"]
        reason: dict[str, Any] | None = None
        if abort:
            reason = {"type": "abort", "message": "Aborted by the scheduler", "status_code": 503}
        elif k >= state["max_new"]:
            reason = {"type": "length", "length": state["max_new"]}
        else:
            k += 1
        ids = reply[:k]
        text = self.tokenizer.decode(ids)
        stops = params.get("stop") or []
        for stop in [stops] if isinstance(stops, str) else stops:
            if reason is None and stop in text:
                cut = text.index(stop) + (len(stop) if params.get("no_stop_trim") else 0)
                text, reason = text[:cut], {"type": "stop", "matched": stop}
        if reason is None and k == len(reply):
            reason = {"type": "stop", "matched": self.tokenizer.eos_token_id}
        if reason is None and k >= state["max_new"]:
            reason = {"type": "length", "length": state["max_new"]}
        state["k"], state["done"] = k, reason is not None
        meta: dict[str, Any] = {
            "id": obj.rid,
            "prompt_tokens": len(state["input"]),
            "completion_tokens": k,
            "cached_tokens": CACHED_TOKENS,
            "finish_reason": reason,
            "e2e_latency": 0.01,
        }
        if obj.return_logprob:
            self._add_logprobs(meta, obj, state["input"], ids)
        return {"index": state["j"], "text": text, "output_ids": ids, "meta_info": meta}

    def _entry(self, obj: GenerateReqInput, lp: float | None, token_id: int) -> list[Any]:
        text = self.tokenizer.decode([token_id]) if obj.return_text_in_logprobs else None
        return [lp, token_id, text]

    def _tops(self, obj: GenerateReqInput, token_id: int) -> list[list[Any]]:
        ids = [token_id, token_id + 1, token_id + 2, token_id + 3][: obj.top_logprobs_num]
        return [self._entry(obj, -0.5 * (r + 1), t) for r, t in enumerate(ids)]

    def _add_logprobs(
        self, meta: dict[str, Any], obj: GenerateReqInput, input_ids: list[int], ids: list[int]
    ) -> None:
        meta["output_token_logprobs"] = [self._entry(obj, -0.5, t) for t in ids]
        meta["output_top_logprobs"] = [self._tops(obj, t) for t in ids]
        if obj.logprob_start_len == 0:
            meta["input_token_logprobs"] = [
                self._entry(obj, None if p == 0 else -1.0, t) for p, t in enumerate(input_ids)
            ]
            meta["input_top_logprobs"] = [
                None if p == 0 else self._tops(obj, t) for p, t in enumerate(input_ids)
            ]
