"""The ExecutionPlan: what `auto` becomes on a CPU and on CUDA, the refusals, and that every name the plan
can hold is one its registries carry out."""

from __future__ import annotations

import pytest
import torch

from meshkernels import cpu_ops
from services.engine.config import EngineConfig
from services.engine.runtime import plan
from services.engine.runtime.models import attention, linear, ops
from services.engine.runtime.plan import ExecutionPlan, decide


def fields(p: ExecutionPlan) -> tuple[str, ...]:
    return p.device, p.dtype, p.matmul, p.attention, p.ops, p.graphs


def test_auto_on_the_cpu_is_fp32_with_fp16_weights_and_the_fused_ops() -> None:
    fused = "fused" if cpu_ops.load() else "torch"
    assert fields(decide(device="cpu")) == ("cpu", "float32", "fp16w", fused, "cpu" if cpu_ops.load() else "torch",
                                            "off")


def test_float32_is_the_exact_mode_with_the_torch_ops() -> None:
    assert fields(decide(device="cpu", dtype="float32")) == ("cpu", "float32", "exact", "torch", "torch", "off")
    assert fields(decide(device="cpu", dtype="bfloat16")) == ("cpu", "bfloat16", "exact", "torch", "torch", "off")


def test_int8_quantizes_the_weights_on_the_cpu_only() -> None:
    assert decide(device="cpu", dtype="int8").matmul == "int8"
    assert decide(device="cpu", dtype="int8").dtype == "float32"
    with pytest.raises(ValueError, match="CPU only"):
        decide(device="cuda", dtype="int8")


def test_cuda_is_bf16_with_fused_gemms_triton_kernels_and_graphs() -> None:
    assert fields(decide(device="cuda")) == ("cuda", "bfloat16", "fused", "triton", "triton", "cuda")
    # float32 keeps transformers' GEMMs and torch ops for parity; decode attention stays Triton.
    assert fields(decide(device="cuda", dtype="float32")) == ("cuda", "float32", "exact", "triton", "torch", "cuda")
    assert decide(device="cuda", graphs="off").graphs == "off"


def test_pinned_kinds_for_tests_and_benchmarks() -> None:
    p = decide(device="cpu", dtype="float32", matmul="fp16w", attention="torch", graphs="eager")
    assert fields(p) == ("cpu", "float32", "fp16w", "torch", "torch", "eager")
    t = decide(device="cpu", dtype="float32", matmul="packed", attention="triton")
    assert (t.attention, t.ops) == ("triton", "triton")        # Triton's interpreter on the CPU
    assert decide(device="cpu", dtype="float32", attention="triton").ops == "torch"   # exact keeps the torch ops


def test_impossible_plans_are_refused() -> None:
    with pytest.raises(ValueError, match="need --device cuda"):
        decide(device="cpu", graphs="cuda")
    with pytest.raises(ValueError, match="'bogus' is not one of"):
        decide(device="cpu", graphs="bogus")
    with pytest.raises(ValueError, match="attention 'fused' needs the fused CPU ops"):
        decide(device="cpu", dtype="float32", attention="fused")          # exact: never the fused ops
    with pytest.raises(ValueError, match="float32 on the CPU only"):
        ExecutionPlan("cuda", "bfloat16", "fused", "fused", "cpu", "off")
    with pytest.raises(ValueError, match="matmul 'fp8'"):
        ExecutionPlan("cpu", "float32", "fp8", "torch", "torch", "off")


def test_the_config_decides_through_the_plan() -> None:
    assert plan.for_config(EngineConfig(model_path="/m", device="cpu", dtype="float32", cuda_graphs="eager")) == \
        decide(device="cpu", dtype="float32", graphs="eager")


def test_every_name_has_its_implementation() -> None:
    assert tuple(linear.LINEARS) == plan.MATMULS
    assert tuple(attention.DECODE) == plan.ATTENTIONS
    assert tuple(ops.OPS) == plan.OPS


def test_labels_name_every_field() -> None:
    p = decide(device="cuda")
    assert p.labels() == {"device": "cuda", "dtype": "bfloat16", "matmul": "fused", "attention": "triton",
                          "ops": "triton", "graphs": "cuda", "matmul_large": "", "split_rows": "0",
                          "kv_dtype": "bfloat16"}
    assert str(p) == "cuda bfloat16, fused matmuls, triton decode attention, triton ops, bfloat16 KV cache, graphs cuda"


def test_kv_cache_is_float16_where_the_fused_cpu_ops_attend() -> None:
    fused = decide(device="cpu", dtype="auto", matmul="fp16w")
    if fused.attention == "fused":
        assert fused.kv_dtype == "float16" and fused.kv_torch_dtype == torch.float16
    exact = decide(device="cpu", dtype="float32")
    assert exact.kv_torch_dtype == torch.float32 and exact.labels()["kv_dtype"] == "float32"
    assert decide(device="cpu", dtype="auto", matmul="fp16w", kv_dtype="float32").kv_torch_dtype == torch.float32
    with pytest.raises(ValueError, match="KV cache dtype"):
        ExecutionPlan("cuda", "bfloat16", "fused", "triton", "triton", "cuda", kv_dtype="float16")


def test_a_measured_choice_becomes_the_cpu_plan() -> None:
    from services.engine.runtime.tune import Tuned, choose

    table = {"q4": [5.0, 20.0, 60.0, 200.0], "fp16w": [30.0, 35.0, 50.0, 120.0], "packed": [40.0, 45.0, 70.0, 150.0]}
    tuned = choose(table)
    assert (tuned.small, tuned.large, tuned.rows) == ("q4", "fp16w", 4)
    assert choose({"fp16w": [1.0, 2.0, 3.0, 4.0], "q4": [2.0, 3.0, 4.0, 5.0]}) == \
        Tuned("fp16w", "", 0, {"fp16w": [1.0, 2.0, 3.0, 4.0], "q4": [2.0, 3.0, 4.0, 5.0]})
    # a second copy of the weights only where it pays: 1.5x faster at 64 rows, not 1.2x
    near = {"gguf": [20.0, 25.0, 26.0, 64.0], "bf16w": [36.0, 34.0, 36.0, 53.0]}
    assert choose(near) == Tuned("gguf", "", 0, near)
    assert choose(near | {"bf16w": [36.0, 34.0, 36.0, 42.0]}).large == "bf16w"
    # ... and only where the small kind's one row pays for it too: 7% faster is not worth a copy, 20% is
    close = {"gguf": [30.0, 41.6, 310.1, 1193.5], "ggufr": [32.1, 38.6, 87.5, 297.0]}
    assert choose(close) == Tuned("ggufr", "", 0, close)
    apart = close | {"ggufr": [36.0, 38.6, 87.5, 297.0]}
    assert (choose(apart).small, choose(apart).large, choose(apart).rows) == ("gguf", "ggufr", 1)
    if cpu_ops.load():
        p = decide(device="cpu", tuned=tuned)
        assert (p.matmul, p.matmul_large, p.split_rows) == ("q4", "fp16w", 4)
        assert "q4 matmuls up to 4 rows, fp16w above" in str(p)
    assert decide(device="cpu", dtype="float32", tuned=tuned).matmul == "exact"   # the exact mode stays exact
    with pytest.raises(ValueError, match="q4, bf16w, gguf and ggufr matmuls run in a float32 model on the CPU only"):
        ExecutionPlan("cuda", "bfloat16", "q4", "triton", "triton", "off")
    for kind in ("gguf", "ggufr"):
        with pytest.raises(ValueError, match="ggufr matmuls run in a float32 model on the CPU only"):
            ExecutionPlan("cuda", "bfloat16", kind, "triton", "triton", "off")


def test_bf16w_where_onednn_cannot_pack_bf16_is_a_clear_error(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An AVX2-only CPU cannot pack bf16 weights: asking for bf16w there says so and names what runs."""
    monkeypatch.setattr(plan, "bf16w_runs", lambda: False)
    with pytest.raises(ValueError, match="matmul 'bf16w' needs a CPU with AVX-512"):
        decide(device="cpu", dtype="float32", matmul="bf16w")
    tuned = plan.tune.Tuned("q4", "bf16w", 4, {})
    with pytest.raises(ValueError, match="use 'fp16w', 'q4' or 'auto'"):
        decide(device="cpu", tuned=tuned)
    monkeypatch.setattr(plan, "bf16w_runs", lambda: True)
    assert decide(device="cpu", dtype="float32", matmul="bf16w").matmul == "bf16w"


def test_tuning_leaves_out_what_cannot_run_and_falls_back_without_shapes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.engine.runtime import tune

    kinds = ["q4", "fp16w"] if "fbgemm" in torch.backends.quantized.supported_engines else ["q4"]
    table = tune.measure(2, [(64, 40), (40, 64)], kinds, reps=1)
    assert "q4" not in table                          # 40 inputs: no 32-weight blocks
    assert tune.tune(tmp_path) is None                # no config.json to read shapes from: the default plan


def test_an_answer_timed_on_a_busy_machine_is_measured_again_once_it_is_quiet(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Tuning while other processes use the CPU caches a provisional answer; the next start measures again
    if the machine is quiet then, and keeps a quiet answer (or a provisional one while still busy)."""
    import json

    from services.engine.runtime import tune

    monkeypatch.setenv("INFERMESH_HOME", str(tmp_path / "home"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4,
                                                    "intermediate_size": 128, "num_hidden_layers": 2}))
    monkeypatch.setattr(tune, "candidates", lambda folder=None: ["fp16w", "packed"])
    timings = iter([{"fp16w": [9.0, 9.0, 9.0, 9.0], "packed": [1.0, 1.0, 1.0, 1.0]},       # skewed by a job
                    {"fp16w": [1.0, 2.0, 3.0, 4.0], "packed": [5.0, 6.0, 7.0, 8.0]}])
    calls: list[int] = []

    def measure(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return next(timings)

    monkeypatch.setattr(tune, "measure", measure)
    trims: list[int] = []
    monkeypatch.setattr(tune, "trim_heap", lambda: trims.append(1))
    others = {"during": 1.5, "now": 1.0}
    monkeypatch.setattr(tune, "_others_since", lambda: lambda: others["during"])
    monkeypatch.setattr(tune, "_others", lambda seconds: others["now"])
    first = tune.tune(folder)
    assert first is not None and first.small == "packed" and first.busy == 1.5 and len(calls) == 1
    assert "provisional" in tune.describe(first)
    assert tune.tune(folder) == first and len(calls) == 1        # still busy: the provisional answer serves
    others.update(during=0.0, now=0.0)
    again = tune.tune(folder)
    assert again is not None and again.small == "fp16w" and again.busy == 0.0 and len(calls) == 2
    assert tune.tune(folder) == again and len(calls) == 2        # a quiet answer is kept
    assert "provisional" not in tune.describe(again)
    assert len(trims) == 2          # each measurement's trial weights handed back to the system


def test_the_busy_probe_sees_another_process_spin() -> None:
    """/proc/stat accounting, not a speed: a child spinning for a second shows as other processes' CPU."""
    import subprocess
    import sys

    from services.engine.runtime import tune

    probe = tune._others_since()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    assert probe() > 0.1


def test_a_plan_tuned_on_one_build_of_the_ops_is_not_anothers(monkeypatch: pytest.MonkeyPatch) -> None:
    """INFERMESH_CPU_ISA=avx512 builds the ops without AMX: its plan is measured again, not the AMX build's reused
    (the non-AMX path's figures were the AMX plan's)."""
    from services.engine.runtime import tune

    monkeypatch.setattr(cpu_ops, "_cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                                        "avx512_vnni", "amx_tile", "amx_int8"})
    monkeypatch.delenv("INFERMESH_CPU_ISA", raising=False)
    native = tune._cache_file(2, [(64, 40)], ["gguf"])
    assert "-mamx-int8" in cpu_ops.build_flags()
    monkeypatch.setenv("INFERMESH_CPU_ISA", "avx512")
    assert "-mamx-int8" not in cpu_ops.build_flags()
    assert tune._cache_file(2, [(64, 40)], ["gguf"]) != native
