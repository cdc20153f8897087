"""Structured output: a request's constraint compiled to a grammar, and the token masks that hold it.

xgrammar does the work (bench/grammar.py measured it against llguidance on this model's vocabulary:
filling the masks of 16 constrained rows took about a tenth of the time; docs/architecture.md,
"Structured outputs", gives the figures).  Compiled grammars are cached by constraint, so the JSON
schema an application sends with every request is compiled once.  Compiling runs off the step thread
(the server calls `matcher` in a worker thread before adding the request), and in a child process
that is killed when it runs too long (services/engine/runtime/grammar_worker.py); the step thread only fills
and applies masks.

What grammars may cost is bounded (services/engine/runtime/grammar_limits.py, issue 31 finding 4): the cache
by bytes, compiles per tenant and at once, one compile's time.

A constrained request's output is the constraint's prefix, then a text the grammar accepts, then
its suffix, then an end-of-sequence token: once the grammar is complete only the end-of-sequence
ids are allowed, so the request ends with finish_reason "stop".
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mesh.constraints import Constraint
from mesh.errors import InvalidArgument
from services.engine.runtime.grammar_limits import CompileGate, ConstraintRefused, GrammarCache, GrammarLimits
from services.engine.runtime.grammar_worker import CompileTimeout, CompileWorker, WorkerDied

_IDLE: dict[tuple[str, int, tuple[int, ...]], list[CompileWorker]] = {}     # (folder, vocab, eos) -> idle
_IDLE_LOCK = threading.Lock()


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, compiled: Any, cached: bool = False):
        import xgrammar as xgr
        self._m = xgr.GrammarMatcher(compiled)
        self.cached = cached                 # the grammar was compiled before (for the metrics)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and its end-of-sequence token was accepted."""
        return bool(self._m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles constraints for one model's vocabulary (its tokenizer, its end-of-sequence ids), within
    `limits`.  Thread-safe: the server calls it from several threads at once."""

    def __init__(self, folder: str | Path, vocab_size: int, eos_token_ids: Collection[int],
                 limits: GrammarLimits | None = None, clock: Callable[[], float] = time.monotonic):
        self.folder = Path(folder)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.limits = limits or GrammarLimits()
        self.cache = GrammarCache(self.limits.cache_bytes)
        self._gate = CompileGate(self.limits)
        self._clock = clock
        self._info: Any = None                          # xgrammar TokenizerInfo, built on first use
        # Started compiler processes not compiling now, shared by every Grammars of this vocabulary in the
        # process (an engine has one; the tests build many, and a process takes ~2 s to start).
        self._idle = _IDLE.setdefault((str(self.folder.resolve()), vocab_size, tuple(self.eos_token_ids)), [])
        self._pending: dict[bytes, Future[Any]] = {}    # constraint digest -> its compile under way
        self._lock = threading.Lock()                   # never held across a compile
        self._slot_free = threading.Condition(self._lock)
        self._starting = 0          # compiler processes being started (and the TokenizerInfo built, the first time)
        self._started_at = -math.inf    # when the last start ended (monotonic)
        self._info_lock = threading.Lock()
        self.compiles = 0            # cache misses compiled (or tried)
        self.hits = 0                # served from the cache, or by another request's compile under way

    @property
    def compiling(self) -> int:
        return self._gate.running

    @property
    def worker_pids(self) -> list[int]:
        """The idle compiler processes (a compiling one is not listed)."""
        with _IDLE_LOCK:
            return [w.pid for w in self._idle]

    def close(self) -> None:
        """Stop the idle compiler processes (they also end with this process: their stdin closes)."""
        with _IDLE_LOCK:
            while self._idle:
                self._idle.pop().kill()

    def _tokenizer_info(self) -> Any:
        with self._info_lock:
            if self._info is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer
                tokenizer = AutoTokenizer.from_pretrained(self.folder)
                # A model with no end-of-sequence id (generation_config's eos_token_id: []): xgrammar takes the
                # tokenizer's own (it refuses an empty list).
                self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.eos_token_ids or None)
            return self._info

    def compile(self, c: Constraint, tenant: bytes = b"") -> Any:
        """The constraint's compiled grammar (cached).  ConstraintRefused (INVALID_ARGUMENT) when it does not
        compile or compiles too slowly; CompileRefused (RESOURCE_EXHAUSTED) past the compile limits."""
        return self._compile(c, tenant)[0]

    def _compile(self, c: Constraint, tenant: bytes) -> tuple[Any, bool]:
        """(compiled grammar, whether this request did not compile it).  `tenant`: whose compile rate a
        miss spends (the request's cache_salt)."""
        key = _digest(c)
        mine = None
        with self._lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                self.hits += 1
                return compiled, True
            pending = self._pending.get(key)
            if pending is not None:          # the same constraint's compile is under way: wait for it
                self.hits += 1
            else:
                why = self._gate.refusal(key)
                if why is not None:
                    raise ConstraintRefused(f"refused at once: {why}", "remembered")
                now_or_later = self._gate.enter(tenant, self._clock())        # or CompileRefused
                # Registered before waiting for a slot, so the same constraint meanwhile waits for this one.
                mine = pending = self._pending[key] = Future()
                if not now_or_later:
                    self._wait_for_slot(key, pending, tenant)
                self.compiles += 1
        if pending is mine:
            return self._run(c, key, pending), False
        return pending.result(), True

    def _wait_for_slot(self, key: bytes, pending: Future[Any], tenant: bytes) -> None:
        """Under the lock: wait (releasing it) until the gate starts this compile; after one compile's time
        limit without a slot, the compiles ahead are slow ones: refuse it (CompileRefused, busy).  The time a
        compiler process takes to start (seconds, the engine's first compile) is no slow compile: it does not
        count."""
        deadline = time.monotonic() + self.limits.compile_timeout_s
        while not self._gate.start():
            # A limit of compiling from the end of the last start: one that ended while this waited counts too.
            end_of_start = time.monotonic() if self._starting else self._started_at
            deadline = max(deadline, end_of_start + self.limits.compile_timeout_s)
            left = deadline - time.monotonic()
            if left <= 0:
                refused = self._gate.give_up(tenant, self._clock())
                del self._pending[key]
                pending.set_exception(refused)
                raise refused
            self._slot_free.wait(left)

    def cached_matcher(self, c: Constraint) -> Matcher | None:
        """A matcher for `c` if its grammar is cached, else None; never waits (the server calls it on its
        event loop, so a cache hit needs no thread, however many compiles wait for theirs)."""
        with self._lock:
            compiled = self.cache.get(_digest(c))
            if compiled is None:
                return None
            self.hits += 1
        return Matcher(compiled, cached=True)

    def _run(self, c: Constraint, key: bytes, pending: Future[Any]) -> Any:
        """Compile `c` in a child process (an idle one, or a new one); publish it to the cache and `pending`."""
        compiled, size, worker = None, 0, self._borrow()
        try:
            import xgrammar as xgr
            cold = worker is None
            if cold:
                with self._lock:
                    self._starting += 1
            try:
                info = self._tokenizer_info()
                if worker is None:
                    worker = CompileWorker(info.serialize_json())
            finally:
                if cold:
                    with self._lock:
                        self._starting -= 1
                        self._started_at = time.monotonic()
            try:
                text = worker.compile(c, self.limits.compile_timeout_s)
            except CompileTimeout:
                worker = None                   # killed: its CPU stopped
                raise self._refuse(key, f"the {c.kind} constraint {describe(c)} took longer than "
                                   f"{self.limits.compile_timeout_s:g} s to compile (--grammar-compile-timeout-s) "
                                   f"and was stopped (this engine now refuses it at once); simplify it (fewer "
                                   f"properties with a pattern, shorter bounds) or split it", "timeout") from None
            except WorkerDied as exc:
                worker = None
                raise self._refuse(key, f"the {c.kind} constraint {describe(c)} crashed the grammar compiler "
                                   f"({exc})", "invalid") from None
            except InvalidArgument as exc:
                raise ConstraintRefused(exc.message, "invalid") from None
            compiled = xgr.CompiledGrammar.deserialize_json(text, info)
            size = int(compiled.memory_size_bytes)
            pending.set_result(compiled)
            return compiled
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            with self._lock:
                if compiled is not None:
                    self.cache.put(key, compiled, size)     # False (not kept): larger than the whole budget
                self._pending.pop(key, None)
                self._gate.leave()
                self._slot_free.notify()
            if worker is not None:
                with _IDLE_LOCK:
                    self._idle.append(worker)

    def _borrow(self) -> CompileWorker | None:
        """An idle compiler process, or None (start one).  One that died idle (killed from outside) is
        dropped here, so its death is not blamed on the next constraint."""
        with _IDLE_LOCK:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    return worker
                worker.kill()
        return None

    def _refuse(self, key: bytes, why: str, reason: str) -> ConstraintRefused:
        with self._lock:
            self._gate.remember(key, why)
        return ConstraintRefused(why, reason)

    def matcher(self, c: Constraint, replay: Sequence[int] = (), tenant: bytes = b"") -> Matcher:
        """A matcher at the grammar's start, advanced over `replay` (tokens streamed before a failover)."""
        compiled, cached = self._compile(c, tenant)
        m = Matcher(compiled, cached)
        for i, token in enumerate(replay):
            if not m.accept(token):
                raise InvalidArgument(f"resumed token {i} (id {token}) does not follow the request's "
                                      f"{c.kind} constraint")
        return m


def describe(c: Constraint) -> str:
    """How a person recognises the constraint in an error: a JSON schema's title, else its first characters."""
    if c.kind == "json_schema":
        try:
            title = json.loads(c.text).get("title")
        except (ValueError, AttributeError):
            title = None
        if isinstance(title, str) and title:
            return json.dumps(title[:60])
    return json.dumps(c.text[:40] + ("..." if len(c.text) > 40 else ""))


def _digest(c: Constraint) -> bytes:
    """The cache's and the refusals' key: 32 bytes, however long the constraint's text (up to 64 KiB)."""
    return hashlib.sha256(json.dumps([c.kind, c.text, c.prefix, c.suffix]).encode()).digest()


def apply_masks(scores: torch.Tensor, logits: torch.Tensor, rows: Sequence[tuple[int, Matcher]]) -> None:
    """Mask, in place, the rows of `scores` that a grammar constrains: every token the row's matcher does
    not accept next becomes -inf.  One bitmask for the batch, filled row by row, unpacked and applied at
    once (numpy's unpackbits: several times faster on the CPU than xgrammar's own apply).  A row left
    with no token at all (min_tokens banning the end-of-sequence token a complete grammar needs) is
    masked from its unprocessed logits instead: the grammar wins."""
    if not rows:
        return
    import xgrammar as xgr
    vocab = scores.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for i, (_, m) in enumerate(rows):
        m.fill(bitmask, i)
    # Bit j of 32-bit word w is token 32w + j: little-endian bytes, least significant bit first.
    words = bitmask.numpy().astype("<i4", copy=False)
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    banned = torch.from_numpy(bits.view(np.bool_)).logical_not_()
    index = [r for r, _ in rows]
    picked = scores[index].masked_fill_(banned, float("-inf"))
    for i in torch.isneginf(picked).all(dim=1).nonzero().flatten().tolist():
        picked[i] = logits[index[i]].masked_fill(banned[i], float("-inf"))
    scores[index] = picked
