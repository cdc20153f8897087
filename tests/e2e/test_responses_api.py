"""End to end, issue 35: the Responses API (POST /v1/responses) with the `openai` package, on the session mesh
(float32 engines: greedy answers equal transformers')."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.conftest import Mesh

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http}/v1", api_key="unused", max_retries=0, timeout=300)


def test_a_response_whole_streamed_and_continued(client: openai.OpenAI, reference) -> None:  # type: ignore[no-untyped-def]
    first = client.responses.create(model=MODEL, input="Name three colors.", instructions="Answer briefly.",
                                    max_output_tokens=16, temperature=0)
    conversation = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colors."}]
    assert first.object == "response" and first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output_text == reference(16, messages=conversation)
    assert first.output[0].type == "message" and first.usage is not None and first.usage.output_tokens > 0

    # The same request streamed: typed events, the deltas adding up to the text of the final response.
    events = list(client.responses.create(model=MODEL, input="Name three colors.", instructions="Answer briefly.",
                                          max_output_tokens=16, temperature=0, stream=True, store=False))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{first.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == first.output_text == events[-1].response.output_text
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done",
            "response.output_item.done"} <= set(kinds)

    # Continued: the stored conversation comes first in the next prompt.
    second = client.responses.create(model=MODEL, input="Now name one more.", previous_response_id=first.id,
                                     instructions="Answer briefly.", max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens    # type: ignore[union-attr]
    conversation += [{"role": "assistant", "content": first.output_text},
                     {"role": "user", "content": "Now name one more."}]
    assert second.output_text == reference(12, messages=conversation)

    # Not stored, or unknown: nothing to continue.
    for previous in (events[-1].response.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=MODEL, input="Go on.", previous_response_id=previous, max_output_tokens=4)


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    asked = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=40, temperature=0)
    calls = [item for item in asked.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    answered = client.responses.create(
        model=MODEL, previous_response_id=asked.id, tools=[WEATHER], max_output_tokens=24, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"}])
    assert answered.status in ("completed", "incomplete") and answered.output
    # Its prompt held the stored call and the call's output after it.
    assert answered.usage.input_tokens > asked.usage.input_tokens + asked.usage.output_tokens + 3  # type: ignore[union-attr]


def test_precise_errors(client: openai.OpenAI) -> None:
    for kwargs, param in (({"input": []}, "input"),
                          ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
                          ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
                          ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
                          ({"input": "x", "temperature": 3}, "temperature")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, max_output_tokens=4, **kwargs)   # type: ignore[arg-type]
        assert err.value.param == param, (kwargs, err.value)


def test_a_stored_response_is_read_back_and_deleted(client: openai.OpenAI) -> None:
    made = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0)
    again = client.responses.retrieve(made.id)
    assert again.id == made.id and again.output_text == made.output_text and again.usage == made.usage
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):              # its conversation went with it
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=made.id, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)
    unstored = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
