"""The engine's lifecycle RPCs: LoadVersion (hot swap, services/engine/runtime/versions.py) and Drain.

A mixin of EngineServicer (services/engine/rpcs/server.py), which holds the state they use: the engine,
the calls in flight (`queues`), the step loop's wakeup, and the Service's health and discovery hooks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from mesh import models, peers
from mesh.errors import InvalidArgument, ResourceExhausted
from mesh.grpcutil import rpc_errors
from mesh.request_limits import name_problem
from meshpb.v1 import engine_pb2
from services.engine.runtime.versions import available_bytes, weight_bytes

log = logging.getLogger(__name__)

MEMORY_HEADROOM = 0.9           # load beside the running weights only into 90% of the memory available


class Lifecycle:
    engine: Any
    config: Any
    queues: dict[str, Any]
    _wakeup: asyncio.Event
    _loading: asyncio.Lock
    draining: bool
    set_serving: Callable[[bool], Awaitable[None]] | None
    withdraw: Callable[[], Awaitable[None]] | None
    _step_thread: ThreadPoolExecutor

    @rpc_errors
    async def LoadVersion(self, request: engine_pb2.LoadVersionRequest, context: grpc.aio.ServicerContext
                          ) -> engine_pb2.LoadVersionResponse:
        """Hot swap (services/engine/runtime/versions.py): the weights load in a worker thread while this engine
        keeps stepping; the switch happens at the start of a step."""
        peers.require(context, "LoadVersion", peers.ENGINE)
        versions, started = self.engine.versions, time.monotonic()
        problem = name_problem("version", request.version)
        if problem or not request.version:
            raise InvalidArgument(problem or "version is empty")
        if request.folder:
            try:
                folder = models.path(request.folder)          # a folder, or a registered model's
            except models.ModelError as exc:
                raise InvalidArgument(f"{request.folder!r} is not a model folder or a registered model on this "
                                      f"engine's machine: {exc}") from None
            # What would be refused is refused now: _replace frees the running weights before it builds.
            await asyncio.to_thread(versions.check, request.version, folder)
            need, free = weight_bytes(folder), available_bytes()
            async with self._loading:
                if need <= free * MEMORY_HEADROOM:
                    await asyncio.to_thread(versions.build, request.version, folder)
                elif request.activate:
                    await self._replace(request.version, folder, need, free)
                else:
                    raise ResourceExhausted(f"version {request.version}'s weights ({need >> 20} MiB) do not fit "
                                            f"beside the running ones ({free >> 20} MiB available); activate it to "
                                            "have this engine drain and replace them")
        if request.activate:
            versions.activate(request.version)
            self._wakeup.set()
            loop = asyncio.get_running_loop()
            while versions.active != request.version:       # the step loop switches before its next step
                await asyncio.sleep(0.01)
                if not self.engine.has_work():              # idle: switch on the step thread ourselves
                    await loop.run_in_executor(self._step_thread, versions.switch)
        log.info("version %s %s in %.1f s (active %s; loaded %s)", request.version,
                 "loaded" if request.folder else "switched to", time.monotonic() - started, versions.active,
                 ", ".join(versions.loaded()))
        return engine_pb2.LoadVersionResponse(active_version=versions.active, loaded_versions=versions.loaded(),
                                              load_seconds=time.monotonic() - started)


    async def _replace(self, version: str, folder: Path, need: int, free: int) -> None:
        """Not enough memory for two versions: stop taking work (UNAVAILABLE, NOT_SERVING: the routers
        send it elsewhere), let the calls in flight finish, free the running weights, load the new
        ones, and serve again."""
        log.warning("version %s (%d MiB) does not fit beside the running weights (%d MiB available): "
                    "draining, then replacing them", version, need >> 20, free >> 20)
        self.draining = True
        if self.set_serving is not None:
            await self.set_serving(False)
        try:
            while self.queues:
                await asyncio.sleep(0.1)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._step_thread, self.engine.versions.replace, version, folder)
        finally:
            self.draining = False
            if self.set_serving is not None:
                await self.set_serving(True)

    @rpc_errors
    async def Drain(self, request: engine_pb2.DrainRequest, context: grpc.aio.ServicerContext
                    ) -> engine_pb2.DrainResponse:
        peers.require(context, "Drain", peers.ENGINE)
        if not self.draining:
            self.draining = True
            log.info("draining: %d call(s) in flight finish, no new ones", len(self.queues))
            if self.set_serving is not None:
                await self.set_serving(False)
        in_flight = len(self.queues)
        while self.queues:
            await asyncio.sleep(0.1)
        if self.withdraw is not None:
            await self.withdraw()
        log.info("drained: nothing in flight; out of discovery")
        return engine_pb2.DrainResponse(finished=in_flight)
