"""Model versions in one engine: the one new requests start on, and older ones still finishing.

A hot swap (the server's LoadVersion) builds the new version's model beside the running one, off the
step thread, then asks for it to become active; the step thread switches at the start of its next
step, so a step never mixes a switch with its own work.  Every request keeps the version it was made
on (`Request.version`) to its end: a batch that holds several versions runs each one's rows through
its own weights (the KV cache is shared: same architecture, same shapes), and a version that is no
longer active is released once no request holds it (weak references: a request object that is gone
holds nothing).  A version built but not yet active is kept until it becomes active (a load now,
activate later; and the step that ends between a build and its activation must not free it).
Prefix-cache blocks never cross versions: every version after the first salts its requests' block
hashes with its name.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mesh.errors import FailedPrecondition, InvalidArgument
from mesh.heap import trim_heap
from mesh.models.gguf_header import GgufError
from services.engine.core.request import Request
from services.engine.core.scheduler import Chunk
from services.engine.runtime.models import ARCHITECTURES
from services.engine.runtime.models.config import check_weights, load_weights

log = logging.getLogger(__name__)

# The config fields two versions must share to run on one KV cache and one tokenizer.
SHAPE = ("num_layers", "num_kv_heads", "head_dim", "vocab_size")


class Versions:
    def __init__(self, runner: Any, first: str):
        self.runner = runner
        self.first = self.active = first
        self.models: dict[str, Any] = {first: runner.model}
        self.folders: dict[str, Path] = {first: Path(runner.folder)}
        # version -> the requests on it, by id (weakly: a request object that is gone holds nothing)
        self._holders: dict[str, weakref.WeakValueDictionary[int, Request]] = {first: weakref.WeakValueDictionary()}
        self._pending: str | None = None          # to become active at the next step
        self._staged: set[str] = set()            # built, never yet active: not released
        self._lock = threading.Lock()
        self.released: list[str] = []             # versions whose weights were freed (for the log and tests)

    def loaded(self) -> list[str]:
        return sorted(self.models)

    def salt(self, version: str) -> bytes:
        return b"" if version == self.first else b"|version:" + version.encode()

    def hold(self, request: Request) -> None:
        """`request` runs on the active version until it ends."""
        with self._lock:
            request.version = self.active
            self._holders[self.active][id(request)] = request

    def build(self, version: str, folder: Path) -> None:
        """Load `version`'s weights from `folder` beside the running ones (any thread but the step's:
        this takes seconds).  Raises InvalidArgument when they cannot run on this engine's cache."""
        if version in self.models:
            raise FailedPrecondition(f"version {version!r} is loaded already; activate it instead")
        config = self.check(version, folder)
        _, model_cls = ARCHITECTURES[_model_type(folder)]
        with torch.inference_mode():
            model = model_cls(config, load_weights(folder), self.runner.plan)
        trim_heap()               # loading's temporaries back to the system, as ModelRunner does after its build
        with self._lock:
            self.models[version] = model
            self.folders[version] = folder
            self._holders.setdefault(version, weakref.WeakValueDictionary())
            self._staged.add(version)

    def check(self, version: str, folder: Path) -> Any:
        """`folder`'s config, or InvalidArgument (nothing loaded, nothing freed) when `version` cannot run here:
        another architecture or cache shape than the running model's, or a GGUF whose tensors disagree with its
        config (models/gguf_check.py).  LoadVersion asks first: a replacement frees the running weights before
        it builds."""
        config_cls, _ = ARCHITECTURES[_model_type(folder)]
        config = config_cls.from_folder(folder)
        old = self.runner.config
        differs = [f for f in SHAPE if getattr(config, f, None) != getattr(old, f, None)]
        if type(config) is not type(old) or differs:
            raise InvalidArgument(f"{folder}: a different architecture ({', '.join(differs) or type(config).__name__})"
                                  " cannot replace the running model in place; start another engine for it")
        try:
            check_weights(folder)
        except GgufError as exc:
            raise InvalidArgument(f"version {version}: {exc}") from None
        return config

    def replace(self, version: str, folder: Path) -> None:
        """With nothing in flight (the engine drained): free every version's weights, then load and
        activate `version` alone, for when two would not fit in memory."""
        with self._lock:
            dropped = [v for v in self.models if v != version]
            self.models.clear()
            self.folders.clear()
            self._holders = {}
            self._staged.clear()
            self.runner.model = None
            self.active = ""
        gc.collect()
        trim_heap()
        self.released.extend(dropped)
        self.build(version, folder)
        with self._lock:
            self.active, self._pending = version, None
            self._staged.discard(version)
        self.runner.use_model(self.models[version])
        log.info("version %s replaced %s (drained first: not enough memory for both)", version, ", ".join(dropped))

    def activate(self, version: str) -> None:
        """New requests run on `version` from the next step on."""
        if version not in self.models:
            raise FailedPrecondition(f"version {version!r} is not loaded here (loaded: {', '.join(self.loaded())})")
        with self._lock:
            self._pending = version

    def switch(self) -> bool:
        """On the step thread, before a step: apply a pending activation; True when one happened."""
        with self._lock:
            version, self._pending = self._pending, None
            if version is None or version == self.active:
                return False
            self.active = version
            self._staged.discard(version)
        self.runner.use_model(self.models[version])
        log.info("version %s is active (loaded: %s)", version, ", ".join(self.loaded()))
        return True

    def release_unused(self) -> list[str]:
        """On the step thread, after a step: free every inactive version no request holds."""
        with self._lock:
            idle = [v for v in self.models if v != self.active and v != self._pending and v not in self._staged
                    and not len(self._holders[v])]
            for version in idle:
                del self.models[version], self.folders[version], self._holders[version]
        if idle:
            gc.collect()
            trim_heap()               # the weights' pages back to the system, not kept in glibc's arenas
            self.released.extend(idle)
            log.info("released the weights of version %s (no request holds them)", ", ".join(idle))
        return idle

    def order(self, chunks: list[Chunk]) -> list[tuple[str, list[Chunk]]]:
        """The batch's chunks grouped by version (active first), in place: the runner takes each
        group through its own weights and the rows come back in this order."""
        rank = {v: i for i, v in enumerate([self.active, *sorted(set(self.models) - {self.active})])}
        chunks.sort(key=lambda c: rank.get(c.request.version, 0))
        groups: dict[str, list[Chunk]] = {}
        for c in chunks:
            groups.setdefault(c.request.version or self.active, []).append(c)
        return list(groups.items())

    def run(self, chunks: list[Chunk], greedy: bool) -> torch.Tensor:
        if len(self.models) == 1:                # the usual step: one version, no grouping (every step)
            return self.runner.run(chunks, greedy=greedy)
        groups = self.order(chunks)
        if len(groups) == 1 and groups[0][0] == self.active:
            return self.runner.run(chunks, greedy=greedy)
        outs = []
        for version, group in groups:
            with self._using(version):
                outs.append(self.runner.run(group, greedy=greedy))
        if len({o.dim() for o in outs}) > 1:        # one group gave ids, another logits: ids for all
            outs = [o if o.dim() == 1 else o.argmax(dim=-1) for o in outs]
        return torch.cat(outs)

    @contextlib.contextmanager
    def _using(self, version: str) -> Iterator[None]:
        if version == self.active:
            yield
            return
        model, graphs = self.runner.model, self.runner.graphs
        self.runner.model, self.runner.graphs = self.models[version], None   # an older version: eager steps
        try:
            yield
        finally:
            self.runner.model, self.runner.graphs = model, graphs


def _model_type(folder: Path) -> str:
    import json

    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{folder}: no readable config.json ({exc})") from None
    if model_type not in ARCHITECTURES:
        raise InvalidArgument(f"{folder}: model_type {model_type!r} is not one of {', '.join(ARCHITECTURES)}")
    return str(model_type)


def weight_bytes(folder: Path) -> int:
    """What a version's weights take, as their files do (an upper bound for the dtypes this engine runs)."""
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.gguf") for f in folder.glob(pattern))


def available_bytes() -> int:
    """The memory the kernel says can be had without swapping (/proc/meminfo MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62                  # unknown: do not refuse
