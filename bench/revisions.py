"""The mesh's throughput at one revision against another's, in the same run: is a change no slower?

`bench/revisions.py --before REV [-- ARGS]` checks REV out into a temporary git worktree (its stubs generated
there), then runs `bench/engine.py --no-peer ARGS` of each tree in turn, `--rounds` times alternating (the machine
drifts: a round of each, then again), and prints each level's tokens/s per round and the median ratio
(this tree / REV).  Each tree runs its own code (PYTHONPATH) with this checkout's virtual environment and model
cache.  Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"


def worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), rev], check=True)
    (where / ".venv").symlink_to(ROOT / ".venv")
    subprocess.run([str(PYTHON), "proto/generate.py"], cwd=where, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(where)})
    return where


def run(tree: Path, args: list[str], out: Path) -> dict[int, float]:
    """bench/engine.py of `tree`: tokens/s of the mesh by level."""
    subprocess.run([str(PYTHON), str(tree / "bench" / "engine.py"), "--no-peer", "--json", str(out), *args],
                   cwd=tree, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    results = json.loads(out.read_text())["results"]
    return {r["streams"]: r["tokens_per_s"] for r in results if r["system"].startswith("infermesh")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the revision to compare with (a commit, a branch)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then bench/engine.py's arguments")
    args = parser.parse_args()
    extra = [a for a in args.engine_args if a != "--"]
    scratch = Path(tempfile.mkdtemp(prefix="infermesh-revisions-"))
    before = worktree(args.before, scratch / "before")
    figures: dict[str, list[dict[int, float]]] = {"before": [], "after": []}
    try:
        for i in range(args.rounds):
            for name, tree in (("before", before), ("after", ROOT)) if i % 2 == 0 else (("after", ROOT),
                                                                                          ("before", before)):
                figures[name].append(run(tree, extra, scratch / f"{name}-{i}.json"))
                print(f"round {i + 1} {name}: " + ", ".join(f"{n} streams {v:.1f} tok/s"
                                                          for n, v in sorted(figures[name][-1].items())), flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    print(f"\n| streams | {args.before} tok/s | this tree tok/s | ratio (median of {args.rounds}) |")
    print("|---:|---:|---:|---:|")
    for n in sorted(figures["after"][0]):
        b = [f[n] for f in figures["before"]]
        a = [f[n] for f in figures["after"]]
        ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
        print(f"| {n} | {' / '.join(f'{v:.1f}' for v in b)} | {' / '.join(f'{v:.1f}' for v in a)} | {ratio:.2f}x |")
    print(f"CPU: {cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
