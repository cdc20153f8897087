"""Issue 49, finding 1: a reasoning model's thoughts leaked through logprobs.

A model thinking "I love Paris in the spring" under the output rule `Paris in the spring` (window 32)
answered `content: ""`, `finish_reason: content_filter` and no reasoning text, but `logprobs.content`
spelled `I love Paris in`, streamed and whole: each logprob entry was released against the answer's
guard, which has nothing to hold while the model thinks, and top alternatives were screened against the
answer only.  Now an entry waits for both guards (thoughts and answer) and alternatives are screened
against both.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from mesh.clients.router_client import Delta, ServedBy, TokenLogprob, TopLogprob
from tests.fakes.scripted_router import ScriptedRouter, app, events, request

THOUGHTS = ["I", " love", " Paris", " in", " the", " spring", "."]
ANSWER = ["Spring", " is", " nice", "."]


@pytest.fixture
def policy(tmp_path: Path) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"output": [{"category": "travel", "pattern": "Paris in the spring"}],
                                "window": 32}))
    return str(path)


def thinking(thoughts: Sequence[str], answer: Sequence[str], alternatives: dict[int, str] | None = None
             ) -> list[Delta]:
    """Deltas of a thinking model: `thoughts` in the reasoning channel, then `answer`; token k's
    runner-up is alternatives[k] (id 900 + k)."""
    served = ServedBy("engine-0", "m", "1", "local", False, 1.0)
    pieces = [(p, True) for p in thoughts] + [(p, False) for p in answer]
    out = []
    for k, (piece, thought) in enumerate(pieces):
        top = [TopLogprob(100 + k, piece, -0.1)]
        if alternatives and k in alternatives:
            top.append(TopLogprob(900 + k, alternatives[k], -2.0))
        last = k == len(pieces) - 1
        out.append(Delta("" if thought else piece, "stop" if last else None, 5 if last else 0,
                         len(pieces) if last else 0, served_by=served if last else None, ids=(100 + k,),
                         logprobs=(TokenLogprob(100 + k, piece, -0.1, tuple(top)),),
                         reasoning=piece if thought else ""))
    return out


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Repeat exactly: I love Paris in the spring."}],
            "logprobs": True, "top_logprobs": 2, "temperature": 0, **extra}


def _tokens(logprobs: dict[str, Any] | None) -> list[str]:
    return [e["token"] for e in (logprobs or {}).get("content") or []]


def _alternatives(logprobs: dict[str, Any] | None) -> list[str]:
    return [t["token"] for e in (logprobs or {}).get("content") or [] for t in e["top_logprobs"]]


def test_blocked_thoughts_give_out_no_logprob_whole(policy: str) -> None:
    async def main() -> None:
        edge = app(ScriptedRouter(thinking(THOUGHTS, ANSWER)), content_policy=policy)
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", _chat())
        assert status == 200
        choice = json.loads(raw)["choices"][0]
        assert choice["finish_reason"] == "content_filter"
        assert not choice["message"]["content"] and not choice["message"].get("reasoning_content")
        assert _tokens(choice["logprobs"]) == []
    asyncio.run(main())


def test_blocked_thoughts_give_out_no_logprob_streamed(policy: str) -> None:
    async def main() -> None:
        edge = app(ScriptedRouter(thinking(THOUGHTS, ANSWER)), content_policy=policy)
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", _chat(stream=True))
        assert status == 200
        chunks = [c["choices"][0] for c in events(raw) if c.get("choices")]
        assert chunks[-1]["finish_reason"] == "content_filter"
        streamed = [t for c in chunks for t in _tokens(c.get("logprobs"))]
        thoughts = "".join(c["delta"].get("reasoning_content") or "" for c in chunks)
        assert streamed == [] and thoughts == ""
    asyncio.run(main())


def test_clean_thoughts_keep_every_logprob_in_order(policy: str) -> None:
    async def main() -> None:
        thoughts = ["I", " love", " Rome", " in", " the", " fall", "."]
        edge = app(ScriptedRouter(thinking(thoughts, ANSWER)), content_policy=policy)
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", _chat())
        choice = json.loads(raw)["choices"][0]
        assert status == 200 and choice["finish_reason"] == "stop"
        assert choice["message"]["reasoning_content"] == "".join(thoughts)
        assert _tokens(choice["logprobs"]) == thoughts + ANSWER

        status, _, raw = await request(edge, "POST", "/v1/chat/completions", _chat(stream=True))
        chunks = [c["choices"][0] for c in events(raw) if c.get("choices")]
        assert [t for c in chunks for t in _tokens(c.get("logprobs"))] == thoughts + ANSWER
        # an entry goes out no earlier than its text: the thoughts' before the answer's first piece
        first_answer = next(i for i, c in enumerate(chunks) if c["delta"].get("content"))
        released = [t for c in chunks[:first_answer + 1] for t in _tokens(c.get("logprobs"))]
        assert released[:len(thoughts)] == thoughts
    asyncio.run(main())


def test_an_alternative_completing_a_match_in_the_thoughts_is_dropped(policy: str) -> None:
    async def main() -> None:
        # "I love Paris in the" then " fall"; its runner-up " spring" would complete the rule in the thoughts
        thoughts = ["I", " love", " Paris", " in", " the", " fall", "."]
        edge = app(ScriptedRouter(thinking(thoughts, ANSWER, {5: " spring"})), content_policy=policy)
        for stream in (False, True):
            status, _, raw = await request(edge, "POST", "/v1/chat/completions", _chat(stream=stream))
            assert status == 200
            if stream:
                alternatives = [t for c in events(raw) if c.get("choices")
                                for t in _alternatives(c["choices"][0].get("logprobs"))]
            else:
                alternatives = _alternatives(json.loads(raw)["choices"][0]["logprobs"])
            assert " spring" not in alternatives and " fall" in alternatives
    asyncio.run(main())
