import pytest

from mesh.client import Delta, ServedBy
from mesh.edge import openai
from mesh.edge.openai import BadRequest

CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_defaults_follow_openai() -> None:
    spec = openai.parse_chat(CHAT)
    assert spec.sampling.temperature == 1.0 and spec.sampling.top_p == 1.0
    assert spec.sampling.max_tokens == 0 and spec.messages[0].content == "hi"


def test_chat_fields_are_carried() -> None:
    body = {**CHAT, "temperature": 0, "max_completion_tokens": 7, "stop": "x", "seed": 5, "user": "u1",
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}]}
    spec = openai.parse_chat(body, pinned="engine-1")
    assert spec.sampling.max_tokens == 7 and spec.sampling.stop == ("x",) and spec.sampling.seed == 5
    assert spec.messages[0].role == "system" and spec.messages[0].content == "ab"
    assert spec.session_id == "u1" and spec.pinned_replica == "engine-1"


def test_header_session_wins_over_user() -> None:
    assert openai.parse_chat({**CHAT, "user": "u1"}, session_id="h").session_id == "h"


@pytest.mark.parametrize("patch,param", [
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"bogus": 1}, "bogus"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
])
def test_bad_chat_requests_name_the_field(patch: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        openai.parse_chat({**CHAT, **patch})
    assert err.value.status == 400 and err.value.param == param


def test_stream_options_need_stream() -> None:
    assert openai.stream_options({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    with pytest.raises(BadRequest):
        openai.stream_options({"stream_options": {"include_usage": True}})


def test_completion_prompt() -> None:
    spec = openai.parse_completion({"model": "m", "prompt": ["once upon"], "max_tokens": 3})
    assert spec.prompt == "once upon" and spec.sampling.max_tokens == 3
    with pytest.raises(BadRequest):
        openai.parse_completion({"model": "m", "prompt": ["a", "b"]})


def test_response_shapes_carry_infermesh_metadata() -> None:
    final = Delta("", "stop", 5, 2, served_by=ServedBy("engine-0", "m", "1", "local", False, 1.0))
    body = openai.completion_body(True, "chatcmpl-1", "m", "hi", final)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["infermesh"] == {"replica": "engine-0", "model_version": "1", "region": "local",
                                 "degraded": False, "confidence": 1.0}
    chunk = openai.chunk_body(True, "chatcmpl-1", "m", "", "stop", final=final)
    assert chunk["choices"][0]["delta"] == {} and chunk["infermesh"]["replica"] == "engine-0"


def test_model_routing_body_is_checked() -> None:
    from mesh.edge.openai import parse_model_routing

    assert parse_model_routing({"default_version": "2"}) == ("2", None)
    assert parse_model_routing({"canary": {"3": 0.25}}) == ("", {"3": 0.25})
    assert parse_model_routing({"default_version": "2", "canary": {}}) == ("2", {})
    for body, match in [({}, "default_version and/or canary"), ({"canary": [1]}, "object of version"),
                        ({"canary": {"2": 2}}, r"in \[0, 1\]"), ({"canary": {"2": True}}, r"in \[0, 1\]"),
                        ({"weights": {}}, "unrecognized field")]:
        with pytest.raises(BadRequest, match=match):
            parse_model_routing(body)
