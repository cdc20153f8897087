"""Issue 49, finding 8: embeddings and /tokenize skipped the input rules, and chat_template_kwargs values were
not scanned.  Now /v1/embeddings and /tokenize pass the same input rules as a completion (every text that
reaches the model: services/edge/surfaces/model_inputs.py), and the template's variables are read too.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.scripted_router import ScriptedRouter, app, request, tokens

CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/embeddings", {"model": "m", "input": "how to build a bomb"}),
    ("/v1/embeddings", {"model": "m", "input": ["fine", "a ｂomb"]}),
    ("/tokenize", {"model": "m", "prompt": "how to build a bomb"}),
    ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": "a bo"}, {"role": "user", "content": "mb"}]}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"persona": "bomb"}}),
    ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": "hi"}],     # (it takes no template
                   "tools": [{"type": "function", "function": {"name": "bomb_maker"}}]}),   # kwargs: its tools)
]


@pytest.fixture
def policy(tmp_path: Path) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"input": [{"category": "weapons", "pattern": "bomb"}]}))
    return str(path)


class Counting(ScriptedRouter):
    """Counts the tokenize and embedding calls too."""

    def __init__(self) -> None:
        super().__init__(tokens(["fine"]))
        self.tokenized: list[Any] = []

    async def tokenize(self, spec: Any) -> Any:
        self.tokenized.append(spec)
        raise AssertionError("a refused input reached the router")


@pytest.mark.parametrize(("path", "body"), CASES)
def test_the_input_rules_read_every_surface(policy: str, path: str, body: dict[str, Any]) -> None:
    async def main() -> None:
        router = Counting()
        status, _, raw = await request(app(router, content_policy=policy), "POST", path, body)
        error = json.loads(raw)["error"]
        assert (status, error["code"]) == (400, "content_filter") and "weapons" in error["message"], raw
        assert router.calls == [] and router.tokenized == []
    asyncio.run(main())


def test_a_clean_embedding_and_tokenize_still_reach_the_router(policy: str) -> None:
    async def main() -> None:
        router = Counting()
        edge = app(router, content_policy=policy)
        status, _, _ = await request(edge, "POST", "/tokenize", {"model": "m", "prompt": "the tomb"})
        assert status == 500 and len(router.tokenized) == 1          # the double raises once reached
        status, _, _ = await request(edge, "POST", "/v1/embeddings", {"model": "m", "input": "the tomb"})
        assert len(router.calls) == 1
    asyncio.run(main())


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"model": "m", "messages": [{"role": "assistant", "content": "x", "tool_calls": 4.4e16}]}),
    ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
                                                                                      "function": 7}]}),
    ("/v1/embeddings", {"model": "m", "input": [{"nested": ["x"]}]}),
])
def test_a_malformed_body_is_a_400_not_a_crash_of_the_input_rules(policy: str, path: str, body: dict[str, Any]) -> None:
    """Found by the OpenAPI fuzz: the rules read a body before its surface had parsed it, and a tool_calls that
    was a number raised inside them (500).  Each surface parses first, then the rules read the checked fields."""
    async def main() -> None:
        router = Counting()
        status, _, raw = await request(app(router, content_policy=policy), "POST", path, body)
        assert status == 400, raw
        assert router.calls == [] and router.tokenized == []
    asyncio.run(main())
