"""A model step that may stop between layers.

An engine whose step runs only batch-class rows lets an interactive request that arrives meanwhile go
first (engine.py): it sets the step's event, and the model's next layer raises StepInterrupted instead of
running.  The step then counts as not run: nothing is committed, sampled or charged, and the scheduler's
next step takes the same rows again (their KV writes so far are rewritten with the same values).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType


class StepInterrupted(Exception):
    """The step was given up between two layers for a request of a higher class."""


_EVENT: ContextVar[threading.Event | None] = ContextVar("infermesh_step_interrupt", default=None)


class interruptible:  # a context manager, named as contextlib's are
    """Within the block, check() raises StepInterrupted once `event` is set (None: the step runs to its end);
    the block then ends there, quietly, after `gave_way` is called.  A class, not a generator: it wraps
    every step."""

    __slots__ = ("_token", "event", "gave_way")

    def __init__(self, event: threading.Event | None, gave_way: Callable[[], None] | None = None):
        self.event, self.gave_way = event, gave_way

    def __enter__(self) -> None:
        self._token = _EVENT.set(self.event)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        _EVENT.reset(self._token)
        if kind is None or not issubclass(kind, StepInterrupted):
            return False
        if self.gave_way is not None:
            self.gave_way()
        return True


def check() -> None:
    """Between two layers: StepInterrupted if the running step was asked to give way."""
    event = _EVENT.get()
    if event is not None and event.is_set():
        raise StepInterrupted
