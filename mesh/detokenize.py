"""Incremental detokenization for streaming: never emit half a character.

A byte-level BPE token can end in the middle of a multi-byte UTF-8 character, and a
SentencePiece token's text depends on its neighbours, so text is computed as the
difference between decoding a short window of ids with and without the newest ones.
The caller keeps `(prefix_offset, read_offset)` between calls, which makes this pure and
lets any tokenizer replica continue a stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

REPLACEMENT = "\ufffd"


class DecodeStep(NamedTuple):
    text: str           # newly complete text (may be empty)
    prefix_offset: int  # start of the window the next call must decode
    read_offset: int    # first id whose text has not been emitted yet


def decode_step(
    decode: Callable[[Sequence[int]], str],
    ids: Sequence[int],
    prefix_offset: int,
    read_offset: int,
    final: bool = False,
) -> DecodeStep:
    """Text for ids[read_offset:], given that ids[:read_offset] was already emitted.

    Invariant: concatenating the texts of successive calls (the last with final=True)
    equals decode(ids) for decoders that are prefix-stable, such as byte-level BPE.
    """
    if not 0 <= prefix_offset <= read_offset <= len(ids):
        raise ValueError(f"bad offsets: prefix {prefix_offset}, read {read_offset}, len {len(ids)}")
    prefix_text = decode(ids[prefix_offset:read_offset])
    full_text = decode(ids[prefix_offset:])
    # An incomplete character decodes to U+FFFD; wait for the bytes that complete it.
    if len(full_text) > len(prefix_text) and (final or not full_text.endswith(REPLACEMENT)):
        return DecodeStep(full_text[len(prefix_text):], read_offset, len(ids))
    return DecodeStep("", prefix_offset, read_offset)


class IncrementalDecoder:
    """Holds the ids and offsets of one stream; `push(new_ids)` returns new text."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        step = decode_step(self._decode, self.ids, self.prefix_offset, self.read_offset, final)
        self.prefix_offset, self.read_offset = step.prefix_offset, step.read_offset
        return step.text
