"""The tokenizer service renders chat templates and reads tokenizer folders without transformers
(services/tokenizer/template.py, services/tokenizer/resolved.py): the text must be transformers' own, for
templates that use what real ones do (tools through tojson, raise_exception, namespace, loop controls,
`{% generation %}`, reasoning fields, special tokens), and a start from the cache must not import it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest

from mesh.chat import Message
from mesh.errors import InvalidArgument
from services.tokenizer import resolved as resolved_mod
from services.tokenizer.template import ChatTemplate
from services.tokenizer.tokenizer import ModelTokenizer

ROOT = Path(__file__).resolve().parents[2]

TOOLS = """{%- if tools %}{{ '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You may call tools.{% endif %}
{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'system' and tools %}{% continue %}{% endif %}
  {{- '<|im_start|>' + message.role + '\\n' }}
  {%- if message.content is defined %}{{ message.content }}{% endif %}
  {%- if message.tool_calls is defined %}{% for call in message.tool_calls %}
<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson(indent=2, sort_keys=True) }}
</tool_call>{% endfor %}{% endif %}
  {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

STRICT = """{{ bos_token }}{%- set ns = namespace(turns=0) -%}
{%- for message in messages -%}
{%- if (message['role'] == 'user') != (ns.turns % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- set ns.turns = ns.turns + 1 -%}
{%- if message.role == 'assistant' -%}<start_of_turn>model
{% generation %}{{ message.content | trim }}{% endgeneration %}<end_of_turn>
{% else -%}<start_of_turn>user
{{ message.content | trim }}<end_of_turn>
{% endif -%}
{%- if ns.turns > 4 %}{% break %}{% endif -%}
{%- endfor -%}
{%- set extra = dict(eos=eos_token) -%}
{%- if add_generation_prompt %}<start_of_turn>model
{% else %}{{ extra.eos }}{% endif %}"""

REASONING = """{% for m in messages %}[{{ m.role }}]
{%- if m.thinking is defined %}<think>{{ m.thinking }}</think>{% endif %}
{%- if m.reasoning_content is defined %}({{ m.reasoning_content }}){% endif %}
{{- m.content if m.content is defined else '-' }}
{% endfor %}{{ strftime_now('%Y') | length }}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Météo d'une ville",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
CHATS = {
    "tools": (TOOLS, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wetter in Zürich? 🌧"},
                      {"role": "assistant", "content": None, "tool_calls": [CALL]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 4}"}], [WEATHER]),
    "tools-none": (TOOLS, [{"role": "user", "content": "Hi"}], None),
    "strict": (STRICT, [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Hello! "},
                        {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Yes"},
                        {"role": "user", "content": "3"}, {"role": "assistant", "content": "cut by break"}], None),
    "reasoning": (REASONING, [{"role": "user", "content": "Why?"},
                              {"role": "assistant", "content": None, "reasoning": "Because."},
                              {"role": "assistant", "content": "So.", "thinking": "Hmm"}], None),
}


@pytest.mark.parametrize("name", sorted(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_templates_render_as_transformers_renders_them(hf_tokenizer: Any, name: str,
                                                       add_generation_prompt: bool) -> None:
    source, chat, tools = CHATS[name]
    want = hf_tokenizer.apply_chat_template(chat, chat_template=source, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    got = ChatTemplate(source, hf_tokenizer.special_tokens_map).render(chat, tools, add_generation_prompt)
    assert got == want


def test_named_templates_take_tool_use_when_there_are_tools(hf_tokenizer: Any) -> None:
    named = {"default": "plain:{{ messages[0].content }}", "tool_use": TOOLS}
    template = ChatTemplate(named, hf_tokenizer.special_tokens_map)
    chat = [{"role": "user", "content": "Hi"}]
    saved, hf_tokenizer.chat_template = hf_tokenizer.chat_template, named
    try:
        for tools in (None, [WEATHER]):
            assert template.render(chat, tools) == hf_tokenizer.apply_chat_template(
                chat, tools=tools, tokenize=False, add_generation_prompt=True)
    finally:
        hf_tokenizer.chat_template = saved
    with pytest.raises(ValueError, match="none is named 'default'"):
        ChatTemplate({"tool_use": TOOLS}, {})


@pytest.mark.parametrize("source, words", [
    (STRICT, "roles must alternate"),                                   # the template's own raise_exception
    ("{% set ns = namespace(_x=1) %}{{ ns._x }}", "'_x'"),             # underscore names stay out of reach
    ("{{ messages.append(1) }}", "unsafe"),                             # the sandbox is immutable
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
])
def test_a_template_that_refuses_or_escapes_is_the_callers_error(hf_tokenizer: Any, source: str, words: str) -> None:
    chat = [{"role": "assistant", "content": "first"}]
    with pytest.raises(jinja2.TemplateError):
        hf_tokenizer.apply_chat_template(chat, chat_template=source, tokenize=False)
    with pytest.raises(InvalidArgument, match=words):
        ChatTemplate(source, hf_tokenizer.special_tokens_map).render(chat)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}", {})


def test_a_folder_resolves_once_then_starts_from_the_cache(model_dir: Path, tmp_path: Path, hf_tokenizer: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("INFERMESH_TOKENIZER_CACHE", str(cache))
    folder = tmp_path / "copy"
    folder.mkdir()
    for f in resolved_mod.sources(model_dir):
        shutil.copy(f, folder / f.name)
    cold = ModelTokenizer("m", folder)
    (entry,) = list(cache.iterdir())
    assert entry.name == resolved_mod.cache_key(model_dir)                 # the same files: the same entry
    assert json.loads((entry / "meta.json").read_text())["special_tokens"] == hf_tokenizer.special_tokens_map
    # A start from the cache imports neither transformers nor torch, and tokenizes as the cold start did.
    code = ("import sys, json; from services.tokenizer.tokenizer import ModelTokenizer; from mesh.chat import Message; "
            f"t = ModelTokenizer('m', {str(folder)!r}); print(json.dumps([t.chat([Message('user', 'Hi 🚀')])[0], "
            "sorted(m for m in ('transformers', 'torch') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, "INFERMESH_TOKENIZER_CACHE": str(cache)})
    ids, imported = json.loads(out.stdout)
    assert imported == [] and ids == cold.chat([Message("user", "Hi 🚀")])[0]
    # A broken entry is resolved again; other files are another entry.
    (entry / "meta.json").write_text("{")
    assert ModelTokenizer("m", folder).json() == cold.json()
    assert json.loads((entry / "meta.json").read_text())["format"] == resolved_mod.FORMAT
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages[0].content }}"}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    assert ModelTokenizer("m", folder).render_chat([Message("user", "only this")]) == "only this"
    assert len(list(cache.iterdir())) == 2
