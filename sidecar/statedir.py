"""State that outlives the process: one write-behind schedule over pluggable backends, and the
``--state-dir`` backend (the local directory, which also keeps the tokenizer caches' L1 entries).

Owns the write-behind schedule (:class:`WriteBehind`), the :class:`Backend` interface a place
where records live implements, the directory backend (:class:`StateDir`: created 0700 and
refused when group/other-writable, foreign-owned or a symlink; one file per session, named by a
blake2b hash of its namespace and id, never by a name a client spells; the index of records
found at start and not yet claimed), the bookkeeping of restore at start (:class:`Preload`:
sessions restored from the index before their first op, held until it comes) and the
tokenizer caches' files (:class:`CacheFiles`).
The record format is :mod:`toktier.persist`'s (a conversation's: :mod:`toktier.conversation_record`,
files ending ``CONV_SUFFIX``, written and ended on the same schedule, restored by a replay); the
shared Valkey/Redis backend is :mod:`toktier_sidecar.statestore`'s.

Why one snapshot per session rather than an append-only log: a snapshot is self-contained
(restore reads one record, checks one checksum and its tiling: :mod:`toktier.persist`), a crash mid-write leaves
the previous record (temp file + fsync + rename; a store's SET is atomic), and nothing needs
compaction.  It costs O(session) bytes per write, which the schedule bounds:

* after an op changes a session, its record is written ``state_flush_delay`` seconds later
  (a burst of appends writes once: what a SIGKILL can lose), by one writer thread, with at
  most one write per session in flight (a change during a write schedules one more);
* the state is copied on the loop thread only while no op runs on the session (its lane
  is idle), then encoded and checksummed once and handed to every backend, off the loop;
* a session that ends loses its record: in the directory on any end (close, TTL, eviction),
  in a shared store only on Close (a TTL or eviction here says nothing of the other nodes,
  and the store's own TTL ends it there); shutdown writes every pending change and keeps them;
* the directory's records are restored at start, in the background (:class:`Preload`, driven by
  :class:`toktier_sidecar.server.Sidecar`): most recently written first, within the session
  memory budget, held apart from the open sessions until their first op claims them (so that
  op is a warm repair).  A record the preload has not reached is restored by its session's
  first op, as without a preload (the directory first, then the store); one restore per
  record either way: the index entry is the token both paths take.

Disk use: about the live sessions' text plus 4 bytes per token (plus ~300 bytes each),
i.e. under the memory budget's worth, plus unclaimed records until their TTL, plus the
tokenizer caches' files (each at most its L1 byte bound of text + IDs).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Literal, NamedTuple, Protocol

import numpy as np

import toktier
from toktier.errors import TokTierError
from toktier.persist import (
    CorruptRecord, ForeignRecord, RecordError, SessionRecord, decode_record, encode_record, split_records, write_bytes,
)

log = logging.getLogger(__name__)

SUFFIX = ".rec"
#: A conversation's record (:mod:`toktier.conversation_record`): replayed, not read back as a state.
CONV_SUFFIX = ".conv"
CACHE_SUFFIX = ".l1"
#: The first part of a conversation key's namespace (``toktier_sidecar.conversations``).
CONVERSATION_KIND = "conversation"
BUSY: Literal["busy"] = "busy"


class InsecureStateDir(TokTierError, PermissionError):
    """A ``--state-dir`` that is not private to this user (the message says what is wrong)."""


class StaleRecord(RecordError):
    """A record older than the client's view of its session (it missed ops a crash lost, or
    another node wrote it before the client's later ops elsewhere)."""


class SessionKey(Protocol):
    """What the backends need of a session key (the service's ``SessionKey``)."""

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

    @property
    def label(self) -> str:
        return f"session {self.session[:64]!r}"

    def encode(self) -> bytes:
        """Writer thread: the record's bytes (encoded and checksummed once for every backend)."""
        rec = SessionRecord.from_parts(self.tok, namespace=self.namespace, session=self.session, seq=self.seq,
                                       window=self.window, text=self.text.encode("utf-8"), ids=self.ids,
                                       op_key=self.op_key, nchars=len(self.text))
        return encode_record(rec)


class Record(Protocol):
    """What the write-behind writes: a session's :class:`Snapshot`, or a conversation's
    (``toktier_sidecar.conversations.ConvSnapshot``)."""

    @property
    def label(self) -> str: ...

    def encode(self) -> bytes: ...


class IndexEntry(NamedTuple):
    """A record found at start and not claimed yet: its file's mtime (wall clock) and size."""

    mtime: float
    size: int


class Backend(Protocol):
    """A place where session records live.  ``save``/``delete`` run on the writer thread, in
    submission order; ``load`` on a worker thread.  A backend reports its own failures (logs,
    metrics) and never raises from ``save``/``delete``: the session lives on in memory."""

    #: ``toktier_state_*`` label and log name.
    name: str
    #: Shared with other nodes: a session ending *here* (TTL, eviction) keeps its record there.
    shared: bool

    def save(self, key: SessionKey, data: bytes) -> None: ...

    def delete(self, key: SessionKey) -> None: ...

    def load(self, key: SessionKey) -> bytes | None: ...

    def close(self) -> None: ...


def record_name(namespace: Hashable, session: str) -> str:
    """The file name of a session's (or conversation's) record: a hash, so no client id ever
    becomes a path; conversations' end in ``CONV_SUFFIX``."""
    return key_digest(namespace, session) + (CONV_SUFFIX if is_conversation(namespace) else SUFFIX)


def is_conversation(namespace: Hashable) -> bool:
    """Whether a key's namespace is a conversation's (``(CONVERSATION_KIND, peer namespace)``)."""
    return isinstance(namespace, tuple) and len(namespace) == 2 and namespace[0] == CONVERSATION_KIND


def key_digest(namespace: Hashable, session: str) -> str:
    """blake2b-160 hex of a session key: file names and store keys alike."""
    key = json.dumps([namespace, session], ensure_ascii=True).encode("ascii")
    return hashlib.blake2b(key, digest_size=20).hexdigest()


def check_record(rec: SessionRecord, key: SessionKey) -> SessionRecord:
    """``rec`` if it claims to be ``key``'s; ForeignRecord otherwise (renamed file, hash collision)."""
    if rec.namespace != key.namespace or rec.session != key.session:
        raise ForeignRecord("record belongs to another session (renamed file, copied key or hash collision)")
    return rec


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


# ------------------------------------------------------------------ the directory
class StateDir:
    """The ``--state-dir`` backend.  ``scan``/``indexed``/``claim``/``expire`` run on the loop
    thread; ``save``/``delete`` on the writer thread; ``load`` on a worker."""

    name = "dir"
    shared = False

    def __init__(self, path: str, *, ttl: float) -> None:
        self.path = ensure_state_dir(path)
        self.ttl = ttl
        #: Session records found at start and not yet claimed: file name -> its mtime and size.
        self.index: dict[str, IndexEntry] = {}
        #: The same for conversation records (preloaded with the sessions', replayed when restored).
        self.conv_index: dict[str, IndexEntry] = {}
        self.write_errors = 0

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def scan(self) -> list[str]:
        """Index the session records left by earlier runs (no reads: the server restores them in
        the background, or on demand), remove temp files of interrupted writes and records older
        than the TTL; returns the tokenizer cache files found.  Blocking: at start."""
        now = time.time()
        expired = 0
        caches = []
        with os.scandir(self.path) as entries:
            for e in entries:
                if e.name.endswith(".tmp") and e.name.startswith("."):
                    _unlink(e.path)
                elif e.name.endswith((SUFFIX, CONV_SUFFIX)) and e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    if now - st.st_mtime > self.ttl:
                        _unlink(e.path)
                        expired += 1
                    else:
                        self.index_of(e.name)[e.name] = IndexEntry(st.st_mtime, st.st_size)
                elif e.name.endswith(CACHE_SUFFIX) and e.is_file(follow_symlinks=False):
                    caches.append(e.path)
        mb = lambda index: sum(e.size for e in index.values()) / 1e6  # noqa: E731
        log.info("state dir %s: %d session records (%.1f MB), %d conversation records (%.1f MB); %d expired "
                 "removed; %d cache files", self.path, len(self.index), mb(self.index), len(self.conv_index),
                 mb(self.conv_index), expired, len(caches))
        return caches

    def index_of(self, name: str) -> dict[str, IndexEntry]:
        return self.conv_index if name.endswith(CONV_SUFFIX) else self.index

    def expired(self) -> list[str]:
        """Unindex unclaimed records older than the TTL (their sessions would have expired);
        the caller removes them in order with the writes."""
        cutoff = time.time() - self.ttl
        old = []
        for index in (self.index, self.conv_index):
            stale = [name for name, e in index.items() if e.mtime < cutoff]
            for name in stale:
                del index[name]
            old += stale
        return old

    def indexed(self, key: SessionKey) -> bool:
        name = record_name(key.namespace, key.session)
        index = self.index_of(name)
        return bool(index) and name in index

    def claim(self, key: SessionKey) -> bool:
        """True if the session (or conversation) had an unclaimed record (now claimed: ``load`` reads it)."""
        return self.unindex(key)

    def unindex(self, key: SessionKey) -> bool:
        name = record_name(key.namespace, key.session)
        return self.index_of(name).pop(name, None) is not None

    def load(self, key: SessionKey) -> bytes | None:
        return self.read(record_name(key.namespace, key.session))

    def read(self, name: str) -> bytes | None:
        """Any thread: the bytes of record file ``name``, None when it is gone."""
        try:
            with open(self.file(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def save(self, key: SessionKey, data: bytes) -> None:
        try:
            write_bytes(self.file(record_name(key.namespace, key.session)), data)
        except Exception:  # a full disk must not take the server down: the session lives on in memory
            self.write_errors += 1
            log.exception("writing the record of session %r failed", key.session[:64])

    def delete(self, key: SessionKey) -> None:
        _unlink(self.file(record_name(key.namespace, key.session)))

    def remove(self, name: str) -> None:
        _unlink(self.file(name))

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ restore at start
class Held(NamedTuple):
    """A session restored at start, not open yet (the service's ``Slot``: session, arena, seq)."""

    slot: Any
    seq: int
    nbytes: int
    mtime: float


class Preload:
    """Bookkeeping of restore at start; loop thread only (the server reads and verifies records
    on a thread of its own and decides when; see :class:`toktier_sidecar.server.Sidecar`).

    * ``inflight``: record name -> a future done once the preload's restore of it finished
      (held or failed).  The first op of that session waits for it rather than read the
      record again: one restore per record.
    * ``held``: record name -> a session restored and verified whose first op has not come.  It
      is not in the session store: no LRU eviction ends it (which would delete its record), no
      write-behind rewrites it, and its TTL is its record's (the sweeper releases it with the
      index entry).  Its record stays in the :class:`StateDir` index until an op claims it, so
      a released one is still restored on demand.
    * Memory: held sessions count against the session memory budget together with the open
      ones.  The preload starts a record only if it fits next to both; ``trim(room, slots)``
      releases held ones, least recently written first, when open sessions need the room.
    """

    def __init__(self, release: Callable[[Any], None], count: Callable[[str, int], None] = lambda r, n: None) -> None:
        self._release = release  # frees a held slot's arena
        self._count = count  # toktier_state_preload_sessions_total{result}
        self.inflight: dict[str, asyncio.Future] = {}
        self.held: dict[str, Held] = {}
        #: Records the preload has not reached yet (an op on one of them "raced" it).
        self.unreached: set[str] = set()
        self.bytes = 0
        self.pending = 0
        self.running = False
        self.done = False
        self._t0 = 0.0
        self._seconds = 0.0

    def begin(self, names: Iterable[str]) -> None:
        self.unreached = set(names)
        self.pending, self.running, self._t0 = len(self.unreached), True, time.monotonic()

    def reached(self, name: str) -> None:
        self.unreached.discard(name)
        self.pending = len(self.unreached)

    def finish(self) -> None:
        self.unreached.clear()
        self.pending, self.running, self.done = 0, False, True
        self._seconds = time.monotonic() - self._t0

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._t0 if self.running else self._seconds

    def count(self, result: str, n: int = 1) -> None:
        self._count(result, n)

    def hold(self, name: str, held: Held) -> None:
        self.held[name] = held
        self.bytes += held.nbytes
        self.count("restored")

    def take(self, name: str) -> Held | None:
        """The held session of record ``name``, for its first op to open (or release), or None."""
        held = self.held.pop(name, None)
        if held is not None:
            self.bytes -= held.nbytes
        return held

    def drop(self, name: str) -> bool:
        """Release the held session of record ``name`` (its record stays); True if there was one."""
        held = self.held.pop(name, None)
        if held is None:
            return False
        self.bytes -= held.nbytes
        self._release(held.slot)
        self.count("released")
        return True

    def trim(self, room: int, slots: int) -> int:
        """Release held sessions, least recently written first, until they take at most ``room``
        bytes and ``slots`` sessions; returns how many were released."""
        if self.bytes <= room and len(self.held) <= slots:
            return 0
        n = 0
        for name, _held in sorted(self.held.items(), key=lambda kv: kv[1].mtime):
            if self.bytes <= room and len(self.held) <= slots:
                break
            self.drop(name)
            n += 1
        return n

    def release_all(self) -> None:
        """At shutdown: free every held session (their records stay for the next run)."""
        for name in list(self.held):
            held = self.held.pop(name)
            self._release(held.slot)
        self.bytes = 0

    def snapshot(self) -> dict:
        """The gauges (:mod:`toktier_sidecar.metrics`); any thread (reads only)."""
        held = dict(self.held)
        return {"pending": self.pending, "held": len(held), "held_bytes": sum(h.nbytes for h in held.values()),
                "seconds": self.seconds}


# ------------------------------------------------------------------ the schedule
@dataclass
class _Pending:
    """Write-behind state of one session (loop thread only)."""

    dirty: bool = False
    inflight: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class WriteBehind:
    """The one write-behind schedule of a server, over its backends (see the module docstring).
    Loop-thread methods unless marked otherwise; backend writes run on the one writer thread,
    in submission order."""

    def __init__(self, backends: Iterable[Backend], *, flush_delay: float) -> None:
        self.backends = list(backends)
        self.flush_delay = flush_delay
        #: Set by the server (loop thread): a copy of the session's state; None when it is not
        #: to be written (gone, or bound to its connection); BUSY while an op runs on it.
        self.snapshot: Callable[[SessionKey], Record | Literal["busy"] | None] = lambda key: None
        self._pending: dict[SessionKey, _Pending] = {}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="toktier-state")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dir = next((b for b in self.backends if isinstance(b, StateDir)), None)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn(*args)`` on the writer thread, after every write submitted before it."""
        return self._writer.submit(fn, *args)

    def changed(self, key: SessionKey) -> None:
        """A session op completed: write its record after the flush delay (coalesced)."""
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = _Pending()
        p.dirty = True
        if p.timer is None and not p.inflight and self._loop is not None:
            p.timer = self._loop.call_later(self.flush_delay, self._fire, key, p)

    def ended(self, key: SessionKey, *, closed: bool) -> None:
        """The session ended (not at shutdown): remove its record after any write in flight (one
        writer thread: FIFO), from every local backend, and from shared ones when ``closed``."""
        p = self._pending.pop(key, None)
        if p is not None and p.timer is not None:
            p.timer.cancel()
        for b in self.backends:
            if closed or not b.shared:
                self._writer.submit(b.delete, key)

    def supersede(self, key: SessionKey) -> None:
        """A new state is created under ``key`` (a fork's target): a record of it from an earlier
        run, not restored, is dropped from the index (the new state's record overwrites its file),
        so the index's TTL sweep never removes the new state's record."""
        if self._dir is not None:
            self._dir.unindex(key)

    def forget(self, key: SessionKey) -> bool:
        """A Close of a session not open here: remove its records everywhere; True if the state
        dir held an unclaimed record of it (the session existed, as far as this server knows)."""
        existed = self._dir is not None and self._dir.unindex(key)
        self.ended(key, closed=True)
        return existed

    def _fire(self, key: SessionKey, p: _Pending) -> None:
        p.timer = None
        if self._pending.get(key) is not p or not p.dirty:
            return
        snap = self.snapshot(key)
        if snap is None:
            del self._pending[key]
            return
        if isinstance(snap, str):  # BUSY: try again later (the running op may fail and never reschedule)
            p.timer = self._loop.call_later(self.flush_delay, self._fire, key, p)
            return
        p.dirty, p.inflight = False, True
        fut = self._writer.submit(self._write, key, snap)
        fut.add_done_callback(lambda _f: self._loop.call_soon_threadsafe(self._written, key, p))

    def _written(self, key: SessionKey, p: _Pending) -> None:
        p.inflight = False
        if self._pending.get(key) is not p:
            return
        if p.dirty:
            p.timer = self._loop.call_later(self.flush_delay, self._fire, key, p)
        else:
            del self._pending[key]

    def _write(self, key: SessionKey, snap: Record) -> None:
        """Writer thread: encode and checksum one snapshot once, then save it everywhere."""
        try:
            data = snap.encode()
        except Exception:
            log.exception("encoding the record of %s failed", snap.label)
            return
        for b in self.backends:
            b.save(key, data)

    def close(self) -> None:
        """At shutdown (loop thread, no op running): write every pending change, then wait for
        the writer and close the backends.  Records stay: the next run restores them."""
        for key, p in list(self._pending.items()):
            if p.timer is not None:
                p.timer.cancel()
                p.timer = None
            if p.dirty:
                snap = self.snapshot(key)
                if snap is not None and not isinstance(snap, str):
                    self._writer.submit(self._write, key, snap)
        self._pending.clear()
        self._writer.shutdown(wait=True)
        for b in self.backends:
            try:
                b.close()
            except Exception:
                log.exception("closing state backend %s failed", b.name)


# ------------------------------------------------------------------ tokenizer caches
class CacheFiles:
    """The tokenizer caches' L1 entries in the state directory: one file per (namespace,
    tokenizer), a concatenation of :mod:`toktier.persist` records (session id ``""``, each with
    its own checksum, and the certificate ``PrefixCache.adopt`` checks), most recently used entry first, at most the cache's L1
    byte bound of text + IDs.  Written whole (temp file + rename) every
    ``state_cache_flush_interval`` seconds while the cache changed, and at shutdown; read at
    start.  Why whole files: a cache's entries change by LRU all the time, and one rename keeps
    the file consistent.  Why at start, before serving, rather than lazily: reading and adopting
    (checksum, certificate, tiling; no encode) ran at ~40M characters/s here (25 ms per 1M
    characters), so even a full default 256 MiB cache (~100M characters) delays readiness by a
    few seconds, and the first cached encode after a restart is then a hit, never a race with
    a background load."""

    def __init__(self, state_dir: StateDir, *, max_bytes: int) -> None:
        self.dir = state_dir
        self.max_bytes = max_bytes
        self._signature: dict[tuple[Hashable, str], tuple] = {}

    @staticmethod
    def name(namespace: Hashable, tok_hash: str) -> str:
        return key_digest(namespace, "l1:" + tok_hash) + CACHE_SUFFIX

    def changed(self, key: tuple[Hashable, str], cache: toktier.PrefixCache) -> bool:
        """Loop thread: whether ``cache`` changed since it was last written (by its counters:
        every stored or evicted entry moves them).  A cache that was never written and holds
        nothing has not changed."""
        st = cache.stats()
        sig = (tuple(sorted(st.lookups.items())), tuple(sorted(st.evictions.items())), st.entries["l1"])
        old = self._signature.get(key)
        self._signature[key] = sig
        if old is None:
            return st.entries["l1"] > 0 or bool(sum(st.lookups.values()))
        return old != sig

    def write(self, key: tuple[Hashable, str], cache: toktier.PrefixCache) -> int:
        """Writer thread: the cache's entries, most recent first, within the byte bound; returns
        the entries written."""
        namespace, tok_hash = key
        tok = cache.tokenizer
        parts: list[bytes] = []
        total = n = 0
        for text, ids in cache.entries():
            size = len(text) + 4 * len(ids)
            if total + size > self.max_bytes:
                continue  # an older, smaller one may still fit
            rec = SessionRecord.from_parts(tok, namespace=namespace, session="", seq=0, window=0, text=text, ids=ids,
                                           certify=True)
            parts.append(encode_record(rec))
            total += size
            n += 1
        path = self.dir.file(self.name(namespace, tok_hash))
        try:
            if parts:
                write_bytes(path, b"".join(parts))
            else:
                _unlink(path)
        except Exception:
            self.dir.write_errors += 1
            log.exception("writing the tokenizer cache file %s failed", path)
        return n

    @staticmethod
    def read(path: str) -> tuple[list[SessionRecord], list[RecordError]]:
        """Any thread: the records of a cache file (oldest first, the order to adopt them in) and
        the errors of those that failed their checksum or layout."""
        good: list[SessionRecord] = []
        bad: list[RecordError] = []
        with open(path, "rb") as f:
            data = f.read()
        try:
            for part in split_records(data):
                try:
                    rec = decode_record(part)
                    if rec.session != "":
                        raise ForeignRecord("a session record in a tokenizer cache file")
                    good.append(rec)
                except RecordError as exc:
                    bad.append(exc)
        except CorruptRecord as exc:  # the rest of the file cannot be split
            bad.append(exc)
        good.reverse()
        return good, bad


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
