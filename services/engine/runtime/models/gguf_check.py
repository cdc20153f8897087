"""A GGUF model file's tensors checked against the model's config before any weight is read: every tensor the
forward reads present, of the shape the config implies (hidden size, layers, heads and KV heads, head size,
intermediate size, vocabulary) and of a type the loader reads.  Where each tensor lies is read_header's check
(mesh/models/gguf_header.py: inside the file, after the header, whole blocks).

Without it a file that disagrees with its config loads and fails later, inside a kernel: a replica reports
healthy and then fails every request.  `infermesh model register` runs `check_file` before it keeps a file, the
engine's load (models/config.py `load_weights`) before it maps a weight; both refuse with GgufError naming the
tensor, what the config expects and what the file says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from mesh.models.gguf_header import GgufError, Header, TensorInfo, read_header
from services.engine.runtime.models.gguf_weights import hf_names

Want = tuple[tuple[int, ...], str]         # a shape (outermost first, as torch reads it) and the config's sizes


class Sizes(Protocol):
    """The config fields the check reads (models/config.py's LlamaConfig has them), read-only."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def sandwich_norms(self) -> bool: ...


def supported_types() -> frozenset[str]:
    """The ggml types the loader reads (gguf_weights.py): F32, F16 as they are, and every type gguf-py's
    `dequantize` has a table for (BF16 and the block types: the `gguf` kind multiplies by some of them, every
    other kind asks for them de-quantized).  Integer and F64 tensors are no model's weights."""
    import gguf.quants

    return frozenset({"F32", "F16"} | {t.name for t in gguf.quants._type_traits})


def check_file(path: str | Path, config: Sizes) -> Header:
    """`check` on the GGUF file at `path`; returns its header."""
    header = read_header(path)
    check(header, config)
    return header


def check(header: Header, config: Sizes) -> None:
    """GgufError unless every tensor the forward reads is in `header`, shaped as `config` implies and of a
    supported type (see the module's docstring)."""
    from gguf import GGMLQuantizationType

    header.require_tensors()
    names = hf_names(header.string("general.architecture"), config.num_layers)
    loaded: dict[str, TensorInfo] = {names[t.name]: t for t in header.tensors if t.name in names}
    in_file = {hf: gguf_name for gguf_name, hf in names.items()}
    wanted, required = _wanted(config)
    for group in required:                  # each entry: the names one of which (a fused weight or its parts) is read
        if not any(all(name in loaded for name in option) for option in group):
            missing = next(name for name in group[0] if name not in loaded)
            shown = f"{in_file[missing]!r} ({missing})" if missing in in_file else repr(missing)
            raise GgufError(f"{header.path}: no tensor {shown}, which the model reads (its config: "
                            f"num_hidden_layers {config.num_layers})")
    supported = supported_types()
    for name, info in loaded.items():
        if name not in wanted:
            continue                        # mapped but not read by the forward (o_proj's bias, say)
        shape, sizes = wanted[name]
        if info.shape != shape:
            raise GgufError(f"{header.path}: tensor {info.name!r} ({name}) has shape {info.shape} in the file (dims "
                            f"{list(info.dims)}); the config ({sizes}) expects {shape}")
        kind = GGMLQuantizationType(info.qtype).name
        if kind not in supported:
            raise GgufError(f"{header.path}: tensor {info.name!r} ({name}) is of type {kind}, which the engine's "
                            "loader does not read (F32, F16, BF16 or a block type gguf-py de-quantizes)")


def _wanted(c: Sizes) -> tuple[dict[str, Want], list[list[tuple[str, ...]]]]:
    """(each weight the forward may read -> its shape and the sizes it follows, the required ones: groups of
    alternatives, e.g. q/k/v or Phi-3's one qkv_proj)."""
    h, v, i, d = c.hidden_size, c.vocab_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * d, c.num_kv_heads * d
    hidden, vocab, inter = f"hidden_size {h}", f"vocab_size {v}", f"intermediate_size {i}"
    heads = f"num_attention_heads {c.num_heads} x head_dim {d}"
    kv_heads = f"num_key_value_heads {c.num_kv_heads} x head_dim {d}"
    wanted: dict[str, Want] = {"model.embed_tokens.weight": ((v, h), f"{vocab}, {hidden}"),
                               "lm_head.weight": ((v, h), f"{vocab}, {hidden}"), "model.norm.weight": ((h,), hidden)}
    required: list[list[tuple[str, ...]]] = [[("model.embed_tokens.weight",)], [("model.norm.weight",)]]
    norms = ["input_layernorm", "post_attention_layernorm"] + (
        ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if c.sandwich_norms else [])
    for layer in range(c.num_layers):
        p, a = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn."
        qkv, kvs, mlp = f"{heads}, {hidden}", f"{kv_heads}, {hidden}", f"{inter}, {hidden}"
        shapes: dict[str, Want] = {
            a + "q_proj.weight": ((q, h), qkv), a + "k_proj.weight": ((kv, h), kvs),
            a + "v_proj.weight": ((kv, h), kvs), a + "o_proj.weight": ((h, q), f"{hidden}, {heads}"),
            a + "q_proj.bias": ((q,), heads), a + "k_proj.bias": ((kv,), kv_heads),
            a + "v_proj.bias": ((kv,), kv_heads),
            a + "qkv_proj.weight": ((q + 2 * kv, h), f"{heads} + 2 x {kv_heads}, {hidden}"),
            p + "mlp.gate_proj.weight": ((i, h), mlp), p + "mlp.up_proj.weight": ((i, h), mlp),
            p + "mlp.gate_up_proj.weight": ((2 * i, h), f"2 x {mlp}"),
            p + "mlp.down_proj.weight": ((h, i), f"{hidden}, {inter}"),
            **{p + n + ".weight": ((h,), hidden) for n in norms}}
        required += [[(p + n + ".weight",)] for n in norms]
        required += [[(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), (a + "qkv_proj.weight",)],
                     [(a + "o_proj.weight",)],
                     [(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (p + "mlp.gate_up_proj.weight",)],
                     [(p + "mlp.down_proj.weight",)]]
        if c.qk_norm:
            shapes |= {a + "q_norm.weight": ((d,), f"head_dim {d}"), a + "k_norm.weight": ((d,), f"head_dim {d}")}
            required += [[(a + "q_norm.weight",)], [(a + "k_norm.weight",)]]
        wanted |= shapes
    return wanted, required
