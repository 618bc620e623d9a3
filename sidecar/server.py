"""The asyncio adapter: Unix socket, peer admission, per-session lanes, workers, shutdown.

Thin by design: protocol rules live in :mod:`toktier_sidecar.connection` (sans-IO), how
each request type is served in the handler table of :mod:`toktier_sidecar.service`, shared
memory in :mod:`toktier_sidecar.shm`, ordering in :mod:`toktier_sidecar.lanes`.  This module only
moves bytes and decides where work runs, the same way for every request
(``Sidecar._serve``):

* Ops on one session key run strictly in arrival order (a lane per key);
  different sessions proceed concurrently.
* An op carrying little text (``inline_chars``) runs right on the event loop when
  its lane is idle: a repair costs about a millisecond and a thread hop costs
  more than the rest of the sidecar's overhead (measured: +0.7 ms P50).
* Big ops run in two thread pools: *bulk* (opens with text, stateless encodes,
  tokenizer loads: whole-context work, 0.1-1 s at 1M characters) and *repair*
  (big appends, edits and syncs on an existing session).  An append never waits
  for a thread that a session start holds; the core's encodes release the GIL,
  so the loop keeps serving meanwhile.
* Every admitted request gets exactly one reply frame; limits answer with typed
  errors; a misbehaving peer gets an error frame and a lingering close.  Whatever
  escapes a handler (or the protocol layer) becomes a typed error frame, never a
  dropped connection with a traceback.
* Abuse is bounded: a connection that sends no Hello within ``handshake_timeout``
  or stays idle past ``idle_timeout`` is closed (one reaper task checks every
  peer), incomplete frames of all peers share one buffer budget
  (:class:`~toktier_sidecar.connection.BufferBudget`), tokenizer loads run on a
  thread of their own.
* At start, before serving, the server takes its instance lock and sweeps the
  segments of its own dead instances (:mod:`toktier_sidecar.shm`).
* With ``--state-dir`` (:mod:`toktier_sidecar.statedir`) and/or ``--state-store``
  (:mod:`toktier_sidecar.statestore`) the first op on a session this server does not hold goes
  through its lane and restores the session's record in a bulk worker first (``_restore``: the
  directory's record from an earlier run, else the shared store's); a record that fails a check
  is counted (and removed when it can never serve), and the op misses as without state.  A
  conversation's first op here restores its record the same way (a replay: one render and encode
  of the whole conversation, ``toktier_sidecar.conversations``).  With
  ``--state-dir`` the tokenizer caches' L1 entries are read back at start, before serving
  (``_restore_caches``), and written behind every ``state_cache_flush_interval`` seconds.
* Restore at start (``--state-dir``, ``state_preload``, on by default; ``_preload_records``):
  once serving, a background task restores the directory's records, most recently written
  first, one at a time on a thread of its own (read, checksum, tiling: no encode; a
  conversation's record is replayed, which renders and encodes it), each only if it fits the
  memory budget next to the open sessions, and pausing (up to ``PRELOAD_YIELD_S``)
  while requests are in flight.  A restored session is *held* (:class:`~toktier_sidecar.statedir.Preload`)
  until its first op, which opens it without I/O (a warm repair, answered inline when small) after
  the same checks an on-demand restore makes (stale ``seq``, ``create_only``, Close).  An op that
  comes before the preload reaches its record restores it on demand, and an op whose record the
  preload is reading waits for that read: the record's index entry is the token, taken once.
  Readiness (systemd ``READY=1``) does not wait for the preload: with socket activation clients
  reach the socket before readiness anyway, a session not restored yet is served (restored on
  demand), and a preload of a full budget (seconds) must not run into ``TimeoutStartSec=``; the
  preload reports its progress in ``STATUS=`` and the log instead.  Only the directory is
  preloaded: a shared store holds every node's sessions, and which of them will come here is
  the router's choice (they are restored on demand).

Run it with ``uvloop.run(Sidecar(config).run())`` (see :mod:`toktier_sidecar.cli`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Coroutine, Hashable, cast

import toktier
from toktier.conversation_record import decode_conversation_record
from toktier.persist import ForeignRecord, decode_record
from toktier.session import PRIME_HEADROOM
from toktier_client import protocol as P

from . import conversations  # noqa: F401  (registers the conversation ops' handlers in HANDLERS)
from . import sdnotify
from .config import ServerConfig
from .connection import BufferBudget, ServerConnection, refusal
from .errors import ShuttingDown, code_for, error_frame
from .lanes import Lanes
from .listen import BACKLOG, bind_unix_socket, peer_credentials, runtime_dir_for
from .metrics import Metrics
from .service import HANDLERS, Answer, Call, Handler, Pool, ServerCounts, SessionKey, SessionService, session_overhead
from .shadow import Shadow, ShadowConfig
from .shm import ArenaPool, InstanceLock, Segment, sweep_stale
from .statedir import (
    BUSY, CONV_SUFFIX, CONVERSATION_KIND, Backend, CacheFiles, Held, Preload, Record, StaleRecord, StateDir,
    WriteBehind, check_record, is_conversation, record_name, restore_result,
)
from .statestore import StateStore, StoreUnavailable, parse_store_url

log = logging.getLogger(__name__)

#: How long a refused or misbehaving peer may keep its half-closed connection.
LINGER_S = 2.0
#: Most seconds the restore at start waits, before each record, for requests in flight to
#: finish: it yields to clients, yet still makes progress under a steady load.
PRELOAD_YIELD_S = 0.05
#: What a restored session holds besides its record's bytes (``Session._prime``'s room for the
#: next op: ids and checkpoints for PRIME_HEADROOM tokens, 8x as many text bytes; the slot).
PRELOAD_EXTRA_BYTES = 4 * PRIME_HEADROOM + 8 * PRIME_HEADROOM + 4096
#: A restored conversation's memory (``conversation_nbytes``: two sessions over its text, the
#: text again, its messages, its segment) per byte of its record (~1.0-1.2 bytes per character):
#: ~8-9x for English measured, rounded up.
CONV_MEMORY_PER_RECORD_BYTE = 10
#: ``toktier_state_preload_sessions_total`` results, exported at 0 from the start.
PRELOAD_RESULTS = ("restored", "claimed", "released", "skipped_budget", "raced")


class _Peer(asyncio.Protocol):
    """One client connection: admission, bytes <-> sans-IO connection, owned resources."""

    def __init__(self, sidecar: "Sidecar", cid: int) -> None:
        self.sidecar = sidecar
        self.cid = cid
        self.transport: asyncio.Transport | None = None
        self.conn = ServerConnection(sidecar.welcome, max_frame=sidecar.config.max_frame,
                                     max_inflight=sidecar.config.max_inflight, budget=sidecar.buffer_budget)
        self.namespace: object = None
        self.handoffs: dict[str, Segment] = {}  # stateless results not yet Released
        self.pending_handoffs = 0  # encodes admitted, not answered yet
        self.bound: set[Hashable] = set()  # sessions that end with this connection
        self.alive = False
        self.half_closed = False
        self.last_active = time.monotonic()  # last request or reply: the idle timeout's clock

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sc = self.sidecar
        _pid, uid, gid = peer_credentials(transport.get_extra_info("socket"))
        if not sc.config.admits(uid, gid):
            log.warning("refused connection from uid %d gid %d", uid, gid)
            self._refuse(P.ErrorCode.PERMISSION_DENIED, f"uid {uid} is not admitted by this sidecar")
        elif sc.stopping:
            self._refuse(P.ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        elif len(sc.peers) >= sc.config.max_connections:
            self._refuse(P.ErrorCode.OVERLOADED, f"more than {sc.config.max_connections} connections")
        else:
            self.namespace = "*" if sc.config.shared_namespace else uid
            self.alive = True
            sc.peers[self.cid] = self

    def _refuse(self, code: P.ErrorCode, message: str) -> None:
        self.sidecar.metrics.protocol_errors.labels(code.value).inc()
        self.transport.write(refusal(code, message))
        self._linger_close()

    def _linger_close(self) -> None:
        """Send FIN after the pending error frame but keep reading (and discarding) until the peer
        closes, so a peer still writing its request reads our error instead of EPIPE/ECONNRESET.
        A peer that never closes is cut off after ``LINGER_S``."""
        self.alive = False
        if self.transport.can_write_eof():
            self.transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_S, self.transport.abort)
        else:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self.alive:
            return
        self.last_active = time.monotonic()
        try:
            requests = self.conn.feed(data)
        except Exception:  # a bug in the protocol layer: answer it as one, keep the server
            log.exception("protocol layer failed on connection %d", self.cid)
            self._refuse(P.ErrorCode.INTERNAL, "internal error while decoding a frame")
            return
        pending = self.conn.data_to_send()
        if pending:
            self.transport.write(pending)
        for req in requests:
            self.sidecar.dispatch(self, req)
        if self.conn.closing:
            self.sidecar.metrics.protocol_errors.labels("protocol").inc()
            self._linger_close()

    def expire(self, now: float) -> None:
        """Close the connection if it never said Hello in time, or sat idle too long."""
        cfg = self.sidecar.config
        if not self.alive:
            return
        if self.conn.awaiting_hello:
            if now - self.last_active >= cfg.handshake_timeout:
                self._refuse(P.ErrorCode.BAD_REQUEST, f"no Hello within {cfg.handshake_timeout:g} s")
        elif (cfg.idle_timeout > 0 and now - self.last_active >= cfg.idle_timeout
              and self.conn.inflight == 0 and not self.bound):
            log.info("closing connection %d: idle for %.0f s", self.cid, now - self.last_active)
            self.alive = False
            self.transport.close()

    def eof_received(self) -> bool:
        """The peer sent all its requests (half-close): answer those in flight, then close."""
        self.half_closed = True
        return self.alive and self.conn.inflight > 0

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        self.conn.discard()  # its incomplete frame's share of the buffer budget
        self.sidecar.peer_gone(self)

    def pause_writing(self) -> None:  # the peer is not reading its replies: stop reading requests
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.alive:
            self.transport.resume_reading()

    def send(self, frame: bytes) -> None:
        self.last_active = time.monotonic()
        if self.alive and not self.transport.is_closing():
            self.transport.write(frame)
            if self.half_closed and self.conn.inflight == 0:
                self.transport.close()


class Sidecar:
    """The server.  ``await run()`` serves until SIGTERM/SIGINT (or :meth:`request_stop`)."""

    def __init__(self, config: ServerConfig, *, registry: toktier.Registry | None = None,
                 install_signals: bool = True) -> None:
        self.config = config
        self.pool = ArenaPool(config.shm_prefix, mode=0o640 if config.group is not None else 0o600,
                              gid=config.group)
        self.buffer_budget = BufferBudget(max(config.max_buffered_bytes, config.max_frame))
        self._instance_lock: InstanceLock | None = None
        self.service = SessionService(config, registry or toktier.Registry(), self.pool)
        self.metrics = Metrics(lambda: self.service.snapshot(len(self.peers)), self.service.registry,
                               config.verify_rate, cache_stats=self.service.cache_stats)
        self.verifier: Shadow | None = None
        if config.verify_rate > 0:
            # Dispatch samples (`_succeed`: only sampled results build their O(N) sample); the
            # worker checks every offer with private cache-free references, built when a
            # tokenizer loads and never rebuilt (ShadowConfig's default reference policy).
            self.verifier = Shadow(self.service.registry.get,
                                   ShadowConfig(rate=config.verify_rate,
                                                disable_on_mismatch=config.verify_disable_on_mismatch,
                                                max_chars=config.verify_max_chars,
                                                chars_per_second=config.verify_chars_per_second),
                                   metrics=self.metrics.registry)
            self.service.fast_path_disabled = self.verifier.is_disabled
            self.service.on_tokenizer_loaded = self.verifier.prepare
        self.service.server_counts = self._counts
        self.service.on_op = self.metrics.record_op
        self.service.conversations.on_result = self.metrics.record_conversation
        self.state: WriteBehind | None = None
        self.state_dir: StateDir | None = None
        self.state_store: StateStore | None = None
        self.cache_files: CacheFiles | None = None
        backends: list[Backend] = []
        if config.state_dir is not None:  # checked here: a bad directory fails before anything starts
            self.state_dir = StateDir(config.state_dir, ttl=config.session_ttl)
            self.cache_files = CacheFiles(self.state_dir, max_bytes=config.tokenizer_cache_l1_max_memory)
            backends.append(self.state_dir)
        if config.state_store is not None:  # so is a bad URL (no connection yet: the store may come later)
            self.state_store = StateStore(parse_store_url(config.state_store), prefix=config.state_store_prefix,
                                          ttl=config.session_ttl, max_value=config.state_store_max_value,
                                          timeout=config.state_store_timeout)
            self.state_store.on_op = lambda op, result: self.metrics.state_store_ops.labels(op, result).inc()
            backends.append(self.state_store)
        if backends:
            self.state = WriteBehind(backends, flush_delay=config.state_flush_delay)
            self.state.snapshot = self._state_snapshot
            self.service.state = self.state
        self.preload: Preload | None = None
        if self.state_dir is not None and config.state_preload:
            counter = self.metrics.state_preload
            for result in PRELOAD_RESULTS:
                counter.labels(result)
            self.preload = Preload(release=_release_slot, count=lambda result, n: counter.labels(result).inc(n))
            self.metrics.watch_preload(self.preload.snapshot)
            self.service.on_resized = self._trim_held
            self.service.on_superseded = lambda key: self.preload.drop(record_name(key.namespace, key.session))
        self.install_signals = install_signals
        self.lanes = Lanes()
        self.peers: dict[int, _Peer] = {}
        self.stopping = False
        self.welcome: P.Welcome | None = None
        self.metrics_port: int | None = None
        self._cids = itertools.count(1)
        self._bulk: ThreadPoolExecutor | None = None  # whole-context work
        self._repair: ThreadPoolExecutor | None = None  # changes to existing sessions
        self._loader: ThreadPoolExecutor | None = None  # tokenizer loads: never hold a bulk worker
        self._preloader: ThreadPoolExecutor | None = None  # restore at start: one record at a time
        self._pools: dict[Pool, ThreadPoolExecutor] = {}
        self._server: asyncio.AbstractServer | None = None
        self._owns_socket_file = False
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self._loads: dict[tuple[str, str], asyncio.Future] = {}
        self._background: set[asyncio.Task] = set()
        self._busy = 0  # requests being processed off the inline path
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.shutdown()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    def request_stop(self) -> None:
        self._stop.set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        self._bulk = ThreadPoolExecutor(cfg.workers, thread_name_prefix="toktier-bulk")
        self._repair = ThreadPoolExecutor(cfg.workers, thread_name_prefix="toktier-repair")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="toktier-load")
        if self.preload is not None:
            self._preloader = ThreadPoolExecutor(1, thread_name_prefix="toktier-preload")
        self._pools = {"bulk": self._bulk, "repair": self._repair}
        await loop.run_in_executor(self._loader, self.service.preload)
        if self.state is not None:
            self.state.start()
        if self.state_dir is not None:
            await self._restore_caches(self.state_dir.scan())
        if self.state_store is not None:
            await loop.run_in_executor(self._loader, self.state_store.ping)
        self.welcome = P.Welcome(
            version=P.PROTOCOL_VERSION, server=f"toktier-sidecar/{toktier.__version__}", max_frame=cfg.max_frame,
            max_session_chars=cfg.max_session_chars, max_inflight=cfg.max_inflight,
            default_tokenizer=self.service.default_tokenizer,
            namespace="shared" if cfg.shared_namespace else "peer-uid",
        )
        activated = sdnotify.listen_fds()
        if activated:
            sock = activated[0]
            for extra in activated[1:]:
                extra.close()
            log.info("socket-activated (fd %d)", sock.fileno())
        else:
            sock = bind_unix_socket(cfg.socket_path, cfg.group)
            self._owns_socket_file = True
        self._claim_segments()  # the socket's directory exists now; no segment was made yet
        sock.setblocking(False)
        self._server = await loop.create_unix_server(lambda: _Peer(self, next(self._cids)), sock=sock,
                                                     backlog=BACKLOG)
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.metrics_addr)
        if self.install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            loop.add_signal_handler(signal.SIGHUP, self.reenable_fast_paths)
        self._spawn(self._sweeper())
        self._spawn(self._reaper())
        if self.cache_files is not None:
            self._spawn(self._cache_writer())
        sdnotify.notify(f"READY=1\nSTATUS=serving on {cfg.socket_path}")
        log.info("serving on %s (default tokenizer %s)", cfg.socket_path, self.service.default_tokenizer)
        self._ready.set()
        if self.preload is not None:  # after readiness: serving does not wait for it (module docstring)
            if self.state_dir is not None and (self.state_dir.index or self.state_dir.conv_index):
                self._spawn(self._preload_records())
            else:
                self.preload.finish()

    async def shutdown(self) -> None:
        """Graceful stop: refuse new work, let in-flight requests finish, unlink everything."""
        if self.stopping:
            return
        self.stopping = True
        sdnotify.notify("STOPPING=1")
        if self._server is not None:
            self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.shutdown_grace
        while (self._busy or len(self.lanes)) and loop.time() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 0.05)
        try:
            for peer in list(self.peers.values()):
                peer.alive = False
                peer.transport.close()
            for task in list(self._background):
                task.cancel()
            for pool in (self._bulk, self._repair, self._loader, self._preloader):
                if pool is not None:
                    pool.shutdown(wait=True, cancel_futures=True)
            if self.verifier is not None:
                self.verifier.close()
            self.metrics.stop()
        finally:  # whatever failed above, leave nothing behind in /dev/shm or on disk
            for peer in list(self.peers.values()):
                self._drop_handoffs(peer)
            if self.state is not None:  # before the sessions end: their pending changes are written
                try:
                    self._write_caches()
                    self.state.close()
                except Exception:
                    log.exception("writing session records at shutdown failed")
            if self.preload is not None:  # not open: nothing to write, their records stay as they are
                self.preload.release_all()
            self.service.shutdown()
            if self._instance_lock is not None:  # after the segments are gone: nothing left to sweep
                self._instance_lock.release()
            if self._owns_socket_file:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.config.socket_path)
        log.info("stopped")

    def _claim_segments(self) -> None:
        """Take this instance's lock, then remove the segments of this server's dead instances
        (crashes leave them; rules in :mod:`toktier_sidecar.shm`).  Without a usable private
        runtime dir the server still serves, but cannot sweep (logged)."""
        cfg = self.config
        try:
            directory = runtime_dir_for(cfg)
            self._instance_lock = InstanceLock(directory, self.pool.prefix, self.pool.instance).acquire()
            report = sweep_stale(self.pool.prefix, directory, own_instance=self.pool.instance)
        except OSError as exc:
            log.warning("no shared-memory sweep (segments of a crashed run stay in /dev/shm): %s", exc)
            return
        if report.removed or report.lock_files:
            log.warning("removed %d stale shared-memory segments (%d bytes) of %d crashed instance(s)",
                        report.removed, report.removed_bytes, report.lock_files)
        if report.unproven:
            log.info("left %d segments with prefix %r alone: no lock file in %s proves them ours",
                     report.unproven, self.pool.prefix, directory)

    async def _reaper(self) -> None:
        """Close connections past the handshake or idle timeout."""
        cfg = self.config
        timeouts = [t for t in (cfg.handshake_timeout, cfg.idle_timeout) if t > 0]
        tick = min(1.0, max(0.05, min(timeouts) / 4)) if timeouts else 1.0
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for peer in list(self.peers.values()):
                try:
                    peer.expire(now)
                except Exception:  # one broken transport must not stop the reaper
                    log.exception("closing connection %d failed", peer.cid)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _sweeper(self) -> None:
        """End sessions idle past the TTL (lookups check it too; this frees their memory)."""
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            try:
                n = self.service.store.expire()
            except Exception:  # keep sweeping; the failure is a bug worth a traceback
                log.exception("TTL sweep failed")
                continue
            if n:
                log.info("ended %d idle sessions (TTL)", n)
            if self.state is not None and self.state_dir is not None:
                old = self.state_dir.expired()
                for name in old:
                    if self.preload is not None:
                        self.preload.drop(name)
                    self.state.submit(self.state_dir.remove, name)
                if old:
                    log.info("removed %d session and conversation records not restored within the TTL", len(old))

    def _enter(self) -> None:
        self._busy += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._busy -= 1
        if not self._busy:
            self._idle.set()

    def _counts(self) -> ServerCounts:
        v = self.verifier.stats if self.verifier is not None else None
        return ServerCounts(connections=len(self.peers), inflight=self._busy,
                            verified=v.checked if v else 0, mismatches=v.mismatches if v else 0)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, peer: _Peer, req: P.Request) -> None:
        """Route one admitted request (called from ``data_received``, in arrival order): run it
        right here when it is ready and small, else in its session's lane or its own task."""
        handler = HANDLERS[type(req)]
        try:
            sid = handler.lane(req)
        except Exception as exc:
            self._fail(peer, req, handler, exc, time.perf_counter())
            return
        key = None if sid is None else handler.key(peer.namespace, sid)
        if self.stopping or ((key is None or self.lanes.idle(key)) and self._inline_ready(handler, req, key)):
            _run_now(self._serve(peer, key, req, handler))  # when stopping: refused at once
        elif key is not None:
            self.lanes.submit(key, lambda: self._queued(peer, key, req, handler))
        else:
            self._enter()
            task = asyncio.get_running_loop().create_task(self._serve(peer, None, req, handler))
            task.add_done_callback(lambda _t: self._leave())

    def _inline_ready(self, handler: Handler[Any], req: P.Request, key: SessionKey | None) -> bool:
        """Little work, and a tokenizer (if it names one) already loaded: ``_serve`` will not
        suspend, so it can run on the loop now."""
        if handler.pool is not None and handler.work_chars(self.service, key, req) > self.config.inline_chars:
            return False
        if key is not None and self._restorable(key, req) and not self._held_ready(key, req):
            return False  # the record is read and verified in a worker first
        spec = handler.tokenizer(req)
        if spec is None:
            return True
        try:
            return self.service.find_tokenizer(*spec) is not None
        except Exception:
            return True  # the error is answered inline

    async def _queued(self, peer: _Peer, key: SessionKey, req: P.Request, handler: Handler[Any]) -> None:
        """A lane job: the request's turn on its session came."""
        self._enter()
        try:
            await self._serve(peer, key, req, handler)
        finally:
            self._leave()

    async def _serve(self, peer: _Peer, key: SessionKey | None, req: P.Request, handler: Handler[Any]) -> None:
        """The one sequence every request goes through: refuse when stopping, resolve its
        tokenizer (loading it in a worker on first use), plan, work (on the loop when small,
        else in the handler's pool), done/failed, then reply (or a typed error) and account.

        It awaits only to load a tokenizer or to run big work, so a request that
        ``_inline_ready`` admits completes synchronously (``_run_now``)."""
        t0 = time.perf_counter()
        try:
            if self.stopping and not handler.one_way:
                raise ShuttingDown("the sidecar is shutting down")
            spec = handler.tokenizer(req)
            tok = None if spec is None else await self._tokenizer(*spec)
            if key is not None and self._restorable(key, req):
                await self._restore(key, req)
            plan = handler.plan(self.service, Call(peer, key, tok), req)
            try:
                if handler.pool is None or handler.work_chars(self.service, key, req) <= self.config.inline_chars:
                    result = plan.work()
                else:
                    pool = self._pools[handler.pool]
                    result = await asyncio.get_running_loop().run_in_executor(pool, plan.work)
            except BaseException as exc:
                plan.failed(exc)
                raise
            answer = plan.done(result)
        except Exception as exc:
            self._fail(peer, req, handler, exc, t0)
        else:
            self._succeed(peer, req, handler, answer, t0)

    def _succeed(self, peer: _Peer, req: P.Request, handler: Handler[Any], answer: Answer, t0: float) -> None:
        if answer.reply is None:
            return
        try:
            frame = peer.conn.reply(answer.reply)
        except Exception as exc:  # a reply that cannot be encoded: still exactly one typed answer
            self._fail(peer, req, handler, exc, t0)
            return
        peer.send(frame)
        self.metrics.observe(handler.tag, "ok", time.perf_counter() - t0, answer.path,
                             getattr(answer.reply, "tokenizer", ""))
        if self.verifier is not None and answer.sample is not None and self.verifier.sampled():
            try:  # builds the sample only if the queue has room and the budget allows its size
                self.verifier.offer(answer.sample, answer.sample_chars)
            except Exception:  # the reply is sent: a verifier failure must not become a second answer
                log.exception("shadow verifier offer failed")

    # ------------------------------------------------------------ state that outlives the process
    def _restorable(self, key: SessionKey, req: P.Request) -> bool:
        """Loop thread, no I/O: a record may wait for this session, and it is not open here (a
        record of an earlier run in the state dir, or any session with a shared store)."""
        if self.state is None or self.service.store.peek(key) is not None:
            return False
        if self.state_store is not None:  # a Close deletes the shared record without reading it
            return not isinstance(req, (P.Close, P.ConvClose))
        return self.state_dir is not None and self.state_dir.indexed(key)

    async def _restore(self, key: SessionKey, req: P.Request) -> None:
        """In the session's lane, before its first op here: open the session from its record.
        A session restored at start (held) is opened at once; else the record is read, checked
        and verified in a worker (no encode): the state dir's first, then the store's.  A record
        that fails any check is counted and treated as absent (removed when it can never serve:
        corrupt, invalid, and the dir's record whatever failed); the op then misses as it would
        without state.  A Close forgets the record itself; a recovery re-create (``create_only``)
        replaces it.  Suspends only to read (or to wait for the preload's read of this record).
        A conversation's record goes the same way (held when the preload replayed it; else
        replayed here: ``Conversations.restore``)."""
        pre = self.preload
        name = record_name(key.namespace, key.session) if pre is not None and self.state_dir is not None else ""
        if name:
            done = pre.inflight.get(name)
            if done is not None:  # the preload is reading this very record: one read, not two
                await asyncio.shield(done)
        if isinstance(req, (P.Close, P.ConvClose)):
            if name:
                pre.drop(name)
            return
        create_only = isinstance(req, (P.Open, P.ConvOpen)) and req.create_only
        expect = getattr(req, "expect_seq", -1)
        sd, ss = self.state_dir, self.state_store
        if sd is not None and sd.claim(key):
            held = pre.take(name) if name else None
            if create_only:
                if held is not None:
                    _release_slot(held.slot)
                self.state.submit(sd.delete, key)
                return
            if held is not None:
                if self._open_held(key, held, expect):
                    return
            else:
                if name and name in pre.unreached:  # its first op came before the preload reached it
                    pre.reached(name)
                    pre.count("raced")
                if await self._restore_from(sd, key, expect):
                    return
        if ss is not None and not create_only:
            await self._restore_from(ss, key, expect)

    def _held_ready(self, key: SessionKey, req: P.Request) -> bool:
        """Whether ``_restore`` would not suspend: the session was restored at start, and its
        first op will not fall through to the store (a stale record with a store configured)."""
        pre = self.preload
        if pre is None or not pre.held or is_conversation(key.namespace):
            return False  # a conversation's op size depends on it (work_chars): it goes through its lane
        held = pre.held.get(record_name(key.namespace, key.session))
        if held is None:
            return False
        return self.state_store is None or getattr(req, "expect_seq", -1) <= held.seq

    def _open_held(self, key: SessionKey, held: Held, expect: int) -> bool:
        """Open a session restored at start for its first op, after the check an on-demand
        restore makes (``run_restore``: a record behind the client's ``seq`` is stale, a miss);
        True when the session is open now."""
        if expect > held.seq:
            self.metrics.state_restores.labels("stale").inc()
            log.warning("session record of %r in dir not used (stale): %s", key.session[:64],
                        StaleRecord(f"record is at seq {held.seq}, the client at {expect}"))
            _release_slot(held.slot)
            self.state.submit(self.state_dir.delete, key)
            return False
        if self.service.store.peek(key) is not None:  # cannot happen in its lane; never replace a live session
            _release_slot(held.slot)
            return True
        self._add_restored(key, held.slot)
        self.metrics.state_restores.labels("ok").inc()
        self.preload.count("claimed")
        return True

    def _add_restored(self, key: SessionKey, slot: Any) -> None:
        """Loop thread: open a restored session (or conversation) in the store."""
        if is_conversation(key.namespace):
            self.service.conversations.add(self.service, key, slot, restored=True)
        else:
            self.service.add(key, slot)

    def _trim_held(self) -> None:
        """Loop thread, after the open sessions grew: held sessions give the room back (they come
        after every open session in the memory budget)."""
        pre = self.preload
        if pre is None or not pre.held:
            return
        st = self.service.store.stats()
        n = pre.trim(self.config.memory_budget - st.bytes_held, self.config.max_sessions - st.live)
        if n:
            log.info("released %d sessions restored at start for open sessions' memory (their records stay; "
                     "restored on demand)", n)

    async def _yield_to_clients(self) -> None:
        """Let requests in flight finish first (up to ``PRELOAD_YIELD_S``)."""
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PRELOAD_YIELD_S
        while self._busy and not self.stopping:
            left = deadline - loop.time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), left)

    async def _preload_records(self) -> None:
        """Restore at start (see the module docstring): the state dir's records, most recently
        written first, within the memory budget, each read and verified on the preload thread
        and held until its session's first op."""
        pre, sd = self.preload, self.state_dir
        assert pre is not None and sd is not None
        loop = asyncio.get_running_loop()
        order = sorted([*sd.index.items(), *sd.conv_index.items()], key=lambda kv: kv[1].mtime, reverse=True)
        pre.begin(name for name, _ in order)
        total_mb = sum(e.size for _, e in order) / 1e6
        log.info("restoring %d session and conversation records (%.1f MB) in the background, most recent first",
                 len(order), total_mb)
        sdnotify.notify(f"STATUS=serving on {self.config.socket_path}; restoring {len(order)} sessions")
        failed: dict[str, int] = {}
        held = skipped = 0
        try:
            for name, entry in order:
                if self.stopping:
                    break
                index = sd.index_of(name)
                if name not in pre.unreached or index.get(name) is not entry:
                    continue  # claimed by its first op, forgotten by a Close, or expired
                st = self.service.store.stats()
                room = self.config.memory_budget - st.bytes_held - pre.bytes
                if _memory_of(name, entry.size) > room or st.live + len(pre.held) >= self.config.max_sessions:
                    pre.reached(name)
                    pre.count("skipped_budget")
                    skipped += 1
                    continue  # a smaller, older one may still fit
                await self._yield_to_clients()
                if self.stopping or name not in pre.unreached or index.get(name) is not entry:
                    continue
                pre.reached(name)
                done = loop.create_future()
                pre.inflight[name] = done
                try:
                    got = await loop.run_in_executor(self._preloader, self._preload_one, name)
                except Exception as exc:
                    result = restore_result(exc)
                    failed[result] = failed.get(result, 0) + 1
                    self.metrics.state_restores.labels(result).inc()
                    if index.get(name) is entry:  # no op claimed it meanwhile: remove it as an op would
                        del index[name]
                        self.state.submit(sd.remove, name)
                    if result == "error":
                        log.error("restoring session record %s at start failed", name, exc_info=exc)
                    else:
                        log.warning("session record %s not used (%s): %s", name, result, exc)
                    continue
                finally:
                    del pre.inflight[name]
                    done.set_result(None)
                if got is None:  # gone, or of a tokenizer not loaded: left to its first op
                    continue
                key, slot = got
                if self.stopping or index.get(name) is not entry:
                    _release_slot(slot)
                    continue
                nbytes = slot.nbytes if is_conversation(key.namespace) else slot.session.nbytes + session_overhead(key)
                pre.hold(name, Held(slot, slot.seq, nbytes, entry.mtime))
                held += 1
                self._trim_held()
        finally:
            pre.finish()
            log.info("restored %d sessions and conversations at start in %.2f s (%d left to restore on demand: "
                     "over the memory budget; %s)", held, pre.seconds, skipped,
                     ", ".join(f"{k} {v}" for k, v in sorted(failed.items())) or "no bad records")
            if not self.stopping:
                sdnotify.notify(f"STATUS=serving on {self.config.socket_path}; {held} sessions restored at start")

    def _preload_one(self, name: str) -> tuple[SessionKey, Any] | None:
        """Preload thread: the session key and slot of record ``name``, checked as an op's restore checks it (the
        record must name the session its file is named for); None when the file is gone or its
        tokenizer is not loaded yet but may be (its first op decides: loads cost seconds)."""
        if self.stopping:
            return None
        data = self.state_dir.read(name)
        if data is None:
            return None
        if name.endswith(CONV_SUFFIX):
            conv = decode_conversation_record(data)
            key = SessionKey((CONVERSATION_KIND, conv.namespace), conv.conversation)
            if record_name(key.namespace, key.session) != name:
                raise ForeignRecord("record belongs to another conversation (renamed file, copied key or hash "
                                    "collision)")
            if not self._tokenizer_ready(conv.tokenizer_hash, conv.tokenizer_name, "all"):
                return None
            return key, self.service.conversations.restore(self.service, conv, key, -1)
        rec = decode_record(data)
        if record_name(rec.namespace, rec.session) != name:
            raise ForeignRecord("record belongs to another session (renamed file, copied key or hash collision)")
        if not self._tokenizer_ready(rec.tokenizer_hash, rec.tokenizer_name, cast(P.Specials, rec.specials)):
            return None
        return SessionKey(rec.namespace, rec.session), self.service.run_restore(rec, -1)

    def _tokenizer_ready(self, tok_hash: str, name: str, specials: P.Specials) -> bool:
        """Whether a record's tokenizer is served now (False: loadable, so its first op may load it:
        loads cost seconds); raises UnknownTokenizer (a foreign record) when it can never be."""
        try:
            self.service.registry.get(tok_hash)
        except toktier.UnknownTokenizer:
            return self.service.find_tokenizer(name, specials) is not None
        return True

    async def _restore_from(self, backend: Backend, key: SessionKey, expect: int) -> bool:
        """Restore ``key`` from ``backend``; True when the session (or conversation) is open now."""
        conv = is_conversation(key.namespace)
        book = self.service.conversations

        def load() -> Any:
            data = backend.load(key)
            if data is None:
                return None
            if conv:
                return book.restore(self.service, decode_conversation_record(data), key, expect)
            return self.service.run_restore(check_record(decode_record(data), key), expect)

        try:
            slot = await asyncio.get_running_loop().run_in_executor(self._pools["bulk"], load)
        except StoreUnavailable:  # counted and logged (once per outage) by the store
            self.metrics.state_restores.labels("store_error").inc()
            return False
        except Exception as exc:
            result = restore_result(exc)
            self.metrics.state_restores.labels(result).inc()
            if not backend.shared or result in ("corrupt", "invalid"):  # a stale or foreign shared record may
                self.state.submit(backend.delete, key)                  # serve another client or node
            what = "conversation" if conv else "session"
            if result == "error":
                log.error("restoring %s %r from %s failed", what, key.session[:64], backend.name, exc_info=exc)
            else:
                log.warning("%s record of %r in %s not used (%s): %s", what, key.session[:64], backend.name, result,
                            exc)
            return False
        if slot is None:
            return False
        if self.service.store.peek(key) is not None:  # cannot happen in its lane; never replace a live session
            slot.arena.release()
            return True
        self._add_restored(key, slot)
        self.metrics.state_restores.labels("ok").inc()
        log.debug("%s %r restored from %s at seq %d (%d tokens)", "conversation" if conv else "session",
                  key.session[:64], backend.name, slot.seq, slot.conv.num_tokens if conv else slot.session.num_tokens)
        return True

    async def _restore_caches(self, paths: list[str]) -> None:
        """At start, before serving: adopt the tokenizer caches' L1 entries from their files (in a
        worker; each entry checked like a session record).  A file of a tokenizer not loaded,
        or of a namespace written by another configuration, is counted as foreign and left."""
        if not paths or not self.config.tokenizer_cache_enabled:
            return
        t0 = time.perf_counter()
        try:
            counts = await asyncio.get_running_loop().run_in_executor(self._loader, self._adopt_cache_files, paths)
        except Exception:  # a cache is an optimisation: never a reason not to serve
            log.exception("restoring the tokenizer caches failed; they start empty")
            self.metrics.cache_restores.labels("error").inc()
            return
        for result, n in counts.items():
            if n:
                self.metrics.cache_restores.labels(result).inc(n)
        log.info("tokenizer caches: %d entries restored from %d files in %.0f ms (%s)", counts.get("ok", 0),
                 len(paths), 1000 * (time.perf_counter() - t0),
                 ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "ok") or "no misses")

    def _adopt_cache_files(self, paths: list[str]) -> dict[str, int]:
        """Loader thread, before serving (the caches are created here: nothing else runs yet)."""
        counts: dict[str, int] = {}
        for path in paths:
            try:
                records, bad = CacheFiles.read(path)
            except OSError as exc:
                log.warning("cannot read tokenizer cache file %s: %s", path, exc)
                counts["corrupt"] = counts.get("corrupt", 0) + 1
                continue
            for exc in bad:
                counts[restore_result(exc)] = counts.get(restore_result(exc), 0) + 1
            for rec in records:
                try:
                    tok = self.service.registry.get(rec.tokenizer_hash)
                    if os.path.basename(path) != CacheFiles.name(rec.namespace, tok.hash):
                        raise ForeignRecord("cache entry filed under another namespace or tokenizer")
                    cache = self.service.prefix_cache(rec.namespace, tok)
                    if cache is None:
                        continue
                    cache.adopt(rec.text, rec.ids, rec.certificate)
                    result = "ok"
                except Exception as exc:
                    result = restore_result(exc)
                    if result == "error":
                        log.error("adopting a tokenizer cache entry failed", exc_info=exc)
                counts[result] = counts.get(result, 0) + 1
        return counts

    async def _cache_writer(self) -> None:
        """Write the tokenizer caches that changed, every ``state_cache_flush_interval`` seconds."""
        while True:
            await asyncio.sleep(self.config.state_cache_flush_interval)
            try:
                self._write_caches()
            except Exception:
                log.exception("writing the tokenizer caches failed")

    def _write_caches(self) -> None:
        """Loop thread: queue a write of every cache that changed (the writer thread reads it)."""
        if self.cache_files is None or self.state is None:
            return
        for key, cache in self.service.caches():
            if self.cache_files.changed(key, cache):
                self.state.submit(self.cache_files.write, key, cache)

    def _state_snapshot(self, key: SessionKey) -> Record | str | None:
        """The state dir's snapshot hook: BUSY while an op on the session runs or waits."""
        if not self.lanes.idle(key):
            return BUSY
        return self.service.state_snapshot(key)

    def reenable_fast_paths(self) -> None:
        """Operator action (SIGHUP): re-enable every tokenizer the verifier disabled."""
        if self.verifier is None:
            return
        for tok in self.service.registry:
            if self.verifier.reenable(tok.hash):
                log.warning("fast path re-enabled for tokenizer %s (%s)", tok.name, tok.hash[:12])

    def _fail(self, peer: _Peer, req: P.Request, handler: Handler[Any], exc: Exception, t0: float) -> None:
        if code_for(exc) is None:
            log.error("internal error in %s", handler.tag, exc_info=exc)
        if handler.one_way:
            return  # nobody waits for an answer
        frame = error_frame(getattr(req, "id", 0), exc)
        peer.send(peer.conn.reply(frame))
        self.metrics.observe(handler.tag, frame.code.value, time.perf_counter() - t0, None,
                             getattr(req, "tokenizer", ""))

    async def _tokenizer(self, name: str, specials: P.Specials) -> toktier.FrozenTokenizer:
        """A served tokenizer, loading a bundled one in a worker on first use (loads deduplicated)."""
        tok = self.service.find_tokenizer(name, specials)
        if tok is not None:
            return tok
        name = name or self.service.default_tokenizer  # e.g. the default with specials="none"
        k = (name, specials)
        fut = self._loads.get(k)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = self._loads[k] = loop.run_in_executor(self._loader, self.service.load_tokenizer, name, specials)
            fut.add_done_callback(lambda _f: self._loads.pop(k, None))
        return await asyncio.shield(fut)

    # ------------------------------------------------------------ disconnects
    def peer_gone(self, peer: _Peer) -> None:
        if self.peers.pop(peer.cid, None) is None:
            return
        self._drop_handoffs(peer)
        if self.stopping:
            return  # shutdown ends every session anyway
        for key in list(peer.bound):
            async def close_if_bound(key: Hashable = key) -> None:
                slot = self.service.store.peek(key)
                if slot is not None and slot.bound_to == peer.cid:
                    self.service.close(key)
            self.lanes.submit(key, close_if_bound)

    def _drop_handoffs(self, peer: _Peer) -> None:
        handoffs, peer.handoffs = peer.handoffs, {}
        for seg in handoffs.values():
            seg.unlink()


def _memory_of(name: str, record_bytes: int) -> int:
    """What restoring record file ``name`` of ``record_bytes`` will hold in memory, before it is
    restored (the budget check of the preload): a session about its record plus room to grow;
    a conversation ~``CONV_MEMORY_PER_RECORD_BYTE`` times its record (which holds no text or IDs)."""
    if name.endswith(CONV_SUFFIX):
        return record_bytes * CONV_MEMORY_PER_RECORD_BYTE
    return record_bytes + PRELOAD_EXTRA_BYTES


def _release_slot(slot: Any) -> None:
    """Free a restored session that never opened (its arena; no client was told of its segment)."""
    slot.arena.release()


def _run_now(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` to completion right here, without a task: it must not suspend (an inline
    request never does: its tokenizer is loaded and its work small)."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("an inline request suspended; _inline_ready let through one that was not ready")
