"""SessionStore: TTL, LRU memory budget, pins, explicit close, counters, typed misses."""

from __future__ import annotations

import pytest

from toktier.store import EndCause, SessionMiss, SessionStore, TOMBSTONES


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock, **kw):
    ended: list[tuple[str, str, str]] = []
    st = SessionStore(clock=clock, on_end=lambda k, v, c: ended.append((k, v, c.value)), **kw)
    return st, ended


def test_get_touches_and_miss_is_typed(clock):
    st, _ = make(clock)
    st.add("a", "A", 10)
    assert st.get("a") == "A"
    with pytest.raises(SessionMiss) as ei:
        st.get("zz")
    assert isinstance(ei.value, KeyError) and ei.value.reason == "unknown"
    assert st.stats().misses == 1


def test_ttl_since_last_use(clock):
    st, ended = make(clock, ttl=10)
    st.add("a", "A", 1)
    st.add("b", "B", 1)
    clock.t = 8
    st.get("a")  # refreshes a
    clock.t = 15
    assert st.expire() == 1
    assert ended == [("b", "B", "ttl")]
    assert "a" in st and "b" not in st
    with pytest.raises(SessionMiss) as ei:
        st.get("b")
    assert ei.value.reason == "ttl"
    clock.t = 30  # a expires lazily on lookup even without a sweep
    with pytest.raises(SessionMiss):
        st.get("a")
    assert st.stats().evictions == {"ttl": 2, "memory": 0, "capacity": 0}


def test_lru_memory_eviction_spares_recent_and_pinned(clock):
    st, ended = make(clock, memory_budget=100)
    for k in "abc":
        st.add(k, k.upper(), 30)
    st.get("a")  # order now b, c, a
    st.pin("b")
    st.add("d", "D", 30)  # 120 > 100: b is pinned, so c goes
    assert [e[0] for e in ended] == ["c"]
    assert st.stats().bytes_held == 90
    st.resize("d", 60)  # 150: evict LRU unpinned others (a), never d itself
    assert [e[0] for e in ended] == ["c", "a"]
    assert st.stats().bytes_held == 90 and st.stats().live == 2
    st.unpin("b")
    st.resize("d", 80)
    assert [e[0] for e in ended] == ["c", "a", "b"]
    assert st.stats().evictions["memory"] == 3


def test_single_oversized_entry_is_kept(clock):
    st, ended = make(clock, memory_budget=10)
    st.add("big", "X", 50)
    assert ended == [] and "big" in st


def test_close_and_clear(clock):
    st, ended = make(clock)
    st.add("a", "A", 5)
    st.add("b", "B", 5)
    assert st.close("a") is True and st.close("a") is False
    with pytest.raises(SessionMiss) as ei:
        st.get("a")
    assert ei.value.reason == "closed"
    st.pin("b")
    assert st.clear() == 1  # shutdown ends pinned entries too
    assert ended == [("a", "A", "closed"), ("b", "B", "shutdown")]
    s = st.stats()
    assert (s.live, s.bytes_held, s.opened, s.ended["closed"], s.ended["shutdown"]) == (0, 0, 2, 1, 1)


def test_pinned_entries_survive_ttl(clock):
    st, ended = make(clock, ttl=1)
    st.add("a", "A", 1)
    st.pin("a")
    clock.t = 100
    assert st.expire() == 0 and st.get("a") == "A"


def test_duplicate_add_refused_and_reopen_clears_tombstone(clock):
    st, _ = make(clock)
    st.add("a", "A", 1)
    with pytest.raises(ValueError):
        st.add("a", "A2", 1)
    st.close("a")
    st.add("a", "A3", 1)
    assert st.get("a") == "A3"


def test_tombstones_are_bounded(clock):
    st, _ = make(clock)
    for i in range(TOMBSTONES + 10):
        st.add(i, i, 1)
        st.close(i)
    with pytest.raises(SessionMiss) as ei:
        st.get(0)
    assert ei.value.reason == "unknown"
    with pytest.raises(SessionMiss) as ei:
        st.get(TOMBSTONES + 9)
    assert ei.value.reason == EndCause.CLOSED.value


def test_invalid_limits():
    with pytest.raises(ValueError):
        SessionStore(memory_budget=0)


def test_entry_count_bound(clock):
    st, ended = make(clock, max_entries=2)
    st.add("a", "A", 1)
    st.add("b", "B", 1)
    st.get("a")
    st.add("c", "C", 1)
    assert ended == [("b", "B", "capacity")] and len(st) == 2
    assert st.stats().evictions["capacity"] == 1
