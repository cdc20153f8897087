"""End to end, issue 21: a model version hot-swapped while 16 streams are in flight.

`infermesh up --engines 2 --dtype float32`; v2 is the default model with two of its 30 layers
perturbed (a fine-tune-like change that changes greedy answers).  `PUT /admin/models/smollm2-135m/
versions/2` while 16 greedy streams run: none fails, each has v1's text (equal to the fault-free run
before the swap); requests after it report version 2 and have v2's greedy text (transformers on the v2
folder); the engines are the same processes, and once v1's last request is gone its weights are
released and each engine's memory is back within 10% of what it was with one version.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import OFFSET, Mesh, engine_pid, json_call, rss_mib, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 900
ADMIN_KEY = "swap-admin-key"
MODEL = "smollm2-135m"
PROMPTS = [f"Write a few lines about {t}." for t in (
    "the sea", "a fox", "winter", "a violin", "the moon", "bread", "a river", "glaciers", "a market", "comets",
    "lighthouses", "owls", "rain", "a library", "bicycles", "tea")]
TOKENS = 40


@pytest.fixture(scope="module")
def v2_folder(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model (de-quantized into a float32 folder: a copy of tests/reference.py's) with every
    tensor of layers 9 and 20 scaled by (1 + 50% noise): answers change."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.reference import float32_folder

    folder = tmp_path_factory.mktemp("v2") / "smollm2-v2"
    shutil.copytree(float32_folder(model_dir), folder)
    weights = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(2)
    for name, tensor in weights.items():
        if ".layers.9." in name or ".layers.20." in name:
            weights[name] = tensor * (1 + 0.5 * torch.randn(tensor.shape, generator=generator))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def swap_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("swap") / "infermesh-up.log"
    with running_mesh(["--engines", "2", "--dtype", "float32", "--kv-cache-mb", "128"], PORTS, log,
                      env={"INFERMESH_ADMIN_KEYS": ADMIN_KEY}) as m:
        yield m


def engine_pids() -> list[int]:
    return [engine_pid(i, PORTS) for i in range(2)]


def stream(client: openai.OpenAI, prompt: str, progress: list[int], slot: int) -> dict[str, Any]:
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finish, meta = [], None, None
    for chunk in chunks:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            progress[slot] += 1
        meta = (chunk.model_extra or {}).get("infermesh") or meta
    return {"text": "".join(text), "finish": finish, "version": meta and meta["model_version"]}


def put_version(mesh: Mesh, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return json_call(mesh, "PUT", f"/admin/models/{MODEL}/versions/2", body, ADMIN_KEY, timeout=600)


def test_a_hot_swap_under_16_streams(swap_mesh: Mesh, v2_folder: Path) -> None:
    client = openai.OpenAI(base_url=f"{swap_mesh.http}/v1", api_key="unused", max_retries=0, timeout=600)
    with ThreadPoolExecutor(16) as pool:                 # fault free, one version: the references
        before = list(pool.map(lambda p: stream(client, p, [0], 0), PROMPTS))
    assert all(r["finish"] == "length" and r["version"] == "1" for r in before)
    pids = engine_pids()
    baseline = [rss_mib(p) for p in pids]

    # Refused precisely: a folder that does not exist, a different architecture is covered in-process.
    status, body = put_version(swap_mesh, {"source": "/nonexistent/folder"})
    assert status == 400 and "not a model folder or a registered model" in body["error"]["message"], body

    progress = [0] * len(PROMPTS)
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream, client, p, progress, i) for i, p in enumerate(PROMPTS)]
        deadline = time.monotonic() + 120
        while min(progress) < 3:
            assert time.monotonic() < deadline, progress
            time.sleep(0.05)
        status, body = put_version(swap_mesh, {"source": str(v2_folder)})
        assert status == 200, body
        assert max(progress) < TOKENS + 1, "the swap came after a stream had finished"
        during = [f.result(timeout=600) for f in futures]
    assert [r["text"] for r in during] == [r["text"] for r in before]     # every stream on v1's weights
    assert all(r["finish"] == "length" and r["version"] == "1" for r in during)
    assert body["routing"]["default_version"] == "2"
    assert {r["active_version"] for r in body["replicas"]} == {"2"} and len(body["replicas"]) == 2

    # After the swap: version 2, v2's greedy text (transformers on the v2 folder), the same processes.
    import torch
    from transformers import AutoTokenizer

    from mesh.models.gguf import load_float32

    def ask(prompt: str) -> Any:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=24, temperature=0)

    with ThreadPoolExecutor(3) as pool:          # the mesh answers while transformers computes the references
        replies = pool.map(ask, PROMPTS[:3])
        tokenizer = AutoTokenizer.from_pretrained(str(v2_folder))
        model = load_float32(v2_folder)
        replies = list(replies)
    changed = 0
    for prompt, old, reply in zip(PROMPTS[:3], before[:3], replies, strict=True):
        assert reply.model_extra["infermesh"]["model_version"] == "2"      # type: ignore[index]
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        assert reply.choices[0].message.content == expected
        changed += not old["text"].startswith(expected[:40])
    assert changed >= 1, "v2 answers like v1: the perturbation did not change the model"
    assert engine_pids() == pids

    # v1's weights go once its last request has: memory back within 10% of the one-version baseline.
    deadline = time.monotonic() + 60
    while swap_mesh.log.read_text().count("released the weights of version 1") < 2:
        assert time.monotonic() < deadline, "v1 was not released on both engines"
        time.sleep(0.5)
    after = [rss_mib(p) for p in pids]
    print(f"\nhot swap: load seconds per replica {[r['load_seconds'] for r in body['replicas']]}; engine RSS MiB "
          f"with one version {[round(b) for b in baseline]}, after the swap and v1's release "
          f"{[round(a) for a in after]}")
    for b, a in zip(baseline, after, strict=True):
        assert a <= 1.10 * b, (baseline, after)


def test_a_drained_replica_finishes_its_streams_and_leaves(swap_mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{swap_mesh.http}/v1", api_key="unused", max_retries=0, timeout=600)
    progress = [0] * 6
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, client, p, progress, i) for i, p in enumerate(PROMPTS[:6])]
        deadline = time.monotonic() + 120
        while min(progress) < 3:
            assert time.monotonic() < deadline, progress
            time.sleep(0.05)
        req = urllib.request.Request(f"{swap_mesh.http}/admin/replicas/engine-1/drain", data=b"", method="POST",
                                     headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        with urllib.request.urlopen(req, timeout=600) as reply:
            drained = json.loads(reply.read())
        results = [f.result(timeout=600) for f in futures]
    assert drained["drained"] is True and drained["finished"] >= 1, drained     # it had streams, and they ended
    assert all(r["finish"] == "length" for r in results)                         # every one completed
    # Out of the router's table: new requests go to engine-0, a pin to engine-1 names it unknown.
    for _ in range(4):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert reply.model_extra["infermesh"]["replica"] == "engine-0"     # type: ignore[index]
    with pytest.raises(openai.NotFoundError, match="engine-1"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_headers={"x-infermesh-replica": "engine-1"})
    assert "drained: nothing in flight; out of discovery" in swap_mesh.log.read_text()
