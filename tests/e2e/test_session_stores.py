"""End to end, both session stores: `infermesh up` with the embedded store (its journal under
--cache-dir) and with `--session-store redis://...` (a real redis-server); a session turn over HTTP,
the cache service killed with SIGKILL and restarted by the launcher, and the next turn's prompt still
holds the first turn."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from services.cache.redis_sessions import PREFIX
from tests.e2e.conftest import OFFSET, Mesh, running_mesh
from tests.redis_server import running_redis

pytestmark = pytest.mark.e2e

# Offsets whose ports no other mesh of the run uses (OFFSET + 1100 would put the edge on the session-long
# mesh's engine metrics port, 9100 + OFFSET).
PORTS = {"embedded": OFFSET + 1000, "redis": OFFSET + 1500}
SESSION = "s-stores"


@pytest.fixture(params=["embedded", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Mesh, str]]:
    """(the store, its mesh, the Redis URL or "")."""
    args = ["--engines", "1", "--dtype", "float32", "--kv-cache-mb", "64"]
    log = tmp_path / "infermesh-up.log"
    if request.param == "embedded":
        with running_mesh(args, PORTS["embedded"], log) as m:
            yield "embedded", m, ""
        return
    with running_redis(request.getfixturevalue("redis_binary"), tmp_path / "redis") as url:
        with running_mesh([*args, "--session-store", f"{url}/0"], PORTS["redis"], log) as m:
            yield "redis", m, f"{url}/0"


def cache_pid(port_offset: int) -> int:
    pattern = f"services.cache --replica-id cache-0 --port {50053 + port_offset}"
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, f"expected one process for {pattern!r}, found {out}"
    return int(out[0])


def test_a_session_survives_a_killed_cache_service(store: tuple[str, Mesh, str]) -> None:
    kind, mesh, url = store
    client = openai.OpenAI(base_url=f"{mesh.http}/v1", api_key="unused", max_retries=0, timeout=120)

    def prompt_tokens(content: str, max_tokens: int = 1, **extra: Any) -> int:
        reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": content}],
                                               max_tokens=max_tokens, temperature=0, **extra)
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    in_session: dict[str, Any] = {"extra_headers": {"x-session-id": SESSION}}
    prompt_tokens("My name is Ada and I live in Lisbon.", max_tokens=6, **in_session)
    # A stored response (the Responses API) is a conversation in the same store.
    stored = client.responses.create(model="smollm2-135m", input="My name is Ada and I live in Lisbon.",
                                     max_output_tokens=6, temperature=0)
    kept = mesh.log.parent / "cache-service" / "sessions.jsonl"
    if kind == "redis":
        keys = [str(k) for k in redis.Redis.from_url(url, decode_responses=True).keys(f"{PREFIX}*")]
        assert len(keys) == 2 and any(k.endswith(SESSION) for k in keys) and any(k.endswith(stored.id) for k in keys), \
            keys
        assert not kept.exists()                  # nothing of the session on the cache service's disk
    else:
        assert SESSION in kept.read_text()

    os.kill(cache_pid(PORTS[kind]), signal.SIGKILL)
    deadline = time.monotonic() + 90
    while "sessions kept in" not in mesh.log.read_text().partition("cache-0 restarted")[2]:
        assert time.monotonic() < deadline, "the cache service was not restarted"
        time.sleep(0.5)
    after = mesh.log.read_text().partition("cache-0 restarted")[2]
    expected = (rf"sessions kept in Redis at {re.escape(url)} \(keys {PREFIX}\*\)" if kind == "redis"
                else r"sessions kept in \S+sessions\.jsonl \(2 brought back\)")
    assert re.search(expected, after), after[-2000:]

    alone = prompt_tokens("And?")
    # The router may still be reconnecting to the new cache process: a 503 (nothing stored) is retried.
    while True:
        try:
            with_history = prompt_tokens("And?", **in_session)
            break
        except openai.APIStatusError as err:
            assert err.status_code == 503 and time.monotonic() < deadline, err
            time.sleep(0.5)
    # The first turn (about 12 tokens of question, 6 of answer) came back from the store.
    assert with_history >= alone + 12, (alone, with_history)
    continued = client.responses.create(model="smollm2-135m", input="And?", previous_response_id=stored.id,
                                        max_output_tokens=1, temperature=0)
    assert continued.usage is not None and continued.usage.input_tokens >= alone + 12, (alone, continued.usage)
    assert client.responses.retrieve(stored.id).output_text == stored.output_text     # kept on the cache's disk
