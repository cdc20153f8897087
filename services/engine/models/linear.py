"""How the model multiplies by its weights: one Linear kind per ExecutionPlan.matmul, in a dict registry.

- `exact`: transformers' own GEMM (MKL on CPU), bit-for-bit parity (an explicit --dtype float32).
- `fused` (the CUDA default): the same GEMM, with q/k/v and gate/up each one call.
- `packed`: oneDNN fp32 with the weight reordered once (the CPU default without FBGEMM).
- `fp16w` (the CPU default with FBGEMM): fp16-stored weights, fp32 activations and accumulation.
- `int8`: --dtype int8, weight-only int8 with dynamic int8 activations (a quantized model).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


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


LINEARS: dict[str, type[Linear]] = {"exact": Linear, "fused": FusedLinear, "packed": PackedLinear,
                                    "fp16w": Fp16WeightLinear, "int8": Int8Linear}


def head_kind(matmul: str) -> type[Linear]:
    """The output head's Linear: fp32 even in the fp16-weight mode, so logits (and so sampling and
    logprobs) are the fp32 model's and the greedy shortcut agrees with their argmax."""
    return PackedLinear if matmul == "fp16w" else LINEARS[matmul]


def has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class Concat:
    """Several projections of the same input, outputs side by side.

    Exact mode keeps transformers' separate GEMMs (so each output is bit-identical) and
    concatenates; the other kinds fuse the weights into one GEMM, which saves a call per part."""

    def __init__(self, kind: type[Linear], weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
        if kind is not Linear:
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases, strict=True)])
            self.parts: list[Linear] = [kind(torch.cat(weights), bias)]
        else:
            self.parts = [Linear(w, b) for w, b in zip(weights, biases, strict=True)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0](x)
        return torch.cat([part(x) for part in self.parts], dim=-1)
