"""The Llama-family forward (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, Phi-3; SmolLM2 here) over a paged KV cache.

One call runs a ragged batch: the tokens of every scheduled chunk, flattened, go through
the projections together (where batching pays); attention then runs per group: all
decode rows in one paged call, each prefill chunk on its own prefix (models/attention.py).

The ExecutionPlan picks the parts, the forward is one: the Linear kind (models/linear.py), the
decode attention kind (models/attention.py) and the norm/RoPE/SiLU op set (models/ops.py).  With
the torch ops and "exact" matmuls the float32 math is transformers' LlamaForCausalLM op for op,
so greedy outputs agree with it bit for bit; the fused op sets (the CPU library, Triton) compute
the same with fewer passes over memory, equal to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.engine.runtime.execution_plan import GGUF_MATMULS, ExecutionPlan
from services.engine.runtime.lora import LoraRows
from services.engine.runtime.lora import apply as lora_apply
from services.engine.runtime.models import interrupt, rope
from services.engine.runtime.models import ops as op_sets
from services.engine.runtime.models.attention import Attention, AttentionMetadata
from services.engine.runtime.models.config import LlamaConfig, split_fused
from services.engine.runtime.models.gguf_weights import Blocks, RepackedBlocks, Weight, dense
from services.engine.runtime.models.linear import (
    BlockLinear,
    Concat,
    GgufLinear,
    GgufRepackedLinear,
    Int8Linear,
    Linear,
    Q4Linear,
    SplitLinear,
    has_fbgemm,
    head_kind,
    linear_kind,
    takes_blocks,
)


@dataclass
class Layer:
    input_norm: torch.Tensor      # (H,)
    q_norm: torch.Tensor | None   # (D,) Qwen3's per-head norms, else None
    k_norm: torch.Tensor | None
    qkv: Concat                   # H -> (heads + 2 kv_heads) * D
    o: Linear                     # heads*D -> H
    post_norm: torch.Tensor       # the norm before the MLP
    gate_up: Concat               # H -> 2 I
    down: Linear                  # I -> H
    attn_out_norm: torch.Tensor | None = None   # Gemma: the attention's output is normalized before the add,
    mlp_out_norm: torch.Tensor | None = None    # and the MLP's


def _fused_q4_layers(layers: list[Layer]) -> list[tuple[torch.Tensor, ...]] | None:
    """Per layer (input_norm, qkv, o, post_norm, gate_up, down) packed weights for decode_layer_q4, or
    None unless every GEMM is one lossless q4 product without bias (directly or as a split's small kind)."""
    def packed(linear: Any) -> torch.Tensor | None:
        if isinstance(linear, Concat):
            if len(linear.parts) != 1:
                return None
            linear = linear.parts[0]
        if isinstance(linear, SplitLinear):
            linear = linear.small
        ok = isinstance(linear, Q4Linear) and linear.lossless and linear.bias is None
        return linear.weight if ok else None

    out = []
    for layer in layers:
        parts = [packed(layer.qkv), packed(layer.o), packed(layer.gate_up), packed(layer.down)]
        if any(p is None for p in parts):
            return None
        qkv, o, gate_up, down = parts
        out.append((layer.input_norm, qkv, o, layer.post_norm, gate_up, down))
    return out  # type: ignore[return-value]


def _fused_gguf_layers(layers: list[Layer]) -> list[tuple[Any, ...]] | None:
    """Per layer decode_layer_gguf's weights (input_norm, up to 3 q/k/v blocks with kinds, their bias, o, post_norm,
    up to 2 gate/up blocks, down), or None unless every GEMM is gguf blocks the kernel has (directly or as a
    split's small kind), o and down without bias."""
    def blocks(linear: Any) -> GgufLinear | None:
        linear = linear.small if isinstance(linear, SplitLinear) else linear
        return linear if isinstance(linear, GgufLinear) and linear.fallback is None else None

    def parts(concat: Concat, most: int) -> list[GgufLinear] | None:
        found = [blocks(p) for p in concat.parts]
        return found if len(found) <= most and all(found) else None  # type: ignore[return-value]

    out: list[tuple[Any, ...]] = []
    for layer in layers:
        qkv, gate_up, o, down = parts(layer.qkv, 3), parts(layer.gate_up, 2), blocks(layer.o), blocks(layer.down)
        if qkv is None or gate_up is None or o is None or down is None or o.bias is not None \
                or down.bias is not None or any(p.bias is not None for p in gate_up):
            return None
        bias = None if all(p.bias is None for p in qkv) else torch.cat(
            [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in qkv]).float().contiguous()
        qkv_args = [a for p in qkv for a in (p.weight, p.kind)] + [None, 0] * (3 - len(qkv))
        gate_up_args = [a for p in gate_up for a in (p.weight, p.kind)] + [None, 0] * (2 - len(gate_up))
        out.append((layer.input_norm, *qkv_args, bias, o.weight, o.kind, layer.post_norm, *gate_up_args,
                    down.weight, down.kind))
    return out


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over each head's vector, op for op as transformers' Qwen3RMSNorm (float32 math)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class LlamaModel:
    def __init__(self, config: LlamaConfig, weights: dict[str, Weight], plan: ExecutionPlan):
        self.config = config
        self.plan = plan
        dtype, device = plan.torch_dtype, torch.device(plan.device)
        self.dtype = dtype
        linear = linear_kind(plan.matmul, plan.matmul_large, plan.split_rows)

        def w(name: str) -> torch.Tensor:
            return dense(weights[name]).to(device=device, dtype=dtype).contiguous()

        # A GGUF folder's quantized weights stay blocks where the plan multiplies by them (gguf_weights.py):
        # every one for `gguf`; the layers' for the kinds that take a file's blocks of their own layout (q4).
        keep_blocks = bool(set(GGUF_MATMULS) & {plan.matmul, plan.matmul_large})
        layer_blocks = keep_blocks or any(map(takes_blocks, (plan.matmul, plan.matmul_large)))

        def lw(name: str, blocks: bool = True) -> Weight:
            weight = weights[name]
            return weight if blocks and layer_blocks and isinstance(weight, Blocks) else w(name)

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        def norm(name: str) -> torch.Tensor:
            """An RMSNorm weight as the forward multiplies by it: Gemma's (1 + w), taken in float32."""
            if not config.norm_offset:
                return w(name)
            return (dense(weights[name]).float() + config.norm_offset).to(device=device, dtype=dtype).contiguous()

        split_fused(weights, config)          # Phi-3's fused qkv_proj / gate_up_proj, as separate tensors
        self.embed: Weight = lw("model.embed_tokens.weight", keep_blocks)         # (V, H)
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(Layer(
                input_norm=norm(p + "input_layernorm.weight"),
                q_norm=norm(a + "q_norm.weight") if config.qk_norm else None,
                k_norm=norm(a + "k_norm.weight") if config.qk_norm else None,
                qkv=Concat(linear, [lw(a + "q_proj.weight"), lw(a + "k_proj.weight"), lw(a + "v_proj.weight")],
                           [opt(a + "q_proj.bias"), opt(a + "k_proj.bias"), opt(a + "v_proj.bias")]),
                o=linear(lw(a + "o_proj.weight"), None),
                post_norm=norm(p + ("pre_feedforward_layernorm.weight" if config.sandwich_norms
                                    else "post_attention_layernorm.weight")),
                gate_up=Concat(linear, [lw(p + "mlp.gate_proj.weight"), lw(p + "mlp.up_proj.weight")], [None, None]),
                down=linear(lw(p + "mlp.down_proj.weight"), None),
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if config.sandwich_norms else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if config.sandwich_norms else None,
            ))
        self.norm = norm("model.norm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        # (V, H): the file's blocks where the plan's kinds take them, else the float head (tied: the embedding's)
        head: Weight = lw(head_name) if not tied or layer_blocks and isinstance(weights[head_name], Blocks) \
            else self.embed
        # A GGUF's head is quantized in the file already: with the gguf kind it splits as the layers do.
        gguf = plan.matmul in GGUF_MATMULS
        self.lm_head = linear(head, None) if gguf else \
            head_kind(plan.matmul, plan.matmul_large, plan.split_rows)(head, None)
        if tied and isinstance(head, Blocks) and isinstance(self.lm_head, GgufRepackedLinear) \
                and self.lm_head.fallback is None:
            # the embedding reads the head's repacked blocks: one copy of the tied weight, not two
            self.embed = RepackedBlocks(self.lm_head.weight, head.qtype, head.shape)
        if not gguf:
            head = dense(self.embed if tied else head).to(device=device, dtype=dtype)
        if isinstance(head, Blocks):        # the head in its blocks: logits (and argmax) from them, no copies
            head = torch.empty(0)
        # Greedy shortcut (fast modes on the CPU): an int8 copy of the head ranks the vocabulary,
        # then the top candidates are rescored exactly in fp32.  See greedy().  With the head in the
        # model's own 8-bit blocks, only for batches above the plan's split: up to it the blocks'
        # full product reads no more than the copy would.
        small_head = self.lm_head.small if isinstance(self.lm_head, SplitLinear) else self.lm_head
        exact_blocks = isinstance(small_head, BlockLinear) and small_head.lossless
        cpu_fast = plan.matmul not in ("exact", *GGUF_MATMULS) and plan.device == "cpu" and (
            not exact_blocks or bool(plan.matmul_large))
        self.head_weight = head if cpu_fast else None
        self.approx_head = Int8Linear(head, None) if cpu_fast and has_fbgemm() else None
        self.greedy_min_rows = plan.split_rows + 1 if exact_blocks else 1
        # RoPE tables as transformers builds them: float32 inverse frequencies (the variant's, models/rope.py)
        # times positions; cos and sin scaled by the variant's attention factor (yarn's; 1 otherwise).
        d = config.head_dim

        def tables(params: dict[str, Any], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
            inv_freq, scale = rope.frequencies(params, theta, d)
            freqs = torch.arange(config.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)                               # (P, D)
            return (emb.cos() * scale).to(device=device, dtype=dtype), (emb.sin() * scale).to(device=device,
                                                                                           dtype=dtype)

        self.cos, self.sin = tables(dict(config.rope_scaling), config.rope_theta)
        # Dynamic NTK: rows past max_position_embeddings turn at a theta of their own (rope.py), so a step
        # builds those rows' cos/sin itself (dynamic_rows); the table above serves every other row.
        self.dynamic = rope.rope_type(dict(config.rope_scaling)) == "dynamic"
        # How far requests may run: dynamic NTK exists to go past max_position_embeddings, by its factor.
        self.max_context = int(config.max_position * float(dict(config.rope_scaling)["factor"])) if self.dynamic \
            else config.max_position
        if self.dynamic and config.layer_rope:
            raise ValueError("rope_parameters: dynamic RoPE per layer type is not supported")
        if self.dynamic and plan.graphs == "cuda":
            raise ValueError("rope_parameters.rope_type dynamic: not with CUDA graphs yet (--cuda-graphs off)")
        # Per layer (cos, sin): one table per distinct rope_parameters (Gemma 3: local and global layers).
        distinct = {key: tables(dict(key), float(dict(key).get("rope_theta", config.rope_theta)))
                    for key in set(config.layer_rope)}
        self.rope_tables = [distinct[key] for key in config.layer_rope] if config.layer_rope else \
            [(self.cos, self.sin)] * config.num_layers
        self.windows = config.windows or (0,) * config.num_layers
        if any(self.windows) and plan.attention == "triton":
            raise ValueError("sliding_window: the Triton decode kernel has no sliding window yet; run this model "
                             "with --device cpu")
        self.attention = Attention(plan.attention, config.attn_scale or d ** -0.5, config.attn_softcap)
        self.ops: Any = op_sets.load(plan.ops)      # add_rms_norm, rope_and_write_kv, silu_and_mul
        # Pure-decode steps of up to `fused_rows` rows run each layer as one call of the CPU library (the same
        # ops in the same order) when every layer's GEMMs are lossless q4 (decode_layer_q4) or a GGUF's blocks
        # (decode_layer_gguf).
        plain = not (config.qk_norm or any(self.windows) or config.layer_rope or config.sandwich_norms
                     or self.dynamic or config.attn_softcap
                     or config.embed_scale != 1.0 or config.activation != "silu")   # what decode_layer_q4 computes
        fusable = (plan.attention, plan.ops) == ("fused", "cpu") and plain
        self.fused_op = "decode_layer_gguf" if gguf else "decode_layer_q4"
        self.fused_layers = (_fused_gguf_layers(self.layers) if gguf else
                             _fused_q4_layers(self.layers)) if fusable else None
        self.fused_rows = plan.split_rows if plan.matmul_large else 1 << 30

    def refresh_fused(self) -> None:
        """Take the layers' gguf kinds into the one-call decode layers again (after outliers.py changed them)."""
        if self.fused_layers is not None and self.fused_op == "decode_layer_gguf":
            self.fused_layers = _fused_gguf_layers(self.layers)

    @property
    def needs_decode_mask(self) -> bool:
        """Whether decode attention wants paged_attention.decode_mask(); the kernels mask by length."""
        return self.attention.needs_decode_mask

    def dynamic_rows(self, positions: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic NTK: each row's (cos, sin), (T, D), at its position under the theta of its `lengths` entry
        (the sequence length transformers rotates it at; rope.py)."""
        c = self.config
        params = dict(c.rope_scaling)
        within = lengths <= c.max_position                          # the default table's rows (positions < M)
        safe = torch.where(within, positions, 0)
        cos, sin = self.cos[safe].clone(), self.sin[safe].clone()
        for length in sorted(set(lengths[~within].tolist())):
            rows = (lengths == length).nonzero().flatten()
            theta = rope.dynamic_theta(params, c.rope_theta, c.head_dim, c.max_position, length)
            inv_freq, _ = rope.frequencies({"rope_type": "default"}, theta, c.head_dim)
            freqs = positions[rows].float()[:, None] * inv_freq[None, :].to(positions.device)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos[rows], sin[rows] = emb.cos().to(cos.dtype), emb.sin().to(sin.dtype)
        return cos, sin

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: list[tuple[torch.Tensor, torch.Tensor]], logits_rows: torch.Tensor,
                rope_lengths: torch.Tensor | None = None, lora: LoraRows | None = None) -> torch.Tensor:
        """input_ids, positions: (T,); logits_rows: (S,) the rows whose next token is wanted.
        Returns their final hidden states, (S, H) in the plan's dtype (logits() makes logits of them).

        Each residual add rides in the next norm (add_rms_norm adds `update` into x in place), and
        RoPE rotates q and k in place while k and v are stored in the cache.  rope_lengths: (T,) each
        row's sequence length for dynamic NTK RoPE (the model runner's), else None.  lora: the rows that run
        with a LoRA adapter (services/engine/runtime/lora.py): each projection adds their low-rank updates."""
        c = self.config
        ops = self.ops
        t = input_ids.shape[0]
        qk_heads = c.num_heads + c.num_kv_heads
        eps = c.rms_norm_eps
        x = self.embed.rows(input_ids) if isinstance(self.embed, Blocks) else self.embed[input_ids]   # (T, H)
        if c.embed_scale != 1.0:
            x = x * torch.tensor(c.embed_scale, dtype=x.dtype)
        update: torch.Tensor | None = None                                         # (T, H) not yet added to x
        if self.fused_layers is not None and meta.decode_rows is not None and not meta.prefills \
                and t <= self.fused_rows and lora is None:
            for weights, (k_cache, v_cache) in zip(self.fused_layers, kv, strict=True):
                interrupt.check()
                update = getattr(torch.ops.infermesh, self.fused_op)(
                    x, update, *weights, eps, positions, self.cos, self.sin, k_cache, v_cache, meta.slots,
                    meta.decode_tables, meta.decode_lens, self.attention.scale, c.num_heads, c.num_kv_heads,
                    c.head_dim, c.intermediate_size)
            rows = x[logits_rows]
            return ops.add_rms_norm(rows, update[logits_rows] if update is not None else None, self.norm, eps)
        tables, rope_positions = self.rope_tables, positions
        if self.dynamic and rope_lengths is not None:
            row_tables = self.dynamic_rows(positions, rope_lengths)    # row i's cos/sin at index i
            tables, rope_positions = [row_tables] * c.num_layers, torch.arange(t, device=positions.device)
        for i, (layer, window, (cos, sin), (k_cache, v_cache)) in enumerate(zip(self.layers, self.windows, tables,
                                                                                kv, strict=True)):
            interrupt.check()
            h = ops.add_rms_norm(x, update, layer.input_norm, eps)                 # x += update
            qkv = lora_apply(layer.qkv(h), h, i, "qkv", lora).view(t, qk_heads + c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                qkv[:, : c.num_heads] = _head_norm(qkv[:, : c.num_heads], layer.q_norm, eps)
                qkv[:, c.num_heads: qk_heads] = _head_norm(qkv[:, c.num_heads: qk_heads], layer.k_norm, eps)
            ops.rope_and_write_kv(qkv, rope_positions, cos, sin, k_cache, v_cache, meta.slots, c.num_heads)
            q, k, v = qkv[:, : c.num_heads], qkv[:, c.num_heads: qk_heads], qkv[:, qk_heads:]
            attn = self.attention(q, k, v, k_cache, v_cache, meta, window)         # (T, heads, D)
            flat = attn.reshape(t, c.num_heads * c.head_dim)
            out = lora_apply(layer.o(flat), flat, i, "o", lora)
            if layer.attn_out_norm is not None:
                out = ops.add_rms_norm(out, None, layer.attn_out_norm, eps)
            h = ops.add_rms_norm(x, out, layer.post_norm, eps)                     # x += out
            gate_up = lora_apply(layer.gate_up(h), h, i, "gate_up", lora)
            if c.activation == "silu":
                act = ops.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = torch.nn.functional.gelu(gate, approximate="tanh") * up
            update = lora_apply(layer.down(act), act, i, "down", lora)
            if layer.mlp_out_norm is not None:
                update = ops.add_rms_norm(update, None, layer.mlp_out_norm, eps)
        rows = x[logits_rows]                                                      # (S, H)
        return ops.add_rms_norm(rows, update[logits_rows] if update is not None else None, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (S, H) -> (S, V) float32 (soft-capped, Gemma 2)."""
        return self.final_cap(self.lm_head(hidden).float())

    def final_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-capping, in transformers' order: cap * tanh(logits / cap); no cap: logits."""
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    GREEDY_CANDIDATES = 64

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Argmax token of each row without the full fp32 vocabulary GEMM, or None if unavailable.

        The int8 head is within a small error of the fp32 logits, so the true argmax is among
        its top 64 unless 64 tokens tie within that error; the candidates are rescored in fp32
        and, sorted by id, ties resolve to the lowest id exactly as a full argmax does.  The soft-cap (tanh,
        monotonic) leaves the ranking alone, but the rescored values are capped as logits() caps them: where
        tanh rounds two logits to one value, the lower id wins there too."""
        if self.approx_head is None or self.head_weight is None or hidden.shape[0] < self.greedy_min_rows:
            return None
        approx = self.approx_head(hidden.float())                                   # (S, V)
        candidates = approx.topk(self.GREEDY_CANDIDATES, dim=-1).indices.sort(dim=-1).values  # (S, K)
        exact = self.final_cap(torch.einsum("sh,skh->sk", hidden, self.head_weight[candidates]).float())  # (S, K)
        return candidates.gather(1, exact.argmax(dim=-1, keepdim=True)).squeeze(1)
