"""A native gRPC caller who skips the edge gets the edge's limits at the router (issue 16).

On 003ae70 the router's Generate accepted temperature 50, 1,000 stop strings and a 10 KB session id:
each is INVALID_ARGUMENT now, naming the limit, and a request within the limits still streams.
"""

from __future__ import annotations

import grpc
import pytest

from mesh.request_limits import MAX_NAME_CHARS
from mesh.sampling import SPECS, Sampling, problem
from tests.fakes.router_mesh import chat, collect, ids_of, run, running


@pytest.mark.parametrize("change, says", [
    (lambda r: setattr(r.sampling, "temperature", 50.0), "temperature"),
    (lambda r: r.sampling.stop.extend(["x"] * 1000), f"at most {SPECS['stop'].items} sequences"),
    (lambda r: r.sampling.stop.append("s" * 10_000), "each stop sequence"),
    (lambda r: setattr(r.sampling, "top_p", 3.0), "top_p"),
    (lambda r: setattr(r.sampling, "top_logprobs", 500), "top_logprobs"),
    (lambda r: setattr(r, "session_id", "s" * 10_000), "session_id"),
    (lambda r: setattr(r, "pinned_replica", "e" * 1_000), "pinned_replica"),
])
def test_the_router_refuses_what_the_edge_would(change, says) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        async with running(engines=1) as mesh:
            request = chat(("user", "hello"))
            change(request)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(mesh, request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in (err.value.details() or "")
            assert len(err.value.details() or "") < 200          # the offending value is not echoed back
            assert ids_of(await collect(mesh, chat(("user", "hello"))))   # the router goes on serving

    run(scenario)


def test_the_limits_themselves() -> None:
    assert problem(Sampling(2.0, 1.0, 0, stop=("a",) * SPECS["stop"].items, top_logprobs=20)) is None
    assert problem(Sampling(2.01, 1.0, 0)) is not None
    assert problem(Sampling(0.0, 0.0, 0, top_logprobs=21)) is not None
    assert MAX_NAME_CHARS == 256
