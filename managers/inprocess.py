"""`InProcessDriver`: the scheduler and a model worker in this process, no sockets.

Tests and `bench/` use it to drive the real scheduler with the real model (or a scripted
worker). The multi-process Engine sends the same `TokenizedGenerateReqInput` messages, built by
the same `make_requests`, to a scheduler in another process.

With `tp` (a rank's `TPGroup`), each rank of a tensor-parallel group runs its own driver and
must make the same calls in the same order; pass explicit `rid`s, since the default ones
contain a random part that differs between processes.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import replace
from typing import Any

from managers.io_struct import AbortReq, BatchTokenIDOut, FinishReason
from managers.parallel_sampling import make_requests
from managers.scheduler import Scheduler
from managers.validation import check_sampling_params, parse_sampling_params
from srt.distributed import TPGroup
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs


def trim_stop_str(text: str, finish_reason: FinishReason | None, params: SamplingParams) -> str:
    """Cut the text at the stop string that finished the request (unless no_stop_trim)."""
    if finish_reason is None or params.no_stop_trim:
        return text
    matched = finish_reason.matched
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            return text[:pos]
    return text


class InProcessDriver:
    def __init__(
        self,
        server_args: ServerArgs,
        worker: Any = None,
        tokenizer: Any = None,
        tp: TPGroup | None = None,
    ) -> None:
        if worker is None:
            from managers.model_worker import ModelWorker

            worker = ModelWorker(server_args, tp=tp)  # `tp` only builds the worker
        if tokenizer is None and not server_args.skip_tokenizer_init:
            path = getattr(worker.model_config, "model_path", None)
            if path is not None:
                from srt.model_loader.sources import get_tokenizer

                tokenizer = get_tokenizer(path, server_args.tokenizer_path)
        self.worker = worker
        self.tokenizer = tokenizer
        self.outputs: dict[str, dict[str, Any]] = {}
        self.scheduler = Scheduler(server_args, worker, self._on_output, tokenizer)
        self._ids = itertools.count()

    # ---- output sink ---------------------------------------------------------------
    def _on_output(self, batch: BatchTokenIDOut) -> None:
        for out in batch.outputs:
            rid = out.rid
            state = self.outputs.setdefault(rid, {"meta_info": {"id": rid}, "output_ids": []})
            state["output_ids"] = state["output_ids"] + out.new_token_ids
            if out.embedding is not None:
                state["embedding"] = out.embedding
            reason = state["_finish"] = out.finish_reason
            meta = state["meta_info"]
            meta.update(
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                cached_tokens=out.cached_tokens,
                finish_reason=None if reason is None else reason.to_json(),
            )
            lp = out.logprobs
            if lp is not None and (lp.input_token_logprobs or lp.output_token_logprobs):
                for key, values in (
                    ("input_token_logprobs", lp.input_token_logprobs),
                    ("input_top_logprobs", lp.input_top_logprobs),
                    ("output_token_logprobs", lp.output_token_logprobs),
                    ("output_top_logprobs", lp.output_top_logprobs),
                ):
                    meta.setdefault(key, []).extend(values)

    # ---- API -----------------------------------------------------------------------
    def submit(
        self,
        input_ids: list[int] | None = None,
        params: SamplingParams | dict[str, Any] | None = None,
        *,
        text: str | None = None,
        rid: str | None = None,
        **fields: Any,
    ) -> list[str]:
        """Queue one prompt; returns the rids whose outputs the caller should read."""
        vocab_size = self.scheduler.vocab_size
        if isinstance(params, SamplingParams):
            check_sampling_params(params, vocab_size)
        else:
            params = parse_sampling_params(params, vocab_size)
        if input_ids is None:
            if text is None or self.tokenizer is None:
                raise ValueError("give input_ids, or text with a tokenizer")
            input_ids = self.tokenizer.encode(text)
        rid = rid or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        msgs = make_requests(rid, list(input_ids), params, input_text=text, **fields)
        for msg in msgs:
            self.outputs[msg.rid] = {
                "meta_info": {"id": msg.rid},
                "output_ids": [],
                "_t0": time.perf_counter(),
                "_params": msg.sampling_params,
            }
            self.scheduler.handle(msg)
        return [m.rid for m in msgs if m.sampling_params.max_new_tokens != 0 or params.n == 1]

    def abort(self, rid: str) -> None:
        self.scheduler.handle(AbortReq(rid))

    def step(self) -> bool:
        return self.scheduler.step()

    def run_until_idle(self) -> None:
        self.scheduler.run_until_idle()

    def result(self, rid: str) -> dict[str, Any]:
        state = self.outputs[rid]
        meta = state["meta_info"]
        if "e2e_latency" not in meta and meta.get("finish_reason") is not None:
            meta["e2e_latency"] = time.perf_counter() - state["_t0"]
        out = {"output_ids": state["output_ids"], "meta_info": meta}
        if "embedding" in state:
            out["embedding"] = state["embedding"]
        if self.tokenizer is not None:
            params: SamplingParams = state["_params"]
            text = self.tokenizer.decode(
                state["output_ids"], skip_special_tokens=params.skip_special_tokens
            )
            out["text"] = trim_stop_str(text, state.get("_finish"), params)
        return out

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        params: SamplingParams | dict[str, Any] | list[Any] | None = None,
        **fields: Any,
    ) -> list[dict[str, Any]]:
        """Submit every prompt, run to completion, return SGLang-shaped results in order.

        A prompt with n > 1 contributes n consecutive results.
        """
        if not isinstance(params, list):
            params = [params] * len(prompts)
        rids: list[str] = []
        for prompt, p in zip(prompts, params, strict=True):
            p = replace(p) if isinstance(p, SamplingParams) else p
            if isinstance(prompt, str):
                rids += self.submit(None, p, text=prompt, **fields)
            else:
                rids += self.submit(prompt, p, **fields)
        self.run_until_idle()
        return [self.result(r) for r in rids]
