"""`python -m mesh.healthcheck HOST:PORT [--service NAME]`: exit 0 when the gRPC health service says SERVING.

For container healthchecks (docker compose, plain `docker run --health-cmd`), where Kubernetes' native
`grpc` probe is not available.  `HOST:PORT` may also be an `http://` URL (the edge's `/health`): then
exit 0 on a 200.  Exit 1 with one line on stderr otherwise, so `docker inspect` shows why.
Against a mesh with mutual TLS the probe presents the certificate in `--tls-dir` (default:
$INFERMESH_MESH_TLS_DIR, the service's own folder in the compose file).
Imports only grpc, the health stubs and mesh.credentials: a probe runs every few seconds and must start fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.credentials import ENV_VAR, TLS_CHANNEL_OPTIONS, MeshTLS


def probe_grpc(address: str, service: str = "", timeout: float = 2.0, tls_dir: str = "") -> str:
    """"" when `address` reports SERVING for `service`, else the reason it does not."""
    try:
        tls = MeshTLS.load(tls_dir) if tls_dir else None
    except OSError as exc:
        return f"--tls-dir: {exc}"
    try:
        with (grpc.secure_channel(address, tls.channel_credentials(), options=TLS_CHANNEL_OPTIONS) if tls
              else grpc.insecure_channel(address)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return ""


def probe_http(url: str, timeout: float = 2.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return "" if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except OSError as exc:
        return str(exc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mesh.healthcheck")
    p.add_argument("target", help="HOST:PORT of a gRPC service, or an http:// URL")
    p.add_argument("--service", default="", help="the gRPC health service name; default: the whole server")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds")
    p.add_argument("--tls-dir", default=os.environ.get(ENV_VAR, ""),
                   help=f"mesh certificate folder for mutual TLS (default: ${ENV_VAR}; \"\": plaintext)")
    a = p.parse_args(argv)
    if a.target.startswith(("http://", "https://")):
        reason = probe_http(a.target, a.timeout)
    else:
        reason = probe_grpc(a.target, a.service, a.timeout, a.tls_dir)
    if reason:
        print(f"{a.target}: not serving ({reason})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
