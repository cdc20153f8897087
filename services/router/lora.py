"""LoRA adapters from the router: which exist (name -> base model and folder), which replica holds which (its
load reports), where a request for one goes, and loading one where it is not held.

A request names an adapter as its model: it runs on the adapter's base model, the engine request carrying
`adapter`.  The replicas holding it are preferred while one of them is healthy and has nothing waiting in its
queue; otherwise any replica of the base model takes the request and loads the adapter first (LoadAdapter;
one load per replica and adapter at a time, however many requests wait for it).  So a stream whose holder
died resumes on another replica.  The adapters a router knows: those loaded through it, and those any replica
reports holding (with the folder it was read from), so every router routes to them.  A folder is a path on
the engines' machines: the same path on each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import PurePath
from typing import NamedTuple

import grpc

from mesh.adapters import NAME, NAME_RULE, served_version
from mesh.errors import InvalidArgument, MeshError, NotFound
from services.router.engines import Engines
from services.router.events import RECENT
from services.router.replicas import Replica, ReplicaTable
from services.router.upstream import relay_error

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0


class Lora(NamedTuple):
    name: str
    model: str            # its base model
    path: str             # its folder on the engines' machines


class LoraAdapters:
    def __init__(self, table: ReplicaTable, engines: Engines):
        self.table, self.engines = table, engines
        self.registered: dict[str, Lora] = {}
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}

    def find(self, name: str) -> Lora | None:
        """The adapter a request's model names, or None when it names none."""
        lora = self.registered.get(name)
        if lora is not None or not name:
            return lora
        for r in self.table.all():
            if name in r.adapters and r.model:
                return Lora(name, r.model, r.adapters[name])
        return None

    def resolve(self, model: str) -> tuple[str, Lora | None]:
        """A request's `model` (`name` or `name@version`) with an adapter's name replaced by its base model's,
        and that adapter (None when the name is a served model's, or no adapter's)."""
        name = model.partition("@")[0]
        lora = self.find(name) if name not in self.table.models() else None
        return (lora.model + model[len(name):], lora) if lora is not None else (model, None)

    @staticmethod
    def base_version(lora: Lora, pinned: str) -> str:
        """The base model's version a request for `lora` pins, given as the adapter's answers name their version
        (served_version: a stream the edge resumes on another router pins what its first part carried), or as the
        base's; NotFound when it names the adapter read from another folder (other weights)."""
        base, suffix, _ = pinned.partition("+lora.")
        if suffix and served_version(base, lora.path) != pinned:
            raise NotFound(f"version {pinned!r} of {lora.name!r} is not served: the adapter is now read from "
                           f"{lora.path}")
        return base

    def known(self) -> list[tuple[Lora, list[str]]]:
        """Every adapter known here, by name, with the replicas holding it."""
        names = set(self.registered) | {n for r in self.table.all() for n in r.adapters}
        found = [lora for lora in map(self.find, sorted(names)) if lora is not None]
        return [(lora, sorted(r.replica_id for r in self.table.all() if lora.name in r.adapters)) for lora in found]

    @staticmethod
    def prefer(name: str, model: str, pool: list[Replica], usable: Callable[[Replica], bool]) -> list[Replica]:
        """The part of `pool` a request for the adapter of `model` goes to: of `model`'s replicas, its holders
        while one is `usable` (failover would take it) with nothing waiting, else all of them (the one picked
        loads it: `ensure`); the other models' replicas (failover's fallbacks) stay."""
        held = [r for r in pool if r.model == model and name in r.adapters and not r.waiting and usable(r)]
        return [*held, *(r for r in pool if r.model != model)] if held else pool

    async def ensure(self, lora: Lora, replica: Replica, timeout: float | None) -> None:
        """`replica` holds the adapter, read from its folder, once this returns (MeshError from the engine
        otherwise); one of that name read from another folder is replaced."""
        if replica.adapters.get(lora.name) == lora.path:
            return
        key = (replica.replica_id, lora.name)
        task = self._loading.get(key)
        if task is None:
            task = self._loading[key] = asyncio.create_task(self._load(lora, replica))

            def done(finished: asyncio.Task[None]) -> None:
                self._loading.pop(key, None)
                if not finished.cancelled():
                    finished.exception()            # retrieved: its waiters may all have timed out
            task.add_done_callback(done)
        await asyncio.wait_for(asyncio.shield(task), timeout)

    @staticmethod
    def dropped(lora: Lora, replica: Replica, exc: BaseException) -> bool:
        """Whether `exc` is the engine saying it does not hold the adapter the router took it to hold (it restarted,
        and its first load report has not come yet): then it is forgotten there, so the next attempt loads it."""
        if not (isinstance(exc, MeshError) and exc.code == grpc.StatusCode.NOT_FOUND and
                "is not loaded on this engine" in str(exc)):
            return False
        return replica.adapters.pop(lora.name, None) is not None

    async def _load(self, lora: Lora, replica: Replica) -> None:
        try:
            load_seconds = await self.engines.load_adapter(replica.address, lora.name, lora.path, LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            raise relay_error(f"loading LoRA adapter {lora.name!r} on {replica.replica_id}", err) from None
        replica.adapters[lora.name] = lora.path          # its load reports say so within an interval
        RECENT.record("lora_loaded", lora.model, replica.replica_id, f"{lora.name} in {load_seconds:.2f} s")
        log.info("LoRA adapter %s loaded on %s in %.2f s", lora.name, replica.replica_id, load_seconds)

    async def load(self, name: str, path: str, model: str, replica_id: str) -> Lora:
        """The admin load: on `replica_id`, or the healthy replica of `model` holding fewest adapters."""
        if not NAME.fullmatch(name):
            raise InvalidArgument(f"lora_name {name[:64]!r}: {NAME_RULE}")
        if not path:
            raise InvalidArgument("lora_path is empty: give the adapter's folder on the engines' machines")
        path = str(PurePath(path))            # as the engines report it (a trailing slash dropped)
        if name in self.table.models():
            raise InvalidArgument(f"lora_name {name!r} is the name of a served model; choose another")
        held = self.find(name)
        if held is not None and held.path != path:
            raise InvalidArgument(f"a LoRA adapter named {name!r} is loaded already (from {held.path}); "
                                  "unload it first")
        replicas = [r for r in self.table.all() if r.model == model and r.healthy]
        if replica_id:
            replicas = [r for r in replicas if r.replica_id == replica_id]
            if not replicas:
                raise NotFound(f"replica {replica_id!r} is not a healthy replica of {model!r}")
        if not replicas:
            raise NotFound(f"model {model!r} has no healthy replica to load the adapter on")
        replica = min(replicas, key=lambda r: (r.adapters.get(name) != path, len(r.adapters), r.in_flight,
                                                r.replica_id))
        lora = Lora(name, model, path)
        await self.ensure(lora, replica, LOAD_TIMEOUT_S)
        self.registered[name] = lora
        return lora

    async def unload(self, name: str) -> Lora:
        """Forgotten here and unloaded from every replica holding it (their requests on it finish first)."""
        lora = self.find(name)
        if lora is None:
            raise NotFound(f"no LoRA adapter named {name[:128]!r} is loaded")
        self.registered.pop(name, None)
        for replica in [r for r in self.table.all() if name in r.adapters]:
            try:
                await self.engines.unload_adapter(replica.address, name, LOAD_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:        # gone: it holds nothing when it comes back
                log.warning("unloading LoRA adapter %s on %s: %s", name, replica.replica_id, err.details())
            replica.adapters.pop(name, None)
        log.info("LoRA adapter %s unloaded", name)
        return lora
