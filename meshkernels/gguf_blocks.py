"""GGUF weight blocks, kept exactly as the GGUF stores them, for the CPU library's `gguf_linear`
(meshkernels/cpu_gguf.cpp: the op and its vector loops; cpu_gguf_amx.cpp: AMX-INT8 tiles where the CPU has
them): taking them out of a GGUF tensor, the op's Python wrapper, and the torch references the tests
hold it to.

Kinds are GGML type ids (gguf-py's GGMLQuantizationType): Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12,
Q5_K = 13, Q6_K = 14; `KINDS` holds each one's bytes per block and weights per block (32, or a K-quant's
256-weight super-block: in_features must be a multiple of it).

The op multiplies the blocks with activations quantized to int8 per 32-element block, as llama.cpp
does: dx = max|x| / 127 (float32), qx = round(x * (1 / dx)) to nearest even.  Each block's integer
dot product is exact; the sum over blocks of scale * dx * dot (and Q4_1's / K-quants' mins terms) runs in
float32.  So the op differs from the float product x @ W^T by the activations' quantization (at most
dx / 2 per element, relative 2^-8 of the block's largest |x|), and from `gguf_linear_reference`
(which quantizes x the same way) only by float rounding.  Q4_K and Q6_K at 1-4 rows on AVX512-VNNI CPUs
(meshkernels/cpu_gguf_q8k.cpp) quantize x per 256 instead, as llama.cpp's Q8_K activations for K-quants:
there `gguf_linear_reference(..., block=256)` is the reference.

Layouts (gguf-py's `gguf.quants` dequantizes them, and is the reference here; meshkernels/cpu_gguf.cpp's
header comment spells each one out):
- Q4_1: 20 bytes a block = fp16 d, fp16 m, 16 bytes qs; element j < 16 is qs[j] & 15, element
  j + 16 is qs[j] >> 4; w = d * q + m.
- Q8_0: 34 bytes = fp16 d, 32 int8 q; w = d * q.
- Q5_0: 22 bytes = fp16 d, uint32 qh (little-endian), 16 bytes qs; element j < 16 is
  qs[j] & 15 plus bit j of qh as its 5th bit, element j + 16 is qs[j] >> 4 plus bit j + 16;
  w = d * (q - 16).
- Q4_K: 144 bytes = fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of 4-bit q;
  w = d * sc * q - dmin * m per 32-weight sub-block.
- Q5_K: 176 bytes, as Q4_K with 32 bytes of 5th bits.
- Q6_K: 210 bytes = 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales (one per 16
  weights), fp16 d; w = d * sc * (q - 32).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

BLOCK = 32                    # activations are quantized per BLOCK elements
Q4_1 = int(GGMLQuantizationType.Q4_1)
Q5_0 = int(GGMLQuantizationType.Q5_0)
Q8_0 = int(GGMLQuantizationType.Q8_0)
Q4_K = int(GGMLQuantizationType.Q4_K)
Q5_K = int(GGMLQuantizationType.Q5_K)
Q6_K = int(GGMLQuantizationType.Q6_K)


class Kind(NamedTuple):
    qtype: GGMLQuantizationType
    bytes: int                # per block
    weights: int              # per block: in_features must be a multiple


KINDS: dict[int, Kind] = {
    Q4_1: Kind(GGMLQuantizationType.Q4_1, 20, 32),
    Q5_0: Kind(GGMLQuantizationType.Q5_0, 22, 32),
    Q8_0: Kind(GGMLQuantizationType.Q8_0, 34, 32),
    Q4_K: Kind(GGMLQuantizationType.Q4_K, 144, 256),
    Q5_K: Kind(GGMLQuantizationType.Q5_K, 176, 256),
    Q6_K: Kind(GGMLQuantizationType.Q6_K, 210, 256),
}
_NAMES = ", ".join(f"{k} ({v.qtype.name})" for k, v in KINDS.items())


def kind_of(kind: int | GGMLQuantizationType) -> int:
    """The op's kind (a GGML type id in KINDS) for an int id or a GGMLQuantizationType."""
    if isinstance(kind, GGMLQuantizationType):
        if int(kind) not in KINDS:
            raise ValueError(f"{kind.name} blocks are not supported by gguf_linear ({_NAMES} are)")
        return int(kind)
    if isinstance(kind, bool) or not isinstance(kind, int | np.integer) or int(kind) not in KINDS:
        raise ValueError(f"kind must be one of {_NAMES}, got {kind!r}")
    return int(kind)


def check_in_features(k: int, kind: int | GGMLQuantizationType) -> None:
    """ValueError unless rows of k weights are whole blocks of `kind`."""
    info = KINDS[kind_of(kind)]
    if k % info.weights:
        raise ValueError(f"in_features {k} is not a multiple of {info.weights} "
                         f"({info.qtype.name} blocks hold {info.weights} weights)")


def block_bytes(kind: int | GGMLQuantizationType) -> int:
    return KINDS[kind_of(kind)].bytes


def blocks_from_array(data: np.ndarray[Any, Any], kind: int | GGMLQuantizationType) -> torch.Tensor:
    """A GGUF tensor's raw blocks (as `GGUFReader` gives them: uint8, (N, K / weights * bytes), or any shape
    whose last dimension holds whole rows) as a contiguous (N, K / weights * bytes) uint8 torch tensor (a copy:
    the reader's array is a read-only memory map)."""
    width = block_bytes(kind)
    array = np.ascontiguousarray(data, dtype=np.uint8)
    if array.ndim < 1 or array.shape[-1] % width:
        raise ValueError(f"rows of {array.shape[-1] if array.ndim else 0} bytes are not whole "
                         f"{width}-byte blocks")
    return torch.from_numpy(array.reshape(-1, array.shape[-1]).copy())


def blocks_from_reader_tensor(tensor: Any) -> tuple[torch.Tensor, int]:
    """(blocks, kind) for a `gguf.GGUFReader` tensor of a kind in KINDS."""
    kind = kind_of(GGMLQuantizationType(tensor.tensor_type))
    return blocks_from_array(tensor.data, kind), kind


def dequantize(blocks: torch.Tensor, kind: int | GGMLQuantizationType) -> torch.Tensor:
    """The float32 weight (N, K) the blocks hold, by gguf-py's dequantize."""
    qtype = KINDS[kind_of(kind)].qtype
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(blocks.numpy(), qtype), dtype=np.float32))


def quantize_activations(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) float32 -> (q (T, K) int8, d (T, K / block) float32), as the kernel quantizes it."""
    t, k = x.shape
    if k % block:
        raise ValueError(f"in_features {k} is not a multiple of {block}")
    xb = x.float().reshape(t, k // block, block)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.round(xb * inv.unsqueeze(-1))                    # half to even, as the kernel rounds
    return q.to(torch.int8).reshape(t, k), d


COARSE = 5.0        # meshkernels/cpu_gguf.h's kCoarse


def fine_activations(x: torch.Tensor) -> torch.Tensor:
    """x (T, K) as the repacked products with OUTLIERS take it (float64): int8 per 32 elements, except in a
    coarse block, one whose largest |x| is above COARSE times its row's root mean square (an outlier channel),
    whose first element of that |x| stays a float and whose other 31 are quantized without it."""
    q, d = quantize_activations(x, BLOCK)
    t, k = x.shape
    xb = x.float().reshape(t, k // BLOCK, BLOCK)
    xq = q.double().reshape(t, -1, BLOCK) * d.double().unsqueeze(-1)
    top = xb.abs().amax(-1)
    coarse = top.double() ** 2 * k > COARSE ** 2 * (x.double() ** 2).sum(1, keepdim=True)
    if bool(coarse.any()):
        at = xb.abs().argmax(-1, keepdim=True)                     # the first of the largest
        rest = xb.scatter(-1, at, 0.0)
        rq, rd = quantize_activations(rest.reshape(t, k), BLOCK)
        alone = (rq.double().reshape(t, -1, BLOCK) * rd.double().unsqueeze(-1)).scatter(
            -1, at, xb.gather(-1, at).double())
        xq = torch.where(coarse.unsqueeze(-1), alone, xq)
    return xq.reshape(t, k)


def gguf_linear_reference(x: torch.Tensor, blocks: torch.Tensor, kind: int | GGMLQuantizationType,
                          block: int = BLOCK, fine: bool = False) -> torch.Tensor:
    """x (T, K) -> (T, N): the kernel's product (int8 activations per `block` elements; `fine`: the coarse
    blocks as fine_activations gives them, as repacked products with OUTLIERS take them), in float64."""
    if fine:
        xq = fine_activations(x)
    else:
        q, d = quantize_activations(x, block)
        t, k = q.shape
        xq = (q.double().reshape(t, k // block, block) * d.double().unsqueeze(-1)).reshape(t, k)
    return (xq @ dequantize(blocks, kind).double().T).float()


def float_reference(x: torch.Tensor, blocks: torch.Tensor, kind: int | GGMLQuantizationType) -> torch.Tensor:
    """x @ W^T in float32 with the blocks' weights (no activation quantization)."""
    return x.float() @ dequantize(blocks, kind).T


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, kind: int | GGMLQuantizationType) -> torch.Tensor:
    """x (T, K) float32 -> (T, N) by `torch.ops.infermesh.gguf_linear` (load meshkernels.cpu_ops first)."""
    check_in_features(x.shape[-1], kind)
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    torch.ops.infermesh.gguf_linear(x, blocks, kind_of(kind), out)
    return out


REPACKED = 256      # gguf_linear's kind + REPACKED: the blocks are repack()'s
OUTLIERS = 512      # kind + REPACKED + OUTLIERS: with the coarse blocks' outliers kept as floats (fine_activations)
GROUP = 16          # rows repacked together: rows [16 g, 16 g + 16) are group g, the last N % 16 rows as they were


def repack(blocks: torch.Tensor, kind: int | GGMLQuantizationType) -> torch.Tensor:
    """The blocks (N, row bytes) of `kind` laid out 16 rows at a time for the vector paths without AMX
    (meshkernels/cpu_gguf_r16.cpp): same shape, same bytes rearranged; `gguf_linear(x, repacked, kind + REPACKED)`
    multiplies by them.  The last N % 16 rows stay as they are."""
    return torch.ops.infermesh.gguf_repack(blocks.contiguous(), kind_of(kind), True)


def unpack(repacked: torch.Tensor, kind: int | GGMLQuantizationType) -> torch.Tensor:
    """repack() undone: the file's blocks again, byte for byte."""
    return torch.ops.infermesh.gguf_repack(repacked.contiguous(), kind_of(kind), False)
