"""SGLang's native `/generate` and `/encode` request and response shapes, shared by the HTTP
routes and the offline `Engine`.

A body carries `text` or `input_ids`, each a single prompt or a batch, with
`sampling_params` (one dict for all prompts, or one per prompt), `rid` (str or list),
`stream`, the logprob options, and `timeout` (seconds) and `priority` (an integer) for the
whole body (the tokenizer manager checks both). A top-level field not in `GENERATE_FIELDS`,
or a `sampling_params` key that is not a `SamplingParams` field, is a 400 naming it: a
misspelt or unsupported option must not be dropped without a word. One prompt with n == 1 answers with one object; a batch
or n > 1 answers with a list ordered prompt-major (prompt i, sample j -> i * n + j), and
streamed items carry that position as "index".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from managers.errors import RequestError
from managers.io_struct import EmbedOptions, GenerateReqInput
from managers.validation import check_batch_size
from srt.entrypoints.native_fields import ENCODE_FIELDS, GENERATE_FIELDS, SAMPLING_FIELDS
from srt.entrypoints.openai.fields import screen


def parse_generate(body: Any, max_batch_size: int) -> tuple[list[GenerateReqInput], bool]:
    """Split a body into one `GenerateReqInput` per prompt; also return whether it was a
    batch. Unknown fields are refused. A body whose prompts times n exceed `max_batch_size`
    (`--max-batch-size`) is refused."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    body = screen(GENERATE_FIELDS, {}, body, nested=False)
    prompts, is_batch = _prompts(body, max_batch_size)
    prompt_field = prompts[0][0]
    params = [
        _sampling_params(p)
        for p in _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params", dict)
    ]
    rids = _per_prompt(body.get("rid"), len(prompts), "rid", str)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("`stream` must be a boolean.", param="stream")
    options = {}
    for name, kind, default in (
        ("return_logprob", bool, False),
        ("logprob_start_len", int, -1),
        ("top_logprobs_num", int, 0),
        ("return_text_in_logprobs", bool, False),
    ):
        value = body.get(name, default)
        if value is None:
            value = default
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise RequestError(f"`{name}` must be {kind.__name__}.", param=name)
        options[name] = value
    boot = bootstrap_info(body, len(prompts))
    keys = cache_keys(body, len(prompts))
    objs = [
        GenerateReqInput(
            **{field: prompt},
            sampling_params=params[i] if params[i] is not None else {},
            rid=rids[i],
            stream=stream,
            bootstrap=boot[i],
            timeout=body.get("timeout"),
            priority=body.get("priority"),
            extra_key=keys[i],
            **options,
        )
        for i, (field, prompt) in enumerate(prompts)
    ]
    sequences = sum(num_samples(obj) for obj in objs)
    check_batch_size(len(objs), sequences, max_batch_size, prompt_field)
    return objs, is_batch


def parse_encode(body: Any, max_batch_size: int) -> tuple[list[GenerateReqInput], bool]:
    """`/encode` (an embedding server): one embedding request per prompt, as
    `parse_generate` splits them; `dimensions` applies to all of them."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    body = screen(ENCODE_FIELDS, {}, body, nested=False)
    prompts, is_batch = _prompts(body, max_batch_size)
    rids = _per_prompt(body.get("rid"), len(prompts), "rid", str)
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1
    ):
        raise RequestError("`dimensions` must be an integer >= 1.", param="dimensions")
    embed = EmbedOptions(dimensions)
    objs = [
        GenerateReqInput(
            **{field: prompt},
            sampling_params={"max_new_tokens": 0},
            rid=rids[i],
            priority=body.get("priority"),
            embed=embed,
        )
        for i, (field, prompt) in enumerate(prompts)
    ]
    return objs, is_batch


def _prompts(body: dict[str, Any], max_batch_size: int) -> tuple[list[tuple[str, Any]], bool]:
    """The body's prompts as ("text" | "input_ids", prompt) pairs, and whether it was a
    batch; a batch larger than `max_batch_size` is refused."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise RequestError("Give `text` or `input_ids`.", param="text")
    if text is not None and input_ids is not None:
        raise RequestError("Give only one of `text` and `input_ids`.", param="text")
    if text is not None:
        is_batch = isinstance(text, list)
        prompts = [("text", t) for t in (text if is_batch else [text])]
    else:
        if not isinstance(input_ids, list):
            raise RequestError("`input_ids` must be a list of integers.", param="input_ids")
        is_batch = bool(input_ids) and all(isinstance(x, list) for x in input_ids)
        prompts = [("input_ids", ids) for ids in (input_ids if is_batch else [input_ids])]
    if is_batch and not prompts:
        raise RequestError("The batch is empty.", param="text")
    # Counted here before building the prompts' objects (n >= 1), and by the caller after,
    # with each prompt's n.
    check_batch_size(len(prompts), len(prompts), max_batch_size, prompts[0][0])
    return prompts, is_batch


def _sampling_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """A `sampling_params` dict screened by `SAMPLING_FIELDS`, SGLang's `sampling_seed`
    renamed to our `seed`."""
    if params is None:
        return None
    params = screen(SAMPLING_FIELDS, {}, params, nested=False)
    if "sampling_seed" in params:
        seed = params.pop("sampling_seed")
        if params.get("seed") is not None and seed is not None and params["seed"] != seed:
            raise RequestError("`seed` and `sampling_seed` differ.", param="sampling_seed")
        if seed is not None:
            params["seed"] = seed
    return params


def cache_keys(body: dict[str, Any], n: int) -> list[str | None]:
    """Per prompt, the prefix-cache namespace of SGLang's `extra_key` and `cache_salt` (one
    value for every prompt, or one per prompt): requests share cached KV only when equal."""
    columns = []
    for name in ("extra_key", "cache_salt"):
        value = body.get(name)
        values = value if isinstance(value, list) else [value] * n
        if len(values) != n or not all(v is None or isinstance(v, str) for v in values):
            raise RequestError(f"`{name}` must be a string or one per prompt.", param=name)
        columns.append(values)
    return [
        None if key is None and salt is None else f"{key or ''}\0{salt or ''}"
        for key, salt in zip(*columns, strict=True)
    ]


def bootstrap_info(body: dict[str, Any], n: int) -> list[tuple[str, int, int] | None]:
    """`bootstrap_host/port/room` (as sglang-router's PD mode sends them), per prompt."""
    room = body.get("bootstrap_room")
    if room is None:
        return [None] * n
    hosts = _per_prompt(body.get("bootstrap_host"), n, "bootstrap_host", str)
    ports = _per_prompt(body.get("bootstrap_port"), n, "bootstrap_port", int)
    rooms = _per_prompt(room, n, "bootstrap_room", int)
    out = []
    for host, port, r in zip(hosts, ports, rooms, strict=True):
        if host is None or port is None or r is None:
            raise RequestError("bootstrap_host, bootstrap_port and bootstrap_room go together.")
        out.append((host, port, r))
    return out


def _per_prompt(value: Any, n: int, name: str, kind: type) -> list[Any]:
    if value is None:
        return [None] * n
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"`{name}` has {len(value)} entries for {n} prompts.", param=name)
        values = value
    else:
        values = [value] * n
    for v in values:
        if v is not None and not isinstance(v, kind):
            raise RequestError(f"`{name}` must be a {kind.__name__} or a list of them.", name)
    if kind is str and n > 1 and not isinstance(value, list):
        raise RequestError("A batch needs one `rid` per prompt.", param=name)
    return values


def num_samples(obj: GenerateReqInput) -> int:
    n = obj.sampling_params.get("n", 1) if isinstance(obj.sampling_params, dict) else 1
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def _drop_index(out: dict[str, Any]) -> dict[str, Any]:
    out.pop("index", None)
    return out


async def generate_all(
    tm: Any, objs: list[GenerateReqInput], is_batch: bool, request: Any = None
) -> dict[str, Any] | list[dict[str, Any]]:
    """Run every prompt concurrently; return the final output(s) in the native shape."""

    async def one(obj: GenerateReqInput) -> list[dict[str, Any]]:
        outs = [o async for o in tm.generate_request(obj, request)]
        return sorted(outs, key=lambda o: o["index"])

    tasks = [asyncio.ensure_future(one(obj)) for obj in objs]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # one prompt failed: abort the others
    flat = [out for outs in results for out in outs]
    if not is_batch and len(flat) == 1:
        return _drop_index(flat[0])
    for i, out in enumerate(flat):
        out["index"] = i
    return flat


async def stream_all(
    tm: Any, objs: list[GenerateReqInput], is_batch: bool, request: Any = None
) -> AsyncIterator[dict[str, Any]]:
    """Merge the streams of every prompt; yield cumulative outputs as they come."""
    single = not is_batch and num_samples(objs[0]) == 1
    if len(objs) == 1:
        gen = tm.generate_request(objs[0], request)
        async with contextlib.aclosing(gen):
            async for out in gen:
                yield _drop_index(out) if single else out
        return
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, obj: GenerateReqInput) -> None:
        gen = tm.generate_request(obj, request)
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer below
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, None))

    offsets = [0]
    for obj in objs:
        offsets.append(offsets[-1] + num_samples(obj))
    tasks = [asyncio.ensure_future(pump(i, obj)) for i, obj in enumerate(objs)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                item["index"] = offsets[i] + item["index"]
                yield item
    finally:
        for task in tasks:
            task.cancel()
