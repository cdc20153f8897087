"""Grammar compiles in a child process, so a compile past its time limit can be stopped: a Python thread
cannot be killed, and xgrammar's compile has no way to be cancelled, but a process can.

The engine (CompileWorker) starts `python -m services.engine.runtime.grammar_worker`, sends it the tokenizer's
xgrammar TokenizerInfo once, then one constraint per compile; the child answers with the compiled
grammar's `serialize_json()`, which the engine turns back into a CompiledGrammar with
`CompiledGrammar.deserialize_json` against its own TokenizerInfo.  On a timeout the engine kills the
child (its CPU stops at once) and starts a fresh one for the next compile.

The protocol, on the child's stdin and a private copy of its stdout (its fd 1 then points at stderr, so
nothing a library prints can corrupt it): frames of an 8-byte big-endian length and that many bytes.
Engine -> child: the TokenizerInfo JSON, then constraints as JSON.  Child -> engine: b"R" once ready,
then per constraint b"O" + the compiled grammar's JSON, or b"E" + a message for the request's caller.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import asdict
from typing import IO, Any

from mesh.constraints import Constraint
from mesh.errors import InvalidArgument, MeshError
from mesh.heap import trim_heap

_LENGTH = struct.Struct(">Q")
START_TIMEOUT_S = 120.0        # importing xgrammar (torch, transformers) takes ~2 s; much more on a busy box


class CompileTimeout(Exception):
    """The compile ran past its time limit; the child process was killed."""


class WorkerDied(Exception):
    """The child process ended in the middle of a compile (a crash inside xgrammar, or killed)."""


class CompileWorker:
    """One child process that compiles grammars for one tokenizer, one compile at a time."""

    def __init__(self, tokenizer_info_json: str):
        self._proc = subprocess.Popen([sys.executable, "-m", "services.engine.runtime.grammar_worker"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=_ROOT)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin, self._stdout = self._proc.stdin, self._proc.stdout.fileno()
        try:
            _write(self._stdin, tokenizer_info_json.encode())
            if self._read(time.monotonic() + START_TIMEOUT_S) != b"R":
                raise WorkerDied("it answered something else than ready")
        except (CompileTimeout, WorkerDied, OSError) as exc:
            self.kill()
            raise MeshError(f"the grammar compiler process did not start ({exc}); see the engine's log") from None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def compile(self, c: Constraint, timeout_s: float) -> str:
        """The compiled grammar's JSON.  InvalidArgument (it does not compile), CompileTimeout (the process
        is gone), WorkerDied."""
        try:
            _write(self._stdin, json.dumps(asdict(c)).encode())
            reply = self._read(time.monotonic() + timeout_s)
        except CompileTimeout:
            self.kill()
            raise
        except (WorkerDied, OSError) as exc:
            self.kill()
            raise WorkerDied(str(exc)) from None
        if reply[:1] == b"O":
            return reply[1:].decode()
        if reply[:1] == b"E":
            raise InvalidArgument(reply[1:].decode())
        self.kill()
        raise WorkerDied(f"unexpected reply {reply[:20]!r}")

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._stdin.close()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def _read(self, deadline: float) -> bytes:
        header = self._read_exactly(_LENGTH.size, deadline)
        return self._read_exactly(_LENGTH.unpack(header)[0], deadline)

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        data = bytearray()
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._stdout], [], [], left)[0]:
                raise CompileTimeout("no answer in time")
            chunk = os.read(self._stdout, min(n - len(data), 1 << 20))
            if not chunk:
                raise WorkerDied(f"it exited with code {self._proc.wait()}")
            data += chunk
        return bytes(data)


_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))   # `-m` finds services/ there


def _write(out: IO[bytes], payload: bytes) -> None:
    out.write(_LENGTH.pack(len(payload)) + payload)
    out.flush()


def _read_frame(inp: IO[bytes]) -> bytes | None:
    header = inp.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None                     # the engine closed the pipe (it stopped, or dropped this worker)
    return inp.read(_LENGTH.unpack(header)[0])


# -- the child ----------------------------------------------------------------------------------------

def grammar(c: Constraint) -> Any:
    """The constraint as an xgrammar Grammar: its body between its literal prefix and suffix."""
    import xgrammar as xgr

    from mesh import tools
    if c.kind == "json_schema":
        body = xgr.Grammar.from_json_schema(c.text, any_whitespace=False, strict_mode=True)
    elif c.kind == "json_object":
        body = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    elif c.kind == "regex":
        body = xgr.Grammar.from_regex(c.text)
    elif c.kind == "tool_calls":
        tools.check(c.text, [])
        body = xgr.Grammar.from_structural_tag(json.dumps(tools.structural_tag(c.text)))
    else:
        body = xgr.Grammar.from_ebnf(c.text)
    parts = [body]
    if c.prefix:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {_literal(c.prefix)}"))
    if c.suffix:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {_literal(c.suffix)}"))
    return xgr.Grammar.concat(*parts) if len(parts) > 1 else body


def _literal(text: str) -> str:
    """An EBNF string literal for `text` (JSON's escapes are the grammar's)."""
    return json.dumps(text, ensure_ascii=False)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[-1][:300] if text else type(exc).__name__


def compile_one(compiler: Any, c: Constraint) -> bytes:
    try:
        return b"O" + compiler.compile_grammar(grammar(c)).serialize_json().encode()
    except InvalidArgument as exc:
        return b"E" + exc.message.encode()
    except Exception as exc:           # xgrammar reports a bad schema / regex / grammar this way
        return b"E" + f"the {c.kind} constraint cannot be compiled: {_first_line(exc)}".encode()


def _exit_with_engine(engine: int) -> None:
    """Exit once the engine is gone, even in the middle of a compile (stdin's end is seen only between)."""
    while os.getppid() == engine:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    import threading
    threading.Thread(target=_exit_with_engine, args=(os.getppid(),), daemon=True).start()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                      # stray prints go to the engine's log, not into the protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C reaches the whole group: the engine stops us
    inp = sys.stdin.buffer
    info = _read_frame(inp)
    if info is None:
        return
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info.decode()), max_threads=1,
                                   cache_enabled=False)
    _write(out, b"R")
    while (frame := _read_frame(inp)) is not None:
        _write(out, compile_one(compiler, Constraint(**json.loads(frame))))
        # A heavy grammar's compile and JSON peak at ~850 MB (19 MB compiled, 64 MB of JSON); glibc keeps the
        # freed heap, so without this an idle worker would hold its largest compile's peak for good.
        trim_heap()


if __name__ == "__main__":
    main()
