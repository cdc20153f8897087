"""`infermesh model keygen | publish | sync` (infermesh/cli.py adds these to `infermesh model`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ACTIONS = ("keygen", "publish", "sync")


def add_parsers(msub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    keygen = msub.add_parser("keygen", help="make an Ed25519 signing key for `model publish` (and print its "
                                            "public half, for other machines' trusted keys)")
    keygen.add_argument("--key", default="", help="default: <infermesh home>/keys/signing.key")
    pub = msub.add_parser("publish", help="write a model version into a checkpoint store as signed, "
                                          "content-addressed chunks (only chunks the store lacks are written)")
    pub.add_argument("name")
    pub.add_argument("version")
    pub.add_argument("--folder", default="", help="the version's weights (default: the model NAME's folder)")
    pub.add_argument("--store", default="", help="the store folder (default: <infermesh home>/checkpoints)")
    pub.add_argument("--key", default="", help="signing key (default: <infermesh home>/keys/signing.key)")
    pub.add_argument("--chunk-mb", type=int, default=1, help="chunk size in MiB (default 1)")
    sync = msub.add_parser("sync", help="fetch a version's missing chunks from a store (folder, http(s) URL, or "
                                        "grpc://HOST:PORT of a cache service serving one), "
                                        "verify every chunk and the signature, then make it loadable")
    sync.add_argument("name")
    sync.add_argument("version")
    sync.add_argument("--from", dest="source", required=True, metavar="SOURCE", help="store folder or URL")
    sync.add_argument("--tls-dir", default="", help="grpc://: the mesh client certificate folder (default: "
                                                    "$INFERMESH_MESH_TLS_DIR, else <infermesh home>/mesh-ca/client)")
    sync.add_argument("--trusted", default="", help="folder of trusted public keys (*.pub; default: "
                                                    "<infermesh home>/trusted-keys)")


def run(a: argparse.Namespace) -> int:
    from mesh.checkpoints import ship
    from mesh.checkpoints.manifest import CheckpointError, generate_key

    try:
        if a.action == "keygen":
            public = generate_key(Path(a.key) if a.key else ship.signing_key_file())
            print(f"signing key written; its public half: {public}")
            print(f"trust it elsewhere: copy it into {ship.trusted_keys_dir()}/ on the machines that sync")
        elif a.action == "publish":
            folder = Path(a.folder) if a.folder else _model_folder(a.name)
            store = Path(a.store) if a.store else ship.local_store()
            done = ship.publish(a.name, a.version, folder, store, Path(a.key) if a.key else ship.signing_key_file(),
                                chunk_bytes=a.chunk_mb << 20)
            print(f"{a.name} {a.version}: {done.size:,} bytes, {done.chunks_written} new chunks "
                  f"({done.bytes_written:,} bytes compressed) -> {done.manifest}")
        else:
            if a.source.startswith("grpc://"):
                _mesh_credentials(a.tls_dir)
            got = ship.sync(a.source, a.name, a.version, Path(a.trusted) if a.trusted else None)
            print(f"{a.name} {a.version}: signed by key {got.key_id}; fetched {got.chunks_fetched} chunks, "
                  f"{got.bytes_fetched:,} bytes for {got.size:,} ({got.bytes_fetched / max(got.size, 1):.1%}); "
                  f"loadable at {got.folder}")
    except CheckpointError as exc:
        print(f"infermesh model {a.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def _mesh_credentials(tls_dir: str) -> None:
    """A cache service speaks mutual TLS: $INFERMESH_MESH_TLS_DIR, else this machine's mesh client leaf."""
    import os

    from mesh import credentials
    from mesh.models import home

    default = home() / "mesh-ca" / "client"
    credentials.configure(tls_dir or os.environ.get(credentials.ENV_VAR, str(default) if default.is_dir() else ""))


def _model_folder(name: str) -> Path:
    from mesh import models
    from mesh.checkpoints.manifest import CheckpointError

    try:
        return models.path(name)
    except models.ModelError as exc:
        raise CheckpointError(str(exc)) from None
