"""Prometheus metrics of one server, with SGLang's names (plus the vLLM-named gauges and
prefix-cache counters that inference gateways score on). The tokenizer manager feeds them:
request timings and token counts as outputs arrive, and scheduler gauges from the
`SchedulerStats` the scheduler sends.

Counters are exposed with the `_total` suffix (`sglang:cached_tokens_total`,
`vllm:prefix_cache_hits_total`); token counters move when a request finishes.

Each server gets its own `CollectorRegistry`, so several engines in one process never clash.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from managers.io_struct import SchedulerStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 60, 120, 300, 600, 1200)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            g = Gauge(name, doc, list(labels), registry=self.registry)
            return g.labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            c = Counter(name, doc, list(labels), registry=self.registry)
            return c.labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry)
            return h.labels(**labels)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "Running requests")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "Requests in the waiting queue")
        self.token_usage = gauge("sglang:token_usage", "Fraction of the KV pool in use")
        self.cache_hit_rate = gauge(
            "sglang:cache_hit_rate", "Prefix-cache hit rate of the last prefill batch"
        )
        self.gen_throughput = gauge("sglang:gen_throughput", "Generation throughput (token/s)")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Generated tokens of finished requests"
        )
        self.cached_tokens = counter(
            "sglang:cached_tokens",
            "Prompt tokens of finished requests served from the prefix cache",
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache"
        )
        self.num_used_tokens = gauge(
            "sglang:num_used_tokens", "KV slots held by requests (neither free nor evictable)"
        )
        self.num_queued_tokens = gauge(
            "radixrt:num_queued_tokens", "Prompt tokens of the requests not admitted yet"
        )
        self.num_retracted = counter(
            "sglang:num_retracted_requests", "Requests retracted because the KV pool was full"
        )
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds", "End-to-end request latency", E2E_BUCKETS
        )
        self.vllm_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.vllm_running = gauge("vllm:num_requests_running", "Requests running")
        self.vllm_kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1")
        self.worker_idle = counter(
            "radixrt:worker_idle_seconds",
            "Time the model worker waited for the scheduler between consecutive forwards",
        )
        self.worker_busy = counter("radixrt:worker_busy_seconds", "Time spent in forwards")
        self.worker_idle_fraction = gauge(
            "radixrt:worker_idle_fraction",
            "Share of the last stats interval the model worker waited for the scheduler",
        )
        self._retracted_seen = 0
        self._worker_seen = (0.0, 0.0)

    def on_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_running_reqs.set(stats.num_running_reqs)
        self.num_queue_reqs.set(stats.num_queue_reqs)
        self.token_usage.set(stats.token_usage)
        self.cache_hit_rate.set(stats.cache_hit_rate)
        self.gen_throughput.set(stats.gen_throughput)
        self.vllm_running.set(stats.num_running_reqs)
        self.vllm_waiting.set(stats.num_queue_reqs)
        self.vllm_kv_usage.set(stats.token_usage)
        self.num_used_tokens.set(stats.num_used_tokens)
        self.num_queued_tokens.set(stats.num_queued_tokens)
        idle = stats.worker_idle_s - self._worker_seen[0]
        busy = stats.worker_busy_s - self._worker_seen[1]
        if idle + busy > 0:
            self.worker_idle.inc(idle)
            self.worker_busy.inc(busy)
            self.worker_idle_fraction.set(idle / (idle + busy))
            self._worker_seen = (stats.worker_idle_s, stats.worker_busy_s)
        if stats.num_retracted_reqs > self._retracted_seen:
            self.num_retracted.inc(stats.num_retracted_reqs - self._retracted_seen)
            self._retracted_seen = stats.num_retracted_reqs

    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_tokens(self, interval: float, num_tokens: int) -> None:
        """`num_tokens` tokens arrived `interval` seconds after the previous ones."""
        per_token = interval / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(per_token)

    def on_finish(
        self, e2e: float, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> None:
        """A request finished: `cached_tokens` of its `prompt_tokens` came from the prefix
        cache (its `meta_info.cached_tokens`)."""
        self.e2e.observe(e2e)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
