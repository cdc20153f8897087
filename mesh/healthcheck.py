"""`python -m mesh.healthcheck HOST:PORT [--service NAME]`: exit 0 when the gRPC health service says SERVING.

For container healthchecks (docker compose, plain `docker run --health-cmd`), where Kubernetes' native
`grpc` probe is not available.  `HOST:PORT` may also be an `http://` URL (the edge's `/health`): then
exit 0 on a 200.  Exit 1 with one line on stderr otherwise, so `docker inspect` shows why.
Imports only grpc and the health stubs: a probe runs every few seconds and must start fast.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def probe_grpc(address: str, service: str = "", timeout: float = 2.0) -> str:
    """"" when `address` reports SERVING for `service`, else the reason it does not."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
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
    a = p.parse_args(argv)
    if a.target.startswith(("http://", "https://")):
        reason = probe_http(a.target, a.timeout)
    else:
        reason = probe_grpc(a.target, a.service, a.timeout)
    if reason:
        print(f"{a.target}: not serving ({reason})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
