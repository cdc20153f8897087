"""Shared fixtures: the default model's folder (pulled by `make setup`) and its transformers reference; and,
as root, the meshes' fixed gRPC ports kept out of Linux's ephemeral range for the session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mesh import models

# The end-to-end meshes listen on 50051 + offset (offsets up to ~1,900): inside Linux's ephemeral
# range (32768-60999), so any outgoing connection that happens to take one of them as its local
# port makes a later mesh fail to bind it ("Address already in use").
MESH_PORTS = (50000, 51999)
RESERVED = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")


def pytest_sessionstart(session: pytest.Session) -> None:
    reserve_mesh_ports()


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker, torch's threads are the worker's share of the cores: N workers each
    spinning N OpenMP threads on N cores would wait on each other (the meshes' processes set their own)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that starts meshes (marker e2e) goes to one xdist group, so that under `-n N --dist
    loadgroup` they run on one worker, in file order, as they do without xdist: their fixed ports
    (tests/e2e/conftest.py) never meet and no two meshes share the cores; the rest spread over the others."""
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.xdist_group("meshes"))


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
def hf(model_dir: Path):  # type: ignore[no-untyped-def]
    """(transformers' float32 model, tokenizer) of the default model: the reference (tests/reference.py)."""
    from transformers import AutoTokenizer

    from tests.reference import load_model

    return load_model(model_dir), AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """The redis-server binary (tests/redis_server.py installs it as root), or the test is skipped."""
    from tests.redis_server import install

    binary, why = install()
    if binary is None:
        pytest.skip(f"Redis session store tests need a real redis-server: {why}")
    return binary
