"""Finding 1 of issue 31 (HIGH): the output filter leaked through logprobs.

With an output rule on a word, an answer containing it ended with finish_reason content_filter and
no trace of the word in its text, but `logprobs.content` (chat) and `logprobs.tokens` (completions)
returned every token of the match but the last, streamed and whole, for every choice; top_logprobs
showed a blocked word as the runner-up even when the chosen text avoided it, and that answer was
stored in the response cache and replayed.  Now logprobs go out only with the text they belong to,
alternatives that would complete a match are dropped, and such answers are never cached.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.scripted_router import ScriptedRouter, app, events, request, tokens

# "...the secret is in the bomb shelter": the rule's word arrives across two tokens, " bo" + "mb"
PIECES = ["The", " secret", " is", " in", " the", " bo", "mb", " shelter", "."]
CLEAN = ["The", " secret", " is", " in", " the", " old", " shelter", "."]


@pytest.fixture
def policy(tmp_path: Path) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"output": [{"category": "weapons", "pattern": "bomb"}], "window": 8}))
    return str(path)


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "where is it?"}], "logprobs": True,
            "top_logprobs": 3, "temperature": 0, **extra}


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "where is it?", "logprobs": 3, "temperature": 0, **extra}


def _chat_tokens(choice: dict[str, Any]) -> list[str]:
    return [e["token"] for e in (choice["logprobs"] or {}).get("content") or []]


def _chat_alternatives(choice: dict[str, Any]) -> list[str]:
    return [t["token"] for e in (choice["logprobs"] or {}).get("content") or [] for t in e["top_logprobs"]]


def test_a_cut_answers_logprobs_hold_no_token_of_the_match(policy: str) -> None:
    async def main() -> None:
        edge = app(ScriptedRouter(tokens(PIECES)), content_policy=policy)
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", _chat(n=2))
        assert status == 200
        for choice in json.loads(raw)["choices"]:
            assert choice["finish_reason"] == "content_filter"
            text = choice["message"]["content"] or ""
            assert "bo" not in text.replace("The", "")
            # every token given out is text the client got (a token that straddles the cut is held back)
            assert text.startswith("".join(_chat_tokens(choice))) and len(_chat_tokens(choice)) >= 4
            assert " bo" not in _chat_tokens(choice) and " bo" not in _chat_alternatives(choice)

        status, _, raw = await request(edge, "POST", "/v1/completions", _completion())
        choice = json.loads(raw)["choices"][0]
        assert choice["finish_reason"] == "content_filter" and " bo" not in choice["logprobs"]["tokens"]
        assert choice["text"].startswith("".join(choice["logprobs"]["tokens"]))
    asyncio.run(main())


def test_a_cut_streams_logprobs_hold_no_token_of_the_match(policy: str) -> None:
    async def main() -> None:
        edge = app(ScriptedRouter(tokens(PIECES)), content_policy=policy)
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", _chat(stream=True, n=2))
        assert status == 200
        for index in (0, 1):
            chunks = [c["choices"][0] for c in events(raw) if c["choices"] and c["choices"][0]["index"] == index]
            text = "".join(c["delta"].get("content") or "" for c in chunks)
            streamed = [t for c in chunks for t in _chat_tokens(c)]
            alternatives = [t for c in chunks for t in _chat_alternatives(c)]
            assert chunks[-1]["finish_reason"] == "content_filter"
            assert text.startswith("".join(streamed)) and " bo" not in streamed and " bo" not in alternatives

        status, _, raw = await request(edge, "POST", "/v1/completions", _completion(stream=True))
        chunks = [c["choices"][0] for c in events(raw) if c["choices"]]
        streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert " bo" not in streamed and "".join(c["text"] for c in chunks).startswith("".join(streamed))
    asyncio.run(main())


def test_an_alternative_that_would_complete_a_match_is_dropped_and_the_answer_not_cached(policy: str) -> None:
    """The chosen text avoids the word, but its runner-up at " old" is " bomb"."""
    async def main() -> None:
        router = ScriptedRouter(tokens(CLEAN, alternatives={5: [" bomb", " new"]}))
        edge = app(router, content_policy=policy)
        for _ in range(2):
            status, _, raw = await request(edge, "POST", "/v1/chat/completions", _chat())
            choice = json.loads(raw)["choices"][0]
            assert status == 200 and choice["finish_reason"] == "stop"
            assert choice["message"]["content"] == "".join(CLEAN)
            assert " bomb" not in _chat_alternatives(choice) and " new" in _chat_alternatives(choice)
        assert len(router.calls) == 2          # the second ask reached the model: nothing was cached

        status, _, raw = await request(edge, "POST", "/v1/completions", _completion(stream=True))
        tops = [t for c in events(raw) if c["choices"] and c["choices"][0]["logprobs"]
                for top in c["choices"][0]["logprobs"]["top_logprobs"] for t in top]
        assert " bomb" not in tops and " new" in tops
    asyncio.run(main())


def test_without_output_rules_logprobs_stream_with_their_tokens(tmp_path: Path) -> None:
    """The hold-back is the rules' price only: with none, each chunk carries its own token's logprob."""
    async def main() -> None:
        edge = app(ScriptedRouter(tokens(CLEAN, alternatives={5: [" bomb"]})))
        _, _, raw = await request(edge, "POST", "/v1/chat/completions", _chat(stream=True))
        chunks = [c["choices"][0] for c in events(raw) if c["choices"]]
        with_text = [c for c in chunks if c["delta"].get("content")]
        assert [_chat_tokens(c) for c in with_text] == [[p] for p in CLEAN]
        assert " bomb" in [t for c in chunks for t in _chat_alternatives(c)]
    asyncio.run(main())
