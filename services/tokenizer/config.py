"""TokenizerConfig: everything the tokenizer process needs, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.tokenizer.limits import InputLimits


@dataclass(frozen=True)
class TokenizerConfig:
    replica_id: str = "tokenizer-0"
    host: str = "127.0.0.1"
    port: int = 50052
    # (served name, Hugging Face folder) for every model this replica tokenizes.
    models: tuple[tuple[str, str], ...] = ()
    discovery: str = "static"           # static | consul: where this process announces itself
    metrics_port: int = 0               # Prometheus /metrics; 0: off
    advertise: str = ""                # HOST[:PORT] registered in discovery; "": the bind host
    tls_dir: str = ""                  # mesh mutual TLS (ca.crt, tls.crt, tls.key); "": plaintext
    limits: InputLimits = field(default_factory=InputLimits)   # input refused before it is tokenized

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("the tokenizer needs at least one model (--model NAME)")
        names = [n for n, _ in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
