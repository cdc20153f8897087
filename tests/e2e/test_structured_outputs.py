"""End to end, issue 19: structured outputs and tools (and logit_bias, another control of what may be sampled)
through `infermesh up`, with the `openai` package and an agent framework's client (langchain-openai).  n and lists
of prompts, whose checks compare texts across requests, are in test_openai_api.py (the session mesh's float32
engines give the same text in any batch)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from tests.data.json_schemas import SCHEMAS
from tests.e2e.conftest import OFFSET, Mesh, running_mesh

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"
PORTS = OFFSET + 2900             # this module is a unit of its own (tests/conftest.py ON_THEIR_OWN)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CALL_IT = [{"role": "user", "content": "Use the get_weather tool: call it for Paris in celsius."}]


@pytest.fixture(scope="module")
def sampled_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The engines' own plan (`auto`: the measured one), as users run them: none of these tests compares text
    with transformers, and float32 (the session mesh's parity dtype) steps ~3x slower on a CPU."""
    with running_mesh(["--engines", "2"], PORTS, tmp_path_factory.mktemp("mesh") / "infermesh-up.log") as mesh:
        yield mesh


@pytest.fixture(scope="module")
def client(sampled_mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sampled_mesh.http}/v1", api_key="unused", max_retries=0, timeout=300)


def test_twenty_json_schemas_sampled_all_validate(client: openai.OpenAI) -> None:
    def ask(item: tuple[int, tuple[str, str, dict]]) -> tuple[str, str, dict, str | None]:  # type: ignore[type-arg]
        i, (name, prompt, schema) = item
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"{prompt} Answer in JSON."}], temperature=0.7,
            max_tokens=400, seed=i, response_format={"type": "json_schema", "json_schema": {
                "name": name, "schema": schema, "strict": True}})
        return name, reply.choices[0].message.content or "", schema, reply.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, enumerate(SCHEMAS)))
    for name, text, schema, finish in answers:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)
    name, prompt, schema = SCHEMAS[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0.7, max_tokens=400, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}}) if c.choices)
    jsonschema.validate(json.loads(streamed), schema)
    # json_object bounds nothing (a string may run to max_tokens): an object it is, whole when it stopped.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}], temperature=0.7, max_tokens=300,
        response_format={"type": "json_object"}, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("{"), text
    if [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop":
        assert isinstance(json.loads(text), dict)


def test_logit_bias_keeps_a_token_out_of_sampled_completions(client: openai.OpenAI, model_dir) -> None:  # type: ignore[no-untyped-def]
    """A -100 bias on the token the model would start with: absent from 20 sampled answers (read back token
    by token through logprobs), while without the bias the greedy answer starts with it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": "Name a color."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,  # type: ignore[arg-type]
                                           temperature=0, logprobs=True)
    token = first.choices[0].logprobs.content[0]                      # type: ignore[union-attr,index]
    banned = tokenizer.encode(bytes(token.bytes or []).decode(), add_special_tokens=False)
    assert len(banned) == 1
    for seed in range(20):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=seed,  # type: ignore[arg-type]
            logprobs=True, logit_bias={str(banned[0]): -100})
        chosen = [bytes(t.bytes or []) for t in reply.choices[0].logprobs.content]  # type: ignore[union-attr]
        assert bytes(token.bytes or []) not in chosen, f"seed {seed}"


def test_regex_and_grammar_extensions(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "When was 1969?"}],
                                           max_tokens=20, temperature=0.9, extra_body={"regex": r"[0-9]{4}-[0-9]{2}"})
    assert len(reply.choices[0].message.content or "") == 7
    reply = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5,
                                      extra_body={"grammar": 'root ::= " yes" | " no"'})
    assert reply.choices[0].text in (" yes", " no")
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body={"regex": "(unclosed"})


def _check_call(call, tools) -> None:  # type: ignore[no-untyped-def]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in params
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_gives_valid_calls_streamed_and_not(client: openai.OpenAI, choice) -> None:  # type: ignore[no-untyped-def]
    tools = [WEATHER, CLOCK]

    def ask(seed: int):  # type: ignore[no-untyped-def]
        return client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                              temperature=0.7, seed=seed, max_tokens=200)

    with ThreadPoolExecutor(3) as pool:            # batched together in the engines, as users' requests are
        replies = list(pool.map(ask, range(3)))
    for reply in replies:
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        assert len(message.tool_calls) == 1
        _check_call(message.tool_calls[0], tools)
        if isinstance(choice, dict):
            assert message.tool_calls[0].function.name == "get_weather"
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                                 temperature=0.7, seed=5, max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    # One call, its arguments in pieces as the model wrote them: id, type and name in the first only.
    assert {c.index for c in calls} == {0} and calls[0].id and not any(c.id or c.type for c in calls[1:])
    whole = calls[0].model_copy(deep=True)
    whole.function.arguments = "".join(c.function.arguments or "" for c in calls)     # type: ignore[union-attr]
    _check_call(whole, tools)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not "".join(d.content or "" for d in deltas).strip()


def test_auto_tool_choice_calls_are_valid_and_text_stays_free(client: openai.OpenAI) -> None:
    """tool_choice auto (the default with tools): whatever the model writes, any call it makes validates."""
    tools = [WEATHER, CLOCK]
    made = 0

    def ask(seed: int):  # type: ignore[no-untyped-def]
        return client.chat.completions.create(model=MODEL, messages=CALL_IT, tools=tools, temperature=1.0, seed=seed,
                                              max_tokens=120)

    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(ask, range(6)))
    for reply in replies:
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        calls = message.tool_calls or []
        # max_tokens may cut the last call off mid-arguments: that answer says "length", not "tool_calls"
        for call in calls[:-1] if finish == "length" else calls:
            _check_call(call, tools)
            made += 1
        assert (finish == "tool_calls") == bool(calls) or finish == "length"
        assert message.tool_calls or message.content
    hello = client.chat.completions.create(model=MODEL, tools=tools, temperature=0, max_tokens=30,
                                           messages=[{"role": "user", "content": "Just say hello."}])
    assert hello.choices[0].message.content or hello.choices[0].message.tool_calls


def test_tool_results_continue_the_conversation(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    follow = client.chat.completions.create(model=MODEL, tools=[WEATHER], temperature=0, max_tokens=40, messages=[
        *ASK, first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow.usage.prompt_tokens > first.usage.prompt_tokens
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=20)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_langchain_agent_client_structured_output_and_tools(sampled_mesh: Mesh) -> None:
    """What an agent built on LangChain does: tool calls bound to the model, and a typed structured output."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{sampled_mesh.http}/v1", api_key="unused", temperature=0.7, max_tokens=200,
                     max_retries=0, timeout=300)
    bound = llm.bind_tools([WEATHER, CLOCK], tool_choice="required")
    ai = bound.invoke([HumanMessage("What time is it in Tokyo?")])
    assert len(ai.tool_calls) == 1
    call = ai.tool_calls[0]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    jsonschema.validate(call["args"], params[call["name"]])
    answer = llm.bind_tools([WEATHER, CLOCK]).invoke(
        [HumanMessage("What time is it in Tokyo?"), ai, ToolMessage("10:42", tool_call_id=call["id"])])
    assert answer.content or answer.tool_calls
    streamed = None
    for chunk in bound.stream([HumanMessage("Weather in Oslo?")]):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and len(streamed.tool_calls) == 1
    jsonschema.validate(streamed.tool_calls[0]["args"], params[streamed.tool_calls[0]["name"]])
    name, prompt, schema = SCHEMAS[5]
    typed = llm.with_structured_output(schema | {"title": name, "description": prompt}, method="json_schema",
                                       strict=True)
    jsonschema.validate(typed.invoke(prompt), schema)


def test_native_grpc_constraint_and_tools(sampled_mesh: Mesh) -> None:
    """The same controls on meshpb.v1.Router/Generate: a JSON-schema constraint, and tools rendered with the
    chat template plus the tool-call constraint, read back with mesh.tools.parse."""
    import asyncio

    from mesh import tools
    from meshpb.v1 import common_pb2, router_pb2, router_pb2_grpc, tokenizer_pb2

    name, prompt, schema = SCHEMAS[8]
    call = tools.call_constraint([WEATHER])

    async def scenario() -> tuple[str, str]:
        async with sampled_mesh.channel(sampled_mesh.router) as ch:
            stub = router_pb2_grpc.RouterStub(ch)

            async def text(request: router_pb2.RouterGenerateRequest) -> str:
                return "".join([r.text async for r in stub.Generate(request, timeout=300)])

            structured = await text(router_pb2.RouterGenerateRequest(
                model=MODEL, chat=router_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user",
                                                                                           content=prompt)]),
                sampling=common_pb2.SamplingParams(temperature=0.7, seed=1, max_tokens=300,
                                                   constraint=common_pb2.Constraint(json_schema=json.dumps(schema)))))
            called = await text(router_pb2.RouterGenerateRequest(
                model=MODEL, chat=router_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(**m) for m in ASK],
                                                       tools=json.dumps([WEATHER])),
                sampling=common_pb2.SamplingParams(temperature=0.7, seed=2, max_tokens=200,
                                                   constraint=common_pb2.Constraint(
                                                       json_schema=call.text, prefix=call.prefix,
                                                       suffix=call.suffix))))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await text(router_pb2.RouterGenerateRequest(model=MODEL, prompt="x", sampling=common_pb2.SamplingParams(
                    max_tokens=5, constraint=common_pb2.Constraint(regex="(unclosed"))))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot be compiled" in err.value.details()
            return structured, called

    structured, called = asyncio.run(scenario())
    jsonschema.validate(json.loads(structured), schema)
    content, calls = tools.parse(called, [WEATHER])
    assert content == "" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
