"""The engine's lifecycle RPCs: LoadVersion (hot swap, services/engine/versions.py) and Drain.

A mixin of EngineServicer (services/engine/server.py), which holds the state they use: the engine,
the calls in flight (`queues`), the step loop's wakeup, and the Service's health and discovery hooks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from mesh import models, peers
from mesh.errors import InvalidArgument
from mesh.grpcutil import rpc_errors
from mesh.request_limits import name_problem
from meshpb.v1 import engine_pb2

log = logging.getLogger(__name__)


class Lifecycle:
    engine: Any
    config: Any
    queues: dict[str, Any]
    _wakeup: asyncio.Event
    _loading: asyncio.Lock
    draining: bool
    set_serving: Callable[[bool], Awaitable[None]] | None
    withdraw: Callable[[], Awaitable[None]] | None

    @rpc_errors
    async def LoadVersion(self, request: engine_pb2.LoadVersionRequest, context: grpc.aio.ServicerContext
                          ) -> engine_pb2.LoadVersionResponse:
        """Hot swap (services/engine/versions.py): the weights load in a worker thread while this engine
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
            async with self._loading:
                await asyncio.to_thread(versions.build, request.version, folder)
        if request.activate:
            versions.activate(request.version)
            self._wakeup.set()
            while versions.active != request.version:       # the step loop switches before its next step
                await asyncio.sleep(0.01)
                if not self.engine.has_work():
                    versions.switch()
        log.info("version %s %s in %.1f s (active %s; loaded %s)", request.version,
                 "loaded" if request.folder else "switched to", time.monotonic() - started, versions.active,
                 ", ".join(versions.loaded()))
        return engine_pb2.LoadVersionResponse(active_version=versions.active, loaded_versions=versions.loaded(),
                                              load_seconds=time.monotonic() - started)


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
