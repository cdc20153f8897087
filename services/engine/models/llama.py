"""The Llama-family forward (Llama, Mistral, Qwen2 shapes; SmolLM2 here) over a paged KV cache.

One call runs a ragged batch: the tokens of every scheduled chunk, flattened, go through
the projections together (where batching pays); attention then runs per group: all
decode rows in one paged call, each prefill chunk on its own prefix.  In the "exact" mode
the float32 math mirrors transformers' LlamaForCausalLM op for op, so greedy outputs agree
with it bit for bit; the fast modes run the norms, RoPE, the KV write, SiLU and decode
attention as fused CPU ops (kernels/cpu_ops.cpp) when that library builds.  On CUDA, decode
attention is the Triton paged kernel (kernels/paged_attention_triton.py) and, outside "exact",
the norms, RoPE + KV write and SiLU are Triton kernels too (kernels/triton_ops.py).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels import cpu_ops, paged_attention

SUPPORTED = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_folder(cls, folder: Path) -> LlamaConfig:
        c = json.loads((folder / "config.json").read_text())
        if c.get("model_type") not in SUPPORTED:
            raise ValueError(f"model_type {c.get('model_type')!r} is not supported ({', '.join(SUPPORTED)})")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"rope scaling {rope!r} is not supported yet")
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads, intermediate_size=c["intermediate_size"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            max_position=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            qkv_bias=c.get("attention_bias", c.get("model_type") == "qwen2"),
        )


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


class Concat:
    """Several projections of the same input, outputs side by side.

    Exact mode keeps transformers' separate GEMMs (so each output is bit-identical) and
    concatenates; packed mode fuses the weights into one GEMM, which saves a call per part."""

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


def _has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


ATTENTIONS = ("auto", "torch", "fused", "triton")

MATMULS: dict[str, type[Linear]] = {"exact": Linear, "fused": FusedLinear, "packed": PackedLinear,
                                     "fp16w": Fp16WeightLinear, "int8": Int8Linear}


@dataclass
class Layer:
    input_norm: torch.Tensor      # (H,)
    qkv: Concat                   # H -> (heads + 2 kv_heads) * D
    o: Linear                     # heads*D -> H
    post_norm: torch.Tensor
    gate_up: Concat               # H -> 2 I
    down: Linear                  # I -> H


@dataclass(frozen=True)
class AttentionPlan:
    """How the flat batch's rows attend.  Built by the model runner from the scheduled chunks."""

    slots: torch.Tensor                                   # (T,) cache slot of every row
    decode_rows: torch.Tensor | None                      # (B,) rows that are single decode tokens
    decode_tables: torch.Tensor | None                    # (B, max_blocks)
    decode_lens: torch.Tensor | None                      # (B,) keys per decode row
    decode_mask: torch.Tensor | None                      # paged_attention.decode_mask() of the above; the
                                                          # fused decode op needs none
    prefills: tuple[tuple[int, int, int, torch.Tensor], ...]  # (first row, rows, start position, block table)


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(folder / name)))
    return weights


class LlamaModel:
    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, matmul: str = "exact", attention: str = "auto"):
        if attention not in ATTENTIONS:
            raise ValueError(f"attention {attention!r} is not one of {ATTENTIONS}")
        self.config = config
        self.dtype = dtype
        linear = MATMULS[matmul]

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        self.embed = w("model.embed_tokens.weight")                               # (V, H)
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(Layer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=Concat(linear, [w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")],
                           [opt(a + "q_proj.bias"), opt(a + "k_proj.bias"), opt(a + "v_proj.bias")]),
                o=linear(w(a + "o_proj.weight"), None),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=Concat(linear, [w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], [None, None]),
                down=linear(w(p + "mlp.down_proj.weight"), None),
            ))
        self.norm = w("model.norm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        head = self.embed if tied else w("lm_head.weight")                           # (V, H)
        # The output head stays fp32 in the fp16-weight mode, so logits (and so sampling and
        # logprobs) are the fp32 model's and greedy() below agrees with their argmax.
        self.lm_head = (PackedLinear if linear is Fp16WeightLinear else linear)(head, None)
        # Greedy shortcut (fast modes only): an int8 copy of the head ranks the vocabulary,
        # then the top candidates are rescored exactly in fp32.  See greedy().
        cpu_fast = matmul != "exact" and device.type == "cpu"
        self.head_weight = head if cpu_fast else None
        self.approx_head = Int8Linear(head, None) if cpu_fast and _has_fbgemm() else None
        # RoPE tables as transformers builds them: float32 inverse frequencies times positions.
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(config.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)                                   # (P, D)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.scale = d ** -0.5
        # The fused ops agree with the torch ops to rounding, not bit for bit, so "exact" keeps the torch ops.
        cpu_fusable = matmul != "exact" and device.type == "cpu" and dtype == torch.float32
        if attention == "auto":
            attention = ("triton" if device.type == "cuda" else
                         "fused" if cpu_fusable and cpu_ops.load() else "torch")
        elif attention == "fused" and not (cpu_fusable and cpu_ops.load()):
            raise ValueError("attention 'fused' needs the fused CPU ops: a CPU float32 model, matmul other than "
                             "'exact', and kernels/cpu_ops built")
        # Decode attention: the fused CPU op, the Triton kernel (CUDA; the interpreter on CPU), or torch's SDPA.
        self.attention = attention
        self.ops: Any = None                       # the fused forward's norm/RoPE/SiLU ops; None: the torch ops
        self._triton_decode = None
        if attention == "fused":
            self.ops = torch.ops.infermesh
        elif attention == "triton":
            from kernels import paged_attention_triton

            self._triton_decode = paged_attention_triton.decode
            if matmul != "exact":      # "exact" keeps transformers' torch ops, for parity
                from kernels import triton_ops

                self.ops = triton_ops

    @property
    def needs_decode_mask(self) -> bool:
        """Whether decode attention wants paged_attention.decode_mask(); the kernels mask by length."""
        return self.attention == "torch"

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan,
                kv: list[tuple[torch.Tensor, torch.Tensor]], logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,); logits_rows: (S,) rows whose next-token logits are wanted.
        Returns (S, V) float32."""
        if self.ops is not None:
            return self._forward_fused(input_ids, positions, plan, kv, logits_rows)
        c = self.config
        t = input_ids.shape[0]
        qk_heads = c.num_heads + c.num_kv_heads
        x = self.embed[input_ids]                                                  # (T, H)
        cos = self.cos[positions][:, None, :]                                      # (T, 1, D)
        sin = self.sin[positions][:, None, :]
        for layer, (k_cache, v_cache) in zip(self.layers, kv, strict=True):
            h = self._rms_norm(x, layer.input_norm)
            qkv = layer.qkv(h).view(t, qk_heads + c.num_kv_heads, c.head_dim)      # (T, H+2KH, D)
            qk = self._rope(qkv[:, :qk_heads], cos, sin)                           # q and k rotate together
            q, k, v = qk[:, : c.num_heads], qk[:, c.num_heads:], qkv[:, qk_heads:]
            paged_attention.write_kv(k_cache, v_cache, plan.slots, k, v)
            attn = self._attention(q, k, v, k_cache, v_cache, plan)                # (T, heads, D)
            x = x + layer.o(attn.reshape(t, c.num_heads * c.head_dim))
            h = self._rms_norm(x, layer.post_norm)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return self._rms_norm(x[logits_rows], self.norm)                           # (S, H)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan,
                       kv: list[tuple[torch.Tensor, torch.Tensor]], logits_rows: torch.Tensor) -> torch.Tensor:
        """forward() with fused ops (the CPU library, or the Triton kernels on CUDA): each residual add
        rides in the next norm, and RoPE rotates q and k in place while it stores k and v in the cache."""
        c = self.config
        ops = self.ops
        t = input_ids.shape[0]
        qk_heads = c.num_heads + c.num_kv_heads
        eps = c.rms_norm_eps
        x = self.embed[input_ids]                                                  # (T, H) residual stream
        update: torch.Tensor | None = None                                         # (T, H) not yet added to x
        for layer, (k_cache, v_cache) in zip(self.layers, kv, strict=True):
            h = ops.add_rms_norm(x, update, layer.input_norm, eps)                 # x += update
            qkv = layer.qkv(h).view(t, qk_heads + c.num_kv_heads, c.head_dim)      # (T, H+2KH, D)
            ops.rope_and_write_kv(qkv, positions, self.cos, self.sin, k_cache, v_cache, plan.slots, c.num_heads)
            q, k, v = qkv[:, : c.num_heads], qkv[:, c.num_heads: qk_heads], qkv[:, qk_heads:]
            attn = self._attention(q, k, v, k_cache, v_cache, plan)                # (T, heads, D)
            h = ops.add_rms_norm(x, layer.o(attn.reshape(t, c.num_heads * c.head_dim)), layer.post_norm, eps)
            update = layer.down(ops.silu_and_mul(layer.gate_up(h)))
        rows = x[logits_rows]                                                      # (S, H)
        return ops.add_rms_norm(rows, update[logits_rows] if update is not None else None, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (S, H) -> (S, V) float32."""
        return self.lm_head(hidden).float()

    GREEDY_CANDIDATES = 64

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Argmax token of each row without the full fp32 vocabulary GEMM, or None if unavailable.

        The int8 head is within a small error of the fp32 logits, so the true argmax is among
        its top 64 unless 64 tokens tie within that error; the candidates are rescored in fp32
        and, sorted by id, ties resolve to the lowest id exactly as a full argmax does."""
        if self.approx_head is None or self.head_weight is None:
            return None
        approx = self.approx_head(hidden.float())                                   # (S, V)
        candidates = approx.topk(self.GREEDY_CANDIDATES, dim=-1).indices.sort(dim=-1).values  # (S, K)
        exact = torch.einsum("sh,skh->sk", hidden, self.head_weight[candidates])   # (S, K)
        return candidates.gather(1, exact.argmax(dim=-1, keepdim=True)).squeeze(1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        """The decode rows' attention.  q: (B, H, D) -> (B, H, D)."""
        assert plan.decode_tables is not None and plan.decode_lens is not None
        if self.attention == "fused":
            return torch.ops.infermesh.paged_decode_attention(q, k_cache, v_cache, plan.decode_tables,
                                                              plan.decode_lens, self.scale)
        if self._triton_decode is not None:
            return self._triton_decode(q, k_cache, v_cache, plan.decode_tables, plan.decode_lens, self.scale)
        return paged_attention.decode(q, k_cache, v_cache, plan.decode_tables, plan.decode_lens, self.scale,
                                      plan.decode_mask)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        if plan.decode_rows is not None and not plan.prefills:
            # Pure decode step (the common case): every row is a decode row, in order.
            return self._decode(q, k_cache, v_cache, plan)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(q[plan.decode_rows], k_cache, v_cache, plan)
        for first, rows, start, table in plan.prefills:
            sl = slice(first, first + rows)
            if start == 0:
                out[sl] = paged_attention.causal(q[sl], k[sl], v[sl], self.scale)
            else:
                out[sl] = paged_attention.prefill(q[sl], k_cache, v_cache, table, start, self.scale)
        return out
