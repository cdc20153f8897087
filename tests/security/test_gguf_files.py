"""Issue 49, item 8: a GGUF's tensors are checked against its header, its file and the model's config before any
weight is read (mesh/models/gguf_header.py, services/engine/runtime/models/gguf_check.py).

Before, malformed files gave raw tracebacks at `infermesh model register`, and some registered, served as healthy
and failed every request (a projection the config's heads or sizes do not fit, a type the loader cannot read), or
read bytes past the file or inside the header as weights.  Each file here is a tiny Llama written as llama.cpp
lays one out, then broken one way: the engine's load (`load_weights`) and `infermesh model register` both refuse
it with GgufError's one message naming the tensor, what was expected and what the file says; register exits 1
with that message and no traceback, and keeps nothing.  A good file still loads and registers.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mesh import models
from mesh.models.gguf_header import GgufError, read_header
from services.engine.runtime.models.config import load_weights
from tests.service.gguf_files import Field, tokenizer_fields

gguf = pytest.importorskip("gguf")

H, HEADS, KV, D, INTER, VOCAB = 64, 4, 2, 16, 128, 256
CONFIG = {"model_type": "llama", "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV,
          "intermediate_size": INTER, "num_hidden_layers": 1, "vocab_size": VOCAB, "tie_word_embeddings": True,
          "max_position_embeddings": 128}
SHAPES = {"token_embd.weight": (VOCAB, H), "output_norm.weight": (H,), "blk.0.attn_norm.weight": (H,),
          "blk.0.ffn_norm.weight": (H,), "blk.0.attn_q.weight": (H, H), "blk.0.attn_k.weight": (KV * D, H),
          "blk.0.attn_v.weight": (KV * D, H), "blk.0.attn_output.weight": (H, H), "blk.0.ffn_gate.weight": (INTER, H),
          "blk.0.ffn_up.weight": (INTER, H), "blk.0.ffn_down.weight": (H, INTER)}


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> list[Field]:
    return tokenizer_fields(model_dir / "model.gguf", VOCAB)


def write(path: Path, tokenizer: list[Field] | None = None, shapes: dict[str, tuple[int, ...]] | None = None,
          int32: str = "", alignment: int | None = None) -> Path:
    """A tiny Llama GGUF (float32 weights; `shapes` replacing SHAPES; `int32`: that tensor stored as I32)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(D)
    if alignment is not None:           # the key only: the writer still lays the data out at its own 32
        writer.add_int32("general.alignment", alignment)
    for key, value, kind, sub in tokenizer or []:
        writer.add_key_value(key, value, kind, sub_type=sub)
    g = np.random.default_rng(0)
    for name, shape in (SHAPES if shapes is None else shapes).items():
        w = g.normal(0, 0.05, shape).astype(np.float32)
        writer.add_tensor(name, w.astype(np.int32) if name == int32 else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def folder_of(file: Path) -> Path:
    """A model folder as `register` keeps one (config.json beside model.gguf) for the engine's load."""
    folder = file.parent / f"{file.stem}-folder"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "model.gguf").write_bytes(file.read_bytes())
    return folder


def header_only(n_tensors: int = 0, n_kv: int = 0) -> bytes:
    """The 24 bytes every GGUF starts with: magic, version 3, the tensor and metadata counts."""
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def refused_at_load(file: Path) -> str:
    with pytest.raises(GgufError) as refused:
        load_weights(folder_of(file))
    return str(refused.value).replace(str(file.parent / f"{file.stem}-folder" / "model.gguf"), str(file))


def register(file: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`infermesh model register bad FILE` in process: its exit status and stderr (nothing kept on failure)."""
    from infermesh.cli import main

    code = main(["model", "register", "bad", str(file)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code:
        assert not (home / "models" / "bad").exists() and "bad" not in {m["name"] for m in models.list_models()}
    return code, err


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("INFERMESH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_good_file_loads_and_registers(tmp_path: Path, tokenizer: list[Field], home: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    file = write(tmp_path / "good.gguf", tokenizer)
    weights = load_weights(folder_of(file))
    assert tuple(weights["model.layers.0.self_attn.k_proj.weight"].shape) == (KV * D, H)
    code, err = register(file, home, capsys)
    assert code == 0, err
    assert models.path("bad") == home / "models" / "bad"


def test_a_dimension_that_disagrees_with_the_config(tmp_path: Path, tokenizer: list[Field], home: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    file = write(tmp_path / "narrow-q.gguf", tokenizer, {**SHAPES, "blk.0.attn_q.weight": (48, H)})
    message = (f"{file}: tensor 'blk.0.attn_q.weight' (model.layers.0.self_attn.q_proj.weight) has shape (48, 64) in "
               "the file (dims [64, 48]); the config (num_attention_heads 4 x head_dim 16, hidden_size 64) expects "
               "(64, 64)")
    assert refused_at_load(file) == message
    assert register(file, home, capsys) == (1, f"infermesh model: {message}\n")     # the config read from the file


def test_a_tensor_whose_data_runs_past_the_end_of_the_file(tmp_path: Path, home: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path / "whole.gguf")
    last = read_header(good).tensors[-1]
    file = tmp_path / "truncated.gguf"
    file.write_bytes(good.read_bytes()[:-100])
    message = (f"{file}: tensor 'blk.0.ffn_down.weight' (F32, dims [128, 64]: {last.nbytes} bytes at byte "
               f"{last.offset}) runs past the end of the file ({file.stat().st_size} bytes): the file is truncated or "
               "its header is wrong")
    assert last.offset + last.nbytes == good.stat().st_size
    assert refused_at_load(file) == message
    assert register(file, home, capsys) == (1, f"infermesh model: {message}\n")
    done = subprocess.run([sys.executable, "-m", "infermesh.cli", "model", "register", "bad", str(file)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "INFERMESH_HOME": str(home)},
                          cwd=Path(__file__).resolve().parents[2])
    assert (done.returncode, done.stderr) == (1, f"infermesh model: {message}\n")


def test_an_unknown_or_unsupported_ggml_type(tmp_path: Path) -> None:
    ints = write(tmp_path / "int-weights.gguf", int32="blk.0.attn_v.weight")
    assert refused_at_load(ints) == (
        f"{ints}: tensor 'blk.0.attn_v.weight' (model.layers.0.self_attn.v_proj.weight) is of type I32, which the "
        "engine's loader does not read (F32, F16, BF16 or a block type gguf-py de-quantizes)")
    unknown = tmp_path / "unknown-type.gguf"
    data = bytearray(write(tmp_path / "typed.gguf").read_bytes())
    name = b"blk.0.attn_k.weight"
    at = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
    unknown.write_bytes(bytes(data))
    assert refused_at_load(unknown) == f"{unknown}: tensor 'blk.0.attn_k.weight' has a type (99) gguf-py does not know"


def test_a_missing_tensor(tmp_path: Path) -> None:
    file = write(tmp_path / "no-down.gguf", shapes={k: v for k, v in SHAPES.items() if k != "blk.0.ffn_down.weight"})
    assert refused_at_load(file) == (f"{file}: no tensor 'blk.0.ffn_down.weight' (model.layers.0.mlp.down_proj."
                                     "weight), which the model reads (its config: num_hidden_layers 1)")


def test_a_24_byte_file(tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "empty.gguf"
    file.write_bytes(header_only())
    message = f"{file}: the file holds no tensors (a header of 24 bytes and no weights)"
    assert refused_at_load(file) == message
    assert register(file, home, capsys) == (1, f"infermesh model: {message}\n")
    file.write_bytes(header_only(n_kv=7))
    assert refused_at_load(file) == (f"{file}: the header declares 7 metadata keys; the 0 bytes left in the file "
                                     "(of 24) hold at most 0")


def test_a_tensor_count_larger_than_the_file_can_hold(tmp_path: Path, home: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "counted.gguf"
    file.write_bytes(header_only(n_tensors=1 << 40))
    message = (f"{file}: the header declares 1099511627776 tensors; the 0 bytes left after its metadata (of 24) "
               "hold at most 0")
    assert refused_at_load(file) == message
    assert register(file, home, capsys) == (1, f"infermesh model: {message}\n")
    data = bytearray(write(tmp_path / "real.gguf").read_bytes())          # a real file's count raised
    struct.pack_into("<Q", data, 8, 10 ** 6)
    file.write_bytes(bytes(data))
    assert re.fullmatch(rf"{file}: the header declares 1000000 tensors; the \d+ bytes left after its metadata "
                        rf"\(of {len(data)}\) hold at most \d+", refused_at_load(file))


@pytest.mark.parametrize("alignment", [0, -64])
def test_an_alignment_that_would_start_the_data_inside_the_header(tmp_path: Path, alignment: int) -> None:
    """With -64 the data's start rounded "up" lands before the header's end: weights read from the header's bytes."""
    file = write(tmp_path / f"aligned{alignment}.gguf", alignment=alignment)
    assert refused_at_load(file) == (f"{file}: general.alignment {alignment} is not a positive whole number (the "
                                     "tensors' data would not start after the header)")


def test_a_hot_swap_to_a_bad_file_is_refused_before_the_running_weights_go(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """LoadVersion with too little memory for two versions drains the engine and frees its weights before it builds
    the new ones: a file that would fail, or another architecture, is refused first (INVALID_ARGUMENT), and the
    running version serves on (before, the engine was left drained with no model)."""
    import asyncio

    import grpc
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshpb.v1 import engine_pb2
    from services.engine.rpcs import lifecycle
    from tests.service.test_engine_server import request, serving
    from tests.service.test_hot_swap import tiny

    torch.manual_seed(0)
    running = tmp_path / "running"                  # the sizes of CONFIG: the same architecture and cache shapes
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
                                 num_attention_heads=HEADS, num_key_value_heads=KV,
                                 max_position_embeddings=128)).save_pretrained(running)
    bad = folder_of(write(tmp_path / "swap.gguf", shapes={**SHAPES, "blk.0.ffn_up.weight": (INTER, 32)}))
    other = tiny(tmp_path / "other", 1)             # two layers of 8-wide heads
    monkeypatch.setattr(lifecycle, "available_bytes", lambda: 1)

    async def scenario() -> None:
        async with serving(running) as (stub, servicer):
            for folder, message in (
                    (bad, f"version 2: {bad / 'model.gguf'}: tensor 'blk.0.ffn_up.weight' (model.layers.0.mlp."
                          "up_proj.weight) has shape (128, 32) in the file (dims [32, 128]); the config "
                          "(intermediate_size 128, hidden_size 64) expects (128, 64)"),
                    (other, f"{other}: a different architecture (num_layers, head_dim) cannot replace the running "
                            "model in place; start another engine for it")):
                swap = engine_pb2.LoadVersionRequest(version="2", folder=str(folder), activate=True)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.LoadVersion(swap)
                assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
                assert servicer.engine.versions.loaded() == ["1"] and not servicer.draining
                assert len([i async for r in stub.Generate(request("after")) for i in r.ids]) == 3

    asyncio.run(asyncio.wait_for(scenario(), 120))
