"""What the main process reports about the schedulers: the load that sglang-router reads,
and one memory-integrity verdict across tensor-parallel ranks."""

from __future__ import annotations

from managers.io_struct import MemoryIntegrity, SchedulerState, SchedulerStats


def load_report(stats: SchedulerStats | None) -> list[dict[str, int]]:
    """SGLang's /get_load: one entry per data-parallel rank (RadixRT has one), from the
    latest scheduler stats (at most ~0.5 s old while busy). `num_tokens`, what
    sglang-router's power-of-two policy compares, is the KV held by requests plus the
    prompt tokens still waiting."""
    if stats is None:
        return [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    return [
        {
            "dp_rank": 0,
            "num_reqs": stats.num_running_reqs + stats.num_queue_reqs,
            "num_waiting_reqs": stats.num_queue_reqs,
            "num_tokens": stats.num_used_tokens + stats.num_queued_tokens,
        }
    ]


def combined_memory_integrity(states: list[SchedulerState]) -> MemoryIntegrity:
    """One verdict over every rank's KV integrity check: failed if any rank's failed (each
    error prefixed with its rank), unknown (None) while some rank has not checked yet, else
    ok; the time is the oldest rank's. At tp=1 it is rank 0's own, unchanged."""
    if len(states) == 1:
        return states[0].memory_integrity
    checks = [(s.tp_rank, s.memory_integrity) for s in states]
    errors = [f"rank {rank}: {c.error}" for rank, c in checks if c.ok is False]
    if errors:
        ok: bool | None = False
    elif any(c.ok is None for _, c in checks):
        ok = None
    else:
        ok = True
    times = [c.time for _, c in checks]
    oldest = None if None in times else min(t for t in times if t is not None)
    return MemoryIntegrity(ok, "; ".join(errors) or None, oldest)
