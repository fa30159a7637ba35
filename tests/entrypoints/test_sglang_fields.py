"""`/generate` knows every field of the installed SGLang's request structs: each field of
`GenerateReqInput` and of `SamplingParams` (read from the package's source, so nothing of
SGLang is imported) is honoured, a no-op or refused in `srt/entrypoints/native_fields.py`. A
field a new SGLang release adds fails here. Also what SGLang's clients send with their
defaults (`bench_serving`'s `return_routed_experts: false`, the frontend's `stop_regex: []`)
is accepted, and `sampling_seed`, `extra_key` / `cache_salt` and `stop_regex` are checked."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from managers.errors import RequestError
from srt.entrypoints.native_fields import ENCODE_FIELDS, GENERATE_FIELDS, SAMPLING_FIELDS
from srt.entrypoints.native_protocol import parse_generate


def sglang_source(relative: str) -> str:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed")
    return (Path(spec.origin).parent / relative).read_text()


def class_fields(source: str, name: str) -> list[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [
                st.target.id
                for st in node.body
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
            ]
    raise AssertionError(f"{name} not found in the installed sglang")


@pytest.mark.parametrize(
    ("path", "cls", "table"),
    [
        ("srt/managers/io_struct.py", "GenerateReqInput", GENERATE_FIELDS),
        ("srt/sampling/sampling_params.py", "SamplingParams", SAMPLING_FIELDS),
        ("srt/managers/io_struct.py", "EmbeddingReqInput", ENCODE_FIELDS),
    ],
)
def test_every_field_of_the_installed_sglang_is_classified(
    path: str, cls: str, table: dict[str, Any]
) -> None:
    names = class_fields(sglang_source(path), cls)
    assert len(names) > 10
    missing = sorted(set(names) - set(table))
    assert not missing, f"SGLang's {cls} fields with no rule in native_fields.py: {missing}"


def parse(body: dict[str, Any]) -> list[Any]:
    return parse_generate(body, max_batch_size=64)[0]


def test_what_sglang_clients_send_with_defaults_is_accepted() -> None:
    source = sglang_source("benchmark/serving.py")
    assert '"return_routed_experts"' in source  # bench_serving still sends it
    [obj] = parse(
        {
            "text": "Hi",
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": 8,
                "ignore_eos": True,
                "stop_regex": [],
                "stream_interval": 1,
                "beam_width": None,
            },
            "stream": True,
            "return_logprob": False,
            "return_routed_experts": False,
            "routed_experts_start_len": 0,
            "log_metrics": True,
            "custom_labels": {"team": "a"},
            "lora_path": None,
        }
    )
    assert obj.sampling_params == {
        "temperature": 0.0,
        "max_new_tokens": 8,
        "ignore_eos": True,
        "stop_regex": [],
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "Hi", "return_routed_experts": True}, "return_routed_experts"),
        ({"text": "Hi", "session_params": {"id": "s"}}, "session_params"),
        ({"text": "Hi", "received_time": 1.0}, "received_time"),
        ({"text": "Hi", "sampling_params": {"beam_width": 4}}, "beam_width"),
        ({"text": "Hi", "sampling_params": {"stream_interval": "2"}}, "stream_interval"),
        ({"text": "Hi", "sampling_params": {"stop_strs": ["x"]}}, "stop_strs"),
        ({"text": "Hi", "sampling_params": {"seed": 1, "sampling_seed": 2}}, "sampling_seed"),
        ({"text": ["a", "b"], "extra_key": ["k"]}, "extra_key"),
        ({"text": "Hi", "cache_salt": 3}, "cache_salt"),
    ],
)
def test_refused_fields_name_themselves(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        parse(body)
    assert info.value.param == param and info.value.status_code == 400


def test_sampling_seed_is_seed_and_cache_keys_are_per_prompt() -> None:
    [obj] = parse({"text": "Hi", "sampling_params": {"sampling_seed": 7}})
    assert obj.sampling_params == {"seed": 7}
    a, b = parse({"text": ["a", "b"], "extra_key": "k", "cache_salt": ["s", None]})
    assert a.extra_key == "k\0s" and b.extra_key == "k\0"
    [plain] = parse({"text": "Hi"})
    assert plain.extra_key is None


@pytest.mark.parametrize(
    ("stop_regex", "why"),
    [("(a", "not a valid regular expression"), ([""], "empty"), (["x"] * 17, "at most 16")],
)
def test_bad_stop_regex_is_refused(stop_regex: Any, why: str) -> None:
    from srt.sampling.sampling_params import SamplingParams

    params = SamplingParams.from_dict({"stop_regex": stop_regex})
    params.normalize()
    with pytest.raises(ValueError, match=why):
        params.verify()
