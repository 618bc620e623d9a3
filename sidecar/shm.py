"""Shared-memory arenas: where the sidecar puts token IDs for clients to read in place.

Layout of every segment (defined once, in ``toktier_client.shm``)::

    /dev/shm/<prefix>-<instance>-<22 random url-safe chars>   mode 0600 (0640 with a group)
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

Allocation that cannot SIGBUS
-----------------------------
``ftruncate`` alone only sizes a tmpfs file; its pages are allocated on first
write, and a write into a full ``/dev/shm`` is a SIGBUS that kills the whole
sidecar.  Every segment's pages are therefore allocated when it is created or
grown (``posix_fallocate``), before any ID is written: a full ``/dev/shm``
(ENOSPC, or ENOMEM) is a :class:`~toktier_sidecar.errors.ResourceExhausted`
error for that one request, the new name is unlinked, and every other session
keeps working.

Crash cleanup: the startup sweep
--------------------------------
Names are ``<prefix>-<instance>-<random>``: ``instance`` is 12 hex characters
drawn when the server starts.  While it runs, the server holds an exclusive
``flock`` on ``<runtime dir>/<prefix>-<instance>.lock`` (:class:`InstanceLock`;
the runtime dir is the socket's private directory unless configured).  A crash
(SIGKILL, OOM kill, SIGBUS) releases the lock but leaves the segments.  At start,
:func:`sweep_stale` removes a segment only when all of this proves it is a dead
instance's own:

* its name has this server's prefix followed by a well-formed instance tag;
* it is owned by this server's uid (another uid's segments are never touched);
* the instance's lock file exists in this server's runtime dir, is owned by
  this uid, and its ``flock`` can be taken (a live server holds it).

A segment without a lock file here (another server with the same prefix but
another runtime dir, an older version) is left alone and counted as unproven; a
live server's segments are counted as live.  Lock files of dead instances are
removed with their segments, so ``ExecStartPre`` cleanup is not needed.

Access: names carry 128 random bits (``secrets``) and are created with
``O_CREAT|O_EXCL``, so nobody can predict or pre-create one; but ``/dev/shm`` is
listable, so the *mode* is what keeps other users out (0600: only the sidecar's
uid).  With a configured group (0640), every member of that group can map every
session's IDs: the group is a trust boundary.  Mutually distrusting engines get
one sidecar each.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass

import numpy as np
import posix_ipc

from toktier_client.shm import HEADER_BYTES, HEADER_DTYPE, IDS_DTYPE, LAYOUT_VERSION, MAGIC, segment_bytes

from .errors import ResourceExhausted

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: errnos that mean "no memory for this segment": the request fails, the server does not.
_EXHAUSTED = frozenset({errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG})
_INSTANCE = re.compile(r"[0-9a-f]{12}")

#: Smallest session segment: one page holds the header and 1008 IDs.
MIN_CAPACITY = (mmap.PAGESIZE - HEADER_BYTES) // IDS_DTYPE.itemsize


class Segment:
    """One created-and-mapped POSIX shared-memory segment (the sidecar side)."""

    __slots__ = ("name", "capacity", "nbytes", "header", "ids", "_pool")

    def __init__(self, pool: "ArenaPool", capacity: int) -> None:
        nbytes = segment_bytes(capacity)
        name = f"/{pool.prefix}-{pool.instance}-{secrets.token_urlsafe(16)}"
        shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=pool.mode, size=nbytes)
        try:
            if pool.gid is not None:
                os.fchown(shm.fd, -1, pool.gid)
            _allocate(shm.fd, nbytes, name)
            try:
                mm = mmap.mmap(shm.fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                if exc.errno in _EXHAUSTED:  # no address space / map count left: this request's failure
                    raise ResourceExhausted(f"cannot map a {nbytes}-byte shared-memory segment: {exc.strerror}") \
                        from None
                raise
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


def _allocate(fd: int, nbytes: int, name: str) -> None:
    """Give the segment all its pages now, so no later write can SIGBUS; a full ``/dev/shm``
    becomes :class:`ResourceExhausted` (glibc emulates the call where the filesystem lacks it)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in _EXHAUSTED:
            raise
        raise ResourceExhausted(
            f"shared memory is exhausted: cannot allocate {nbytes} bytes for a segment in {SHM_DIR} "
            f"({errno.errorcode.get(exc.errno, exc.errno)}); free memory or enlarge {SHM_DIR} "
            "(Docker: --shm-size) or lower the memory budget") from None


class ArenaPool:
    """Creates segments with the configured prefix/mode/group and tracks every live name.

    ``instance`` (12 hex characters, drawn here) is part of every name, so the startup
    sweep can tell this server's segments from every other's.  Thread-safe: workers
    allocate while the event loop releases."""

    def __init__(self, prefix: str = "toktier", *, mode: int = 0o600, gid: int | None = None,
                 instance: str | None = None) -> None:
        if "/" in prefix or not prefix:
            raise ValueError(f"invalid shared-memory prefix {prefix!r}")
        self.instance = instance or secrets.token_hex(6)
        if not _INSTANCE.fullmatch(self.instance):
            raise ValueError(f"invalid instance tag {self.instance!r} (12 lowercase hex characters)")
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


# ------------------------------------------------------------------ crash cleanup
class InstanceLock:
    """A running server's claim on its segments: ``<directory>/<prefix>-<instance>.lock``,
    created 0600 and held with an exclusive ``flock`` until :meth:`release` (or the process
    dies, whatever kills it: the kernel drops the lock)."""

    def __init__(self, directory: str, prefix: str, instance: str) -> None:
        self.path = os.path.join(directory, f"{prefix}-{instance}.lock")
        self._fd: int | None = None

    def acquire(self) -> "InstanceLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())  # for operators; the flock is the proof
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file, then drop the lock (the segments are gone by then)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


@dataclass(frozen=True)
class SweepReport:
    """What :func:`sweep_stale` did (counts of segments)."""

    removed: int = 0
    removed_bytes: int = 0
    live: int = 0  # another running instance holds its lock
    unproven: int = 0  # no lock file of ours names their instance: not provably ours
    foreign: int = 0  # our prefix but another owner uid (or not a regular file)
    lock_files: int = 0  # dead instances' lock files removed


def sweep_stale(prefix: str, directory: str, *, own_instance: str = "", shm_dir: str = SHM_DIR) -> SweepReport:
    """Unlink the segments of dead instances of this server (rules in the module docstring).

    ``directory`` is the server's private runtime directory (where the lock files are);
    ``own_instance`` is never swept.  Never raises for one odd entry: it is skipped."""
    uid = os.geteuid()
    lead = prefix + "-"
    segments: dict[str, list[tuple[str, int]]] = {}
    foreign = 0
    for entry in os.scandir(shm_dir):
        if not entry.name.startswith(lead):
            continue
        instance, sep, _rest = entry.name[len(lead):].partition("-")
        if not sep or not _INSTANCE.fullmatch(instance) or instance == own_instance:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
            foreign += 1
            continue
        segments.setdefault(instance, []).append((entry.name, st.st_size))
    lock_suffix = ".lock"
    for entry in os.scandir(directory):  # dead instances whose segments are all gone still have a lock file
        if entry.name.startswith(lead) and entry.name.endswith(lock_suffix):
            instance = entry.name[len(lead): -len(lock_suffix)]
            if _INSTANCE.fullmatch(instance) and instance != own_instance:
                segments.setdefault(instance, [])
    removed = removed_bytes = live = unproven = lock_files = 0
    for instance, segs in segments.items():
        path = os.path.join(directory, f"{lead}{instance}{lock_suffix}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # no lock file (or a symlink): not provably ours
            unproven += len(segs)
            continue
        try:
            if os.fstat(fd).st_uid != uid:
                unproven += len(segs)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live += len(segs)  # its server is running
                continue
            for name, size in segs:
                try:
                    posix_ipc.unlink_shared_memory("/" + name)
                except posix_ipc.ExistentialError:
                    continue
                removed += 1
                removed_bytes += size
            os.unlink(path)  # still holding its lock: no instance can be using it
            lock_files += 1
        finally:
            os.close(fd)
    return SweepReport(removed, removed_bytes, live, unproven, foreign, lock_files)
