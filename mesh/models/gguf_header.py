"""A GGUF file's header read in milliseconds: its scalar metadata and its tensors' names, types, shapes and
places, for the engine's loader and `model inspect`.

gguf-py's `GGUFReader` builds a numpy view of every value in the header, the tokenizer's ~100,000
strings included: 3.5 s for SmolLM2's 272 tensors, paid at every engine start, before a weight is read.
This reader walks the same layout (GGUF v2/v3: magic, version, tensor count, key/value count, the
key/values, the tensor infos, the data at the file's alignment) and keeps only what a loader needs:
arrays are stepped over (their element count kept), strings read as str.  `tensor_data` maps the file
and gives one tensor as gguf-py would (float types typed, block types as uint8 rows of their bytes).

Every count, length and place is checked against the file's size before it is used (a header naming more
tensors than the file can hold, a string longer than what is left, a tensor whose data runs past the end, an
alignment that would start the data inside the header): a malformed file is refused with GgufError naming the
file, the tensor or key and what the file says, never read out of bounds or turned into a raw traceback.  What
the tensors must be for a model (present, shaped by its config, of a type the loader reads) is the engine's
check: services/engine/runtime/models/gguf_check.py.

Standard library at import; numpy and gguf-py's type table are imported by the functions that need them.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4                       # ggml's GGML_MAX_DIMS
_MAX_NESTING = 4                    # arrays of arrays (none in practice; bounded so recursion stays shallow)
# The fewest bytes a metadata key (empty key, type, one-byte value) and a tensor's info (empty name, one
# dimension, type, offset) can take: counts beyond what the rest of the file can hold are refused at once.
_LEAST_KEY = 8 + 4 + 1
_LEAST_TENSOR = 8 + 4 + 8 + 4 + 8


class GgufError(ValueError):
    """A GGUF file that cannot be used as it is (not a GGUF, a header out of the file's bounds, a tensor that
    disagrees with its header, its file or the model's config); the message names the file, the tensor or key,
    what was expected and what the file says."""


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

    def require_tensors(self) -> None:
        """GgufError for a file without tensors: a valid GGUF (llama.cpp writes vocabulary-only ones), but no model."""
        if not self.tensors:
            raise GgufError(f"{self.path}: the file holds no tensors (a header of {self.path.stat().st_size} bytes "
                            "and no weights)")

    def string(self, key: str) -> str:
        value = self.metadata.get(key)
        if not isinstance(value, str):
            raise GgufError(f"{self.path}: no string {key!r} in the GGUF metadata")
        return value


class _Cursor:
    """Reads little-endian values from a buffered file of `size` bytes, counting the bytes consumed; a length
    past the file's end is refused before anything of that length is read or allocated."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f, self.path, self.pos, self.size = f, path, 0, size

    def _bound(self, n: int) -> None:
        if n > self.size - self.pos:
            raise GgufError(f"{self.path}: the GGUF header ends early (it needs {n} bytes at byte {self.pos}; the "
                            f"file has {self.size})")

    def take(self, n: int) -> bytes:
        self._bound(n)
        data = self.f.read(n)
        if len(data) != n:
            raise GgufError(f"{self.path}: the GGUF header ends early (at byte {self.pos + len(data)})")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        self._bound(n)
        self.f.seek(n, 1)
        self.pos += n

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def count(self, what: str, least: int) -> int:
        """A count of `what`, each at least `least` bytes: more than the rest of the file can hold is refused
        here, by name, not after reading to the end."""
        n = self.scalar("<Q")
        room = (self.size - self.pos) // least
        if n > room:
            raise GgufError(f"{self.path}: the header declares {n} {what}; the {self.size - self.pos} bytes left "
                            f"in the file (of {self.size}) hold at most {room}")
        return n

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            self.skip_items(item, count, depth + 1)
            return SkippedArray(item, count)
        raise GgufError(f"{self.path}: unknown GGUF value type {kind} at byte {self.pos}")

    def skip_items(self, item: int, count: int, depth: int) -> None:
        if item in _SCALARS:
            self.skip(struct.calcsize(_SCALARS[item]) * count)
        elif item == _STRING:
            for _ in range(count):
                self.skip(self.scalar("<Q"))
        elif item == _ARRAY:
            if depth >= _MAX_NESTING:       # each level is 12 bytes: a small file could exhaust Python's stack
                raise GgufError(f"{self.path}: metadata arrays nested deeper than {_MAX_NESTING} at byte {self.pos}")
            for _ in range(count):
                self.value(_ARRAY, depth)
        else:
            raise GgufError(f"{self.path}: unknown GGUF array type {item} at byte {self.pos}")


def read_header(path: str | Path) -> Header:
    """The header of a GGUF file (see the module's docstring); GgufError if it is not one, or if a count,
    length or tensor in it does not fit the file."""
    path = Path(path)
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        cur = _Cursor(f, path, size)
        if cur.take(4) != MAGIC:
            raise GgufError(f"{path}: not a GGUF file (it does not start with {MAGIC!r})")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise GgufError(f"{path}: GGUF version {version}; this reader knows versions 2 and 3")
        n_tensors, n_kv = cur.scalar("<Q"), cur.count("metadata keys", _LEAST_KEY)
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        room = (size - cur.pos) // _LEAST_TENSOR
        if n_tensors > room:
            raise GgufError(f"{path}: the header declares {n_tensors} tensors; the {size - cur.pos} bytes left "
                            f"after its metadata (of {size}) hold at most {room}")
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise GgufError(f"{path}: tensor {name!r} has {n_dims} dimensions; GGUF tensors have 1 to {_MAX_DIMS}")
            dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
            raw.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
            # The data starts at the header's end rounded up to this: zero or less would put it inside the header.
            raise GgufError(f"{path}: general.alignment {alignment!r} is not a positive whole number (the tensors' "
                            "data would not start after the header)")
        start = -(-cur.pos // alignment) * alignment
    return Header(path, version, metadata, [_tensor(path, size, start, *entry) for entry in raw])


def _tensor(path: Path, size: int, start: int, name: str, dims: tuple[int, ...], qtype: int, offset: int
            ) -> TensorInfo:
    """One tensor's info, its type known to gguf-py, its rows whole blocks, its bytes inside the file (after the
    header: its offset counts from the data's start)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(qtype)
        block, block_bytes = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise GgufError(f"{path}: tensor {name!r} has a type ({qtype}) gguf-py does not know") from None
    if min(dims) < 1:
        raise GgufError(f"{path}: tensor {name!r} has dims {list(dims)}: a dimension of 0")
    if dims[0] % block:
        raise GgufError(f"{path}: tensor {name!r} of type {kind.name} has rows of {dims[0]} values; its blocks hold "
                        f"{block} each")
    nbytes = math.prod(dims) // block * block_bytes
    if start + offset + nbytes > size:
        raise GgufError(f"{path}: tensor {name!r} ({kind.name}, dims {list(dims)}: {nbytes} bytes at byte "
                        f"{start + offset}) runs past the end of the file ({size} bytes): the file is truncated or "
                        "its header is wrong")
    return TensorInfo(name, dims, qtype, start + offset, nbytes)


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
