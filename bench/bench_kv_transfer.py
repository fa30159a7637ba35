"""KV transfer throughput between two processes on this host, per transfer backend.

    python -m bench.bench_kv_transfer --backend mooncake nixl loopback --tokens 4096

Each side builds a KV pool shaped like the default model's (30 layers, K and V, 3 KV heads x
64 dims, float32 unless --dtype), registered with the backend exactly as a server does. The
"decode" process publishes its `peer_info`; the "prefill" process writes `--tokens` slots per
request (scattered runs, as a real request's slots are) and reports GB/s over --repeats.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import time

import torch

from disagg.base import KVArgs
from disagg.transfer import create_transfer_backend


def make_kv(slots: int, layers: int, heads: int, dim: int, dtype: torch.dtype) -> KVArgs:
    k = [torch.zeros(slots, heads, dim, dtype=dtype) for _ in range(layers)]
    v = [torch.zeros(slots, heads, dim, dtype=dtype) for _ in range(layers)]
    return KVArgs(k, v, heads * dim * k[0].element_size())


def receiver(backend: str, args: dict, conn) -> None:
    kv = make_kv(**args)
    transfer = create_transfer_backend(backend, kv, "127.0.0.1")
    conn.send(transfer.peer_info())
    conn.recv()  # wait until the sender is done, keeping the memory registered


def scattered_slots(n: int, total: int, seed: int) -> list[int]:
    """Runs of 16 consecutive slots at random page-aligned places, like a paged pool's."""
    rng = random.Random(seed)
    pages = rng.sample(range(1, total // 16), n // 16)
    return [p * 16 + i for p in pages for i in range(16)]


def run(backend: str, tokens: int, repeats: int, dtype: torch.dtype) -> dict:
    shape = {"slots": tokens * 4, "layers": 30, "heads": 3, "dim": 64, "dtype": dtype}
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=receiver, args=(backend, shape, child))
    proc.start()
    peer = parent.recv()
    kv = make_kv(**shape)
    for buf in kv.buffers():
        buf.normal_()
    transfer = create_transfer_backend(backend, kv, "127.0.0.1")
    nbytes = tokens * kv.item_bytes * len(kv.buffers())
    times = []
    for i in range(repeats + 1):
        src = scattered_slots(tokens, shape["slots"], seed=i)
        dst = scattered_slots(tokens, shape["slots"], seed=100 + i)
        tic = time.perf_counter()
        transfer.write(peer, src, dst)
        payload = transfer.payload(src)
        if payload is not None:  # loopback: the receiver's copy, measured here
            transfer.receive_payload(dst, payload)
        if i:  # the first write pays for handshakes
            times.append(time.perf_counter() - tic)
    parent.send("done")
    proc.join(30)
    best = min(times)
    return {
        "backend": backend,
        "tokens": tokens,
        "mbytes": round(nbytes / 1e6, 1),
        "best_s": round(best, 4),
        "gb_per_s": round(nbytes / best / 1e9, 2),
        "median_gb_per_s": round(nbytes / sorted(times)[len(times) // 2] / 1e9, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", nargs="+", default=["mooncake", "nixl", "loopback"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    for backend in args.backend:
        print(json.dumps(run(backend, args.tokens, args.repeats, getattr(torch, args.dtype))))


if __name__ == "__main__":
    main()
