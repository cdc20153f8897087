"""Fair scheduling in the engine with the real model: paused and preempted requests lose nothing.

A batch-class request of one tenant runs while interactive requests of another arrive: it is left out
of steps (its KV kept) and, with too few KV blocks for all, preempted and recomputed; its greedy text
is still the one it has alone.  Two tenants' tokens split by their weights on the model's own steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.core.request import Owner, SamplingParams
from services.engine.core.scheduler import SchedulerConfig
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.models import interrupt
from tests.service.test_engine import EXACT, PROMPTS, chat_ids, run, tokens

BATCH = Owner(priority=1, tenant="jobs")
CHAT = Owner(priority=0, tenant="people")


@pytest.mark.slow                    # over 5 s of model runs on 2 cores: make test runs it, make test-fast not
def test_a_paused_and_preempted_batch_request_gives_the_greedy_text_it_gives_alone(model_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    _, tokenizer = hf
    job = chat_ids(tokenizer, "Describe a sunrise over the mountains.")
    chats = [chat_ids(tokenizer, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    probe = ModelRunner(model_dir, EXACT, kv_cache_bytes=64 << 20)
    # The chats share their first blocks (the chat template's system prompt): two blocks fewer than their sum
    # hold them to their end, but not the job as well, whose blocks go to them.
    blocks = sum(-(-(len(ids) + 24) // probe.block_size) for ids in chats) - 2
    runner = ModelRunner(model_dir, EXACT, kv_cache_bytes=blocks * probe.block_bytes)
    alone = Engine(runner, scheduler=SchedulerConfig(max_running=3))
    expected = tokens(run(alone, alone.make_request("job", job, params, owner=BATCH))["job"])

    engine = Engine(runner, scheduler=SchedulerConfig(max_running=3))
    request = engine.make_request("job", job, params, owner=BATCH)
    engine.add(request)
    outputs = [out for _ in range(6) for out in engine.step()]     # the job decodes alone for a while
    for i, ids in enumerate(chats):
        engine.add(engine.make_request(f"chat{i}", ids, params, owner=CHAT))
    for outs in engine.run_until_idle().values():
        outputs += outs
    got = [t for o in outputs if o.request_id == "job" for t in o.new_ids]
    assert request.num_preemptions >= 1 and engine.stats.paused >= 1
    assert got == expected
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.slow                    # over 5 s of model runs on 2 cores: make test runs it, make test-fast not
def test_two_tenants_share_the_model_steps_by_weight(model_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    _, tokenizer = hf
    runner = ModelRunner(model_dir, EXACT, kv_cache_bytes=64 << 20)
    engine = Engine(runner, scheduler=SchedulerConfig(max_running=4))
    params = SamplingParams(max_tokens=100, ignore_eos=True)     # none finishes (and admits another) in the window
    for i in range(6):
        for name, weight in (("premium", 3.0), ("free", 1.0)):
            ids = chat_ids(tokenizer, f"Tell me about the number {i}.")
            engine.add(engine.make_request(f"{name}{i}", ids, params, owner=Owner(0, name, weight)))
    for _ in range(3):
        engine.step()                                # admissions: each tenant's first prompts
    before = dict(engine.stats.tenant_tokens)
    for _ in range(40):
        engine.step()
    served = {t: engine.stats.tenant_tokens[t] - before[t] for t in ("premium", "free")}
    assert served == {"premium": 120, "free": 40}    # 3 of the 4 rows a step, and 1


def test_a_batch_step_gives_way_between_layers_to_an_interactive_arrival(model_dir: Path, hf,  # type: ignore[no-untyped-def]
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _, tokenizer = hf
    job = chat_ids(tokenizer, "Describe a sunrise over the mountains.")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runner = ModelRunner(model_dir, EXACT, kv_cache_bytes=64 << 20)
    alone = Engine(runner, scheduler=SchedulerConfig(max_running=4))
    expected = tokens(run(alone, alone.make_request("job", job, params, owner=BATCH))["job"])

    engine = Engine(runner, scheduler=SchedulerConfig(max_running=4))
    engine.add(engine.make_request("job", job, params, owner=BATCH))
    outputs = [out for _ in range(4) for out in engine.step()]      # the job's prefill and 3 decode steps
    chat = engine.make_request("chat", chat_ids(tokenizer, PROMPTS[0]), params, owner=CHAT)
    layers = iter(range(1_000))
    check = interrupt.check

    def arrives_at_layer_5() -> None:               # the chat arrives while the job's step is at layer 5
        if next(layers) == 5:
            engine.add(chat)
        check()

    monkeypatch.setattr(interrupt, "check", arrives_at_layer_5)
    assert engine.step() == [] and engine.stats.interrupted == 1    # given up: nothing sampled for the job
    monkeypatch.setattr(interrupt, "check", check)
    step = engine.step()
    assert [o.request_id for o in step] == ["chat"]                  # the chat's prefill runs alone, at once
    assert engine.scheduler.running[0].request_id == "job" and chat.num_computed == len(chat.prompt_ids)
    for outs in engine.run_until_idle().values():
        outputs += outs
    assert [t for o in outputs if o.request_id == "job" for t in o.new_ids] == expected
    assert engine.stats.interrupted == 1             # the steps with the chat's rows in them are not given up
