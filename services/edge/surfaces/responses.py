"""OpenAI response shapes: a completion, its stream chunks, usage and logprobs.  Pure: deltas in, JSON out.

Every completion (the last chunk when streaming) carries an `infermesh` object: which replica,
model version and region served it, whether it was degraded, and a confidence.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mesh.clients.router_client import Delta, ServedBy, TokenLogprob


@dataclass(frozen=True)
class StreamHead:
    """What every chunk of one stream repeats: chat or completions, the response id, the model."""
    chat: bool
    rid: str
    model: str


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def _meta(served: ServedBy | None) -> dict[str, object] | None:
    return served.as_dict() if served else None


def _lp(value: float) -> float:
    # JSON has no -Infinity; OpenAI reports impossible tokens as -9999.0.
    return value if math.isfinite(value) else -9999.0


class LogprobFormatter:
    """OpenAI's `logprobs` object for one choice, delta by delta.

    chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
    "refusal": null}.  completions: {"tokens", "token_logprobs", "top_logprobs" (one dict per token: the
    top alternatives and the chosen token), "text_offset"}; offsets count characters from the start of
    the prompt, as OpenAI's do, and run on across a stream's chunks.  A token's text is its own
    decoding, so a token that is part of a multi-byte character shows as U+FFFD."""

    def __init__(self, chat: bool, prompt_chars: int = 0):
        self.chat = chat
        self.offset = prompt_chars

    def format(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return {"content": [{"token": e.token, "logprob": _lp(e.logprob), "bytes": list(e.token.encode()),
                                 "top_logprobs": [{"token": t.token, "logprob": _lp(t.logprob),
                                                   "bytes": list(t.token.encode())} for t in e.top]}
                                for e in entries], "refusal": None}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e.token)
            if math.isnan(e.logprob):        # an echoed prompt's first token: nothing before it to predict it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                top = {t.token: _lp(t.logprob) for t in e.top}
                top.setdefault(e.token, _lp(e.logprob))
                out["token_logprobs"].append(_lp(e.logprob))
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


def whole_body(chat: bool, rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any],
               meta: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use, "infermesh": meta}


def chunk_body(head: StreamHead, text: str, finish: str | None = None, final: Delta | None = None,
               logprobs: dict[str, Any] | None = None, index: int = 0, delta: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """One streamed chunk of choice `index`; chat: `delta` (services/edge/surfaces/choices.py) or one made of `text`."""
    chat = head.chat
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
    if chat:
        choice["delta"] = delta if delta is not None else {"content": text} if text or finish is None else {}
    else:
        choice["text"] = text
    body: dict[str, Any] = {"id": head.rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": int(time.time()), "model": head.model, "choices": [choice]}
    if final is not None:
        body["infermesh"] = _meta(final.served_by)
    return body


def usage_chunk(head: StreamHead, use: dict[str, Any], meta: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": head.rid, "object": "chat.completion.chunk" if head.chat else "text_completion",
            "created": int(time.time()), "model": head.model, "choices": [], "usage": use, "infermesh": meta}


def replay_chunks(chat: bool, body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A whole answer (a cached one) as the chunks of a stream: each choice's text (or tool calls) in one
    chunk, then its finish; the usage chunk when asked for."""
    head = {"id": body["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": body["created"], "model": body["model"]}
    out: list[dict[str, Any]] = []
    for c in body["choices"]:
        if chat:
            message = c.get("message") or {}
            delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            first: dict[str, Any] = {"index": c["index"], "delta": delta, "logprobs": c.get("logprobs"),
                                     "finish_reason": None}
            last: dict[str, Any] = {"index": c["index"], "delta": {}, "logprobs": None,
                                    "finish_reason": c["finish_reason"]}
        else:
            first = {"index": c["index"], "text": c.get("text", ""), "logprobs": c.get("logprobs"),
                     "finish_reason": None}
            last = {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
        out.append({**head, "choices": [first]})
        out.append({**head, "choices": [last], "infermesh": body.get("infermesh")})
    if include_usage:
        out.append({**head, "choices": [], "usage": body.get("usage"), "infermesh": body.get("infermesh")})
    return out
