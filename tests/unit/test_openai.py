import asyncio
import dataclasses
import json

import pytest

from mesh.apikeys import digest
from mesh.clients.router_client import Delta, ServedBy, TokenLogprob, TopLogprob
from mesh.ratelimit import Rate
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from services.edge.errors import ApiError
from services.edge.surfaces import choices, requests, responses
from services.edge.surfaces.fields import parse_json
from services.edge.surfaces.openapi import document
from tests.fakes.edge_router import CHAT, CHAT_JSON, FakeRouter, asgi, edge_app


def test_chat_defaults_follow_openai() -> None:
    spec = requests.parse_chat(CHAT)
    assert spec.sampling.temperature == 1.0 and spec.sampling.top_p == 1.0
    assert spec.sampling.max_tokens == 0 and spec.messages[0].content == "hi"


def test_penalties_bias_and_the_vllm_extensions_are_carried() -> None:
    body = {**CHAT, "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.3, "min_p": 0.05,
            "logit_bias": {"42": -100, "7": 3.5}, "min_tokens": 2, "max_tokens": 8}
    s = requests.parse_chat(body).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -0.25, 1.3, 0.05)
    assert s.logit_bias == ((7, 3.5), (42, -100.0)) and s.min_tokens == 2
    assert requests.parse_chat({**CHAT, "stop_token_ids": [13, 2]}).sampling.stop_token_ids == (13, 2)
    from mesh.clients.router_client import _to_pb  # what the router is sent, field by field
    pb = _to_pb(requests.parse_chat({**body, "stop_token_ids": [13]})).sampling
    assert (pb.presence_penalty, pb.frequency_penalty, pb.min_tokens, list(pb.stop_token_ids)) == (0.5, -0.25, 2, [13])
    assert dict(pb.logit_bias) == {7: 3.5, 42: -100.0} and abs(pb.repetition_penalty - 1.3) < 1e-6


def test_fields_left_out_take_the_models_defaults() -> None:
    """Left out or null, temperature / top_p / top_k are marked for the model's generation_config values
    (the engine applies them where the model has one; else OpenAI's defaults above stand)."""
    assert requests.parse_chat(CHAT).sampling.model_defaults == ("temperature", "top_p", "top_k")
    spec = requests.parse_chat({**CHAT, "temperature": 0.5, "top_p": None})
    assert spec.sampling.model_defaults == ("top_p", "top_k") and spec.sampling.temperature == 0.5
    assert requests.parse_completion({"model": "m", "prompt": "x", "temperature": 0, "top_p": 1, "top_k": 3}
                                   ).sampling.model_defaults == ()


def test_chat_fields_are_carried() -> None:
    body = {**CHAT, "temperature": 0, "max_completion_tokens": 7, "stop": "x", "seed": 5, "user": "u1",
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}]}
    spec = requests.parse_chat(body, pinned="engine-1")
    assert spec.sampling.max_tokens == 7 and spec.sampling.stop == ("x",) and spec.sampling.seed == 5
    assert spec.messages[0].role == "system" and spec.messages[0].content == "ab"
    assert spec.session_id == "u1" and spec.pinned_replica == "engine-1"


def test_header_session_wins_over_user() -> None:
    assert requests.parse_chat({**CHAT, "user": "u1"}, session_id="h").session_id == "h"


@pytest.mark.parametrize("patch,param", [
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"n": 2, "user": "u1"}, "n"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
    ({"grammar": ""}, "grammar"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": 0.0}]}, "messages[0].tool_calls"),   # falsy, not a list
    ({"messages": [{"role": "assistant", "tool_calls": ""}]}, "messages[0].tool_calls"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"bogus": 1}, "bogus"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
])
def test_bad_chat_requests_name_the_field(patch: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as err:
        requests.parse_chat({**CHAT, **patch})
    assert err.value.status == 400 and err.value.param == param


def test_stream_options_need_stream() -> None:
    assert requests.stream_options({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    with pytest.raises(ApiError):
        requests.stream_options({"stream_options": {"include_usage": True}})


def test_completion_prompt() -> None:
    spec = requests.parse_completion({"model": "m", "prompt": ["once upon"], "max_tokens": 3})
    assert spec.prompt == "once upon" and spec.sampling.max_tokens == 3
    spec = requests.parse_completion({"model": "m", "prompt": ["a", "b"], "n": 2, "echo": True})
    assert spec.prompts == ("a", "b") and spec.n == 2 and spec.echo
    for patch, field in [({"prompt": []}, "prompt"), ({"prompt": ["a", ""]}, "prompt"), ({"prompt": [1, 2]}, "prompt"),
                         ({"prompt": ["a"] * 33}, "prompt"), ({"n": 17}, "n"), ({"n": 2, "user": "u"}, "n"),
                         ({"max_tokens": 0}, "max_tokens"), ({"prompt": ["a", "b"], "user": "u"}, "prompt")]:
        with pytest.raises(ApiError) as err:
            requests.parse_completion({"model": "m", "prompt": "x", **patch})
        assert err.value.param == field, patch


def test_structured_outputs_and_tools_parse() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = requests.parse_chat({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}}).sampling.constraint
    assert c is not None and c.kind == "json_schema" and json.loads(c.text) == schema
    assert requests.parse_chat({**CHAT, "response_format": {"type": "text"}}).sampling.constraint is None
    regex = requests.parse_completion({"model": "m", "prompt": "x", "regex": "[0-9]+"}).sampling.constraint
    assert regex is not None and regex.kind == "regex"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}},
             {"type": "function", "function": {"name": "noop"}}]
    auto = requests.parse_chat({**CHAT, "tools": tools})
    assert auto.tool_calls == "parallel" and auto.sampling.constraint is not None
    assert auto.sampling.constraint.kind == "tool_calls" and "get_weather" in auto.tools
    both = requests.parse_chat({**CHAT, "tools": tools, "response_format": {"type": "json_object"}})
    assert both.sampling.constraint is not None and both.sampling.constraint.kind == "json_object"
    required = requests.parse_chat({**CHAT, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert required.tool_calls == "single" and required.sampling.constraint is not None
    assert required.sampling.constraint.prefix == "<tool_call>\n"
    named = requests.parse_chat({**CHAT, "tools": tools, "tool_choice": {"type": "function",
                                                                       "function": {"name": "noop"}}})
    assert named.sampling.constraint is not None and '"const": "noop"' in named.sampling.constraint.text
    assert "get_weather" not in named.sampling.constraint.text
    none = requests.parse_chat({**CHAT, "tools": tools, "tool_choice": "none"})
    assert none.tools == "" and none.tool_calls == "" and none.sampling.constraint is None
    history = requests.parse_chat({**CHAT, "tools": tools, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assert json.loads(history.messages[1].tool_calls)[0]["function"]["name"] == "get_weather"
    assert history.messages[2].role == "tool" and history.messages[2].tool_call_id == "call_1"


def test_choices_fan_out_with_seeds_and_ids() -> None:
    spec = dataclasses.replace(requests.parse_completion({"model": "m", "prompt": ["a", "b"], "n": 3, "seed": 7}),
                               request_id="cmpl-1")
    calls = choices.specs(spec)
    assert [c.prompt for c in calls] == ["a"] * 3 + ["b"] * 3
    assert [c.sampling.seed for c in calls] == [7, 8, 9, 7, 8, 9]
    assert [c.request_id for c in calls] == ["cmpl-1"] + [f"cmpl-1-{i}" for i in range(1, 6)]
    assert all(c.n == 1 and not c.prompts for c in calls)


def test_response_shapes_carry_infermesh_metadata() -> None:
    final = Delta("", "stop", 5, 2, served_by=ServedBy("engine-0", "m", "1", "local", False, 1.0))
    answer = choices.Choice(0, True, requests.parse_chat(CHAT), "")
    answer.add(Delta("hi"))
    answer.add(final)
    body = responses.whole_body(True, "chatcmpl-1", "m", [answer.body()], choices.usage([answer], 1),
                                choices.meta([answer]))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["infermesh"] == {"replica": "engine-0", "model_version": "1", "region": "local",
                                 "degraded": False, "confidence": 1.0}
    chunk = responses.chunk_body(responses.StreamHead(True, "chatcmpl-1", "m"), "", "stop", final=final)
    assert chunk["choices"][0]["delta"] == {} and chunk["infermesh"]["replica"] == "engine-0"


def test_model_routing_body_is_checked() -> None:
    assert requests.parse_model_routing({"default_version": "2"}) == ("2", None, None)
    assert requests.parse_model_routing({"canary": {"3": 0.25}}) == ("", {"3": 0.25}, None)
    assert requests.parse_model_routing({"default_version": "2", "canary": {}}) == ("2", {}, None)
    assert requests.parse_model_routing({"shadow": {"version": "2", "share": 0.5}}) == ("", None, ("2", 0.5))
    assert requests.parse_model_routing({"shadow": None}) == ("", None, ("", 0.0))      # ends shadowing
    for body, match in [({}, "default_version, canary and/or shadow"), ({"canary": [1]}, "object of version"),
                        ({"canary": {"2": 2}}, r"in \[0, 1\]"), ({"canary": {"2": True}}, r"in \[0, 1\]"),
                        ({"weights": {}}, "unrecognized field"), ({"shadow": {"version": "2", "share": 0}}, "shadow"),
                        ({"shadow": {"version": "2", "share": 1, "x": 1}}, "shadow"), ({"shadow": 3}, "shadow")]:
        with pytest.raises(ApiError, match=match):
            requests.parse_model_routing(body)


# -- logprobs, limits and hostile input -------------------------------------------------
def test_chat_logprobs_are_carried() -> None:
    spec = requests.parse_chat({**CHAT, "logprobs": True, "top_logprobs": 20})
    assert spec.sampling.logprobs and spec.sampling.top_logprobs == 20
    assert not requests.parse_chat(CHAT).sampling.logprobs
    assert requests.parse_chat({**CHAT, "logprobs": True}).sampling.top_logprobs == 0


def test_completion_logprobs_is_top_n() -> None:
    spec = requests.parse_completion({"model": "m", "prompt": "a", "logprobs": 5})
    assert spec.sampling.logprobs and spec.sampling.top_logprobs == 5
    spec = requests.parse_completion({"model": "m", "prompt": "a", "logprobs": 0})
    assert spec.sampling.logprobs and spec.sampling.top_logprobs == 0


@pytest.mark.parametrize("patch,param,code", [
    ({"logprobs": 1}, "logprobs", "invalid_type"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "invalid_value"),
    ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs", "invalid_type"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "name", "invalid_type"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages[0].tool_call_id",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "weight": 1}]}, "messages[0].weight", "unknown_parameter"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
     "messages[0].content", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}] * 1001}, "messages", "invalid_value"),
    ({"stop": "x" * 257}, "stop", "invalid_value"),
    ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x", "unknown_parameter"),
    ({"frequency_penalty": "0"}, "frequency_penalty", "invalid_type"),
    ({"frequency_penalty": False}, "frequency_penalty", "invalid_type"),
    ({"seed": 1 << 64}, "seed", "invalid_value"),
    ({"model": "m" * 257}, "model", "invalid_value"),
])
def test_bad_fields_get_precise_errors(patch: dict[str, object], param: str, code: str) -> None:
    with pytest.raises(ApiError) as err:
        body = {**CHAT, **patch}
        requests.parse_chat(body)
        requests.stream_options(body)
    assert (err.value.status, err.value.param, err.value.code) == (400, param, code)


def test_echoed_assistant_messages_and_negative_seeds_are_accepted() -> None:
    echoed = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": [], "audio": None,
              "function_call": None, "annotations": []}
    spec = requests.parse_chat({**CHAT, "messages": [*CHAT["messages"], echoed], "seed": -1,  # type: ignore[list-item]
                              "frequency_penalty": 0.0, "logit_bias": {}})
    assert spec.messages[1].content == "hi"
    assert spec.sampling.seed == (1 << 64) - 1      # the engine's seed is uint64
    assert requests.parse_chat(CHAT, max_messages=1).messages[0].role == "user"


@pytest.mark.parametrize("patch", [{"echo": 0}, {"suffix": "x"}, {"best_of": 2},
                                   {"best_of": True}, {"logprobs": 6}, {"logprobs": True}, {"top_logprobs": 1}])
def test_bad_completion_fields(patch: dict[str, object]) -> None:
    with pytest.raises(ApiError) as err:
        requests.parse_completion({"model": "m", "prompt": "a", **patch})
    assert err.value.status == 400 and err.value.param == next(iter(patch))


def _lp(token: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(0, token, logprob, tuple(TopLogprob(i, t, lp) for i, (t, lp) in enumerate(top)))


def test_chat_logprobs_shape() -> None:
    fmt = responses.LogprobFormatter(chat=True)
    out = fmt.format([_lp("Hé", -0.5, ("Hé", -0.5), ("Hi", -1.5)), _lp("!", float("-inf"))])
    assert out == {"refusal": None, "content": [
        {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169],
         "top_logprobs": [{"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
                          {"token": "Hi", "logprob": -1.5, "bytes": [72, 105]}]},
        {"token": "!", "logprob": -9999.0, "bytes": [33], "top_logprobs": []}]}


def test_completion_logprobs_shape_and_offsets_run_across_chunks() -> None:
    fmt = responses.LogprobFormatter(chat=False, prompt_chars=5)
    first = fmt.format([_lp(" Paris", -0.1, (" Paris", -0.1), (" Lyon", -3.0))])
    second = fmt.format([_lp(".", -0.7, (",", -0.2))])
    assert first == {"tokens": [" Paris"], "token_logprobs": [-0.1], "text_offset": [5],
                     "top_logprobs": [{" Paris": -0.1, " Lyon": -3.0}]}
    # The chosen token is always in its top_logprobs dict (up to N + 1 entries, as in OpenAI).
    assert second == {"tokens": ["."], "token_logprobs": [-0.7], "text_offset": [11],
                      "top_logprobs": [{",": -0.2, ".": -0.7}]}


@pytest.mark.parametrize("raw,match", [
    (b'{"model": "m\xff"}', "not valid UTF-8"),
    (b'{"model": "m"', "not valid JSON"),
    (b'{"temperature": NaN}', "not valid JSON"),
    (b'{"seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'["a"]', "must be a JSON object"),
    (b'{"model": "\\ud800"}', "surrogate"),
])
def test_hostile_bodies_get_400(raw: bytes, match: str) -> None:
    with pytest.raises(ApiError, match=match) as err:
        parse_json(raw)
    assert err.value.status == 400


def test_paired_surrogate_escapes_are_fine() -> None:
    assert parse_json(b'{"model": "\\ud83d\\ude00"}') == {"model": "\U0001f600"}


# -- the ASGI app, with a fake router ---------------------------------------------------------
KEY = {"authorization": "Bearer k1"}


def test_keys_rates_and_limits_answer_before_the_router() -> None:
    async def main() -> None:
        router = FakeRouter()
        app = edge_app(router, api_key_digests=(digest("k1"),), rate_limit=Rate(2, 1), max_body_bytes=1024,
                      body_timeout_s=0.05)
        status, _, body = await asgi(app, "POST", "/v1/chat/completions", CHAT_JSON)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _, _ = await asgi(app, "POST", "/v1/chat/completions", CHAT_JSON,
                                  {"authorization": "Bearer nope"})
        assert status == 401
        status, headers, body = await asgi(app, "POST", "/v1/chat/completions", b"x" * 2048,
                                           {**KEY, "content-length": "2048"})
        assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
        status, headers, body = await asgi(app, "POST", "/v1/chat/completions", None, KEY)
        assert status == 408 and headers["connection"] == "close"       # a stalled body
        status, headers, body = await asgi(app, "POST", "/v1/chat/completions", None, KEY)
        assert status == 429          # the bucket (2/s) is spent: refused before the body is even read
        assert headers["retry-after"] == "1"
        assert json.loads(body)["error"] == {"message": json.loads(body)["error"]["message"], "type": "requests",
                                             "param": None, "code": "rate_limit_exceeded"}
        assert router.calls == []
        tiers = app.admission.directory.tiers          # the standard tier without a request rate
        tiers["standard"] = dataclasses.replace(tiers["standard"], requests=None)
        status, _, body = await asgi(app, "POST", "/v1/chat/completions", CHAT_JSON, KEY)
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "Hi!"
        status, _, body = await asgi(app, "GET", "/openapi.json")
        assert status == 200 and json.loads(body)["openapi"].startswith("3.1")
        assert len(router.calls) == 1

    asyncio.run(main())


def test_requests_in_flight_are_bounded() -> None:
    async def main() -> None:
        router = FakeRouter()
        router.release = asyncio.Event()
        app = edge_app(router, max_concurrent=1)
        first = asyncio.create_task(asgi(app, "POST", "/v1/chat/completions", CHAT_JSON))
        while not router.calls:
            await asyncio.sleep(0)
        status, headers, body = await asgi(app, "POST", "/v1/chat/completions", CHAT_JSON)
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "overloaded"
        router.release.set()
        assert (await first)[0] == 200
        assert (await asgi(app, "POST", "/v1/chat/completions", CHAT_JSON))[0] == 200

    asyncio.run(main())


def test_tokens_are_reserved_then_settled() -> None:
    async def main() -> None:
        app = edge_app(token_limit=Rate(100, 60))
        limit = app.admission._limiter(app.admission.directory.tiers["standard"], "tokens")
        assert limit is not None
        big = json.dumps({**CHAT, "max_tokens": 90}).encode()
        status, _, _ = await asgi(app, "POST", "/v1/chat/completions", big)
        assert status == 200      # reserved 1 + 90, used 7 + 2: the rest is refunded
        assert limit.bucket("127.0.0.1", 0).level == pytest.approx(91, abs=0.5)
        status, _, _ = await asgi(app, "POST", "/v1/chat/completions", big)
        assert status == 200
        status, headers, body = await asgi(app, "POST", "/v1/chat/completions", json.dumps(
            {**CHAT, "max_tokens": 95}).encode())
        assert status == 429 and json.loads(body)["error"]["type"] == "tokens"
        assert int(headers["retry-after"]) >= 1

    asyncio.run(main())


def test_logprobs_reach_the_client() -> None:
    served = ServedBy("engine-0", "m", "1", "local", False, 1.0)
    deltas = [Delta("", logprobs=(_lp("H", -0.1, ("H", -0.1)),)),
              Delta("Hi", logprobs=(_lp("i", -0.2, ("i", -0.2)),)),
              Delta("", "length", 3, 2, served_by=served)]

    async def main() -> None:
        app = edge_app(FakeRouter(deltas))
        body = {**CHAT, "logprobs": True, "top_logprobs": 1, "max_tokens": 2}
        status, _, raw = await asgi(app, "POST", "/v1/chat/completions", json.dumps(body).encode())
        content = json.loads(raw)["choices"][0]["logprobs"]["content"]
        assert status == 200 and [c["token"] for c in content] == ["H", "i"]
        status, _, raw = await asgi(app, "POST", "/v1/chat/completions",
                                    json.dumps({**body, "stream": True}).encode())
        chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        tokens = [c["token"] for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
                  for c in ch["choices"][0]["logprobs"]["content"]]
        assert tokens == ["H", "i"] and "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == "Hi"
        status, _, raw = await asgi(app, "POST", "/v1/completions", json.dumps(
            {"model": "m", "prompt": "Say", "logprobs": 1, "max_tokens": 2}).encode())
        lp = json.loads(raw)["choices"][0]["logprobs"]
        assert lp["tokens"] == ["H", "i"] and lp["text_offset"] == [3, 4]

    asyncio.run(main())


def test_echo_puts_the_prompt_and_its_logprobs_first() -> None:
    served = ServedBy("engine-0", "m", "1", "local", False, 1.0)
    prompt = (_lp("S", float("nan")), _lp("ay", -1.5, ("ay", -1.5)))
    deltas = [Delta("H", logprobs=(_lp("H", -0.1, ("H", -0.1)),), prompt_logprobs=prompt),
              Delta("i", "length", 2, 2, served_by=served, logprobs=(_lp("i", -0.2, ("i", -0.2)),))]

    async def main() -> None:
        router = FakeRouter(deltas)
        app = edge_app(router)
        body = {"model": "m", "prompt": "Say", "logprobs": 1, "max_tokens": 2, "echo": True}
        status, _, raw = await asgi(app, "POST", "/v1/completions", json.dumps(body).encode())
        choice = json.loads(raw)["choices"][0]
        assert status == 200 and choice["text"] == "SayHi" and router.calls[-1].sampling.prompt_logprobs
        lp = choice["logprobs"]
        assert lp["tokens"] == ["S", "ay", "H", "i"] and lp["text_offset"] == [0, 1, 3, 4]
        assert lp["token_logprobs"][:2] == [None, -1.5] and lp["top_logprobs"][0] is None
        status, _, raw = await asgi(app, "POST", "/v1/completions", json.dumps({**body, "stream": True}).encode())
        chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "SayHi"
        assert chunks[0]["choices"][0]["logprobs"]["tokens"] == ["S", "ay"]
        status, _, raw = await asgi(app, "POST", "/v1/completions", json.dumps({**body, "max_tokens": 0}).encode())
        reply = json.loads(raw)
        assert reply["choices"][0]["text"] == "Say" and reply["choices"][0]["finish_reason"] == "length"
        assert reply["choices"][0]["logprobs"]["tokens"] == ["S", "ay"] and reply["usage"]["completion_tokens"] == 0
        assert router.calls[-1].sampling.max_tokens == 1
        status, _, raw = await asgi(app, "POST", "/v1/completions", json.dumps(
            {"model": "m", "prompt": "Say", "max_tokens": 0}).encode())
        assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"

    asyncio.run(main())


def test_openapi_schema_lists_the_fields_the_parser_takes() -> None:
    doc = document(EdgeConfig(max_messages=7))
    schemas = doc["components"]["schemas"]
    assert set(schemas["ChatCompletionRequest"]["properties"]) == requests.CHAT_FIELDS
    assert set(schemas["CompletionRequest"]["properties"]) == requests.COMPLETION_FIELDS
    for shape in schemas["ChatMessage"]["oneOf"]:
        assert set(shape["properties"]) == requests.MESSAGE_FIELDS | set(requests.MESSAGE_EMPTY_FIELDS)
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] == 7
    assert "security" not in doc["paths"]["/v1/models"]["get"]
    assert document(EdgeConfig(api_key_digests=(b"x",)))["paths"]["/v1/models"]["get"]["security"]


def test_verbose_health_lists_each_service_and_needs_a_key_when_keys_are_set() -> None:
    async def main() -> None:
        app = edge_app(FakeRouter())
        status, _, raw = await asgi(app, "GET", "/health?verbose=1")
        body = json.loads(raw)
        assert status == 200 and body["status"] == "ok" and body["tokenizer"] == "serving"
        assert body["router"]["state"] == "ready" and body["engines"][0]["replica"] == "engine-0"
        status, _, raw = await asgi(app, "GET", "/health")
        assert status == 200 and json.loads(raw) == {"status": "ok"}
        keyed = EdgeApp(EdgeConfig(api_key_digests=(digest("k1"),)), FakeRouter())  # type: ignore[arg-type]
        assert (await asgi(keyed, "GET", "/health?verbose=1"))[0] == 401
        assert (await asgi(keyed, "GET", "/health?verbose=1", headers={"authorization": "Bearer k1"}))[0] == 200
        assert (await asgi(keyed, "GET", "/health"))[0] == 200

    asyncio.run(main())


def test_logit_bias_entries_are_checked_before_their_count() -> None:
    """The OpenAPI fuzz's body: null biases under keys that are not token ids were a 500 (the count's check read
    the values as numbers)."""
    from services.edge.errors import ApiError
    from services.edge.surfaces.requests import parse_completion

    with pytest.raises(ApiError, match="'logit_bias' key '' is not a token id"):
        parse_completion({"logit_bias": {"": None, "k": None}, "model": "m", "prompt": "0", "top_k": 0})
    with pytest.raises(ApiError, match="'logit_bias' holds at most 1024 tokens"):
        parse_completion({"logit_bias": {str(i): 1 for i in range(1025)}, "model": "m", "prompt": "0"})
