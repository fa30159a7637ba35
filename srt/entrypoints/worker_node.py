"""`serve_worker_node(server_args)`: a node with `--node-rank > 0` of a multi-node
tensor-parallel group. `launch_server` runs it instead of the HTTP server.

    node 0:  launch_server --tp-size 2 --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:29500
    node 1:  launch_server --tp-size 2 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:29500

Such a node runs only its scheduler ranks: no tokenizer manager, detokenizer or HTTP. The
ranks take their inputs from rank 0 (on node 0) over the group, so there is nothing else to
serve. The node lives as long as its ranks: it exits 1 when any of them dies (a lost peer
makes a rank exit with `TP_PEER_LOST_EXIT_CODE`, which is how node 0 going away ends this
node too), and 0 on SIGTERM/SIGINT, after killing them. The ranks die with this process
(see `srt.utils.process.become_child`).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from srt.entrypoints.subprocesses import ChildProcesses, ChildStartError
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def serve_worker_node(server_args: ServerArgs) -> int:
    """Run this node's ranks until one dies (exit 1) or SIGTERM/SIGINT (exit 0)."""
    local = server_args.tp_size // server_args.nnodes
    first = server_args.node_rank * local
    children = ChildProcesses(server_args)
    try:
        children.wait_ready()
    except ChildStartError as e:
        logger.error("%s", e)
        return 1
    done = threading.Event()
    died: list[str] = []

    def on_death(reason: str) -> None:
        died.append(reason)
        done.set()

    def on_signal(sig: int, frame: Any) -> None:
        logger.info("%s: stopping the scheduler ranks.", signal.Signals(sig).name)
        done.set()

    children.watch(on_death)
    originals = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    logger.info(
        "Node %d of %d ready: tensor-parallel rank%s of %d; rank 0 is at %s.",
        server_args.node_rank,
        server_args.nnodes,
        f" {first}" if local == 1 else f"s {first}..{first + local - 1}",
        server_args.tp_size,
        server_args.dist_init_addr,
    )
    try:
        while not done.wait(1.0):  # a timed wait, so that signal handlers get to run
            pass
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)
        children.stop()  # the watcher already did, after a death
    return 1 if died else 0
