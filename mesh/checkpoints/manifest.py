"""Signed, content-addressed checkpoints: what `infermesh model publish` writes and `sync` checks.

A checkpoint store is a folder (served as is over HTTP, or by a region's cache service):

    chunks/<first 2 hex>/<sha256 hex>.zst        a chunk of a weights file, zstd-compressed; named by
                                                 the SHA-256 of its uncompressed bytes
    manifests/<model>/<version>.json             the manifest: every file as its list of chunk hashes
    manifests/<model>/<version>.sig              {"key_id", "signature"}: Ed25519 over the manifest's bytes

Files are cut into fixed-size chunks (1 MiB by default), so a version that changes a few tensors of
a safetensors file (same layout, same offsets) shares every other chunk with the version before it,
and a sync moves only the chunks it lacks.  Ed25519 and zstd come from `cryptography` and
`zstandard`.  Keys: PEM files; a key's id is the first 16 hex digits of the SHA-256 of its raw
public bytes.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from mesh.files import write_atomic

FORMAT = "infermesh-checkpoint/1"
CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 64 << 20          # what a manifest may declare (and a chunk may decompress to)


class CheckpointError(Exception):
    """A checkpoint that cannot be published, fetched or trusted; the message says which part and why."""


@dataclass(frozen=True)
class FileEntry:
    path: str                       # relative, '/'-separated
    size: int
    sha256: str                     # the whole file's
    chunks: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    model: str
    version: str
    chunk_bytes: int
    files: tuple[FileEntry, ...]

    def chunk_set(self) -> set[str]:
        return {c for f in self.files for c in f.chunks}

    def size(self) -> int:
        return sum(f.size for f in self.files)


def chunk_path(store: Path, digest: str) -> Path:
    return store / "chunks" / digest[:2] / f"{digest}.zst"


def manifest_path(store: Path, model: str, version: str) -> Path:
    return store / "manifests" / model / f"{version}.json"


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


# -- keys ----------------------------------------------------------------------------------------
def generate_key(private_file: Path) -> Path:
    """A new Ed25519 signing key at `private_file` (0600) and its public half beside it (.pub)."""
    if private_file.exists():
        raise CheckpointError(f"{private_file} exists already; remove it first to make a new key")
    key = Ed25519PrivateKey.generate()
    write_atomic(private_file, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()), mode=0o600)
    public_file = private_file.with_suffix(".pub")
    write_atomic(public_file, key.public_key().public_bytes(serialization.Encoding.PEM,
                                                            serialization.PublicFormat.SubjectPublicKeyInfo))
    return public_file


def load_private(file: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(file.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the signing key {file}: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise CheckpointError(f"{file} is not an Ed25519 private key")
    return key


def load_trusted(folder: Path) -> dict[str, Ed25519PublicKey]:
    """key id -> public key, for every *.pub (PEM) in `folder`."""
    trusted: dict[str, Ed25519PublicKey] = {}
    for file in sorted(folder.glob("*.pub")) if folder.is_dir() else ():
        try:
            key = serialization.load_pem_public_key(file.read_bytes())
        except ValueError as exc:
            raise CheckpointError(f"trusted key {file} is not a PEM public key: {exc}") from None
        if isinstance(key, Ed25519PublicKey):
            trusted[key_id(key)] = key
    return trusted


# -- manifests -----------------------------------------------------------------------------------
def manifest_bytes(manifest: Manifest) -> bytes:
    body = {"format": FORMAT, "model": manifest.model, "version": manifest.version,
            "chunk_bytes": manifest.chunk_bytes,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256, "chunks": list(f.chunks)}
                      for f in manifest.files]}
    return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"


def parse_manifest(raw: bytes, model: str, version: str) -> Manifest:
    """A manifest whose signature was checked; its shape is checked here (paths stay inside the folder)."""
    try:
        body = json.loads(raw)
        if body.get("format") != FORMAT:
            raise ValueError(f"format {body.get('format')!r} is not {FORMAT}")
        chunk_bytes = int(body["chunk_bytes"])
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes {chunk_bytes} is out of range")
        files = []
        for f in body["files"]:
            rel = str(f["path"])
            parts = Path(rel).parts
            if not parts or Path(rel).is_absolute() or ".." in parts or rel.startswith("."):
                raise ValueError(f"file path {rel!r} leaves the model folder")
            chunks = tuple(str(c) for c in f["chunks"])
            if any(len(c) != 64 or any(ch not in "0123456789abcdef" for ch in c) for c in chunks):
                raise ValueError(f"{rel}: a chunk name is not a SHA-256 hex digest")
            size = int(f["size"])
            if len(chunks) != -(-size // chunk_bytes):
                raise ValueError(f"{rel}: {len(chunks)} chunks for {size} bytes")
            files.append(FileEntry(rel, size, str(f["sha256"]), chunks))
        manifest = Manifest(str(body["model"]), str(body["version"]), chunk_bytes, tuple(files))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"the manifest of {model} {version} is malformed: {exc}") from None
    if (manifest.model, manifest.version) != (model, version):
        raise CheckpointError(f"the manifest names {manifest.model} {manifest.version}, not {model} {version}")
    return manifest


def sign(raw: bytes, key: Ed25519PrivateKey) -> bytes:
    signature = base64.b64encode(key.sign(raw)).decode()
    return json.dumps({"key_id": key_id(key.public_key()), "signature": signature}).encode() + b"\n"


def verify(raw: bytes, signature_file: bytes, trusted: dict[str, Ed25519PublicKey], what: str) -> str:
    """The signing key's id, when `raw` carries a valid signature by a trusted key; else CheckpointError."""
    try:
        entry = json.loads(signature_file)
        kid, signature = str(entry["key_id"]), base64.b64decode(entry["signature"], validate=True)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"the signature of {what} is malformed: {exc}") from None
    key = trusted.get(kid)
    if key is None:
        known = ", ".join(sorted(trusted)) or "none"
        raise CheckpointError(f"{what} is signed by key {kid}, which is not trusted here (trusted: {known}); "
                              "add its public key to the trusted keys folder if you trust it")
    try:
        key.verify(signature, raw)
    except InvalidSignature:
        raise CheckpointError(f"the signature of {what} does not match its manifest (key {kid}): "
                              "the manifest or the signature was altered") from None
    return kid


def files_of(folder: Path) -> Iterator[Path]:
    """The regular files a model folder publishes, sorted (dot files and symlinks left out)."""
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not path.is_symlink() and not any(p.startswith(".") for p in rel.parts):
            yield path


def read_chunks(file: Path, chunk_bytes: int) -> Iterator[bytes]:
    with file.open("rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                return
            yield block


def describe(manifest: Manifest) -> dict[str, Any]:
    return {"model": manifest.model, "version": manifest.version, "files": len(manifest.files),
            "bytes": manifest.size(), "chunks": len(manifest.chunk_set())}


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
