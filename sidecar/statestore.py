"""``--state-store``: the shared tier, session records in a Valkey or Redis server, so that a
conversation a router sends to another node resumes there by repair.

Owns the store URL (:func:`parse_store_url`: ``redis://``, ``rediss://``, ``valkey://``,
``valkeys://``, ``unix://``; a bad one is refused at start with what to write instead), the
key of each session (``<prefix>s:<blake2b of namespace and id>``, as the state dir names its
files: no client id is ever part of a key), and talking to the server
(:class:`StateStore`, a :class:`~toktier_sidecar.statedir.Backend` of the write-behind
schedule).  Records are :mod:`toktier.persist`'s, byte for byte what the state dir writes, and
are trusted for nothing: the server verifies each (checksum, tokenizer, key, ID range and tiling,
``seq``: :mod:`toktier.persist` says what each proves) before use, as it does a file.  Records
here are restored on demand only, never at start: the store holds every node's sessions, and
which of them come to this node is the router's choice (the state dir's records are this
node's own, and are restored at start).

Threads, not ``redis.asyncio``: every store call runs on the state writer thread (``SET``,
``DEL``) or on a worker thread (``GET`` during a restore, which then decodes and verifies the
record there: O(N) work that needs a thread anyway), through redis-py's thread-safe
connection pool.  The event loop never waits on the store, and a record of megabytes is
never parsed on it.

Failures never fail an op.  A call that cannot reach the server (refused, timed out, reset)
or that the server refuses is counted (``toktier_state_store_ops_total{op,result="error"}``)
and treated as absent: a lookup misses (``toktier_state_restore_total{result="store_error"}``)
and the op goes on as it would without a store; a write is dropped (the session lives on in
memory; its next change writes again).  After a failure the store is skipped for a backoff
(0.25 s doubling to 30 s; ``result="skipped"``) so that a dead server costs one timeout per
backoff, not one per op, and it is logged once per outage (when it starts and when it ends),
not per op.

Consistency between nodes: last writer wins.  Each record carries its session's ``seq`` (the
op counter the client also holds).  A client's op carries the ``seq`` it last saw
(``expect_seq``); a record older than that is a :class:`~toktier_sidecar.statedir.StaleRecord`
(a counted miss: the client re-sends its text), never older IDs.  Two nodes serving one session
at once (affinity broken mid-burst) each write their own state; the later write stays, and the
next op anywhere that expects another ``seq`` misses and is repaired from the client's text.

Bounds: a key lives ``session_ttl`` seconds after its last write (``PX``), a value is at most
``max_value`` bytes (larger records are not written and the older one is deleted: counted as
``result="too_large"``), and the client waits at most ``timeout`` seconds per call.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable

from toktier.errors import TokTierError

from .statedir import SessionKey, key_digest

log = logging.getLogger(__name__)

SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss", "unix": "unix"}
DEFAULT_PREFIX = "toktier:"
#: Largest value written or read.  Redis and Valkey accept 512 MB, but the server copies a value
#: while it runs no other command: 64 MiB is a 16M-character session (the default session limit).
DEFAULT_MAX_VALUE = 64 << 20
#: Seconds a store call may take (connect, send, read a multi-MB value over a LAN).
DEFAULT_TIMEOUT = 2.0
BACKOFF_MIN, BACKOFF_MAX = 0.25, 30.0


class InvalidStateStore(TokTierError, ValueError):
    """A ``--state-store`` URL or option that cannot work (the message says what to write)."""


class StoreUnavailable(TokTierError, ConnectionError):
    """The store could not answer (unreachable, timed out, refused the command, or in backoff)."""


@dataclass(frozen=True)
class StoreURL:
    """A checked store URL: ``url`` as redis-py reads it, ``display`` without the password."""

    url: str
    display: str


def parse_store_url(text: str) -> StoreURL:
    """Check a ``--state-store`` URL and translate it for redis-py.

    >>> parse_store_url("valkey://:secret@cache.internal:6380/2").display
    'redis://:***@cache.internal:6380/2'
    >>> parse_store_url("unix:///run/valkey/valkey.sock?db=1").url
    'unix:///run/valkey/valkey.sock?db=1'
    >>> parse_store_url("http://cache:6379")
    Traceback (most recent call last):
    ...
    toktier_sidecar.statestore.InvalidStateStore: --state-store 'http://cache:6379': unknown scheme 'http'; use redis://HOST[:PORT][/DB], rediss:// (TLS), valkey://, valkeys:// or unix:///PATH/TO/SOCKET[?db=N]
    """
    usage = ("use redis://HOST[:PORT][/DB], rediss:// (TLS), valkey://, valkeys:// or "
             "unix:///PATH/TO/SOCKET[?db=N]")
    try:
        u = urllib.parse.urlsplit(text.strip())
        port = u.port
    except ValueError as exc:
        raise InvalidStateStore(f"--state-store {_redact(text)!r}: {exc}; {usage}") from None
    scheme = SCHEMES.get(u.scheme.lower())
    if scheme is None:
        raise InvalidStateStore(f"--state-store {_redact(text)!r}: unknown scheme {u.scheme!r}; {usage}")
    query = urllib.parse.parse_qs(u.query)
    db = query.get("db", [""])[-1]
    if scheme == "unix":
        if (u.netloc and not u.netloc.endswith("@")) or not u.path.startswith("/"):
            raise InvalidStateStore(f"--state-store {_redact(text)!r}: a unix socket URL needs an absolute path "
                                    f"(three slashes: unix:///run/valkey/valkey.sock); {usage}")
    else:
        if not u.hostname:
            raise InvalidStateStore(f"--state-store {_redact(text)!r}: no host; {usage}")
        path_db = u.path.strip("/")
        if path_db:
            if db:
                raise InvalidStateStore(f"--state-store {_redact(text)!r}: the database is given twice")
            db = path_db
        if port == 0:
            raise InvalidStateStore(f"--state-store {_redact(text)!r}: port 0; {usage}")
    if db and not (db.isdigit() and int(db) < 1 << 16):
        raise InvalidStateStore(f"--state-store {_redact(text)!r}: database {db!r} is not a number; {usage}")
    # By hand: urlunsplit drops the "//" of a unix URL with no host.
    url = f"{scheme}://{u.netloc}{u.path}" + (f"?{u.query}" if u.query else "")
    return StoreURL(url, _redact(url))


def _redact(text: str) -> str:
    """The URL with its password replaced (URLs are logged and put in error messages)."""
    try:
        u = urllib.parse.urlsplit(text)
        if u.password is None:
            return text
        netloc = u.netloc.replace(":" + u.password + "@", ":***@", 1)
        return urllib.parse.urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))
    except ValueError:
        return "<unparsable URL>"


def check_prefix(prefix: str) -> str:
    """A key prefix: printable ASCII without spaces (it is part of every key; ``KEYS toktier:*``)."""
    if not prefix or not prefix.isascii() or not prefix.isprintable() or " " in prefix or len(prefix) > 256:
        raise InvalidStateStore(f"--state-store-prefix {prefix!r} must be 1-256 printable ASCII characters "
                                "without spaces, e.g. 'toktier:' or 'prod-eu:toktier:'")
    return prefix


class StateStore:
    """The Valkey/Redis backend (see the module docstring).  Thread-safe: ``save``/``delete``
    run on the writer thread, ``load`` on workers; no method runs on the event loop except
    ``healthy`` (no I/O)."""

    name = "store"
    shared = True

    def __init__(self, url: StoreURL, *, prefix: str = DEFAULT_PREFIX, ttl: float, max_value: int = DEFAULT_MAX_VALUE,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ModuleNotFoundError:
            raise InvalidStateStore("--state-store needs the redis client library: pip install 'toktier[redis]'") from None
        if max_value < 1024:
            raise InvalidStateStore(f"state_store_max_value must be at least 1024 bytes, not {max_value}")
        self.url = url
        self.prefix = check_prefix(prefix)
        self.ttl_ms = max(1, int(ttl * 1000))
        self.max_value = max_value
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        # One attempt per call: the backoff below decides when to try again, not redis-py.
        self._redis = redis.Redis.from_url(url.url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                           retry=Retry(NoBackoff(), 0), health_check_interval=30)
        #: Set by the server: count one call, ``(op, result)``.
        self.on_op: Callable[[str, str], None] = lambda op, result: None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = BACKOFF_MIN
        self._failures = 0  # during the current outage
        self.up = True

    def key(self, key: SessionKey) -> str:
        return f"{self.prefix}s:{key_digest(key.namespace, key.session)}"

    # ------------------------------------------------------------------ calls
    def _call(self, op: str, fn: Callable[[], Any]) -> Any:
        if time.monotonic() < self._down_until:
            self.on_op(op, "skipped")
            raise StoreUnavailable(f"state store {self.url.display} is in backoff after a failure")
        try:
            out = fn()
        except self._errors as exc:
            self._failed(op, exc)
            raise StoreUnavailable(f"state store {self.url.display}: {exc}") from None
        if not self.up:
            with self._lock:
                if not self.up:
                    log.warning("state store %s is reachable again (%d calls failed or skipped meanwhile)",
                                self.url.display, self._failures)
                    self.up, self._failures, self._backoff = True, 0, BACKOFF_MIN
        return out

    def _failed(self, op: str, exc: BaseException) -> None:
        self.on_op(op, "error")
        with self._lock:
            self._failures += 1
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(BACKOFF_MAX, self._backoff * 2)
            first = self.up
            self.up = False
        if first:  # once per outage, not once per op
            log.warning("state store %s failed (%s: %s); sessions stay local until it answers again "
                        "(retried after a backoff)", self.url.display, type(exc).__name__, exc)

    def ping(self) -> bool:
        """Any thread, at start: whether the store answers (logged; never fatal)."""
        try:
            self._call("ping", self._redis.ping)
        except StoreUnavailable:
            return False
        log.info("state store %s reachable (prefix %r)", self.url.display, self.prefix)
        return True

    # ------------------------------------------------------------ the backend
    def save(self, key: SessionKey, data: bytes) -> None:
        """Writer thread: ``SET key data PX ttl`` (or delete the older record when ``data`` is over
        the value bound: it would be stale the moment this session moved on)."""
        k = self.key(key)
        try:
            if len(data) > self.max_value:
                self.on_op("set", "too_large")
                self._call("delete", lambda: self._redis.delete(k))
                return
            self._call("set", lambda: self._redis.set(k, data, px=self.ttl_ms))
        except StoreUnavailable:
            return
        self.on_op("set", "ok")

    def delete(self, key: SessionKey) -> None:
        k = self.key(key)
        try:
            self._call("delete", lambda: self._redis.delete(k))
        except StoreUnavailable:
            return
        self.on_op("delete", "ok")

    def load(self, key: SessionKey) -> bytes | None:
        """Worker thread: the record's bytes, None when there is none.  Raises StoreUnavailable;
        a value over the bound is treated as absent (and counted)."""
        data = self._call("get", lambda: self._redis.get(self.key(key)))
        if data is None:
            self.on_op("get", "miss")
            return None
        if len(data) > self.max_value:
            self.on_op("get", "too_large")
            return None
        self.on_op("get", "ok")
        return bytes(data)

    def ttl_of(self, key: SessionKey) -> int:
        """Milliseconds the key has left (-2: none, -1: no TTL); for tests and operators."""
        return int(self._call("pttl", lambda: self._redis.pttl(self.key(key))))

    def close(self) -> None:
        self._redis.close()
