"""tests/gpu/checks.py's checks as tests: without CUDA on the tiny model through Triton's interpreter and
the decode graphs' buffers without capture (what `gpu_check.py --smoke` runs); on a GPU compiled,
captured and with longer prompts, plus the CUDA-only checks (no host sync, SmolLM2's shapes)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # read when the Triton kernels are defined

from tests.gpu import checks  # noqa: E402

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; none here (bench/gpu_check.py runs these checks "
                                                 "on a lent GPU)")
SMOKE = not CUDA          # on the CPU: the smoke sizes


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    """fp32 parity means fp32 matmuls (as gpu_check.py sets for the whole run)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(scope="module")
def tiny(device: torch.device, tmp_path_factory: pytest.TempPathFactory) -> checks.Model:
    return checks.Model("tiny", device, tmp_path_factory.mktemp("models"))


def passes(verdict: checks.Verdict) -> None:
    assert verdict.ok, f"{verdict.check}: {verdict.detail}"


def test_triton_decode_kernel_matches_torch_and_float64(device: torch.device) -> None:
    passes(checks.check_kernel(device, SMOKE))


def test_fp32_greedy_parity_with_transformers(tiny: checks.Model) -> None:
    passes(checks.check_fp32_parity(tiny, SMOKE))


def test_bf16_logits_within_transformers_own_bf16_error(tiny: checks.Model) -> None:
    passes(checks.check_bf16_logits(tiny, SMOKE))


@needs_cuda
def test_no_host_sync_inside_a_step(tiny: checks.Model) -> None:
    passes(checks.check_no_sync(tiny))


@needs_cuda
def test_smollm2_shapes_parity(tmp_path: Path) -> None:
    model = checks.Model("smollm2-135m", torch.device("cuda"), tmp_path)
    passes(checks.check_fp32_parity(model, smoke=False))
    passes(checks.check_bf16_logits(model, smoke=False))
