"""Engine protobuf <-> engine types: sampling parameters in, step outputs out."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from mesh.errors import InvalidArgument
from mesh.models.folder import SAMPLING_DEFAULTS
from mesh.sampling_pb import from_pb
from meshpb.v1 import common_pb2, engine_pb2
from services.engine.core.request import EngineTokenLogprob, FinishReason, SamplingParams, StepOutput

FINISH = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_pb(s: common_pb2.SamplingParams, defaults: Mapping[str, float] | None = None) -> SamplingParams:
    """The engine's SamplingParams (mesh/sampling_pb.py); the fields named in s.model_defaults take the model's
    generation_config value (`defaults`) where it has one."""
    unknown = sorted(set(s.model_defaults) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise InvalidArgument(f"model_defaults names {', '.join(unknown)}; only {', '.join(SAMPLING_DEFAULTS)} "
                              "may take the model's defaults")
    params = from_pb(s, SamplingParams)
    given = {name: type(getattr(params, name))(defaults[name]) for name in s.model_defaults
             if defaults and name in defaults}
    if given.get("top_p") == 0:
        given["top_p"] = 1.0                  # 0 is off, as in the message
    if s.top_logprobs and not s.logprobs:
        given["logprobs"] = True
    return dataclasses.replace(params, **given) if given else params


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
