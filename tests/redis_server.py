"""A real, throwaway redis-server for the Redis session store's tests: its own free port, its own
folder, no persistence; installed with apt-get (as root) when missing."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

BINARY = "redis-server"


def install() -> tuple[str | None, str]:
    """The redis-server binary, installing Debian's package as root when it is missing; else (None, why)."""
    found = shutil.which(BINARY)
    if found:
        return found, ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, f"{BINARY} is not installed (as root with apt-get: apt-get install -y redis-server)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    why = ""
    for steps in ([["apt-get", "install", "-y", "-qq", "redis-server"]],
                  [["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "redis-server"]]):
        for step in steps:
            try:
                done = subprocess.run(step, capture_output=True, text=True, timeout=300, env=env)
            except (OSError, subprocess.TimeoutExpired) as exc:
                why = str(exc)
                break
            if done.returncode != 0:
                why = (done.stderr or done.stdout).strip()[-300:]
                break
        if shutil.which(BINARY):
            return shutil.which(BINARY), ""
    return None, f"{BINARY} is missing and `apt-get install -y redis-server` failed: {why}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_redis(binary: str, folder: Path, port: int | None = None) -> Iterator[str]:
    """redis-server on 127.0.0.1 (a free port unless given) until the block ends; yields redis://127.0.0.1:PORT."""
    port = port or free_port()
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"redis-{port}.log"
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(folder), "--logfile", str(log)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    text = log.read_text() if log.exists() else ""
                    raise RuntimeError(f"redis-server on port {port} did not start:\n{text[-2000:]}") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
