"""The code base's shape: no import cycle among the project's modules, imports only downwards
through the layers, no oversized module, no two modules one letter apart, no class name twice.

Imports are read from the source (ast), wherever they sit in a file: an import tucked inside a
function to dodge a cycle (or a layer) is still a cycle (or crosses the layer); and an import of a package's
module goes through the package's __init__ (Python runs it first), so a cycle through an __init__ shows too.
"""

from __future__ import annotations

import ast
import warnings
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("infermesh", "mesh", "services", "meshkernels")
MAX_LINES = 600          # a module over this fails; one over WARN_LINES is named in a warning (time to split it)
WARN_LINES = 300
EXEMPT = {"meshkernels/cpu_ops.cpp"}          # the C++ ops file; generated stubs live outside these folders
# Each package imports only from its own layer and the ones below: the operator's tools (infermesh/) over
# the services, the services over the shared library (mesh/), and the kernels (meshkernels/) under all.
LAYERS = {"meshkernels": 0, "mesh": 1, "services": 2, "infermesh": 3}
NAMED_APART = ("infermesh", "mesh", "services", "meshkernels", "bench")   # folders whose module names are checked


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (explicitly; a package's __init__ only when named)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in known:
                    out.add(target)
                elif base in known:
                    out.add(base)
    # Importing a.b.c runs the __init__ of a.b first (and of a): an edge to each such package outside the
    # importer's own packages (whose __init__ runs before the importer anyway), so a cycle through a package's
    # __init__ (models/__init__ -> llama -> plan -> tune -> models) shows.
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    for target in list(out):
        parts = target.split(".")
        out.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in known and p not in own)
    out.discard(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def sizes() -> dict[str, int]:
    """Lines of every .py and .cpp module of the packages (the C++ ops file aside)."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            rel = path.relative_to(ROOT).as_posix()
            if path.suffix in (".py", ".cpp") and rel not in EXEMPT:
                out[rel] = len(path.read_text().splitlines())
    return out


def test_no_module_over_the_size_limit():
    long = {rel: n for rel, n in sizes().items() if n > WARN_LINES}
    if long:
        warnings.warn(f"{len(long)} modules over {WARN_LINES} lines (split where a noun wants its own room): "
                      + ", ".join(f"{rel} {n}" for rel, n in sorted(long.items(), key=lambda kv: -kv[1])),
                      stacklevel=1)
    assert {rel: n for rel, n in long.items() if n > MAX_LINES} == {}


def test_the_router_servicer_stays_thin():
    assert len((ROOT / "services/router/server.py").read_text().splitlines()) < 200


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a module imports from a layer above its own."""
    def layer(module: str) -> int:
        return LAYERS[module.partition(".")[0]]

    return sorted((name, target) for name, targets in graph.items() for target in targets
                  if layer(target) > layer(name))


def test_imports_only_go_down_the_layers():
    known = modules()
    assert set(LAYERS) == set(PACKAGES)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert upward(graph) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {"mesh.a": {"services.b", "meshkernels.c"}, "services.b": {"mesh.a", "infermesh.d"},
             "meshkernels.c": {"mesh.a"}, "infermesh.d": {"services.b", "mesh.a", "meshkernels.c"}}
    assert upward(graph) == [("mesh.a", "services.b"), ("meshkernels.c", "mesh.a"), ("services.b", "infermesh.d")]


def one_edit_apart(a: str, b: str) -> bool:
    """Levenshtein distance exactly 1: one letter replaced, added or dropped."""
    if len(a) > len(b):
        a, b = b, a
    if len(b) - len(a) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    return any(b[:i] + b[i + 1:] == a for i in range(len(b)))


def near_names() -> list[tuple[str, str, str]]:
    """(folder, name, name) for two modules (or subpackages) of one folder whose names are one edit apart."""
    found = []
    for top in NAMED_APART:
        for folder in sorted({p.parent for p in (ROOT / top).rglob("*.py")}):
            names = sorted({p.stem for p in folder.glob("*.py")} |
                           {d.name for d in folder.iterdir() if (d / "__init__.py").is_file()})
            found += [(folder.relative_to(ROOT).as_posix(), a, b)
                      for i, a in enumerate(names) for b in names[i + 1:] if one_edit_apart(a, b)]
    return found


def test_no_two_module_names_one_letter_apart():
    assert near_names() == []


def test_one_edit_apart():
    assert one_edit_apart("router", "routers") and one_edit_apart("openai", "openapi")
    assert one_edit_apart("http1", "http3") and one_edit_apart("gpu_checks", "gpu_check")
    assert not one_edit_apart("router", "router") and not one_edit_apart("http11", "http3")
    assert not one_edit_apart("router_client", "router_pool") and not one_edit_apart("ab", "ba")


def test_no_class_name_defined_in_two_modules():
    where: dict[str, list[str]] = defaultdict(list)
    for name, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where[node.name].append(name)
    assert {cls: found for cls, found in where.items() if len(found) > 1} == {}


PB_DOORS = {"services.router.server", "services.router.wire", "services.router.engines", "services.router.upstream"}


def protobuf_importers(package: str) -> set[str]:
    """The modules of `package` that import generated protobuf code (a *_pb2 or *_pb2_grpc module)."""
    def generated(name: str) -> bool:
        return name.rpartition(".")[2].endswith(("_pb2", "_pb2_grpc"))

    found = set()
    for name, path in modules().items():
        if name != package and not name.startswith(package + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(generated(a.name) for a in node.names) or \
                    isinstance(node, ast.ImportFrom) and (generated(node.module or "") or
                                                          any(generated(a.name) for a in node.names)):
                found.add(name)
    return found


def test_protobuf_stays_at_the_routers_doors():
    """Issue 50: the servicer (server.py), its conversions (wire.py), the engine client (engines.py) and the
    tokenizer / session-store clients (upstream.py); inside, the router speaks dataclasses (request.py)."""
    found = protobuf_importers("services.router")
    assert len(found) <= 4 and found == PB_DOORS


def test_the_protobuf_finder_finds_an_importer():
    assert "services.engine.rpcs.server" in protobuf_importers("services.engine")
    assert "mesh.sampling_pb" in protobuf_importers("mesh") and "mesh.sampling" not in protobuf_importers("mesh")
