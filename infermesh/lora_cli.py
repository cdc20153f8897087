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
    """The first router loads (or lists); every other one then learns the adapter on the replica it went to.
    An unload goes to every router: NOT_FOUND only when none knew the adapter."""
    import os

    import grpc

    from mesh.clients.router_client import RouterClient

    key = a.key or os.environ.get("INFERMESH_API_KEY" if a.action == "list" else "INFERMESH_ADMIN_KEY", "")
    clients = [RouterClient(address) for address in a.router.split(",") if address]
    try:
        if a.action == "list":
            return await clients[0].lora_adapters(key=key)
        if a.action == "load":
            cards = await clients[0].load_lora_adapter(a.name, a.path, a.model, a.replica, key=key)
            holder = next((c.replicas[0] for c in cards if c.name == a.name and c.replicas), a.replica)
            for client in clients[1:]:
                await client.load_lora_adapter(a.name, a.path, a.model, holder, key=key)
            return cards
        found: list[LoraCard] | None = None
        missing: grpc.aio.AioRpcError | None = None
        for client in clients:
            try:
                found = await client.unload_lora_adapter(a.name, key=key)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                missing = err
        if found is None and missing is not None:
            raise missing
        return found or []
    finally:
        for client in clients:
            await client.close()
