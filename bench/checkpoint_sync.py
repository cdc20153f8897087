"""Shipping a model update as a signed incremental checkpoint, over an emulated wide-area link.

    sudo .venv/bin/python bench/checkpoint_sync.py [--rtt-ms 100] [--layers 2] [--loopback]

v1 is the default model (`infermesh model pull`); v2 is v1 with `--layers` of its decoder layers
perturbed (every tensor of those layers, +-1% noise: a fine-tune-like change, same file layout).
Both are published into one checkpoint store (`infermesh model publish`, 1 MiB chunks, zstd,
Ed25519), which a static HTTP server serves from one network namespace; the other syncs over
/work/shared/tools/wanem.py at `--rtt-ms`.  Measured in the same run: the baseline, a machine
with nothing syncing v2 (every chunk), against a machine that holds v1 syncing v2 (only the
chunks v2 changed).  Prints bytes moved and time to deploy, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WANEM = os.environ.get("WANEM", "/work/shared/tools/wanem.py")
SERVER_ADDR = "10.203.0.2"


def perturbed_copy(v1: Path, v2: Path, layers: list[int]) -> int:
    """v2 = v1 with every tensor of `layers` perturbed; returns the bytes of tensors changed."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(v1, v2)
    weights = load_file(str(v1 / "model.safetensors"))
    changed = 0
    generator = torch.Generator().manual_seed(21)
    for name, tensor in weights.items():
        if any(f".layers.{i}." in name for i in layers):
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * 0.01
            weights[name] = (tensor.float() * (1 + noise)).to(tensor.dtype)
            changed += tensor.numel() * tensor.element_size()
    save_file(weights, str(v2 / "model.safetensors"), metadata={"format": "pt"})
    return changed


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    started = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"checkpoint_sync: {' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
    return time.monotonic() - started, out.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rtt-ms", type=float, default=100.0)
    p.add_argument("--layers", type=int, default=2, help="decoder layers perturbed in v2")
    p.add_argument("--loopback", action="store_true", help="no namespaces (a smoke run without root)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    if not a.loopback and os.geteuid() != 0:
        raise SystemExit("checkpoint_sync: network namespaces need root (or pass --loopback)")
    py = str(ROOT / ".venv" / "bin" / "python")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        publisher = {**os.environ, "INFERMESH_HOME": str(tmp / "publisher")}
        v1 = Path(subprocess.run([py, "-m", "infermesh.cli", "model", "path", "default"], capture_output=True,
                                 text=True, check=True).stdout.strip())
        if (v1 / "model.gguf").is_file():           # the pulled folder keeps the GGUF: sync its float32 form
            from mesh.models.gguf import convert_gguf

            convert_gguf(v1 / "model.gguf", tmp / "v1")
            v1 = tmp / "v1"
        config = json.loads((v1 / "config.json").read_text())
        layers = [round(i * (config["num_hidden_layers"] - 1) / max(1, a.layers - 1)) for i in range(a.layers)]
        changed = perturbed_copy(v1, tmp / "v2", layers)
        store = tmp / "store"
        run([py, "-m", "infermesh.cli", "model", "keygen"], publisher)
        for version, folder in (("1", v1), ("2", tmp / "v2")):
            run([py, "-m", "infermesh.cli", "model", "publish", "smollm2-135m", version, "--folder", str(folder),
                 "--store", str(store)], publisher)
        pub = tmp / "publisher" / "keys" / "signing.pub"
        tag = f"ck{os.getpid() % 100000}"
        wanem = server = None
        host = "127.0.0.1" if a.loopback else SERVER_ADDR
        client: list[str] = [] if a.loopback else ["ip", "netns", "exec", f"{tag}c"]
        try:
            if not a.loopback:
                wanem = subprocess.Popen([sys.executable, WANEM, "up", "--rtt-ms", str(a.rtt_ms), "--a", f"{tag}c",
                                          "--b", f"{tag}s"], stdout=subprocess.PIPE, text=True)
                assert wanem.stdout is not None
                while not wanem.stdout.readline().startswith("READY"):
                    if wanem.poll() is not None:
                        raise SystemExit("checkpoint_sync: wanem did not start")
            server = subprocess.Popen([*([] if a.loopback else ["ip", "netns", "exec", f"{tag}s"]), py, "-m",
                                       "http.server", "8765", "--bind", host, "--directory", str(store)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.5)
            source = f"http://{host}:8765"
            results: dict[str, dict[str, Any]] = {}
            for machine, steps in (("fresh", ["2"]), ("holds v1", ["1", "2"])):
                env = {**os.environ, "INFERMESH_HOME": str(tmp / machine.replace(" ", "-"))}
                (Path(env["INFERMESH_HOME"]) / "trusted-keys").mkdir(parents=True)
                shutil.copy(pub, Path(env["INFERMESH_HOME"]) / "trusted-keys" / "publisher.pub")
                for version in steps:
                    seconds, line = run([*client, py, "-m", "infermesh.cli", "model", "sync", "smollm2-135m", version,
                                         "--from", source], env)
                moved = int(line.split("chunks, ")[1].split(" bytes")[0].replace(",", ""))
                results[machine] = {"seconds": round(seconds, 2), "bytes": moved, "line": line}
        finally:
            for proc in (server, wanem):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(15)
    size = (v1 / "model.safetensors").stat().st_size
    full, delta = results["fresh"], results["holds v1"]
    print(f"v2: {a.layers} of {config['num_hidden_layers']} layers perturbed (layers {layers}; {changed:,} bytes "
          f"of tensors changed, {changed / size:.1%} of the weights); link: "
          f"{'loopback' if a.loopback else f'{a.rtt_ms:g} ms RTT (wanem)'}")
    print("| sync of v2 | bytes moved | share of the model's bytes | time to deploy |")
    print("|---|---:|---:|---:|")
    for name, r in (("nothing held (baseline)", full), ("v1 held", delta)):
        print(f"| {name} | {r['bytes']:,} | {r['bytes'] / size:.1%} | {r['seconds']:.1f} s |")
    print(f"incremental / full: bytes {delta['bytes'] / full['bytes']:.3f}, "
          f"time {delta['seconds'] / full['seconds']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"layers": layers, "changed_bytes": changed, "model_bytes": size,
                                            "rtt_ms": a.rtt_ms, "full": full, "incremental": delta}, indent=2))


if __name__ == "__main__":
    main()
