"""Waiting-queue order (`SchedulePolicy`) and prefill admission (`PrefillAdder`).

`lpm` sorts by the longest prefix match against the radix tree. Requests whose prefix is not
cached yet but is shared with a request ahead of them in the queue are held back for one
round: the request ahead fills the cache, and they hit it next round instead of computing the
same prefix twice in one batch. Among equal matches, the request that holds back the most
others goes first: its prefill unblocks them all (with a cold cache and several system
prompts arriving at once, mean time to first token falls). Past `LPM_FALLBACK_QUEUE_LEN`
waiting requests, matching every request costs more than it saves and the order falls back
to FCFS.

With `--enable-priority-scheduling` the queue is ordered by `priority` first (higher values
first, lower with `--schedule-low-priority-values-first`), and by the policy within one
priority level (a stable sort after the policy's order). Priority decides admission only: a
running request is never preempted for a more urgent one.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from mem_cache.radix_cache import RadixCache

if TYPE_CHECKING:
    from managers.req import Req
    from mem_cache.kv_manager import KVManager

LPM_FALLBACK_QUEUE_LEN = 128
# A request whose cached prefix is at most this long is checked against the waiting queue...
IN_BATCH_PREFIX_CHECK_THRESHOLD = 32
# ...and held back when it shares at least this many tokens with a request ahead of it.
IN_BATCH_PREFIX_HOLD_THRESHOLD = 32
# Decode growth reserved per running request is capped at this many tokens.
CLIP_MAX_NEW_TOKENS = 4096
SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")


def urgency(low_values_first: bool) -> Callable[[Req], int]:
    """Sort key of priority scheduling: the smaller, the sooner a request is admitted."""
    if low_values_first:
        return lambda r: r.admission.priority
    return lambda r: -r.admission.priority


class SchedulePolicy:
    def __init__(
        self, policy: str, kv: KVManager, by_priority: Callable[[Req], int] | None = None
    ) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"unknown schedule policy {policy!r}; choose one of {SCHEDULE_POLICIES}"
            )
        self.policy = policy
        self.kv = kv
        self.page_size = kv.page_size
        self.held_back: set[str] = set()
        self.by_priority = by_priority  # None: priorities are not used

    def calc_priority(self, waiting_queue: list[Req]) -> None:
        """Match every waiting request against the tree and reorder `waiting_queue` in place."""
        self._order_by_policy(waiting_queue)
        if self.by_priority is not None:
            waiting_queue.sort(key=self.by_priority)  # stable: policy order within a level

    def _order_by_policy(self, waiting_queue: list[Req]) -> None:
        self.held_back = set()
        policy = self.policy
        if policy == "lpm" and len(waiting_queue) > LPM_FALLBACK_QUEUE_LEN:
            policy = "fcfs"
        if policy == "fcfs":
            for req in waiting_queue:
                req.init_next_round_input(self.kv)
            return
        followers = self._match_and_find_held_back(waiting_queue)
        if policy == "lpm":
            waiting_queue.sort(
                key=lambda r: (r.rid in self.held_back, -r.kv.prefix_len(), -followers[r.rid])
            )
        else:
            waiting_queue[:] = self._dfs_weight_order(waiting_queue)

    def _match_and_find_held_back(self, waiting_queue: list[Req]) -> Counter[str]:
        """Match every request, fill `held_back`; return how many each request holds back."""
        # A pool-less tree of the uncached prompts seen so far in this round; each token's
        # value is the queue position of the request that inserted it.
        in_batch = RadixCache(page_size=self.page_size)
        followers: Counter[str] = Counter()
        for i, req in enumerate(waiting_queue):
            req.init_next_round_input(self.kv)
            if req.kv.prefix_len() > IN_BATCH_PREFIX_CHECK_THRESHOLD:
                continue
            key = req.fill_ids
            shared = in_batch.match_prefix(key, extra_key=req.extra_key).device_indices
            if len(shared) >= IN_BATCH_PREFIX_HOLD_THRESHOLD:
                self.held_back.add(req.rid)
                followers[waiting_queue[int(shared[-1])].rid] += 1
            else:
                in_batch.insert(key, torch.full((len(key),), i, dtype=torch.int64), req.extra_key)
        return followers

    def _dfs_weight_order(self, waiting_queue: list[Req]) -> list[Req]:
        """Visit the tree depth-first, heaviest subtree (most waiting requests) first."""
        by_node: dict[int, list[Req]] = defaultdict(list)
        nodes: dict[int, object] = {}
        for req in waiting_queue:
            by_node[id(req.kv.last_node)].append(req)
            nodes[id(req.kv.last_node)] = req.kv.last_node
        weight: dict[int, int] = defaultdict(int)
        for node_id, reqs in by_node.items():
            node = nodes[node_id]
            while node is not None:
                weight[id(node)] += len(reqs)
                node = node.parent
        root = self.kv.tree_root()
        if root is None:
            return waiting_queue
        order: list[Req] = []
        stack = [root]
        while stack:
            node = stack.pop()
            order.extend(by_node.get(id(node), []))
            kids = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
            kids.sort(key=lambda c: weight[id(c)])  # heaviest popped first
            stack.extend(kids)
        seen = {id(r) for r in order}
        return order + [r for r in waiting_queue if id(r) not in seen]


class AddResult(Enum):
    CONTINUE = auto()
    NO_TOKEN = auto()  # the total-token budget is exhausted
    OTHER = auto()  # prefill or chunk budget, or the running-request cap


class PrefillAdder:
    """Admit waiting requests under three budgets: total tokens, prefill tokens, chunk size.

    The total-token budget is the KV that is free or evictable, minus what running requests
    are expected to still grow by (`new_token_ratio` times their remaining `max_new_tokens`).
    """

    def __init__(
        self,
        kv: KVManager,
        available_tokens: int,
        running_reqs: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunk_size: int | None,
        max_new_reqs: int,
        page_size: int = 1,
    ) -> None:
        self.kv = kv
        self.new_token_ratio = new_token_ratio
        self.page_size = page_size
        self.has_running = bool(running_reqs)
        self.rem_total_tokens = available_tokens - sum(
            self._decode_reserve(r) for r in running_reqs
        )
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunk_size
        self.rem_reqs = max_new_reqs
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None
        self.log_input_tokens = 0
        self.log_hit_tokens = 0

    def _decode_reserve(self, req: Req) -> float:
        max_new = req.sampling_params.max_new_tokens or 0
        remaining = max(max_new - len(req.output_ids), 0)
        return min(remaining, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def _lock(self, req: Req) -> None:
        self.rem_total_tokens += self.kv.lock(req.kv)  # <= 0: the prefix leaves the budget

    def _unlock(self, req: Req) -> None:
        self.rem_total_tokens += self.kv.unlock(req.kv)

    def _check_budgets(self, req: Req, extend: int) -> AddResult | None:
        # With nothing else running, a request only needs room for its prompt: if it then
        # outgrows the pool, it is finished with an error instead of waiting forever.
        alone = not self.can_run_list and not self.has_running
        reserve = 0.0 if alone else self._decode_reserve(req)
        if extend + self._page_slack() + reserve > self.rem_total_tokens:
            return AddResult.NO_TOKEN
        chunk = self.rem_chunk_tokens
        this_round = (
            extend if chunk is None else min(extend, chunk // self.page_size * self.page_size)
        )
        if this_round <= 0 or (self.can_run_list and this_round > self.rem_input_tokens):
            return AddResult.OTHER
        return None

    def _page_slack(self) -> int:
        """Slots a request may take beyond its tokens: the rest of a fresh last page."""
        return self.page_size - 1

    def _take(self, req: Req, extend_len: int) -> None:
        self.can_run_list.append(req)
        self.rem_total_tokens -= extend_len + self._page_slack() + self._decode_reserve(req)
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len
        self.rem_reqs -= 1
        self.log_input_tokens += extend_len
        self.log_hit_tokens += req.kv.prefix_len()

    def add_chunked_req(self, req: Req) -> None:
        """Continue a chunked prompt; its prefix is already locked."""
        remaining = req.seq_len() - req.kv.prefix_len()
        chunk = (
            remaining if self.rem_chunk_tokens is None else min(remaining, self.rem_chunk_tokens)
        )
        req.set_chunk(chunk)
        self._take(req, chunk)
        if req.is_chunked:
            self.new_chunked_req = req

    def add_one_req(self, req: Req) -> AddResult:
        if self.rem_reqs <= 0:
            return AddResult.OTHER
        extend = req.extend_input_len()
        # Lock first: the matched prefix stops being evictable, so it leaves the budget.
        self._lock(req)
        result = self._check_budgets(req, extend)
        if result is not None:
            self._unlock(req)
            return result
        if self.rem_chunk_tokens is not None and extend > self.rem_chunk_tokens:
            chunk = self.rem_chunk_tokens // self.page_size * self.page_size
            req.set_chunk(chunk)
            self._take(req, chunk)
            self.new_chunked_req = req
            return AddResult.OTHER
        req.set_chunk(extend)
        self._take(req, extend)
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return AddResult.OTHER
        return AddResult.CONTINUE
