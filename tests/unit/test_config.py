"""Every process's config refuses what cannot work, with a message naming the setting."""

import os

import pytest

from infermesh.launcher import MeshConfig, plan
from mesh.apikeys import ApiKeys, digest, load_keys
from mesh.discovery import Endpoint, parse_endpoint
from services.cache.config import CacheConfig
from services.edge.config import EdgeConfig
from services.engine.config import EngineConfig
from services.router.config import RouterConfig
from services.tokenizer.config import TokenizerConfig

ENGINE = (Endpoint("engine", "engine-0", "127.0.0.1:50060"),)


@pytest.mark.parametrize("make,match", [
    (lambda: EngineConfig(model_path="/m", dtype="float16"), "dtype"),
    (lambda: EngineConfig(model_path="/m", port=0), "port"),
    (lambda: EngineConfig(model_path="/m", threads=-1), "threads"),
    (lambda: EngineConfig(model_path="/m", cuda_graphs="on"), "cuda_graphs"),
    (lambda: TokenizerConfig(models=()), "at least one model"),
    (lambda: TokenizerConfig(models=(("a", "/x"), ("a", "/y"))), "unique"),
    (lambda: RouterConfig(tokenizer="t:1", engines=()), "at least one engine"),
    (lambda: RouterConfig(tokenizer="t:1", engines=ENGINE, policy="random"), "policy"),
    (lambda: CacheConfig(session_ttl_s=0), "session_ttl_s"),
    (lambda: EdgeConfig(host="0.0.0.0"), "API keys"),
    (lambda: MeshConfig(engines=0), "engines"),
    (lambda: MeshConfig(discovery="dns"), "discovery"),
    (lambda: MeshConfig(engines=1, versions=("1", "2")), "2 versions need at least as many --engines"),
    (lambda: MeshConfig(engines=2, versions=("1", "1")), "names a version twice"),
    (lambda: MeshConfig(versions=("a b",)), "letters, digits"),
    (lambda: MeshConfig(engine_threads=-1), "--engine-threads"),
    (lambda: MeshConfig(engines=1, models=("a", "b")), "2 models need at least as many --engines"),
    (lambda: MeshConfig(engines=2, models=("a", "b"), versions=("1", "2")), "--version is for one --model"),
])
def test_invalid_configs_are_refused(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        make()


def test_non_loopback_edge_with_keys_is_allowed() -> None:
    assert EdgeConfig(host="0.0.0.0", api_key_digests=(digest("k"),)).host == "0.0.0.0"


def test_engine_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.engine.__main__ import parse

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("INFERMESH_ENGINE_MAX_RUNNING", "256")
    config = parse(["--model", f"m={tmp_path}", "--cuda-graphs", "off", "--device", "cuda"])
    assert (config.cuda_graphs, config.device, config.max_running) == ("off", "cuda", 256)
    with pytest.raises(SystemExit):
        parse(["--model", f"m={tmp_path}", "--cuda-graphs", "always"])
    monkeypatch.setenv("INFERMESH_ENGINE_FAIR_SLOWDOWN", "2.5")
    assert parse(["--model", f"m={tmp_path}"]).fair_slowdown == 2.5
    assert parse(["--model", f"m={tmp_path}", "--fair-slowdown", "0"]).fair_slowdown == 0


@pytest.mark.parametrize("slowdown", ["0.5", "-1", "101"])
def test_a_fair_slowdown_out_of_range_is_refused_by_name(slowdown: str, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from services.engine.__main__ import parse

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit):
        parse(["--model", f"m={tmp_path}", "--fair-slowdown", slowdown])
    assert "must be 0 (no row cap) or from 1 to 100" in capsys.readouterr().err


def test_endpoint_parsing() -> None:
    assert parse_endpoint("engine", "e1=127.0.0.1:5").replica_id == "e1"
    with pytest.raises(ValueError):
        parse_endpoint("engine", "nonsense")


def test_api_keys_hashed_and_checked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    keyfile = tmp_path / "keys"
    keyfile.write_text("# ops\nk2\n")
    keys = ApiKeys(load_keys({"INFERMESH_API_KEYS": "k1, ", "INFERMESH_API_KEYS_FILE": str(keyfile)}))
    assert keys.check("Bearer k1") and keys.check("Bearer k2")
    assert not keys.check("Bearer k3") and not keys.check("k1") and not keys.check("")
    assert ApiKeys(()).check("")


def test_launch_plan_gives_every_process_a_replica_id() -> None:
    stages = plan(MeshConfig(engines=2, port_offset=100))
    names = [c.name for stage in stages for c in stage]
    assert names == ["cache-0", "tokenizer-0", "engine-0", "engine-1", "router-0", "edge-0"]
    for stage in stages:
        for child in stage:
            assert child.argv[child.argv.index("--replica-id") + 1] == child.name
    router = stages[1][0]
    assert "engine-1=127.0.0.1:50161" in router.argv


def test_engines_share_out_the_cpus_this_process_may_use_unless_told() -> None:
    def threads(config: MeshConfig) -> list[str]:
        return [c.argv[c.argv.index("--threads") + 1] for stage in plan(config) for c in stage if "--threads" in c.argv]

    cpus = len(os.sched_getaffinity(0))
    assert threads(MeshConfig(engines=2)) == [str(max(1, cpus // 2))] * 2
    assert threads(MeshConfig(engines=1, fallback_engines=1, engine_threads=3)) == ["3", "3"]


def test_launch_plan_with_replicated_routers_and_tokenizers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stages = plan(MeshConfig(engines=2, routers=2, tokenizers=3, port_offset=100, cache_dir=str(tmp_path)))
    names = [c.name for stage in stages for c in stage]
    assert names == ["cache-0", "tokenizer-0", "tokenizer-1", "tokenizer-2", "engine-0", "engine-1",
                     "router-0", "router-1", "edge-0"]
    children = {c.name: c for stage in stages for c in stage}

    def flag(name: str, option: str) -> str:
        argv = children[name].argv
        return argv[argv.index(option) + 1]

    tokenizers = "127.0.0.1:50152,127.0.0.1:50141,127.0.0.1:50142"
    assert [flag(f"tokenizer-{i}", "--port") for i in range(3)] == ["50152", "50141", "50142"]
    assert flag("router-0", "--tokenizer") == flag("router-1", "--tokenizer") == tokenizers
    assert [flag(f"router-{i}", "--port") for i in range(2)] == ["50151", "50131"]
    assert [flag(f"router-{i}", "--metrics-port") for i in range(2)] == ["9280", "9261"]
    assert flag("edge-0", "--router") == "127.0.0.1:50151,127.0.0.1:50131"
    assert flag("cache-0", "--cold-dir") == str(tmp_path / "blocks")
    assert flag("cache-0", "--sessions-dir") == str(tmp_path)
    assert flag("cache-0", "--objects-dir") == str(tmp_path)          # stored responses, with Redis sessions too
    assert "--sessions-dir" not in plan(MeshConfig(cache_dir="none"))[0][0].argv
    with pytest.raises(ValueError, match="--routers"):
        MeshConfig(routers=0)


def test_versions_are_dealt_out_to_engines_and_the_first_is_the_default() -> None:
    stages = plan(MeshConfig(engines=3, versions=("1", "2=/models/v2")))
    engines = stages[0][2:]
    assert [e.argv[e.argv.index("--model-version") + 1] for e in engines] == ["1", "2", "1"]
    assert [e.argv[e.argv.index("--model") + 1] for e in engines] == ["default", "smollm2-135m=/models/v2", "default"]
    router = stages[1][0]
    assert router.argv[router.argv.index("--default-version") + 1] == "smollm2-135m=1"


def test_several_models_are_dealt_out_to_engines_and_all_reach_the_tokenizer() -> None:
    stages = plan(MeshConfig(engines=4, models=("a", "b", "c")))
    engines = stages[0][2:]
    assert [e.argv[e.argv.index("--model") + 1] for e in engines] == ["a", "b", "c", "a"]
    tokenizer = next(c for c in stages[0] if c.name.startswith("tokenizer"))
    assert [tokenizer.argv[i + 1] for i, a in enumerate(tokenizer.argv) if a == "--model"] == ["a", "b", "c"]


def test_a_draft_model_goes_to_the_first_models_engines_only() -> None:
    stages = plan(MeshConfig(engines=3, models=("big", "other"), draft_model="small"))
    drafts = [e.argv[e.argv.index("--draft-model") + 1] if "--draft-model" in e.argv else "" for e in stages[0][2:]]
    assert drafts == ["small", "", "small"]
    assert all("--draft-model" not in c.argv for stage in plan(MeshConfig()) for c in stage)


def test_engine_draft_model_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.engine.__main__ import parse

    for name in ("big", "small"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"model_type": "llama"}')
        (tmp_path / name / "tokenizer.json").write_text("{}")
    config = parse(["--model", f"big={tmp_path / 'big'}", "--draft-model", f"small={tmp_path / 'small'}"])
    assert (config.draft_model, config.draft_model_path) == ("small", str(tmp_path / "small"))
    assert parse(["--model", f"big={tmp_path / 'big'}"]).draft_model_path == ""


def test_admin_keys_are_read_from_their_own_variables() -> None:
    admin = ApiKeys(load_keys({"INFERMESH_API_KEYS": "user", "INFERMESH_ADMIN_KEYS": "boss"},
                              variable="INFERMESH_ADMIN_KEYS"))
    assert admin.check("Bearer boss") and not admin.check("Bearer user")
