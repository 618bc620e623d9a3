"""The sidecar's session logic, without any I/O: tokenizers, the session store, arenas.

Split by thread, so the asyncio adapter can run the expensive middle anywhere:

* ``begin_*`` (event-loop thread): validate, look up and pin the session.
* ``run_*`` (event loop for small ops, a worker thread for big ones): the core
  :class:`toktier.Session` op, which writes IDs straight into the session's
  shared-memory segment; then the segment header is published.
* ``finish`` (event-loop thread): unpin, account the new size (may evict others).

The store is touched only from the loop thread; a session is touched only by the
one op its lane lets run.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable

import numpy as np

import toktier
from toktier.fullpath import encode_full
from toktier.store import EndCause, SessionStore
from toktier_client import protocol as P
from toktier_client.shm import HEADER_BYTES

from .config import ServerConfig
from .errors import BadRequest, SessionConflict, TokenizerMismatch, TooLarge, code_for
from .shm import ArenaPool, Segment, SessionArena

log = logging.getLogger(__name__)

SPECIALS = ("all", "none")
#: Largest repair window a client may ask for (bytes); larger is just a full encode.
MAX_WINDOW = 1 << 20


@dataclass
class Slot:
    """One open session as the sidecar holds it."""

    session: toktier.Session
    arena: SessionArena
    tokenizer: toktier.FrozenTokenizer
    seq: int = 0
    bound_to: int | None = None  # connection id when bind_to_connection


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a session op produced, ready to become an ``Ids`` reply."""

    segment: Segment
    count: int
    seq: int
    first_changed: int
    path: str
    widenings: int
    tokenizer: str


def _nothing(_exc: BaseException) -> None:
    return None


@dataclass(frozen=True)
class Plan:
    """One session request, split by thread.  :meth:`SessionService.plan` has already done the
    loop-thread checks (and pinned the session); ``work()`` runs anywhere; then exactly one of
    ``done(result)`` (returns the reply) or ``failed(exc)`` runs on the loop thread."""

    work: Callable[[], object]
    done: Callable[[object], P._Msg]
    failed: Callable[[BaseException], None] = _nothing
    text_chars: int = 0  # code points ``work`` tokenizes: decides inline vs worker


class SessionService:
    def __init__(self, config: ServerConfig, registry: toktier.Registry, pool: ArenaPool) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.store: SessionStore[Hashable, Slot] = SessionStore(
            memory_budget=config.memory_budget, ttl=config.session_ttl, max_entries=config.max_sessions,
            on_end=self._ended,
        )
        self.bundled = frozenset(toktier.list_tokenizers())
        # Set by the server when the shadow verifier may disable a tokenizer's fast path.
        self.fast_path_disabled: Callable[[str], bool] = lambda tokenizer_hash: False
        # Set by the server: runs on the loading thread after each tokenizer load (the
        # shadow verifier builds its private reference there, not mid-traffic).
        self.on_tokenizer_loaded: Callable[[toktier.FrozenTokenizer], None] = lambda tok: None
        self._warned_unspliceable: set[str] = set()  # hashes already warned about (loads run on workers)
        self._warn_lock = threading.Lock()
        self.started = time.monotonic()
        self.default_tokenizer = ""

    # ------------------------------------------------------------- tokenizers
    def preload(self) -> None:
        """Load the configured tokenizers (blocking; call before serving)."""
        for i, name in enumerate(self.config.tokenizers):
            tok = self.registry.load(name)
            self._loaded(tok)
            if i == 0:
                self.default_tokenizer = tok.name
            log.info("tokenizer %s loaded (hash %s, family %s)", tok.name, tok.hash[:12], tok.family)

    def find_tokenizer(self, name: str, specials: str) -> toktier.FrozenTokenizer | None:
        """The served tokenizer for ``name`` (or hash); None if it must be loaded first.
        Raises UnknownTokenizer when it can never be served."""
        if specials not in SPECIALS:
            raise BadRequest(f"specials must be one of {SPECIALS}, not {specials!r}")
        name = name or self.default_tokenizer
        try:
            return self.registry.get(name, specials)  # type: ignore[arg-type]
        except toktier.UnknownTokenizer:
            if self.config.lazy_load and name in self.bundled:
                return None
            served = sorted(set(self.registry.names()) | (self.bundled if self.config.lazy_load else set()))
            raise toktier.UnknownTokenizer(
                f"tokenizer {name!r} is not served; served: {', '.join(served)}"
            ) from None

    def load_tokenizer(self, name: str, specials: str) -> toktier.FrozenTokenizer:
        """Load a bundled tokenizer (slow: run in a worker)."""
        tok = self.registry.load(name, specials=specials)  # type: ignore[arg-type]
        self._loaded(tok)
        return tok

    def _loaded(self, tok: toktier.FrozenTokenizer) -> None:
        """Every load (preload and lazy) ends here: the server's hook, then a warning when
        the tokenizer cannot splice, so an operator sees why its ops cost O(text), not O(edit),
        instead of finding out from latency.  Once per tokenizer, however often it is loaded."""
        self.on_tokenizer_loaded(tok)
        if tok.spliceable:
            return
        with self._warn_lock:
            if tok.hash in self._warned_unspliceable:
                return
            self._warned_unspliceable.add(tok.hash)
        log.warning("tokenizer %r (hash %s...) is served without splicing: every op re-tokenizes the whole "
                    "text (%s)", tok.name, tok.hash[:12], tok.family_reason)

    # ---------------------------------------------------------------- sessions
    def plan(self, key: Hashable, req: P._Msg, tok: toktier.FrozenTokenizer | None = None) -> Plan:
        """Loop thread: validate ``req`` (an Open needs its resolved ``tok``) and split it."""
        rid = req.id  # type: ignore[attr-defined]
        if isinstance(req, P.Close):
            existed = self.close(key)
            return Plan(work=lambda: None, done=lambda _r: P.Closed(id=rid, existed=existed))
        if isinstance(req, P.Open):
            assert tok is not None
            slot = self.begin_open(key, req, tok)
            if slot is None:
                def created(res: object) -> P._Msg:
                    new_slot, out = res  # type: ignore[misc]
                    self.add(key, new_slot)
                    return ids_reply(rid, out)
                return Plan(work=lambda: self.run_create(tok, req), done=created, text_chars=len(req.text))
            return self._planned(key, slot, lambda: self.run_open_existing(slot, req), rid, len(req.text))
        slot = self.begin_op(key, req)  # type: ignore[arg-type]
        return self._planned(key, slot, lambda: self.run_op(slot, req), rid, len(req.text))  # type: ignore[arg-type]

    def _planned(self, key: Hashable, slot: Slot, work: Callable[[], Outcome], rid: int, chars: int) -> Plan:
        def done(out: object) -> P._Msg:
            self.finish(key, slot)
            return ids_reply(rid, out)  # type: ignore[arg-type]

        def failed(exc: BaseException) -> None:
            if code_for(exc) is None:  # unexpected: the session may be half-updated; end it
                self.store.unpin(key)
                self.close(key)
            self.finish(key, slot)

        return Plan(work=work, done=done, failed=failed, text_chars=chars)

    def begin_op(self, key: Hashable, req: P.Append | P.Edit | P.Sync) -> Slot:
        """Loop thread: look up, check, pin."""
        slot = self.store.get(key)
        if req.tokenizer and req.tokenizer not in (slot.tokenizer.hash, slot.tokenizer.name):
            raise TokenizerMismatch(
                f"session {req.session!r} uses tokenizer {slot.tokenizer.name} ({slot.tokenizer.hash[:12]}), "
                f"not {req.tokenizer[:64]!r}"
            )
        if req.expect_seq >= 0 and req.expect_seq != slot.seq:
            raise SessionConflict(f"session {req.session!r} is at seq {slot.seq}, not {req.expect_seq}")
        self._check_size(slot.session, req)
        self.store.pin(key)
        return slot

    def _check_size(self, session: toktier.Session, req: P.Append | P.Edit | P.Sync) -> None:
        limit = self.config.max_session_chars
        if isinstance(req, P.Append):
            new = session.num_chars + len(req.text)
        elif isinstance(req, P.Edit):
            removed = max(0, min(req.end, session.num_chars) - max(req.start, 0))
            new = session.num_chars - removed + len(req.text)
        else:
            new = len(req.text)
        if new > limit:
            raise TooLarge(f"session text would be {new} code points; the limit is {limit}")

    def run_op(self, slot: Slot, req: P.Append | P.Edit | P.Sync) -> Outcome:
        """Any thread (the lane guarantees exclusivity): apply the op, publish the segment."""
        s = slot.session
        s.fast_path = not self.fast_path_disabled(slot.tokenizer.hash)
        if isinstance(req, P.Append):
            r = s.append(req.text)
        elif isinstance(req, P.Edit):
            r = s.edit(req.start, req.end, req.text)
        else:
            r = s.sync(req.text)
        return self._publish(slot, r)

    def begin_open(self, key: Hashable, req: P.Open, tok: toktier.FrozenTokenizer) -> Slot | None:
        """Loop thread: the existing slot to sync (pinned), or None to create one."""
        if len(req.text) > self.config.max_session_chars:
            raise TooLarge(f"text of {len(req.text)} code points exceeds the limit of {self.config.max_session_chars}")
        if req.window and not 16 <= req.window <= MAX_WINDOW:
            raise BadRequest(f"window must be 0 (default) or in [16, {MAX_WINDOW}], not {req.window}")
        slot = self.store.peek(key)
        if slot is None:
            return None
        if slot.tokenizer.hash != tok.hash:
            raise TokenizerMismatch(
                f"session {req.session!r} is open with tokenizer {slot.tokenizer.name} ({slot.tokenizer.hash[:12]}); "
                f"close it before re-opening with {tok.name} ({tok.hash[:12]})"
            )
        self.store.get(key)  # touch
        self.store.pin(key)
        return slot

    def run_open_existing(self, slot: Slot, req: P.Open) -> Outcome:
        slot.session.fast_path = not self.fast_path_disabled(slot.tokenizer.hash)
        return self._publish(slot, slot.session.sync(req.text))

    def run_create(self, tok: toktier.FrozenTokenizer, req: P.Open) -> tuple[Slot, Outcome]:
        """Any thread: build a new session whose IDs live in a fresh segment."""
        arena = self.pool.session_arena()
        try:
            session = toktier.Session(tok, req.text, window=req.window or self.config.window or None,
                                      allocator=arena.allocate)
            slot = Slot(session, arena, tok)
            if req.text:
                path, first_changed = toktier.RepairPath.FULL.value, 0
            else:
                path, first_changed = toktier.RepairPath.NOOP.value, 0
            slot.seq = 1
            seg = self._ids_segment(slot, session.ids, 0)
            seg.publish(slot.seq, session.num_tokens)
            return slot, Outcome(seg, session.num_tokens, slot.seq, first_changed, path, 0, tok.hash)
        except BaseException:
            arena.release()
            raise

    def add(self, key: Hashable, slot: Slot) -> None:
        """Loop thread: register a created session (may evict others)."""
        self.store.add(key, slot, slot.session.nbytes)

    def finish(self, key: Hashable, slot: Slot) -> None:
        """Loop thread: unpin and account the session's new size."""
        if self.store.peek(key) is slot:
            self.store.unpin(key)
            self.store.resize(key, slot.session.nbytes)

    def close(self, key: Hashable) -> bool:
        return self.store.close(key)

    def _publish(self, slot: Slot, r: toktier.OpResult) -> Outcome:
        slot.seq += 1
        seg = self._ids_segment(slot, r.ids, r.first_changed)
        seg.publish(slot.seq, len(r.ids))
        return Outcome(seg, len(r.ids), slot.seq, r.first_changed, r.path.value, r.widenings, slot.tokenizer.hash)

    def _ids_segment(self, slot: Slot, ids: np.ndarray, first_changed: int) -> Segment:
        """The segment holding ``ids``: the session writes its IDs straight into the arena's
        segment (it is the session's allocator), so publishing never copies them."""
        seg = slot.arena.segment
        if seg is None or (len(ids) and ids.__array_interface__["data"][0] != seg.ids.__array_interface__["data"][0]):
            raise RuntimeError("the session's IDs are not in its shared-memory arena (allocator ignored?)")
        return seg

    # ------------------------------------------------------------- stateless
    def run_encode(self, tok: toktier.FrozenTokenizer, text: str) -> Segment:
        """Any thread: full reference encode into a handoff segment (the core's full path:
        parallel chunks, GIL released)."""
        if len(text) > self.config.max_session_chars:
            raise TooLarge(f"text of {len(text)} code points exceeds the limit of {self.config.max_session_chars}")
        if not text:
            ids = np.zeros(0, dtype=np.uint32)
        else:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise toktier.InvalidText(f"text is not valid Unicode at index {exc.start}") from None
            ids = encode_full(tok, text)
        return self.pool.handoff(ids)

    # ------------------------------------------------------------------- misc
    def stats(self, rid: int, connections: int, inflight: int = 0, verified: int = 0,
              mismatches: int = 0) -> P.StatsReply:
        st = self.store.stats()
        return P.StatsReply(
            id=rid, sessions=st.live, bytes_held=st.bytes_held, shm_bytes=self.pool.live_bytes,
            shm_segments=self.pool.live_segments, opened=st.opened, closed=st.ended.get("closed", 0),
            misses=st.misses, evictions=st.evictions, connections=connections,
            uptime_s=time.monotonic() - self.started, inflight=inflight, verified=verified,
            mismatches=mismatches,
        )

    def snapshot(self, connections: int) -> dict:
        st = self.store.stats()
        return dict(sessions=st.live, bytes_held=st.bytes_held, shm_bytes=self.pool.live_bytes,
                    shm_segments=self.pool.live_segments, connections=connections, ended=st.ended,
                    opened=st.opened, misses=st.misses)

    def tokenizer_list(self, rid: int) -> P.TokenizerList:
        loaded = [P.TokenizerInfo(name=t.name, hash=t.hash, family=t.family or "", specials=t.specials)
                  for t in self.registry]
        available = sorted(set(self.registry.names()) | (self.bundled if self.config.lazy_load else set()))
        return P.TokenizerList(id=rid, available=available, loaded=loaded, default=self.default_tokenizer)

    def shutdown(self) -> None:
        self.store.clear(EndCause.SHUTDOWN)
        self.pool.unlink_all()

    def _ended(self, key: Hashable, slot: Slot, cause: EndCause) -> None:
        slot.arena.release()
        if cause is not EndCause.CLOSED:
            log.debug("session %r ended: %s", key, cause.value)


def ids_reply(rid: int, out: Outcome) -> P.Ids:
    return P.Ids(id=rid, segment=out.segment.name, offset=HEADER_BYTES, count=out.count, seq=out.seq,
                 first_changed=out.first_changed, path=out.path, widenings=out.widenings, tokenizer=out.tokenizer)
