"""Which combinations of server flags are valid: checked when a `ServerArgs` is built, so a bad
command line fails at once, before any model loads. Kept apart from the flags themselves
(`srt/server_args.py`) and, like them, cheap to import."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.utils.registry import import_target

if TYPE_CHECKING:
    from srt.server_args import ServerArgs


def check_server_args(args: ServerArgs) -> None:
    """Raise ValueError naming the flag(s) at fault."""
    if args.page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {args.page_size}")
    if not args.watchdog_timeout > 0:
        raise ValueError(f"watchdog_timeout must be > 0 s, got {args.watchdog_timeout}")
    _check_parallelism(args)
    if args.is_embedding and args.disaggregation_mode != "null":
        raise ValueError("--is-embedding runs no decode: it cannot be one side of a PD pair")
    if args.speculative_algorithm is not None:
        _check_speculative(args)
    if args.kv_events_config is not None:
        # Parsed now, so that a bad config fails at once rather than after the model loads.
        import_target("mem_cache.kv_events:KVEventsConfig").from_json(args.kv_events_config)


def _check_speculative(args: ServerArgs) -> None:
    if args.is_embedding:
        raise ValueError("--speculative-algorithm: an embedding server decodes nothing")
    if args.speculative_num_draft_tokens < 1:
        raise ValueError("--speculative-num-draft-tokens must be >= 1")
    lo = args.speculative_ngram_min_match_window_size
    if not 1 <= lo <= args.speculative_ngram_max_match_window_size:
        raise ValueError(
            "need 1 <= --speculative-ngram-min-match-window-size <= "
            "--speculative-ngram-max-match-window-size"
        )


def _check_parallelism(args: ServerArgs) -> None:
    if args.tp_size < 1 or args.nnodes < 1:
        raise ValueError(f"tp_size and nnodes must be >= 1, got {args.tp_size}, {args.nnodes}")
    if args.tp_size % args.nnodes:
        raise ValueError(f"tp_size {args.tp_size} must be a multiple of nnodes {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"node_rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address)")
    if not args.dist_timeout > 0:
        raise ValueError(f"dist_timeout must be > 0 s, got {args.dist_timeout}")
    if args.tp_size > 1 and args.disaggregation_mode != "null":
        raise ValueError(
            "PD disaggregation with --tp-size > 1 is not supported yet: the KV transfer "
            "moves one pool, and each rank holds only its own KV heads"
        )
