"""Issue 49, finding 8: the token budget's estimate left out the stored history.  A conversation continued by
`x-session-id` (or Responses' previous_response_id) reserved only its new messages' bytes / 4, so a tenant
with a long stored conversation was charged for it only after the engine had read it.  Now each stored
conversation's tokens, as its last turn used them (the tokenizer's count: prompt with history + answer), are
reserved with the next turn."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

from mesh.clients.router_client import Delta, ServedBy
from tests.fakes.scripted_router import ScriptedRouter, app, request

SERVED = ServedBy("engine-0", "m", "1", "local", False, 1.0)


def _long_history() -> ScriptedRouter:
    """Answers whose usage says a 400-token prompt (the stored conversation) and a 20-token answer."""
    return ScriptedRouter([Delta("ok"), Delta(".", "stop", 400, 20, served_by=SERVED)])


def _files(tmp_path: Path, tokens: str) -> dict[str, str]:
    (tmp_path / "keys").write_text("k-a tenant=acme tier=small\n")
    (tmp_path / "tiers.json").write_text(json.dumps({"small": {"tokens": tokens}}))
    return {"keys_file": str(tmp_path / "keys"), "tiers_file": str(tmp_path / "tiers.json"),
            "response_cache_ttl_s": 0}


def test_a_sessions_next_turn_reserves_its_stored_tokens(tmp_path: Path) -> None:
    async def main() -> None:
        router = _long_history()
        edge = app(router, **_files(tmp_path, "425/m"))
        auth = {"authorization": "Bearer k-a", "x-session-id": "s-1"}
        chat = {"model": "m", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 8}
        status, _, _ = await request(edge, "POST", "/v1/chat/completions", chat, auth)
        assert status == 200 and list(edge.admission.conversations.values()) == [420]
        # the next turn reserves 420 + its own 10: more than the whole 425 a minute, refused before the router
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", chat, auth)
        error = json.loads(raw)["error"]
        assert status == 429 and error["code"] == "request_too_large" and len(router.calls) == 1
        assert "the stored conversation's 420" in error["message"]
        # another session of the tenant reserves only its own (it waits for the debt the first turn left, no more)
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", chat, {**auth, "x-session-id": "s-2"})
        assert status == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    asyncio.run(main())


def test_a_responses_chain_reserves_the_previous_responses_tokens(tmp_path: Path) -> None:
    async def main() -> None:
        router = _long_history()
        edge = app(router, **_files(tmp_path, "100000/m"))
        auth = {"authorization": "Bearer k-a"}
        status, _, raw = await request(edge, "POST", "/v1/responses", {"model": "m", "input": "hi",
                                                                     "max_output_tokens": 8}, auth)
        first = json.loads(raw)["id"]
        assert status == 200 and edge.admission.conversations[(router.calls[0].tenant, first)] == 420
        caller = edge.admission.directory.by_key("k-a")
        assert caller is not None
        spec = router.calls[0]
        alone = edge.admission.enter(caller, replace(spec, session_id="resp_other", history_from=""))
        chained = edge.admission.enter(caller, replace(spec, session_id="resp_next", history_from=first))
        assert chained.reserved - alone.reserved == 420
        edge.admission.leave(alone)
        edge.admission.leave(chained)
    asyncio.run(main())
