"""Mean and CLS pooling (`--is-embedding`) against sentence-transformers, with the real
scheduler and model in this process (`InProcessDriver`). Prompts run in chunks of 8 tokens
and each is asked twice: such prompts read every position's hidden state, so the second time
is computed whole again (no cached prefix) and must give the same vector. Last-token pooling,
which does reuse the radix cache, is checked through a server in
`tests/server/test_embeddings.py`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from managers.inprocess import InProcessDriver
from managers.io_struct import EmbedOptions
from srt.server_args import ServerArgs
from tests.engine.tiny_models import save_tiny_embedding_model

TEXTS = [
    "A sentence long enough to need three chunks of eight tokens each, or more.",
    "A sentence long enough to share its start.",
    "hi",
]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_pooling_equals_sentence_transformers(
    tmp_path: Path, default_model_path: str, pooling: str
) -> None:
    st = pytest.importorskip("sentence_transformers")
    folder = save_tiny_embedding_model(tmp_path, default_model_path, pooling=pooling)
    reference = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    args = ServerArgs(
        model_path=str(folder),
        is_embedding=True,
        dtype="float32",
        chunked_prefill_size=8,
        max_total_tokens=2048,
    )
    driver = InProcessDriver(args)
    for _ in range(2):
        outs = driver.generate(TEXTS, {"max_new_tokens": 0}, embed=EmbedOptions())
        got = np.array([out["embedding"] for out in outs])
        np.testing.assert_allclose(got, reference, atol=1e-5)
        assert [out["meta_info"]["cached_tokens"] for out in outs] == [0, 0, 0]
        assert all(out["output_ids"] == [] for out in outs)
    driver.scheduler.check_memory()
