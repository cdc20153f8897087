"""CacheConfig: the shared KV-cache and session-context service."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from mesh.grpcutil import MAX_MESSAGE_BYTES
from services.cache.eviction import DEFAULT_WEIGHTS, POLICIES
from services.cache.sessions import DEFAULT_TTL_S

EMBEDDED = "embedded"
REDIS_FORM = "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]"


@dataclass(frozen=True)
class RedisAddress:
    """Where a Redis session store lives.  `str()` leaves the credentials out (logs, error messages)."""
    host: str
    port: int = 6379
    db: int = 0
    username: str = ""
    password: str = ""

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://{host}:{self.port}/{self.db}"


def redis_address(store: str) -> RedisAddress | None:
    """--session-store: "embedded" -> None; a redis:// URL -> its address; anything else: ValueError."""
    if store == EMBEDDED:
        return None
    shown = re.sub(r"//[^/@]*@", "//***@", store)           # never echo a password
    if not store.startswith("redis://"):
        raise ValueError(f"--session-store {shown!r} is neither 'embedded' nor a Redis URL ({REDIS_FORM})")
    url = urlsplit(store)
    try:
        port = 6379 if url.port is None else url.port
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ValueError(f"--session-store {shown!r}: the port is not a number from 1 to 65535")
    db = re.fullmatch(r"(?:/(\d{1,5})?)?", url.path)
    if not url.hostname or url.query or url.fragment or db is None:
        raise ValueError(f"--session-store {shown!r} is not a Redis URL ({REDIS_FORM}; DB a number, default 0)")
    return RedisAddress(url.hostname, port, int(db.group(1) or 0), unquote(url.username or ""),
                        unquote(url.password or ""))


@dataclass(frozen=True)
class CacheConfig:
    replica_id: str = "cache-0"
    host: str = "127.0.0.1"
    port: int = 50053
    session_ttl_s: float = DEFAULT_TTL_S   # sliding: every read or write extends it
    max_sessions: int = 100_000
    max_messages_per_session: int = 1_000
    # "embedded": sessions in this process (kept across restarts with sessions_dir); or a Redis URL
    # (services/cache/redis_sessions.py), where every cache replica pointed at it shares them.
    session_store: str = EMBEDDED
    sessions_dir: str = ""              # the embedded store's journal (services/cache/journal.py); "": memory
    objects_dir: str = ""               # the edges' stored objects (services/cache/objects.py); "": sessions_dir's
    checkpoint_store: str = ""          # a checkpoint store served to other regions (GetCheckpointFile); "": none
    discovery: str = "static"           # static | consul: where this process announces itself
    advertise: str = ""                # HOST[:PORT] registered in discovery; "": the bind host
    tls_dir: str = ""                  # mesh mutual TLS (ca.crt, tls.crt, tls.key); "": plaintext
    # KV block store
    hot_mb: int = 1024                  # RAM tier budget (block payload bytes), MiB; 0: every block goes cold
    cold_dir: str = ""                  # disk tier folder, kept across restarts; "": no cold tier
    cold_mb: int = 4096                 # disk tier budget (whole block files), MiB
    eviction: str = "lru"               # lru | lru2 | tenant (services/cache/eviction.py), both tiers
    tenant_weights: tuple[tuple[str, float], ...] = tuple(DEFAULT_WEIGHTS.items())   # SLA class -> weight
    max_block_mb: int = 32              # one block (one gRPC message); larger ones are INVALID_ARGUMENT
    metrics_port: int = 0               # Prometheus /metrics; 0: off

    def __post_init__(self) -> None:
        if self.session_ttl_s <= 0:
            raise ValueError("session_ttl_s must be positive")
        if self.max_sessions < 1 or self.max_messages_per_session < 1:
            raise ValueError("session limits must be at least 1")
        if redis_address(self.session_store) is not None and self.sessions_dir:
            raise ValueError("--sessions-dir keeps the embedded store's sessions; with --session-store "
                             f"{self.redis} Redis keeps them: drop one of the two")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if self.hot_mb < 0 or self.cold_mb < 0:
            raise ValueError("--hot-mb and --cold-mb must not be negative")
        if self.hot_mb == 0 and not self.cold_dir:
            raise ValueError("--hot-mb 0 needs a cold tier (--cold-dir): the block store would hold nothing")
        if self.eviction not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.eviction!r} (use one of {', '.join(POLICIES)})")
        if any(w <= 0 for _, w in self.tenant_weights):
            raise ValueError("tenant weights must be positive")
        # Leave room for the key and metadata in the message.
        if not 1 <= self.max_block_mb << 20 <= MAX_MESSAGE_BYTES - (1 << 20):
            raise ValueError(f"--max-block-mb must be between 1 and {(MAX_MESSAGE_BYTES >> 20) - 1} "
                             "(mesh.grpcutil.MAX_MESSAGE_BYTES)")

    @property
    def redis(self) -> RedisAddress | None:
        """The Redis session store; None: the embedded one."""
        return redis_address(self.session_store)
