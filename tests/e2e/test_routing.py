"""End to end: which replica serves what, with `infermesh up --engines 2`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.e2e.conftest import Mesh

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client: openai.OpenAI, content: str, max_tokens: int = 4, **extra: Any) -> tuple[str, int]:
    """(replica that served it, prompt tokens)."""
    reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": content}],
                                           max_tokens=max_tokens, temperature=0, **extra)
    assert reply.usage is not None
    return str(reply.model_extra["infermesh"]["replica"]), reply.usage.prompt_tokens  # type: ignore[index]


def test_a_sessions_requests_stay_on_one_replica(client: openai.OpenAI) -> None:
    for session in ("alpha", "beta", "gamma"):
        replicas = {ask(client, f"Turn {i} of {session}.", extra_headers={"x-session-id": f"stay-{session}"})[0]
                    for i in range(4)}
        assert len(replicas) == 1, f"session {session} moved between {replicas}"


def test_the_openai_user_field_names_a_session_too(client: openai.OpenAI) -> None:
    replicas = {ask(client, f"Question {i}.", user="user-field-session")[0] for i in range(3)}
    assert len(replicas) == 1


def test_a_session_keeps_its_history_server_side(client: openai.OpenAI) -> None:
    """The second turn sends only the new message; the router prepends the stored history."""
    _, alone = ask(client, "And what is my name?")
    first_replica, first = ask(client, "My name is Ada Lovelace.", extra_headers={"x-session-id": "history-1"})
    second_replica, second = ask(client, "And what is my name?", extra_headers={"x-session-id": "history-1"})
    # The stored user turn (~12 tokens with its role markers) and the assistant's reply came along.
    assert second >= alone + 12, (alone, first, second)
    assert first_replica == second_replica


def test_concurrent_requests_without_session_use_both_replicas(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(16) as pool:
        replicas = list(pool.map(lambda i: ask(client, f"Concurrent question number {i}.", 8)[0], range(16)))
    assert set(replicas) == {"engine-0", "engine-1"}


def test_a_pinned_request_goes_where_it_is_pinned(client: openai.OpenAI) -> None:
    for replica in ("engine-1", "engine-0", "engine-1"):
        assert ask(client, "Pinned.", extra_headers={"x-infermesh-replica": replica})[0] == replica
    with pytest.raises(openai.NotFoundError, match="engine-9"):
        ask(client, "Pinned nowhere.", extra_headers={"x-infermesh-replica": "engine-9"})


def test_router_metrics_export_decisions_and_load_entropy(client: openai.OpenAI) -> None:
    import re
    import urllib.request

    from tests.e2e.conftest import OFFSET

    ask(client, "Metrics, please.")
    ask(client, "Pinned metrics.", extra_headers={"x-infermesh-replica": "engine-0"})
    with urllib.request.urlopen(f"http://127.0.0.1:{9180 + OFFSET}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    entropy = float(re.search(r"^infermesh_router_load_entropy (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
    assert 0.0 <= entropy <= 1.0
    assert re.search(r'^infermesh_router_requests_total\{.*reason="(balance|session|prefix)".*\} [1-9]', text, re.M)
    assert re.search(r'^infermesh_router_requests_total\{.*reason="pinned".*\} [1-9]', text, re.M)
    assert "infermesh_router_replicas_healthy 2.0" in text
