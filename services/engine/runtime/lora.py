"""LoRA adapters on the engine's model: a PEFT folder read into per-layer low-rank factors, and the update
that adds each row's adapter to the base projections of a mixed batch.

A PEFT LoRA folder holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, rank_pattern,
alpha_pattern) and `adapter_model.safetensors` (or `.bin`) with `...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`
(r x in) and `lora_B.weight` (out x r).  The base projection runs once for every row of the step; then, per
adapter, its rows' update `(h[rows] @ A^T) @ B^T * scale` is added into the rows of the projection's output
(q, k and v share the fused qkv output, gate and up the gate_up one: their factors are merged at load into
one pair per projection, each module's B block at its columns, so a projection costs two small GEMMs).  Targets: q, k,
v, o, gate, up and down projections; an adapter naming another module, a layer the model has not, or shapes
that do not fit is refused (ValueError naming it).  On the CPU library (meshkernels/cpu_lora.cpp) a projection's
updates for every adapter of the step are one call over B's nonzero blocks only; the torch loop here is its
reference (and the path on other devices and dtypes).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.engine.runtime.lora_checks import Factor, check_config, check_factor, check_kept, shown

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Which fused projection a module writes into, and its slice there (in units the model's config gives).
PROJECTION = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
              "up_proj": "gate_up", "down_proj": "down"}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# The CPU kernel's table (meshkernels/cpu_lora.cpp): per adapter, its rows' span then ENTRY values (A's and B's
# addresses, rank, blocks, float16, then KERNEL_BLOCKS blocks of 4): 2 + ENTRY = 19 columns.
KERNEL_BLOCKS = 3
ENTRY = 5 + 4 * KERNEL_BLOCKS
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class Shape:
    """The base model's sizes the adapter must fit."""

    layers: int
    hidden: int
    q_out: int
    kv_out: int
    intermediate: int
    heads: int = 0            # attention heads and KV heads (a GGUF file's q/k rows are in llama.cpp's order)
    kv_heads: int = 0

    def dims(self, module: str) -> tuple[int, int]:
        """(in, out) of a module's projection."""
        return {"q_proj": (self.hidden, self.q_out), "k_proj": (self.hidden, self.kv_out),
                "v_proj": (self.hidden, self.kv_out), "o_proj": (self.q_out, self.hidden),
                "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
                "down_proj": (self.intermediate, self.hidden)}[module]

    def width(self, projection: str) -> int:
        """The fused projection's output columns."""
        return {"qkv": self.q_out + 2 * self.kv_out, "o": self.hidden, "gate_up": 2 * self.intermediate,
                "down": self.hidden}[projection]

    def offset(self, module: str) -> int:
        """Where the module's columns start in its fused projection's output."""
        return {"q_proj": 0, "k_proj": self.q_out, "v_proj": self.q_out + self.kv_out, "o_proj": 0,
                "gate_proj": 0, "up_proj": self.intermediate, "down_proj": 0}[module]


@dataclass(frozen=True)
class Factors:
    """One fused projection's LoRA factors, its modules' merged and transposed for the products."""

    a: torch.Tensor          # (in, sum of the modules' ranks): A^T, the modules' stacked
    b: torch.Tensor          # (sum of ranks, the projection's whole output): B^T, the scale folded in, each
                             # module's block at its ranks and columns, zero elsewhere
    blocks: tuple[tuple[int, int, int, int], ...] = ()   # those blocks: (rank start, end, column start, end)

    def entry(self) -> list[int]:
        """This pair as the CPU kernel's table columns 2..18: A's and B's addresses, rank, its blocks' count,
        float16 or not, the blocks."""
        flat = [v for block in self.blocks for v in block]
        return [self.a.data_ptr(), self.b.data_ptr(), self.a.shape[1], len(self.blocks),
                int(self.a.dtype == torch.float16), *flat, *[0] * (4 * KERNEL_BLOCKS - len(flat))]


@dataclass
class Adapter:
    name: str
    rank: int
    # What the prefix cache namespaces its blocks by: the name and the weights file it was read from (its path,
    # size and modification time), so an adapter loaded again under the name from other weights shares nothing.
    key: str = ""
    layers: list[dict[str, Factors]] = field(default_factory=list)   # layer -> "qkv" | "o" | "gate_up" | "down"
    nbytes: int = 0
    _entries: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def entries(self) -> torch.Tensor:
        """(layers, 4, ENTRY) int64: every projection's kernel entry (all zeros where the adapter has none)."""
        if self._entries is None:
            self._entries = torch.tensor([[f.entry() if (f := layer.get(p)) is not None else [0] * ENTRY
                                           for p in PROJECTIONS] for layer in self.layers], dtype=torch.long)
        return self._entries


def load_adapter(name: str, folder: str | Path, shape: Shape, dtype: torch.dtype = torch.float32) -> Adapter:
    """A PEFT LoRA folder as an Adapter for a model of `shape`; ValueError naming what does not fit (a GGUF LoRA
    file: services/engine/runtime/lora_gguf.py)."""
    folder = Path(folder)
    config, pairs, weights = _read_peft(folder, shape)
    return build(name, weights_key(name, weights), config, pairs, shape, dtype, folder)


def weights_key(name: str, weights: Path) -> str:
    """Adapter.key: the name and the weights file (path, size, modification time)."""
    stat = weights.stat()
    return f"{name}|{weights.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


Pairs = dict[tuple[int, str], dict[str, Factor]]      # (layer, module) -> "A" | "B" -> (name in the file, tensor)


def _read_peft(folder: Path, shape: Shape) -> tuple[dict[str, Any], Pairs, Path]:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder}: no adapter_config.json (a PEFT LoRA folder has one)")
    try:
        config = check_config(json.loads(config_file.read_text()), config_file)
    except UnicodeDecodeError:
        raise ValueError(f"{config_file}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file}: not JSON ({exc})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{folder}: peft_type {shown(config.get('peft_type'))} is not LORA")
    if config.get("use_dora"):
        raise ValueError(f"{folder}: DoRA adapters are not supported")
    weights = weights_file(folder)
    pairs: Pairs = {}
    for key, value in _tensors(weights).items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"{weights}: tensor {shown(key)} is not a LoRA factor of a layer's projection")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in MODULES:
            raise ValueError(f"{weights}: target module {module!r} is not one of {', '.join(MODULES)}")
        if layer >= shape.layers:
            raise ValueError(f"{weights}: layer {layer} is past the model's {shape.layers} layers")
        add_factor(pairs, weights, (layer, module, which), key, value)
    return config, pairs, weights


def add_factor(pairs: Pairs, source: Path, at: tuple[int, str, str], name: str, value: Any) -> None:
    """One factor checked (lora_checks.py) into `pairs`: the second tensor for one layer's module and side is
    refused, not taken in place of the first."""
    layer, module, which = at
    held = pairs.setdefault((layer, module), {})
    if which in held:
        raise ValueError(f"{source}: tensors {held[which][0]!r} and {name!r} are both layer {layer}'s {module} "
                         f"lora_{which}")
    held[which] = (name, check_factor(source, name, value))


def build(name: str, key: str, config: dict[str, Any], pairs: Pairs, shape: Shape, dtype: torch.dtype,
          source: Path) -> Adapter:
    """An Adapter from each (layer, module)'s {"A": (r, in), "B": (out, r)} and its config (r, lora_alpha,
    use_rslora, alpha_pattern; checked: lora_checks.py): shapes checked against the base's projections, scales
    folded into B, each projection's modules merged."""
    if not pairs:
        raise ValueError(f"{source}: the adapter has no LoRA factors")
    check_config(config, source)
    adapter = Adapter(name, int(config.get("r", 0)), key, [{} for _ in range(shape.layers)])
    # layer -> projection -> (A (r, in), B (out, r) scaled, first column in the projection's output) per module
    modules: list[dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]]] = [{} for _ in range(shape.layers)]
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{source}: layer {layer} {module} has lora_{next(iter(ab))} without its pair")
        (a_name, a), (b_name, b) = ab["A"], ab["B"]
        fan_in, fan_out = shape.dims(module)
        rank = a.shape[0]
        for factor, got, want in ((a_name, a, (rank, fan_in)), (b_name, b, (fan_out, rank))):
            if tuple(got.shape) != want:
                raise ValueError(f"{source}: tensor {factor!r} has shape {tuple(got.shape)}; the model's layer {layer} "
                                 f"{module} ({fan_in} -> {fan_out}) at rank {rank} expects {want}: an adapter of "
                                 "another base?")
        scale = _scale(config, module, rank)
        scaled = b.float() * scale
        check_kept(source, a_name, a, dtype)
        check_kept(source, b_name, scaled, dtype, scale)
        modules[layer].setdefault(PROJECTION[module], []).append((a.float(), scaled, shape.offset(module)))
    for layer, projections in enumerate(modules):
        for projection, parts in projections.items():
            merged = _merged(parts, shape.width(projection), dtype)
            adapter.layers[layer][projection] = merged
            adapter.nbytes += merged.a.nbytes + merged.b.nbytes
    return adapter


def _merged(parts: list[tuple[torch.Tensor, torch.Tensor, int]], width: int, dtype: torch.dtype) -> Factors:
    """One projection's modules as one pair: A stacked, B placed at each module's ranks and columns."""
    rank = sum(a.shape[0] for a, _, _ in parts)
    a_t = torch.cat([a for a, _, _ in parts]).t().to(dtype).contiguous()
    b_t = torch.zeros(rank, width)
    start, blocks = 0, []
    for a, b, offset in parts:
        b_t[start:start + a.shape[0], offset:offset + b.shape[0]] = b.t()
        blocks.append((start, start + a.shape[0], offset, offset + b.shape[0]))
        start += a.shape[0]
    return Factors(a_t, b_t.to(dtype).contiguous(), tuple(blocks))


def _scale(config: dict[str, Any], module: str, rank: int) -> float:
    """lora_alpha / r (or / sqrt(r) with use_rslora), with the config's per-module patterns (their values checked
    finite and positive: lora_checks.py)."""
    alpha = float(config.get("lora_alpha", rank))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module in pattern:
            alpha = float(value)
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def weights_file(folder: Path) -> Path:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"{folder}: no adapter_model.safetensors or adapter_model.bin")


def _tensors(file: Path) -> dict[str, Any]:
    """The weights file's tensors by name.  adapter_model.bin is a pickle: torch reads it with weights_only=True,
    which builds tensors and plain containers only and refuses any other object (a pickle that would run code);
    what it or safetensors refuses comes back as a ValueError naming the file."""
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(file)))
        except Exception as exc:            # safetensors' own error class, not a ValueError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"{file}: not a safetensors file ({shown(first)})") from None
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception:                       # pickle's and torch's errors; their text offers to load it unsafely
        raise ValueError(f"{file}: torch's weights_only reader refuses it (adapter_model.bin may hold tensors and "
                         "plain containers only; adapter_model.safetensors is the safe format)") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{file}: holds a {type(loaded).__name__}, not a dict of tensor name -> tensor")
    return {str(k): v for k, v in loaded.items()}


@dataclass(frozen=True)
class LoraRows:
    """A step's rows that run with an adapter, grouped by adapter: `index` (R,) the rows in that order, `spans`
    each adapter's slice of it.  A projection gathers those rows once, runs each adapter's two small GEMMs on its
    slice (only its own rows: no work for the base model's rows or another adapter's), and adds the updates back
    in one index_add."""

    index: torch.Tensor
    spans: tuple[tuple[Adapter, int, int], ...]
    # The CPU kernel's table per layer and projection, (layers, 4, adapters, 19); None: the torch loop.
    tables: torch.Tensor | None = None


def apply(out: torch.Tensor, h: torch.Tensor, layer: int, projection: str, rows: LoraRows | None) -> torch.Tensor:
    """Add each row's adapter update into `out` (T, out) from `h` (T, in), in place; returns `out`."""
    if rows is None:
        return out
    if rows.tables is not None and out.dtype == h.dtype == torch.float32 and out.is_contiguous() \
            and h.is_contiguous():
        torch.ops.infermesh.lora_apply(out, h, rows.index, rows.tables[layer, PROJECTIONS.index(projection)])
        return out
    x = h.index_select(0, rows.index)
    delta = torch.zeros(x.shape[0], out.shape[1], dtype=x.dtype, device=x.device)
    for adapter, start, end in rows.spans:
        f = adapter.layers[layer].get(projection)
        if f is not None:
            a, b = (f.a, f.b) if f.a.dtype == x.dtype else (f.a.to(x.dtype), f.b.to(x.dtype))   # float16 kept
            torch.mm(torch.mm(x[start:end], a), b, out=delta[start:end])
    out.index_add_(0, rows.index, delta.to(out.dtype))
    return out


def grouped(adapters: Sequence[Adapter | None], device: torch.device, kernel: bool = False) -> LoraRows | None:
    """The step's rows by adapter (`adapters[i]` is row i's; None: the base model), or None when no row has one;
    `kernel`: with the CPU kernel's tables (float32 or float16 factors on the CPU).  Grouped by the adapter object,
    not its name: a request that began on a name's earlier weights (unloaded, then loaded again from others)
    keeps them."""
    by_adapter: dict[int, tuple[Adapter, list[int]]] = {}
    for i, adapter in enumerate(adapters):
        if adapter is not None:
            by_adapter.setdefault(id(adapter), (adapter, []))[1].append(i)
    if not by_adapter:
        return None
    order: list[int] = []
    spans = []
    for adapter, rows in by_adapter.values():
        spans.append((adapter, len(order), len(order) + len(rows)))
        order += rows
    index = torch.tensor(order, dtype=torch.long, device=device)
    if not kernel or device.type != "cpu" or any(_dtype(a) not in (torch.float32, torch.float16) for a, _, _ in spans):
        return LoraRows(index, tuple(spans))
    entries = torch.stack([a.entries() for a, _, _ in spans], dim=2)             # (layers, 4, adapters, ENTRY)
    bounds = torch.tensor([[start, end] for _, start, end in spans], dtype=torch.long)
    tables = torch.cat([bounds.expand(*entries.shape[:2], -1, -1), entries], dim=3).contiguous()
    return LoraRows(index, tuple(spans), tables)


def _dtype(adapter: Adapter) -> torch.dtype:
    factors = next((f for layer in adapter.layers for f in layer.values()), None)
    return factors.a.dtype if factors is not None else torch.float32
