"""EdgeConfig: ports, limits and keys of the HTTP/1.1 + HTTP/3 edge."""

from __future__ import annotations

from dataclasses import dataclass, field

from mesh.apikeys import is_loopback
from mesh.ratelimit import Rate


@dataclass(frozen=True)
class EdgeConfig:
    replica_id: str = "edge-0"
    host: str = "127.0.0.1"
    http_port: int = 8000                  # HTTP/1.1 on TCP
    http3_port: int = 8443                 # HTTP/3 on UDP; 0 disables it
    router: str = "127.0.0.1:50051"
    cert_dir: str = ""                     # where the self-signed certificate lives
    api_key_digests: tuple[bytes, ...] = ()    # INFERMESH_API_KEYS: standard tier, a tenant each
    keys_file: str = ""                    # INFERMESH_API_KEYS_FILE: keys with tenant, tier, signing secret
    tiers_file: str = ""                   # INFERMESH_TIERS_FILE: per-tier limits, priority, cache class
    jwt_secret: str = field(default="", repr=False)     # INFERMESH_JWT_SECRET: HS256 bearer tokens
    jwt_jwks_file: str = ""                # INFERMESH_JWT_JWKS_FILE: RS256 bearer tokens
    jwt_audience: str = ""
    jwt_issuer: str = ""
    content_policy: str = ""               # INFERMESH_CONTENT_POLICY: input/output rules (gateway/safety.py)
    content_classifier: str = ""           # HOST:PORT of a ContentClassifier gRPC service; "": none
    cache_service: str = ""                # HOST:PORT of the cache service: the response cache's shared tier
    response_cache_ttl_s: float = 300.0    # 0: no response cache
    response_cache_bytes: int = 64 << 20   # the edge's in-memory tier
    admin_key_digests: tuple[bytes, ...] = ()   # the admin API's own keys; none: admin API off
    max_body_bytes: int = 1 << 20          # larger bodies get 413 (refused on Content-Length, before reading)
    max_messages: int = 1_000              # chat `messages` longer than this get 400
    request_timeout_s: float = 600.0       # deadline passed to the router
    discovery: str = "static"              # static | consul: where the edge announces itself
    advertise: str = ""                    # HOST[:PORT] registered in discovery; "": the bind host
    tls_dir: str = ""                  # mesh mutual TLS (ca.crt, tls.crt, tls.key); "": plaintext
    rate_limit: Rate | None = None         # requests per API key (per client address without keys)
    token_limit: Rate | None = None        # prompt + completion tokens, same callers
    auth_failure_limit: Rate | None = Rate(10, 60)  # failed API/admin keys per client address, then 429
    max_concurrent: int = 256              # router calls in flight across all callers (prompts x n a request); 503
    max_connections: int = 4_096           # HTTP/1.1 connections; past this uvicorn answers 503
    header_timeout_s: float = 10.0         # a request head must arrive within this (slow loris)
    body_timeout_s: float = 30.0           # a request body must arrive within this, else 408
    # A streaming client must take each chunk within this (its transport's buffer full: it reads more
    # slowly than tokens come); past it the stream ends with an error event and its generation is aborted.
    stream_send_timeout_s: float = 30.0
    batch_concurrency: int = 8             # a batch's lines under way at once (services/edge/batch/runner.py)
    # Batch lines' own places in flight (services/edge/batch/admission.py), apart from max_concurrent's: at most
    # this share of max_concurrent for all batches together, and of those at most batch_tenant_share for one tenant's.
    batch_share: float = 0.25
    batch_tenant_share: float = 0.5

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not (self.api_key_digests or self.keys_file or self.jwt_secret
                                                   or self.jwt_jwks_file):
            raise ValueError(
                f"--host {self.host} is not a loopback address: configure API keys first "
                "(INFERMESH_API_KEYS or INFERMESH_API_KEYS_FILE) or JWTs (INFERMESH_JWT_SECRET or "
                "INFERMESH_JWT_JWKS_FILE)")
        if self.response_cache_ttl_s < 0 or self.response_cache_bytes < 0:
            raise ValueError("the response cache's TTL and size cannot be negative")
        for name in ("http_port", "http3_port"):
            port = getattr(self, name)
            if not 0 <= port < 65536:
                raise ValueError(f"{name} {port} is out of range")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        for name in ("max_messages", "max_concurrent", "max_connections", "batch_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("batch_share", "batch_tenant_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be above 0 and at most 1")
        for name in ("request_timeout_s", "header_timeout_s", "body_timeout_s", "stream_send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
