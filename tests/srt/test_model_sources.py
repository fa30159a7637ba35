"""`sources.get_tokenizer` loads `TokenizersBackend` directly where `AutoTokenizer` would
choose it (sparing `AutoTokenizer`'s import of torch and every model configuration), and the
tokenizer it gives is the one `AutoTokenizer` gives; everywhere else it is `AutoTokenizer`."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from srt.model_loader import sources

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé, 中文, emoji 🚀 and <|endoftext|> in the middle",
    "def f(x):\n    return x ** 2  # squares",
]


def assert_same_tokenizer(direct, auto) -> None:
    assert type(direct) is type(auto)
    assert len(direct) == len(auto) and direct.vocab_size == auto.vocab_size
    assert direct.all_special_ids == auto.all_special_ids
    assert (direct.bos_token_id, direct.eos_token_id, direct.pad_token_id) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.pad_token_id,
    )
    for text in TEXTS:
        ids = auto.encode(text)
        assert direct.encode(text) == ids
        assert direct.encode(text, add_special_tokens=False) == auto.encode(
            text, add_special_tokens=False
        )
        for skip in (True, False):
            assert direct.decode(ids, skip_special_tokens=skip) == auto.decode(
                ids, skip_special_tokens=skip
            )
        assert direct.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    chat = [{"role": "user", "content": "Hi there"}]
    assert direct.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def copy_with(folder: Path, dest: Path, config: dict, tokenizer_config: dict) -> Path:
    dest.mkdir()
    shutil.copy(folder / "tokenizer.json", dest / "tokenizer.json")
    base = json.loads((folder / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**base, **tokenizer_config}))
    base_config = json.loads((folder / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**base_config, **config}))
    return dest


def test_default_model_tokenizer_loads_directly_and_equals_autotokenizers(
    default_model_path: str,
) -> None:
    folder = Path(default_model_path)
    assert sources._tokenizers_backend_for(folder) is not None
    assert_same_tokenizer(
        sources.get_tokenizer(default_model_path),
        AutoTokenizer.from_pretrained(default_model_path, local_files_only=True),
    )


def test_qwen3_folder_loads_directly_and_equals_autotokenizers(
    default_model_path: str, tmp_path: Path
) -> None:
    folder = copy_with(Path(default_model_path), tmp_path / "qwen3", {"model_type": "qwen3"}, {})
    assert sources._tokenizers_backend_for(folder) is not None
    assert_same_tokenizer(
        sources.get_tokenizer(str(folder)),
        AutoTokenizer.from_pretrained(str(folder), local_files_only=True),
    )


@pytest.mark.parametrize(
    ("config", "tokenizer_config"),
    [
        ({"model_type": "qwen2"}, {}),  # AutoTokenizer gives Qwen2Tokenizer
        ({"model_type": "mistral"}, {}),  # transformers may choose mistral-common's backend
        ({"model_type": "internlm2"}, {}),  # its declared class is overridden by transformers
        ({}, {"tokenizer_class": "GPT2Tokenizer"}),  # a named class: AutoTokenizer resolves it
        ({}, {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}),  # the folder's own code
    ],
)
def test_other_folders_go_through_autotokenizer(
    default_model_path: str, tmp_path: Path, config: dict, tokenizer_config: dict
) -> None:
    folder = copy_with(Path(default_model_path), tmp_path / "m", config, tokenizer_config)
    assert sources._tokenizers_backend_for(folder) is None
    if "auto_map" not in tokenizer_config:  # loading the folder's own code is refused offline
        got = sources.get_tokenizer(str(folder))
        assert type(got) is type(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


def random_ids(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Id runs that mix ordinary tokens with every added token (special or not)."""
    rng = random.Random(seed)
    added = list(tokenizer.added_tokens_decoder)
    return [
        [
            rng.choice(added) if rng.random() < 0.2 else rng.randrange(len(tokenizer))
            for _ in range(k)
        ]
        for k in (rng.randint(1, 40) for _ in range(n))
    ]


def assert_decodes_the_same(decoder, tokenizer) -> None:
    assert {i: (t.content, t.special) for i, t in decoder.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in tokenizer.added_tokens_decoder.items()
    }
    runs = [tokenizer.encode(text) for text in TEXTS] + random_ids(tokenizer, 200, seed=5)
    for ids in runs:
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            ), ids


def test_the_detokenizer_decodes_as_the_tokenizer_without_transformers(
    default_model_path: str, tmp_path: Path
) -> None:
    """The default model's and a qwen3 folder's decoding tokenizers are the `tokenizers`
    backend alone, and decode every run of ids (added and special tokens among them, skipped
    or not) as `get_tokenizer`'s does."""
    qwen3 = copy_with(Path(default_model_path), tmp_path / "qwen3", {"model_type": "qwen3"}, {})
    for folder in (default_model_path, str(qwen3)):
        decoder = sources.get_decoding_tokenizer(folder)
        assert isinstance(decoder, sources.BackendDecoder)
        assert_decodes_the_same(decoder, sources.get_tokenizer(folder))


@pytest.mark.parametrize(
    "tokenizer_config",
    [
        {"eos_token": "</s>"},  # a named token the backend lacks: TokenizersBackend adds it
        {"extra_special_tokens": ["<tool>"]},
        {"tokenizer_class": "GPT2Tokenizer"},  # not read as TokenizersBackend at all
    ],
)
def test_a_tokenizer_that_would_change_the_backend_decodes_through_transformers(
    default_model_path: str, tmp_path: Path, tokenizer_config: dict
) -> None:
    folder = copy_with(Path(default_model_path), tmp_path / "m", {}, tokenizer_config)
    decoder = sources.get_decoding_tokenizer(str(folder))
    assert not isinstance(decoder, sources.BackendDecoder)
    assert_decodes_the_same(decoder, sources.get_tokenizer(str(folder)))


def test_the_decoding_tokenizer_imports_no_transformers(default_model_path: str) -> None:
    """What the detokenizer process imports to decode: no transformers (most of its start)."""
    code = (
        "import sys; import managers.detokenizer_manager; "
        "from srt.model_loader.sources import get_decoding_tokenizer as g; "
        f"t = g({default_model_path!r}); assert t.decode([28, 29]); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
