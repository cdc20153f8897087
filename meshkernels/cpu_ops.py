"""Fused float32 CPU ops (`meshkernels/cpu_ops.cpp`), compiled on first use and loaded into torch.

The engine's fast (non-"exact") forward calls them through `torch.ops.infermesh.*`:

- `paged_decode_attention(q (B, H, D), k_cache, v_cache, block_tables (B, W), context_lens (B,), scale,
  window=0, softcap=0.0)` -> (B, H, D): `paged_attention.decode()` without gathering K/V into copies first;
  window > 0 attends each row's last `window` keys, softcap > 0 caps each scaled score as
  softcap * tanh(score / softcap) before the softmax (Gemma 2); 0 turns either off.
- `add_rms_norm(x (T, H), residual (T, H) | None, weight (H,), eps)` -> (T, H): `x += residual` in
  place, then returns the RMS-normalized x.
- `rope_and_write_kv(qkv (T, H+2KH, D), positions (T,), cos (P, D), sin (P, D), k_cache, v_cache,
  slots (T,), num_heads)`: rotates q and k in place and stores k and v at `slots`.
- `silu_and_mul(gate_up (T, 2I))` -> (T, I): silu(gate) * up.
- `lora_apply(out (T, O), h (T, I), rows (R,), table (n, 19))`: each adapter's rows' LoRA update added into `out`
  in place (meshkernels/cpu_lora.cpp; its reference is services/engine/runtime/lora.py's torch loop).

Their torch references, with the same signatures, are meshkernels/torch_ops.py (the norm, RoPE and SiLU
ops) and paged_attention.decode() / _reference() (decode attention); tests/unit/test_cpu_ops.py
compares against them.

The library is a plain shared object (no Python module) written against torch's stable C++ API,
whose headers compile in seconds (about 7 s in all here, against 17 s with <torch/library.h>).  It
is built with the system's g++ into `$INFERMESH_KERNEL_CACHE/<hash>/` (else `~/.cache/infermesh/kernels/...`);
the hash covers the source, the flags and the torch version, so an upgrade rebuilds it.  A file
lock keeps two engines that start at once from building over each other.  Without a compiler, or
if the build fails, `load()` logs one warning and returns False, and the engine keeps its torch
ops.  `INFERMESH_CPU_OPS=0` turns the library off (to compare against the torch ops).
`python -m meshkernels.cpu_ops` builds it ahead of time (`make setup` does).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# A lower INFERMESH_CPU_ISA stands for a CPU without the higher paths: oneDNN (torch's bf16 and fp32 GEMMs) is
# capped to match, so that "AMX off" on a Xeon leaves AMX out of the bf16w kind's matmuls too (oneDNN reads
# its cap at its first primitive; an explicit ONEDNN_MAX_CPU_ISA wins).
_ONEDNN_CAPS = {"avx512": "AVX512_CORE_BF16", "avxvnni": "AVX2_VNNI", "avx2": "AVX2", "portable": "SSE41"}
if os.environ.get("INFERMESH_CPU_ISA") in _ONEDNN_CAPS:
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_CAPS[os.environ["INFERMESH_CPU_ISA"]])

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
SOURCES = (SOURCE, Path(__file__).with_name("cpu_gemm.cpp"), Path(__file__).with_name("cpu_layer.cpp"),
           Path(__file__).with_name("cpu_sample.cpp"), Path(__file__).with_name("cpu_gguf.cpp"),
           Path(__file__).with_name("cpu_gguf_x.cpp"), Path(__file__).with_name("cpu_gguf_amx.cpp"),
           Path(__file__).with_name("cpu_gguf_amx16.cpp"), Path(__file__).with_name("cpu_layer_gguf.cpp"),
           Path(__file__).with_name("cpu_gguf_q8k.cpp"), Path(__file__).with_name("cpu_lora.cpp"),
           Path(__file__).with_name("cpu_gguf_r16.cpp"),
           Path(__file__).with_name("cpu_gguf_r16_pack.cpp"))
HEADERS = (Path(__file__).with_name("cpu_common.h"), Path(__file__).with_name("cpu_api.h"),
           Path(__file__).with_name("cpu_gguf.h"), Path(__file__).with_name("cpu_gguf_amx.h"),
           Path(__file__).with_name("cpu_gguf_r16.h"),
           Path(__file__).with_name("cpu_gguf_r16_narrow.h"))
LIBRARY = "libinfermesh_cpu_ops.so"

_lock = threading.Lock()
_loaded: bool | None = None


def _cache_root() -> Path:
    """$INFERMESH_KERNEL_CACHE, else ~/.cache/infermesh/kernels: a build cache of the machine, keyed by source,
    flags and torch, apart from $INFERMESH_HOME (a process given a fresh home for its models, as tests and
    `model register` checks are, must not compile the library again: ~30 s on 2 cores)."""
    env = os.environ.get("INFERMESH_KERNEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "infermesh" / "kernels"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _command(compiler: str, output: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    include = torch_dir / "include"
    lib = torch_dir / "lib"
    return [
        compiler, *map(str, SOURCES), "-o", str(output), "-shared", "-fPIC", "-std=c++20", "-O3",
        *_isa_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-isystem", str(include),
        f"-L{lib}", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
    ]


def _isa_flags() -> list[str]:
    """The vector paths this CPU runs (AVX-512, else AVX2; with VNNI where the CPU has it; AMX-INT8 tiles
    for cpu_gguf_amx.cpp), else none: the portable loops.
    `INFERMESH_CPU_ISA=avx512|avx2|avxvnni|portable` builds a lower one (to test those paths on a bigger
    CPU; avx512 is everything but AMX) and caps oneDNN's to match (ONEDNN_MAX_CPU_ISA, set at import)."""
    flags, wanted = _cpu_flags(), os.environ.get("INFERMESH_CPU_ISA", "native")
    avx2 = ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= flags else []
    if wanted == "portable" or not avx2:
        return []
    if wanted == "avx2":
        return avx2
    if wanted == "avxvnni":         # AVX2 with AVX-VNNI, no AVX-512 (to test that path on an AVX-512 CPU)
        return [*avx2, "-mavxvnni"] if "avx_vnni" in flags else avx2
    # VNNI's byte dot products (cpu_gguf.cpp's int8 activations): AVX512-VNNI, else AVX-VNNI
    vnni = ["-mavxvnni"] if "avx_vnni" in flags else []
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        amx = ["-mamx-tile", "-mamx-int8"] if wanted != "avx512" and {"amx_tile", "amx_int8"} <= flags else []
        return [*avx2, "-mavx512f", "-mavx512bw", "-mavx512vl",
                *(["-mavx512vnni"] if "avx512_vnni" in flags else vnni), *amx]
    return [*avx2, *vnni]


def build_flags() -> list[str]:
    """The vector paths the ops are (or will be) built for here: the CPU's, or the lower ones INFERMESH_CPU_ISA
    asks for.  A plan tuned on one build is not another's (services/engine/runtime/tune.py keys its cache by it)."""
    return _isa_flags()


def source_digests() -> list[str]:
    """The sha256 of each kernel source and header: what an answer measured on these kernels is keyed by
    (services/engine/runtime/tune.py's plans, outliers.py's probe)."""
    return [hashlib.sha256(path.read_bytes()).hexdigest() for path in (*SOURCES, *HEADERS)]


def _build_folder(compiler: str) -> Path:
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.read_bytes())
    # Paths left out: the sources are hashed above, and torch's folder is named by its version; so every clone,
    # and every venv with this torch, shares one build (the headers are the wheel's; libtorch_cpu is found by
    # its name, already loaded by then).
    command = (" ".join(_command(compiler, Path(LIBRARY))).replace(str(Path(torch.__file__).parent), "<torch>")
               .replace(str(SOURCE.parent), "<sources>"))
    key.update(command.encode())
    key.update(torch.__version__.encode())
    return _cache_root() / key.hexdigest()[:16]


def build() -> Path:
    """Compile the library unless a build for this source, torch and CPU exists; return its path.

    Raises RuntimeError (with the compiler's output) when it cannot be built."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    folder = _build_folder(compiler)
    library = folder / LIBRARY
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # another process may be building the same library
        if library.exists():
            return library
        partial = folder / f"{LIBRARY}.{os.getpid()}.tmp"
        started = time.monotonic()
        result = subprocess.run(_command(compiler, partial), capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"{' '.join(_command(compiler, library))} failed:\n{result.stderr[-4000:]}")
        os.replace(partial, library)           # atomic: a reader sees no library or a whole one
        log.info("built %s in %.1f s", library, time.monotonic() - started)
    return library


def load() -> bool:
    """Build (once) and load the library; True when `torch.ops.infermesh` ops are usable."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> bool:
    if os.environ.get("INFERMESH_CPU_OPS", "1") == "0":
        return False
    try:
        torch.ops.load_library(str(build()))
    except Exception as exc:   # a missing compiler or a failed build must not stop the engine
        log.warning("fused CPU ops unavailable, using the torch ops instead (slower decode): %s", exc)
        return False
    return True


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        library = build()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        print(f"meshkernels.cpu_ops: {exc}", file=sys.stderr)
        return 1
    torch.ops.load_library(str(library))
    print(f"meshkernels.cpu_ops: {library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
