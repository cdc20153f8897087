"""The repacked products' outliers (services/engine/runtime/outliers.py) on the default model, SmolLM2, whose
hidden states have outlier channels: measured at load and kept as floats there, every repacked kind (the
one-call decode layers' too) following the decision, which is cached per model, plan and kernels;
INFERMESH_GGUF_OUTLIERS overrides it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshkernels import cpu_ops, gguf_blocks
from services.engine.runtime import outliers
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide

if not cpu_ops.load():
    pytest.skip("fused CPU ops off (INFERMESH_CPU_OPS=0) or not built (see meshkernels.cpu_ops' warning)",
                allow_module_level=True)


def repacked(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, decide(device="cpu", dtype="float32", matmul="ggufr"), kv_cache_bytes=16 << 20)


def kinds(runner: ModelRunner) -> list[int]:
    """Every repacked product's kind, and the one-call decode layers' gguf kinds (the ints in their tuples)."""
    fused = [k for layer in runner.model.fused_layers or [] for k in layer if isinstance(k, int) and k >= 256]
    return [linear.kind for linear in outliers.repacked_linears(runner.model)] + fused


def test_measured_on_a_model_with_outlier_channels(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERMESH_GGUF_OUTLIERS", raising=False)
    runner = repacked(model_dir)
    assert runner.outliers is True
    assert len(outliers.repacked_linears(runner.model)) >= 30 * 4 + 1          # every layer's products and the head
    assert all(kind >= gguf_blocks.OUTLIERS for kind in kinds(runner))
    linears = outliers.repacked_linears(runner.model)
    measured = outliers.difference(runner, linears)     # leaves them on, as it found them
    assert measured is not None and measured > outliers.THRESHOLD
    # a swapped-in model follows the decision without measuring
    other = repacked(model_dir)
    outliers.keep(other.model, False)
    assert all(gguf_blocks.REPACKED <= kind < gguf_blocks.OUTLIERS for kind in kinds(other))
    runner.use_model(other.model)
    assert all(kind >= gguf_blocks.OUTLIERS for kind in kinds(runner))


def test_the_setting_overrides_and_is_checked(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERMESH_GGUF_OUTLIERS", "off")
    runner = repacked(model_dir)
    assert runner.outliers is False
    assert all(gguf_blocks.REPACKED <= kind < gguf_blocks.OUTLIERS for kind in kinds(runner))
    monkeypatch.setenv("INFERMESH_GGUF_OUTLIERS", "sometimes")
    with pytest.raises(ValueError, match="INFERMESH_GGUF_OUTLIERS must be one of auto, on, off, got 'sometimes'"):
        repacked(model_dir)


def test_a_plan_without_repacked_products_has_no_decision(model_dir: Path) -> None:
    runner = ModelRunner(model_dir, decide(device="cpu", dtype="float32", matmul="gguf"), kv_cache_bytes=16 << 20)
    assert runner.outliers is None


def test_a_failing_probe_keeps_the_plain_products(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.delenv("INFERMESH_GGUF_OUTLIERS", raising=False)
    monkeypatch.setenv("INFERMESH_HOME", str(tmp_path))     # no cached answer from another test
    def broken(*_: object) -> float:
        raise RuntimeError("no logits here")

    monkeypatch.setattr(outliers, "difference", broken)
    runner = repacked(model_dir)          # starts all the same
    assert runner.outliers is False
    assert all(gguf_blocks.REPACKED <= kind < gguf_blocks.OUTLIERS for kind in kinds(runner))

    assert not list((tmp_path / "plans").glob("outliers-*.json"))     # a failure is not an answer to keep


def test_the_measurement_is_cached(model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("INFERMESH_GGUF_OUTLIERS", raising=False)
    monkeypatch.setenv("INFERMESH_HOME", str(tmp_path))
    probes: list[float | None] = []
    measure = outliers.difference

    def counted(runner: ModelRunner, linears: list[object]) -> float | None:
        probes.append(measure(runner, linears))            # type: ignore[arg-type]
        return probes[-1]

    monkeypatch.setattr(outliers, "difference", counted)
    first = repacked(model_dir)
    cache = outliers.cache_file(first)
    assert first.outliers is True and len(probes) == 1 and cache is not None
    assert cache.parent == tmp_path / "plans"
    assert json.loads(cache.read_text())["difference"] == probes[0]
    assert repacked(model_dir).outliers is True and len(probes) == 1     # read back, not measured again
    cache.write_text(json.dumps({"difference": 0.0}))                   # the cached answer is what decides
    assert repacked(model_dir).outliers is False and len(probes) == 1
    cache.write_text("{not json")                                        # unreadable: measured and written again
    assert repacked(model_dir).outliers is True and len(probes) == 2
    assert json.loads(cache.read_text())["difference"] == probes[1]
    other = ModelRunner(model_dir, decide(device="cpu", dtype="float32", matmul="ggufr", kv_dtype="float32"),
                        kv_cache_bytes=16 << 20)
    assert outliers.cache_file(other) != cache and len(probes) == 3      # another plan, its own answer
