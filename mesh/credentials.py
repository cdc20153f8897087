"""The mesh's mutual-TLS credentials for grpcio, and the one process-wide choice of them.

A TLS folder holds `ca.crt` (the mesh CA), `tls.crt` and `tls.key` (this process's leaf, signed by
that CA): the layout of a Kubernetes TLS Secret plus its CA, and what mesh/pki.py writes per service
kind.  Every gRPC server of the mesh then requires a client certificate signed by the mesh CA, and
every channel presents its own leaf, so only holders of a mesh certificate reach the services.

Clients check the server's certificate against the mesh CA and the name MESH_NAME, which every leaf
carries as a SAN, not against the address dialled: replicas move (pod IPs, Consul addresses, NAT),
the CA is what authenticates them.  Standard library and grpc only: mesh/healthcheck.py (a container
probe that must start fast) uses it.

The process-wide setting is made once at startup by `configure(folder)` (run_service does it from
the config's tls_dir); until then it comes from $INFERMESH_MESH_TLS_DIR, so operators' tools and
tests reach a TLS mesh by pointing that variable at a client folder ("" or unset: plaintext).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

MESH_NAME = "infermesh-mesh"            # the SAN every leaf carries and every client expects
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
ENV_VAR = "INFERMESH_MESH_TLS_DIR"


@dataclass(frozen=True)
class MeshTLS:
    """The CA to trust and the leaf to present, as PEM bytes."""

    root: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> MeshTLS:
        """Read FOLDER/ca.crt, tls.crt and tls.key; OSError names the one missing."""
        path = Path(folder)
        return cls(*((path / name).read_bytes() for name in (CA_FILE, CERT_FILE, KEY_FILE)))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root, self.key, self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        # require_client_auth: a caller without a certificate signed by the mesh CA is refused in the handshake.
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.root,
                                           require_client_auth=True)


# Channel options a TLS channel adds: the name to verify, whatever address it dials.
TLS_CHANNEL_OPTIONS = [("grpc.ssl_target_name_override", MESH_NAME)]

_configured = False
_current: MeshTLS | None = None


def configure(folder: str | os.PathLike[str]) -> MeshTLS | None:
    """Make FOLDER's credentials this process's (""/None: plaintext); returns them."""
    global _configured, _current
    _current = MeshTLS.load(folder) if folder else None
    _configured = True
    return _current


def current() -> MeshTLS | None:
    """The process-wide credentials: configure()'s, else $INFERMESH_MESH_TLS_DIR's, else None."""
    if not _configured:
        configure(os.environ.get(ENV_VAR, ""))
    return _current
