"""Sidecar configuration: one frozen dataclass, filled from CLI flags and an optional TOML file."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from toktier.errors import InvalidCacheConfig
from toktier.store import DEFAULT_MEMORY_BUDGET, DEFAULT_TTL
from toktier_client.paths import default_socket_path as _client_default_socket_path
from toktier_client.protocol import DEFAULT_MAX_FRAME, DEFAULT_MAX_SESSION_CHARS

DEFAULT_TOKENIZER = "llama3"


def default_socket_path() -> str:
    """The one default socket path (``toktier_client.paths``: ``$TOKTIER_SOCKET``, else
    ``$XDG_RUNTIME_DIR/toktier/toktier.sock``, ``/run/toktier/toktier.sock`` for root,
    ``/tmp/toktier-<uid>/toktier.sock``).  Computed only: the server creates and verifies
    the directory when it binds."""
    return _client_default_socket_path(ensure_dir=False)


@dataclass(frozen=True)
class ServerConfig:
    """Everything the sidecar can be told.  Limits are per server unless named otherwise."""

    socket_path: str = field(default_factory=default_socket_path)
    #: Tokenizers loaded at start (names or tokenizer file paths); the first is the default.
    tokenizers: tuple[str, ...] = (DEFAULT_TOKENIZER,)
    #: Bundled tokenizers not preloaded may be loaded on a client's first request.  Off by
    #: default: a load costs seconds of CPU and up to a GB of memory, which any admitted
    #: client could otherwise trigger (the loads run on their own worker thread either way).
    lazy_load: bool = False
    max_connections: int = 256
    #: Unanswered requests per connection (pipelining depth) before ``overloaded``.
    max_inflight: int = 64
    max_frame: int = DEFAULT_MAX_FRAME
    #: Bytes that incomplete frames of all connections may hold together (each connection
    #: is capped by ``max_frame``); at least ``max_frame`` is always allowed.
    max_buffered_bytes: int = 256 * 1024 * 1024
    #: Seconds a new connection has to send Hello before it is closed (frees its slot).
    handshake_timeout: float = 10.0
    #: Seconds without a request or reply after which a connection is closed (0: never).
    #: A connection holding sessions bound to it is never idle (they would end with it).
    idle_timeout: float = 600.0
    max_session_chars: int = DEFAULT_MAX_SESSION_CHARS
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    #: Most open sessions (LRU beyond it).  Each session keeps one mmap of its segment and
    #: Linux allows 65530 mappings per process by default (vm.max_map_count), shared with
    #: everything else the process maps: a quarter of it leaves ample headroom.
    max_sessions: int = 16384
    session_ttl: float = DEFAULT_TTL
    #: Seconds between TTL sweeps (lookups also check the TTL).
    sweep_interval: float = 30.0
    #: Repair window in bytes; 0 = the session default (twice the longest token).
    window: int = 0
    #: Ops whose text is at most this many code points run on the event loop (a
    #: repair window costs well under a millisecond); larger ones go to a worker.
    inline_chars: int = 16 * 1024
    #: Threads in each of the two pools (bulk: opens/encodes; repair: big changes).
    workers: int = field(default_factory=lambda: max(2, os.cpu_count() or 2))
    #: Peer uids/gids admitted (SO_PEERCRED).  Empty uids means "the server's own uid".
    allowed_uids: frozenset[int] = frozenset()
    allowed_gids: frozenset[int] = frozenset()
    #: Group owning the socket and segments (mode 0660 / 0640 instead of 0600).
    group: int | None = None
    #: Sessions visible to every admitted peer instead of namespaced by peer uid.
    shared_namespace: bool = False
    #: Stateless encode results a connection may hold without Release.
    max_handoffs: int = 64
    shm_prefix: str = "toktier"
    #: Where the instance lock file lives (see ``toktier_sidecar.shm``: the startup sweep);
    #: empty: the socket's directory.
    runtime_dir: str = ""
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    #: Fraction of served results re-encoded by the shadow verifier (0 = off).  Sampling a
    #: session result materializes its text and copies its IDs (O(N), on the loop thread),
    #: so keep it small for long sessions.
    verify_rate: float = 0.01
    #: The verifier's budget, so it cannot slow other clients down: sampled results longer
    #: than ``verify_max_chars`` code points are skipped (never materialized), and
    #: ``verify_chars_per_second`` code points are re-encoded per second on average (bursts up
    #: to one ``verify_max_chars`` sample); the rest are dropped and counted by reason.  256K/s
    #: kept another client's P99 within 1.05x (1M/s: 4.8x; `bench/exact_load.py --part shadow`).
    verify_max_chars: int = 256 * 1024
    verify_chars_per_second: int = 256 * 1024
    #: On a confirmed mismatch, send every session of that tokenizer down the full path
    #: until an operator re-enables it (SIGHUP re-enables all tokenizers).
    verify_disable_on_mismatch: bool = False
    #: Try the GPU full path for large whole-text encodes when a driver (pycuda/CuPy + GPU) is
    #: present; without one every encode stays on the CPU either way.
    gpu: bool = True
    #: Seconds to let in-flight requests finish on SIGTERM.
    shutdown_grace: float = 10.0
    #: Cached stateless encodes (``Encode(cache=True)``: :class:`toktier.PrefixCache`, one per
    #: tokenizer and namespace, created on first use).  Both layers on by default: their
    #: answers are the reference's by construction (every match is verified byte for byte, a
    #: hash collision is a miss), so caching costs memory, never correctness.  Both off: cached
    #: encodes are answered as plain ones (``layer="off"``).
    tokenizer_cache_enable_l0: bool = True
    #: Whole-text keys each cache indexes (LRU; ~160 bytes each, its data is the L1 store's).
    tokenizer_cache_l0_max_entries: int = 4096
    tokenizer_cache_enable_l1: bool = True
    #: Bytes each cache's entry store may hold (text, IDs, index; LRU), the store both layers
    #: answer from.  Held alongside ``memory_budget`` (sessions), not inside it: the sidecar's
    #: token state is bounded by ``memory_budget`` + this per cache.
    tokenizer_cache_l1_max_memory: int = 256 * 1024 * 1024
    #: Directory where sessions outlive the process (``toktier_sidecar.statedir``); None: off.
    #: Each session's record (text, IDs, checksummed) is written behind its ops and restored
    #: after a restart (see ``state_preload``); created 0700, refused unless private.
    state_dir: str | None = None
    #: Restore ``state_dir``'s records at start, in the background, most recently written first
    #: and within ``memory_budget``, so that the first op on a restored session is a warm
    #: repair.  Serving (and systemd readiness) does not wait for it: a session it has not
    #: reached yet is restored by its first op, as with this off (restore on demand only).
    state_preload: bool = True
    #: Seconds a changed session waits before its record is written: a burst of ops writes
    #: once (each write is O(session): text + 4 bytes/token); what a SIGKILL can lose, which
    #: the next op then answers as a miss (never with older IDs).
    state_flush_delay: float = 0.25
    #: Seconds between writes of the tokenizer caches' L1 entries to ``state_dir`` (each cache
    #: is one file, rewritten whole while it changes, within its L1 byte bound; read at start).
    state_cache_flush_interval: float = 5.0
    #: Shared tier for fleets (``toktier_sidecar.statestore``): a Valkey/Redis URL
    #: (``redis://HOST:PORT/DB``, ``rediss://``, ``valkey://``, ``valkeys://``,
    #: ``unix:///PATH?db=N``); None: off.  Session records are written behind to it on the
    #: same schedule as ``state_dir`` (both when both are set), and a session this server does
    #: not hold is looked up there (after ``state_dir``) and resumed by repair.
    state_store: str | None = None
    #: Prefix of every key this server writes (keys are ``<prefix>s:<hash of the session key>``).
    state_store_prefix: str = "toktier:"
    #: Largest record written to or read from the store, in bytes (64 MiB: a 16M-character session).
    state_store_max_value: int = 64 << 20
    #: Seconds one store call may take before it counts as a failure (then a backoff).
    state_store_timeout: float = 2.0
    #: Freed bytes the process heap may keep instead of returning them to the kernel, with
    #: allocations under 32 MiB served from the heap (``toktier_sidecar.heap``: renders of
    #: megabyte messages page-faulted every temporary in again); 0: glibc's defaults.
    malloc_retain: int = 256 << 20

    def __post_init__(self) -> None:
        for name in ("tokenizer_cache_enable_l0", "tokenizer_cache_enable_l1"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidCacheConfig(f"{name} must be true or false, not {getattr(self, name)!r}")
        if not (self.tokenizer_cache_enable_l0 or self.tokenizer_cache_enable_l1):
            return  # no cache is ever built: its sizes do not matter
        for name, minimum in (("tokenizer_cache_l0_max_entries", 1 if self.tokenizer_cache_enable_l0 else 0),
                              ("tokenizer_cache_l1_max_memory", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidCacheConfig(
                    f"{name} must be an integer >= {minimum}, not {value!r} (to turn a cache layer off, "
                    "set tokenizer_cache_enable_l0 / tokenizer_cache_enable_l1 to false)")

    @property
    def tokenizer_cache_enabled(self) -> bool:
        """Whether cached encodes use a cache at all (else they are answered as plain encodes)."""
        return self.tokenizer_cache_enable_l0 or self.tokenizer_cache_enable_l1

    def admitted_uids(self) -> frozenset[int]:
        return self.allowed_uids or frozenset({os.getuid()})

    def admits(self, uid: int, gid: int) -> bool:
        return uid in self.admitted_uids() or gid in self.allowed_gids
