"""POST /v1/embeddings, in OpenAI's shape.

Each input goes through the mesh as a one-token request whose engine pools the prompt's final hidden states
(SamplingParams.pooling "model": the model's sentence-transformers pooling config where it has one, else the
mean of every prompt token), computed whole in the engine's steps beside its other work; the edge truncates
each vector to `dimensions` and scales it to length 1.  Strings are tokenized as a completion prompt is (the
tokenizer's special tokens added); token-id inputs go as they are.  Admission (in flight, tokens) as for a
completion: every input's prompt is charged.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from mesh.clients.router_client import Delta, GenerateSpec, Sampling
from mesh.clients.router_pool import Routers
from services.edge.config import EdgeConfig
from services.edge.errors import ApiError, from_grpc
from services.edge.gateway.pipeline import Pipeline
from services.edge.surfaces import responses
from services.edge.surfaces.fields import MAX_TOKEN_ID, integer, is_token_id, no_unknown, string
from services.edge.transports.asgi import Receive, Scope, Send, send_json, unless_gone

FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
MAX_INPUTS = 2048             # OpenAI's limit on inputs per request
MAX_DIMENSIONS = 1 << 16
PARALLEL = 32                 # one request's inputs in flight at once (the engines batch them)
SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    base64: bool = False              # encoding_format "base64": little-endian float32, base64-encoded
    dimensions: int | None = None     # truncate to this many (then normalize)


def _inputs(raw: Any) -> tuple[str | tuple[int, ...], ...]:
    if raw is None:
        raise ApiError(400, "you must provide an 'input' parameter", "input", code="missing_required_parameter")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(is_token_id(t) for t in raw)):
        raw = [raw]                                  # one string, or one list of token ids
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, f"'input' must be {SHAPES}", "input", code="invalid_type")
    if len(raw) > MAX_INPUTS:
        raise ApiError(400, f"'input' holds at most {MAX_INPUTS} inputs, got {len(raw)}", "input")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str) and item:
            out.append(item)
        elif isinstance(item, list) and item and all(is_token_id(t) for t in item):
            out.append(tuple(item))
        else:
            raise ApiError(400, f"'input[{i}]' must be a non-empty string or a non-empty list of token ids "
                           "(integers from 0)", f"input[{i}]")
    return tuple(out)


def parse_embeddings(body: dict[str, Any]) -> EmbeddingRequest:
    no_unknown(body, FIELDS)
    model = string(body, "model", required=True)
    string(body, "user")
    inputs = _inputs(body.get("input"))
    encoding = body.get("encoding_format")
    if encoding not in (None, "float", "base64"):
        raise ApiError(400, f"'encoding_format' must be \"float\" or \"base64\", got {str(encoding)[:40]!r}",
                       "encoding_format")
    return EmbeddingRequest(model, inputs, encoding == "base64", integer(body, "dimensions", 1, MAX_DIMENSIONS))


def shaped(vector: Sequence[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values (all without it), scaled to length 1 (a zero vector stays zero)."""
    if dimensions is not None and dimensions > len(vector):
        raise ApiError(400, f"'dimensions' {dimensions} is more than the model's {len(vector)}", "dimensions")
    kept = list(vector[:dimensions] if dimensions is not None else vector)
    norm = math.sqrt(math.fsum(v * v for v in kept))
    return [v / norm for v in kept] if norm > 0 else kept


def encoded(vector: list[float], as_base64: bool) -> list[float] | str:
    if not as_base64:
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class Embeddings:
    """The route's handler (app.py routes it; the caller is admitted by then)."""

    def __init__(self, config: EdgeConfig, router: Routers, pipe: Pipeline):
        self.config, self.router, self.pipe = config, router, pipe

    async def embeddings(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        body = await self.pipe.read_json(scope, receive, headers)
        request = parse_embeddings(body)
        caller = scope["infermesh.caller"]
        await self.pipe.screen(body, caller)        # once parsed: the rules read checked fields
        estimate = tuple(t if isinstance(t, str) else "    " * len(t) for t in request.inputs)   # ~4 bytes a token
        rid = responses.new_id(False)
        base = self.pipe.stamp(GenerateSpec(request.model, Sampling(temperature=0.0, max_tokens=1, pooling="model")),
                               caller, headers, rid)
        specs = [dataclasses.replace(base, request_id=f"{rid}-{i}", prompt=t if isinstance(t, str) else None,
                                     prompt_ids=None if isinstance(t, str) else t)
                 for i, t in enumerate(request.inputs)]
        with self.pipe.admitted(caller, GenerateSpec(request.model, Sampling(max_tokens=1), prompts=estimate),
                                places=min(len(estimate), PARALLEL)) as charge:     # _run's calls open at once
            finals = await unless_gone(self._run(specs), receive)
            if finals is None:
                return 499
            charge.started = True
            charge.used = sum(d.prompt_tokens + d.completion_tokens for d in finals)
            used = sum(d.prompt_tokens for d in finals)
            data = [{"object": "embedding", "index": i,
                     "embedding": encoded(shaped(d.embedding, request.dimensions), request.base64)}
                    for i, d in enumerate(finals)]
            model = next((d.served_by.model for d in finals if d.served_by), request.model)
            await send_json(send, 200, {"object": "list", "data": data, "model": model,
                                        "usage": {"prompt_tokens": used, "total_tokens": used}})
            return 200

    async def _run(self, specs: list[GenerateSpec]) -> list[Delta]:
        """Every input's final delta, in order (at most PARALLEL in flight); the first failure fails them all."""
        gate = asyncio.Semaphore(PARALLEL)

        async def one(spec: GenerateSpec) -> Delta:
            async with gate:
                final, served = None, None
                try:
                    async for delta in self.router.generate(spec, timeout=self.config.request_timeout_s):
                        served = delta.served_by or served
                        if delta.finish_reason is not None:
                            final = delta
                except grpc.aio.AioRpcError as err:
                    raise from_grpc(err) from None
                if final is None or not final.embedding:
                    raise ApiError(502, "the mesh ended an embedding without its vector", kind="server_error",
                                   code=None)
                return dataclasses.replace(final, served_by=final.served_by or served)

        tasks = [asyncio.ensure_future(one(s)) for s in specs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:              # one failed (or the client left): the others stop too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


def schemas() -> dict[str, Any]:
    """The OpenAPI schemas of the route's body and answer (services/edge/surfaces/openapi.py)."""
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}
    text = {"type": "string", "minLength": 1}
    request = {"type": "object", "additionalProperties": False, "required": ["model", "input"], "properties": {
        "model": {"type": "string", "description": "a served model (GET /v1/models)"},
        "input": {"anyOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS,
                                        "items": {"anyOf": [text, ids]}}], "description": SHAPES},
        "encoding_format": {"enum": ["float", "base64", None],
                            "description": "base64: little-endian float32 values, base64-encoded"},
        "dimensions": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_DIMENSIONS,
                       "description": "keep the first N values (then normalized); at most the model's"},
        "user": {"type": ["string", "null"]}}}
    item = {"type": "object", "required": ["object", "index", "embedding"], "properties": {
        "object": {"const": "embedding"}, "index": {"type": "integer"},
        "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}
    usage = {"type": "object", "required": ["prompt_tokens", "total_tokens"],
             "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}
    reply = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": item}, "model": {"type": "string"},
        "usage": usage}}
    return {"EmbeddingRequest": request, "EmbeddingResponse": reply}
