"""``--state-dir``: the directory where sessions outlive the process, and when records are written.

Owns the directory (created 0700; refused when group/other-writable, foreign-owned or a
symlink), the file name of each session's record (a blake2b hash of its namespace and id:
never a name a client spells), the index of records found at start and not yet claimed,
and the write-behind schedule.  The record format is :mod:`toktier.persist`'s.

Why one snapshot file per session rather than an append-only log: a snapshot is
self-contained (restore reads one file, checks one checksum and one certificate), a crash
mid-write leaves the previous record (temp file + fsync + rename), and nothing needs
compaction.  It costs O(session) bytes per write, which the schedule bounds:

* after an op changes a session, its record is written ``state_flush_delay`` seconds later
  (a burst of appends writes once: what a SIGKILL can lose), by one writer thread, with at
  most one write per session in flight (a change during a write schedules one more);
* the state is copied on the loop thread only while no op runs on the session (its lane
  is idle), then checksummed and written off the loop;
* a session that ends (close, TTL, eviction) loses its record; shutdown writes every
  pending change and keeps the records;
* a record found at start is restored lazily, by the first op on its session (see
  :class:`toktier_sidecar.server.Sidecar`), and removed unused after the session TTL.

Disk use: about the live sessions' text plus 4 bytes per token (plus ~300 bytes each),
i.e. under the memory budget's worth, plus unclaimed records until their TTL.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Hashable, Literal, NamedTuple, Protocol

import numpy as np

import toktier
from toktier.errors import TokTierError
from toktier.persist import ForeignRecord, RecordError, SessionRecord, read_record, write_record

log = logging.getLogger(__name__)

SUFFIX = ".rec"
BUSY: Literal["busy"] = "busy"


class InsecureStateDir(TokTierError, PermissionError):
    """A ``--state-dir`` that is not private to this user (the message says what is wrong)."""


class StaleRecord(RecordError):
    """A record older than the client's view of its session (it missed ops a crash lost)."""


class SessionKey(Protocol):
    """What the directory needs of a session key (the service's ``SessionKey``)."""

    @property
    def namespace(self) -> Hashable: ...

    @property
    def session(self) -> str: ...


class Snapshot(NamedTuple):
    """A copy of one session's state, taken on the loop thread, written by the writer thread."""

    tok: toktier.FrozenTokenizer
    namespace: Hashable
    session: str
    seq: int
    window: int
    text: str
    ids: np.ndarray
    op_key: str


def ensure_state_dir(path: str) -> str:
    """Create ``path`` (and missing parents) 0700 unless it exists, then check that it is a real
    directory owned by this uid that group and others cannot write; returns its absolute path.
    Raises :class:`InsecureStateDir`."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, 0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise InsecureStateDir(f"state directory {path} is not usable: {exc}") from None
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    elif st.st_uid != uid:
        problem = f"is owned by uid {st.st_uid}, not {uid}"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        return path
    raise InsecureStateDir(
        f"refusing state directory {path}: it {problem}; another user could plant session records "
        f"there. Use a private directory (chmod 700, owned by uid {uid})")


def record_name(namespace: Hashable, session: str) -> str:
    """The file name of a session's record: a hash, so no client id ever becomes a path."""
    key = json.dumps([namespace, session], ensure_ascii=True).encode("ascii")
    return hashlib.blake2b(key, digest_size=20).hexdigest() + SUFFIX


@dataclass
class _Pending:
    """Write-behind state of one session (loop thread only)."""

    dirty: bool = False
    inflight: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class StateDir:
    """The state directory of one server (see the module docstring).  Loop-thread methods
    unless marked otherwise; file work runs on the one writer thread, in submission order."""

    def __init__(self, path: str, *, ttl: float, flush_delay: float) -> None:
        self.path = ensure_state_dir(path)
        self.ttl = ttl
        self.flush_delay = flush_delay
        #: Records found at start and not yet claimed: file name -> mtime (wall clock).
        self.index: dict[str, float] = {}
        #: Set by the server (loop thread): a copy of the session's state; None when it is not
        #: to be written (gone, or bound to its connection); BUSY while an op runs on it.
        self.snapshot: Callable[[SessionKey], Snapshot | Literal["busy"] | None] = lambda key: None
        self._pending: dict[SessionKey, _Pending] = {}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="toktier-state")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.write_errors = 0

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    # ---------------------------------------------------------------- start
    def scan(self) -> None:
        """Index the records left by earlier runs (no reads: restores are lazy), remove temp
        files of interrupted writes and records older than the TTL.  Blocking: at start."""
        self._loop = asyncio.get_running_loop()
        now = time.time()
        expired = 0
        with os.scandir(self.path) as entries:
            for e in entries:
                if e.name.endswith(".tmp") and e.name.startswith("."):
                    _unlink(e.path)
                elif e.name.endswith(SUFFIX) and e.is_file(follow_symlinks=False):
                    mtime = e.stat(follow_symlinks=False).st_mtime
                    if now - mtime > self.ttl:
                        _unlink(e.path)
                        expired += 1
                    else:
                        self.index[e.name] = mtime
        log.info("state dir %s: %d session records to restore on demand (%d expired removed)",
                 self.path, len(self.index), expired)

    def expire(self) -> int:
        """Remove unclaimed records older than the TTL (their sessions would have expired)."""
        cutoff = time.time() - self.ttl
        old = [name for name, mtime in self.index.items() if mtime < cutoff]
        for name in old:
            del self.index[name]
            self._writer.submit(_unlink, self.file(name))
        return len(old)

    # ------------------------------------------------------------- restores
    def indexed(self, key: SessionKey) -> bool:
        return bool(self.index) and record_name(key.namespace, key.session) in self.index

    def claim(self, key: SessionKey) -> str | None:
        """The path of the session's unclaimed record (now claimed), or None."""
        name = record_name(key.namespace, key.session)
        return self.file(name) if self.index.pop(name, None) is not None else None

    @staticmethod
    def load(path: str, key: SessionKey) -> SessionRecord:
        """Any thread: read and check a record (checksum, version, key).  Raises RecordError/OSError."""
        rec = read_record(path)
        if rec.namespace != key.namespace or rec.session != key.session:
            raise ForeignRecord("record belongs to another session (renamed file or hash collision)")
        return rec

    def drop(self, path: str) -> None:
        """Remove a record that failed its checks (in order with the writes)."""
        self._writer.submit(_unlink, path)

    # ------------------------------------------------------------ write-behind
    def changed(self, key: SessionKey) -> None:
        """A session op completed: write its record after the flush delay (coalesced)."""
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = _Pending()
        p.dirty = True
        if p.timer is None and not p.inflight and self._loop is not None:
            p.timer = self._loop.call_later(self.flush_delay, self._fire, key, p)

    def ended(self, key: SessionKey) -> bool:
        """The session ended (not at shutdown): remove its record, after any write in flight
        (one writer thread: FIFO).  True if an unclaimed record of it existed."""
        p = self._pending.pop(key, None)
        if p is not None and p.timer is not None:
            p.timer.cancel()
        name = record_name(key.namespace, key.session)
        was_indexed = self.index.pop(name, None) is not None
        self._writer.submit(_unlink, self.file(name))
        return was_indexed

    def _fire(self, key: SessionKey, p: _Pending) -> None:
        p.timer = None
        if self._pending.get(key) is not p or not p.dirty:
            return
        snap = self.snapshot(key)
        if snap is None:
            del self._pending[key]
            return
        if snap == BUSY:  # try again later (the running op may fail and never reschedule)
            p.timer = self._loop.call_later(self.flush_delay, self._fire, key, p)
            return
        p.dirty, p.inflight = False, True
        fut = self._writer.submit(self._write, snap)
        fut.add_done_callback(lambda _f: self._loop.call_soon_threadsafe(self._written, key, p))

    def _written(self, key: SessionKey, p: _Pending) -> None:
        p.inflight = False
        if self._pending.get(key) is not p:
            return
        if p.dirty:
            p.timer = self._loop.call_later(self.flush_delay, self._fire, key, p)
        else:
            del self._pending[key]

    def _write(self, snap: Snapshot) -> None:
        """Writer thread: checksum and write one snapshot."""
        try:
            rec = SessionRecord.from_parts(snap.tok, namespace=snap.namespace, session=snap.session, seq=snap.seq,
                                           window=snap.window, text=snap.text.encode("utf-8"), ids=snap.ids,
                                           op_key=snap.op_key)
            write_record(self.file(record_name(snap.namespace, snap.session)), rec)
        except Exception:  # a full disk must not take the server down: the session lives on in memory
            self.write_errors += 1
            log.exception("writing the record of session %r failed", snap.session[:64])

    def close(self) -> None:
        """At shutdown (loop thread, no op running): write every pending change, then wait for
        the writer.  Records stay: the next run restores them."""
        for key, p in list(self._pending.items()):
            if p.timer is not None:
                p.timer.cancel()
                p.timer = None
            if p.dirty:
                snap = self.snapshot(key)
                if isinstance(snap, Snapshot):
                    self._writer.submit(self._write, snap)
        self._pending.clear()
        self._writer.shutdown(wait=True)


def restore_result(exc: BaseException) -> str:
    """The ``toktier_state_restore_total`` result label of a failed restore."""
    if isinstance(exc, StaleRecord):
        return "stale"
    if isinstance(exc, (ForeignRecord, toktier.UnknownTokenizer)):
        return "foreign"
    if isinstance(exc, toktier.InvalidState):
        return "invalid"  # intact, but not the reference encoding of its text
    if isinstance(exc, (RecordError, toktier.InvalidText, OSError)):
        return "corrupt"
    return "error"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
