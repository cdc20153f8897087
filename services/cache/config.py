"""CacheConfig: the shared KV-cache and session-context service."""

from __future__ import annotations

from dataclasses import dataclass

from services.cache.sessions import DEFAULT_TTL_S


@dataclass(frozen=True)
class CacheConfig:
    replica_id: str = "cache-0"
    host: str = "127.0.0.1"
    port: int = 50053
    session_ttl_s: float = DEFAULT_TTL_S   # sliding: every read or write extends it
    max_sessions: int = 100_000
    max_messages_per_session: int = 1_000
    discovery: str = "static"           # static | consul: where this process announces itself
    metrics_port: int = 0               # Prometheus /metrics; 0: off
    advertise: str = ""                # HOST[:PORT] registered in discovery; "": the bind host

    def __post_init__(self) -> None:
        if self.session_ttl_s <= 0:
            raise ValueError("session_ttl_s must be positive")
        if self.max_sessions < 1 or self.max_messages_per_session < 1:
            raise ValueError("session limits must be at least 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
