"""What grammar-constrained decoding costs: the grammar libraries' mask cost, and the mesh's tokens/s at 16
concurrent streams with and without JSON-schema constraints.

1. Masks (in process, no model): 16 matchers, one per stream, walk the 20 schemas of
   tests/data/json_schemas.py over the default model's vocabulary; each step fills the 16 rows' token
   masks, as the engine's sampler does, then every row takes a random allowed token.  xgrammar (what
   the engine uses) and llguidance (if installed) side by side: compile time and mask time per step.
2. Served (`infermesh up`, one engine): the same 64 chat requests (20 schemas, seeds 0..63, temperature
   0.7) run with `response_format` json_schema, 16 at a time; then again unconstrained with each
   request's max_tokens set to the length its constrained run produced and ignore_eos, so both runs
   generate the same tokens from the same prompts with the same sampling: the difference is the
   grammar's.  Then the same at temperature 0 (greedy: unconstrained rows take the engine's greedy
   shortcut and speculative drafts, which a constrained row cannot).  Rounds alternate constrained and
   unconstrained runs, and the best of each counts.

    .venv/bin/python bench/grammar.py [--rounds 2] [--requests 64] [--streams 16] [--port-offset 700]
                                      [--skip-served] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import INFERMESH, cpu_name, stop, wait_http  # noqa: E402

from tests.data.json_schemas import SCHEMAS  # noqa: E402

MODEL = "smollm2-135m"


def mask_cost(streams: int, steps: int) -> dict[str, dict[str, float]]:
    """Per library: seconds to compile the 20 schemas, and milliseconds per step to fill `streams` masks."""
    import torch
    from transformers import AutoTokenizer

    from mesh import models
    from mesh.models import eos_token_ids

    folder = models.path("default")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    libraries: dict[str, Any] = {"xgrammar": _xgrammar(tokenizer, vocab, sorted(eos_token_ids(folder)))}
    try:
        libraries["llguidance"] = _llguidance(tokenizer, vocab)
    except ImportError:
        print("llguidance is not installed (pip install llguidance): measuring xgrammar only", flush=True)
    out = {}
    for name, (compile_one, fill, allowed, accept, done) in libraries.items():
        t0 = time.perf_counter()
        compiled = [compile_one(schema) for _, _, schema in SCHEMAS]
        compile_s = time.perf_counter() - t0
        rng = random.Random(0)
        matchers = [compiled[i % len(compiled)]() for i in range(streams)]
        spent = 0.0
        for step in range(steps):
            t0 = time.perf_counter()
            mask = fill(matchers)
            spent += time.perf_counter() - t0
            for i, m in enumerate(matchers):
                accept(m, rng.choice(allowed(mask, i, torch)))
                if done(m):
                    matchers[i] = compiled[(i + step) % len(compiled)]()
        out[name] = {"compile_20_schemas_s": compile_s, "mask_ms_per_step": 1e3 * spent / steps,
                     "mask_us_per_token": 1e6 * spent / steps / streams}
        print(f"  {name}: compile 20 schemas {compile_s * 1e3:.0f} ms; masks for {streams} rows "
              f"{1e3 * spent / steps:.3f} ms per step ({1e6 * spent / steps / streams:.1f} us per token)", flush=True)
    return out


def _xgrammar(tokenizer: Any, vocab: int, eos: list[int]) -> tuple[Any, ...]:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                                                      stop_token_ids=eos), max_threads=1)
    bitmask = None

    def compile_one(schema: dict[str, Any]) -> Any:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        return lambda: xgr.GrammarMatcher(compiled)

    def fill(matchers: list[Any]) -> Any:
        nonlocal bitmask
        if bitmask is None:
            bitmask = xgr.allocate_token_bitmask(len(matchers), vocab)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def allowed(mask: Any, i: int, torch: Any) -> list[int]:
        logits = torch.zeros(1, vocab)
        xgr.apply_token_bitmask_inplace(logits, mask[i:i + 1], vocab_size=vocab)
        return torch.nonzero(logits[0] == 0).flatten().tolist()

    return compile_one, fill, allowed, lambda m, t: m.accept_token(t), lambda m: m.is_terminated()


def _llguidance(tokenizer: Any, vocab: int) -> tuple[Any, ...]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    bitmask = None

    def compile_one(schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        llguidance.LLMatcher(lltok, grammar)          # compiled (and checked) here
        return lambda: llguidance.LLMatcher(lltok, grammar)

    def fill(matchers: list[Any]) -> Any:
        nonlocal bitmask
        if bitmask is None:
            bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocab)
        for i, m in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(m, bitmask, i)
        return bitmask

    def allowed(mask: Any, i: int, torch: Any) -> list[int]:
        logits = torch.zeros(1, vocab)
        llguidance.torch.apply_token_bitmask_inplace(logits, mask[i:i + 1])
        return torch.nonzero(logits[0] == 0).flatten().tolist()

    return compile_one, fill, allowed, lambda m, t: m.consume_token(t), lambda m: m.is_stopped()


def requests(n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        name, prompt, schema = SCHEMAS[i % len(SCHEMAS)]
        out.append({"model": MODEL, "messages": [{"role": "user", "content": f"{prompt} Answer in JSON."}],
                    "temperature": 0.7, "seed": i, "max_tokens": 400,
                    "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}})
    return out


async def drive(base: str, bodies: list[dict[str, Any]], streams: int) -> tuple[float, list[int], int]:
    """(seconds, completion tokens per request, failures) for the bodies run `streams` at a time."""
    lengths = [0] * len(bodies)
    failed = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal failed
        while not queue.empty():
            i = queue.get_nowait()
            r = await client.post(f"{base}/v1/chat/completions", json=bodies[i])
            if r.status_code != 200:
                failed += 1
                print(f"    request {i}: {r.status_code} {r.text[:200]}", flush=True)
                continue
            lengths[i] = r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(streams)))
        return time.perf_counter() - t0, lengths, failed


def served(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    base = f"http://127.0.0.1:{8000 + args.port_offset}"
    log = logdir / "infermesh.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([str(INFERMESH), "up", "--engines", "1", "--port-offset", str(args.port_offset)],
                                stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "INFERMESH_EDGE_RESPONSE_CACHE_TTL": "0"})
        try:
            wait_http("infermesh", f"{base}/health", proc, 300, log)
            constrained = requests(args.requests)
            asyncio.run(drive(base, constrained[:args.streams], args.streams))     # warm up, compile the schemas
            best: dict[str, float] = {}
            for r in range(args.rounds):
                line = []
                for mode, temperature in (("sampled", 0.7), ("greedy", 0.0)):
                    bodies = [b | {"temperature": temperature} for b in constrained]
                    seconds, lengths, failed = asyncio.run(drive(base, bodies, args.streams))
                    free = [{k: v for k, v in b.items() if k != "response_format"} | {"max_tokens": n,
                                                                                      "ignore_eos": True}
                            for b, n in zip(bodies, lengths, strict=True) if n]
                    free_s, free_lengths, free_failed = asyncio.run(drive(base, free, args.streams))
                    rates = {f"constrained_{mode}": sum(lengths) / seconds, f"free_{mode}": sum(free_lengths) / free_s}
                    line.append(f"{mode}: constrained {rates[f'constrained_{mode}']:.1f} tok/s ({sum(lengths)} tokens, "
                                f"{failed} failed), unconstrained {rates[f'free_{mode}']:.1f} tok/s "
                                f"({free_failed} failed)")
                    best = {k: max(best.get(k, 0.0), v) for k, v in rates.items()} | \
                        {k: v for k, v in best.items() if k not in rates}
                print(f"  round {r}: " + "; ".join(line), flush=True)
            return best
        finally:
            stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--steps", type=int, default=400, help="mask-cost steps per library")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port-offset", type=int, default=700)
    p.add_argument("--skip-served", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    print(f"CPU: {cpu_name()}", flush=True)
    print(f"1. token masks, {args.streams} streams, 20 JSON schemas:", flush=True)
    results: dict[str, Any] = {"cpu": cpu_name(), "masks": mask_cost(args.streams, args.steps)}
    if not args.skip_served:
        print(f"2. served, {args.streams} concurrent streams, {args.requests} requests:", flush=True)
        logdir = Path("/tmp/infermesh-bench-grammar")
        logdir.mkdir(exist_ok=True)
        best = served(args, logdir)
        results["served_tokens_per_s"] = best
        for mode in ("sampled", "greedy"):
            ratio = best[f"constrained_{mode}"] / best[f"free_{mode}"]
            print(f"{mode} (temperature {'0.7' if mode == 'sampled' else '0'}): constrained / unconstrained, same "
                  f"tokens: {ratio:.3f} (cost {100 * (1 - ratio):.1f}%)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
