"""Gateway policies, pure parts: tenants and tiers, JWTs, signed requests, content rules, response-cache keys."""

import json
import os
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from mesh import signing
from mesh.apikeys import digest, load_keys
from mesh.clients.router_client import GenerateSpec
from mesh.ratelimit import Rate
from services.cache.responses import ResponseStore
from services.edge.gateway.jwt_auth import JwtRefused, JwtVerifier
from services.edge.gateway.response_cache import cache_key, storable
from services.edge.gateway.safety import OutputGuard, PolicySource, parse_policy
from services.edge.gateway.tenants import STANDARD, Directory, TenantTier, parse_keys, parse_tiers
from services.edge.surfaces import requests

HS = "topsecret-topsecret-topsecret-32b"
TIERS = {"free": {"requests": "2/m", "tokens": "500/m", "priority": "batch", "cache_class": "batch"},
         "premium": {"requests": "600/m", "cache_class": "premium"}}


def test_keys_file_fields_and_tiers() -> None:
    keys = parse_keys("# comment\nk-free tenant=acme tier=free\n\nk-bare\nk-sign tier=premium signing_secret=s3\n")
    assert keys[digest("k-free")].tenant == "acme" and keys[digest("k-free")].tier == "free"
    assert keys[digest("k-bare")].tier == STANDARD and keys[digest("k-sign")].signing_secret == b"s3"
    tiers = parse_tiers(json.dumps(TIERS), TenantTier(STANDARD, Rate(5, 1)))
    assert tiers["free"].requests == Rate(2, 60) and tiers["free"].tokens == Rate(500, 60)
    assert tiers["free"].priority == "batch" and tiers["premium"].cache_class == "premium"
    assert tiers[STANDARD].requests == Rate(5, 1)
    for bad in ('{"x": {"priority": "urgent"}}', '{"x": {"cache_class": "gold"}}', '{"x": {"rps": 1}}',
                '{"bad name": {}}', '[]'):
        with pytest.raises(ValueError):
            parse_tiers(bad, TenantTier(STANDARD))
    with pytest.raises(ValueError, match="line 1"):
        parse_keys("k1 owner=me\n")


def test_tiers_schedule_by_class_and_weight() -> None:
    tiers = parse_tiers('{"premium": {"class": "interactive", "weight": 3}, "free": {"weight": 0.5}, '
                        '"jobs": {"class": "batch"}, "old": {"priority": "batch"}}', TenantTier(STANDARD))
    assert (tiers["premium"].priority, tiers["premium"].weight) == ("interactive", 3.0)
    assert (tiers["free"].priority, tiers["free"].weight) == ("interactive", 0.5)
    assert tiers["jobs"].priority == tiers["old"].priority == "batch" and tiers[STANDARD].weight == 1.0
    for bad, why in (('{"x": {"weight": 0}}', "weight 0 must be"), ('{"x": {"weight": "3"}}', "weight '3'"),
                     ('{"x": {"weight": 1001}}', "at most 1000"), ('{"x": {"weight": true}}', "weight True"),
                     ('{"x": {"class": "urgent"}}', "class 'urgent'"),
                     ('{"x": {"class": "batch", "priority": "interactive"}}', "disagree")):
        with pytest.raises(ValueError, match=why):
            parse_tiers(bad, TenantTier(STANDARD))
    # The router reads only the key of each line.
    assert load_keys({"INFERMESH_API_KEYS_FILE": _write("k-free tenant=acme tier=free\n")}) == (digest("k-free"),)


def _write(text: str, path: Path | None = None) -> str:
    import tempfile
    target = path or Path(tempfile.mkdtemp()) / "f"
    target.write_text(text)
    return str(target)


def test_directory_reloads_changed_files_and_keeps_the_last_good(tmp_path: Path) -> None:
    keys, tiers = tmp_path / "keys", tmp_path / "tiers.json"
    keys.write_text("k1 tenant=acme tier=free\n")
    tiers.write_text(json.dumps(TIERS))
    d = Directory((), str(keys), str(tiers))
    caller = d.by_key("k1")
    assert caller is not None and caller.tenant == "t:acme" and caller.tier.name == "free" and caller.label == "acme"
    assert d.by_key("k2") is None
    keys.write_text("k1 tenant=acme tier=premium\nk2\n")
    os.utime(keys, ns=(time.time_ns(), time.time_ns() + 10**9))
    d.refresh(now=time.monotonic() + 5)
    assert d.by_key("k1").tier.name == "premium"           # type: ignore[union-attr]
    k2 = d.by_key("k2")
    assert k2 is not None and k2.tenant.startswith("key:") and k2.tier.name == STANDARD
    keys.write_text("k1 tier=gold\n")                     # a tier nobody defined: the last good stays
    os.utime(keys, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    d.refresh(now=time.monotonic() + 10)
    assert d.by_key("k1").tier.name == "premium"           # type: ignore[union-attr]


def test_signed_requests_refuse_unsigned_stale_forged_and_replayed() -> None:
    nonces, now = signing.NonceCache(), 1_700_000_000.0
    body = b'{"x": 1}'
    good = signing.sign_headers("s3", "POST", "/v1/chat/completions", body, now=now, nonce="nonce-0001")
    signing.verify(b"s3", "k", "POST", "/v1/chat/completions", good, body, now + 10, nonces)
    cases = {
        "missing": ({}, body, now),
        "already used": (good, body, now + 20),                                         # replayed
        "old": (signing.sign_headers("s3", "POST", "/v1/chat/completions", body, now=now - 301), body, now),
        "does not match": (signing.sign_headers("other", "POST", "/v1/chat/completions", body, now=now), body, now),
    }
    for words, (headers, sent, at) in cases.items():
        with pytest.raises(signing.BadSignature, match=words):
            signing.verify(b"s3", "k", "POST", "/v1/chat/completions", headers, sent, at, nonces)
    tampered = signing.sign_headers("s3", "POST", "/v1/chat/completions", body, now=now)
    with pytest.raises(signing.BadSignature, match="does not match"):
        signing.verify(b"s3", "k", "POST", "/v1/chat/completions", tampered, b'{"x": 2}', now, nonces)


def test_jwt_hs256_and_rs256_with_a_jwks_file(tmp_path: Path) -> None:
    hs = JwtVerifier(secret=HS)
    now = int(time.time())
    token = jwt.encode({"tenant": "acme", "tier": "free", "sub": "u1", "exp": now + 60}, HS,
                       algorithm="HS256")
    claims = hs.verify(token)
    assert (claims.tenant, claims.tier, claims.subject) == ("acme", "free", "u1")
    expired = jwt.encode({"tenant": "acme", "exp": now - 60}, HS, algorithm="HS256")
    with pytest.raises(JwtRefused, match="expired"):
        hs.verify(expired)
    with pytest.raises(JwtRefused, match="tenant"):
        hs.verify(jwt.encode({"exp": now + 60}, HS, algorithm="HS256"))
    with pytest.raises(JwtRefused, match="exp"):
        hs.verify(jwt.encode({"tenant": "acme"}, HS, algorithm="HS256"))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "alg": "RS256", "use": "sig"}]}))
    rs = JwtVerifier(jwks_file=str(tmp_path / "jwks.json"))
    signed = jwt.encode({"tenant": "globex", "exp": now + 60}, key, algorithm="RS256", headers={"kid": "k1"})
    assert rs.verify(signed).tenant == "globex" and rs.verify(signed).tier == STANDARD
    with pytest.raises(JwtRefused, match="not accepted"):
        rs.verify(token)                                    # HS256 where only RS256 is configured
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    with pytest.raises(JwtRefused, match="refused"):
        rs.verify(jwt.encode({"tenant": "globex", "exp": now + 60}, other, algorithm="RS256", headers={"kid": "k1"}))


def test_output_guard_catches_a_term_split_across_tokens() -> None:
    policy = parse_policy(json.dumps({"output": [{"category": "secrets", "pattern": "sword ?fish"}], "window": 12}))
    guard = OutputGuard(policy)
    sent = ""
    for piece in ["The password", " is a long word, and it is ", "Swo", "rd", "fish", " indeed"]:
        sent += guard.feed(piece)
    sent += guard.finish()
    assert guard.blocked == "secrets"
    assert sent == "The password is a long word, and it is "      # the text before the term, none of it
    clean = OutputGuard(policy)
    text = "".join(clean.feed(p) for p in ["A sword", " and a fish", " swim"]) + clean.finish()
    assert text == "A sword and a fish swim" and clean.blocked is None


def test_policy_file_is_validated_and_reloaded(tmp_path: Path) -> None:
    for bad in ('{"input": [{"category": "x"}]}', '{"input": [{"category": "x", "pattern": "("}]}',
                '{"output": [{"category": "x", "pattern": "a*"}]}', '{"window": 0}', '{"rules": []}'):
        with pytest.raises(ValueError):
            parse_policy(bad)
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"input": [{"category": "weapons", "pattern": "build a bomb"}]}))
    source = PolicySource(str(path))
    assert source.current().check_input(["How do I BUILD A BOMB?"]) == "weapons"
    path.write_text(json.dumps({"input": []}))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert source.current().check_input(["How do I build a bomb?"]) is None


def test_response_cache_keys_are_per_tenant_and_ignore_stream_fields() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    spec: GenerateSpec = requests.parse_chat(body)
    a = cache_key(True, "t:acme", body, spec, "")
    assert a is not None and a == cache_key(True, "t:acme", {**body, "stream": True}, spec, "")
    assert a != cache_key(True, "t:globex", body, spec, "")
    assert a != cache_key(False, "t:acme", body, spec, "") and a != cache_key(True, "t:acme", body, spec, "2")
    hot = {**body, "temperature": 0.7}
    assert cache_key(True, "t:acme", hot, requests.parse_chat(hot), "") is None
    seeded = {**hot, "seed": 3}
    assert cache_key(True, "t:acme", seeded, requests.parse_chat(seeded), "") is not None
    assert cache_key(True, "t:acme", body, requests.parse_chat(body, session_id="s1"), "") is None
    assert storable({"choices": [{"finish_reason": "stop"}], "infermesh": {"degraded": False}})
    assert not storable({"choices": [{"finish_reason": "content_filter"}], "infermesh": None})
    assert not storable({"choices": [{"finish_reason": "stop"}], "infermesh": {"degraded": True}})


def test_shared_response_store_is_bounded_and_expires() -> None:
    store = ResponseStore(max_bytes=100)
    store.put(b"k" * 32, b"a" * 60, 10, now=0)
    store.put(b"j" * 32, b"b" * 60, 10, now=1)           # over the budget: the oldest goes
    assert store.get(b"k" * 32, 2) is None and store.get(b"j" * 32, 2) == b"b" * 60
    assert store.get(b"j" * 32, 11.5) is None               # expired
    with pytest.raises(Exception, match="16 to 64"):
        store.put(b"short", b"x", 10, now=0)
