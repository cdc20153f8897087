"""Shared fixtures: the default model's folder (pulled by `make setup`) and its transformers reference; and,
as root, the meshes' fixed gRPC ports kept out of Linux's ephemeral range for the session."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from mesh import models

# The end-to-end meshes listen on 50051 + offset (offsets up to ~3,200): inside Linux's ephemeral
# range (32768-60999), so any outgoing connection that happens to take one of them as its local
# port makes a later mesh fail to bind it ("Address already in use").
MESH_PORTS = (50000, 53299)
# Under pytest-xdist the end-to-end modules run in two groups side by side, each group on one worker in file
# order (MeshGroups below): the modules on the session-long mesh (tests/e2e/conftest.py `mesh`) plus
# BESIDE_THE_SESSION_MESH, and every other module (each with a mesh of its own): about 5 minutes each on 2
# cores.  Two meshes running at once must not share a port: a mesh takes 8000, 8443 (UDP), 9100-9199 and
# 50030-50099, each + its offset, so offsets of meshes that may run at once differ by at least 100 and never
# by 1100-1199 (one's edge on the other's metrics ports).  tests/unit/test_mesh_groups.py checks both lists
# and the offsets.  A module in ON_THEIR_OWN is a unit by itself, handed to whichever worker is free, so its
# meshes may run beside those of either group: its offsets clash with none.
SESSION_MESH_MODULES = ("test_edge_fuzz.py", "test_grpc.py", "test_http3.py", "test_openai_api.py",
                        "test_responses_api.py", "test_routing.py", "test_supervision.py")
BESIDE_THE_SESSION_MESH = ("test_architectures_served.py",)
ON_THEIR_OWN = ("test_fair_scheduling.py", "test_structured_outputs.py")
# Modules whose tests share a session fixture that costs seconds (test_model_pull.py: a pull of the default model,
# ~9 s): one unit of work under xdist, so the fixture runs on one worker, once.
ONE_UNIT = ("tests/service/test_model_pull.py",)
RESERVED = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")


def pytest_sessionstart(session: pytest.Session) -> None:
    reserve_mesh_ports()


def pytest_configure(config: pytest.Config) -> None:
    """The engines the suite starts (some 30 meshes' worth) keep torch's allocator off 2 MB pages
    (services/engine/__main__.py turns them on unless THP_MEM_ALLOC_ENABLE is set): a speed setting for
    steps, whose first touch costs ~5 s of CPU per GiB (weights and KV cache) on these VMs; an engine
    starts in ~3 s of CPU instead of ~8.

    In a pytest-xdist worker, torch's threads are the worker's share of the cores, and OpenMP threads
    (the worker's, and those of the meshes it starts) sleep when they wait instead of spinning: with a
    worker per core, a mesh's 2-thread engine otherwise spins against the other worker (a 4 s test took
    48 s)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "0")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")      # read when libgomp loads: before torch
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def mesh_group(nodeid: str) -> str | None:
    """The xdist group of an end-to-end test ("session-mesh", "own-meshes", or its module's path for one
    ON_THEIR_OWN), None for any other test."""
    path = Path(nodeid.split("::", 1)[0])
    if path.parent.name not in ("e2e", "multihost"):
        return None
    if path.name in ON_THEIR_OWN:
        return str(path)
    return "session-mesh" if path.name in SESSION_MESH_MODULES + BESIDE_THE_SESSION_MESH else "own-meshes"


def work_unit(nodeid: str) -> str:
    """The unit of work under xdist a test belongs to: its mesh group, its module (ONE_UNIT), or itself."""
    module = nodeid.split("::", 1)[0]
    return mesh_group(nodeid) or (module if module in ONE_UNIT else nodeid)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The session mesh's group runs as one block where its first test stands (its modules are otherwise
    interleaved with the others in file order), so a serial run starts that mesh once and stops it after
    the group's last test (tests/e2e/conftest.py); under xdist each worker collects the same order."""
    group = [item for item in items if mesh_group(item.nodeid) == "session-mesh"]
    if group:
        first = items.index(group[0])
        rest = [item for item in items if mesh_group(item.nodeid) != "session-mesh"]
        items[:] = rest[:first] + group + rest[first:]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduler, each mesh group one unit of work (the two largest, so they start first, one
    per worker), each ONE_UNIT module one, and every other test a unit of its own, handed to whichever worker
    is free."""
    from xdist.scheduler import LoadScopeScheduling

    class MeshGroups(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return MeshGroups(config, log)


def reserve_mesh_ports() -> None:
    """As root, add MESH_PORTS to net.ipv4.ip_local_reserved_ports (they are then never handed out
    as ephemeral ports; listening on them explicitly still works).  Without root, leave it."""
    low, high = MESH_PORTS
    try:
        current = RESERVED.read_text().strip()
    except OSError:
        return
    if f"{low}-{high}" in current.split(",") or os.geteuid() != 0:
        return
    try:
        RESERVED.write_text(",".join(filter(None, [current, f"{low}-{high}"])) + "\n")
    except OSError:
        pass                       # a read-only /proc/sys (some containers): the tests run as before


@pytest.fixture(scope="session")
def model_dir() -> Path:
    try:
        return models.path("default")
    except models.ModelError as exc:
        pytest.fail(f"{exc} (run `make setup`)")


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path) -> Any:
    """transformers' tokenizer of the default model: the tokenizer service's reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def hf(model_dir: Path, hf_tokenizer: Any):  # type: ignore[no-untyped-def]
    """(transformers' float32 model, tokenizer) of the default model: the reference (tests/reference.py)."""
    from tests.reference import load_model

    return load_model(model_dir), hf_tokenizer


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """The redis-server binary (tests/redis_server.py installs it as root), or the test is skipped."""
    from tests.redis_server import install

    binary, why = install()
    if binary is None:
        pytest.skip(f"Redis session store tests need a real redis-server: {why}")
    return binary
