"""What a LoRA adapter must be before the engine holds it: its config's fields (PEFT's adapter_config.json, or
what a GGUF LoRA file's header gives) of their types and ranges, and each factor a finite floating-point matrix
that stays finite in the dtype the engine keeps it in.  Each refusal is a ValueError naming the field or the
tensor, what was expected and what the adapter has; the pool (adapters.py) answers it as INVALID_ARGUMENT.

Before, such adapters gave INTERNAL with raw exception text (r or a factor's rank 0 divided by zero, a list for
alpha_pattern), or loaded and failed every step they ran in (NaN factors: the step's requests all failed and the
router excluded the replica).  Shapes against the base model are lora.py's `build`, which knows the projections.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

Factor = tuple[str, torch.Tensor]       # a factor and its name in the adapter's file


def shown(value: Any) -> str:
    """A value as a message quotes it: its repr, at most 64 characters (an operator's file may hold anything)."""
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def whole(value: Any) -> bool:
    """A positive whole number (bool is not one, though Python counts it an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def positive(value: Any) -> bool:
    """A finite positive number."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_config(config: Any, source: Path) -> dict[str, Any]:
    """`config` if its fields are what lora.py reads them as: r a positive whole number, lora_alpha a finite
    positive number, alpha_pattern / rank_pattern objects of module name -> such numbers, target_modules a
    module name (or pattern) or a list of them, use_rslora true or false.  Absent fields keep their defaults."""
    if not isinstance(config, dict):
        raise ValueError(f"{source}: adapter_config.json holds {type(config).__name__} {shown(config)}, not an object")
    if "r" in config and not whole(config["r"]):
        raise ValueError(f"{source}: r {shown(config['r'])} is not a positive whole number (the adapter's rank)")
    if "lora_alpha" in config and not positive(config["lora_alpha"]):
        raise ValueError(f"{source}: lora_alpha {shown(config['lora_alpha'])} is not a finite positive number")
    for field, good, what in (("alpha_pattern", positive, "finite positive numbers"),
                              ("rank_pattern", whole, "positive whole numbers")):
        pattern = config.get(field)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            raise ValueError(f"{source}: {field} {shown(pattern)} is not an object of module name -> {what}")
        for key, value in pattern.items():
            if not key or not good(value):
                raise ValueError(f"{source}: {field}[{shown(key)}] is {shown(value)}; its values are {what}")
    targets = config.get("target_modules")
    if targets is not None and not (isinstance(targets, str) and targets) and not (
            isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)):
        raise ValueError(f"{source}: target_modules {shown(targets)} is not a module name (or pattern) or a list of "
                         "them")
    if not isinstance(config.get("use_rslora", False), bool):
        raise ValueError(f"{source}: use_rslora {shown(config['use_rslora'])} is not true or false")
    return config


def check_factor(source: Path, name: str, value: Any) -> torch.Tensor:
    """A factor as read from the file: a floating-point tensor of two dimensions, none of its values NaN or
    infinite."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{source}: {name!r} is a {type(value).__name__}, not a tensor")
    if not value.is_floating_point():
        raise ValueError(f"{source}: tensor {name!r} is {value.dtype}; LoRA factors are floating point")
    if value.dim() != 2 or min(value.shape) < 1:
        raise ValueError(f"{source}: tensor {name!r} has shape {tuple(value.shape)}; a LoRA factor is a matrix of "
                         "rank x inputs (lora_A) or outputs x rank (lora_B), none of them 0")
    bad = int((~torch.isfinite(value)).sum())
    if bad:
        raise ValueError(f"{source}: tensor {name!r} has {bad} NaN or infinite values (of {value.numel()})")
    return value


def check_kept(source: Path, name: str, value: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """A factor (lora_B times its scale) still finite in the dtype the engine keeps it in (float16 on the CPU
    kernel's reduced plans: beyond 65504 it would be infinite and every row it adapts NaN)."""
    if not bool(torch.isfinite(value.to(dtype)).all()):
        raise ValueError(f"{source}: tensor {name!r} times its scale {scale:g} reaches {float(value.abs().max()):.4g}, "
                         f"beyond {dtype}, in which this engine keeps adapters")
