"""Tensor parallelism: what a rank needs to join (`spec.py`), process groups (`group.py`) and
the arithmetic of a rank's share (`partition.py`).

The names below are imported from their submodule on first use, so a process that needs
only a spec (the HTTP server's main process) does not import torch.
"""

from __future__ import annotations

from srt.utils.lazy import lazy_exports

_SUBMODULE = {
    "TPSpec": "srt.distributed.spec",
    "node_specs": "srt.distributed.spec",
    "TPGroup": "srt.distributed.group",
    "TPInitError": "srt.distributed.group",
    "TPPeerLost": "srt.distributed.group",
    "init_tp_group": "srt.distributed.group",
    "HeadLayout": "srt.distributed.partition",
    "VocabLayout": "srt.distributed.partition",
    "balanced_range": "srt.distributed.partition",
    "head_layout": "srt.distributed.partition",
    "vocab_layout": "srt.distributed.partition",
}

__getattr__ = lazy_exports(__name__, _SUBMODULE)
