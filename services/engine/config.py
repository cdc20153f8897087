"""EngineConfig: one frozen description of an engine process."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "int8")
DEVICES = ("auto", "cpu", "cuda")
CUDA_GRAPHS = ("auto", "off")


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
    block_size: int = 16               # tokens per KV block
    max_batched_tokens: int = 512      # tokens per step (decode rows + prefill chunks)
    max_running: int = 64              # sequences per step
    cuda_graphs: str = "auto"          # auto: pure-decode steps replay CUDA graphs on a GPU; off: never
    metrics_port: int = 0              # Prometheus /metrics; 0: off
    discovery: str = "static"          # static | consul: where this engine announces itself
    advertise: str = ""                # HOST[:PORT] registered in discovery; "": the bind host
    # The shared KV-cache service: prompt blocks other engines computed are loaded, not recomputed.
    cache: str = ""                    # HOST:PORT of services.cache; "": no shared cache
    cache_tenant: str = "standard"     # SLA class the blocks this engine publishes are evicted by
    cache_timeout_s: float = 2.0       # fetching one request's blocks, at most; then it recomputes
    cache_outbox_mb: int = 256         # computed blocks waiting to be published; the oldest go beyond
    cache_staging_mb: int = 1024       # fetched blocks waiting for their requests' admission; beyond: recompute

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not one of {DEVICES}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if self.kv_cache_mb < 1 or self.block_size < 1:
            raise ValueError("kv_cache_mb and block_size must be at least 1")
        if self.max_batched_tokens < 1 or self.max_running < 1:
            raise ValueError("max_batched_tokens and max_running must be at least 1")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs {self.cuda_graphs!r} is not one of {CUDA_GRAPHS}")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be at least 1")
        if self.cache and not self.cache.rpartition(":")[2].isdigit():
            raise ValueError(f"--cache {self.cache!r} is not HOST:PORT")
        if not 0 < len(self.cache_tenant) <= 64:
            raise ValueError("--cache-tenant must be 1 to 64 characters")
        if self.cache_timeout_s <= 0 or self.cache_outbox_mb < 1 or self.cache_staging_mb < 1:
            raise ValueError("cache_timeout_s, cache_outbox_mb and cache_staging_mb must be positive")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        # Measured on the 2-core AVX2 CPU here: bf16 GEMMs run at ~18 GFLOP/s against 50-120
        # for fp32 (no native bf16), so auto means fp32 on CPU and bf16 on CUDA.
        if self.dtype == "int8":
            return "float32"  # int8 weights, float32 activations and KV cache
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device() == "cuda" else "float32"

    def resolved_matmul(self) -> str:
        """How the engine multiplies by its weights; see services/engine/models/llama.py.

        - `exact`: transformers' own GEMM, bit-for-bit parity (an explicit --dtype float32).
        - `fp16w` (auto on CPU with FBGEMM): fp16-stored weights with fp32 activations and
          accumulation, faster than packed fp32 at every batch size on this AVX2 CPU (1.6-2x
          for decode); greedy output still equal to float32's on the tested prompts.
        - `packed`: oneDNN fp32 with weights reordered once (auto on CPU without FBGEMM).
        - `int8`: --dtype int8, a quantized model.
        - `fused` (auto on CUDA): cuBLAS, with q/k/v and gate/up each one GEMM."""
        if self.dtype == "int8":
            if self.resolved_device() != "cpu":
                raise ValueError("--dtype int8 runs on the CPU only (FBGEMM)")
            return "int8"
        if self.dtype == "auto" and self.resolved_device() == "cpu":
            import torch

            if "fbgemm" in torch.backends.quantized.supported_engines:
                return "fp16w"
            return "packed" if torch.backends.mkldnn.is_available() else "exact"
        if self.resolved_device() == "cuda" and self.dtype != "float32":
            return "fused"
        return "exact"
