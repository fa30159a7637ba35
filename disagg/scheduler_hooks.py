"""Build the scheduler's disaggregation side for `--disaggregation-mode`."""

from __future__ import annotations

from typing import Any

from disagg.base import KVArgs


def create_disagg(scheduler: Any, worker: Any) -> Any:
    mode = scheduler.server_args.disaggregation_mode
    if mode == "null":
        return None
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise ValueError("disaggregation needs a model worker with a KV pool")
    kv = KVArgs.from_pool(runner.token_to_kv_pool)
    if mode == "prefill":
        from disagg.prefill import PrefillDisagg

        return PrefillDisagg(scheduler, kv)
    from disagg.decode import DecodeDisagg

    return DecodeDisagg(scheduler, kv)
