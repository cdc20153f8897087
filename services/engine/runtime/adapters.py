"""The engine's LoRA adapters by name (services/engine/runtime/lora.py reads and applies them).

`load` reads a PEFT folder (the server calls it off the step thread) and registers it under a name; the
factors of at most `max_bytes` of adapters are held, least recently used out first (an adapter pushed out
is read from its folder again when a request names it).  A request holds its adapter object to its end, so
`unload` (new requests for the name are then NOT_FOUND) and eviction free an adapter's memory only once its
requests are done.  Prefix-cache blocks are namespaced per adapter and the weights it was read from (a
request's cache_salt: Adapter.key)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mesh.adapters import NAME, NAME_RULE
from mesh.errors import InvalidArgument, NotFound
from services.engine.runtime.lora import Adapter, Shape, load_adapter, weights_file, weights_key
from services.engine.runtime.lora_gguf import is_gguf_lora, load_gguf_adapter

if TYPE_CHECKING:
    from services.engine.core.request import Request
    from services.engine.runtime.model_runner import ModelRunner



def shape_of(runner: ModelRunner) -> Shape:
    c = runner.config
    return Shape(c.num_layers, c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                 c.intermediate_size, c.num_heads, c.num_kv_heads)


# GEMM kinds that round the weights (below float32): the adapters' factors are then kept in float16 for the CPU
# kernel (half the bytes a step reads; meshkernels/cpu_lora.cpp), not finer than the base model's own products.
REDUCED = frozenset({"fp16w", "int8", "q4", "bf16w", "gguf", "ggufr"})


def factor_dtype(runner: ModelRunner) -> torch.dtype:
    """The dtype an engine keeps LoRA factors in: float16 on the CPU kernel under a plan whose GEMMs round the
    weights anyway, else the engine's own (float32: exact plans compute adapters exactly as transformers + peft)."""
    plan = runner.plan
    if plan.device == "cpu" and plan.ops == "cpu" and {plan.matmul, plan.matmul_large} & REDUCED:
        return torch.float16
    return runner.dtype


class AdapterPool:
    def __init__(self, shape: Shape, dtype: torch.dtype, max_bytes: int = 1 << 30):
        self.shape, self.dtype, self.max_bytes = shape, dtype, max_bytes
        self.folders: dict[str, Path] = {}
        self.loaded: OrderedDict[str, Adapter] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, name: str, folder: str | Path) -> Adapter:
        """Read and register an adapter (replacing one of that name, unless it was read from these very weights:
        the same file, size and modification time); InvalidArgument naming what is wrong."""
        if not NAME.fullmatch(name):
            raise InvalidArgument(f"adapter name {name[:64]!r}: {NAME_RULE}")
        path = Path(folder)
        if not path.is_dir() and not (path.is_file() and path.suffix == ".gguf"):
            raise InvalidArgument(f"lora_path {str(folder)[:256]!r} is not a folder (or a .gguf file) on the engine's "
                                  "machine")
        try:
            gguf = is_gguf_lora(path)
            with self._lock:                # the same weights loaded already (another router's load): kept
                held = self.loaded.get(name)
            if held is not None and held.key == weights_key(name, gguf or weights_file(path)):
                return held
            adapter = load_gguf_adapter(name, gguf, self.shape, self.dtype) if gguf else \
                load_adapter(name, path, self.shape, self.dtype)
        except (ValueError, OSError) as exc:
            raise InvalidArgument(f"adapter {name!r}: {exc}") from None
        with self._lock:
            self.folders[name] = path
            self._keep(adapter)
        return adapter

    def unload(self, name: str) -> bool:
        with self._lock:
            self.loaded.pop(name, None)
            return self.folders.pop(name, None) is not None

    def get(self, name: str) -> Adapter:
        with self._lock:
            adapter = self.loaded.get(name)
            if adapter is not None:
                self.loaded.move_to_end(name)
                return adapter
            folder = self.folders.get(name)
        if folder is None:
            raise NotFound(f"the adapter {name[:128]!r} is not loaded on this engine")
        return self.load(name, folder)

    def attach(self, req: Request, name: str) -> None:
        """Run `req` with the adapter `name` ("": the base model)."""
        if name:
            req.adapter = self.get(name)
            req.cache_salt += b"|lora:" + req.adapter.key.encode()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.folders)

    def held(self) -> dict[str, str]:
        """Each adapter's folder, by name (sorted), read at once: a load report's names and folders agree."""
        with self._lock:
            return {name: str(self.folders[name]) for name in sorted(self.folders)}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.loaded.values())

    def _keep(self, adapter: Adapter) -> None:
        self.loaded.pop(adapter.name, None)
        while self.loaded and self.nbytes + adapter.nbytes > self.max_bytes:
            self.loaded.popitem(last=False)
        self.loaded[adapter.name] = adapter
