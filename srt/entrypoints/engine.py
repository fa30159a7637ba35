"""`Engine`: the offline API over the same three roles the server runs.

    with Engine(dtype="bfloat16") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8})
        print(out["text"], out["meta_info"]["finish_reason"])

The scheduler (one process per tensor-parallel rank, `Engine(tp_size=2)`) and the
detokenizer run in child processes; the `TokenizerManager` runs in this process on a
background asyncio loop, so `generate` is synchronous and `async_generate` works from any
caller's loop. `launch_server` builds an Engine and serves its tokenizer manager on
uvicorn's loop instead. An Engine is node 0 of a multi-node group; the other nodes run
`launch_server --node-rank N` (see `worker_node`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from managers.server_status import combined_memory_integrity
from managers.tokenizer_manager import TokenizerManager
from srt.entrypoints.native_protocol import generate_all, parse_encode, parse_generate, stream_all
from srt.entrypoints.subprocesses import ChildProcesses
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_END = object()


class Engine:
    def __init__(self, server_args: ServerArgs | None = None, **kwargs: Any) -> None:
        self.server_args = server_args if server_args is not None else ServerArgs(**kwargs)
        if self.server_args.node_rank > 0:
            raise ValueError(
                "An Engine runs on node 0; --node-rank > 0 runs only its scheduler ranks "
                "(srt.entrypoints.worker_node.serve_worker_node, launched by launch_server)"
            )
        self.children = ChildProcesses(self.server_args)
        try:
            # Loaded while the children load the model (seconds of each start).
            tokenizer = None
            if not self.server_args.skip_tokenizer_init:
                from srt.model_loader.sources import get_tokenizer

                tokenizer = get_tokenizer(self.children.model_path, self.server_args.tokenizer_path)
            ready = self.children.wait_ready()
            # The scheduler's device stands for "auto" from now on: resolving it here would
            # import torch into a process that never runs a model.
            self.server_args = dataclasses.replace(self.server_args, device=ready.device)
            self.tokenizer_manager = TokenizerManager(
                self.server_args,
                self.children.port_args,
                ready,
                self.server_args.resolved_served_model_name(),
                tokenizer,
            )
        except BaseException:
            self.children.stop()
            raise
        self.on_child_death: Callable[[str], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self.children.watch(self._child_died)
        logger.info(
            "Engine ready: %s, context %d tokens, KV pool %d tokens.",
            self.tokenizer_manager.served_model_name,
            self.tokenizer_manager.context_len,
            self.tokenizer_manager.max_total_tokens,
        )

    # ---- offline API ---------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        stream: bool = False,
        **options: Any,
    ) -> Any:
        """One prompt -> one output dict; a list of prompts (or n > 1) -> a list.

        With `stream=True`, an iterator of cumulative outputs. `options`: `rid`,
        `return_logprob`, `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`.
        """
        objs, is_batch = self._parse(prompt, sampling_params, input_ids, stream, options)
        if stream:
            return self._iterate(stream_all(self.tokenizer_manager, objs, is_batch))
        return self._run(generate_all(self.tokenizer_manager, objs, is_batch))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        stream: bool = False,
        **options: Any,
    ) -> Any:
        """`generate` for asyncio callers; with `stream=True`, an async iterator."""
        objs, is_batch = self._parse(prompt, sampling_params, input_ids, stream, options)
        if stream:
            return self._aiterate(stream_all(self.tokenizer_manager, objs, is_batch))
        fut = asyncio.run_coroutine_threadsafe(
            generate_all(self.tokenizer_manager, objs, is_batch), self._background_loop()
        )
        return await asyncio.wrap_future(fut)

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        dimensions: int | None = None,
    ) -> Any:
        """An embedding server's (`is_embedding=True`) vectors: one prompt -> one
        `{"embedding", "meta_info"}` dict; a list of prompts -> a list."""
        body = {"text": prompt, "input_ids": input_ids, "dimensions": dimensions}
        objs, is_batch = parse_encode(body, self.server_args.max_batch_size)
        return self._run(generate_all(self.tokenizer_manager, objs, is_batch))

    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.flush_cache()).success

    def get_server_info(self) -> dict[str, Any]:
        """Scheduler rank 0's state (`num_running_reqs`, ...), with `internal_states`, every
        rank's, and `memory_integrity` over all ranks (as `/get_server_info` has them)."""
        states = self._run(self.tokenizer_manager.get_internal_states())
        return {
            **dataclasses.asdict(states[0]),
            "internal_states": [dataclasses.asdict(state) for state in states],
            "memory_integrity": dataclasses.asdict(combined_memory_integrity(states)),
        }

    def shutdown(self) -> None:
        self.children.stop()
        loop, self._loop = self._loop, None
        if loop is not None and loop.is_running():

            async def close() -> None:
                self.tokenizer_manager.close()

            asyncio.run_coroutine_threadsafe(close(), loop).result()
            loop.call_soon_threadsafe(loop.stop)

    def __enter__(self) -> Engine:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- plumbing ------------------------------------------------------------------
    def _parse(
        self,
        prompt: Any,
        sampling_params: Any,
        input_ids: Any,
        stream: bool,
        options: dict[str, Any],
    ) -> tuple[list[Any], bool]:
        body = {"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params}
        body = {**body, "stream": stream, **options}
        return parse_generate(body, self.server_args.max_batch_size)

    def _background_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="radixrt-engine-loop", daemon=True
                ).start()
                self._loop = loop
            return self._loop

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._background_loop()).result()

    def _iterate(self, agen: AsyncIterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Drive an async generator on the background loop; hand items over a queue."""
        items: queue.Queue[Any] = queue.Queue()

        async def pump() -> None:
            try:
                async for item in agen:
                    items.put(item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                items.put(e)
            finally:
                items.put(_END)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._background_loop())
        try:
            while (item := items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()  # the caller stopped early: the request is aborted

    async def _aiterate(self, agen: AsyncIterator[dict[str, Any]]) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for item in agen:
                    loop.call_soon_threadsafe(items.put_nowait, item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's loop
                loop.call_soon_threadsafe(items.put_nowait, e)
            finally:
                loop.call_soon_threadsafe(items.put_nowait, _END)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._background_loop())
        try:
            while (item := await items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()

    def _child_died(self, reason: str) -> None:
        tm = self.tokenizer_manager
        if tm.loop is not None and tm.loop.is_running():
            tm.loop.call_soon_threadsafe(tm.fail_all, reason)
        else:
            tm.dead_reason = reason
        if self.on_child_death is not None:
            self.on_child_death(reason)
