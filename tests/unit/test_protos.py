"""Every generated meshpb.v1 module imports, and each service's contract is complete."""

import importlib

import pytest

MODULES = ["common", "tokenizer", "engine", "router", "cache", "safety"]


@pytest.mark.parametrize("name", MODULES)
def test_generated_modules_import(name: str) -> None:
    importlib.import_module(f"meshpb.v1.{name}_pb2")
    importlib.import_module(f"meshpb.v1.{name}_pb2_grpc")


@pytest.mark.parametrize("service,rpcs", [
    ("tokenizer", {"ApplyChatTemplate", "Encode", "GetTokenizerJson"}),
    ("engine", {"Generate", "Abort", "WatchLoad", "GetInfo", "LoadVersion", "Drain", "LoadAdapter", "UnloadAdapter"}),
    ("router", {"Generate", "ListModels", "ListReplicas", "GetModelRouting", "SetModelRouting", "LoadModelVersion",
                "DrainReplica", "AddReplica", "Tokenize", "Detokenize", "ForgetConversation", "StoreTurn",
                "LoadLoraAdapter", "UnloadLoraAdapter", "ListLoraAdapters"}),
    ("cache", {"PutBlocks", "GetBlocks", "MatchPrefix", "GetStats", "GetSession", "AppendSession",
               "DeleteSession", "GetCheckpointFile", "GetResponse", "PutResponse", "PutObject", "GetObject",
               "ListObjects", "DeleteObject"}),
    ("safety", {"Classify"}),
])
def test_service_contracts(service: str, rpcs: set[str]) -> None:
    module = importlib.import_module(f"meshpb.v1.{service}_pb2")
    (svc,) = module.DESCRIPTOR.services_by_name.values()
    assert {m.name for m in svc.methods} == rpcs
