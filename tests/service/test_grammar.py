"""Structured output in the engine, on the real model: every constrained answer is one the grammar
accepts, sampled or greedy, in a batch with free rows, across a resume, under min_tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from mesh.constraints import Constraint
from mesh.errors import InvalidArgument
from services.engine.core.request import FinishReason, SamplingParams
from services.engine.core.speculate import SpeculationConfig
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide
from tests.data.json_schemas import SCHEMAS
from tests.service.test_engine import chat_ids, run, tokens


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, decide(device="cpu"))      # the tuned plan the engine serves with


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(model_dir))


def constrained(engine: Engine, rid: str, ids: list[int], c: Constraint, **sampling: object):  # type: ignore[no-untyped-def]
    req = engine.make_request(rid, ids, SamplingParams(constraint=c, **sampling))   # type: ignore[arg-type]
    req.matcher = engine.grammars.matcher(c, req.resume_ids)      # what the server does before add
    return req


@pytest.mark.slow                    # 20 compiles and a batch of 20 sampled rows; make test-fast keeps the small cases
def test_twenty_schemas_sampled_in_one_batch_all_validate(runner: ModelRunner, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = Engine(runner, speculation=SpeculationConfig(max_draft=3))
    requests = []
    for i, (name, prompt, schema) in enumerate(SCHEMAS):
        ids = chat_ids(tokenizer, f"{prompt} Answer in JSON.")
        requests.append(constrained(engine, name, ids, Constraint("json_schema", json.dumps(schema)),
                                    temperature=0.7, seed=i, max_tokens=300))
    free = engine.make_request("free", chat_ids(tokenizer, "Say hello."), SamplingParams(max_tokens=30))
    outs = run(engine, *requests, free)
    for name, _, schema in SCHEMAS:
        text = tokenizer.decode(tokens(outs[name]), skip_special_tokens=True)
        assert outs[name][-1].finish_reason is FinishReason.STOP, (name, text)
        jsonschema.validate(json.loads(text), schema)
    assert engine.grammars.compiles == len(SCHEMAS)
    assert outs["free"][-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_greedy_regex_prefix_suffix_and_cache(runner: ModelRunner, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = Engine(runner)
    ids = chat_ids(tokenizer, "What is the date of the moon landing?")
    c = Constraint("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", prefix="<date>", suffix="</date>")
    a = constrained(engine, "a", ids, c, max_tokens=40)
    b = constrained(engine, "b", ids, c, max_tokens=40, ignore_eos=True)    # the grammar still ends it
    outs = run(engine, a, b)
    texts = {k: tokenizer.decode(tokens(v), skip_special_tokens=True) for k, v in outs.items()}
    assert re.fullmatch(r"<date>[0-9]{4}-[0-9]{2}-[0-9]{2}</date>", texts["a"]), texts
    assert texts["a"] == texts["b"]
    assert outs["b"][-1].finish_reason is FinishReason.STOP
    assert engine.grammars.compiles == 1 and engine.grammars.hits == 1


def test_ebnf_grammar_json_object_and_min_tokens(runner: ModelRunner, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = Engine(runner)
    ids = chat_ids(tokenizer, "Is the sky blue?")
    yes_no = constrained(engine, "g", ids, Constraint("grammar", 'root ::= "yes" | "no"'), max_tokens=10,
                         min_tokens=5)    # min_tokens cannot outlast a complete grammar: the grammar wins
    obj = constrained(engine, "o", chat_ids(tokenizer, "Describe a cat as JSON."), Constraint("json_object"),
                      temperature=0.7, seed=3, max_tokens=200)
    outs = run(engine, yes_no, obj)
    assert tokenizer.decode(tokens(outs["g"]), skip_special_tokens=True) in ("yes", "no")
    text = tokenizer.decode(tokens(outs["o"]), skip_special_tokens=True)
    assert text.startswith("{"), text            # json_object bounds no string: whole only when it stopped
    if outs["o"][-1].finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(text), dict)


def test_resume_replays_the_grammar(runner: ModelRunner, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A stream resumed elsewhere after a failover: the matcher is advanced over the streamed tokens, and
    the seeded sampled output is the one the whole run gives."""
    engine = Engine(runner)
    ids = chat_ids(tokenizer, "Describe a fictional person.")
    c = Constraint("json_schema", json.dumps(SCHEMAS[0][2]))
    whole = tokens(run(engine, constrained(engine, "w", ids, c, temperature=0.7, seed=9, max_tokens=100))["w"])
    req = engine.make_request("r", ids, SamplingParams(temperature=0.7, seed=9, max_tokens=100, constraint=c),
                              resume_ids=whole[:5])
    req.matcher = engine.grammars.matcher(c, req.resume_ids)
    assert whole[:5] + tokens(run(engine, req)["r"]) == whole
    with pytest.raises(InvalidArgument, match="does not follow"):
        engine.grammars.matcher(c, tokenizer.encode("hello", add_special_tokens=False))


def test_auto_tool_calls_leave_text_free_and_calls_valid(runner: ModelRunner, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from mesh import tools

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}
    c = tools.auto_constraint([weather])
    engine = Engine(runner)
    free = constrained(engine, "free", chat_ids(tokenizer, "Say hello."), c, max_tokens=40)
    # A stream resumed inside an opened call: the model must go on with a valid call of get_weather.
    ids = chat_ids(tokenizer, "Weather in Paris?")
    opened = tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": ', add_special_tokens=False)
    req = engine.make_request("call", ids, SamplingParams(temperature=0.9, seed=4, max_tokens=60, constraint=c),
                              resume_ids=opened)
    req.matcher = engine.grammars.matcher(c, req.resume_ids)
    outs = run(engine, free, req)
    assert outs["free"][-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    text = tokenizer.decode(opened + tokens(outs["call"]), skip_special_tokens=True)
    calls = tools.parse(text, [weather])[1]
    assert len(calls) == 1, text
    jsonschema.validate(json.loads(calls[0].arguments), weather["function"]["parameters"])


@pytest.mark.parametrize("c, message", [
    (Constraint("json_schema", "{not json"), "cannot be compiled"),
    (Constraint("regex", "(unclosed"), "cannot be compiled"),
    (Constraint("grammar", "root ::= undefined_rule"), "cannot be compiled"),
])
def test_bad_constraints_are_refused(runner: ModelRunner, c: Constraint, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        Engine(runner).grammars.compile(c)


def test_constraint_kinds_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="not one of"):
        Constraint("yaml", "x")
    with pytest.raises(InvalidArgument, match="needs its text"):
        Constraint("regex")
