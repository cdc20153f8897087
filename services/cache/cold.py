"""The disk cold tier: one file per block under a cache folder, crash-safe.

File layout (little-endian):
    magic     8 bytes   b"IMKVBLK1" (the last byte is the format version)
    meta_len  u32       length of the JSON metadata
    data_len  u64       length of the payload
    checksum  32 bytes  blake2b-256 of magic + meta_len + data_len + metadata + payload
    metadata            JSON: model, version, hash (hex), dtype, shape, num_tokens, tenant
    payload             the block's KV bytes

Writes go through `mesh.files.write_atomic`: a unique `*.tmp` file in the same folder, fsynced, renamed over the final
name, so a crash leaves either no file, a stray `*.tmp`, or a complete one (the rename itself
may be lost: a miss, never a torn block).  A file is served only after its size, magic, key and
checksum all check out; one that fails is deleted.  The startup scan checks structure (size,
magic, metadata, name) and removes `*.tmp` leftovers, so it reads a few hundred bytes per file;
the checksum is checked on every read (and at startup too with `verify_on_scan`).

The file functions (`write_file`, `read_file`) touch no shared state, so the store runs them in
worker threads; the index (`entries`, the `Tier` accounting) changes only on the event loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import BinaryIO, NamedTuple

from mesh.files import TMP_SUFFIX, write_atomic
from services.cache.blocks import Block, BlockKey, BlockMeta, Tier, check_key
from services.cache.eviction import EvictionPolicy

log = logging.getLogger(__name__)

MAGIC = b"IMKVBLK1"
_FIXED = struct.Struct("<8sIQ")
CHECKSUM_BYTES = 32
HEADER_BYTES = _FIXED.size + CHECKSUM_BYTES
MAX_META = 16 * 1024
SUFFIX = ".kvb"


class ScanReport(NamedTuple):
    kept: int          # valid block files now indexed
    removed: int       # torn, corrupt or leftover temporary files deleted
    evicted: int       # valid files deleted because the budget is smaller than what was found


class CorruptBlock(Exception):
    """A torn or corrupt block file; the caller deletes it."""


def encode_meta(key: BlockKey, meta: BlockMeta) -> bytes:
    return json.dumps({"model": key.model, "version": key.version, "hash": key.hash.hex(), "dtype": meta.dtype,
                       "shape": list(meta.shape), "num_tokens": meta.num_tokens, "tenant": meta.tenant},
                      separators=(",", ":"), sort_keys=True).encode()


def decode_meta(raw: bytes) -> tuple[BlockKey, BlockMeta]:
    try:
        m = json.loads(raw)
        key = BlockKey(str(m["model"]), str(m["version"]), bytes.fromhex(m["hash"]))
        check_key(key)
        return key, BlockMeta(str(m["dtype"]), tuple(int(d) for d in m["shape"]), int(m["num_tokens"]),
                              str(m["tenant"]))
    except Exception as exc:     # any malformed metadata means the same thing: not ours to serve
        raise CorruptBlock(f"bad metadata: {exc}") from exc


def file_size(meta_bytes: bytes, nbytes: int) -> int:
    return HEADER_BYTES + len(meta_bytes) + nbytes


def file_name(key: BlockKey) -> str:
    h = hashlib.blake2b(key.model.encode(), digest_size=16)
    h.update(b"\0" + key.version.encode() + b"\0" + key.hash)
    return h.hexdigest()


def _decode(f: BinaryIO, size: int, max_data: int, with_data: bool) -> tuple[BlockKey, BlockMeta, bytes]:
    """Read one block file; raise CorruptBlock unless it is whole.  `with_data`: read the payload
    and check the checksum; else only the structure (b"" for data)."""
    head = f.read(HEADER_BYTES)
    if len(head) != HEADER_BYTES:
        raise CorruptBlock(f"{size}-byte file is shorter than the header")
    magic, meta_len, data_len = _FIXED.unpack_from(head)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if meta_len > MAX_META or data_len > max_data or HEADER_BYTES + meta_len + data_len != size:
        raise CorruptBlock(f"torn: header says {HEADER_BYTES + meta_len + data_len} bytes, file has {size}")
    meta_bytes = f.read(meta_len)
    key, meta = decode_meta(meta_bytes)
    if not with_data:
        return key, meta, b""
    data = f.read(data_len)
    h = hashlib.blake2b(head[:_FIXED.size], digest_size=CHECKSUM_BYTES)
    h.update(meta_bytes)
    h.update(data)
    if len(data) != data_len or h.digest() != head[_FIXED.size:]:
        raise CorruptBlock("checksum mismatch")
    return key, meta, data


class ColdTier(Tier):
    def __init__(self, folder: str | os.PathLike[str], budget: int, policy: EvictionPolicy, max_block_bytes: int):
        super().__init__("cold", budget, policy)
        self.folder = Path(folder)
        self.max_block_bytes = max_block_bytes
        self.entries: dict[BlockKey, BlockMeta] = {}
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: BlockKey) -> Path:
        name = file_name(key)
        return self.folder / name[:2] / f"{name}{SUFFIX}"

    # --- file I/O: safe to run in a worker thread ---

    def write_file(self, block: Block, meta_bytes: bytes) -> None:
        fixed = _FIXED.pack(MAGIC, len(meta_bytes), block.nbytes)
        h = hashlib.blake2b(fixed, digest_size=CHECKSUM_BYTES)
        h.update(meta_bytes)
        h.update(block.data)
        write_atomic(self.path(block.key), (fixed + h.digest() + meta_bytes, block.data))

    def read_file(self, key: BlockKey) -> Block:
        """The block, checksum verified.  FileNotFoundError if it was evicted meanwhile."""
        with open(self.path(key), "rb") as f:
            found, meta, data = _decode(f, os.fstat(f.fileno()).st_size, self.max_block_bytes, with_data=True)
        if found != key:
            raise CorruptBlock(f"file holds {found.describe()}")
        return Block(key, data, meta)

    # --- index: event loop only ---

    def commit(self, block: Block, size: int, now: float) -> None:
        """Turn a reservation made for `block` into an indexed, evictable entry."""
        self.reserved -= size
        self.used -= size
        self.discard(block.key)             # the rename replaced any older file of this key
        self.add(block.key, size, block.meta.tenant, now)
        self.entries[block.key] = block.meta

    def reserve(self, size: int) -> list[BlockKey] | None:
        """Room for a file of `size` bytes: evicts (and deletes) what must go; None if it cannot fit."""
        victims = self.make_room(size)
        if victims is None:
            return None
        for key in victims:
            self.entries.pop(key, None)
            self.path(key).unlink(missing_ok=True)
        self.reserved += size
        self.used += size
        return victims

    def release(self, size: int) -> None:
        self.reserved -= size
        self.used -= size

    def drop(self, key: BlockKey) -> None:
        self.discard(key)
        self.entries.pop(key, None)
        self.path(key).unlink(missing_ok=True)

    def scan(self, verify: bool = False) -> ScanReport:
        """Rebuild the index from the folder at startup.
        Older files (by mtime) are older in the eviction order; over budget, the oldest go."""
        found: list[tuple[int, str, BlockKey, BlockMeta, int]] = []
        removed = 0
        for sub in sorted(p for p in self.folder.iterdir() if p.is_dir() and len(p.name) == 2):
            for path in sorted(sub.iterdir()):
                if path.name.endswith(TMP_SUFFIX):
                    path.unlink(missing_ok=True)
                    removed += 1
                    continue
                if not path.name.endswith(SUFFIX):
                    continue
                try:
                    with open(path, "rb") as f:
                        st = os.fstat(f.fileno())
                        key, meta, _ = _decode(f, st.st_size, self.max_block_bytes, with_data=verify)
                    if path != self.path(key):
                        raise CorruptBlock(f"file holds {key.describe()}")
                    found.append((st.st_mtime_ns, path.name, key, meta, st.st_size))
                except (CorruptBlock, OSError) as exc:
                    log.warning("cold tier: removing %s: %s", path, exc)
                    path.unlink(missing_ok=True)
                    removed += 1
        found.sort()
        for i, (_, _, key, meta, size) in enumerate(found):
            # Logical times before the store's clock, which starts at 0.
            self.add(key, size, meta.tenant, i - len(found))
            self.entries[key] = meta
        victims = self.make_room(0) or []
        for key in victims:
            self.entries.pop(key, None)
            self.path(key).unlink(missing_ok=True)
        return ScanReport(len(self.entries), removed, len(victims))
