"""`StepStager` and `Pack` (srt/model_executor/step_inputs.py), and the request table's log of
rewrites (`ReqToTokenPool.log` / `take_logged`), on a CPU through the device-memory test double:
fields land where the views say, a graph's fields at their fixed offsets with padding, one copy
per send from the pinned buffer used in turn, a wait only when that buffer's last copy is not
done, growth past the first size; and the device table written from staged data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mem_cache.memory_pool import ReqToTokenPool
from srt.model_executor.step_inputs import (
    GraphInputs,
    Pack,
    StepStager,
    resolve_future_ids,
    write_on_device,
)
from srt.utils.device_memory import SharedMemory
from tests.managers.device_double import SeparateMemoryDouble


def test_pack_writes_fields_back_to_back_with_padding() -> None:
    pack = Pack()
    pack.add("a", [1, 2, 3])
    pack.add("b", np.array([7], dtype=np.int64), length=3, pad=9)
    pack.add("c", torch.tensor([4, 5]))
    host = np.zeros(pack.size, dtype=np.int64)
    spans = pack.write(host)
    assert spans == {"a": (0, 3), "b": (3, 3), "c": (6, 2)}
    assert host.tolist() == [1, 2, 3, 7, 9, 9, 4, 5]


def test_cpu_stager_views_its_one_buffer_without_copies() -> None:
    stager = StepStager(SharedMemory(torch.device("cpu")))
    pack = Pack()
    pack.add("ids", [5, 6])
    views = stager.send(pack)
    assert views["ids"].tolist() == [5, 6]
    assert views["ids"].data_ptr() == stager.general.data_ptr()


def test_each_send_is_one_pinned_copy_and_waits_only_for_an_unfinished_buffer() -> None:
    memory = SeparateMemoryDouble()
    stager = StepStager(memory)
    for step in range(4):
        pack = Pack()
        pack.add("ids", list(range(step, step + 3)))
        views = stager.send(pack)
        assert views["ids"].tolist() == list(range(step, step + 3))
    copies = [e for e in memory.log if e[0] == "h2d"]
    assert len(copies) == 4 and all(pinned for _, _, pinned in copies)
    # Nothing ever completed: the third and fourth sends reuse a buffer whose copy (two sends
    # back) is still "in flight", so each waits for it.
    assert [e for e in memory.log if e[0] == "sync"] == [("sync", 1), ("sync", 2)]
    memory.log.clear()
    memory.completed = memory.recorded  # the device caught up: no more waits
    pack = Pack()
    pack.add("ids", list(range(40000)))  # past the first host and device sizes: both grow
    assert stager.send(pack)["ids"][-1].item() == 39999
    assert not [e for e in memory.log if e[0] == "sync"]


def test_a_graph_pack_lands_in_the_graph_inputs_at_fixed_offsets() -> None:
    memory = SeparateMemoryDouble()
    graph = GraphInputs(8, memory)
    stager = StepStager(memory, graph)
    pack = Pack()
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices"):
        pack.add(name, [11, 12, 13], length=4)
    pack.add("seq_lens", [5, 6, 7], length=4, pad=1)
    pack.add("extra", [99])
    assert stager.fits_graph(pack)
    views = stager.send(pack, graph_bs=4)
    fixed = graph.views(4)
    for name, view in fixed.items():
        assert views[name].data_ptr() == view.data_ptr()
    assert fixed["seq_lens"].tolist() == [5, 6, 7, 1]
    assert fixed["input_ids"].tolist() == [11, 12, 13, 0]
    assert views["extra"].tolist() == [99]
    big = Pack()
    big.add("x", [0] * (len(graph.buffer) + 1))
    assert not stager.fits_graph(big)


def test_logged_rewrites_reach_the_device_table_with_their_latest_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = SeparateMemoryDouble()
    memory.install(monkeypatch)
    pool = ReqToTokenPool(4, 16, "cpu")
    assert pool.mirrored and pool.host is not pool.req_to_token
    pool.host[1, :3] = torch.tensor([7, 8, 9], dtype=torch.int32)
    pool.log(1, 0, 3)
    pool.host[1, :2] = torch.tensor([4, 5], dtype=torch.int32)  # rewritten before a launch
    pool.log(1, 0, 2)
    pool.log(2, 5, 5)  # empty: nothing logged
    rows, cols, slots = pool.take_logged()
    assert (rows, cols, slots.tolist()) == ([1, 1, 1, 1, 1], [0, 1, 2, 0, 1], [4, 5, 9, 4, 5])
    assert pool.take_logged() is None
    staged = {
        "logged_rows": torch.tensor(rows),
        "logged_cols": torch.tensor(cols),
        "logged_slots": slots.to(torch.int64),
        "req_pool_indices": torch.tensor([3]),
        "positions": torch.tensor([6]),
        "out_cache_loc": torch.tensor([42]),
    }
    write_on_device(pool, staged, 1, decode=True)
    assert pool.req_to_token[1, :3].tolist() == [4, 5, 9]
    assert pool.req_to_token[3, 6].item() == 42
    assert pool.host[3, 6].item() == 0  # the host side is KVManager's to write


def test_future_ids_are_gathered_in_place() -> None:
    future = torch.tensor([0, 100, 101, 102])
    ids = torch.tensor([5, -2, 7, -3])
    resolve_future_ids(ids, future)
    assert ids.tolist() == [5, 101, 7, 102]
