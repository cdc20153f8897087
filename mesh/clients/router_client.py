"""Clients of the mesh for users and for the services themselves.

`RouterClient` speaks gRPC to the router and yields plain dataclasses, so the edge and the
CLI never touch protobuf.  The HTTP/3 client lives in mesh/clients/http3.py.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

import grpc

from mesh.adapters import served_version
from mesh.chat import Message, to_pb
from mesh.clients.values import (
    Delta,
    GenerateSpec,
    LoraCard,
    ModelCard,
    ModelRouting,
    Sampling,
    ServedBy,
    TokenizeSpec,
    TokenLogprob,
    Tokens,
    TopLogprob,
    VersionLoaded,
)
from mesh.grpcutil import channel, check_health
from mesh.sampling_pb import to_pb as sampling_to_pb
from mesh.telemetry import outgoing_metadata
from meshpb.v1 import common_pb2, router_pb2, router_pb2_grpc

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def _to_pb(spec: GenerateSpec, resume_ids: Sequence[int] = ()) -> router_pb2.RouterGenerateRequest:
    sampling = sampling_to_pb(spec.sampling)
    req = router_pb2.RouterGenerateRequest(
        request_id=spec.request_id, model=spec.model, sampling=sampling, session_id=spec.session_id,
        history_from=spec.history_from, caller_stores_turn=spec.caller_stores_turn,
        pinned_replica=spec.pinned_replica, model_version=spec.model_version, tenant=spec.tenant,
        include_token_ids=True, resume_ids=list(resume_ids), cache_class=spec.cache_class, weight=spec.weight,
        priority=common_pb2.PRIORITY_BATCH if spec.priority == "batch" else common_pb2.PRIORITY_INTERACTIVE)
    if spec.prompt_ids is not None:
        req.prompt_ids.ids.extend(spec.prompt_ids)
    elif spec.prompt is not None:
        req.prompt = spec.prompt
    else:
        req.chat.tools = spec.tools
        req.chat.template_kwargs = spec.template_kwargs
        req.chat.messages.extend(
            to_pb(m) for m in spec.messages)
    return req


class RouterClient:
    def __init__(self, address: str = "127.0.0.1:50051"):
        self.address = address
        self.channel = channel(address)
        self._stub = router_pb2_grpc.RouterStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def healthy(self) -> bool:
        return await check_health(self.address)

    async def generate(self, spec: GenerateSpec, timeout: float | None = None,
                       extra_metadata: Sequence[tuple[str, str]] = (), resume_ids: Sequence[int] = ()
                       ) -> AsyncGenerator[Delta, None]:
        """Stream text deltas (with their token ids); raises grpc.aio.AioRpcError with the router's
        status on failure.  `resume_ids`: continue a stream after these tokens (mesh/clients/router_pool.py)."""
        call = self._stub.Generate(_to_pb(spec, resume_ids), timeout=timeout,
                                   metadata=outgoing_metadata(tuple(extra_metadata)))
        try:
            async for r in call:
                served = None
                if r.HasField("served_by"):
                    b = r.served_by
                    served = ServedBy(b.replica, b.model, b.model_version, b.region, b.degraded, b.confidence,
                                      b.confidence_source, b.degraded_by)
                yield Delta(
                    text=r.text,
                    finish_reason=FINISH_NAMES.get(r.finish_reason),
                    prompt_tokens=r.usage.prompt_tokens,
                    completion_tokens=r.usage.completion_tokens,
                    cached_tokens=r.usage.cached_tokens,
                    served_by=served,
                    ids=tuple(r.ids),
                    logprobs=_logprobs(r.logprobs),
                    prompt_logprobs=_logprobs(r.prompt_logprobs),
                    embedding=tuple(r.embedding),
                    reasoning=r.reasoning,
                )
        finally:
            call.cancel()

    async def state(self, timeout: float = 2.0) -> dict[str, Any]:
        """The router's view of the mesh, as plain JSON-ready values: readiness, the tokenizer, each engine."""
        r = await self._stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=timeout)
        return {"ready": r.ready, "tokenizer": "serving" if r.tokenizer_healthy else "down",
                "expected_engines": r.expected_engines, "load_entropy": round(r.load_entropy, 4),
                "engines": [{"replica": e.replica_id, "model": e.model, "model_version": e.model_version,
                             "region": e.region, "healthy": e.healthy, "breaker": e.breaker, "in_flight": e.in_flight,
                             "isolation": e.isolation, "running": e.load.running, "waiting": e.load.waiting,
                             "kv_used": round(1 - e.load.kv_blocks_free / e.load.kv_blocks_total, 4)
                             if e.load.kv_blocks_total else 0.0,
                             "tokens_per_s": round(e.load.tokens_per_second, 2), "weight": e.weight,
                             "tenants": [{"tenant": t.tenant, "running": t.running, "waiting": t.waiting,
                                          "tokens": t.tokens} for t in e.load.tenants],
                             "adapters": list(e.load.adapters)}
                            for e in r.replicas],
                "ttft_p50_ms": round(r.ttft_p50_ms, 1), "ttft_p95_ms": round(r.ttft_p95_ms, 1),
                "events": [{"unix_ms": e.unix_ms, "kind": e.kind, "model": e.model, "replica": e.replica,
                            "detail": e.detail} for e in r.events]}

    async def models(self, timeout: float = 5.0) -> list[ModelCard]:
        """The served models, then the LoRA adapters (`parent`: the base model; versions: served_version's)."""
        reply = await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=timeout)
        cards = [ModelCard(m.name, m.version, m.replicas, m.max_context, tuple(m.versions)) for m in reply.models]
        bases = {c.name: c for c in cards}
        for a in reply.adapters:
            base = bases.get(a.model)
            if base is not None:
                cards.append(ModelCard(a.name, served_version(base.version, a.path), len(a.replicas), base.max_context,
                                       tuple(served_version(v, a.path) for v in base.versions), parent=a.model))
        return cards

    async def lora_adapters(self, timeout: float = 5.0, key: str = "") -> list[LoraCard]:
        """`key`: an API key, when the router asks a native caller for one."""
        return _lora_cards(await self._stub.ListLoraAdapters(router_pb2.ListLoraAdaptersRequest(), timeout=timeout,
                                                             metadata=_bearer(key)))

    async def load_lora_adapter(self, name: str, path: str, model: str = "", replica: str = "",
                                timeout: float = 300.0, key: str = "") -> list[LoraCard]:
        """Load a PEFT folder or GGUF LoRA file as `name` on a replica of `model` (router LoadLoraAdapter); every
        adapter after.  `key`: an admin key, when the router has them and the caller is not the edge."""
        return _lora_cards(await self._stub.LoadLoraAdapter(router_pb2.LoadLoraAdapterRequest(
            name=name, path=path, model=model, replica=replica), timeout=timeout, metadata=_bearer(key)))

    async def unload_lora_adapter(self, name: str, timeout: float = 300.0, key: str = "") -> list[LoraCard]:
        return _lora_cards(await self._stub.UnloadLoraAdapter(router_pb2.UnloadLoraAdapterRequest(name=name),
                                                              timeout=timeout, metadata=_bearer(key)))

    async def tokenize(self, spec: TokenizeSpec, timeout: float = 30.0) -> Tokens:
        request = router_pb2.TokenizeRequest(model=spec.model, add_special_tokens=spec.add_special_tokens,
                                             add_generation_prompt=spec.add_generation_prompt,
                                             return_token_strs=spec.return_token_strs)
        if spec.messages is not None:
            request.chat.CopyFrom(router_pb2.ChatInput(messages=[to_pb(m) for m in spec.messages], tools=spec.tools))
        else:
            request.prompt = spec.prompt or ""
        r = await self._stub.Tokenize(request, timeout=timeout, metadata=outgoing_metadata())
        return Tokens(r.model, tuple(r.ids), r.max_context, tuple(r.token_strs) if spec.return_token_strs else None)

    async def detokenize(self, model: str, ids: Sequence[int], timeout: float = 30.0) -> str:
        r = await self._stub.Detokenize(router_pb2.DetokenizeRequest(model=model, ids=ids), timeout=timeout,
                                        metadata=outgoing_metadata())
        return str(r.text)

    async def store_turn(self, spec: GenerateSpec, answer: Message, timeout: float = 10.0) -> None:
        """Store the turn of `spec` (a Generate with caller_stores_turn) with `answer`, as the caller gave it out."""
        await self._stub.StoreTurn(router_pb2.StoreTurnRequest(
            tenant=spec.tenant, session_id=spec.session_id, history_from=spec.history_from,
            messages=[to_pb(m) for m in spec.messages], answer=to_pb(answer)), timeout=timeout,
            metadata=outgoing_metadata())

    async def forget_conversation(self, session_id: str, tenant: str = "", timeout: float = 10.0) -> bool:
        """Delete a stored conversation (a session, a stored response) of `tenant` (the edge's) or the caller's."""
        r = await self._stub.ForgetConversation(router_pb2.ForgetConversationRequest(
            session_id=session_id, tenant=tenant), timeout=timeout, metadata=outgoing_metadata())
        return bool(r.found)

    async def model_routing(self, model: str, timeout: float = 5.0) -> ModelRouting:
        return _routing(await self._stub.GetModelRouting(router_pb2.ModelRoutingRequest(model=model), timeout=timeout))

    async def load_model_version(self, model: str, version: str, source: str, activate: bool = True,
                                 timeout: float = 1800.0) -> VersionLoaded:
        """Hot swap `version` (weights from `source`) onto every replica of `model` (router LoadModelVersion)."""
        r = await self._stub.LoadModelVersion(router_pb2.LoadModelVersionRequest(
            model=model, version=version, source=source, activate=activate), timeout=timeout)
        return VersionLoaded(tuple({"replica": x.replica_id, "active_version": x.active_version,
                                    "loaded_versions": list(x.loaded_versions),
                                    "load_seconds": round(x.load_seconds, 2)} for x in r.replicas),
                             _routing(r.routing))

    async def drain_replica(self, replica_id: str, timeout: float = 1800.0) -> int:
        """Drain an engine replica (router DrainReplica); returns the calls it finished."""
        reply = await self._stub.DrainReplica(router_pb2.DrainReplicaRequest(replica_id=replica_id), timeout=timeout)
        return int(reply.finished)

    async def add_replica(self, replica_id: str, address: str, region: str = "", timeout: float = 10.0) -> None:
        await self._stub.AddReplica(router_pb2.AddReplicaRequest(replica_id=replica_id, address=address,
                                                                 region=region), timeout=timeout)

    async def set_model_routing(self, model: str, default_version: str = "", canary: dict[str, float] | None = None,
                                timeout: float = 5.0, shadow: tuple[str, float] | None = None) -> ModelRouting:
        """Switch the default version and/or replace the canary shares and/or the shadow rule
        ((version, share); ("", 0) ends it; None keeps them)."""
        request = router_pb2.SetModelRoutingRequest(model=model, default_version=default_version,
                                                    canary=canary or {}, replace_canary=canary is not None,
                                                    shadow_version=shadow[0] if shadow else "",
                                                    shadow_share=shadow[1] if shadow else 0.0,
                                                    replace_shadow=shadow is not None)
        return _routing(await self._stub.SetModelRouting(request, timeout=timeout))


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


def _lora_cards(reply: router_pb2.LoraAdaptersResponse) -> list[LoraCard]:
    return [LoraCard(a.name, a.model, a.path, tuple(a.replicas)) for a in reply.adapters]


def _logprobs(entries: Sequence[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token_id, lp.token, lp.logprob,
                              tuple(TopLogprob(t.token_id, t.token, t.logprob) for t in lp.top)) for lp in entries)


def _routing(r: router_pb2.ModelRouting) -> ModelRouting:
    shadow = None
    if r.shadow_version:
        s = r.shadow
        shadow = {"version": r.shadow_version, "share": round(r.shadow_share, 6), "mirrored": s.mirrored,
                  "matched": s.matched, "diverged": s.diverged, "failed": s.failed,
                  "mean_first_divergence": round(s.mean_first_divergence, 2),
                  "served_p50_ms": round(s.served_p50_ms, 1), "shadow_p50_ms": round(s.shadow_p50_ms, 1)}
    return ModelRouting(r.model, r.default_version, dict(r.canary), tuple(r.versions), shadow)


__all__ = ["Delta", "GenerateSpec", "LoraCard", "Message", "ModelCard", "ModelRouting", "RouterClient", "Sampling",
           "ServedBy", "TokenizeSpec", "Tokens", "TokenLogprob", "TopLogprob", "VersionLoaded", "grpc"]
