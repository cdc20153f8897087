import pytest

from mesh.chat import Message
from mesh.errors import InvalidArgument, ResourceExhausted
from services.cache.sessions import SessionStore

HI = [Message("user", "hi")]


def test_sliding_ttl_extends_on_every_touch() -> None:
    store = SessionStore(ttl_s=10)
    store.append("s", HI, now=0)
    assert store.get("s", now=9) is not None       # read at 9 extends to 19
    assert store.get("s", now=18) is not None      # extends to 28
    assert store.get("s", now=28.5) is None


def test_history_accumulates_in_order() -> None:
    store = SessionStore()
    store.append("s", HI, now=0)
    store.append("s", [Message("assistant", "hello")], now=1)
    session = store.get("s", now=2)
    assert session is not None
    assert [m.role for m in session.messages] == ["user", "assistant"]


def test_limits() -> None:
    store = SessionStore(max_sessions=2, max_messages=2)
    with pytest.raises(ResourceExhausted):
        store.append("s", HI * 3, now=0)
    store.append("a", HI, now=0)
    store.append("b", HI, now=1)
    store.append("c", HI, now=2)
    assert store.get("a", now=3) is None and len(store) == 2
    with pytest.raises(InvalidArgument):
        store.get("", now=0)


def test_expire_and_delete() -> None:
    store = SessionStore(ttl_s=5)
    store.append("a", HI, now=0)
    store.append("b", HI, now=3)
    assert store.expire(now=6) == 1 and len(store) == 1
    assert store.delete("b", now=6) is True
    assert store.delete("b", now=6) is False
