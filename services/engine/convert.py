"""Engine protobuf <-> engine types: sampling parameters in, step outputs out."""

from __future__ import annotations

from collections.abc import Mapping

from mesh.errors import InvalidArgument
from mesh.models.folder import SAMPLING_DEFAULTS
from meshpb.v1 import common_pb2, engine_pb2
from services.engine.grammar import constraint_from_pb
from services.engine.request import EngineTokenLogprob, FinishReason, SamplingParams, StepOutput

FINISH = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_pb(s: common_pb2.SamplingParams, defaults: Mapping[str, float] | None = None) -> SamplingParams:
    """The engine's SamplingParams; the fields named in s.model_defaults take the model's generation_config
    value (`defaults`) where it has one."""
    unknown = sorted(set(s.model_defaults) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise InvalidArgument(f"model_defaults names {', '.join(unknown)}; only {', '.join(SAMPLING_DEFAULTS)} "
                              "may take the model's defaults")
    given = {"temperature": s.temperature, "top_p": s.top_p, "top_k": float(s.top_k)}
    for name in s.model_defaults:
        if defaults and name in defaults:
            given[name] = defaults[name]
    top_p = given["top_p"]
    return SamplingParams(
        temperature=given["temperature"],
        top_p=top_p if top_p > 0 else 1.0,
        top_k=int(given["top_k"]),
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=s.max_tokens,
        ignore_eos=s.ignore_eos,
        stop_token_ids=tuple(s.stop_token_ids),
        logprobs=s.logprobs or s.top_logprobs > 0,
        top_logprobs=s.top_logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        min_p=s.min_p,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        min_tokens=s.min_tokens,
        constraint=constraint_from_pb(s.constraint) if s.HasField("constraint") else None,
        prompt_logprobs=s.prompt_logprobs,
        pooling=s.pooling,
    )


def output_to_pb(out: StepOutput) -> engine_pb2.GenerateResponse:
    def entries(logprobs: tuple[EngineTokenLogprob, ...]) -> list[common_pb2.TokenLogprob]:
        return [common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=[
            common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]) for lp in logprobs]
    reply = engine_pb2.GenerateResponse(ids=out.new_ids, logprobs=entries(out.logprobs),
                                        prompt_logprobs=entries(out.prompt_logprobs), embedding=out.embedding)
    if out.finish_reason is not None:
        reply.finish_reason = FINISH[out.finish_reason]
        reply.usage.prompt_tokens = out.prompt_tokens
        reply.usage.completion_tokens = out.completion_tokens
        reply.usage.cached_tokens = out.cached_tokens
    return reply
