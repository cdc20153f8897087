"""Who may call what inside the mesh: authorization by the kind of the caller's certificate.

Mutual TLS (mesh/credentials.py) proves a caller holds a leaf of the mesh CA; the leaf's subject
CN is its service kind (mesh/pki.py: cache, tokenizer, engine, router, edge, client).  Each
servicer names the kinds its RPCs serve, so a stolen engine leaf cannot read sessions nor steer
routing.  "client" is operators' tools and tests.  Health and reflection stay open to any leaf.

A plaintext server (--insecure-mesh, debugging only) knows no peer: `kind` is None and every
caller is let through, as before mutual TLS.
"""

from __future__ import annotations

import grpc

from mesh.errors import MeshError

ROUTER_ADMIN = frozenset({"edge", "client"})             # SetModelRouting: the edge checked the admin key
SESSIONS = frozenset({"router", "client"})               # the cache's GetSession, AppendSession, DeleteSession
BLOCKS = frozenset({"engine", "router", "client"})       # MatchPrefix, GetBlocks, PutBlocks, GetStats
ENGINE = frozenset({"router", "client"})                 # Generate, Abort, WatchLoad, GetInfo, LoadVersion, Drain
TOKENIZER = frozenset({"router", "client"})
RESPONSES = frozenset({"edge", "client"})                # the cache's GetResponse, PutResponse (response cache)
CHECKPOINTS = frozenset({"engine", "client"})            # the cache's GetCheckpointFile (model sync)

TENANT_KIND = "edge"            # the one caller whose `tenant` field is honoured: it derived it from a key


class PermissionDenied(MeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


def kind(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's certificate kind (its CN), "" if it has none; None on a plaintext server."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    names = auth.get("x509_common_name") or [b""]
    return names[0].decode("utf-8", "replace")


def permits(caller: str | None, allowed: frozenset[str]) -> bool:
    return caller is None or caller in allowed


def require(context: grpc.aio.ServicerContext, rpc: str, allowed: frozenset[str]) -> None:
    """Raise PermissionDenied unless the caller's kind is one of `allowed`."""
    caller = kind(context)
    if not permits(caller, allowed):
        raise PermissionDenied(f"{rpc} is not open to a {caller or 'nameless'!r} certificate; "
                               f"allowed: {', '.join(sorted(allowed))}")


def tenant_for(caller: str | None, tenant: str) -> str:
    """The tenant a request from `caller` runs as: the edge's own, else a namespace of the caller's kind.

    Only the edge derives a tenant from an API key; any other caller naming one could reach that
    tenant's sessions, so its requests share one namespace per kind instead ("peer:client").
    """
    if caller is None or caller == TENANT_KIND:
        return tenant
    return f"peer:{caller or 'nameless'}"
