"""Tensor parallelism: process groups (`group.py`) and the arithmetic of a rank's share
(`partition.py`)."""

from srt.distributed.group import (
    TPGroup,
    TPInitError,
    TPPeerLost,
    TPSpec,
    init_tp_group,
    node_specs,
)
from srt.distributed.partition import (
    HeadLayout,
    VocabLayout,
    balanced_range,
    head_layout,
    vocab_layout,
)

__all__ = [
    "HeadLayout",
    "TPGroup",
    "TPInitError",
    "TPPeerLost",
    "TPSpec",
    "VocabLayout",
    "balanced_range",
    "head_layout",
    "init_tp_group",
    "node_specs",
    "vocab_layout",
]
