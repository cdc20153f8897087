"""Issue 49: batch work yields to interactive work, so its silence is not a stall.  A batch-class row the engine
holds back (its scheduler gives interactive rows the step; a batch step gives way between layers) went silent
past the router's --stall-timeout and was moved to another replica, computed again there.  Now a batch-class
request has no token timeout at the router (a dead or hung engine still fails its health checks); an interactive
one still moves."""

from __future__ import annotations

from meshpb.v1 import common_pb2
from tests.fakes.router_mesh import FIRST, Behaviour, Script, chat, collect, ids_of, run, running


def test_a_batch_row_held_back_past_the_stall_timeout_stays_on_its_replica() -> None:
    async def scenario() -> None:
        script = Script([Behaviour(stall_after=2, pause_s=1.5)])
        async with running(script=script, stall_timeout_s=0.5) as mesh:
            request = chat(("user", "hi"), max_tokens=5)
            request.priority = common_pb2.PRIORITY_BATCH
            replies = await collect(mesh, request)
            assert ids_of(replies) == [FIRST + i for i in range(5)]
            assert len(script.calls) == 1                  # waited out the pause on the same engine

    run(scenario)


def test_an_interactive_row_silent_past_the_stall_timeout_moves() -> None:
    async def scenario() -> None:
        script = Script([Behaviour(stall_after=2, pause_s=1.5)])
        async with running(script=script, stall_timeout_s=0.5) as mesh:
            replies = await collect(mesh, chat(("user", "hi"), max_tokens=5))
            assert ids_of(replies) == [FIRST + i for i in range(5)]
            assert len(script.calls) == 2                  # resumed on the other engine after 0.5 s of silence

    run(scenario)
