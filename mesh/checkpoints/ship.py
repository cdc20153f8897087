"""Publish and sync: model versions shipped as signed, content-addressed chunk sets.

    publish(name, version, folder, store, key)   chunks the folder into `store`, writes and signs its manifest
    sync(source, name, version, trusted)         fetches the chunks this machine lacks, checks each one and
                                                 the signature, assembles the version's folder, and only then
                                                 moves it into place (loadable)

`source`: a store folder, an http(s):// URL of one (any static file server), or grpc://HOST:PORT: a
region's cache service serving its store (`--checkpoint-store`).  The local chunk
store is `<infermesh home>/checkpoints/chunks`, so a second version costs only the chunks it
changed; the folders land in `<infermesh home>/checkpoints/models/NAME/VERSION`.
Layout, formats and keys: mesh/checkpoints/manifest.py.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zstandard

from mesh.checkpoints.manifest import (
    CHUNK_BYTES,
    CheckpointError,
    FileEntry,
    Manifest,
    chunk_path,
    files_of,
    fsync_dir,
    load_private,
    load_trusted,
    manifest_bytes,
    manifest_path,
    parse_manifest,
    read_chunks,
    sign,
    verify,
)
from mesh.files import write_atomic
from mesh.models import home

__all__ = ["CheckpointError", "Published", "Synced", "local_store", "models_root", "publish", "sync",
           "trusted_keys_dir", "signing_key_file"]

Fetch = Callable[[str], bytes]            # a store-relative path -> its bytes (CheckpointError if missing)


def local_store() -> Path:
    return home() / "checkpoints"


def models_root() -> Path:
    return home() / "checkpoints" / "models"


def trusted_keys_dir() -> Path:
    return home() / "trusted-keys"


def signing_key_file() -> Path:
    return home() / "keys" / "signing.key"


@dataclass(frozen=True)
class Published:
    manifest: Path
    chunks_written: int
    bytes_written: int               # compressed bytes new to the store
    size: int                        # the version's uncompressed bytes


@dataclass(frozen=True)
class Synced:
    folder: Path
    key_id: str
    chunks_fetched: int
    bytes_fetched: int               # compressed bytes moved from the source
    size: int                        # the version's uncompressed bytes


def publish(name: str, version: str, folder: Path, store: Path, key_file: Path,
            chunk_bytes: int = CHUNK_BYTES) -> Published:
    key = load_private(key_file)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} is not a model folder (no config.json)")
    compressor = zstandard.ZstdCompressor(level=3)
    entries, written, written_bytes = [], 0, 0
    for file in files_of(folder):
        digests, whole = [], hashlib.sha256()
        for block in read_chunks(file, chunk_bytes):
            whole.update(block)
            digest = hashlib.sha256(block).hexdigest()
            digests.append(digest)
            target = chunk_path(store, digest)
            if not target.exists():
                packed = compressor.compress(block)
                write_atomic(target, packed)
                written, written_bytes = written + 1, written_bytes + len(packed)
        entries.append(FileEntry(file.relative_to(folder).as_posix(), file.stat().st_size, whole.hexdigest(),
                                 tuple(digests)))
    manifest = Manifest(name, version, chunk_bytes, tuple(entries))
    raw = manifest_bytes(manifest)
    target = manifest_path(store, name, version)
    write_atomic(target, raw)
    write_atomic(target.with_suffix(".sig"), sign(raw, key))      # last: a manifest without it is not served
    return Published(target, written, written_bytes, manifest.size())


def fetcher(source: str) -> Fetch:
    """How to read store-relative paths from `source` (a folder or an http(s) URL)."""
    if source.startswith(("http://", "https://")):
        base = source.rstrip("/")

        def get(rel: str) -> bytes:
            try:
                with urllib.request.urlopen(f"{base}/{rel}", timeout=60) as reply:
                    return bytes(reply.read())
            except urllib.error.HTTPError as exc:
                raise CheckpointError(f"{base}/{rel}: HTTP {exc.code}") from None
            except OSError as exc:
                raise CheckpointError(f"{base}/{rel}: {exc}") from None

        return get
    if source.startswith("grpc://"):
        return _grpc_fetcher(source.removeprefix("grpc://"))
    root = Path(source).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"checkpoint source {source!r} is neither a folder nor an http(s):// or grpc:// URL")

    def read(rel: str) -> bytes:
        try:
            return (root / rel).read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{root / rel}: {exc.strerror or exc}") from None

    return read


def _grpc_fetcher(address: str) -> Fetch:
    """A region's cache service serving its checkpoint store (GetCheckpointFile), with the process's mesh
    credentials (mutual TLS) when it has them."""
    import grpc

    from mesh import credentials
    from mesh.grpcutil import CHANNEL_OPTIONS
    from meshpb.v1 import cache_pb2, cache_pb2_grpc

    tls = credentials.current()
    channel = grpc.secure_channel(address, tls.channel_credentials(),
                                  options=CHANNEL_OPTIONS + credentials.TLS_CHANNEL_OPTIONS) if tls else \
        grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = cache_pb2_grpc.CacheStub(channel)

    def get(rel: str) -> bytes:
        try:
            return bytes(stub.GetCheckpointFile(cache_pb2.CheckpointFileRequest(path=rel), timeout=120).data)
        except grpc.RpcError as err:
            raise CheckpointError(f"grpc://{address}/{rel}: {err.code().name}: {err.details()}") from None

    return get


def sync(source: str, name: str, version: str, trusted: Path | None = None, store: Path | None = None,
         target: Path | None = None, fetch: Fetch | None = None) -> Synced:
    """Bring `name` `version` here from `source`; nothing is made loadable unless every check passes."""
    store = store or local_store()
    target = target or models_root() / name / version
    fetch = fetch or fetcher(source)
    what = f"{name} {version}"
    rel = manifest_path(Path("."), name, version).as_posix()
    raw = fetch(rel)
    kid = verify(raw, fetch(rel.removesuffix(".json") + ".sig"), load_trusted(trusted or trusted_keys_dir()), what)
    manifest = parse_manifest(raw, name, version)
    fetched, fetched_bytes = 0, 0
    decompressor = zstandard.ZstdDecompressor()
    for digest in sorted(manifest.chunk_set()):
        local = chunk_path(store, digest)
        if local.exists():
            continue
        chunk_rel = chunk_path(Path("."), digest).as_posix()
        packed = fetch(chunk_rel)
        try:
            block = decompressor.decompress(packed, max_output_size=manifest.chunk_bytes)
        except zstandard.ZstdError as exc:
            raise CheckpointError(f"chunk {digest[:16]} of {what} from {source} is not valid zstd: {exc}") from None
        if hashlib.sha256(block).hexdigest() != digest:
            raise CheckpointError(f"chunk {digest[:16]} of {what} from {source} does not match its hash "
                                  "(tampered or corrupt); nothing was activated")
        write_atomic(local, packed)
        fetched, fetched_bytes = fetched + 1, fetched_bytes + len(packed)
    _assemble(manifest, store, target, decompressor)
    return Synced(target, kid, fetched, fetched_bytes, manifest.size())


def _assemble(manifest: Manifest, store: Path, target: Path, decompressor: zstandard.ZstdDecompressor) -> None:
    """Write the version's files into a temp folder beside `target`, check each file's size and hash
    (local chunks are checked again: the store may have been altered), then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for entry in manifest.files:
            out = staging / entry.path
            out.parent.mkdir(parents=True, exist_ok=True)
            whole = hashlib.sha256()
            with out.open("wb") as f:
                for digest in entry.chunks:
                    block = decompressor.decompress(chunk_path(store, digest).read_bytes(),
                                                    max_output_size=manifest.chunk_bytes)
                    if hashlib.sha256(block).hexdigest() != digest:
                        raise CheckpointError(f"local chunk {digest[:16]} is corrupt; delete "
                                              f"{chunk_path(store, digest)} and sync again")
                    whole.update(block)
                    f.write(block)
            if out.stat().st_size != entry.size or whole.hexdigest() != entry.sha256:
                raise CheckpointError(f"{entry.path} does not add up to its manifest entry; nothing was activated")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
