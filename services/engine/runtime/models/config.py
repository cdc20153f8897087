"""A Llama-family checkpoint as the forward reads it: config.json as one frozen LlamaConfig (every
architecture's differences from Llama as fields: RoPE variant, q/k norms, windows, Gemma's norms, scales
and soft-caps), and the weights by their Hugging Face names (Phi-3's fused projections split)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.engine.runtime.models import gguf_check, gguf_weights, rope
from services.engine.runtime.models.gguf_weights import Weight

# Gemma2Config's defaults (transformers), for the fields a Gemma 2 config.json may leave out.
GEMMA2_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


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
    rope_scaling: tuple[tuple[str, Any], ...] = ()   # rope_parameters beyond the type's defaults (models/rope.py)
    qk_norm: bool = False                 # Qwen3, Gemma 3: RMSNorm over each head's q and k before RoPE
    windows: tuple[int, ...] = ()         # per layer: sliding-window size, 0 = full attention; () = all full
    # Gemma 3's differences from Llama, off by default:
    layer_rope: tuple[tuple[tuple[str, Any], ...], ...] = ()   # per layer rope_parameters (theta included)
    embed_scale: float = 1.0              # embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    norm_offset: float = 0.0              # every RMSNorm multiplies by (offset + weight) (Gemma: 1)
    sandwich_norms: bool = False          # norms on the attention and MLP outputs too (Gemma)
    activation: str = "silu"              # the MLP's gate: silu | gelu_tanh
    attn_scale: float = 0.0               # attention's softmax scale; 0: head_dim ** -0.5
    # Gemma 2's soft-capping (0: off): attention scores (scaled, before the mask) and the final logits
    # become cap * tanh(x / cap).
    attn_softcap: float = 0.0
    final_softcap: float = 0.0

    @classmethod
    def from_folder(cls, folder: Path) -> LlamaConfig:
        """config.json of a folder whose model_type the registry (models/__init__.py) maps here."""
        c = json.loads((folder / "config.json").read_text())
        model_type = c.get("model_type")
        if model_type == "gemma2":      # what transformers' Gemma2Config assumes where config.json is silent
            c = {**GEMMA2_DEFAULTS, **c}
        params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        layer_rope: tuple[tuple[tuple[str, Any], ...], ...] = ()
        if params and all(isinstance(v, dict) for v in params.values()):
            # Per layer kind (Gemma 3: local layers turn at another theta than global ones).
            kinds = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
            missing = sorted(set(kinds) - set(params))
            if missing:
                raise ValueError(f"rope_parameters has no entry for layer type(s) {', '.join(missing)}")
            for kind in set(kinds):
                rope.check(params[kind])
            layer_rope = tuple(tuple(sorted(params[kind].items())) for kind in kinds)
            params = dict(params.get("full_attention") or next(iter(params.values())))
        rope.check(params)
        gemma = model_type in ("gemma2", "gemma3_text")
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if c.get(field) is not None and not gemma:
                raise ValueError(f"{field} ({c[field]}): soft-capping is Gemma's; transformers' {model_type} "
                                 "does not apply it")
        if c.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported: the engine decodes causally")
        activation = c.get("hidden_activation") or c.get("hidden_act") or "silu"
        activations = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
        if activation not in activations:
            raise ValueError(f"hidden_act {activation!r} is not supported (silu, gelu_pytorch_tanh)")
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads, intermediate_size=c["intermediate_size"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(params.get("rope_theta", c.get("rope_theta", 10000.0))),
            max_position=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            qkv_bias=c.get("attention_bias", c.get("model_type") == "qwen2"),
            rope_scaling=tuple(sorted((k, v) for k, v in params.items() if k != "rope_theta")),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            windows=_windows(c),
            layer_rope=layer_rope,
            embed_scale=c["hidden_size"] ** 0.5 if gemma else 1.0,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            activation=activations[activation],
            attn_scale=c["query_pre_attn_scalar"] ** -0.5 if gemma and c.get("query_pre_attn_scalar") else 0.0,
            attn_softcap=float(c.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(c.get("final_logit_softcapping") or 0.0),
        )


def _windows(c: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers applies them: Mistral slides every
    layer when `sliding_window` is set; Qwen2/3 name each layer's kind in `layer_types` (with
    use_sliding_window); Gemma 2 without `layer_types` slides every other layer, from the first."""
    window = c.get("sliding_window") or 0
    layers = c["num_hidden_layers"]
    if not window:
        return ()
    if c.get("model_type") in ("mistral", "phi3") and "layer_types" not in c:
        return (int(window),) * layers
    kinds = c.get("layer_types")
    if kinds is None and c.get("model_type") == "gemma2":
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if kinds is None:
        if not c.get("use_sliding_window", False):
            return ()
        kinds = ["sliding_attention" if i >= c.get("max_window_layers", layers) else "full_attention"
                 for i in range(layers)]
    windows = tuple(int(window) if kind == "sliding_attention" else 0 for kind in kinds)
    return windows if any(windows) else ()


def split_fused(weights: dict[str, Weight], config: LlamaConfig) -> None:
    """Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj: split them (in place, as
    views) under the names the Llama layout uses."""
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        fused = _dense(weights.pop(p + "self_attn.qkv_proj.weight", None))
        if fused is not None:
            q, k, v = fused.split([q_rows, kv_rows, kv_rows])
            weights.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                            p + "self_attn.v_proj.weight": v})
        fused = _dense(weights.pop(p + "mlp.gate_up_proj.weight", None))
        if fused is not None:
            gate, up = fused.chunk(2)
            weights.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})


def _dense(weight: Weight | None) -> torch.Tensor | None:
    return None if weight is None else gguf_weights.dense(weight)


def load_weights(folder: Path) -> dict[str, Weight]:
    """The folder's weights by Hugging Face name: its safetensors, or its GGUF file (quantized tensors kept
    as blocks: models/gguf_weights.py), its tensors first checked against the config (models/gguf_check.py:
    GgufError naming the tensor; a replica never serves weights its kernels would fail on)."""
    from safetensors.torch import load_file

    if gguf_weights.has_gguf(folder):
        config = check_weights(folder)
        return gguf_weights.load(folder, config.num_layers, config.num_heads, config.num_kv_heads)

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    weights: dict[str, Weight] = {}
    for name in files:
        weights.update(load_file(str(folder / name)))
    return weights


def check_weights(folder: Path) -> LlamaConfig:
    """The folder's config, its GGUF's tensors checked against it (models/gguf_check.py; GgufError naming the
    tensor): before a load, and before a hot swap frees the running weights for one that would fail."""
    config = LlamaConfig.from_folder(folder)
    if gguf_weights.has_gguf(folder):
        gguf_check.check_file(folder / gguf_weights.FILE, config)
    return config
