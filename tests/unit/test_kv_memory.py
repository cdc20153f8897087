"""The CPU KV cache's memory (services/engine/runtime/model_runner.py kv_zeros): zeros, writable, and taken from the
machine only as pages are written."""

from __future__ import annotations

import os

import torch

from services.engine.runtime.model_runner import kv_zeros


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_kv_zeros_are_zeros_and_commit_only_what_is_written() -> None:
    shape = (2048, 16, 8, 64)                                   # 2048 blocks of 16 KiB: 32 MiB
    before = _resident_bytes()
    kv = kv_zeros(shape, torch.float16, torch.device("cpu"))
    assert kv.shape == shape and kv.dtype == torch.float16 and kv.is_contiguous()
    assert _resident_bytes() - before < 8 << 20                 # nothing touched yet: 32 MiB not taken
    kv[7] = 1.5
    assert _resident_bytes() - before < 8 << 20                 # one block's pages
    assert float(kv[7].sum()) == 1.5 * 16 * 8 * 64 and float(kv[:7].abs().sum()) == 0
    assert float(kv[8:].abs().sum()) == 0                       # untouched pages read as zeros
