"""The router's recent events and first-token times, as the console reads them through ListReplicas."""

from meshpb.v1 import router_pb2
from services.router.events import RecentEvents
from services.router.wire import fill_recent


def test_events_are_bounded_and_ttft_covers_the_last_window() -> None:
    recent = RecentEvents(keep=3, window_s=60)
    for i in range(5):
        recent.record("failover", "m", f"engine-{i}", "stalled")
    recent.record("shed", "m", "", "x" * 1000)
    for at, s in [(0.0, 9.0), (100.0, 0.1), (101.0, 0.2), (102.0, 0.3)]:
        recent.first_token(s, now=at)
    p50, p95 = recent.ttft_ms(now=110.0)
    assert (p50, p95) == (200.0, 300.0)               # the sample at t=0 left the window
    assert recent.ttft_ms(now=1000.0) == (0.0, 0.0)
    reply = router_pb2.ListReplicasResponse()
    fill_recent(reply, recent)
    assert [e.replica for e in reply.events] == ["engine-3", "engine-4", ""]
    assert reply.events[-1].kind == "shed" and len(reply.events[-1].detail) == 300
