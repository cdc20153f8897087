"""`infermesh lora load | unload | list`: LoRA adapters on a running mesh, through its router's gRPC admin API
(the mesh's client certificate, as `infermesh top`; the edge's HTTP API is POST /v1/load_lora_adapter)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mesh.clients.values import LoraCard


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    lora = sub.add_parser("lora", help="load, unload and list LoRA adapters on a running mesh")
    lsub = lora.add_subparsers(dest="action", required=True)
    load = lsub.add_parser("load", help="load a PEFT adapter folder under NAME (requests then name it as their model)")
    load.add_argument("name")
    load.add_argument("path", help="the adapter's folder on the engines' machines (adapter_config.json + weights)")
    load.add_argument("--model", default="", help="its base model (default: the mesh's default model)")
    load.add_argument("--replica", default="", help="load it on this replica (default: the one holding fewest)")
    unload = lsub.add_parser("unload", help="unload an adapter everywhere (its requests in flight finish first)")
    unload.add_argument("name")
    lsub.add_parser("list", help="the adapters, their base models and the replicas holding them")
    for p in (load, unload, lsub.choices["list"]):
        p.add_argument("--router", default="127.0.0.1:50051",
                       help="the routers' gRPC addresses, comma-separated: a load or unload goes to each, as the "
                            "edge's goes to every router (list: the first)")
        p.add_argument("--key", default="", help="with keys configured: an admin key for load and unload (default "
                       "$INFERMESH_ADMIN_KEY), an API key for list (default $INFERMESH_API_KEY)")
        p.add_argument("--tls-dir", default=None, help="mesh client certificate folder (\"\": plaintext); default: "
                       "$INFERMESH_MESH_TLS_DIR, else <infermesh home>/mesh-ca/client if present")
    lora.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    import os

    import grpc

    from mesh import credentials
    from mesh.models import home

    default = home() / "mesh-ca" / "client"
    credentials.configure(a.tls_dir if a.tls_dir is not None else
                          os.environ.get(credentials.ENV_VAR, str(default) if default.is_dir() else ""))
    try:
        cards = asyncio.run(_call(a))
    except grpc.aio.AioRpcError as err:
        print(f"infermesh lora {a.action}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    if a.action != "list":
        print(f"{a.name}: {'loaded' if a.action == 'load' else 'unloaded'}")
    for c in cards:
        print(f"{c.name:<24} {c.model:<20} {','.join(c.replicas) or '-':<20} {c.path}")
    return 0


async def _call(a: argparse.Namespace) -> list[LoraCard]:
    """Through the edge's RouterPool over the routers given: a load on one, then every other learns it; an unload
    on each."""
    import os

    from mesh.clients.router_pool import RouterPool

    key = a.key or os.environ.get("INFERMESH_API_KEY" if a.action == "list" else "INFERMESH_ADMIN_KEY", "")
    pool = RouterPool([address for address in a.router.split(",") if address])
    try:
        if a.action == "list":
            return await pool.lora_adapters(key=key)
        if a.action == "load":
            return await pool.load_lora_adapter(a.name, a.path, a.model, a.replica, key=key)
        return await pool.unload_lora_adapter(a.name, key=key)
    finally:
        await pool.close()
