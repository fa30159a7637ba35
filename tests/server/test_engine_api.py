"""`srt.Engine`, the offline API, over the same scheduler and detokenizer processes."""

from __future__ import annotations

import asyncio

import pytest

import srt
from managers.errors import RequestError

pytestmark = pytest.mark.slow

GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def engine():
    with srt.Engine(dtype="float32", max_total_tokens=8192) as eng:
        yield eng
    assert not any(p.is_alive() for p in eng.children.procs.values())


def test_generate_shapes(engine) -> None:
    one = engine.generate("The capital of France is", GREEDY)
    assert one["text"].startswith(" Paris") and "index" not in one
    many = engine.generate(["The capital of France is", "1, 2, 3,"], GREEDY)
    assert [m["index"] for m in many] == [0, 1] and many[0]["output_ids"] == one["output_ids"]
    ids = engine.tokenizer_manager.tokenizer.encode("The capital of France is")
    by_ids = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert by_ids["output_ids"] == one["output_ids"]
    samples = engine.generate("Hi", {"max_new_tokens": 4, "n": 2, "seed": 5})
    assert [s["index"] for s in samples] == [0, 1]


def test_stream_sync(engine) -> None:
    full = engine.generate("Count: one, two,", GREEDY)
    items = list(engine.generate("Count: one, two,", GREEDY, stream=True))
    # One item per token while the consumer keeps up; a consumer that falls behind gets the
    # latest cumulative snapshot instead of a backlog (`managers/req_state.py`), so a busy
    # machine may merge two tokens into one item.
    assert 1 < len(items) <= 8 and items[-1]["text"] == full["text"]
    counts = [i["meta_info"]["completion_tokens"] for i in items]
    assert counts == sorted(set(counts)) and counts[-1] == 8
    assert all(full["text"].startswith(i["text"]) for i in items)
    assert all(i["meta_info"]["finish_reason"] is None for i in items[:-1])


def test_stream_stopped_early_aborts(engine) -> None:
    params = {"max_new_tokens": 500, "ignore_eos": True}
    stream = engine.generate("Tell me a story.", params, stream=True)
    next(stream)
    stream.close()
    for _ in range(100):
        state = engine.get_server_info()
        if state["num_running_reqs"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert state["num_running_reqs"] == 0 and state["memory_integrity"]["ok"] is True


def test_async_generate(engine) -> None:
    async def main():
        outs = await asyncio.gather(
            *(engine.async_generate(f"Number {i}:", GREEDY) for i in range(4))
        )
        stream = await engine.async_generate("Number 0:", GREEDY, stream=True)
        items = [item async for item in stream]
        return outs, items

    outs, items = asyncio.run(main())
    assert len(outs) == 4 and all(o["meta_info"]["completion_tokens"] == 8 for o in outs)
    assert items[-1]["output_ids"] == outs[0]["output_ids"]


def test_errors_and_flush(engine) -> None:
    with pytest.raises(RequestError, match="temperature"):
        engine.generate("x", {"temperature": -1})
    assert engine.flush_cache() is True
