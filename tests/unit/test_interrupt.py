"""A step that may stop between layers (services/engine/runtime/models/interrupt.py)."""

from __future__ import annotations

import threading

import pytest

from services.engine.runtime.models import interrupt


def test_check_raises_only_inside_a_block_whose_event_is_set_and_the_block_ends_quietly() -> None:
    event, gave_way = threading.Event(), []
    interrupt.check()                                   # outside any block: nothing to give way to
    with interrupt.interruptible(event, lambda: gave_way.append(True)):
        interrupt.check()
        event.set()
        interrupt.check()
        raise AssertionError("not reached: the layer after the event stops the step")
    assert gave_way == [True]
    interrupt.check()                                   # the block's event is gone with it
    with interrupt.interruptible(None):
        interrupt.check()                               # None: the step runs to its end


def test_other_failures_go_through() -> None:
    with pytest.raises(ValueError), interrupt.interruptible(threading.Event(), lambda: None):
        raise ValueError("a model failure")
