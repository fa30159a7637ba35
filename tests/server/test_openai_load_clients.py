"""What load generators and routers send, against real servers: usage on every streamed chunk
(`stream_options.continuous_usage_stats`, as guidellm, aiperf `--per-chunk-usage` and
`vllm bench serve` ask for it), any `model` name (sglang-router's PD mode forwards "unknown"),
`--served-model-name`, and short guidellm and aiperf runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PER_CHUNK: Any = {"include_usage": True, "continuous_usage_stats": True}
MESSAGES: Any = [{"role": "user", "content": "Count from one to ten."}]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _check_chunks(chunks: list[Any], n: int, num_prompts: int) -> dict[int, list[int]]:
    """Usage on every chunk; per choice the completion count never falls, ends at NEW_TOKENS
    and the prompt count stays that of the choice's prompt. Returns the prompt count per
    prompt; the last chunk (the final usage) totals them."""
    assert all(c.usage is not None for c in chunks)
    *choice_chunks, final = chunks
    assert final.choices == []
    prompts: dict[int, list[int]] = {}
    for index in range(n * num_prompts):
        own = [c.usage for c in choice_chunks if c.choices[0].index == index]
        counts = [u.completion_tokens for u in own]
        assert counts == sorted(counts) and counts[0] < counts[-1] == NEW_TOKENS, counts
        assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in own)
        prompts.setdefault(index // n, []).extend(u.prompt_tokens for u in own)
    assert all(len(set(counts)) == 1 for counts in prompts.values())
    assert final.usage.prompt_tokens == sum(counts[0] for counts in prompts.values())
    assert final.usage.completion_tokens == n * num_prompts * NEW_TOKENS
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    return prompts


def test_completions_usage_on_every_chunk(client: openai.OpenAI) -> None:
    kw: Any = {
        "model": MODEL,
        "prompt": ["The capital of France is", "1, 2, 3, 4,"],
        "max_tokens": NEW_TOKENS,
        "n": 2,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options=PER_CHUNK))
    _check_chunks(chunks, n=2, num_prompts=2)
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # include_usage alone: the final usage chunk only, as before.
    plain = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None


def test_chat_usage_on_every_chunk(client: openai.OpenAI) -> None:
    kw: Any = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": NEW_TOKENS,
        "n": 2,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options=PER_CHUNK))
    role_chunks = [c for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert len(role_chunks) == 2 and all(c.usage.completion_tokens == 0 for c in role_chunks)
    content = [c for c in chunks if c not in role_chunks]
    _check_chunks(content, n=2, num_prompts=1)
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_any_model_name_is_served(client: openai.OpenAI) -> None:
    for name in ("gpt-4o-mini", "unknown"):
        out = client.completions.create(model=name, prompt="The sky is", max_tokens=2)
        assert out.model == name and out.usage.completion_tokens == 2
        chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
        assert chat.model == name and chat.choices[0].message.content


@pytest.fixture(scope="module")
def named_server(tmp_path_factory: pytest.TempPathFactory, tiny_served_model: str) -> Iterator[str]:
    """A tiny model served as `tiny-served`: names and clients are checked, not outputs."""
    log = Path(tmp_path_factory.mktemp("named_server")) / "server.log"
    srv = ServerProcess(
        "--model-path", tiny_served_model, "--max-total-tokens", "4096",
        "--served-model-name", "tiny-served", log_path=log,
    )  # fmt: skip
    yield srv.url
    code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM: {srv.tail()}"


def test_served_model_name(named_server: str) -> None:
    with openai.OpenAI(base_url=named_server + "/v1", api_key="x", max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == ["tiny-served"]
        assert c.models.retrieve("tiny-served").id == "tiny-served"
        out = c.completions.create(model="unknown", prompt="Hi", max_tokens=2)
        assert out.model == "unknown"
    body = {"prompt": "Hi", "max_tokens": 2}
    r = requests.post(named_server + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "tiny-served"


def test_guidellm_run(named_server: str, tiny_served_model: str, tmp_path: Path) -> None:
    """guidellm's own client (chat completions, usage on every chunk): 0 errors."""
    pytest.importorskip("guidellm")
    out = tmp_path / "guidellm.json"
    cmd = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={named_server}",
        "--profile", "kind=concurrent,streams=2",
        "--constraint", "kind=max_requests,count=4",
        "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--tokenizer", f"kind=huggingface_auto,model={tiny_served_model}",
        "--output", f"kind=json,path={out}",
        "--disable-console",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.monotonic()
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert time.monotonic() - start < 60
    requests_ = json.loads(out.read_text())["benchmarks"][0]["requests"]
    assert len(requests_["errored"]) == 0 and len(requests_["incomplete"]) == 0
    assert len(requests_["successful"]) == 4
    for req in requests_["successful"]:
        body = json.loads(req["request_args"])["body"]
        assert body["stream_options"] == PER_CHUNK and body["model"] == "tiny-served"
        assert req["output_tokens"] == 8 and req["prompt_tokens"] > 0


AIPERF = Path(__file__).resolve().parents[2] / ".venvs" / "aiperf" / "bin" / "aiperf"


def test_aiperf_run(named_server: str, tiny_served_model: str, tmp_path: Path) -> None:
    """aiperf's own client in its own environment (see tests/aiperf.txt): streamed chat with
    usage on every chunk (`--per-chunk-usage`, which aiperf allows only with token counts
    taken from the server's usage), 0 errors, every output as long as asked."""
    if not AIPERF.exists():
        pytest.skip(f"no aiperf environment at {AIPERF.parent.parent}")
    out = tmp_path / "aiperf"
    cmd = [
        str(AIPERF), "profile", "--model", "tiny-served", "--url", named_server,
        "--endpoint-type", "chat", "--streaming", "--per-chunk-usage",
        "--use-server-token-count", "--tokenizer", tiny_served_model,
        "--request-count", "4", "--concurrency", "2", "--isl", "16", "--osl", "8",
        "--artifact-dir", str(out), "--ui-type", "none",
    ]  # fmt: skip
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and summary["was_cancelled"] is False, summary
    assert summary["request_count"]["avg"] == 4
    assert summary["output_sequence_length"]["min"] == summary["output_sequence_length"]["max"] == 8
    payloads = [t["payloads"][0] for t in json.loads((out / "inputs.json").read_text())["data"]]
    assert len(payloads) == 4
    assert all(p["stream_options"] == PER_CHUNK and p["stream"] is True for p in payloads)
