"""`make demo`: start the mesh on loopback, stream one real answer through every service, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from infermesh.launcher import http_ok

QUESTION = "What is the capital of France? Answer in one sentence."


def main() -> int:
    offset = int(os.environ.get("INFERMESH_DEMO_PORT_OFFSET", "0"))
    base = f"http://127.0.0.1:{8000 + offset}"
    if http_ok(f"{base}/health"):
        print(f"demo: something already answers on {base}; stop it or set INFERMESH_DEMO_PORT_OFFSET",
              file=sys.stderr)
        return 1
    infermesh = [sys.executable, "-m", "infermesh.cli"]
    print("demo: starting the mesh (edge, router, tokenizer, cache, 1 engine) ...", flush=True)
    mesh = subprocess.Popen([*infermesh, "up", "--port-offset", str(offset)])
    try:
        deadline = time.monotonic() + 300
        while not http_ok(f"{base}/health"):
            if mesh.poll() is not None:
                print(f"demo: the mesh exited with code {mesh.returncode} before it was ready", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print("demo: the mesh was not ready within 300 s", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(f"\ndemo: > {QUESTION}", flush=True)
        chat = subprocess.run([*infermesh, "chat", QUESTION, "--url", base, "--max-tokens", "64", "-v"])
        return chat.returncode
    finally:
        mesh.send_signal(signal.SIGTERM)
        try:
            mesh.wait(30)
        except subprocess.TimeoutExpired:
            mesh.kill()
        print("demo: mesh stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
