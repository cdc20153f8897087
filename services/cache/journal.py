"""Sessions kept across restarts of the cache service: a journal of changes under `--sessions-dir`.

Every change (a turn appended, a session deleted) is one JSON line appended to `sessions.jsonl`
and handed to the operating system before the RPC answers, so a process that is killed outright
loses nothing (a machine that loses power may lose the last lines: the file is not fsynced per
line).  At start the journal is replayed into the store and rewritten with only the live sessions
(atomically: mesh.files.write_atomic); while serving it is rewritten the same way once it holds
more than twice the lines it needs.  A session's time to live runs on the wall clock across a
restart: one whose last write is older than the TTL is not brought back.

Lines: {"s": id, "t": unix seconds, "m": [[role, content, name, tool_calls, tool_call_id], ...]}
(an append), {"s": id, "t": ..., "d": 1} (a delete).  A line that does not parse (a torn last
line) is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from mesh.chat import Message
from mesh.files import write_atomic
from services.cache.sessions import SessionStore

log = logging.getLogger(__name__)

FILE = "sessions.jsonl"
_SLACK_LINES = 1000                   # rewrite only past 2 x live + this, so small stores never churn


def _line(session_id: str, wall: float, messages: list[Message] | None) -> str:
    record: dict[str, Any] = {"s": session_id, "t": round(wall, 3)}
    if messages is None:
        record["d"] = 1
    else:
        record["m"] = [[m.role, m.content, m.name, m.tool_calls, m.tool_call_id] for m in messages]
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"


class SessionJournal:
    def __init__(self, folder: str | Path, clock: Callable[[], float] = time.time):
        self.clock = clock                   # the wall clock (tests pass their own)
        self.path = Path(folder) / FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = None
        self._lines = 0

    def load(self, store: SessionStore, now: float) -> int:
        """Replay the journal into `store` (monotonic `now`), then rewrite it compacted and open it
        for appending.  Returns how many sessions came back."""
        wall = self.clock()
        kept: dict[str, tuple[list[Message], float]] = {}
        for record in self._records():
            sid = record["s"]
            if record.get("d"):
                kept.pop(sid, None)
                continue
            messages, _ = kept.pop(sid, ([], 0.0))       # re-inserted: the most recently written last
            messages.extend(Message(*fields) for fields in record["m"])
            kept[sid] = (messages, float(record["t"]))
        for sid, (messages, written) in kept.items():
            left = store.ttl_s - (wall - written)
            if left > 0:
                store.restore(sid, messages[-store.max_messages:], now + left)
        self._rewrite(store, now, wall)
        return len(store)

    def _records(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8") as f:
            for number, raw in enumerate(f, 1):
                try:
                    record = json.loads(raw)
                    if not isinstance(record, dict) or not isinstance(record.get("s"), str):
                        raise ValueError("not a session record")
                    yield record
                except (ValueError, TypeError) as exc:
                    log.warning("%s line %d skipped (%s)", self.path, number, exc)

    def _rewrite(self, store: SessionStore, now: float, wall: float) -> None:
        """The journal as the live sessions alone (each written as of its remaining lifetime)."""
        if self._file is not None:
            self._file.close()
        lines = [_line(sid, wall - (store.ttl_s - (session.expires_at - now)), session.messages)
                 for sid, session in store.items(now)]
        write_atomic(self.path, "".join(lines), mode=0o600)
        self._file = self.path.open("a", encoding="utf-8")
        self._lines = len(lines)

    def appended(self, store: SessionStore, session_id: str, messages: list[Message], now: float) -> None:
        self._write(store, _line(session_id, self.clock(), messages), now)

    def deleted(self, store: SessionStore, session_id: str, now: float) -> None:
        self._write(store, _line(session_id, self.clock(), None), now)

    def _write(self, store: SessionStore, line: str, now: float) -> None:
        assert self._file is not None, "load() first"
        self._file.write(line)
        self._file.flush()
        self._lines += 1
        if self._lines > 2 * len(store) + _SLACK_LINES:
            self._rewrite(store, now, self.clock())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
