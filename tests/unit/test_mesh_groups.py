"""The end-to-end modules' xdist groups (tests/conftest.py): SESSION_MESH_MODULES is exactly the modules whose
tests or fixtures take the session-long mesh, and two meshes that may run at once (one of the session mesh's
group beside one of the other) never share a port.  A mesh listens on 8000, 8443 (UDP), 9100-9199 and
50030-50099, each plus its offset (`OFFSET + N` in the modules; the session mesh at OFFSET)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import (
    BESIDE_THE_SESSION_MESH,
    MESH_PORTS,
    ON_THEIR_OWN,
    ONE_UNIT,
    SESSION_MESH_MODULES,
    mesh_group,
    work_unit,
)

ROOT = Path(__file__).resolve().parents[2]
MODULES = [*sorted((ROOT / "tests" / "e2e").glob("test_*.py")), *(ROOT / "tests" / "multihost").glob("test_*.py")]
OFFSET = re.compile(r"OFFSET \+ (\d+)")


def offsets(module: Path) -> set[int]:
    code = "\n".join(line.split("#", 1)[0] for line in module.read_text().splitlines())
    return {int(n) for n in OFFSET.findall(code)}


def takes_the_session_mesh(module: Path) -> bool:
    """Whether a test or fixture of the module has a parameter `mesh` (only tests/e2e/conftest.py defines a
    fixture of that name)."""
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.FunctionDef) and (node.name.startswith("test_") or any(
                "fixture" in ast.unparse(d) for d in node.decorator_list)):
            if "mesh" in [a.arg for a in node.args.args]:
                return True
    return False


def clash(a: int, b: int) -> bool:
    """Whether meshes at offsets a and b would take one port: the same block of ports (gRPC 70 wide,
    metrics 100), or one's edge (8000 + a) among the other's metrics ports (9100-9199 + b)."""
    d = abs(a - b)
    return d < 100 or 1100 <= d <= 1199


def test_the_session_mesh_group_is_the_modules_that_take_the_session_mesh() -> None:
    assert {m.name for m in MODULES if takes_the_session_mesh(m)} == set(SESSION_MESH_MODULES)
    assert not [m for m in BESIDE_THE_SESSION_MESH if m in SESSION_MESH_MODULES]
    assert mesh_group("tests/e2e/test_grpc.py::test_x") == "session-mesh"
    assert mesh_group("tests/e2e/test_architectures_served.py::test_x[llama3]") == "session-mesh"
    assert mesh_group("tests/e2e/test_failover.py::test_x") == "own-meshes"
    assert mesh_group("tests/multihost/test_multihost.py::test_x") == "own-meshes"
    assert mesh_group("tests/service/test_engine.py::test_x") is None
    assert mesh_group("tests/e2e/test_fair_scheduling.py::test_x") == "tests/e2e/test_fair_scheduling.py"


def test_units_of_work_under_xdist() -> None:
    assert work_unit("tests/e2e/test_grpc.py::test_x") == "session-mesh"
    assert work_unit("tests/service/test_model_pull.py::test_a") == work_unit(
        "tests/service/test_model_pull.py::test_b") == "tests/service/test_model_pull.py"
    assert work_unit("tests/service/test_engine.py::test_x[a]") == "tests/service/test_engine.py::test_x[a]"
    assert all((ROOT / m).is_file() for m in ONE_UNIT)


def test_meshes_that_run_at_once_take_no_port_of_each_other() -> None:
    beside = {0} | {o for m in MODULES if m.name in BESIDE_THE_SESSION_MESH for o in offsets(m)}
    others = {(m.name, o) for m in MODULES if mesh_group(f"tests/e2e/{m.name}") == "own-meshes" for o in offsets(m)}
    assert len(beside) >= 2 and len(others) >= 10           # the modules were read
    bad = [(a, name, b) for a in beside for name, b in others if clash(a, b)]
    assert not bad, f"offsets that would share ports when their meshes run at once: {bad}"
    # A module on its own may run beside any mesh, its own included (a module fixture's and a test's).
    alone = {(m.name, o) for m in MODULES if m.name in ON_THEIR_OWN for o in offsets(m)}
    assert len(alone) >= 2
    everyone = {("session", a) for a in beside} | others | alone
    bad = [(x, y) for x in alone for y in everyone if x != y and clash(x[1], y[1])]
    assert not bad, f"offsets that would share ports when their meshes run at once: {bad}"
    # Their gRPC ports (50030-50099 + offset + the default OFFSET, 200) are in the reserved range.
    assert 50099 + 200 + max(o for _, o in everyone) <= MESH_PORTS[1]


def test_the_clash_rule() -> None:
    assert clash(300, 300) and clash(300, 399) and not clash(300, 400)
    assert clash(200, 1300) and clash(1399, 200) and not clash(200, 1400) and not clash(200, 1099)
