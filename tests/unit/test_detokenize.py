"""Incremental detokenization never emits half a character and adds up to the full text."""

import random

import pytest

from mesh.detokenize import IncrementalDecoder, decode_step


def byte_decode(ids: list[int]) -> str:
    # A byte-level "tokenizer": token id = one byte, like the byte fallback of BPE vocabularies.
    return bytes(ids).decode("utf-8", errors="replace")


TEXTS = ["plain ascii", "héllo wörld", "日本語のテキスト", "emoji 🚀🔥 mixed ✓", "Ω≈ç√∫˜µ≤≥÷"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(text: str) -> None:
    ids = list(text.encode())
    rng = random.Random(7)
    decoder = IncrementalDecoder(byte_decode)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        piece = decoder.push(ids[i:i + n], final=i + n >= len(ids))
        assert "\ufffd" not in piece
        pieces.append(piece)
        i += n
    assert "".join(pieces) == text


def test_incomplete_character_is_held_back() -> None:
    ids = list("é".encode())  # two bytes
    step = decode_step(byte_decode, ids[:1], 0, 0)
    assert step.text == "" and (step.prefix_offset, step.read_offset) == (0, 0)
    step = decode_step(byte_decode, ids, step.prefix_offset, step.read_offset)
    assert step.text == "é" and step.read_offset == 2


def test_final_flushes_an_incomplete_character() -> None:
    step = decode_step(byte_decode, list("é".encode())[:1], 0, 0, final=True)
    assert step.text == "\ufffd"


def test_bad_offsets_are_rejected() -> None:
    with pytest.raises(ValueError):
        decode_step(byte_decode, [65], 1, 0)
