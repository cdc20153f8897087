"""Chaos, end to end: the services behind the engines die one after another.

`infermesh up --engines 1 --fallback-engines 1`: the primary model in its default dtype and
the level-3 fallback, the same weights in int8 served as `smollm2-135m-int8`.  Faults are
injected in order (the launcher does not restart what dies), each with its expected outcome:
the cache dies (sessions still answered), the primary engine dies (answers come from the
fallback, marked degraded), the fallback dies (503 with Retry-After), the tokenizer dies (503
naming it).  Every request gets an answer or a precise error: none is lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import OFFSET, Mesh, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 400


@pytest.fixture(scope="module")
def degraded_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("degradation") / "infermesh-up.log"
    with running_mesh(["--engines", "1", "--fallback-engines", "1", "--kv-cache-mb", "64",
                       "--no-restart"], PORTS, log) as m:
        yield m


def kill(service_args: str) -> None:
    out = subprocess.run(["pgrep", "-f", service_args], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, f"expected one process for {service_args!r}, found {out}"
    os.kill(int(out[0]), signal.SIGKILL)


SENT: list[str] = []


def chat(mesh: Mesh, content: str, **headers: str) -> httpx.Response:
    SENT.append(content)
    body: dict[str, Any] = {"model": "smollm2-135m", "max_tokens": 6, "temperature": 0,
                            "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{mesh.http}/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_services_die_one_by_one_and_no_request_is_lost(degraded_mesh: Mesh) -> None:
    outcomes: list[tuple[str, str]] = []

    def record(fault: str, reply: httpx.Response) -> dict[str, Any]:
        body = reply.json()
        outcomes.append((fault, "completed" if reply.status_code == 200 else f"error {reply.status_code}"))
        return dict(body)

    # No fault: the primary answers.
    body = record("none", chat(degraded_mesh, "Hello"))
    assert body["infermesh"] == {"replica": "engine-0", "model_version": "1", "region": "local", "degraded": False,
                                 "confidence": 1.0}
    models = httpx.get(f"{degraded_mesh.http}/v1/models", timeout=10).json()["data"]
    assert {m["id"] for m in models} == {"smollm2-135m", "smollm2-135m-int8"}

    # The session store dies (this mesh does not restart it): a session's turn is not answered without
    # its history (a wrong answer), but refused with a precise 503 and Retry-After; requests without a
    # session go on.
    kill(f"services.cache --replica-id cache-0 --port {50053 + PORTS}")
    reply = chat(degraded_mesh, "My name is Ada.", **{"x-session-id": "chaos"})
    record("cache killed", reply)
    assert reply.status_code == 503 and "session store" in reply.json()["error"]["message"], reply.text
    assert "retry-after" in reply.headers
    body = record("cache killed", chat(degraded_mesh, "What is my name?"))
    assert body["choices"][0]["message"]["content"] and body["infermesh"]["replica"] == "engine-0"

    # The primary engine dies: level 3 answers from the fallback model, marked degraded.
    kill(f"services.engine --replica-id engine-0 --port {50060 + PORTS}")
    for _ in range(4):
        body = record("primary engine killed", chat(degraded_mesh, "Name a color."))
        meta = body["infermesh"]
        assert body["model"] == "smollm2-135m-int8" and body["choices"][0]["message"]["content"]
        assert meta["replica"] == "fallback-0" and meta["degraded"] is True and meta["confidence"] == 0.8

    # The fallback dies too: nothing can serve the model, an honest 503 with Retry-After.
    kill(f"services.engine --replica-id fallback-0 --port {50061 + PORTS}")
    time.sleep(0.5)
    reply = chat(degraded_mesh, "Anyone there?")
    record("fallback engine killed", reply)
    assert reply.status_code == 503, reply.text
    assert 1 <= int(reply.headers["retry-after"]) <= 30
    assert "smollm2-135m" in reply.json()["error"]["message"]

    # The tokenizer dies: a precise 503 that names it.
    kill(f"services.tokenizer --replica-id tokenizer-0 --port {50052 + PORTS}")
    reply = chat(degraded_mesh, "Still there?")
    record("tokenizer killed", reply)
    assert reply.status_code == 503 and "tokenizer" in reply.json()["error"]["message"]
    assert "retry-after" in reply.headers

    print("\nfault -> outcome:", *(f"{f}: {o}" for f, o in outcomes), sep="\n  ")
    # Every request sent got an answer, completed or a precise error: none lost, none hung.
    assert len(outcomes) == len(SENT) == 9
