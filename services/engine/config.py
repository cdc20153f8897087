"""EngineConfig: one frozen description of an engine process, as its flags ask for it.

What `auto` becomes on this machine (device, dtype, matmul, kernels, graphs) is decided once, at
start, by services/engine/runtime/plan.py."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.ratelimit import Rate
from services.engine.core.fairness import check_slowdown

DTYPES = ("auto", "float32", "bfloat16", "int8")
DEVICES = ("auto", "cpu", "cuda")
KV_DTYPES = ("auto", "float32", "float16", "bfloat16")   # auto: float16 with the fused CPU ops, else dtype
# Pure-decode steps.  auto: CUDA graphs on a GPU, else off; eager: the graphs' static buffers without
# capture (their logic, on any device); cuda: captured graphs (a GPU only).
GRAPHS = ("off", "eager", "cuda")           # what a plan runs (services/engine/runtime/plan.py)
GRAPH_MODES = ("auto", *GRAPHS)             # what a config may ask for


@dataclass(frozen=True)
class EngineConfig:
    model_path: str                    # a Hugging Face Llama-family folder
    model: str = "smollm2-135m"        # the name clients ask for
    model_version: str = "1"
    replica_id: str = "engine-0"
    region: str = "local"
    host: str = "127.0.0.1"
    port: int = 50060
    dtype: str = "auto"                # auto: the fastest measured for the device
    device: str = "auto"
    max_waiting: int = 256             # queued requests beyond this are refused (RESOURCE_EXHAUSTED)
    threads: int = 0                   # torch CPU threads; 0: torch's default
    kv_cache_mb: int = 1024            # KV cache budget; decides how many blocks exist
    kv_dtype: str = "auto"             # KV_DTYPES: what the KV cache holds
    block_size: int = 16               # tokens per KV block
    max_batched_tokens: int = 512      # tokens per step (decode rows + prefill chunks)
    max_running: int = 64              # sequences per step
    fair_scheduling: bool = True       # weighted fair queuing between tenants (services/engine/core/fairness.py)
    fair_slowdown: float = 1.5         # a light tenant's steps at most this x its share's (scheduler.py); 0: off
    speculate: int = -1                # prompt-lookup draft tokens per request and step; -1 auto, 0 off
    speculate_rows: int = 0            # draft while a step's rows stay within this; 0 auto (speculate.py)
    draft_model_path: str = ""         # a draft model's folder (the same tokenizer): it proposes the drafts; "": lookup
    draft_model: str = ""              # its name (logs)
    cuda_graphs: str = "auto"          # GRAPH_MODES; auto: pure-decode steps replay CUDA graphs on a GPU
    metrics_port: int = 0              # Prometheus /metrics; 0: off
    lora_roots: tuple[str, ...] = ()   # LoadAdapter reads adapters under these folders only; (): from anywhere
    discovery: str = "static"          # static | consul: where this engine announces itself
    advertise: str = ""                # HOST[:PORT] registered in discovery; "": the bind host
    tls_dir: str = ""                  # mesh mutual TLS (ca.crt, tls.crt, tls.key); "": plaintext
    # The shared KV-cache service: prompt blocks other engines computed are loaded, not recomputed.
    cache: str = ""                    # HOST:PORT of services.cache; "": no shared cache
    cache_tenant: str = "standard"     # SLA class the blocks this engine publishes are evicted by
    cache_timeout_s: float = 2.0       # fetching one request's blocks, at most; then it recomputes
    cache_outbox_mb: int = 256         # computed blocks waiting to be published; the oldest go beyond
    cache_staging_mb: int = 1024       # fetched blocks waiting for their requests' admission; beyond: recompute
    # Structured outputs (services/engine/runtime/grammar_limits.py): what compiled grammars may cost.
    grammar_cache_mb: int = 0          # compiled grammars kept, by their real size; 0: auto (grammar_cache_bytes)
    grammar_compile_rate: Rate | None = Rate(20, 60)   # new grammars per tenant (cache_salt); None: no limit
    grammar_compiles: int = 1          # compiles running at once, all tenants (each in its own process)
    grammar_compile_timeout_s: float = 10.0   # a compile still running then is stopped, its constraint refused

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not one of {KV_DTYPES}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not one of {DEVICES}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if self.kv_cache_mb < 1 or self.block_size < 1:
            raise ValueError("kv_cache_mb and block_size must be at least 1")
        if self.max_batched_tokens < 1 or self.max_running < 1:
            raise ValueError("max_batched_tokens and max_running must be at least 1")
        if self.cuda_graphs not in GRAPH_MODES:
            raise ValueError(f"cuda_graphs {self.cuda_graphs!r} is not one of {GRAPH_MODES}")
        if self.speculate < -1 or self.speculate > 16 or self.speculate_rows < 0:
            raise ValueError("speculate must be -1 (auto) to 16 and speculate_rows >= 0")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be at least 1")
        check_slowdown(self.fair_slowdown)
        self._check_shared_cache()
        self._check_grammars()

    def _check_shared_cache(self) -> None:
        if self.cache and not self.cache.rpartition(":")[2].isdigit():
            raise ValueError(f"--cache {self.cache!r} is not HOST:PORT")
        if not 0 < len(self.cache_tenant) <= 64:
            raise ValueError("--cache-tenant must be 1 to 64 characters")
        if self.cache_timeout_s <= 0 or self.cache_outbox_mb < 1 or self.cache_staging_mb < 1:
            raise ValueError("cache_timeout_s, cache_outbox_mb and cache_staging_mb must be positive")

    def _check_grammars(self) -> None:
        if self.grammar_cache_mb < 0:
            raise ValueError("--grammar-cache-mb must be 0 (auto) or more")
        if self.grammar_compiles < 1:
            raise ValueError("--grammar-compiles must be at least 1")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("--grammar-compile-timeout-s must be positive")

    @property
    def grammar_cache_bytes(self) -> int:
        """The compiled grammars' budget.  Auto: an eighth of the KV budget, between 64 and 512 MB.

        The KV budget is what the operator sized this engine's per-request state to, and compiled grammars
        are more of it, held beside it (host RAM): an eighth keeps the engine within ~12% of that plan.
        The floor, 64 MB, still holds three of the heaviest schemas measured (60 properties with their own
        patterns: 19 MB each) or ~250 typical ones (0.25 MB), so a small engine keeps an application's
        schemas compiled; the ceiling, 512 MB, because a GPU's KV budget (tens of GB of device memory)
        says nothing about the host RAM grammars take, and 512 MB already holds ~2,000 typical schemas."""
        if self.grammar_cache_mb:
            return self.grammar_cache_mb << 20
        return min(max(self.kv_cache_mb // 8, 64), 512) << 20
