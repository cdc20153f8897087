"""The engine's LoRA RPCs (LoadAdapter, UnloadAdapter), a mixin of the engine servicer: the pool is
runtime/adapters.py, the math runtime/lora.py.  A folder is read in a worker thread, so the
engine keeps stepping while an adapter loads."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import Any

import grpc

from mesh import peers
from mesh.errors import InvalidArgument
from mesh.grpcutil import rpc_errors
from mesh.heap import trim_heap
from meshpb.v1 import engine_pb2
from services.engine import metrics

log = logging.getLogger(__name__)


class AdapterRPCs:
    engine: Any
    config: Any

    @rpc_errors
    async def LoadAdapter(self, request: engine_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
                          ) -> engine_pb2.AdaptersResponse:
        peers.require(context, "LoadAdapter", peers.ENGINE)
        started = time.monotonic()
        confined(request.path, self.config.lora_roots)
        pool = self.engine.adapters
        adapter = await asyncio.get_running_loop().run_in_executor(None, pool.load, request.name, request.path)
        seconds = time.monotonic() - started
        metrics.LORA_LOAD.labels(self.config.replica_id).observe(seconds)
        metrics.LORA_ADAPTERS.labels(self.config.replica_id).set(len(pool.names()))
        log.info("engine %s: LoRA adapter %s loaded from %s (rank %d, %.1f MB) in %.2f s", self.config.replica_id,
                 adapter.name, request.path, adapter.rank, adapter.nbytes / 1e6, seconds)
        return engine_pb2.AdaptersResponse(adapters=pool.names(), found=True, load_seconds=seconds)

    @rpc_errors
    async def UnloadAdapter(self, request: engine_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
                            ) -> engine_pb2.AdaptersResponse:
        peers.require(context, "UnloadAdapter", peers.ENGINE)
        pool = self.engine.adapters
        found = pool.unload(request.name)
        metrics.LORA_ADAPTERS.labels(self.config.replica_id).set(len(pool.names()))
        gc.collect()
        trim_heap()               # its factors' pages back to the system (those its last requests hold: at their end)
        if found:
            log.info("engine %s: LoRA adapter %s unloaded", self.config.replica_id, request.name)
        return engine_pb2.AdaptersResponse(adapters=pool.names(), found=found)


def confined(path: str, roots: tuple[str, ...]) -> None:
    """INVALID_ARGUMENT unless `path`, its symlinks and `..` resolved, lies under one of `roots` (--lora-roots;
    none: anywhere).  An admin key must not be a way to read any folder of the engine's machine."""
    if not roots:
        return
    real = os.path.realpath(path)
    if not any(real == (r := os.path.realpath(root)) or real.startswith(r.rstrip(os.sep) + os.sep) for root in roots):
        raise InvalidArgument(f"lora_path {path[:200]!r} is outside the folders this engine loads adapters from "
                              f"(--lora-roots: {', '.join(roots)})")
