"""A GGUF file's header read in milliseconds: its scalar metadata and its tensors' names, types, shapes and
places, for the engine's loader and `model inspect`.

gguf-py's `GGUFReader` builds a numpy view of every value in the header, the tokenizer's ~100,000
strings included: 3.5 s for SmolLM2's 272 tensors, paid at every engine start, before a weight is read.
This reader walks the same layout (GGUF v2/v3: magic, version, tensor count, key/value count, the
key/values, the tensor infos, the data at the file's alignment) and keeps only what a loader needs:
arrays are stepped over (their element count kept), strings read as str.  `tensor_data` maps the file
and gives one tensor as gguf-py would (float types typed, block types as uint8 rows of their bytes).

Standard library at import; numpy and gguf-py's type table are imported by the functions that need them.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class HeaderError(ValueError):
    """Not a GGUF file this reader understands; the message names the file and what was wrong."""


@dataclass(frozen=True)
class SkippedArray:
    """A metadata array not kept (the tokenizer's vocabulary, merges, scores): its element type and count."""

    item_type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]           # as the file lists them: innermost first
    qtype: int                      # a gguf.GGMLQuantizationType value
    offset: int                     # from the file's start
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Outermost first, as torch and numpy order it."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)


@dataclass(frozen=True)
class Header:
    path: Path
    version: int
    metadata: dict[str, Any]        # scalars and strings; arrays as SkippedArray
    tensors: list[TensorInfo]

    def string(self, key: str) -> str:
        value = self.metadata.get(key)
        if not isinstance(value, str):
            raise HeaderError(f"{self.path}: no string {key!r} in the GGUF metadata")
        return value


class _Cursor:
    """Reads little-endian values from a buffered file, counting the bytes consumed."""

    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f, self.path, self.pos = f, path, 0

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise HeaderError(f"{self.path}: the GGUF header ends early (at byte {self.pos + len(data)})")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        self.f.seek(n, 1)
        self.pos += n

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            self.skip_items(item, count)
            return SkippedArray(item, count)
        raise HeaderError(f"{self.path}: unknown GGUF value type {kind} at byte {self.pos}")

    def skip_items(self, item: int, count: int) -> None:
        if item in _SCALARS:
            self.skip(struct.calcsize(_SCALARS[item]) * count)
        elif item == _STRING:
            for _ in range(count):
                self.skip(self.scalar("<Q"))
        elif item == _ARRAY:
            for _ in range(count):
                self.value(_ARRAY)
        else:
            raise HeaderError(f"{self.path}: unknown GGUF array type {item} at byte {self.pos}")


def read_header(path: str | Path) -> Header:
    """The header of a GGUF file (see the module's docstring); HeaderError if it is not one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with path.open("rb") as f:
        cur = _Cursor(f, path)
        if cur.take(4) != MAGIC:
            raise HeaderError(f"{path}: not a GGUF file (it does not start with {MAGIC!r})")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise HeaderError(f"{path}: GGUF version {version}; this reader knows versions 2 and 3")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
            raw.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, qtype, offset in raw:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise HeaderError(f"{path}: tensor {name!r} has a type ({qtype}) gguf-py does not know") from None
        tensors.append(TensorInfo(name, dims, qtype, start + offset, math.prod(dims) * size // block))
    return Header(path, version, metadata, tensors)


def tensor_data(mapped: Any, info: TensorInfo) -> Any:
    """One tensor of a file mapped as a uint8 numpy array (`np.memmap(path, np.uint8, "c")`): F32/F16/F64
    and integer types as their numpy type in `info.shape`, block types (BF16 included) as uint8 rows of
    their bytes, as gguf-py's reader gives them."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    typed = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
             T.I32: np.int32, T.I64: np.int64}
    raw = mapped[info.offset:info.offset + info.nbytes]
    kind = T(info.qtype)
    if kind in typed:
        return raw.view(typed[kind]).reshape(info.shape)
    rows = info.n_elements // info.dims[0]
    return raw.reshape(rows, info.nbytes // rows)
