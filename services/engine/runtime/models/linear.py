"""How the model multiplies by its weights: one Linear kind per ExecutionPlan.matmul, in a dict registry.

- `exact`: transformers' own GEMM (MKL on CPU), bit-for-bit parity (an explicit --dtype float32).
- `fused` (the CUDA default): the same GEMM, with q/k/v and gate/up each one call.
- `packed`: oneDNN fp32 with the weight reordered once (the CPU default without FBGEMM).
- `fp16w` (the CPU default with FBGEMM): fp16-stored weights, fp32 activations and accumulation.
- `int8`: --dtype int8, weight-only int8 with dynamic int8 activations (a quantized model).
- `q4`: weights in 4-bit blocks (meshkernels/quant.py, the CPU library's q4_linear), the output head in
  8-bit blocks, only where that packing is lossless (a model converted from a GGUF's Q4_1 / Q8_0
  tensors, as the default model is): the model's own weights in a third of fp16's bytes, for the
  memory-bound decode of a few rows.  A tensor that would change falls back to `fp16w` (the head
  to `packed`), so the model is never quantized further by it.
- `bf16w`: bf16 weights packed once for oneDNN, activations rounded to bf16 for the product, float32
  out (norms, attention and the residual stay float32): about 2x fp16w at 16-256 rows where the
  CPU multiplies bf16 natively (AVX512-BF16, AMX); a candidate for `auto` only there.
- `gguf`: a GGUF folder's weights as the file stores them (models/gguf_weights.py), multiplied by the CPU
  library's gguf_linear (meshkernels/cpu_gguf.cpp) with activations quantized to int8 per 32 inputs, as
  llama.cpp multiplies them; a tensor of a type the kernel lacks is de-quantized to `fp16w`.
- `<small>+<kind>` (ExecutionPlan.matmul_large): `<small>` up to a number of rows, `<kind>` above it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshkernels import quant
from services.engine.runtime.models.gguf_weights import Blocks, Weight, dense


class Linear:
    """y = x W^T + b with transformers' own GEMM (MKL on CPU): bit-exact with transformers."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """The same GEMM as Linear, but Concat fuses q/k/v and gate/up into one call (the CUDA default:
    one launch and one read of the input instead of three; not bit-identical to separate GEMMs)."""


class PackedLinear(Linear):
    """The same product with the weight reordered once for oneDNN.

    On this CPU (AVX2, no AVX-512) it is 1.2-2.7x faster than MKL for 1-64 rows because the
    weight is not repacked on every call; results differ from MKL's in the last bits.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(torch.ops.mkldnn._reorder_linear_weight(weight), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class Fp16WeightLinear(Linear):
    """Weights stored as fp16 (packed once for FBGEMM), activations and accumulation in fp32.

    Half the weight memory of fp32; FBGEMM widens fp16 to fp32 in registers (F16C).  On this
    AVX2 CPU, with weights streamed from memory as in a real step, it is 1.6-2x faster than
    packed fp32 at 1-16 rows and still ~1.1x at 512.  quantized::linear_dynamic_fp16 runs the
    same kernel as aten's fbgemm_linear_fp16_weight_fp32_activation (bit-identical output) but
    threaded, and without a separate bias pass: 40 ms against 68 ms for a 16-row decode step."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(torch.ops.quantized.linear_prepack_fp16(
            weight.float().contiguous(), bias.float() if bias is not None else None), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.weight)


class Bf16WeightLinear(Linear):
    """bf16 weights packed once for oneDNN; each product rounds its input to bf16 and returns float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(torch.ops.mkldnn._reorder_linear_weight(weight.detach().bfloat16().contiguous()),
                         bias.float() if bias is not None else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.bfloat16(), self.weight, None, "none", [], "").float()
        return y if self.bias is None else y.add_(self.bias)


@functools.cache
def bf16w_runs() -> bool:
    """Whether oneDNN packs bf16 weights here at all: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, so an
    AVX2-only CPU cannot run `bf16w` (native_bf16 is the stricter test of a fast product)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except (AttributeError, RuntimeError):
        return False
    return True


def native_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively here (AVX512-BF16 or AMX), not by emulation."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class Int8Linear(Linear):
    """Weight-only int8 storage (per output channel, symmetric) with dynamic int8 activations,
    run by FBGEMM.  4x less weight memory and 2.5-3x faster GEMMs than packed fp32 on this CPU;
    outputs differ from float32 (a quantized model), so it is chosen only by --dtype int8."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.int64)
        with warnings.catch_warnings():
            # torch marks its quantized tensor types deprecated; FBGEMM's int8 GEMM still needs one
            # here (torch 2.13).  Revisit when torch drops them.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
        super().__init__(torch.ops.quantized.linear_prepack(qweight, bias), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range: FBGEMM's AVX2 kernels need 7-bit activations to avoid overflow.
        return torch.ops.quantized.linear_dynamic(x, self.weight, True)


class BlockLinear(Linear):
    """Weights in 32-weight blocks multiplied by the CPU library (meshkernels/cpu_gemm.cpp), when packing
    them is lossless; else `fallback`'s kind, so the weights stay the model's own.  A GGUF weight whose
    blocks are already this layout (Q4_1 for q4, Q8_0 for q8: quant.GGUF_LAYOUTS) is taken as it is, with
    nothing de-quantized or packed (an engine starts seconds sooner); one in the other layout is not
    this kind's (the fallback); any other type is de-quantized and packed as a float weight is."""

    PACK: Callable[[torch.Tensor], quant.Packed] = staticmethod(quant.pack_q4)
    WIDTH = quant.Q4_BYTES
    OP = "q4_linear"
    FALLBACK: type[Linear] = Fp16WeightLinear

    def __init__(self, weight: Weight, bias: torch.Tensor | None):
        packed = self._packed(weight)
        if packed is not None:
            self.fallback = None
        else:
            fallback = type(self).FALLBACK
            self.fallback = fallback(weight, bias) if issubclass(fallback, BlockLinear) else fallback(dense(weight),
                                                                                                      bias)
        super().__init__(packed.data if packed is not None else torch.empty(0), bias)
        self.out_features = weight.shape[0]
        self._op = getattr(torch.ops.infermesh, self.OP)

    @classmethod
    def _packed(cls, weight: Weight) -> quant.Packed | None:
        """The weight in this kind's blocks, or None where they would change it."""
        if isinstance(weight, Blocks):
            own = quant.from_gguf(weight.data, weight.name, weight.shape[1])
            if own is not None:
                return own if quant.GGUF_LAYOUTS[weight.name] == cls.WIDTH else None
            weight = weight.dense()
        packed = cls.PACK(weight) if weight.shape[1] % quant.BLOCK == 0 else None
        return packed if packed is not None and packed.lossless else None

    @property
    def lossless(self) -> bool:
        return self.fallback is None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback(x)
        y = self._op(x.float().contiguous(), self.weight, self.out_features)
        return y if self.bias is None else y.add_(self.bias)


class Q8LayerLinear(BlockLinear):
    """8-bit blocks for a layer whose weights are exactly such blocks (a Q8_0 GGUF's), fp16w otherwise."""

    PACK = staticmethod(quant.pack_q8)
    WIDTH = quant.Q8_BYTES
    OP = "q8_linear"


class Q4Linear(BlockLinear):
    """4-bit blocks (d * q + m); where that would change the weights, 8-bit blocks if those hold them
    exactly, else fp16w."""

    FALLBACK = Q8LayerLinear


class Q8Linear(BlockLinear):
    """8-bit blocks (d * q), the output head's kind beside q4; packed fp32 where that would change it."""

    PACK = staticmethod(quant.pack_q8)
    WIDTH = quant.Q8_BYTES
    OP = "q8_linear"
    FALLBACK = PackedLinear


class GgufLinear(Linear):
    """A GGUF weight's own blocks times int8-quantized activations (torch.ops.infermesh.gguf_linear) where
    the kernel has the blocks' type; else the weight de-quantized, as fp16w."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None):
        self.kind = gguf_kind(weight)
        self.fallback = Fp16WeightLinear(dense(weight), bias) if self.kind is None else None
        super().__init__(weight.data if isinstance(weight, Blocks) and self.kind is not None else
                         torch.empty(0, dtype=torch.uint8), bias)
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback(x)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        torch.ops.infermesh.gguf_linear(x.float().contiguous(), self.weight, self.kind, out)
        return out if self.bias is None else out.add_(self.bias)


class GgufRepackedLinear(GgufLinear):
    """GgufLinear with the blocks repacked 16 rows at a time at load (meshkernels/cpu_gguf_r16.cpp: one vector
    instruction multiplies 16 columns, for the CPUs without AMX): the same bytes, one copy, the file's
    layout not kept."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None):
        super().__init__(weight, bias)
        if self.kind is not None:                 # else de-quantized (fallback), as GgufLinear
            from meshkernels import gguf_blocks

            self.weight = gguf_blocks.repack(self.weight, self.kind)
            self.kind += gguf_blocks.REPACKED

    @property
    def outliers(self) -> bool:
        """Whether the coarse blocks' outliers are kept as floats (services/engine/runtime/outliers.py decides)."""
        from meshkernels import gguf_blocks

        return self.kind is not None and self.kind >= gguf_blocks.OUTLIERS

    @outliers.setter
    def outliers(self, on: bool) -> None:
        from meshkernels import gguf_blocks

        if self.kind is not None and on != self.outliers:
            self.kind += gguf_blocks.OUTLIERS if on else -gguf_blocks.OUTLIERS


def gguf_kind(weight: Weight) -> int | None:
    """The gguf_linear kind of a weight's blocks, or None (a float weight, or a type the kernel lacks)."""
    if not isinstance(weight, Blocks):
        return None
    from meshkernels import gguf_blocks

    try:
        return gguf_blocks.kind_of(weight.qtype)
    except ValueError:
        return None


class SplitLinear(Linear):
    """One kind up to `rows` rows, another above (ExecutionPlan.split_rows): both hold the weights."""

    def __init__(self, small: Linear, large: Linear, rows: int):
        super().__init__(small.weight, None)
        self.small, self.large, self.rows = small, large, rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.small if x.shape[0] <= self.rows else self.large)(x)


LINEARS: dict[str, type[Linear]] = {"exact": Linear, "fused": FusedLinear, "packed": PackedLinear,
                                    "fp16w": Fp16WeightLinear, "int8": Int8Linear, "q4": Q4Linear,
                                    "bf16w": Bf16WeightLinear, "gguf": GgufLinear, "ggufr": GgufRepackedLinear}
Kind = Callable[[Weight, torch.Tensor | None], Linear]


def takes_blocks(matmul: str) -> bool:
    """Whether the Linear of `matmul` takes a GGUF weight's blocks (and de-quantizes what it cannot use)."""
    return matmul in LINEARS and issubclass(LINEARS[matmul], (GgufLinear, BlockLinear))


def _kind(matmul: str) -> Kind:
    """The Linear for `matmul`, taking a GGUF weight's blocks as they are (gguf, q4) or de-quantized (the rest)."""
    cls = LINEARS[matmul]
    if takes_blocks(matmul):
        return cls
    return lambda w, b: cls(dense(w), b)


def linear_kind(matmul: str, large: str = "", rows: int = 0) -> Kind:
    """The layers' Linear for a plan: `matmul`, or up to `rows` rows `matmul` and above them `large`."""
    if not large or large == matmul:
        return LINEARS[matmul]
    small_kind, large_kind = _kind(matmul), _kind(large)
    return lambda w, b: SplitLinear(small_kind(w, b), large_kind(w, b), rows)


def head_kind(matmul: str, large: str = "", rows: int = 0) -> Kind:
    """The output head's Linear: fp32 even in the fp16-weight mode, so logits (and so sampling and
    logprobs) are the fp32 model's and the greedy shortcut agrees with their argmax; 8-bit blocks
    beside q4 (lossless only: else packed fp32).  A split plan whose large kind is bf16w splits the
    head as the layers: above `rows` rows bf16w's head (q4's 8-bit head at 16 rows took 7.4 ms of a
    34 ms step on a Zen 4 EPYC, bf16w's ~3).  Other large kinds keep the small kind's head: theirs is
    an fp32 copy (more memory than the 8-bit blocks, and not measured faster)."""
    small = _head_kind(matmul)
    if large != "bf16w" or large == matmul:
        return small
    big = _head_kind(large)
    return lambda w, b: SplitLinear(small(w, b), big(w, b), rows)


def _head_kind(matmul: str) -> Kind:
    if matmul == "q4":
        return Q8Linear
    cls = PackedLinear if matmul == "fp16w" else LINEARS[matmul]
    return cls if issubclass(cls, GgufLinear) else lambda w, b: cls(dense(w), b)


def has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def _stack_key(weight: Weight) -> tuple[str, int]:
    return (weight.name, weight.shape[1]) if isinstance(weight, Blocks) else ("dense", weight.shape[1])


class Concat:
    """Several projections of the same input, outputs side by side.

    Exact mode keeps transformers' separate GEMMs (so each output is bit-identical) and
    concatenates; the other kinds fuse the weights into one GEMM, which saves a call per part."""

    def __init__(self, kind: Kind, weights: list[Weight], biases: list[torch.Tensor | None]):
        if kind is Linear:
            self.parts: list[Linear] = [Linear(dense(w), b) for w, b in zip(weights, biases, strict=True)]
            return
        # Neighbours stack into one product; GGUF blocks only with blocks of their own type (a file may
        # store q and k in Q5_0 and v in Q8_0: then q/k is one product and v another).
        self.parts = []
        start = 0
        for end in range(1, len(weights) + 1):
            if end < len(weights) and _stack_key(weights[end]) == _stack_key(weights[start]):
                continue
            group, group_biases = weights[start:end], biases[start:end]
            bias = None if all(b is None for b in group_biases) else torch.cat(
                [b if b is not None else torch.zeros(w.shape[0]) for w, b in zip(group, group_biases, strict=True)])
            stacked = Blocks.cat(group) if isinstance(group[0], Blocks) else torch.cat(  # type: ignore[arg-type]
                [dense(w) for w in group])
            self.parts.append(kind(stacked, bias))
            start = end

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0](x)
        return torch.cat([part(x) for part in self.parts], dim=-1)
