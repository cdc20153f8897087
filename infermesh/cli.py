"""The `infermesh` command: up, chat, model."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path


def _cmd_up(a: argparse.Namespace) -> int:
    from infermesh.launcher import MeshConfig, run
    from mesh import models

    try:
        config = MeshConfig(engines=a.engines, models=tuple(a.model or ["default"]), dtype=a.dtype,
                            discovery=a.discovery, host=a.host, port_offset=a.port_offset, region=a.region,
                            kv_cache_mb=a.kv_cache_mb, versions=tuple(a.version or ["1"]),
                            engine_threads=a.engine_threads, fallback_engines=a.fallback_engines,
                            mesh_tls=not a.insecure_mesh,
                            restart=not a.no_restart, routers=a.routers, tokenizers=a.tokenizers,
                            cache_dir=a.cache_dir, session_store=a.session_store, draft_model=a.draft_model)
        if a.draft_model:
            models.served_model(a.draft_model)   # a model that is not there: said now, not by an engine that exits
    except (ValueError, models.ModelError) as exc:
        print(f"infermesh up: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(run(config))


def _sse_lines(url: str, body: dict[str, object], headers: dict[str, str]) -> Iterator[dict[str, object]]:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=600) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def _chat_body(a: argparse.Namespace) -> dict[str, object]:
    messages = ([{"role": "system", "content": a.system}] if a.system else []) + [
        {"role": "user", "content": a.prompt}]
    body: dict[str, object] = {"model": a.model, "messages": messages, "stream": True,
                               "max_tokens": a.max_tokens, "temperature": a.temperature}
    if a.seed is not None:
        body["seed"] = a.seed
    return body


def _print_chunk(chunk: dict[str, object]) -> dict[str, object] | None:
    if "error" in chunk:
        raise RuntimeError(str(chunk["error"]))
    for choice in chunk.get("choices", []):  # type: ignore[attr-defined]
        text = choice.get("delta", {}).get("content") or ""
        sys.stdout.write(text)
        sys.stdout.flush()
    meta = chunk.get("infermesh")
    return meta if isinstance(meta, dict) else None


def _cmd_chat(a: argparse.Namespace) -> int:
    import os
    import urllib.error

    headers = {}
    key = a.api_key or os.environ.get("INFERMESH_API_KEY") or ""
    if key:
        headers["authorization"] = f"Bearer {key}"
    body = _chat_body(a)
    meta: dict[str, object] | None = None
    transport = ""
    try:
        if a.http3:
            meta, transport = asyncio.run(_chat_http3(a, body, headers))
        else:
            for chunk in _sse_lines(f"{a.url.rstrip('/')}/v1/chat/completions", body, headers):
                meta = _print_chunk(chunk) or meta
    except urllib.error.HTTPError as err:
        print(f"\ninfermesh chat: HTTP {err.code}: {err.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as err:
        print(f"\ninfermesh chat: {err}", file=sys.stderr)
        return 1
    print()
    if meta and a.verbose:
        print(f"[{json.dumps(meta)}]", file=sys.stderr)
    if transport and a.verbose:
        print(f"[http3: {transport}]", file=sys.stderr)
    return 0


async def _chat_http3(a: argparse.Namespace, body: dict[str, object], headers: dict[str, str]
                      ) -> tuple[dict[str, object] | None, str]:
    """Stream the answer over HTTP/3; return the last `infermesh` object and how the connection was made."""
    from urllib.parse import urlsplit

    from mesh.clients.http3 import H3Client, TicketStore
    from mesh.models import home

    url = urlsplit(a.http3_url)
    # Tickets persist across runs, so the next `chat --http3` resumes and sends its request in 0-RTT.
    tickets = TicketStore(home() / "h3-tickets.json")
    meta = None
    async with H3Client(url.hostname or "127.0.0.1", url.port or 8443, verify=False, tickets=tickets) as client:
        async with client.stream("POST", "/v1/chat/completions", {"content-type": "application/json", **headers},
                                 json.dumps(body).encode()) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.read()).decode(errors='replace')}")
            buffer = b""
            async for data in response.chunks():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    line = event.decode().strip()
                    if line.startswith("data: ") and line != "data: [DONE]":
                        meta = _print_chunk(json.loads(line[6:])) or meta
    return meta, client.handshake_summary()


def _cmd_model(a: argparse.Namespace) -> int:
    from infermesh import checkpoints_cli as checkpoints
    from mesh import models

    if a.action in checkpoints.ACTIONS:
        return checkpoints.run(a)
    try:
        if a.action == "pull":
            print(models.pull(a.name))
        elif a.action == "path":
            print(models.path(a.name))
        elif a.action == "register" and a.folder.lower().endswith(".gguf"):
            source = Path(a.folder).expanduser()
            print(models.import_gguf(a.name, a.folder, check=lambda folder: engine_check(folder, source)))
        elif a.action == "register":
            engine_check(models.validate_folder(a.folder))
            print(models.register(a.name, a.folder, a.task))
        elif a.action == "inspect":
            folder = models.path(a.name)
            info = models.describe_folder(folder)
            info["engine"] = engine_view(folder)
            for key, value in info.items():
                print(f"{key + ':':<16} {value}")
        else:
            for entry in models.list_models():
                print(f"{entry['name']:<20} {'present' if entry['present'] else 'absent':<8} {entry['path']}")
    except models.ModelError as exc:
        print(f"infermesh model: {exc}", file=sys.stderr)
        return 1
    return 0


def engine_check(folder: Path, gguf: Path | None = None) -> None:
    """Raise ModelError when the engine cannot run the folder's config (the field it refuses named), or when its
    GGUF's tensors disagree with it (the tensor named: models/gguf_check.py).  `gguf`: the file the folder's
    model.gguf was made from, named in the message instead of the folder's copy."""
    from mesh import models
    from mesh.models.gguf_header import GgufError
    from services.engine.runtime.models.config import LlamaConfig
    from services.engine.runtime.models.gguf_check import check_file

    try:
        config = LlamaConfig.from_folder(folder)
    except (ValueError, KeyError) as exc:
        raise models.ModelError(f"{folder}: the engine cannot run this config: {exc}") from exc
    file = gguf or folder / "model.gguf"
    if gguf is not None or file.is_file():
        try:
            check_file(file, config)
        except GgufError as exc:
            raise models.ModelError(str(exc)) from exc


def engine_view(folder: Path) -> str:
    """How an engine on this machine would run the folder with default flags, without measuring anything."""
    import torch

    from mesh import models
    from services.engine.runtime import plan, tune

    try:
        engine_check(folder)
    except models.ModelError as exc:
        return f"not runnable: {exc}"
    if torch.cuda.is_available():
        return str(plan.decide())
    tuned = tune.cached(folder)
    chosen = plan.decide(tuned=tuned)
    return str(chosen) if tuned is not None else \
        f"{chosen} (not tuned here yet: the engine measures its matmul kinds at first start, or `infermesh tune`)"


def _cmd_top(a: argparse.Namespace) -> int:
    import os

    from infermesh import top
    from mesh import credentials
    from mesh.models import home

    # `infermesh up` runs mutual TLS by default: present the mesh's client leaf when there is one.
    default = home() / "mesh-ca" / "client"
    tls_dir = a.tls_dir
    if tls_dir is None:
        tls_dir = os.environ.get(credentials.ENV_VAR, str(default) if default.is_dir() else "")
    credentials.configure(tls_dir)
    return top.main(a.router, once=a.once, interval_s=a.interval)


def _cmd_tune(a: argparse.Namespace) -> int:
    from mesh import models
    from services.engine.runtime import tune

    try:
        folder = models.path(a.model)
    except models.ModelError as exc:
        print(f"infermesh tune: {exc}", file=sys.stderr)
        return 1
    tuned = tune.tune(folder, use_cache=not a.again)
    if tuned is None:
        print("infermesh tune: no CPU matmul kind to measure (no fused CPU ops, FBGEMM or oneDNN)", file=sys.stderr)
        return 1
    print(f"{'kind':<8}" + "".join(f"{f'{r} rows':>10}" for r in tune.ROWS) + "   (ms per model step, GEMMs only)")
    for kind, ms in tuned.ms.items():
        print(f"{kind:<8}" + "".join(f"{v:>10.1f}" for v in ms))
    print(f"chosen: {tune.describe(tuned).split(' (')[0]}")
    return 0


def parser() -> argparse.ArgumentParser:
    from infermesh import checkpoints_cli as checkpoints  # light: its commands import their libraries when run
    from infermesh import lora_cli

    p = argparse.ArgumentParser(prog="infermesh", description="LLM serving as a mesh of gRPC services")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the whole mesh on this machine until SIGINT/SIGTERM")
    up.add_argument("--engines", type=int, default=1, help="engine replicas (default 1)")
    up.add_argument("--routers", type=int, default=1,
                    help="router replicas (default 1): the edge spreads requests over them and resumes a stream "
                         "whose router dies on another")
    up.add_argument("--tokenizers", type=int, default=1,
                    help="tokenizer replicas (default 1): every router balances over them, each behind a breaker")
    up.add_argument("--cache-dir", default="", metavar="DIR",
                    help="where the cache service keeps its disk tier of KV blocks and its sessions across "
                         "restarts (default <infermesh home>/cache/<its port>; 'none': memory only)")
    up.add_argument("--session-store", default="embedded", metavar="embedded|URL",
                    help="where sessions live: 'embedded' (the cache service, kept in --cache-dir) or Redis, "
                         "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB], with the same sliding TTL")
    up.add_argument("--model", action="append",
                    help="model NAME; repeat to serve several, the engines dealt out over them "
                         "(default: the default model)")
    up.add_argument("--draft-model", default="", metavar="NAME",
                    help="a smaller model with the same tokenizer (e.g. qwen2.5-coder-0.5b for the 1.5b) that drafts "
                         "speculative tokens in the first model's engines, verified by speculative sampling (the "
                         "output's distribution unchanged); default: drafts by prompt lookup")
    up.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "int8"), default="auto",
                    help="engines' compute: auto = the matmul kinds measured fastest on this machine, none less "
                         "precise than bf16 (`infermesh tune`); float32 = transformers' bits; int8 = int8 weights "
                         "(faster on CPU, a quantized model)")
    up.add_argument("--discovery", choices=("static", "consul"), default="static")
    up.add_argument("--host", default="127.0.0.1", help="edge bind address (non-loopback needs API keys)")
    up.add_argument("--port-offset", type=int, default=0, help="add this to every port")
    up.add_argument("--region", default="local")
    up.add_argument("--kv-cache-mb", type=int, default=1024, help="KV cache budget per engine (MiB)")
    up.add_argument("--fallback-engines", type=int, default=0,
                    help="engines of the fallback model (the first model in int8, served as NAME-int8): the router "
                         "turns to them, marking answers degraded, when the primary has no usable replica")
    up.add_argument("--engine-threads", type=int, default=0, metavar="N",
                    help="torch threads per engine (default: the CPUs this process may use, shared out among the "
                         "engines)")
    up.add_argument("--version", action="append", metavar="VERSION[=FOLDER]",
                    help="model version(s) to serve side by side (default 1); engines are dealt out in turn; "
                         "FOLDER: that version's weights (default: the model's own); the first is the default")
    up.add_argument("--no-restart", action="store_true",
                    help="report a service that dies instead of restarting it (tests that kill on purpose)")
    up.add_argument("--insecure-mesh", action="store_true",
                    help="plaintext gRPC between the services (debugging); default: mutual TLS with the mesh CA")
    up.set_defaults(func=_cmd_up)

    chat = sub.add_parser("chat", help="stream one answer from a running mesh")
    chat.add_argument("prompt")
    chat.add_argument("--model", default="default")
    chat.add_argument("--system", default="")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int)
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--http3", action="store_true",
                      help="use HTTP/3 (QUIC) instead of HTTP/1.1; resumes with 0-RTT using a session ticket kept in "
                           "$INFERMESH_HOME/h3-tickets.json")
    chat.add_argument("--http3-url", default="https://127.0.0.1:8443")
    chat.add_argument("--api-key", default="", help="default: $INFERMESH_API_KEY")
    chat.add_argument("-v", "--verbose", action="store_true",
                      help="print which replica served the answer (with --http3: whether 0-RTT was used)")
    chat.set_defaults(func=_cmd_chat)

    model = sub.add_parser("model", help="fetch, convert and locate models")
    msub = model.add_subparsers(dest="action", required=True)
    for action, text in (("pull", "fetch and convert a model once"), ("path", "print a model's folder")):
        m = msub.add_parser(action, help=text)
        m.add_argument("name")
    reg = msub.add_parser("register", help="register a local Hugging Face folder (an architecture the engine runs), "
                                           "or a GGUF file (its blocks kept as they are)")
    reg.add_argument("name")
    reg.add_argument("folder", help="a Hugging Face folder, or FILE.gguf")
    reg.add_argument("--task", choices=("auto", "generate", "embed"), default="auto",
                     help="embed: an embedding model, serving /v1/embeddings only; auto (default): embed for a "
                          "sentence-transformers folder (modules.json), else generate")
    ins = msub.add_parser("inspect", help="architecture, parameters, context, dtype, quantization, chat template, "
                                          "and how the engine would run it here")
    ins.add_argument("name", help="model NAME, or a folder")
    msub.add_parser("list", help="known models")
    checkpoints.add_parsers(msub)
    model.set_defaults(func=_cmd_model)

    top = sub.add_parser("top", help="live view of the replicas: load, queue, KV use, breaker, region, version")
    top.add_argument("--router", default="127.0.0.1:50051", help="the router's gRPC address")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print one snapshot and exit")
    top.add_argument("--tls-dir", default=None, help="mesh client certificate folder (\"\": plaintext); default: "
                     "$INFERMESH_MESH_TLS_DIR, else <infermesh home>/mesh-ca/client if present")
    top.set_defaults(func=_cmd_top)

    tune = sub.add_parser("tune", help="measure the CPU matmul kinds for a model on this machine (engines use "
                                       "the cached answer)")
    tune.add_argument("model", nargs="?", default="default", help="model NAME (default: the default model)")
    tune.add_argument("--again", action="store_true", help="measure even if an answer is cached")
    tune.set_defaults(func=_cmd_tune)
    lora_cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
