"""Real GGUF files, end to end (opt-in: INFERMESH_REAL_GGUFS names a folder of them; a fresh clone has none):
each is registered with `infermesh model register NAME FILE.gguf` (the folder keeps its blocks as
model.gguf, nothing de-quantized on disk), served by `infermesh up --model NAME --dtype float32`, and
asked with the `openai` package, greedy, a few prompts at once: every answer, token by token, equals
transformers' greedy `generate` on a model transformers' own GGUF reader loads from the same file
(`load_gguf_model`).  The instruct Qwen models are asked for chat completions, the base Gemma 3 for plain
completions.  Each token's text is compared (the API's logprobs carry it, not its id), and the text and
count as a whole."""

from __future__ import annotations

import asyncio
import fnmatch
import gc
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.e2e.conftest import OFFSET, running_mesh

pytestmark = pytest.mark.e2e
FOLDER = os.environ.get("INFERMESH_REAL_GGUFS", "")
if not FOLDER or not Path(FOLDER).is_dir() or not list(Path(FOLDER).glob("*.gguf")):
    pytest.skip(f"INFERMESH_REAL_GGUFS={FOLDER!r} is no folder of GGUF files; point it at one holding "
                "qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct or gemma-3-270m GGUFs to run these "
                "tests", allow_module_level=True)

NEW = 24
CHATS = [[{"role": "user", "content": "Write a Python function that reverses a string."}],
         [{"role": "system", "content": "You answer in one short sentence."},
          {"role": "user", "content": "What is a hash map?"}],
         [{"role": "user", "content": "Hi"}]]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]


@dataclass(frozen=True)
class Case:
    pattern: str        # a glob in FOLDER, case-insensitive
    chat: bool          # an instruct model (chat completions), else a base model (completions)


CASES = {"qwen2.5-coder-0.5b": Case("*qwen2.5-coder-0.5b-instruct*.gguf", chat=True),
         "qwen2.5-coder-1.5b": Case("*qwen2.5-coder-1.5b-instruct*.gguf", chat=True),
         "gemma-3-270m": Case("*gemma-3-270m*.gguf", chat=False)}


def _find(pattern: str) -> Path | None:
    found = sorted(p for p in Path(FOLDER).iterdir() if fnmatch.fnmatch(p.name.lower(), pattern))
    return found[0] if found else None


def _reference(gguf_file: Path, folder: Path, chat: bool) -> list[tuple[int, list[int]]]:
    """(prompt length, greedy ids) per prompt, from transformers on the file it reads itself; the model is
    freed before returning (the 1.5B in float32 is ~6 GB, and the mesh loads its own next)."""
    from transformers import AutoTokenizer

    from mesh.models.gguf import load_gguf_model

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if chat:                    # the template rendered, then encoded without adding specials, as the tokenizer does
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                                    add_special_tokens=False) for c in CHATS]
    else:                       # bos added, as the router encodes a prompt
        prompts = [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    model, _ = load_gguf_model(gguf_file)
    model.eval()
    model.generation_config.eos_token_id = None          # the requests ignore eos: NEW tokens each
    out = []
    try:
        for ids in prompts:
            with torch.inference_mode():
                got = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=NEW, do_sample=False)
            out.append((len(ids), got[0, len(ids):].tolist()))
    finally:
        del model
        gc.collect()
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_served_greedy_equals_transformers_on_the_same_gguf(name: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    case = CASES[name]
    gguf_file = _find(case.pattern)
    if gguf_file is None:
        pytest.skip(f"no {case.pattern} in {FOLDER}")
    home = tmp_path / "home"
    env = {**os.environ, "INFERMESH_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "infermesh.cli", "model", "register", name, str(gguf_file)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = Path(done.stdout.strip().splitlines()[-1])
    assert (folder / "model.gguf").is_file() and not list(folder.glob("*.safetensors")), sorted(folder.iterdir())

    want = _reference(folder / "model.gguf", folder, case.chat)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))

    def piece(i: int) -> str:       # a token's text as the API shows it: its own decoding
        return str(tokenizer.decode([i], skip_special_tokens=True))

    with running_mesh(["--model", name, "--dtype", "float32", "--engines", "1", "--insecure-mesh"],
                      OFFSET + 1300, tmp_path / "up.log", env={"INFERMESH_HOME": str(home)}) as mesh:
        client = openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key="unused", max_retries=0, timeout=600)

        async def ask(prompt: Any) -> tuple[str, list[str], Any]:
            common: dict[str, Any] = {"model": name, "max_tokens": NEW, "temperature": 0,
                                      "extra_body": {"ignore_eos": True}}
            if case.chat:
                reply = await client.chat.completions.create(messages=prompt, logprobs=True, **common)
                choice = reply.choices[0]
                return choice.message.content or "", [t.token for t in choice.logprobs.content], reply.usage
            reply = await client.completions.create(prompt=prompt, logprobs=0, **common)
            choice = reply.choices[0]
            return choice.text, list(choice.logprobs.tokens), reply.usage

        async def all_at_once() -> list[tuple[str, list[str], Any]]:
            try:
                # One request first, retried: the router's first request for a model fetches and parses the
                # tokenizer's JSON on its event loop (33 MB for Gemma 3's 262k vocabulary, ~1 s a parse, once
                # per request in flight), long enough for the edge to count the router down and answer 503.
                warm = client.with_options(max_retries=3)
                if case.chat:
                    await warm.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hello"}],
                                                       max_tokens=1, temperature=0)
                else:
                    await warm.completions.create(model=name, prompt="Hello", max_tokens=1, temperature=0)
                return list(await asyncio.gather(*(ask(p) for p in (CHATS if case.chat else PROMPTS))))
            finally:
                await client.close()

        replies = asyncio.run(all_at_once())

    for prompt, (text, pieces, usage), (prompt_len, ids) in zip(CHATS if case.chat else PROMPTS, replies, want,
                                                                 strict=True):
        assert usage.prompt_tokens == prompt_len, prompt
        assert pieces == [piece(i) for i in ids], (prompt, tokenizer.decode(ids), text)
        assert text == tokenizer.decode(ids, skip_special_tokens=True), prompt
        assert usage.completion_tokens == NEW
