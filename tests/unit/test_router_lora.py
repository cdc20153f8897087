"""The router's LoRA adapters (services/router/lora.py): which it knows (loaded through it, or reported by an
engine with its folder), where a request for one goes, and the names an answer carries (mesh/adapters.py)."""

from __future__ import annotations

import asyncio

import pytest

from mesh.adapters import served_version
from mesh.errors import InvalidArgument, NotFound
from services.router.engines import Engines
from services.router.lora import Lora, LoraAdapters
from services.router.replicas import LoadReport, Replica, ReplicaTable


def table_of(*replicas: Replica) -> ReplicaTable:
    table = ReplicaTable()
    for r in replicas:
        table._replicas[r.replica_id] = r       # noqa: SLF001 - the table as discovery would fill it
    return table


def replica(rid: str, model: str = "base", adapters: dict[str, str] | None = None, waiting: int = 0) -> Replica:
    r = Replica(rid, f"127.0.0.1:{1000 + int(rid[-1])}", model=model, healthy=True)
    r.adapters, r.waiting = dict(adapters or {}), waiting
    return r


def test_an_adapter_is_known_when_loaded_here_or_reported_by_an_engine() -> None:
    r0, r1 = replica("e0"), replica("e1", adapters={"beta": "/lora/beta"})
    lora = LoraAdapters(table_of(r0, r1), Engines())
    lora.registered["alpha"] = Lora("alpha", "base", "/lora/alpha")
    assert lora.find("alpha") == Lora("alpha", "base", "/lora/alpha")
    assert lora.find("beta") == Lora("beta", "base", "/lora/beta")          # another router loaded it
    assert lora.find("gamma") is None and lora.find("") is None
    assert lora.resolve("alpha@2") == ("base@2", Lora("alpha", "base", "/lora/alpha"))
    assert lora.resolve("base") == ("base", None) and lora.resolve("gamma") == ("gamma", None)
    assert lora.known() == [(Lora("alpha", "base", "/lora/alpha"), []), (Lora("beta", "base", "/lora/beta"), ["e1"])]


def test_a_load_report_names_the_adapters_and_their_folders() -> None:
    r = replica("e0")
    r.apply_load(LoadReport(kv_blocks_total=10, adapters=("a", "b"), adapter_paths=("/x/a", "/x/b")), 0.0)
    assert r.adapters == {"a": "/x/a", "b": "/x/b"} and r.load.adapters == ("a", "b")


def test_requests_go_to_a_free_holder_else_to_any_replica_of_the_base() -> None:
    held, other, fallback = replica("e1", adapters={"alpha": "/a"}), replica("e0"), replica("e9", model="small")
    pool = [other, held, fallback]
    assert LoraAdapters.prefer("alpha", "base", pool, lambda r: True) == [held, fallback]
    held.waiting = 2                                                         # busy: another replica loads it
    assert LoraAdapters.prefer("alpha", "base", pool, lambda r: True) == pool
    held.waiting = 0
    assert LoraAdapters.prefer("alpha", "base", pool, lambda r: r is not held) == pool   # isolated, or failed
    assert LoraAdapters.prefer("beta", "base", pool, lambda r: True) == pool


def test_bad_loads_are_refused_by_name() -> None:
    lora = LoraAdapters(table_of(replica("e0", adapters={"alpha": "/a"})), Engines())
    with pytest.raises(InvalidArgument, match="lora_name"):
        asyncio.run(lora.load("no spaces", "/x", "base", ""))
    with pytest.raises(InvalidArgument, match="served model"):
        asyncio.run(lora.load("base", "/x", "base", ""))
    with pytest.raises(InvalidArgument, match="loaded already"):
        asyncio.run(lora.load("alpha", "/elsewhere", "base", ""))
    with pytest.raises(NotFound, match="e7"):
        asyncio.run(lora.load("gamma", "/g", "base", "e7"))
    with pytest.raises(NotFound, match="no LoRA adapter named 'gamma'"):
        asyncio.run(lora.unload("gamma"))


def test_an_answer_names_the_adapter_and_folds_its_folder_into_the_version() -> None:
    assert served_version("2", "/lora/a") == served_version("2", "/lora/a") != served_version("2", "/lora/b")
    assert served_version("2", "/lora/a").startswith("2+lora.")


def test_a_version_pinned_as_an_adapters_answer_names_it_pins_the_base_version() -> None:
    # The edge resumes a stream whose router died on another router, pinning the version its first part carried.
    alpha = Lora("alpha", "base", "/lora/alpha")
    assert LoraAdapters.base_version(alpha, served_version("2", "/lora/alpha")) == "2"
    assert LoraAdapters.base_version(alpha, "2") == "2" and LoraAdapters.base_version(alpha, "") == ""
    with pytest.raises(NotFound, match="now read from /lora/alpha"):          # other weights under that name
        LoraAdapters.base_version(alpha, served_version("2", "/lora/old"))


def test_an_engine_that_lost_an_adapter_it_was_taken_to_hold_is_a_failed_attempt() -> None:
    # A restarted engine holds nothing until the router loads it again; its load report may come after a request.
    alpha, holder = Lora("alpha", "base", "/lora/alpha"), replica("e0", adapters={"alpha": "/lora/alpha"})
    lost = NotFound("engine e0: the adapter 'alpha' is not loaded on this engine")
    assert not LoraAdapters.dropped(alpha, holder, NotFound("model 'x' is not served"))
    assert not LoraAdapters.dropped(alpha, holder, InvalidArgument("the adapter 'alpha' is not loaded on this engine"))
    assert LoraAdapters.dropped(alpha, holder, lost) and holder.adapters == {}      # the next attempt loads it
    assert not LoraAdapters.dropped(alpha, holder, lost)                            # not taken to hold it: as it is
