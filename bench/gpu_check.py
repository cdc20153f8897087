"""The engine on a GPU: parity, the Triton kernel, and throughput against transformers, in one run.

    python3 bench/gpu_check.py                 # on a CUDA machine: the full check (at most ~6 min)
    python3 bench/gpu_check.py --smoke         # anywhere: a tiny model on the CPU, the same code paths
                                               # (Triton under its interpreter, graphs without capture)

No network and no model files: models are built with random weights from configs, the same weights
handed to transformers and to our engine.  Needs torch, triton, transformers, safetensors and grpcio
(the engine's error types), nothing else; the repository root is put on sys.path.

Each check prints PASS or FAIL (the exit status is 1 if any FAILs).  The checks themselves are in
tests/gpu/checks.py (fp32 greedy parity, bf16 logits, the Triton kernel, no host sync in a step),
which tests/gpu/test_checks.py also runs under pytest; this script adds:
- Throughput: P-token prompts, G generated tokens each, 1/16/64/256 concurrent requests; our
   engine (bf16, CUDA graphs) against transformers `generate` as one static batch (bf16); aggregate
   tokens/s, time per output token, peak GPU memory, and the ratio.  Passes when ours is >= 5x at
   64 concurrent for each model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if "--smoke" in sys.argv:                      # Triton reads this when kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from tests.gpu.checks import (  # noqa: E402
    CONFIGS,
    Model,
    Verdict,
    check_bf16_logits,
    check_fp32_parity,
    check_kernel,
    check_no_sync,
    drive,
    random_prompts,
    sync,
)

RESULTS: dict[str, Any] = {"checks": [], "throughput": []}


def log(msg: str) -> None:
    print(msg, flush=True)


def verdict(name: str, ok: bool, detail: str) -> bool:
    RESULTS["checks"].append({"check": name, "pass": ok, "detail": detail})
    log(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}")
    return ok


# -- 4: throughput ---------------------------------------------------------------------------------
@torch.inference_mode()
def hf_static(hf: Any, batch: int, prompt_len: int, gen: int, vocab: int) -> dict[str, float]:
    """transformers generate as one static batch: wall for gen tokens, and for 1 token (the prefill)."""
    ids = torch.tensor(random_prompts(batch, [prompt_len], vocab, seed=batch), device=hf.device)
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        sync(hf.device)
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(hf.device)
        return time.perf_counter() - t0

    timed(2)                                                              # warm-up
    first = timed(1)
    wall = timed(gen)
    return {"wall": wall, "ttft_p50": first, "tpot": (wall - first) / max(1, gen - 1)}


def throughput(model: Model, levels: list[int], prompt_len: int, gen: int, deadline: float, smoke: bool) -> None:
    cuda = model.device.type == "cuda"
    hf16 = model.hf_bf16() if cuda else model.hf32
    vocab = model.config.vocab_size
    rows = []
    for level in levels:
        if time.monotonic() > deadline:
            log(f"  {model.name} @ {level}: skipped, out of time")
            continue
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        theirs = hf_static(hf16, level, prompt_len, gen, vocab)
        hf_peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
        rows.append((level, "transformers", theirs, hf_peak))
    # Ours: one runner (CUDA graphs for every bucket up to the largest level), transformers' copy freed.
    model.hf16 = None
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    kv_bytes = max(levels) * (prompt_len + gen + 16) * kv_bytes_per_token(model) + (64 << 20)
    built = time.perf_counter()
    runner = model.runner("bfloat16" if cuda else "float32", "cuda" if cuda else "eager",
                          max_batch=max(levels), kv_bytes=kv_bytes)
    if runner.graphs is None:                 # the runner logged why; it measures without graphs
        verdict(f"{model.name} CUDA graph capture", False, "capture failed (see the warning above); "
                "the figures below are without graphs")
    log(f"  {model.name}: our runner built in {time.perf_counter() - built:.1f} s "
        f"({len(runner.graphs.sizes) if runner.graphs else 0} decode graphs)")
    drive(runner, random_prompts(2, [prompt_len], vocab, seed=99), 4, max_tokens_step=8192)   # warm-up
    for level in levels:
        if time.monotonic() > deadline:
            continue
        _, _, ours = drive(runner, random_prompts(level, [prompt_len], vocab, seed=level), gen,
                           max_tokens_step=8192)
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
        rows.append((level, "infermesh", ours, peak))
    del runner
    if cuda:
        torch.cuda.empty_cache()
    for level in levels:
        pair = {who: (m, peak) for lvl, who, m, peak in rows if lvl == level}
        if len(pair) < 2:
            continue
        entry = {"model": model.name, "concurrent": level, "prompt": prompt_len, "generated": gen}
        for who, (m, peak) in pair.items():
            entry[who] = {"tokens_per_s": level * gen / m["wall"], "tpot_ms": m["tpot"] * 1e3,
                          "ttft_p50_ms": m["ttft_p50"] * 1e3, "peak_gib": peak / 2**30}
        entry["ratio"] = entry["infermesh"]["tokens_per_s"] / entry["transformers"]["tokens_per_s"]
        RESULTS["throughput"].append(entry)


def kv_bytes_per_token(model: Model) -> int:
    c = CONFIGS[model.name]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2


def table() -> str:
    lines = ["| model | concurrent | ours tok/s | transformers tok/s | ratio | ours TPOT ms | transformers TPOT ms "
             "| ours TTFT p50 ms | transformers TTFT ms | ours peak GiB | transformers peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in RESULTS["throughput"]:
        o, t = e["infermesh"], e["transformers"]
        lines.append(f"| {e['model']} | {e['concurrent']} | {o['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | "
                     f"{e['ratio']:.1f}x | {o['tpot_ms']:.2f} | {t['tpot_ms']:.2f} | {o['ttft_p50_ms']:.0f} | "
                     f"{t['ttft_p50_ms']:.0f} | {o['peak_gib']:.2f} | {t['peak_gib']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (Triton's interpreter)")
    p.add_argument("--budget-s", type=float, default=330.0, help="stop starting throughput levels after this")
    p.add_argument("--models", default="", help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--json", default="", help="also write the results here")
    a = p.parse_args(argv)
    started = time.monotonic()
    deadline = started + a.budget_s
    if a.smoke:
        device = torch.device("cpu")
        models, levels, prompt_len, gen = ["tiny"], [1, 4], 16, 8
    else:
        if not torch.cuda.is_available():
            log("no CUDA device: run with --smoke for the CPU check")
            return 2
        device = torch.device("cuda")
        models, levels, prompt_len, gen = ["smollm2-135m", "llama-1.1b"], [1, 16, 64, 256], 128, 128
        torch.backends.cuda.matmul.allow_tf32 = False                        # fp32 parity means fp32
        torch.backends.cudnn.allow_tf32 = False
    if a.models:
        models = a.models.split(",")
    import transformers
    import triton

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"}
    RESULTS["env"] = env
    log(f"gpu_check: {env}")
    save = (lambda: Path(a.json).write_text(json.dumps(RESULTS, indent=1))) if a.json else (lambda: None)
    # One device run has to tell everything: a check that raises is a FAIL with its traceback, and the
    # rest still run; the results file is rewritten after each part, so a run cut short keeps them.
    ok = guarded("Triton paged decode kernel", check_kernel, device, a.smoke)
    save()
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            t0 = time.perf_counter()
            model = Model(name, device, Path(tmp))
            log(f"{name}: random weights built in {time.perf_counter() - t0:.1f} s")
            ok &= guarded(f"{name} fp32 greedy parity", check_fp32_parity, model, a.smoke)
            ok &= guarded(f"{name} bf16 logits", check_bf16_logits, model, a.smoke)
            if device.type == "cuda":
                ok &= guarded("no host sync inside a step", check_no_sync, model)
            save()
            model.hf32 = model.hf32.to(torch.bfloat16) if device.type == "cuda" else model.hf32
            model.hf16 = model.hf32 if device.type == "cuda" else None
            ok &= guarded(f"{name} throughput run", throughput, model, levels, prompt_len, gen, deadline, a.smoke)
            model.release_hf()
            log(table())
            save()
    if not a.smoke:
        for name in models:
            at64 = [e for e in RESULTS["throughput"] if e["model"] == name and e["concurrent"] == 64]
            ok &= verdict(f"{name} throughput at 64 concurrent", bool(at64) and at64[0]["ratio"] >= 5.0,
                          f"{at64[0]['ratio']:.1f}x transformers' static batch (target 5x)" if at64 else "not run")
    ok = ok and all(c["pass"] for c in RESULTS["checks"])
    RESULTS["seconds"] = time.monotonic() - started
    log(f"gpu_check: {'PASS' if ok else 'FAIL'} in {RESULTS['seconds']:.0f} s")
    save()
    return 0 if ok else 1


def guarded(name: str, check: Any, *args: Any) -> bool:
    """check(*args), its Verdict recorded; an exception is a FAIL of `name`, printed with its traceback,
    not the end of the run."""
    try:
        result = check(*args)
    except Exception as exc:
        import traceback

        log(traceback.format_exc(limit=-8))
        return verdict(name, False, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
    if isinstance(result, Verdict):
        return verdict(*result)
    return result is not False


if __name__ == "__main__":
    sys.exit(main())
