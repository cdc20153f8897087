"""The CPU library's LoRA kernel (meshkernels/cpu_lora.cpp) against services/engine/runtime/lora.py's torch loop: a
mixed step's rows over adapters of different ranks and targets (some projections without factors, merged q/k/v
blocks), updates added in place to those rows only; bad tables are refused by name."""

from __future__ import annotations

import pytest
import torch

from meshkernels import cpu_ops
from services.engine.runtime.lora import PROJECTIONS, Adapter, Factors, apply, grouped

if not cpu_ops.load():
    pytest.skip("fused CPU ops off (INFERMESH_CPU_OPS=0) or not built (see meshkernels.cpu_ops' warning)",
                allow_module_level=True)

IN, Q, KV, INTER, LAYERS = 64, 64, 16, 96, 2
WIDTH = {"qkv": Q + 2 * KV, "o": IN, "gate_up": 2 * INTER, "down": IN}
FAN_IN = {"qkv": IN, "o": Q, "gate_up": IN, "down": INTER}
MODULES = {"qkv": [(0, Q), (Q, KV), (Q + KV, KV)], "o": [(0, IN)], "gate_up": [(0, INTER), (INTER, INTER)],
           "down": [(0, IN)]}


def adapter(name: str, rank: int, projections: tuple[str, ...], seed: int, dtype: torch.dtype) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    layers: list[dict[str, Factors]] = []
    for _ in range(LAYERS):
        layer = {}
        for p in projections:
            parts = MODULES[p][: 2 if p == "qkv" and rank == 3 else None]     # one adapter leaves v out
            a = torch.randn(FAN_IN[p], rank * len(parts), generator=g)
            b = torch.zeros(rank * len(parts), WIDTH[p])
            blocks = []
            for k, (col, n) in enumerate(parts):
                b[k * rank:(k + 1) * rank, col:col + n] = torch.randn(rank, n, generator=g)
                blocks.append((k * rank, (k + 1) * rank, col, col + n))
            layer[p] = Factors(a.to(dtype).contiguous(), b.to(dtype).contiguous(), tuple(blocks))
        layers.append(layer)
    return Adapter(name, rank, name, layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_kernel_adds_what_the_torch_loop_adds(rows: int, dtype: torch.dtype) -> None:
    """Float16 factors (kept so under reduced-precision plans) are widened as loaded: the torch loop widens them
    too, so both compute with the same factors."""
    check_against_reference(rows, dtype)


def check_against_reference(rows: int, dtype: torch.dtype) -> None:
    """Also run by tests/unit/test_gguf_blocks.py on the library built for each instruction set."""
    adapters = [adapter("a", 8, PROJECTIONS, 1, dtype), adapter("b", 3, ("qkv", "down"), 2, dtype),
                adapter("c", 40, ("o", "gate_up"), 3, dtype)]
    g = torch.Generator().manual_seed(rows)
    per_row = [None if i % 4 == 3 else adapters[i % 3] for i in range(rows)]
    kernel_rows, torch_rows = grouped(per_row, torch.device("cpu"), kernel=True), grouped(per_row, torch.device("cpu"))
    assert kernel_rows is not None and kernel_rows.tables is not None and torch_rows is not None
    assert torch_rows.tables is None
    for layer in range(LAYERS):
        for p in PROJECTIONS:
            h = torch.randn(rows, FAN_IN[p], generator=g)
            base = torch.randn(rows, WIDTH[p], generator=g)
            got, want = apply(base.clone(), h, layer, p, kernel_rows), apply(base.clone(), h, layer, p, torch_rows)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            base_rows = [i for i, a in enumerate(per_row) if a is None]
            assert torch.equal(got[base_rows], base[base_rows])          # the base model's rows untouched


def test_bad_tables_are_refused_by_name() -> None:
    out, h = torch.zeros(4, 8), torch.zeros(4, 8)
    rows = torch.tensor([0, 1], dtype=torch.long)
    table = torch.zeros(1, 19, dtype=torch.long)
    table[0, :2] = torch.tensor([0, 3])
    with pytest.raises(RuntimeError, match="outside rows"):
        torch.ops.infermesh.lora_apply(out, h, rows, table)
    with pytest.raises(RuntimeError, match="19 columns"):
        torch.ops.infermesh.lora_apply(out, h, rows, torch.zeros(1, 5, dtype=torch.long))
    table[0, :2], table[0, 4], table[0, 5] = torch.tensor([0, 2]), 4, 1
    table[0, 7:11] = torch.tensor([0, 4, 0, 9])
    with pytest.raises(RuntimeError, match="outside its rank"):
        torch.ops.infermesh.lora_apply(out, h, rows, table)


@pytest.mark.parametrize("kernel", [False, True])
def test_two_adapters_of_one_name_keep_their_own_factors(kernel: bool) -> None:
    """A name unloaded and loaded again from other weights while requests on the first still run: one step holds
    both, and each row gets its own adapter's update."""
    old, new = adapter("a", 8, PROJECTIONS, 1, torch.float32), adapter("a", 8, PROJECTIONS, 2, torch.float32)
    rows = grouped([old, new], torch.device("cpu"), kernel=kernel)
    assert rows is not None
    h = torch.randn(2, FAN_IN["o"], generator=torch.Generator().manual_seed(7))
    got = apply(torch.zeros(2, WIDTH["o"]), h, 0, "o", rows)
    for i, a in enumerate((old, new)):
        f = a.layers[0]["o"]
        torch.testing.assert_close(got[i], h[i] @ f.a @ f.b, rtol=1e-4, atol=1e-4)
