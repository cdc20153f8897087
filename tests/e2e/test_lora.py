"""End to end, issue 36: LoRA adapters loaded while serving, through the edge's vLLM-shaped API.

`infermesh up --engines 2 --routers 2 --dtype float32 --no-restart` with an admin key.  Two PEFT adapters built
on the default model (nonzero B) are loaded at run time on engine-1: each answers greedily as transformers + peft
does, and the base model and both adapters asked at once on engine-1 each give their own model's tokens;
/v1/models lists them with their base as `parent`, and both routers know them.  A stream for an adapter held by
engine-1 goes there; after `kill -9` of engine-1 the router loads the adapter on engine-0 and the stream resumes
with the text it would have had.  `infermesh lora` lists and unloads (on both routers).  An adapter unloaded frees
its memory (engine-0's RSS back within 5%) and later requests are 404; bad input is 400/404 naming it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.e2e.conftest import OFFSET, Mesh, engine_pid, json_call, rss_mib, running_mesh
from tests.lora_adapters import TARGETS, build_adapter, random_adapter

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 1900
ADMIN_KEY = "lora-admin-key"
MODEL = "smollm2-135m"
PROMPT = "Write a few lines about the sea."
TOKENS = 24


@pytest.fixture(scope="module")
def folders(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    base, _ = hf
    root = tmp_path_factory.mktemp("lora-e2e")
    return {"alpha": (root / "alpha", build_adapter(base, root / "alpha", 11, 8, TARGETS)),
            "beta": (root / "beta", build_adapter(base, root / "beta", 12, 4, ["q_proj", "v_proj", "down_proj"])),
            "wide": (root / "wide", random_adapter(base.config, root / "wide", 13, 128))}


@pytest.fixture(scope="module")
def lora_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("lora") / "infermesh-up.log"
    args = ["--engines", "2", "--routers", "2", "--dtype", "float32", "--kv-cache-mb", "128", "--no-restart"]
    with running_mesh(args, PORTS, log, env={"INFERMESH_ADMIN_KEYS": ADMIN_KEY}) as m:
        yield m


def post(mesh: Mesh, path: str, body: dict[str, Any], key: str = ADMIN_KEY) -> tuple[int, dict[str, Any]]:
    return json_call(mesh, "POST", path, body, key, timeout=300)


def reference(hf: Any, model: Any) -> str:
    """transformers (+ peft) greedy on the chat-templated prompt: the text the mesh must give."""
    _, tokenizer = hf
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    return str(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))


def stream(client: openai.OpenAI, model: str, tokens: int = TOKENS, on_chunk: Any = None, **extra: Any
           ) -> dict[str, Any]:
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, **extra)
    text, meta, n = [], None, 0
    for chunk in chunks:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            n += 1
            if on_chunk is not None:
                on_chunk(n)
        meta = (chunk.model_extra or {}).get("infermesh") or meta
    return {"text": "".join(text), "replica": meta and meta["replica"]}


def test_adapters_loaded_at_run_time_answer_as_peft_move_with_a_dead_engine_and_unload(
        lora_mesh: Mesh, folders: dict[str, tuple[Path, Any]], hf: Any) -> None:
    def lora_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "infermesh.cli", "lora", *args, "--tls-dir",
                               str(lora_mesh.tls_dir)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "INFERMESH_ADMIN_KEY": ADMIN_KEY})

    client = openai.OpenAI(base_url=f"{lora_mesh.http}/v1", api_key="unused", max_retries=0, timeout=600)
    alpha, beta = folders["alpha"][0], folders["beta"][0]

    # Refused precisely: no admin key, a missing folder, an adapter of another shape, an unknown adapter.
    status, body = post(lora_mesh, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(alpha)}, "nope")
    assert status in (401, 403), body
    status, body = post(lora_mesh, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent/lora"})
    assert status == 400 and "/nonexistent/lora" in body["error"]["message"], body
    with pytest.raises(openai.NotFoundError, match="alpha"):
        client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    status, body = post(lora_mesh, "/v1/unload_lora_adapter", {"lora_name": "alpha"})
    assert status == 404, body

    # Loaded on engine-1 at run time: listed with its base as parent; greedy as transformers + peft.
    for name, folder in (("alpha", alpha), ("beta", beta)):
        status, body = post(lora_mesh, "/v1/load_lora_adapter",
                            {"lora_name": name, "lora_path": str(folder), "replica": "engine-1"})
        assert status == 200 and body["replicas"] == ["engine-1"] and body["model"] == MODEL, body
    cli = lora_cli("list", "--router", lora_mesh.router)
    assert cli.returncode == 0 and re.search(rf"^alpha\s+{MODEL}\s+engine-1\s+{alpha}$", cli.stdout, re.M), cli
    listed = {m.id: m.model_extra for m in client.models.list().data}
    assert listed["alpha"]["parent"] == MODEL and listed["beta"]["parent"] == MODEL and listed[MODEL]["parent"] is None
    expected = {"alpha": reference(hf, folders["alpha"][1]), "beta": reference(hf, folders["beta"][1])}
    expected[MODEL] = reference(hf, hf[0])
    assert len(set(expected.values())) == 3                  # the adapters change the answer
    assert stream(client, "alpha") == {"text": expected["alpha"], "replica": "engine-1"}
    whole = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert whole.model == "beta" and whole.choices[0].message.content == expected["beta"]

    # Base-model rows and both adapters' rows in the same steps of engine-1: each its own model's tokens.
    names = [MODEL, "alpha", "beta"] * 2
    with ThreadPoolExecutor(len(names)) as pool:
        mixed = list(pool.map(lambda n: stream(client, n, extra_headers={"x-infermesh-replica": "engine-1"}), names))
    assert [r["text"] for r in mixed] == [expected[n] for n in names]

    # A long stream on engine-1, which is killed mid-way: the router loads alpha on engine-0 and resumes.
    long_reference = stream(client, "alpha", 64)
    assert long_reference["replica"] == "engine-1"
    pid = engine_pid(1, PORTS)

    def kill_at(n: int) -> None:
        if n == 8:
            os.kill(pid, signal.SIGKILL)

    resumed = stream(client, "alpha", 64, on_chunk=kill_at)
    assert resumed["text"] == long_reference["text"] and resumed["replica"] == "engine-0", resumed
    status, body = post(lora_mesh, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(alpha)})
    assert status == 200 and "engine-0" in body["replicas"], body
    # Every router learnt both adapters from the edge's load (router-1 too: it would load them elsewhere); an
    # unload through `infermesh lora` goes to both routers.
    routers = f"{lora_mesh.router},127.0.0.1:{50031 + PORTS}"
    assert "beta " in lora_cli("list", "--router", routers.split(",")[1]).stdout
    cli = lora_cli("unload", "beta", "--router", routers)
    assert cli.returncode == 0 and cli.stdout.startswith("beta: unloaded"), cli
    assert "beta " not in lora_cli("list", "--router", routers.split(",")[1]).stdout
    with pytest.raises(openai.NotFoundError, match="beta"):
        client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=2)

    # Unloading frees the adapter's memory: a wide one (rank 128 on every projection) on engine-0.
    engine0 = engine_pid(0, PORTS)
    before = rss_mib(engine0)
    status, body = post(lora_mesh, "/v1/load_lora_adapter",
                        {"lora_name": "wide", "lora_path": str(folders["wide"][0]), "replica": "engine-0"})
    assert status == 200, body
    assert stream(client, "wide", 4)["replica"] == "engine-0"
    loaded = rss_mib(engine0)
    status, body = post(lora_mesh, "/v1/unload_lora_adapter", {"lora_name": "wide"})
    assert status == 200, body
    time.sleep(0.5)
    after = rss_mib(engine0)
    print(f"engine-0 RSS: {before:.0f} MiB, {loaded:.0f} with the wide adapter, {after:.0f} after unloading it")
    # Back within 5% of before (below it too: the unload gives glibc's free pages back, older ones included).
    assert loaded - before > 50 and after <= 1.05 * before, (before, loaded, after)
    with pytest.raises(openai.NotFoundError, match="wide"):
        client.chat.completions.create(model="wide", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "wide" not in {m.id for m in client.models.list().data}
