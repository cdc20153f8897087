"""The router's detokenizer (services/router/upstream.py Tokenizer.decoder): fetched once per model however
many requests ask at once, and parsed off the event loop, so a large vocabulary's JSON never stalls the
router's other streams and health answers (Gemma 3's 262k-token JSON took ~1 s a parse, once per waiting
request, and the edge took the router for dead)."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

from services.router.upstream import Tokenizer

VOCAB = {"[UNK]": 0, "a": 1, "b": 2}
TOKENIZER_JSON = json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": VOCAB, "unk_token": "[UNK]"},
                             "decoder": None, "pre_tokenizer": {"type": "Whitespace"}})


def test_one_fetch_for_requests_that_ask_at_once_and_the_loop_keeps_running() -> None:
    calls: list[str] = []
    parsed_on: list[bool] = []

    async def call(method: str, request: Any, timeout: float) -> Any:
        calls.append(method)
        await asyncio.sleep(0.05)
        return SimpleNamespace(tokenizer_json=TOKENIZER_JSON)

    from tokenizers import Tokenizer as Vocabulary

    real = Vocabulary.from_str

    def from_str(text: str) -> Any:
        parsed_on.append(threading.current_thread() is threading.main_thread())
        return real(text)

    async def main() -> list[str]:
        import services.router.upstream as upstream

        tokenizer = Tokenizer("127.0.0.1:1", "test")        # (a grpc.aio channel: made on the running loop)
        tokenizer._call = call  # type: ignore[method-assign]
        upstream.Vocabulary = type("V", (), {"from_str": staticmethod(from_str)})  # type: ignore[misc, assignment]
        try:
            decoders = await asyncio.gather(*(tokenizer.decoder("m") for _ in range(5)))
        finally:
            upstream.Vocabulary = Vocabulary  # type: ignore[misc]
        return [d([1, 2]) for d in decoders]

    texts = asyncio.run(main())
    assert calls == ["GetTokenizerJson"] and parsed_on == [False]
    assert len(set(texts)) == 1 and "a" in texts[0] and "b" in texts[0]


def test_a_failed_fetch_is_tried_again_by_the_next_request() -> None:
    attempts = []

    async def call(method: str, request: Any, timeout: float) -> Any:
        attempts.append(method)
        if len(attempts) == 1:
            raise RuntimeError("tokenizer down")
        return SimpleNamespace(tokenizer_json=TOKENIZER_JSON)

    async def main() -> str:
        tokenizer = Tokenizer("127.0.0.1:1", "test")
        tokenizer._call = call  # type: ignore[method-assign]
        try:
            await tokenizer.decoder("m")
        except RuntimeError:
            pass
        return (await tokenizer.decoder("m"))([1])

    assert asyncio.run(main()) == "a" and len(attempts) == 2
