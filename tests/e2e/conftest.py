"""A real mesh: `infermesh up` as a separate process, torn down with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from infermesh.launcher import http_ok
from mesh.credentials import TLS_CHANNEL_OPTIONS, MeshTLS
from mesh.grpcutil import channel
from mesh.models import home

OFFSET = int(os.environ.get("INFERMESH_TEST_PORT_OFFSET", "200"))


@dataclass(frozen=True)
class Mesh:
    http: str          # http://127.0.0.1:PORT
    http3_port: int
    router: str        # host:port of the router's gRPC
    log: Path
    engine_metrics_port: int
    tls_dir: Path | None = None   # the mesh's client certificate (`up` runs mutual TLS); None: --insecure-mesh

    def channel(self, address: str) -> grpc.aio.Channel:
        """An async channel to one of the mesh's gRPC services, presenting the mesh's client certificate."""
        return channel(address, MeshTLS.load(self.tls_dir) if self.tls_dir else None)

    def sync_channel(self, address: str) -> grpc.Channel:
        if self.tls_dir is None:
            return grpc.insecure_channel(address)
        tls = MeshTLS.load(self.tls_dir)
        return grpc.secure_channel(address, tls.channel_credentials(), options=TLS_CHANNEL_OPTIONS)


@contextlib.contextmanager
def running_mesh(args: list[str], offset: int, log: Path, env: dict[str, str] | None = None) -> Iterator[Mesh]:
    """`infermesh up ARGS --port-offset OFFSET` until the block ends; it must then stop cleanly."""
    m = Mesh(f"http://127.0.0.1:{8000 + offset}", 8443 + offset, f"127.0.0.1:{50051 + offset}", log, 9100 + offset,
             None if "--insecure-mesh" in args else home() / "mesh-ca" / "client")
    if http_ok(f"{m.http}/health"):
        pytest.fail(f"something already serves {m.http}; set INFERMESH_TEST_PORT_OFFSET")
    if "--cache-dir" not in args:     # each mesh its own: no session or KV block left by an earlier one
        args = [*args, "--cache-dir", str(log.parent / "cache-service")]
    # The edge's response cache answers a repeated deterministic request without the engines; the tests
    # that count what reaches them, or kill an engine under a request asked before, need every request to
    # go through.  tests/e2e/test_gateway_policies.py turns it on.
    env = {"INFERMESH_EDGE_RESPONSE_CACHE_TTL": "0", **(env or {})}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "infermesh.cli", "up", *args, "--port-offset", str(offset)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
        try:
            deadline = time.monotonic() + 300
            while not http_ok(f"{m.http}/health"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"infermesh up did not become ready:\n{log.read_text()[-4000:]}")
                time.sleep(0.5)
            yield m
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = -9
    text = log.read_text()
    assert code == 0, f"infermesh up exited with {code}:\n{text[-4000:]}"
    assert "infermesh stopped" in text


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    # float32 is the parity dtype: greedy output must equal transformers' bit for bit.
    log = tmp_path_factory.mktemp("mesh") / "infermesh-up.log"
    with running_mesh(["--engines", "2", "--dtype", "float32"], OFFSET, log) as m:
        yield m


@pytest.fixture(scope="session")
def reference(hf):  # type: ignore[no-untyped-def]
    """Hugging Face transformers' own greedy generation (the session's `hf` model), the independent reference."""
    import torch

    model, tokenizer = hf

    def generate(max_new_tokens: int, messages: list[dict[str, str]] | None = None, prompt: str | None = None
                 ) -> str:
        if messages is not None:
            prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer.encode(prompt_text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(prompt, add_special_tokens=True)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        return str(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))

    return generate
