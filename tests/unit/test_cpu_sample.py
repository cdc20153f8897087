"""The CPU library's sampling ops (meshkernels/cpu_sample.cpp) against their torch references in
services/engine/runtime/sampler.py: the candidates (topk + logsumexp) and the whole-vocabulary inverse CDF, on
the native build and the AVX2 and portable ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshkernels import cpu_ops
from services.engine.runtime import sampler

if not cpu_ops.load():
    pytest.skip("fused CPU ops off (INFERMESH_CPU_OPS=0) or not built (see meshkernels.cpu_ops' warning)",
                allow_module_level=True)

ops = torch.ops.infermesh


def rows(n: int, vocab: int, seed: int, flat: bool = False) -> torch.Tensor:
    """Logits shaped like a model's (a few likely tokens over a long tail), or flat ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 2.0
    return x if flat else x + torch.where(torch.rand(n, vocab, generator=g) < 0.002, 9.0, 0.0)


def fused(logits: torch.Tensor, temps: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    n = logits.shape[0]
    values, ids = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64)
    lse, counts = torch.empty(n), torch.empty(n, dtype=torch.int64)
    ops.sample_candidates(logits, temps, values, ids, lse, counts)
    return values, ids, lse, counts


@pytest.mark.parametrize("vocab,k,flat", [(151_936, 256, False), (49_152, 256, True), (1000, 1000, True),
                                          (37, 8, False)])
def test_candidates_are_the_top_tokens_and_lse_the_whole_vocabularys(vocab: int, k: int, flat: bool) -> None:
    logits = rows(4, vocab, vocab, flat)
    temps = torch.tensor([0.7, 1.0, 1.3, 0.2])
    values, ids, lse, counts = fused(logits, temps, k)
    ref_values, ref_ids, ref_lse = sampler.candidates_reference(logits, temps, k)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    for r in range(4):
        n = int(counts[r])
        assert n >= 1 and torch.isinf(values[r, n:]).all() and (ids[r, n:] == -1).all()
        torch.testing.assert_close(values[r, :n], ref_values[r, :n], rtol=1e-6, atol=1e-6)
        assert set(ids[r, :n].tolist()) == set(ref_ids[r, :n].tolist())     # ties may come in another order
        # what was left out is e^-20 as likely as the first, or the row held k
        assert n == k or float(ref_values[r, n]) < float(values[r, 0]) - 20 + 1e-4


def test_whole_vocabulary_draws_equal_the_torch_inverse_cdf() -> None:
    logits = rows(8, 49_152, 3)
    temps = torch.tensor([0.5, 0.7, 1.0, 1.0, 1.5, 2.0, 0.9, 1.1])
    draws = torch.tensor([0.0, 0.999999, 0.5, 0.25, 0.75, 0.1, 0.9, 0.33])
    out = torch.empty(8, dtype=torch.int64)
    ops.sample_whole(logits, temps, draws, out)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    ids = torch.arange(logits.shape[1])
    expected = [sampler.inverse_cdf(ids, probs[r], float(draws[r])) for r in range(8)]
    assert sum(a == b for a, b in zip(out.tolist(), expected, strict=True)) >= 7   # one bucket edge allowed


def test_the_ops_refuse_bad_temperatures_and_shapes() -> None:
    logits = rows(2, 100, 0)
    with pytest.raises(RuntimeError, match="temperature must be positive"):
        fused(logits, torch.tensor([0.0, 1.0]), 8)
    with pytest.raises(RuntimeError, match="one row per logits row"):
        fused(logits, torch.tensor([1.0]), 8)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_the_other_instruction_set_paths_sample_alike(isa: str) -> None:
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_ops._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    script = (
        "import torch; from meshkernels import cpu_ops; from services.engine.runtime import sampler;"
        "assert cpu_ops.load();"
        "g = torch.Generator().manual_seed(5); x = torch.randn(3, 20_000, generator=g) * 3;"
        "t = torch.tensor([0.7, 1.0, 1.4]); v, i, l = sampler.candidates(x, t, 64);"
        "rv, ri, rl = sampler.candidates_reference(x, t, 64);"
        "torch.testing.assert_close(l, rl, rtol=1e-5, atol=1e-5);"
        "assert all(set(i[r].tolist()) == set(ri[r].tolist()) for r in range(3));"
        "o = torch.empty(3, dtype=torch.int64);"
        "torch.ops.infermesh.sample_whole(x, t, torch.tensor([0.2, 0.5, 0.8]), o);"
        "p = torch.softmax(x / t.unsqueeze(1), -1); ids = torch.arange(20_000);"
        "e = [sampler.inverse_cdf(ids, p[r], u) for r, u in enumerate([0.2, 0.5, 0.8])];"
        "assert sum(a == b for a, b in zip(o.tolist(), e)) >= 2, (o, e); print('ok')")
    env = {**os.environ, "INFERMESH_CPU_ISA": isa, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
