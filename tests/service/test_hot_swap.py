"""Issue 21: a model version swapped in place (services/engine/runtime/versions.py), on tiny random Llamas whose
two versions differ in every weight: requests started before the switch finish on v1's weights, those
after run on v2's, the prefix cache never serves one version's blocks to the other, and v1's weights are
released once no request holds them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesh.errors import FailedPrecondition, InvalidArgument
from services.engine.core.request import SamplingParams
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def tiny(path: Path, seed: int, layers: int = 2) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny(tmp_path_factory.mktemp("v1"), 0), tiny(tmp_path_factory.mktemp("v2"), 1)


def engine_on(folder: Path) -> Engine:
    return Engine(ModelRunner(folder, decide(device="cpu", dtype="float32"), kv_cache_bytes=1 << 20, block_size=4),
                  version="1")


def run_to_end(engine: Engine, outputs: dict[str, list[int]], cached: dict[str, int]) -> None:
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_ids)
            if out.finish_reason is not None:
                cached[out.request_id] = out.cached_tokens


def alone(folder: Path, prompt: list[int]) -> list[int]:
    engine = engine_on(folder)
    engine.add(engine.make_request("x", prompt, GREEDY))
    outputs: dict[str, list[int]] = {}
    run_to_end(engine, outputs, {})
    return outputs["x"]


def test_a_swap_mid_stream_keeps_old_requests_on_old_weights_and_releases_them(folders: tuple[Path, Path]) -> None:
    v1, v2 = folders
    before, after = alone(v1, PROMPT), alone(v2, PROMPT)
    assert before != after                              # the versions answer differently
    engine = engine_on(v1)
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    engine.add(engine.make_request("old", PROMPT, GREEDY))
    for _ in range(4):                                  # under way: prefill and a few tokens on v1
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_ids)
    engine.versions.build("2", v2)
    engine.versions.activate("2")
    assert engine.versions.loaded() == ["1", "2"] and engine.versions.active == "1"   # not before a step
    for out in engine.step():                           # the switch comes first in this step
        outputs.setdefault(out.request_id, []).extend(out.new_ids)
    assert engine.versions.active == "2"
    new = engine.make_request("new", PROMPT, GREEDY)    # the same prompt: v1's cached blocks must not serve it
    assert new.version == "2" and engine.versions.salt("2") in new.cache_salt
    engine.add(new)
    del new
    run_to_end(engine, outputs, cached)
    assert outputs["old"] == before and outputs["new"] == after
    assert cached["new"] == 0                           # no block of v1's crossed over
    assert engine.versions.released == ["1"] and engine.versions.loaded() == ["2"]
    engine.add(engine.make_request("again", PROMPT, GREEDY))
    run_to_end(engine, outputs, cached)
    assert outputs["again"] == after and cached["again"] > 0    # v2's own blocks do serve v2


def test_rollback_while_the_old_version_is_loaded_is_a_switch(folders: tuple[Path, Path]) -> None:
    v1, v2 = folders
    engine = engine_on(v1)
    engine.add(engine.make_request("holder", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True)))
    engine.step()
    engine.versions.build("2", v2)
    engine.versions.activate("2")
    engine.step()
    engine.versions.activate("1")                        # still loaded: its request holds it
    engine.step()
    assert engine.versions.active == "1"
    outputs: dict[str, list[int]] = {}
    engine.add(engine.make_request("back", PROMPT, GREEDY))
    run_to_end(engine, outputs, {})
    assert outputs["back"] == alone(v1, PROMPT)
    assert engine.versions.released == ["2"]


def test_a_version_built_and_not_yet_active_outlives_the_steps_before_its_activation(folders: tuple[Path, Path]
                                                                                     ) -> None:
    """The race the e2e swap met on a busy machine: a step ends between the build and the activation
    (or the version is loaded now and activated later): it must still be there to activate."""
    v1, v2 = folders
    engine = engine_on(v1)
    engine.add(engine.make_request("busy", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)))
    engine.versions.build("2", v2)
    for _ in range(3):
        engine.step()
    assert engine.versions.loaded() == ["1", "2"] and engine.versions.released == []
    engine.versions.activate("2")
    engine.step()
    assert engine.versions.active == "2"
    engine.add(engine.make_request("after", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)))
    run_to_end(engine, {}, {})                          # v1 freed once "busy" ended, while "after" runs
    assert engine.versions.released == ["1"] and engine.versions.loaded() == ["2"]


def test_a_version_that_cannot_share_the_cache_is_refused(folders: tuple[Path, Path], tmp_path: Path) -> None:
    engine = engine_on(folders[0])
    with pytest.raises(InvalidArgument, match="num_layers"):
        engine.versions.build("3", tiny(tmp_path / "deeper", 2, layers=3))
    with pytest.raises(FailedPrecondition, match="is not loaded here"):
        engine.versions.activate("9")
    with pytest.raises(FailedPrecondition, match="loaded already"):
        engine.versions.build("1", folders[0])
    assert engine.versions.loaded() == ["1"]


def test_replace_frees_the_running_weights_before_loading(folders: tuple[Path, Path]) -> None:
    v1, v2 = folders
    engine = engine_on(v1)
    engine.versions.replace("2", v2)
    assert engine.versions.active == "2" and engine.versions.loaded() == ["2"] and engine.versions.released == ["1"]
    outputs: dict[str, list[int]] = {}
    engine.add(engine.make_request("x", PROMPT, GREEDY))
    run_to_end(engine, outputs, {})
    assert outputs["x"] == alone(v2, PROMPT)


def test_load_version_over_grpc_beside_or_drained_when_memory_is_short(folders: tuple[Path, Path],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """LoadVersion: loaded beside (GetInfo lists both, then v1 is released); and when the weights would not fit
    beside, the engine drains (new calls UNAVAILABLE) and replaces them; activate=false then is refused."""
    import asyncio

    import grpc

    from meshpb.v1 import engine_pb2
    from services.engine.rpcs import lifecycle
    from tests.service.test_engine_server import request, serving

    v1, v2 = folders

    async def scenario() -> None:
        async with serving(v1) as (stub, servicer):
            reply = await stub.LoadVersion(engine_pb2.LoadVersionRequest(version="2", folder=str(v2), activate=True))
            assert reply.active_version == "2" and list(reply.loaded_versions) in (["1", "2"], ["2"])
            info = await stub.GetInfo(engine_pb2.EngineInfoRequest())
            assert info.model_version == "2"
            ids = [i async for r in stub.Generate(request("after")) for i in r.ids]
            assert len(ids) == 3
            for _ in range(40):                     # idle: v1, held by nothing, is released within ~1 s
                if servicer.engine.versions.loaded() == ["2"]:
                    break
                await asyncio.sleep(0.1)
            assert servicer.engine.versions.loaded() == ["2"]
            monkeypatch.setattr(lifecycle, "available_bytes", lambda: 1)      # no room for two versions
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.LoadVersion(engine_pb2.LoadVersionRequest(version="3", folder=str(v1)))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "do not fit beside" in (refused.value.details() or "")
            servicer.draining = True                # as the replacement runs: new calls go elsewhere
            with pytest.raises(grpc.aio.AioRpcError) as draining:
                async for _ in stub.Generate(request("during")):
                    pass
            assert draining.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in (draining.value.details()
                                                                                           or "")
            servicer.draining = False
            reply = await stub.LoadVersion(engine_pb2.LoadVersionRequest(version="3", folder=str(v1), activate=True))
            assert reply.active_version == "3" and list(reply.loaded_versions) == ["3"]
            assert not servicer.draining
            ids = [i async for r in stub.Generate(request("back")) for i in r.ids]
            assert len(ids) == 3

    asyncio.run(asyncio.wait_for(scenario(), 120))
