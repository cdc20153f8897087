"""Test helper: write a Llama-architecture GGUF of a transformers model, as llama.cpp's converter lays one
out (tensor names, q/k rows permuted for its RoPE, hyperparameters), quantized with the `gguf` package;
the tokenizer metadata is copied from another GGUF (the default model's), its vocabulary cut to the first
tokens (`tokenizer_fields`): a real BPE tokenizer, small enough that transformers' GGUF reader takes
milliseconds instead of seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q and k: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks (gguf-py dequantizes them but has no quantizer): per 256 weights, fp16 d and dmin, 6-bit
    scale and min per 32-weight sub-block (packed into 12 bytes as llama.cpp's get_scale_min_k4 reads
    them), and 4-bit q, the 2 sub-blocks of each 64 sharing 32 bytes (low nibbles, then high).  The
    weight is d * scale * q - dmin * min.  A plain min/max fit: enough to round-trip tests."""
    blocks = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(blocks.min(axis=2), 0.0)                        # (B, 8)
    step = (blocks.max(axis=2) - lo) / 15.0
    d = (step.max(axis=1) / 63.0).astype(np.float16)                 # (B,)
    dmin = ((-lo).max(axis=1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63).astype(np.uint8)
    scale = df * sc.astype(np.float32)                               # (B, 8)
    offset = dminf * mn.astype(np.float32)
    q = np.clip(np.round(np.divide(blocks + offset[:, :, None], scale[:, :, None],
                                   out=np.zeros_like(blocks), where=scale[:, :, None] > 0)), 0, 15).astype(np.uint8)
    packed = np.zeros((blocks.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        packed[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        packed[:, j + 4] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        packed[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(blocks.shape[0], 128)   # sub-blocks 2k (low), 2k+1 (high)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1)
    return out.reshape(w.shape[0], -1)


Field = tuple[str, Any, Any, Any]          # key, value, GGUF value type, sub-type of an array


def tokenizer_fields(source: Path, vocab: int) -> list[Field]:
    """The `tokenizer.*` metadata of the GGUF `source`, its token arrays cut to the first `vocab` tokens and
    its merges to those among them (pieces and result kept)."""
    import gguf

    fields: list[Field] = []
    reader = gguf.GGUFReader(str(source))
    kept = set(reader.fields["tokenizer.ggml.tokens"].contents()[:vocab])
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = value[:vocab]
        elif key == "tokenizer.ggml.merges":
            value = [m for m in value if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
        fields.append((key, value, field.types[0], field.types[1] if len(field.types) > 1 else None))
    return fields


def write_llama_gguf(model: Any, path: Path, qtype: str, tokenizer: list[Field], embed_qtype: str = "F16") -> None:
    """`model` (a transformers Llama whose vocabulary is the tokenizer's) as a GGUF of `qtype` weights."""
    import gguf

    c = model.config
    kinds = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    for key, value, kind, sub in tokenizer:
        writer.add_key_value(key, value, kind, sub_type=sub)

    def tensor(name: str, w: np.ndarray, kind: str) -> None:
        if kind in ("F32", "F16"):
            writer.add_tensor(name, w.astype(np.float32 if kind == "F32" else np.float16))
        elif kind == "Q4_K":
            writer.add_tensor(name, quantize_q4_k(w), raw_dtype=kinds[kind])
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kinds[kind]), raw_dtype=kinds[kind])

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensor("token_embd.weight", state["model.embed_tokens.weight"], embed_qtype)
    tensor("output_norm.weight", state["model.norm.weight"], "F32")
    if not c.tie_word_embeddings:
        tensor("output.weight", state["lm_head.weight"], embed_qtype)
    for i in range(c.num_hidden_layers):
        for ours, theirs in NAMES.items():
            w = state[f"model.layers.{i}.{ours}.weight"]
            if ours == "self_attn.q_proj":
                w = _permute(w, c.num_attention_heads)
            elif ours == "self_attn.k_proj":
                w = _permute(w, c.num_key_value_heads)
            tensor(f"blk.{i}.{theirs}.weight", w, "F32" if w.ndim == 1 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
