"""Issue 20: the cache service's sessions survive its restart (services/cache/journal.py)."""

from __future__ import annotations

from pathlib import Path

from mesh.chat import Message
from services.cache.journal import FILE, SessionJournal
from services.cache.sessions import SessionStore

TTL = 1800.0


def serve(folder: Path, now: float, wall: float) -> tuple[SessionStore, SessionJournal]:
    """A fresh process: an empty store, the journal replayed into it; its wall clock stands at `wall`."""
    store = SessionStore(ttl_s=TTL, max_messages=10)
    journal = SessionJournal(folder, clock=lambda: wall)
    journal.load(store, now)
    return store, journal


def append(store: SessionStore, journal: SessionJournal, sid: str, now: float, *messages: Message) -> None:
    store.append(sid, list(messages), now)
    journal.appended(store, sid, list(messages), now)


def test_sessions_come_back_after_a_restart_without_a_clean_stop(tmp_path: Path) -> None:
    store, journal = serve(tmp_path, now=100.0, wall=1_000.0)
    call = Message("assistant", "", tool_calls='[{"id":"c1"}]')
    append(store, journal, "t/a", 100.0, Message("user", "hi ünïcode"), Message("assistant", "hello"))
    append(store, journal, "t/b", 100.0, Message("user", "other"))
    append(store, journal, "t/a", 101.0, Message("user", "again"), call, Message("tool", "42", tool_call_id="c1"))
    store.delete("t/b", 101.0)
    journal.deleted(store, "t/b", 101.0)
    # No close(): the process is killed; every line was already handed to the OS.
    again, _ = serve(tmp_path, now=5.0, wall=1_010.0)
    session = again.get("t/a", 5.0)
    assert session is not None and [m.content for m in session.messages] == ["hi ünïcode", "hello", "again", "", "42"]
    assert session.messages[3] == call and session.messages[4].tool_call_id == "c1"
    assert again.get("t/b", 5.0) is None and len(again) == 1


def test_a_session_past_its_ttl_on_the_wall_clock_is_not_brought_back(tmp_path: Path) -> None:
    store, journal = serve(tmp_path, now=0.0, wall=1_000.0)
    append(store, journal, "old", 0.0, Message("user", "x"))
    append(store, journal, "new", 0.0, Message("user", "y"))
    journal.close()
    # 1,000 s later the journal is rewritten compacted; a further 900 s and "old" (last written at
    # wall 1,000) is past the 1,800 s TTL, while "new", touched again meanwhile, is not.
    store, journal = serve(tmp_path, now=0.0, wall=2_000.0)
    append(store, journal, "new", 0.0, Message("user", "z"))
    journal.close()
    later, _ = serve(tmp_path, now=50.0, wall=2_900.0)
    assert later.get("old", 50.0) is None
    kept = later.get("new", 50.0)
    assert kept is not None and [m.content for m in kept.messages] == ["y", "z"]
    assert kept.expires_at == 50.0 + TTL        # read: a sliding TTL again from here


def test_a_torn_last_line_is_skipped_and_the_journal_compacts(tmp_path: Path) -> None:
    store, journal = serve(tmp_path, now=0.0, wall=0.0)
    for i in range(30):
        append(store, journal, "s", 0.0, Message("user", str(i % 10)))
        if len(store.get("s", 0.0).messages) >= 9:       # type: ignore[union-attr]
            store.delete("s", 0.0)
            journal.deleted(store, "s", 0.0)
    journal.close()
    with (tmp_path / FILE).open("a") as f:
        f.write('{"s": "s", "t": 0, "m": [["user", "tor')
    again, journal = serve(tmp_path, now=0.0, wall=1.0)
    assert [m.content for m in again.get("s", 0.0).messages] == [str(i % 10) for i in range(27, 30)]  # type: ignore[union-attr]
    assert len((tmp_path / FILE).read_text().splitlines()) == 1          # rewritten: one line per live session
