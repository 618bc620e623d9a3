"""Session store: many sessions keyed by id, bounded by a time-to-live and a memory budget.

Pure bookkeeping (no sockets, no asyncio, no threads of its own): the store maps
keys to values (a server keeps a :class:`toktier.Session` plus its shared-memory
arena in each), remembers each entry's size in bytes and last use, and ends
entries on explicit close, on TTL expiry and, least-recently-used first, when
the bytes held exceed the budget.  Every ended entry is handed to ``on_end`` with
its :class:`EndCause` (that is where a server unlinks shared memory) and counted;
nothing is dropped silently.  A lookup of an ended or unknown key raises
:class:`SessionMiss`, which says why, so the caller can re-send the full text.

An optional ``max_entries`` bounds the count the same way (cause ``capacity``).
Entries that are *pinned* (an op is running on them) are never ended by TTL or
memory pressure; they are reconsidered after they are unpinned.

>>> ended = []
>>> st = SessionStore(memory_budget=100, ttl=60, clock=lambda: 0.0,
...                   on_end=lambda k, v, cause: ended.append((k, cause.value)))
>>> st.add("a", "A", nbytes=60); st.add("b", "B", nbytes=60)   # over budget: LRU "a" ends
>>> ended, st.stats().live, st.stats().bytes_held
([('a', 'memory')], 1, 60)
>>> st.get("a")
Traceback (most recent call last):
...
toktier.store.SessionMiss: session 'a' is not open (ended: memory)
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, TypeVar

from .errors import TokTierError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Default memory budget: 512 MiB, about a thousand 100K-token sessions (each holds
#: ~4-6 bytes/token of arrays with growth room plus its text, ~0.9 MB for 100K tokens
#: of English).
DEFAULT_MEMORY_BUDGET = 512 * 1024 * 1024
#: Default time-to-live since last use, seconds.
DEFAULT_TTL = 3600.0
#: How many ended keys are remembered to explain a later miss.  Bounded so the
#: store's own memory stays O(budget); older keys are reported as "unknown".
TOMBSTONES = 4096


class EndCause(str, enum.Enum):
    """Why an entry left the store."""

    CLOSED = "closed"
    TTL = "ttl"
    MEMORY = "memory"
    CAPACITY = "capacity"  # more entries than ``max_entries``
    SHUTDOWN = "shutdown"


class SessionMiss(TokTierError, KeyError):
    """A session that is not open: never opened, closed, expired, evicted, or lost in a restart.

    ``reason`` is an :class:`EndCause` value or ``"unknown"``.  Answer it by
    re-opening the session with its full text."""

    def __init__(self, key: object, reason: str = "unknown") -> None:
        super().__init__(key, reason)
        self.key = key
        self.reason = reason

    def __str__(self) -> str:
        sid = self.key[-1] if isinstance(self.key, tuple) and self.key else self.key
        if self.reason == "unknown":
            return f"session {sid!r} is not open"
        return f"session {sid!r} is not open (ended: {self.reason})"


@dataclass
class _Entry(Generic[V]):
    value: V
    nbytes: int
    last_used: float
    pins: int = 0


@dataclass(frozen=True)
class StoreStats:
    live: int
    bytes_held: int
    opened: int
    misses: int
    ended: dict[str, int] = field(default_factory=dict)

    @property
    def evictions(self) -> dict[str, int]:
        """Entries ended by the store itself (TTL, memory), by cause."""
        evicting = (EndCause.TTL.value, EndCause.MEMORY.value, EndCause.CAPACITY.value)
        return {c: n for c, n in self.ended.items() if c in evicting}


class SessionStore(Generic[K, V]):
    """LRU + TTL store of sessions with a byte budget.  Not thread-safe: call from one thread."""

    def __init__(
        self,
        *,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        ttl: float = DEFAULT_TTL,
        max_entries: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_end: Callable[[K, V, EndCause], None] | None = None,
    ) -> None:
        if memory_budget <= 0 or ttl <= 0 or (max_entries is not None and max_entries <= 0):
            raise ValueError("memory_budget, ttl and max_entries must be positive")
        self.memory_budget = memory_budget
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._on_end = on_end
        self._entries: OrderedDict[K, _Entry[V]] = OrderedDict()  # least recently used first
        self._tombstones: OrderedDict[K, EndCause] = OrderedDict()
        self._bytes = 0
        self._opened = 0
        self._misses = 0
        self._ended = {c.value: 0 for c in EndCause}

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[K]:
        return list(self._entries)

    def stats(self) -> StoreStats:
        return StoreStats(len(self._entries), self._bytes, self._opened, self._misses, dict(self._ended))

    def peek(self, key: K) -> V | None:
        """The value for ``key`` without touching its recency, or None."""
        e = self._entries.get(key)
        return None if e is None else e.value

    # --------------------------------------------------------------- mutations
    def add(self, key: K, value: V, nbytes: int) -> None:
        """Insert a new entry (most recently used), then enforce the budget on the others."""
        if key in self._entries:
            raise ValueError(f"session {key!r} is already open")
        self._entries[key] = _Entry(value, nbytes, self._clock())
        self._tombstones.pop(key, None)
        self._bytes += nbytes
        self._opened += 1
        self._enforce_budget(protect=key)

    def get(self, key: K) -> V:
        """The value for ``key``, marking it most recently used.  Raises :class:`SessionMiss`."""
        e = self._entries.get(key)
        now = self._clock()
        if e is not None and e.pins == 0 and now - e.last_used > self.ttl:
            self._end(key, EndCause.TTL)
            e = None
        if e is None:
            self._misses += 1
            cause = self._tombstones.get(key)
            raise SessionMiss(key, cause.value if cause is not None else "unknown")
        e.last_used = now
        self._entries.move_to_end(key)
        return e.value

    def resize(self, key: K, nbytes: int) -> None:
        """Record ``key``'s new size, then end least-recently-used others while over budget."""
        e = self._entries[key]
        self._bytes += nbytes - e.nbytes
        e.nbytes = nbytes
        self._enforce_budget(protect=key)

    def pin(self, key: K) -> None:
        """Protect ``key`` from TTL and memory eviction until :meth:`unpin` (pins nest)."""
        self._entries[key].pins += 1

    def unpin(self, key: K) -> None:
        e = self._entries.get(key)
        if e is not None and e.pins > 0:
            e.pins -= 1

    def close(self, key: K) -> bool:
        """End ``key`` explicitly; True if it was open."""
        if key not in self._entries:
            return False
        self._end(key, EndCause.CLOSED)
        return True

    def expire(self) -> int:
        """End every unpinned entry unused for longer than the TTL; returns how many."""
        now = self._clock()
        stale = []
        for key, e in self._entries.items():  # least recently used first
            if now - e.last_used <= self.ttl:
                break
            if e.pins == 0:
                stale.append(key)
        for key in stale:
            self._end(key, EndCause.TTL)
        return len(stale)

    def clear(self, cause: EndCause = EndCause.SHUTDOWN) -> int:
        """End every entry (pinned ones too) with ``cause``; returns how many."""
        keys = list(self._entries)
        for key in keys:
            self._end(key, cause)
        return len(keys)

    # ---------------------------------------------------------------- internal
    def _enforce_budget(self, protect: K) -> None:
        over_count = 0 if self.max_entries is None else len(self._entries) - self.max_entries
        excess = self._bytes - self.memory_budget
        if excess <= 0 and over_count <= 0:
            return
        victims = []
        for key, e in self._entries.items():  # least recently used first
            if excess <= 0 and over_count <= 0:
                break
            if key == protect or e.pins:
                continue
            victims.append((key, EndCause.CAPACITY if excess <= 0 else EndCause.MEMORY))
            excess -= e.nbytes
            over_count -= 1
        for key, cause in victims:
            self._end(key, cause)

    def _end(self, key: K, cause: EndCause) -> None:
        e = self._entries.pop(key)
        self._bytes -= e.nbytes
        self._ended[cause.value] += 1
        self._tombstones[key] = cause
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)
        if self._on_end is not None:
            self._on_end(key, e.value, cause)
