"""Shared-memory arenas: where the sidecar puts token IDs for clients to read in place.

Layout of every segment (defined once, in ``toktier_client.shm``)::

    /dev/shm/<prefix>-<22 random url-safe chars>        mode 0600 (0640 with a group)
    +-----------------------------------------------+-------------------------------+
    | header, 64 bytes                              | ids: uint32[capacity]         |
    | magic "TKTS" | layout 1 | capacity | seq | count | ids[0:count] = session's IDs |
    +-----------------------------------------------+-------------------------------+

Ownership and lifetime
----------------------
* **Session segment** (:class:`SessionArena`): owned by one session.  The core
  :class:`toktier.Session` keeps its ID array *in* the segment (the arena is the
  session's ``allocator``) and repairs it in place, so publishing a result writes
  only the header (``seq``, ``count``): O(1), no copy of the IDs.  When the
  session outgrows the capacity, the arena maps a bigger segment (amortized
  growth, the session copies its IDs over once) and unlinks the old name.  The
  segment is unlinked when the session is closed, expires (TTL), is evicted
  (memory), and at shutdown.  Sessions are *not* tied to connections (an engine
  may reconnect and continue) unless opened with ``bind_to_connection``; a client
  that crashes therefore leaves sessions that the TTL and the memory budget
  reclaim, or that end with its connection when bound.
* **Handoff segment** (:meth:`ArenaPool.handoff`): one stateless ``Encode``
  result, written once.  Owned by the connection that asked for it until the
  client sends ``Release`` (after mapping it) or the connection closes, then
  unlinked.  A client's mapping outlives the name: unlinking never unmaps.
* The :class:`ArenaPool` knows every live name, so shutdown (and a crash-safe
  ``unlink_all``) leaves nothing in ``/dev/shm``.

A view a client holds of a session segment is valid until the next op on that
session: the next op rewrites ``ids[first_changed:]`` in place.

Access: names carry 128 random bits (``secrets``) and are created with
``O_CREAT|O_EXCL``, so nobody can predict or pre-create one; but ``/dev/shm`` is
listable, so the *mode* is what keeps other users out (0600: only the sidecar's
uid).  With a configured group (0640), every member of that group can map every
session's IDs: the group is a trust boundary.  Mutually distrusting engines get
one sidecar each.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading

import numpy as np
import posix_ipc

from toktier_client.shm import HEADER_BYTES, HEADER_DTYPE, IDS_DTYPE, LAYOUT_VERSION, MAGIC, segment_bytes

#: Smallest session segment: one page holds the header and 1008 IDs.
MIN_CAPACITY = (mmap.PAGESIZE - HEADER_BYTES) // IDS_DTYPE.itemsize


class Segment:
    """One created-and-mapped POSIX shared-memory segment (the sidecar side)."""

    __slots__ = ("name", "capacity", "nbytes", "header", "ids", "_pool")

    def __init__(self, pool: "ArenaPool", capacity: int) -> None:
        nbytes = segment_bytes(capacity)
        name = f"/{pool.prefix}-{secrets.token_urlsafe(16)}"
        shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=pool.mode, size=nbytes)
        try:
            if pool.gid is not None:
                os.fchown(shm.fd, -1, pool.gid)
            mm = mmap.mmap(shm.fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        shm.close_fd()
        self.name = name
        self.capacity = capacity
        self.nbytes = nbytes
        self._pool = pool
        # numpy views keep the mmap alive; it is unmapped when the last view is dropped.
        self.header = np.frombuffer(mm, dtype=HEADER_DTYPE, count=1)
        self.ids = np.frombuffer(mm, dtype=IDS_DTYPE, count=capacity, offset=HEADER_BYTES)
        h = self.header[0]
        h["magic"], h["layout"], h["capacity"], h["seq"], h["count"] = MAGIC, LAYOUT_VERSION, capacity, 0, 0
        pool._track(self)

    def publish(self, seq: int, count: int) -> None:
        """Record which state the IDs show (written after the IDs themselves)."""
        h = self.header
        h["count"] = count
        h["seq"] = seq

    def unlink(self) -> None:
        """Remove the name (idempotent).  Existing mappings stay valid."""
        self._pool._untrack(self)


class SessionArena:
    """A session's ID storage in shared memory; pass :meth:`allocate` as the Session's allocator."""

    __slots__ = ("pool", "segment")

    def __init__(self, pool: "ArenaPool") -> None:
        self.pool = pool
        self.segment: Segment | None = None

    def allocate(self, capacity: int) -> np.ndarray:
        """A new uint32 buffer of at least ``capacity`` elements in a fresh segment.

        The previous segment's name is unlinked at once; its mapping stays valid
        while the session copies its IDs over (and while clients still view it)."""
        old = self.segment
        self.segment = Segment(self.pool, max(capacity, MIN_CAPACITY))
        if old is not None:
            old.unlink()
        return self.segment.ids

    def publish(self, seq: int, count: int) -> Segment:
        assert self.segment is not None, "the session never allocated"
        self.segment.publish(seq, count)
        return self.segment

    def release(self) -> None:
        """Unlink the current segment (the session ended)."""
        if self.segment is not None:
            self.segment.unlink()


class ArenaPool:
    """Creates segments with the configured prefix/mode/group and tracks every live name.

    Thread-safe: workers allocate while the event loop releases."""

    def __init__(self, prefix: str = "toktier", *, mode: int = 0o600, gid: int | None = None) -> None:
        if "/" in prefix or not prefix:
            raise ValueError(f"invalid shared-memory prefix {prefix!r}")
        self.prefix = prefix
        self.mode = mode
        self.gid = gid
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}  # name -> bytes
        self._bytes = 0

    @property
    def live_bytes(self) -> int:
        return self._bytes

    @property
    def live_segments(self) -> int:
        return len(self._live)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def session_arena(self) -> SessionArena:
        return SessionArena(self)

    def handoff(self, ids: np.ndarray) -> Segment:
        """A one-shot segment holding a copy of ``ids`` (stateless encode results)."""
        seg = Segment(self, max(len(ids), 1))
        seg.ids[: len(ids)] = ids
        seg.publish(0, len(ids))
        return seg

    def unlink_all(self) -> int:
        """Unlink every live segment (shutdown); returns how many."""
        with self._lock:
            names, self._live, self._bytes = list(self._live), {}, 0
        for name in names:
            _unlink(name)
        return len(names)

    def _track(self, seg: Segment) -> None:
        with self._lock:
            self._live[seg.name] = seg.nbytes
            self._bytes += seg.nbytes

    def _untrack(self, seg: Segment) -> None:
        with self._lock:
            nbytes = self._live.pop(seg.name, None)
            if nbytes is None:
                return
            self._bytes -= nbytes
        _unlink(seg.name)


def _unlink(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass  # already gone (e.g. removed by an operator); nothing to do
