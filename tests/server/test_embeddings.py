"""An embedding server (`--is-embedding`) against sentence-transformers, through the openai
client and SGLang's native `/encode`.

The model is a tiny random Qwen3 laid out as Qwen3-Embedding is (a bare base model with
sentence-transformers' Pooling and Normalize modules, `tiny_models.save_tiny_embedding_model`);
sentence-transformers loads the same folder with HF transformers and is the reference. Prompts
longer than the server's chunk size run in several chunks; repeated prompts are read from the
radix cache.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from tests.engine.tiny_models import save_tiny_embedding_model
from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow

CHUNK = 16  # --chunked-prefill-size: the long prompts below run in several chunks
TEXTS = [
    "Hello world.",
    (
        "The quick brown fox jumps over the lazy dog, and then it runs far away into the "
        "woods where nobody can find it again for a very long time."
    ),
    "The quick brown fox jumps over the lazy dog, and then it sleeps.",
    "x",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, default_model_path: str) -> Path:
    path = tmp_path_factory.mktemp("tiny-embedding")
    return save_tiny_embedding_model(path, default_model_path, matryoshka_dimensions=[32, 64])


@pytest.fixture(scope="module")
def reference(folder: Path) -> np.ndarray:
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(folder), device="cpu")
    return model.encode(TEXTS, convert_to_numpy=True)


@pytest.fixture(scope="module")
def embedding_server(
    folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("embedding-server") / "server.log"
    srv = ServerProcess(
        "--model-path",
        str(folder),
        "--is-embedding",
        "--dtype",
        "float32",
        "--chunked-prefill-size",
        str(CHUNK),
        "--max-total-tokens",
        "4096",
        log_path=log,
    )
    yield srv
    assert srv.stop() == 0, srv.tail()


@pytest.fixture(scope="module")
def client(embedding_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=embedding_server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_embeddings_equal_sentence_transformers(
    client: openai.OpenAI, reference: np.ndarray
) -> None:
    out = client.embeddings.create(model="tiny", input=TEXTS)
    got = np.array([d.embedding for d in out.data])
    assert [d.index for d in out.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(got, reference, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert out.model == "tiny" and out.object == "list"
    assert out.usage.prompt_tokens == out.usage.total_tokens > len(TEXTS)
    # The same again, now from the radix cache (last-token pooling reuses the prefix).
    again = client.embeddings.create(model="tiny", input=TEXTS[1])
    np.testing.assert_allclose(again.data[0].embedding, reference[1], atol=1e-5)


def test_one_string_token_ids_and_both_encodings(
    embedding_server: ServerProcess, client: openai.OpenAI, reference: np.ndarray
) -> None:
    one = client.embeddings.create(model="m", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, reference[0], atol=1e-5)
    ids = requests.post(
        embedding_server.url + "/tokenize", json={"prompt": TEXTS[2]}, timeout=30
    ).json()
    tokens = ids["tokens"]
    by_ids = client.embeddings.create(model="m", input=[tokens, tokens[:3]])
    np.testing.assert_allclose(by_ids.data[0].embedding, reference[2], atol=1e-5)
    assert by_ids.usage.prompt_tokens == len(tokens) + 3
    raw = requests.post(
        embedding_server.url + "/v1/embeddings",
        json={"model": "m", "input": TEXTS[3], "encoding_format": "base64"},
        timeout=30,
    ).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, reference[3], atol=1e-5)


def test_dimensions_truncate_then_normalize(client: openai.OpenAI, reference: np.ndarray) -> None:
    out = client.embeddings.create(model="m", input=TEXTS[1], dimensions=32)
    vector = np.array(out.data[0].embedding)
    expected = reference[1][:32] / np.linalg.norm(reference[1][:32])
    np.testing.assert_allclose(vector, expected, atol=1e-5)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="m", input=TEXTS[1], dimensions=48)
    assert err.value.body["param"] == "dimensions" and "32, 64" in err.value.body["message"]


def test_native_encode(embedding_server: ServerProcess, reference: np.ndarray) -> None:
    one = requests.post(
        embedding_server.url + "/encode", json={"text": TEXTS[1]}, timeout=30
    ).json()
    np.testing.assert_allclose(one["embedding"], reference[1], atol=1e-5)
    # Asked before: the whole prompt but its last token comes from the radix cache.
    assert one["meta_info"]["cached_tokens"] == one["meta_info"]["prompt_tokens"] - 1
    batch = requests.post(
        embedding_server.url + "/encode",
        json={"text": TEXTS[:2], "sampling_params": {"max_new_tokens": 0}, "dimensions": 64},
        timeout=30,
    ).json()
    assert [b["index"] for b in batch] == [0, 1]
    np.testing.assert_allclose([b["embedding"] for b in batch], reference[:2], atol=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"model": "m", "input": []}, "input"),
        ("/v1/embeddings", {"model": "m", "input": "a", "encoding_format": "int8"}, None),
        ("/v1/embeddings", {"model": "m", "input": "a", "dimension": 32}, "dimension"),
        ("/v1/embeddings", {"model": "m", "input": [[1, 2], [10**9]]}, None),
        ("/v1/embeddings", {"model": "m", "input": "a", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"model": "m", "input": "word " * 5000}, None),
        ("/encode", {"text": "a", "sampling_params": {"max_new_tokens": 5}}, "sampling_params"),
        ("/encode", {"text": "a", "dimensions": True}, "dimensions"),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 5}}, None),
        ("/v1/completions", {"model": "m", "prompt": "a"}, None),
    ],
)
def test_bad_requests_get_400(
    embedding_server: ServerProcess, path: str, body: dict, param: str | None
) -> None:
    resp = requests.post(embedding_server.url + path, json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_memory_is_whole_when_idle(embedding_server: ServerProcess, client: openai.OpenAI) -> None:
    client.embeddings.create(model="m", input=TEXTS * 4)
    info = requests.get(embedding_server.url + "/get_server_info", timeout=30).json()
    assert info["memory_integrity"]["ok"] is True, info["memory_integrity"]


def test_generation_server_refuses_embeddings(url: str) -> None:
    resp = requests.post(url + "/v1/embeddings", json={"model": "m", "input": "a"}, timeout=30)
    assert resp.status_code == 400
    assert "--is-embedding" in resp.json()["error"]["message"]


def test_offline_engine_encode(folder: Path, reference: np.ndarray) -> None:
    from srt.entrypoints.engine import Engine

    with Engine(model_path=str(folder), is_embedding=True, dtype="float32") as engine:
        one = engine.encode(TEXTS[0])
        batch = engine.encode(input_ids=[[1, 2, 3], [4, 5]], dimensions=32)
    np.testing.assert_allclose(one["embedding"], reference[0], atol=1e-5)
    assert [len(out["embedding"]) for out in batch] == [32, 32]
    assert one["meta_info"]["prompt_tokens"] > 0
