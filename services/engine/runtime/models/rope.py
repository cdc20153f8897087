"""Rotary position embedding variants: the inverse frequencies each one rotates by, and the factor
its cos/sin tables are scaled by.  The forward builds one (positions, head_dim) cos/sin table from
them at load (models/llama.py); everything after that is the same for every variant.

- default: theta ** (-2i / d).
- linear (position interpolation): the default frequencies divided by `factor`.
- llama3 (Llama 3.1 / 3.2): long wavelengths (beyond original_max_position_embeddings /
  low_freq_factor) divided by `factor`, short ones (below ... / high_freq_factor) kept, and the band
  between blended linearly in original_max_position_embeddings / wavelength.
- yarn: per dimension a blend of interpolated (divided by `factor`) and extrapolated (default)
  frequencies, ramping between the dimensions that turn beta_fast and beta_slow times over the
  original context; cos/sin scaled by 0.1 ln(factor) + 1 (or by attention_factor, or the mscale
  ratio) to keep attention's temperature.
- dynamic (NTK-aware): the default frequencies of a larger theta, theta (factor s / M - (factor -
  1)) ** (d / (d - 2)), for a sequence length s beyond the model's max_position_embeddings M; at s <=
  M, the default.  As transformers' generate applies it, a position's s depends on when it was
  computed: a prompt of L tokens is rotated at s = max(M, L), each later token p at s = max(M, p + 1),
  and the cache keeps every key as it was rotated (dynamic_lengths gives each row its s).

longrope (whose frequencies switch with the length and carry per-dimension factors) is refused with
the config field named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

VARIANTS = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_type(params: Mapping[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def check(params: Mapping[str, Any]) -> None:
    """Raise ValueError naming the field when `params` (rope_parameters / rope_scaling) is not supported."""
    kind = rope_type(params)
    if kind not in VARIANTS:
        raise ValueError(f"rope_parameters.rope_type {kind!r} is not supported (supported: {', '.join(VARIANTS)}); "
                         "longrope switches its per-dimension factors with the sequence length")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("rope_parameters.partial_rotary_factor other than 1.0 is not supported yet")
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings"), "dynamic": ("factor",)}.get(kind, ())
    missing = [name for name in needed if params.get(name) is None]
    if missing:
        raise ValueError(f"rope_parameters ({kind}) lacks {', '.join(missing)}")


def dynamic_theta(params: Mapping[str, Any], theta: float, head_dim: int, max_position: int, length: int) -> float:
    """Dynamic NTK's theta for a sequence of `length` (the model's own at or below max_position)."""
    factor, length = float(params["factor"]), max(length, max_position)
    return theta * ((factor * length / max_position) - (factor - 1)) ** (head_dim / (head_dim - 2))


def frequencies(params: Mapping[str, Any], theta: float, head_dim: int) -> tuple[torch.Tensor, float]:
    """(head_dim / 2,) float32 inverse frequencies and the cos/sin scale of the variant `params` names
    (dynamic: those at or below max_position_embeddings, the default's; beyond, `dynamic_theta`)."""
    check(params)
    kind = rope_type(params)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = 1.0 / (theta ** exponents)
    if kind in ("default", "dynamic"):
        return base, 1.0
    factor = float(params["factor"])
    if kind == "linear":
        return base / factor, 1.0
    original = float(params["original_max_position_embeddings"])
    if kind == "llama3":
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        wavelength = 2 * math.pi / base
        scaled = torch.where(wavelength > original / low, base / factor, base)
        blend = (original / wavelength - low) / (high - low)
        mid = (wavelength >= original / high) & (wavelength <= original / low)
        return torch.where(mid, (1 - blend) * scaled / factor + blend * scaled, scaled), 1.0
    # yarn
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:       # the dimension that turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp                                # 1: extrapolate (the default frequency), 0: interpolate
    inv = (base / factor) * (1 - keep) + base * keep

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return inv, float(attention)
