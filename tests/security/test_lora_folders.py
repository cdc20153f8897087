"""Issue 49, item 8: LoRA folders and files are checked before the engine holds them
(services/engine/runtime/: lora_checks.py, lora.py, lora_gguf.py); LoadAdapter refuses a bad one with
INVALID_ARGUMENT and a message naming the field or the tensor, what was expected and what the adapter has.

Before, r=0, a list for alpha_pattern or a 24-byte .gguf file gave INTERNAL with raw exception text, and an
adapter with NaN factors loaded, failed the first step it ran in (every request of that step) and had the router
exclude the replica.  adapter_model.bin is read with torch's weights_only reader: a pickle that would run code is
refused, and its code never runs.  The pool is driven directly on a small base's sizes (no model), and once over
the engine's gRPC LoadAdapter.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from mesh.errors import InvalidArgument
from mesh.grpcutil import Service, channel
from mesh.models.gguf_header import read_header
from meshpb.v1 import engine_pb2, engine_pb2_grpc
from services.engine.rpcs.adapters import AdapterRPCs
from services.engine.runtime.adapters import AdapterPool
from services.engine.runtime.lora import Shape
from tests.lora_adapters import random_adapter, write_gguf_lora

BASE = SimpleNamespace(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                       num_hidden_layers=2)
SHAPE = Shape(layers=2, hidden=32, q_out=32, kv_out=16, intermediate=64, heads=4, kv_heads=2)
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
DOWN_B = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return random_adapter(BASE, tmp_path / "good", seed=0, rank=4)


def refused(path: Path, dtype: torch.dtype = torch.float32) -> str:
    """The pool's InvalidArgument for `path`, without its "adapter 'x': " prefix."""
    with pytest.raises(InvalidArgument) as caught:
        AdapterPool(SHAPE, dtype).load("x", path)
    assert caught.value.message.startswith("adapter 'x': ")
    return caught.value.message.removeprefix("adapter 'x': ")


def with_config(good: Path, **changes: Any) -> Path:
    folder = good.with_name(f"config-{len(list(good.parent.iterdir()))}")
    shutil.copytree(good, folder)
    config = json.loads((good / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return folder


def with_tensors(good: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    folder = good.with_name(f"tensors-{len(list(good.parent.iterdir()))}")
    shutil.copytree(good, folder)
    tensors = load_file(str(good / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_good_adapters_load(good: Path, tmp_path: Path) -> None:
    pool = AdapterPool(SHAPE, torch.float32)
    assert pool.load("peft", good).rank == 4
    assert pool.load("gguf", write_gguf_lora(good, tmp_path / "good.gguf", 4, 2)).rank == 4
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    shutil.copy(good / "adapter_config.json", bin_folder)
    torch.save(load_file(str(good / "adapter_model.safetensors")), bin_folder / "adapter_model.bin")
    assert pool.load("bin", bin_folder).nbytes == pool.load("peft", good).nbytes
    assert pool.names() == ["bin", "gguf", "peft"]


RANK = "r {} is not a positive whole number (the adapter's rank)"
ALPHA = "lora_alpha {} is not a finite positive number"
TARGETS = "target_modules {} is not a module name (or pattern) or a list of them"
FINITE, WHOLE = "finite positive numbers", "positive whole numbers"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("r", 0, RANK.format(0)), ("r", -4, RANK.format(-4)), ("r", 4.0, RANK.format(4.0)), ("r", "4", RANK.format("'4'")),
    ("r", True, RANK.format(True)), ("r", None, RANK.format(None)),
    ("lora_alpha", 0, ALPHA.format(0)), ("lora_alpha", -8, ALPHA.format(-8)), ("lora_alpha", "8", ALPHA.format("'8'")),
    ("lora_alpha", float("nan"), ALPHA.format("nan")), ("lora_alpha", float("inf"), ALPHA.format("inf")),
    ("lora_alpha", True, ALPHA.format(True)),
    ("alpha_pattern", ["q_proj"], f"alpha_pattern ['q_proj'] is not an object of module name -> {FINITE}"),
    ("alpha_pattern", {"q_proj": "2"}, f"alpha_pattern['q_proj'] is '2'; its values are {FINITE}"),
    ("alpha_pattern", {"q_proj": float("nan")}, f"alpha_pattern['q_proj'] is nan; its values are {FINITE}"),
    ("rank_pattern", ["q_proj"], f"rank_pattern ['q_proj'] is not an object of module name -> {WHOLE}"),
    ("rank_pattern", {"v_proj": 2.5}, f"rank_pattern['v_proj'] is 2.5; its values are {WHOLE}"),
    ("target_modules", 7, TARGETS.format(7)), ("target_modules", [], TARGETS.format([])),
    ("target_modules", ["q_proj", 3], TARGETS.format(["q_proj", 3])),
    ("target_modules", {"q_proj": 1}, TARGETS.format({"q_proj": 1})),
    ("use_rslora", "false", "use_rslora 'false' is not true or false"),
])
def test_config_fields_are_refused_by_name(good: Path, field: str, value: Any, message: str) -> None:
    folder = with_config(good, **{field: value})
    assert refused(folder) == f"{folder / 'adapter_config.json'}: {message}"


def test_a_config_that_is_not_an_object_or_not_json(good: Path) -> None:
    folder = with_config(good)
    (folder / "adapter_config.json").write_text("[4, 8]")
    assert refused(folder) == f"{folder / 'adapter_config.json'}: adapter_config.json holds list [4, 8], not an object"
    (folder / "adapter_config.json").write_text('{"r": 4,')
    assert refused(folder).startswith(f"{folder / 'adapter_config.json'}: not JSON (Expecting property name")


def test_a_factor_with_nan_or_infinite_values_is_named(good: Path) -> None:
    def nan(t: dict[str, torch.Tensor]) -> None:
        t[DOWN_B][3, 1] = float("nan")

    def inf(t: dict[str, torch.Tensor]) -> None:
        t[Q_A][0, :2] = float("inf")

    for change, name, count, size in ((nan, DOWN_B, 1, 32 * 4), (inf, Q_A, 2, 4 * 32)):
        folder = with_tensors(good, change)
        weights = folder / "adapter_model.safetensors"
        assert refused(folder) == f"{weights}: tensor {name!r} has {count} NaN or infinite values (of {size})"


def test_a_factor_beyond_float16_once_scaled_is_named(good: Path) -> None:
    """An engine on the CPU kernel's reduced plans keeps factors in float16 (adapters.factor_dtype): lora_B times
    alpha / r (here 8 / 4) above 65504 would be infinite there."""
    def big(t: dict[str, torch.Tensor]) -> None:
        t[Q_B][0, 0] = 40000.0

    folder = with_tensors(good, big)
    assert refused(folder, torch.float16) == (f"{folder}: tensor {Q_B!r} times its scale 2 reaches 8e+04, beyond "
                                              "torch.float16, in which this engine keeps adapters")
    AdapterPool(SHAPE, torch.float32).load("x", folder)           # float32 holds it


def test_a_factor_of_the_wrong_shape_is_named_with_expected_and_got(good: Path) -> None:
    wide = with_tensors(good, lambda t: t.update({Q_A: torch.zeros(4, 48)}))
    assert refused(wide) == (f"{wide}: tensor {Q_A!r} has shape (4, 48); the model's layer 0 q_proj (32 -> 32) at "
                             "rank 4 expects (4, 32): an adapter of another base?")
    ranks = with_tensors(good, lambda t: t.update({Q_B: torch.zeros(32, 3)}))
    assert refused(ranks) == (f"{ranks}: tensor {Q_B!r} has shape (32, 3); the model's layer 0 q_proj (32 -> 32) at "
                              "rank 4 expects (32, 4): an adapter of another base?")
    for bad, why in ((torch.zeros(0, 32), "has shape (0, 32)"), (torch.zeros(32), "has shape (32,)")):
        folder = with_tensors(good, lambda t, bad=bad: t.update({Q_A: bad}))        # rank 0 divided by zero before
        assert refused(folder) == (f"{folder / 'adapter_model.safetensors'}: tensor {Q_A!r} {why}; a LoRA factor is "
                                   "a matrix of rank x inputs (lora_A) or outputs x rank (lora_B), none of them 0")
    ints = with_tensors(good, lambda t: t.update({Q_A: torch.zeros(4, 32, dtype=torch.int32)}))
    assert refused(ints) == (f"{ints / 'adapter_model.safetensors'}: tensor {Q_A!r} is torch.int32; LoRA factors are "
                             "floating point")


def header_only(n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def test_a_short_or_malformed_gguf_lora_file(good: Path, tmp_path: Path) -> None:
    file = tmp_path / "short.gguf"
    for data, message in (
            (header_only(), "general.type None / adapter.type None: not a LoRA adapter (llama.cpp's "
                            "convert_lora_to_gguf.py writes 'adapter' / 'lora')"),
            (header_only(n_tensors=3), "the header declares 3 tensors; the 0 bytes left after its metadata (of 24) "
                                       "hold at most 0"),
            (header_only()[:10], "the GGUF header ends early (it needs 8 bytes at byte 8; the file has 10)"),
            (b"PK\x03\x04" + bytes(20), "not a GGUF file (it does not start with b'GGUF')")):
        file.write_bytes(data)
        assert refused(file) == f"{file}: {message}"
    lora = write_gguf_lora(good, tmp_path / "cut.gguf", 4, 2)
    last = read_header(lora).tensors[-1]
    lora.write_bytes(lora.read_bytes()[:-64])
    assert refused(lora) == (f"{lora}: tensor {last.name!r} (F32, dims {list(last.dims)}: {last.nbytes} bytes at byte "
                             f"{last.offset}) runs past the end of the file ({lora.stat().st_size} bytes): the file is "
                             "truncated or its header is wrong")
    nan_alpha = with_config(good, lora_alpha=float("nan"))          # the converter copies it into the file
    alpha = write_gguf_lora(nan_alpha, tmp_path / "nan-alpha.gguf", 4, 2)
    assert refused(alpha) == f"{alpha}: adapter.lora.alpha nan is not a finite positive number (or 0: none)"


class Payload:
    """A pickle that runs code when loaded: makes the folder `marker` (a harmless stand-in for any call)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.makedirs, (str(self.marker),)


def test_adapter_model_bin_is_read_weights_only(good: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(good / "adapter_config.json", folder)
    marker = tmp_path / "ran"
    torch.save({Q_A: torch.zeros(4, 32), "payload": Payload(marker)}, folder / "adapter_model.bin")
    message = (f"{folder / 'adapter_model.bin'}: torch's weights_only reader refuses it (adapter_model.bin may hold "
               "tensors and plain containers only; adapter_model.safetensors is the safe format)")
    assert refused(folder) == message
    assert not marker.exists()
    (folder / "adapter_model.bin").write_bytes(b"not a pickle at all")
    assert refused(folder) == message
    torch.save([torch.zeros(4, 32)], folder / "adapter_model.bin")
    assert refused(folder) == f"{folder / 'adapter_model.bin'}: holds a list, not a dict of tensor name -> tensor"


class Servicer(AdapterRPCs, engine_pb2_grpc.EngineServicer):
    def __init__(self) -> None:
        self.engine = SimpleNamespace(adapters=AdapterPool(SHAPE, torch.float32))
        self.config = SimpleNamespace(replica_id="lora-checks", lora_roots=())


def test_load_adapter_over_grpc_is_invalid_argument_naming_the_field(good: Path, tmp_path: Path) -> None:
    zero = with_config(good, r=0)
    short = tmp_path / "short.gguf"
    short.write_bytes(header_only(n_tensors=3))

    async def scenario() -> None:
        service = Service("meshpb.v1.Engine", "127.0.0.1", 0)
        engine_pb2_grpc.add_EngineServicer_to_server(Servicer(), service.server)
        await service.start()
        ch = channel(f"127.0.0.1:{service.port}")
        try:
            stub = engine_pb2_grpc.EngineStub(ch)
            for path, message in ((zero, f"{zero / 'adapter_config.json'}: {RANK.format(0)}"),
                                  (short, f"{short}: the header declares 3 tensors; the 0 bytes left after its "
                                          "metadata (of 24) hold at most 0")):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.LoadAdapter(engine_pb2.LoadAdapterRequest(name="a", path=str(path)))
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert caught.value.details() == f"adapter 'a': {message}"
            loaded = await stub.LoadAdapter(engine_pb2.LoadAdapterRequest(name="a", path=str(good)))
            assert list(loaded.adapters) == ["a"]
        finally:
            await ch.close()
            await service.stop(0)

    asyncio.run(scenario())
