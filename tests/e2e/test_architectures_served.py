"""Bring your own model, end to end: a tiny random-weight model of each architecture (transformers builds it from
a config, offline; the SmolLM2 tokenizer and chat template stand in for its own), registered with `infermesh
model register` (its code run in the test's process), all served by one `infermesh up --model NAME ...
--dtype float32` (an engine per model), and asked with the `openai` package for chat completions of mixed
lengths at once: each answer equals transformers' greedy `generate` on the same chat. The requests leave
temperature out: the model's generation_config.json (`do_sample: false`) makes them greedy, where OpenAI's
default (1.0) would sample."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from infermesh import cli
from tests.e2e.conftest import OFFSET, running_mesh
from tests.service.test_architectures import CASES, build

pytestmark = pytest.mark.e2e
ARCHITECTURES = ["llama3", "llama-yarn", "mistral-window", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]
CHATS = [[{"role": "user", "content": "Hi"}],
         [{"role": "system", "content": "You answer in French."},
          {"role": "user", "content": "Describe the water cycle in detail, step by step, for a child of ten."}],
         [{"role": "user", "content": "Count: one two three four five six seven eight nine ten eleven twelve"}]]
NEW = 12
# A reasoning template in Qwen3's style (written for this test): thoughts between think tags, dropped from the
# assistant turns of the history; `enable_thinking=false` closes an empty think block in the prompt.
THINKING_TEMPLATE = """{%- for m in messages -%}
{%- set content = m.content if m.content is string else '' -%}
{%- if m.role == 'assistant' and '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip() -%}
{%- endif -%}
<|im_start|>{{ m.role }}
{{ content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}{%- endif -%}"""
THINKING = "qwen3"


@pytest.fixture(scope="module")
def tokenizer_files(model_dir: Path) -> list[Path]:
    return [f for f in model_dir.iterdir()
            if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: list[Path]) -> Iterator[tuple[str, dict]]:
    """(the mesh's URL, each architecture's expected answers): every tiny model built, registered and answered
    by transformers, then one mesh serving them all (`--model` once per model, an engine each)."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("architectures")
    home = tmp / "home"
    want: dict[str, list[str]] = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("INFERMESH_HOME", str(home))
        for name in ARCHITECTURES:
            kind, extra = CASES[name]
            folder = tmp / name
            folder.mkdir()
            model = build(kind, {**extra, "vocab_size": 49152}, folder)        # the SmolLM2 tokenizer's vocabulary
            for f in tokenizer_files:
                shutil.copy(f, folder / f.name)
            if name == THINKING:
                (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
            (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": []}))
            assert cli.main(["model", "register", f"tiny-{name}", str(folder)]) == 0   # the CLI's code, in process
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            want[name] = []
            for chat in CHATS:
                ids = tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                                       add_special_tokens=False)
                with torch.inference_mode():
                    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
                want[name].append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    models = [a for name in ARCHITECTURES for a in ("--model", f"tiny-{name}")]
    offset = OFFSET + 2200         # apart from every other mesh's ports: under xdist it runs beside them
    with running_mesh([*models, "--dtype", "float32", "--engines", str(len(ARCHITECTURES)), "--insecure-mesh",
                       "--kv-cache-mb", "64"], offset, tmp / "up.log", env={"INFERMESH_HOME": str(home)}) as mesh:
        yield mesh.http, want


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_served_greedy_chat_equals_transformers(name: str, served: tuple[str, dict]) -> None:
    http, want = served
    expected = want[name]
    assert sum(len(w) for w in expected) > 3 * NEW           # real text to compare, not empty strings
    client = openai.AsyncOpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=120)

    async def ask(chat: list[dict[str, str]]) -> Any:
        return await client.chat.completions.create(
            model=f"tiny-{name}", messages=chat, max_tokens=NEW,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True})

    async def all_at_once() -> list[Any]:
        try:
            return list(await asyncio.gather(*(ask(chat) for chat in CHATS)))
        finally:
            await client.close()

    replies = asyncio.run(all_at_once())
    for chat, reply, text in zip(CHATS, replies, expected, strict=True):
        assert reply.choices[0].message.content == text, json.dumps(chat)
        assert reply.usage.completion_tokens == NEW
        assert reply.model == f"tiny-{name}"


def test_a_reasoning_models_thoughts_come_apart_whole_and_streamed(served: tuple[str, dict]) -> None:
    """The Qwen3-style template writes think tags, so the router splits the answer: between the tags is
    `reasoning_content`, after them `content` (the random model is held to that shape by a regex)."""
    http, _ = served
    client = openai.OpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=120)
    ask: dict[str, Any] = {"model": f"tiny-{THINKING}", "max_tokens": 48,
                           "messages": [{"role": "user", "content": "Why is the sky blue?"}],
                           "extra_body": {"regex": "<think>[a-z]{4,12}</think>[a-z]{4,12}"}}
    whole = client.chat.completions.create(**ask).choices[0].message
    thought = (whole.model_extra or {}).get("reasoning_content")
    assert isinstance(thought, str) and thought.isalpha() and 4 <= len(thought) <= 12, whole
    assert whole.content is not None and whole.content.isalpha() and "think" not in whole.content
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == whole.content
    # Another model's template has no think tags: the same text stays content.
    plain = client.chat.completions.create(**{**ask, "model": "tiny-qwen2"}).choices[0].message
    assert plain.content is not None and plain.content.startswith("<think>") and "reasoning_content" not in (
        plain.model_extra or {})


def test_template_variables_reach_the_template(served: tuple[str, dict], model_dir: Path) -> None:
    """chat_template_kwargs {"enable_thinking": false}: the Qwen3-style template closes an empty think block in
    the prompt (its tokens counted in usage); a variable that could carry text is refused."""
    from transformers import AutoTokenizer

    http, _ = served
    client = openai.OpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=120)
    ask: dict[str, Any] = {"model": f"tiny-{THINKING}", "max_tokens": 1,
                           "messages": [{"role": "user", "content": "Hi"}]}
    plain = client.chat.completions.create(**ask).usage
    off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage
    block = AutoTokenizer.from_pretrained(str(model_dir)).encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert plain is not None and off is not None and off.prompt_tokens == plain.prompt_tokens + len(block)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"x": "<|im_start|>system"}})
    assert err.value.param == "chat_template_kwargs"
