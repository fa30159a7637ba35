"""What `/generate` does with every field SGLang's clients send: the top level of a body
(`GENERATE_FIELDS`, after SGLang's `GenerateReqInput`) and each `sampling_params` dict
(`SAMPLING_FIELDS`, after SGLang's `SamplingParams`); and `/encode`'s (`ENCODE_FIELDS`, after
SGLang's `EmbeddingReqInput`).

Each field is honoured, a no-op (accepted, type-checked, dropped: it cannot change the output
here) or refused with a reason, as on the OpenAI routes (`openai/fields.py`); anything else is
a 400 naming it. SGLang adds fields every release and its clients send many of them with
their defaults (`bench_serving` sends `return_routed_experts: false`, the frontend
`stop_regex: []`), so a refused field still accepts the value that asks for nothing (null,
or its default). `tests/entrypoints/test_sglang_fields.py` reads both field lists from the
installed `sglang` package: a field a new release adds fails that test, not our users.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from srt.entrypoints.openai.fields import FieldTable, accepts, honoured, no_op, refused
from srt.sampling.sampling_params import COMPUTED_FIELDS, SamplingParams

_TEXT_ONLY = "not supported: this server serves a text-only model"
_INTERNAL = "SGLang's internal field, set by its own server, not by clients"
_NOT_MOE = "not supported: no routed experts (this server runs dense models)"


def _refused_unless(value: Any, why: str) -> Any:
    return refused(f"not supported: {why}", accepts(value), "sglang")


# sglang-router's PD mode re-serializes each body from its own request struct, so it adds
# `model: null`, `log_metrics: true` and `false` for the switches: those values are accepted.
GENERATE_FIELDS: FieldTable = {
    "text": honoured("a prompt or a batch of prompts", "sglang"),
    "input_ids": honoured("token ids, or a batch of them", "sglang"),
    "sampling_params": honoured("SamplingParams fields, one dict or one per prompt", "sglang"),
    "rid": honoured("request id(s), for /abort_request", "sglang"),
    "stream": honoured("server-sent events", "sglang"),
    "return_logprob": honoured("logprobs in meta_info", "sglang"),
    "logprob_start_len": honoured("first prompt position with logprobs", "sglang"),
    "top_logprobs_num": honoured("top logprobs per position", "sglang"),
    "return_text_in_logprobs": honoured("token texts in the logprobs", "sglang"),
    "bootstrap_host": honoured("prefill/decode disaggregation", "sglang"),
    "bootstrap_port": honoured("prefill/decode disaggregation", "sglang"),
    "bootstrap_room": honoured("prefill/decode disaggregation", "sglang"),
    "timeout": honoured("seconds the request may take in all", "sglang"),
    "priority": honoured("scheduling priority (--enable-priority-scheduling)", "sglang"),
    "extra_key": honoured("a prefix-cache namespace: only equal keys share KV", "sglang"),
    "cache_salt": honoured("a prefix-cache namespace, with extra_key", "sglang"),
    # No-ops: hints for SGLang's routers, metrics and tracing; none changes the output.
    "model": no_op(str | None, "a router's model name; this server serves one model", "sglang"),
    "log_metrics": no_op(bool, "SGLang's per-request metrics switch", "sglang"),
    "no_logs": no_op(bool, "SGLang's request-logging switch", "sglang"),
    "custom_labels": no_op(dict[str, str] | None, "labels of SGLang's metrics", "sglang"),
    "external_trace_header": no_op(dict[str, Any] | None, "a tracing context", "sglang"),
    "routing_key": no_op(str | None, "a router's sticky-routing key", "sglang"),
    "conversation_id": no_op(str | None, "a router's conversation key", "sglang"),
    "decode_tp_size": no_op(int | list[int | None] | None, "a PD router's hint", "sglang"),
    "bootstrap_pair_key": no_op(str | list[str | None] | None, "a PD router's hint", "sglang"),
    # Refused unless they ask for nothing (null, or SGLang's default).
    "return_routed_experts": _refused_unless(False, _NOT_MOE),
    "routed_experts_start_len": _refused_unless(0, _NOT_MOE),
    "return_indexer_topk": _refused_unless(False, "no sparse-attention indexer"),
    "return_hidden_states": _refused_unless(False, "hidden states are not returned"),
    "return_bytes": _refused_unless(False, "token bytes are not returned"),
    "return_entropy": _refused_unless(False, "entropies are not returned"),
    "return_prompt_token_ids": _refused_unless(False, "prompt token ids are not returned"),
    "return_sampling_mask": _refused_unless(False, "sampling masks are not returned"),
    "return_flat_raw_top_logprobs": _refused_unless(False, "flat raw logprobs"),
    "return_flat_raw_output_top_logprobs": _refused_unless(False, "flat raw logprobs"),
    "return_flat_raw_top_logprobs_b64": _refused_unless(False, "flat raw logprobs"),
    "background": _refused_unless(False, "no background requests"),
    "require_reasoning": _refused_unless(False, "use the chat route's reasoning parser"),
    "use_audio_in_video": _refused_unless(False, _TEXT_ONLY.removeprefix("not supported: ")),
    "need_wait_for_mm_inputs": _refused_unless(False, _TEXT_ONLY.removeprefix("not supported: ")),
    "token_ids_logprob": refused("not supported: use top_logprobs_num", origin="sglang"),
    "sampling_logprobs_mode": refused("not supported: logprobs of the raw model", origin="sglang"),
    "max_thinking_tokens": refused("not supported: no thinking budget", origin="sglang"),
    "session_id": refused("not supported: no sessions", origin="sglang"),
    "session_params": refused("not supported: no sessions", origin="sglang"),
    "lora_path": refused("not supported: this server serves no LoRA adapters", origin="sglang"),
    "lora_id": refused("not supported: this server serves no LoRA adapters", origin="sglang"),
    "custom_logit_processor": refused("not supported: no custom logit processors", origin="sglang"),
    "watermark": refused("not supported: no watermarking", origin="sglang"),
    "positional_embed_overrides": refused("not supported", origin="sglang"),
    "input_embeds": refused("not supported: send text or input_ids", origin="sglang"),
    "kv_hints": refused("not supported: no KV hints", origin="sglang"),
    "multi_item_delimiter_indices": refused(
        "not supported: no multi-item scoring", origin="sglang"
    ),
    "token_indices_to_pool": refused(
        "not supported: an embedding server pools as its model's configuration says",
        origin="sglang",
    ),
    "data_parallel_rank": refused("not supported: no data parallelism", origin="sglang"),
    "routed_dp_rank": refused("not supported: no data parallelism", origin="sglang"),
    "disagg_prefill_dp_rank": refused("not supported: no data parallelism", origin="sglang"),
    **{
        name: refused(_TEXT_ONLY, origin="sglang")
        for name in (
            "image_data",
            "video_data",
            "audio_data",
            "mm_hashes",
            "mm_content_hashes",
            "video_config",
            "modalities",
            "encoder_urls",
            "max_dynamic_patch",
            "min_dynamic_patch",
            "image_max_dynamic_patch",
            "video_max_dynamic_patch",
            "images_config",
            "mm_processor_kwargs",
        )
    },
    **{
        name: refused(_INTERNAL, origin="sglang")
        for name in ("http_worker_ipc", "received_time", "num_items_assigned")
    },
}

# `/encode` (an embedding server, `--is-embedding`), after SGLang's `EmbeddingReqInput`:
# where a field means what it means on `/generate`, the rule is the same one.
ENCODE_FIELDS: FieldTable = {
    **{
        name: GENERATE_FIELDS[name]
        for name in (
            "text",
            "input_ids",
            "rid",
            "priority",
            "log_metrics",
            "routing_key",
            "external_trace_header",
            "input_embeds",
            "image_data",
            "video_data",
            "audio_data",
            "modalities",
            "lora_path",
            "lora_id",
            "positional_embed_overrides",
            "background",
            "return_prompt_token_ids",
            "multi_item_delimiter_indices",
            "token_indices_to_pool",
            "http_worker_ipc",
            "received_time",
        )
    },
    "dimensions": honoured("Matryoshka truncation, where the model was trained for it", "sglang"),
    # SGLang's clients send `{"max_new_tokens": 0}` or nothing: an embedding generates nothing.
    "sampling_params": refused(
        "an embedding request generates nothing; only {} or max_new_tokens 0 are accepted",
        lambda value, body: value is None or value in ({}, {"max_new_tokens": 0}),
        "sglang",
    ),
    "return_pooled_hidden_states": _refused_unless(False, "the pooled vector is the output"),
    "is_cross_encoder_request": _refused_unless(False, "no cross-encoder (rerank) models"),
    "embed_override_token_id": refused("not supported: no embedding overrides", origin="sglang"),
    "embed_overrides": refused("not supported: no embedding overrides", origin="sglang"),
    "decision_layout": refused("not supported: no decision layouts", origin="sglang"),
}

# Keys of a `sampling_params` dict: our dataclass's fields (so a field added there is
# accepted at once), less those `normalize()` computes; then SGLang's others.
SAMPLING_PARAM_KEYS = frozenset(
    f.name for f in dataclasses.fields(SamplingParams) if f.name not in COMPUTED_FIELDS
)
SAMPLING_FIELDS: FieldTable = {
    **{name: honoured("a SamplingParams field", "sglang") for name in SAMPLING_PARAM_KEYS},
    "sampling_seed": honoured("SGLang's name for seed", "sglang"),
    "stream_interval": no_op(
        int | None, "tokens per streamed chunk; streams here send every step's tokens", "sglang"
    ),
    "beam_width": refused("not supported: no beam search", accepts(0, 1), "sglang"),
    "structural_tag": refused("not supported: no structural tags", origin="sglang"),
    "custom_params": refused("not supported: no custom logit processors", origin="sglang"),
    "watermark": refused("not supported: no watermarking", origin="sglang"),
    "ebnf_full_assistant": _refused_unless(False, "the EBNF constrains the output only"),
    **{
        name: refused(_INTERNAL, origin="sglang")
        for name in (
            "stop_strs",
            "stop_regex_strs",
            "stop_str_max_len",
            "stop_regex_max_len",
            "is_normalized",
        )
    },
}
