"""EngineConfig: one frozen description of an engine process."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


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
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be at least 1")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        # On this CPU single-row bf16 matmuls are slower than fp32 and fp32 matches
        # transformers exactly, so auto means fp32 on CPU and bf16 on CUDA.
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device() == "cuda" else "float32"
