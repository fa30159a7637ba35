"""A sparse (mixture-of-experts) MLP: a router picks `top_k` experts per token, and each
expert, a gated MLP, runs once over all the tokens routed to it.

`SparseMoE.forward` (the grouped path): the router's softmax in float32, top-k, optionally
renormalised (`norm_topk_prob`; Mixtral always), then the (token, slot) pairs sorted by
expert so each active expert's tokens are one contiguous group: one [n, hidden] x [hidden,
2 * inter] GEMM, the activation, one [n, inter] x [inter, hidden] GEMM, and the weighted rows
added back into their tokens. A decode step of batch B runs at most min(E, B * top_k)
expert GEMMs instead of B * top_k matrix-vector products, and reads each active expert's
weights once. `forward_per_token` is the reference it is tested against (and the baseline of
`python -m bench.moe_step`): every token's experts one at a time.

Weights: `w13` [E, 2 * inter, hidden] (gate rows, then up rows) and `w2` [E, hidden, inter],
loaded expert by expert from HF's per-expert tensors (`load_expert`); on a CPU each expert's
two weights are packed like a dense linear's (`pack_for_cpu`): `F.linear` on a plain weight
re-blocks it every call, which at an expert's few rows costs more than the product. Tensor parallelism
shards every expert's intermediate dimension (this rank's balanced range of gate, up and the
matching columns of down), so each rank computes a partial sum of every expert's output and
one all-reduce per layer completes it, as the dense MLP's row-parallel down projection does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed import TPGroup
from srt.distributed.partition import balanced_range
from srt.layers.cpu_packed import PackedWeight, apply_linear

# HF's per-expert names -> which part of the fused weights they are.
GATE, UP, DOWN = "gate", "up", "down"


class SparseMoE(nn.Module):
    # The expert groups' sizes are read on the host each forward (one GEMM pair per active
    # expert), which a CUDA graph cannot capture: the runner leaves decode graphs off.
    cuda_graph_capturable = False

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter_range = balanced_range(intermediate_size, self.tp.size, self.tp.rank)
        inter = self.inter_range[1] - self.inter_range[0]
        self.inter = inter
        # The router is replicated: every rank routes every token the same way.
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        # Per expert, the packed copies the CPU matmuls read (`pack_for_cpu`); None: F.linear.
        self.packed13: list[PackedWeight | None] = [None] * num_experts
        self.packed2: list[PackedWeight | None] = [None] * num_experts

    def pack_for_cpu(self) -> bool:
        """Pack every expert's two weights as a dense linear's are (`cpu_packed.py`): the
        small-row panels matter most here, an expert's share of a step being a few rows."""
        self.packed13 = [PackedWeight.pack(w) for w in self.w13]
        self.packed2 = [PackedWeight.pack(w) for w in self.w2]
        return bool(self.packed_weights())

    def packed_weights(self) -> list[PackedWeight]:
        return [p for p in self.packed13 + self.packed2 if p is not None]

    def load_expert(self, expert: int, part: str, full: torch.Tensor) -> None:
        """One expert's HF tensor (gate or up [inter, hidden], down [hidden, inter]), cut to
        this rank's range of the intermediate dimension."""
        lo, hi = self.inter_range
        with torch.no_grad():
            if part == DOWN:
                self.w2[expert].copy_(full[:, lo:hi])
            else:
                rows = slice(0, self.inter) if part == GATE else slice(self.inter, 2 * self.inter)
                self.w13[expert, rows].copy_(full[lo:hi])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] in x's dtype, expert ids [T, top_k]), as HF routes."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = apply_linear(rows, self.w13[e], None, self.packed13[e])
        act = F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]
        return apply_linear(act, self.w2[e], None, self.packed2[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        # Each pair's expert output, in expert order; then back in (token, slot) order by one
        # gather, and summed over the slots: no scatter-add per expert, which on a CPU costs
        # more than a small group's GEMMs (`python -m bench.moe_step` measures the step).
        ys = x.new_empty(flat.numel(), x.shape[-1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self._expert(
                    e, x.index_select(0, tokens[start : start + n])
                )
                start += n
        pairs = ys.index_select(0, torch.argsort(order)).view(*ids.shape, -1)
        out = (pairs * weights.unsqueeze(-1)).sum(dim=1)
        return self.tp.all_reduce(out)

    def forward_per_token(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: each token's experts, one by one."""
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for slot in range(self.top_k):
                e = int(ids[t, slot])
                out[t] += weights[t, slot] * self._expert(e, x[t : t + 1])[0]
        return self.tp.all_reduce(out)
