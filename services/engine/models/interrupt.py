"""A model step that may stop between layers.

An engine whose step runs only batch-class rows lets an interactive request that arrives meanwhile go
first (engine.py): it sets the step's event, and the model's next layer raises StepInterrupted instead of
running.  The step then counts as not run: nothing is committed, sampled or charged, and the scheduler's
next step takes the same rows again (their KV writes so far are rewritten with the same values).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


class StepInterrupted(Exception):
    """The step was given up between two layers for a request of a higher class."""


_EVENT: ContextVar[threading.Event | None] = ContextVar("infermesh_step_interrupt", default=None)


@contextmanager
def interruptible(event: threading.Event | None) -> Iterator[None]:
    """Within the block, check() raises once `event` is set (None: the step runs to its end)."""
    token = _EVENT.set(event)
    try:
        yield
    finally:
        _EVENT.reset(token)


def check() -> None:
    """Between two layers: StepInterrupted if the running step was asked to give way."""
    event = _EVENT.get()
    if event is not None and event.is_set():
        raise StepInterrupted
