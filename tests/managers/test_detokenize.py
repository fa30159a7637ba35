"""Incremental detokenization with the default model's real byte-level BPE tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from managers.detokenize import IncrementalDecoder, decode_ids
from managers.io_struct import FinishReason, finish_abort, finish_length, finish_matched

MIXED = "Hi café, naïve 日本語 and 中文 🎉👍🏽 done"
RUNNING = None
LENGTH = finish_length(0)


@pytest.fixture(scope="module")
def tok(default_model_path: str) -> Any:
    from srt.model_loader.sources import get_tokenizer

    return get_tokenizer(default_model_path)


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(
    dec: IncrementalDecoder, ids: list[int], chunk: int, last: FinishReason | None
) -> list[str]:
    """Grow the output `chunk` tokens per step, as the scheduler does; finish with `last`."""
    deltas = []
    for end in range(chunk, len(ids), chunk):
        deltas.append(dec.step(ids[:end], RUNNING))
    deltas.append(dec.step(ids, last))
    return deltas


# --- multi-byte characters split across tokens ---------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_split_characters_never_release_partial_bytes(tok: Any, chunk: int) -> None:
    ids = encode(tok, MIXED)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "no character is split across tokens"
    dec = IncrementalDecoder(tok)
    deltas = feed(dec, ids, chunk, LENGTH)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == dec.text == tok.decode(ids) == MIXED
    assert len([d for d in deltas[:-1] if d]) > 3  # streamed while running, not all at the end


def test_finish_with_trailing_incomplete_character_releases_it(tok: Any) -> None:
    ids = encode(tok, "ok 🎉")[:-1]  # the emoji's last byte never arrives
    dec = IncrementalDecoder(tok)
    deltas = feed(dec, ids, 1, finish_abort("client left"))
    assert "".join(deltas[:-1]) == "ok"
    assert dec.text == tok.decode(ids) and dec.text.startswith("ok ")
    assert dec.text.endswith("\ufffd")
    assert dec.step(ids, LENGTH) == ""  # finished: later calls release nothing


def test_window_is_decoded_not_the_whole_output(tok: Any) -> None:
    ids = encode(tok, "word " * 200)
    dec = IncrementalDecoder(tok)
    longest = 0
    decode = tok.decode

    def spy(token_ids: list[int], **kwargs: Any) -> str:
        nonlocal longest
        longest = max(longest, len(token_ids))
        return decode(token_ids, **kwargs)

    tok.decode = spy
    try:
        feed(dec, ids, 1, LENGTH)
    finally:
        del tok.decode
    assert dec.text == tok.decode(ids)
    assert longest <= 2


# --- special tokens ----------------------------------------------------------------------


CHAT = "<|im_start|>user\nhi 🎉<|im_end|><|im_start|>assistant\nok<|im_end|>"


def test_fast_tokenizer_ignores_spaces_between_special_tokens(tok: Any) -> None:
    # Why decode_ids exists: transformers swallows the kwarg. If this starts failing,
    # transformers honours it now and decode_ids could pass it through instead.
    ids = encode(tok, CHAT)
    assert tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True) == CHAT


@pytest.mark.parametrize(
    ("skip", "spaces", "expected"),
    [
        (True, True, "user\nhi 🎉assistant\nok"),
        (True, False, "user\nhi 🎉assistant\nok"),
        (False, False, CHAT),
        (False, True, "<|im_start|> user\nhi 🎉 <|im_end|> <|im_start|> assistant\nok <|im_end|>"),
    ],
)
def test_special_tokens(tok: Any, skip: bool, spaces: bool, expected: str) -> None:
    ids = encode(tok, CHAT)
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids
    kwargs = {"skip_special_tokens": skip, "spaces_between_special_tokens": spaces}
    assert decode_ids(tok, ids, **kwargs) == expected
    for chunk in (1, 2):
        dec = IncrementalDecoder(tok, **kwargs)
        deltas = feed(dec, ids, chunk, LENGTH)
        assert "".join(deltas) == dec.text == expected
        assert all("\ufffd" not in d for d in deltas)


def test_plain_ids_take_one_decode_call(tok: Any) -> None:
    ids = encode(tok, MIXED)
    calls = 0
    decode = tok.decode

    def spy(token_ids: list[int], **kwargs: Any) -> str:
        nonlocal calls
        calls += 1
        return decode(token_ids, **kwargs)

    tok.decode = spy
    try:
        text = decode_ids(tok, ids, skip_special_tokens=False)
    finally:
        del tok.decode
    assert (calls, text) == (1, MIXED)


# --- stop strings and stop tokens --------------------------------------------------------


def run_until_stop(dec: IncrementalDecoder, ids: list[int], stop: str) -> list[str]:
    """Feed one token per step; finish (as the scheduler would) once `stop` is decoded."""
    deltas = []
    for end in range(1, len(ids) + 1):
        done = stop in dec.tokenizer.decode(ids[:end])
        deltas.append(dec.step(ids[:end], finish_matched(stop) if done else None))
        assert stop not in dec.text or dec.no_stop_trim and done
        if done:
            return deltas
    raise AssertionError(f"{stop!r} never decoded")


def test_stop_string_spanning_tokens_is_held_then_trimmed(tok: Any) -> None:
    ids = encode(tok, "Sure thing.</answer> trailing")
    dec = IncrementalDecoder(tok, stop=["</answer>"])
    deltas = run_until_stop(dec, ids, "</answer>")
    assert len(deltas) == 6  # "</", "answer", ">" are three tokens
    assert deltas[3:5] == ["", ""]  # "</" and "</answer" are held while running
    assert "".join(deltas[:5]) == "Sure thing."
    assert dec.text == "Sure thing."
    assert dec.step(ids, LENGTH) == ""  # finished: the trimmed tail is never released later


def test_complete_stop_string_is_held_until_the_finish_arrives(tok: Any) -> None:
    # The scheduler may report the stop a step late (overlap): never leak it meanwhile.
    ids = encode(tok, "Sure thing.</answer> trailing")
    dec = IncrementalDecoder(tok, stop=["</answer>"])
    assert dec.step(ids[:3], RUNNING) == "Sure thing."
    assert dec.step(ids[:6], RUNNING) == ""
    assert dec.step(ids[:7], RUNNING) == ""
    assert dec.step(ids[:7], finish_matched("</answer>")) == ""
    assert dec.text == "Sure thing."


def test_no_stop_trim_keeps_the_stop_string(tok: Any) -> None:
    ids = encode(tok, "Sure thing.</answer> trailing")
    dec = IncrementalDecoder(tok, stop=["</answer>"], no_stop_trim=True)
    deltas = run_until_stop(dec, ids, "</answer>")
    assert "".join(deltas[:5]) == "Sure thing."  # still held while running
    assert deltas[-1] == "</answer>" and dec.text == "Sure thing.</answer>"


def test_held_prefix_that_is_not_a_stop_is_released(tok: Any) -> None:
    ids = encode(tok, "a </b> c </answer>")  # "a", " </", "b", ">", " c", " </", "answer", ">"
    dec = IncrementalDecoder(tok, stop=["</answer>"])
    deltas = run_until_stop(dec, ids, "</answer>")
    assert deltas[:3] == ["a", " ", "</b"]  # "</" held at step 2, released once "b" came
    assert "".join(deltas[:-1]) == "a </b> c "
    assert dec.text == "a </b> c "


def test_held_prefix_is_released_on_length_finish(tok: Any) -> None:
    ids = encode(tok, "Sure thing.</answer")
    dec = IncrementalDecoder(tok, stop=["</answer>"])
    deltas = feed(dec, ids, 1, LENGTH)
    assert "".join(deltas[:-1]) == "Sure thing."
    assert deltas[-1] == "</answer" and dec.text == "Sure thing.</answer"


@pytest.mark.parametrize(
    ("skip", "no_trim", "expected"),
    [
        (False, False, "Hello world."),
        (False, True, "Hello world. <|im_end|>"),  # spaces_between_special_tokens
        (True, False, "Hello world."),
    ],
)
def test_stop_token_id_is_trimmed(tok: Any, skip: bool, no_trim: bool, expected: str) -> None:
    ids = encode(tok, "Hello world.") + [tok.eos_token_id]
    dec = IncrementalDecoder(tok, skip_special_tokens=skip, no_stop_trim=no_trim)
    feed(dec, ids, 1, finish_matched(tok.eos_token_id))
    assert dec.text == expected


def test_ordinary_stop_token_id_is_trimmed(tok: Any) -> None:
    ids = encode(tok, "Hello world.")
    dec = IncrementalDecoder(tok)
    feed(dec, ids, 1, finish_matched(ids[-1]))  # "." as a stop token id
    assert dec.text == "Hello world"


# --- properties --------------------------------------------------------------------------

ALPHABET = st.sampled_from(list("ab </>.é日本語中🎉👍\n"))
PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(text=st.text(ALPHABET, max_size=30), chunk=st.integers(1, 4))
def test_any_text_any_chunking_round_trips(tok: Any, text: str, chunk: int) -> None:
    ids = encode(tok, text)
    dec = IncrementalDecoder(tok)
    deltas = feed(dec, ids, chunk, LENGTH) if ids else [dec.step([], LENGTH)]
    assert all("\ufffd" not in d for d in deltas)
    assert dec.text == "".join(deltas) == tok.decode(ids) == text


@PROPS
@given(
    text=st.text(ALPHABET, max_size=30),
    stop=st.sampled_from(["</a>", "日本", "🎉 ", "ab", "..."]),
)
def test_stop_string_never_leaks(tok: Any, text: str, stop: str) -> None:
    ids = encode(tok, text + stop + "tail")
    dec = IncrementalDecoder(tok, stop=[stop, "never"])
    run_until_stop(dec, ids, stop)
    full = tok.decode(ids)
    assert dec.text == full[: full.find(stop)]
