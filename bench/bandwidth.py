"""The memory-bandwidth limit of one stream: how many tokens a second this machine could make if a token cost only
reading the model's weights once.

One stream's decode reads every weight once per token, so `read bandwidth / bytes per token` bounds it; a server's
1-stream tokens/s as a fraction of that bound says how close to the machine it runs (llama.cpp's CPU kernels reach
0.8-1.0 of it).  The bandwidth is measured here, in the same run: the best of several sums over a float32 tensor far
larger than the caches, on every core torch uses.  The bytes per token are the GGUF's: every tensor's bytes as the
file stores them, the token embedding counted as one row unless it is also the output layer (tied embeddings, no
`output.weight`: then all of it is read).  `bench/engine.py` prints the fraction beside each 1-stream figure.

    .venv/bin/python bench/bandwidth.py [FILE.gguf ...]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mesh.models.gguf_header import read_header  # noqa: E402


def read_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """The machine's read bandwidth, GB/s (1e9 bytes): the best of `repeats` sums over `gib` GiB of float32."""
    import torch

    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    data.sum()                                   # pages touched, threads started
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


@dataclass(frozen=True)
class Model:
    path: Path
    bytes_per_token: int          # what one decode step reads of the weights
    file_bytes: int

    def limit(self, gbs: float) -> float:
        """The tokens/s bound of one stream at `gbs` GB/s."""
        return gbs * 1e9 / self.bytes_per_token


def model_bytes(path: str | Path) -> Model:
    header = read_header(path)
    names = {t.name: t for t in header.tensors}
    total = sum(t.nbytes for t in header.tensors)
    embed = names.get("token_embd.weight")
    if embed is not None and "output.weight" in names:       # untied: a token reads one row of the embedding
        total -= embed.nbytes - embed.nbytes // (embed.n_elements // embed.dims[0])
    return Model(Path(path), total, Path(path).stat().st_size)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="*", help="GGUF files whose 1-stream bound to print")
    parser.add_argument("--gib", type=float, default=1.0, help="the size of the tensor summed")
    args = parser.parse_args()
    gbs = read_gbs(args.gib)
    print(f"read bandwidth: {gbs:.1f} GB/s")
    for path in args.gguf:
        m = model_bytes(path)
        print(f"{path}: {m.bytes_per_token / 1e6:.0f} MB a token ({m.file_bytes / 1e6:.0f} MB file): one stream "
              f"at most {m.limit(gbs):.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
