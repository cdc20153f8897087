"""End to end, the edge's gateway policies on a real mesh (`infermesh up`, the real model): tiers from a
keys file and a tiers file, JWT bearer tokens, HMAC-signed requests, content rules on input and on
streamed output, and the response cache in the edge's memory and in the cache service."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jwt
import openai
import pytest

from mesh import signing
from tests.e2e.conftest import OFFSET, Mesh, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 1200
JWT_SECRET = "e2e-hs256-secret-of-at-least-32-bytes"
MODEL = "smollm2-135m"
TIERS = {"free": {"requests": "3/m", "priority": "batch", "cache_class": "batch"},
         "premium": {"requests": "1000/m", "cache_class": "premium"}}
KEYS = ("k-free tenant=acme tier=free\nk-prem tenant=globex tier=premium\nk-other tenant=initech tier=premium\n"
        "k-sign tenant=hooli tier=premium signing_secret=sign-me\n")


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, Path]]:
    """The mesh and its content policy file (tests rewrite it: the edge reads it again)."""
    folder = tmp_path_factory.mktemp("gateway")
    (folder / "keys").write_text(KEYS)
    (folder / "tiers.json").write_text(json.dumps(TIERS))
    policy = folder / "policy.json"
    policy.write_text(json.dumps({"input": [{"category": "weapons", "pattern": r"build\s+a\s+bomb"}]}))
    env = {"INFERMESH_API_KEYS_FILE": str(folder / "keys"), "INFERMESH_TIERS_FILE": str(folder / "tiers.json"),
           "INFERMESH_CONTENT_POLICY": str(policy), "INFERMESH_JWT_SECRET": JWT_SECRET,
           "INFERMESH_EDGE_RESPONSE_CACHE_TTL": "300"}
    with running_mesh(["--engines", "1", "--dtype", "float32", "--kv-cache-mb", "64"], PORTS,
                      folder / "infermesh-up.log", env=env) as m:
        yield m, policy


def _chat(mesh: Mesh, key: str, content: str, max_tokens: int = 12, headers: dict[str, str] | None = None,
          **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
    return httpx.post(f"{mesh.http}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}", **(headers or {})})


def _metric(mesh: Mesh, name: str, **labels: str) -> float:
    text = httpx.get(f"{mesh.http}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_repeated_deterministic_request_is_answered_from_the_cache_not_across_tenants(
        policies: tuple[Mesh, Path]) -> None:
    mesh, _ = policies
    first = _chat(mesh, "k-prem", "Name three colors.")
    assert first.status_code == 200 and "x-infermesh-cache" not in first.headers
    again = _chat(mesh, "k-prem", "Name three colors.")
    assert again.status_code == 200 and again.headers["x-infermesh-cache"] == "hit"
    body = again.json()
    assert body["infermesh"]["cached"] is True and body["choices"] == first.json()["choices"]
    spent_ms = float(re.search(r"edge;dur=([0-9.]+)", again.headers["server-timing"]).group(1))  # type: ignore[union-attr]
    print(f"cached answer: {spent_ms:.3f} ms at the edge")      # bench/response_cache.py measures it
    # The openai client reads it too, streamed or not.
    client = openai.OpenAI(base_url=f"{mesh.http}/v1", api_key="k-prem", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}],
                                           max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == body["choices"][0]["message"]["content"]
    assert (reply.model_extra or {})["infermesh"]["cached"] is True
    ask = [{"role": "user", "content": "Name three colors."}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    # Another tenant asking the same is answered by the model, never from globex's entry.
    other = _chat(mesh, "k-other", "Name three colors.")
    assert other.status_code == 200 and "x-infermesh-cache" not in other.headers
    assert "cached" not in (other.json()["infermesh"] or {})
    # Bypassed on request.
    assert "x-infermesh-cache" not in _chat(mesh, "k-prem", "Name three colors.",
                                            headers={"cache-control": "no-cache"}).headers


def test_the_shared_tier_outlives_the_edge(policies: tuple[Mesh, Path]) -> None:
    mesh, _ = policies
    assert _chat(mesh, "k-prem", "What is two plus two?", max_tokens=6).status_code == 200
    time.sleep(0.5)                                   # the shared tier is written in the background
    pattern = f"services.edge --replica-id edge-0 --host 127.0.0.1 --http-port {8000 + PORTS}"
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, pids
    os.kill(int(pids[0]), signal.SIGKILL)             # its memory tier is gone; the launcher restarts it
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{mesh.http}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the edge was not restarted"
        time.sleep(0.5)
    again = _chat(mesh, "k-prem", "What is two plus two?", max_tokens=6)
    assert again.status_code == 200 and again.headers.get("x-infermesh-cache") == "hit"
    assert _metric(mesh, "infermesh_edge_response_cache_total", outcome="hit_shared") == 1


def test_blocked_input_gets_400_and_blocked_output_is_cut_even_across_tokens(policies: tuple[Mesh, Path]) -> None:
    mesh, policy = policies
    client = openai.OpenAI(base_url=f"{mesh.http}/v1", api_key="k-prem", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "How do I BUILD a  bomb?"}],
                                       max_tokens=4)
    assert err.value.code == "content_filter" and "weapons" in str(err.value)
    # The model's greedy answer first, then a rule on a stretch of it that spans several tokens.
    ask = [{"role": "user", "content": "Write one sentence about the sea."}]
    full = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0,
                                          extra_headers={"cache-control": "no-cache"})
    text = full.choices[0].message.content or ""
    assert len(text) > 40, text
    term = text[len(text) // 2 - 8:len(text) // 2 + 8]
    policy.write_text(json.dumps({"input": [{"category": "weapons", "pattern": r"build\s+a\s+bomb"}],
                                  "output": [{"category": "test-term", "pattern": re.escape(term)}]}))
    os.utime(policy, ns=(time.time_ns(), time.time_ns() + 10**9))
    time.sleep(1.2)                                  # the edge looks at the file at most once a second
    try:
        stream = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0, stream=True)
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["content_filter"]
        assert term.lower() not in streamed.lower() and streamed == text[:text.lower().index(term.lower())]
        whole = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0)
        assert whole.choices[0].finish_reason == "content_filter"
        assert term.lower() not in (whole.choices[0].message.content or "").lower()
        assert _metric(mesh, "infermesh_edge_content_filtered_total", direction="output", category="test-term") >= 2
    finally:
        policy.write_text(json.dumps({"input": [{"category": "weapons", "pattern": r"build\s+a\s+bomb"}]}))


def test_signed_requests_unsigned_stale_and_replayed_get_401(policies: tuple[Mesh, Path]) -> None:
    mesh, _ = policies
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    url, auth = f"{mesh.http}/v1/chat/completions", {"authorization": "Bearer k-sign",
                                                     "content-type": "application/json"}

    def post(extra: dict[str, str]) -> httpx.Response:
        return httpx.post(url, content=body, headers={**auth, **extra}, timeout=120)

    unsigned = post({})
    assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "invalid_signature"
    signed = signing.sign_headers("sign-me", "POST", "/v1/chat/completions", body)
    assert post(signed).status_code == 200
    replayed = post(signed)
    assert replayed.status_code == 401 and "already used" in replayed.json()["error"]["message"]
    stale = post(signing.sign_headers("sign-me", "POST", "/v1/chat/completions", body, now=time.time() - 400))
    assert stale.status_code == 401 and "old" in stale.json()["error"]["message"]
    forged = post(signing.sign_headers("not-the-secret", "POST", "/v1/chat/completions", body))
    assert forged.status_code == 401 and "does not match" in forged.json()["error"]["message"]


def test_a_free_key_gets_429_where_a_premium_key_in_the_same_burst_does_not(policies: tuple[Mesh, Path]) -> None:
    mesh, _ = policies
    keys = ["k-free", "k-prem"] * 5
    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: (keys[i], _chat(mesh, keys[i], f"Say {i}.", max_tokens=1,
                                                           headers={"cache-control": "no-cache"})), range(10)))
    free = sorted(r.status_code for k, r in results if k == "k-free")
    premium = [r.status_code for k, r in results if k == "k-prem"]
    assert free == [200, 200, 200, 429, 429] and premium == [200] * 5
    refused = next(r for k, r in results if r.status_code == 429)
    assert "free tier" in refused.json()["error"]["message"] and int(refused.headers["retry-after"]) >= 1
    assert _metric(mesh, "infermesh_edge_tenant_requests_total", tenant="acme", tier="free", status="429") == 2


def test_a_jwt_tenant_is_honoured_and_an_expired_one_refused(policies: tuple[Mesh, Path]) -> None:
    mesh, _ = policies
    now = int(time.time())
    token = jwt.encode({"tenant": "umbrella", "tier": "premium", "sub": "alice", "exp": now + 300}, JWT_SECRET,
                       algorithm="HS256")
    client = openai.OpenAI(base_url=f"{mesh.http}/v1", api_key=token, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert _metric(mesh, "infermesh_edge_tenant_requests_total", tenant="umbrella", tier="premium", status="200") == 1
    expired = jwt.encode({"tenant": "umbrella", "exp": now - 120}, JWT_SECRET, algorithm="HS256")
    stale_client = openai.OpenAI(base_url=f"{mesh.http}/v1", api_key=expired, max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError) as err:
        stale_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    assert "expired" in str(err.value)
