"""Issue 16: the prefix caches crossed callers, so a hit (`cached_tokens`, a faster first token)
told one caller what another had sent.  On a7f9686 key B's request for key A's prompt came back
with cached_tokens > 0.

Now the block hash chain starts from a root salted by the request's cache_salt (mesh/prefix.py),
which the router sets to the tenant: the engine's cache, the shared KV cache (keyed by those
hashes) and the router's prefix affinity all keep tenants apart; `--prefix-sharing global` shares.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.prefix import block_hashes, root, tenant_salt
from services.engine.core.block_manager import BlockManager
from services.engine.core.request import SamplingParams
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide
from services.router.config import RouterConfig
from tests.fakes.router_mesh import chat, collect, run, running

PROMPT = list(range(1, 70))


def test_salted_chains_never_meet() -> None:
    a, b = tenant_salt("key:aaaa"), tenant_salt("key:bbbb")
    assert set(block_hashes(PROMPT, 16, b"m", a)).isdisjoint(block_hashes(PROMPT, 16, b"m", b))
    assert set(block_hashes(PROMPT, 16, b"m", a)).isdisjoint(block_hashes(PROMPT, 16, b"m"))
    assert block_hashes(PROMPT, 16, b"m", a) == block_hashes(PROMPT, 16, b"m", a)
    assert root(b"m") == b"m" and root(b"m", a) != root(b"m", b)


def test_block_manager_shares_within_a_salt_only() -> None:
    blocks = BlockManager(num_blocks=32, block_size=16, namespace=b"m")
    table, cached = blocks.allocate(PROMPT, salt=b"A")
    blocks.commit(table, PROMPT, len(PROMPT))
    assert cached == 0
    assert len(blocks.match_prefix(PROMPT, salt=b"A")) == 4
    assert blocks.match_prefix(PROMPT, salt=b"B") == []
    assert blocks.match_prefix(PROMPT) == []
    again, cached = blocks.allocate(PROMPT, salt=b"A")
    assert cached == 64 and again.hashes == table.hashes[:4]


def _cached_tokens(engine: Engine, request_id: str, prompt: list[int], salt: bytes) -> int:
    engine.add(engine.make_request(request_id, prompt, SamplingParams(max_tokens=2), cache_salt=salt))
    return engine.run_until_idle()[request_id][-1].cached_tokens


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(ModelRunner(model_dir, decide(device="cpu", dtype="float32"), kv_cache_bytes=32 << 20))


def test_another_tenant_gets_no_hit_on_a_real_engine(engine: Engine) -> None:
    prompt = [1, *range(500, 600)]
    assert _cached_tokens(engine, "a1", prompt, b"key:aaaa") == 0
    assert _cached_tokens(engine, "b1", prompt, b"key:bbbb") == 0       # a7f9686: 96 cached
    assert _cached_tokens(engine, "a2", prompt, b"key:aaaa") > 0        # the owner still reuses it


def test_the_router_salts_engine_requests_by_tenant() -> None:
    async def scenario() -> None:
        async with running(engines=1) as mesh:
            for tenant in ("key:aaaa", "key:bbbb", "key:aaaa"):
                await collect(mesh, chat(("user", "the same long prompt"), tenant=tenant))
            salts = [request.cache_salt for _, request in mesh.script.calls]
            assert salts == [b"key:aaaa", b"key:bbbb", b"key:aaaa"]

    run(scenario)


def test_global_sharing_is_a_choice() -> None:
    assert RouterConfig(tokenizer="t:1", engines=(), discovery="consul", prefix_sharing="global")
    with pytest.raises(ValueError, match="prefix_sharing"):
        RouterConfig(tokenizer="t:1", engines=(), discovery="consul", prefix_sharing="everyone")
