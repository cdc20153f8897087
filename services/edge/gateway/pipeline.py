"""One request's life at the edge, the same for every surface: chat and completions (completions.py), Responses
(responses_api.py), batch lines (they enter those routes: batch_lines.py), embeddings and /tokenize.

    authenticate, rate, signature     app.py, before any route (every method: EdgeApp._signed)
    parse                             the surface (requests.py, responses_input.py, embeddings.py, ...)
    screen   the input rules over every field that reaches the model, folded, and the classifier (model_inputs.py)
    stamp    the caller onto the request: tenant, class, weight, KV-cache class, pinned version, request id
    admitted places in flight, one a router call, fairly shared between tenants; the token budget, the stored
             conversation's tokens included; settled to the usage when the request ends
    answers  each choice with its output guards over every channel of model text: content, reasoning, tool calls,
             logprobs and their alternatives (choices.Choice)
    guarded  the router's deltas through those guards; a choice the rules block has its call stopped there
    store    a turn as it went out (choices.store_turn), never the engine's raw text; the response cache keeps
             only answers no rule cut (completions.py)

Surfaces differ in how they parse and how they render, not in which of these they pass
(tests/security/test_pipeline_matrix.py runs every surface against every policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from mesh.clients.router_client import Delta, GenerateSpec
from mesh.clients.router_pool import Routers
from services.edge.config import EdgeConfig
from services.edge.errors import ApiError
from services.edge.gateway.admission import Admission, Charge
from services.edge.gateway.classifier import Classifier
from services.edge.gateway.safety import ContentPolicy, PolicySource
from services.edge.gateway.tenants import AuthenticatedCaller
from services.edge.metrics import TENANT_TOKENS
from services.edge.surfaces import choices, model_inputs
from services.edge.surfaces.choices import Choice, Piece, fan_out
from services.edge.surfaces.fields import parse_json
from services.edge.transports.asgi import Receive, Scope, read_body

Deltas = AsyncGenerator[tuple[int, Delta], None]         # choices.fan_out's
Guarded = AsyncGenerator[tuple[int, Delta, list[Piece]], None]


class Pipeline:
    """What every surface's handler calls, in this order (the module's docstring)."""

    def __init__(self, config: EdgeConfig, router: Routers, admission: Admission):
        self.config, self.router, self.admission = config, router, admission
        self.safety = PolicySource(config.content_policy)
        self.classifier = Classifier(config.content_classifier) if config.content_classifier else None

    async def close(self) -> None:
        if self.classifier is not None:
            await self.classifier.close()

    async def read_json(self, scope: Scope, receive: Receive, headers: dict[str, str]) -> dict[str, Any]:
        """The body as JSON (its signature, for a key that must sign, was checked by the app: EdgeApp._signed)."""
        return parse_json(await read_body(receive, headers, self.config.max_body_bytes, self.config.body_timeout_s))

    async def screen(self, body: dict[str, Any], caller: AuthenticatedCaller) -> ContentPolicy:
        """The policy in force, once its input rules and the classifier pass every text of `body` that reaches
        the model (400 `content_filter` naming the category and the field).  `body` is one the surface parsed
        already (model_inputs reads its fields as the parser checked them)."""
        policy = self.safety.current()
        texts = model_inputs.texts(body)
        found = policy.blocked_input(texts)
        if found is None and self.classifier is not None:
            category = await self.classifier.check_input([t for _, t in texts], caller.label)
            found = (category, "messages" if "messages" in body else "prompt") if category else None
        if found is not None:
            raise ApiError(400, f"the request was refused by the content policy (category: {found[0]})",
                           found[1], code="content_filter")
        return policy

    @staticmethod
    def stamp(spec: GenerateSpec, caller: AuthenticatedCaller, headers: dict[str, str], request_id: str,
              **fields: Any) -> GenerateSpec:
        """The request as the router gets it: the caller's tenant, scheduling class and weight, KV-cache class,
        the version the headers pin, its id; `fields` set the surface's own (sessions, ...)."""
        return dataclasses.replace(spec, request_id=request_id, tenant=caller.tenant, priority=caller.tier.priority,
                                   cache_class=caller.tier.cache_class, weight=caller.tier.weight,
                                   model_version=headers.get("x-infermesh-model-version", "").strip(), **fields)

    @contextlib.contextmanager
    def admitted(self, caller: AuthenticatedCaller, spec: GenerateSpec, places: int = 0) -> Any:
        """Its places in flight and its tokens while the block runs (429, 503 before it), then settled to the
        usage the block set on the charge (`charge.used`), and counted for the tenant."""
        charge: Charge = self.admission.enter(caller, spec, places)
        try:
            yield charge
        finally:
            self.admission.leave(charge)
            if charge.used:
                TENANT_TOKENS.labels(caller.label, caller.tier.name).inc(charge.used)

    def answers(self, chat: bool, spec: GenerateSpec, policy: ContentPolicy) -> tuple[list[Choice], Deltas]:
        """Each choice's answer under `policy`'s output rules (a router call each: its `stop_call` ends that call
        alone), and their deltas as they come."""
        calls = choices.specs(spec)
        running: dict[int, asyncio.Task[None]] = {}
        answers = [Choice(i, chat, spec, call.prompt or "", policy) for i, call in enumerate(calls)]
        for i, answer in enumerate(answers):
            answer.stop_call = functools.partial(choices.stop, running, i)
        return answers, fan_out(self.router, calls, spec.n, self.config.request_timeout_s, running)


async def guarded(deltas: Deltas, answers: Sequence[Choice], charge: Charge) -> Guarded:
    """(choice index, delta, what it adds for the client) for each delta, through the choice's guards
    (Choice.add); a choice the output rules block has its router call stopped at once (its engine generates no
    more), and deltas of a choice whose last chunk is out (`cut`) are dropped.  Closing this closes `deltas`."""
    try:
        async for index, d in deltas:
            charge.started = True
            answer = answers[index]
            if answer.cut:
                continue
            pieces = answer.add(d)
            if answer.blocked:
                answer.stop_call()
            yield index, d, pieces
    finally:
        await deltas.aclose()


async def drain(items: AsyncIterator[Any]) -> None:
    async for _ in items:
        pass
