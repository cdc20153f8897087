"""A real mesh: `infermesh up` as a separate process, torn down with SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from infermesh.launcher import http_ok
from mesh.credentials import TLS_CHANNEL_OPTIONS, MeshTLS
from mesh.grpcutil import channel
from mesh.models import home
from tests.conftest import mesh_group

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


# A service that dies while starting because the machine would not give it a thread (gRPC's
# "pthread_create failed", seen on the shared CI machines when several meshes start at once) or its poller a
# wakeup (gRPC's epoll poller aborting on "Check failed: wakeup_fd_->Wakeup().ok()", seen once in an edge
# while five meshes started on two cores; or, before the launcher turned gRPC's fork support off, a child
# aborting between fork and exec on "epoll_wait error: Bad file descriptor", grpc/grpc#43055) says nothing
# about the mesh: `running_mesh` starts it again, at most twice, and says so on stderr.
RESOURCE_FAILURES = ("pthread_create failed", "wakeup_fd_->Wakeup().ok()", "epoll_wait error: Bad file descriptor")
STARTS = 3


def process_pid(pattern: str) -> int:
    """The one process whose command line holds `pattern` (pgrep -f): a mesh's service, to kill or measure."""
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, f"expected one process for {pattern!r}, found {out}"
    return int(out[0])


def engine_pid(index: int, offset: int) -> int:
    """engine-`index` of the mesh `infermesh up --port-offset offset` started."""
    return process_pid(f"services.engine --replica-id engine-{index} --port {50060 + index + offset}")


def json_call(mesh: Mesh, method: str, path: str, body: dict[str, Any] | None = None, key: str = "",
              timeout: float = 120) -> tuple[int, dict[str, Any]]:
    """One JSON request to the mesh's edge (`Authorization: Bearer key` when a key is given): the status and the
    JSON body, an HTTP error's as well."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{mesh.http}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+)", text, re.M).group(1)) / 1024   # type: ignore[union-attr]


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
    command = [sys.executable, "-m", "infermesh.cli", "up", *args, "--port-offset", str(offset)]
    for start in range(1, STARTS + 1):
        with log.open("wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
        if ready(proc, m):
            break
        text = log.read_text()
        if not any(failure in text for failure in RESOURCE_FAILURES) or start == STARTS:
            pytest.fail(f"infermesh up did not become ready:\n{text[-4000:]}")
        print(f"infermesh up (offset {offset}) could not start a thread; starting it again ({start + 1} of {STARTS}):"
              f"\n{text[-1500:]}", file=sys.stderr)
        time.sleep(2)
    try:
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


def ready(proc: subprocess.Popen[bytes], m: Mesh) -> bool:
    """Whether the mesh answers /health within 300 s; False, with `up` stopped, when it exits first or not."""
    deadline = time.monotonic() + 300
    while not http_ok(f"{m.http}/health"):
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return False
        time.sleep(0.5)
    return True


class SessionMesh:
    """The mesh most end-to-end modules share (SESSION_MESH_MODULES in tests/conftest.py): started by the first
    test that takes it, stopped after the last test of that group (the group runs as one block: on one xdist
    worker, or together in a serial run), so it never runs beside the meshes its worker starts later."""

    def __init__(self) -> None:
        self._running: contextlib.ExitStack | None = None
        self._mesh: Mesh | None = None

    def get(self, tmp_path_factory: pytest.TempPathFactory) -> Mesh:
        if self._mesh is None:
            stack = contextlib.ExitStack()
            # float32 is the parity dtype: greedy output must equal transformers' bit for bit.
            log = tmp_path_factory.mktemp("mesh") / "infermesh-up.log"
            self._mesh = stack.enter_context(running_mesh(["--engines", "2", "--dtype", "float32"], OFFSET, log))
            self._running = stack
        return self._mesh

    def stop(self) -> None:
        running, self._running, self._mesh = self._running, None, None
        if running is not None:
            running.close()


SESSION_MESH = SessionMesh()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    return SESSION_MESH.get(tmp_path_factory)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the session mesh's group's last test (and its module's fixtures), stop the mesh."""
    if nextitem is None or mesh_group(nextitem.nodeid) != "session-mesh":
        SESSION_MESH.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    SESSION_MESH.stop()


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
