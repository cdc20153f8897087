"""Issue 16 (low): a rejected or abandoned request logged a 20-line OpenTelemetry "Failed to detach
context" traceback.  The mechanism: a streaming RPC's handler holds its server span across `yield`;
when the call is cancelled gRPC leaves the generator suspended, and the event loop's finalizer
closes it later from another task, whose context never held the span.  On a7f9686 the scenario
below logged the traceback; server_span now leaves detaching to the task that attached."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from mesh.telemetry import server_span


async def handler() -> AsyncIterator[int]:
    with server_span("test.stream"):
        for i in range(10):
            yield i
            await asyncio.sleep(0)


def test_a_stream_closed_by_another_task_logs_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        stream = handler()
        assert await anext(stream) == 0                      # suspended at a yield, span attached
        await asyncio.create_task(stream.aclose())           # the loop's finalizer does this, elsewhere

    with caplog.at_level(logging.ERROR):
        asyncio.run(scenario())
        asyncio.run(scenario())                               # and the owning task's context is intact
    assert not [r for r in caplog.records if "detach" in r.getMessage().lower()]
