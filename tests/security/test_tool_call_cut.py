"""Finding 8 of issue 31 (INFO): a tool call cut by the output filter returned its raw partial markup.

An answer that opened a `<tool_call>` and wrote a blocked word inside it ended with the call's
unfinished markup (`<tool_call>{"name": ...`) as the message's content.  Now the cut call is dropped
whole: the choice ends with finish_reason content_filter, no tool_calls and no markup.  Streamed, a call's
arguments go out in pieces as they are written (as OpenAI streams them), so the pieces released before
the cut may have gone out, never the markup and never the text the rules hold back.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.fakes.scripted_router import ScriptedRouter, app, events, request, tokens

TOOL = {"type": "function", "function": {"name": "lookup", "description": "finds things",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
PIECES = ["Let me look.", "\n<tool_call>\n", '{"name": "lookup", ', '"arguments": {"q": "a bo', 'mb"}}',
          "\n</tool_call>"]


def test_a_tool_call_cut_by_the_rules_ends_without_partial_markup(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"output": [{"category": "weapons", "pattern": "bomb"}], "window": 8}))

    async def main() -> None:
        edge = app(ScriptedRouter(tokens(PIECES)), content_policy=str(policy))
        body = {"model": "m", "messages": [{"role": "user", "content": "find it"}], "tools": [TOOL]}
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", body)
        choice = json.loads(raw)["choices"][0]
        assert status == 200 and choice["finish_reason"] == "content_filter"
        content = choice["message"]["content"] or ""
        assert "<tool_call" not in content and "lookup" not in content and "bo" not in content
        assert not choice["message"].get("tool_calls")

        status, _, raw = await request(edge, "POST", "/v1/chat/completions", {**body, "stream": True})
        chunks = [c["choices"][0] for c in events(raw) if c["choices"]]
        streamed = "".join(c["delta"].get("content") or "" for c in chunks)
        assert chunks[-1]["finish_reason"] == "content_filter"
        assert "<tool_call" not in streamed and "lookup" not in streamed
        pieces = "".join(call["function"].get("arguments") or "" for c in chunks
                         for call in c["delta"].get("tool_calls") or [])
        assert "bo" not in pieces and "tool_call" not in pieces and pieces.startswith('{"q": "a')
    asyncio.run(main())
