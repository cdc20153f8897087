"""Issue 21: signed, incremental checkpoints (mesh/checkpoints): publish, sync of only the missing chunks,
and refusal of a tampered chunk, an altered manifest and an untrusted key (nothing made loadable)."""

from __future__ import annotations

import functools
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.checkpoints.manifest import (
    CheckpointError,
    chunk_path,
    generate_key,
    manifest_bytes,
    manifest_path,
    parse_manifest,
    sign,
)
from mesh.checkpoints.ship import publish, sync

CHUNK = 64 << 10


def model_folder(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "model.safetensors").write_bytes(weights)
    (root / ".hidden").write_text("not published")
    return root


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    """(signing key file, trusted keys folder holding its public half)."""
    private = tmp_path / "keys" / "signing.key"
    public = generate_key(private)
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "publisher.pub").write_bytes(public.read_bytes())
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    return private, trusted


@pytest.fixture
def versions(tmp_path: Path, keys: tuple[Path, Path]) -> tuple[Path, bytes, bytes]:
    """A store with v1 and v2 of "m": v2 changes two 50 KB spans of a 3 MiB weights file."""
    v1 = os.urandom(3 << 20)
    v2 = bytearray(v1)
    for start in (400_000, 2_000_000):
        v2[start:start + 50_000] = os.urandom(50_000)
    store = tmp_path / "store"
    publish("m", "1", model_folder(tmp_path / "v1", v1), store, keys[0], chunk_bytes=CHUNK)
    published = publish("m", "2", model_folder(tmp_path / "v2", bytes(v2)), store, keys[0], chunk_bytes=CHUNK)
    assert published.chunks_written <= 4            # only v2's changed chunks were new to the store
    return store, v1, bytes(v2)


def test_sync_moves_only_the_chunks_it_lacks(tmp_path: Path, keys: tuple[Path, Path],
                                             versions: tuple[Path, bytes, bytes]) -> None:
    store, v1, v2 = versions
    local = tmp_path / "local"
    first = sync(str(store), "m", "1", trusted=keys[1], store=local, target=tmp_path / "models" / "m" / "1")
    assert (first.folder / "model.safetensors").read_bytes() == v1
    assert sorted(p.name for p in first.folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert first.chunks_fetched == 48 + 2 and first.bytes_fetched >= 3 << 20      # everything, the first time
    second = sync(str(store), "m", "2", trusted=keys[1], store=local, target=tmp_path / "models" / "m" / "2")
    assert (second.folder / "model.safetensors").read_bytes() == v2
    # Two changed spans of 50 KB touch at most 4 of the 64 KiB chunks: under 10% of the version's bytes.
    assert second.chunks_fetched <= 4 and second.bytes_fetched <= 0.10 * second.size
    assert second.key_id == first.key_id


def test_a_tampered_chunk_is_refused_and_nothing_is_activated(tmp_path: Path, keys: tuple[Path, Path],
                                                              versions: tuple[Path, bytes, bytes]) -> None:
    store, _, _ = versions
    import zstandard

    manifest = parse_manifest(manifest_path(store, "m", "2").read_bytes(), "m", "2")
    victim = chunk_path(store, manifest.files[1].chunks[3])
    victim.write_bytes(zstandard.ZstdCompressor().compress(os.urandom(CHUNK)))
    target = tmp_path / "models" / "m" / "2"
    with pytest.raises(CheckpointError, match="does not match its hash .tampered or corrupt.; nothing was activated"):
        sync(str(store), "m", "2", trusted=keys[1], store=tmp_path / "local", target=target)
    assert not target.exists() and not list(target.parent.glob("*"))


def test_an_altered_manifest_or_an_untrusted_key_is_refused(tmp_path: Path, keys: tuple[Path, Path],
                                                            versions: tuple[Path, bytes, bytes]) -> None:
    store, _, _ = versions
    target = tmp_path / "models" / "m" / "1"
    path = manifest_path(store, "m", "1")
    original = path.read_bytes()
    path.write_bytes(original.replace(b'"size": 3145728', b'"size": 3145729'))
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        sync(str(store), "m", "1", trusted=keys[1], store=tmp_path / "local", target=target)
    path.write_bytes(original)
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "other.pub").write_bytes(generate_key(tmp_path / "other" / "k.key").read_bytes())
    with pytest.raises(CheckpointError, match="not trusted here"):
        sync(str(store), "m", "1", trusted=stranger, store=tmp_path / "local", target=target)
    with pytest.raises(CheckpointError, match="not trusted here .trusted: none."):
        sync(str(store), "m", "1", trusted=tmp_path / "nowhere", store=tmp_path / "local", target=target)
    assert not target.exists()


def test_a_signed_manifest_cannot_write_outside_its_folder(tmp_path: Path, keys: tuple[Path, Path],
                                                           versions: tuple[Path, bytes, bytes]) -> None:
    store, _, _ = versions
    from mesh.checkpoints.manifest import load_private

    manifest = parse_manifest(manifest_path(store, "m", "1").read_bytes(), "m", "1")
    evil = manifest.files[0].__class__("../../escape.txt", *[getattr(manifest.files[0], f) for f in
                                                             ("size", "sha256", "chunks")])
    raw = manifest_bytes(manifest.__class__("m", "3", manifest.chunk_bytes, (evil,)))
    manifest_path(store, "m", "3").write_bytes(raw)
    manifest_path(store, "m", "3").with_suffix(".sig").write_bytes(sign(raw, load_private(keys[0])))
    with pytest.raises(CheckpointError, match="leaves the model folder"):
        sync(str(store), "m", "3", trusted=keys[1], store=tmp_path / "local", target=tmp_path / "models" / "m" / "3")
    assert not (tmp_path / "escape.txt").exists()


@pytest.fixture
def http_store(versions: tuple[Path, bytes, bytes]) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(versions[0]))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.RequestHandlerClass.log_message = lambda *args: None     # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_sync_from_an_http_store(tmp_path: Path, keys: tuple[Path, Path], versions: tuple[Path, bytes, bytes],
                                 http_store: str) -> None:
    synced = sync(http_store, "m", "2", trusted=keys[1], store=tmp_path / "local", target=tmp_path / "m2")
    assert (synced.folder / "model.safetensors").read_bytes() == versions[2]
    with pytest.raises(CheckpointError, match="HTTP 404"):
        sync(http_store, "m", "9", trusted=keys[1], store=tmp_path / "local", target=tmp_path / "m9")


def test_sync_from_a_cache_service_over_grpc(tmp_path: Path, keys: tuple[Path, Path],
                                             versions: tuple[Path, bytes, bytes]) -> None:
    """Another region's cache service serves its checkpoint store (GetCheckpointFile); only store files."""
    import asyncio

    import grpc

    from mesh.grpcutil import Service, channel
    from meshpb.v1 import cache_pb2, cache_pb2_grpc
    from services.cache.server import CacheServicer, add_to
    from services.cache.sessions import SessionStore
    from services.cache.store import BlockStore

    async def scenario() -> None:
        service = Service("meshpb.v1.Cache", "127.0.0.1", 0)
        add_to(service, CacheServicer(SessionStore(), BlockStore.create(1 << 20), checkpoint_store=versions[0]))
        await service.start()
        try:
            source = f"grpc://127.0.0.1:{service.port}"
            synced = await asyncio.to_thread(sync, source, "m", "2", keys[1], tmp_path / "local", tmp_path / "m2")
            assert (synced.folder / "model.safetensors").read_bytes() == versions[2]
            with pytest.raises(CheckpointError, match="NOT_FOUND"):
                await asyncio.to_thread(sync, source, "m", "9", keys[1], tmp_path / "local", tmp_path / "m9")
            async with channel(f"127.0.0.1:{service.port}") as ch:
                stub = cache_pb2_grpc.CacheStub(ch)
                for path in ("../secret", "manifests/m/../../x.json", "config.json"):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.GetCheckpointFile(cache_pb2.CheckpointFileRequest(path=path))
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await service.stop(0)

    asyncio.run(scenario())
