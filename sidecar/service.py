"""How the sidecar serves each request, without any I/O: one handler table, session logic,
tokenizers, the session store, arenas.

:data:`HANDLERS` maps every request type to the one :class:`Handler` that serves
it; the server (:mod:`toktier_sidecar.server`) runs every request through one sequence
over this table.  A handler says:

* ``lane(req)``: the session id of a session op (ops on one session run in
  arrival order), or None;
* ``tokenizer(req)``: the (name, specials) to resolve first (the server loads a
  bundled one in a worker on first use), or None;
* ``pool`` and ``text_chars(req)``: work on more than ``inline_chars`` code
  points runs in that thread pool (``bulk``: whole-context work; ``repair``:
  changes to an open session), anything smaller on the event loop;
* ``plan(svc, call, req)`` (loop thread): validate (size, seq, tokenizer), pin
  the session, and split the request into a :class:`Plan`.

Cached stateless encodes (``Encode(cache=True)``) go through one :class:`toktier.PrefixCache`
per (namespace, tokenizer), created on the loop thread on first use and kept for the server's
life (each bounded by ``tokenizer_cache_l1_max_memory``); the cache locks itself, so encodes
run in the bulk pool like any other big request.  Namespaced as sessions are: a cache's
``layer`` and ``reused_chars`` would otherwise tell one peer what another peer sent.

With ``--state-dir`` or ``--state-store`` the service tells the server's
:class:`~toktier_sidecar.statedir.WriteBehind` of every change and end (``changed``/``_ended``;
records are written behind), copies a session's state for it (``state_snapshot``), and opens a
session from a restored record (``run_restore``: :func:`toktier.persist.restore_session`, no
encode); the server decides when (at start, or at the session's first op), and is told when the
open sessions' bytes grow (``on_resized``: sessions restored at start and not open yet give way).

Adding an op is one Struct in ``toktier_client.protocol`` and one handler here
(``@handles(P.Ping) class PingHandler``), plus one client method.  The conversation ops'
handlers live in :mod:`toktier_sidecar.conversations` (same table, same store: a handler's
``key`` puts conversations in a namespace of their own).

Split by thread, so the asyncio adapter can run the expensive middle anywhere:

* ``plan`` / ``begin_*`` (event-loop thread): validate, look up and pin the session.
* ``Plan.work`` (event loop for small ops, a worker thread for big ones): the core
  :class:`toktier.Session` op, which writes IDs straight into the session's
  shared-memory segment; then the segment header is published.
* ``Plan.done`` / ``Plan.failed`` (event-loop thread): unpin, account the new size
  (may evict others), build the reply.

The store is touched only from the loop thread; a session is touched only by the
one op its lane lets run.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Generic, Hashable, Literal, NamedTuple, Protocol, TypeVar, cast, get_args

import numpy as np

import toktier
from toktier.fullpath import encode_full
from toktier.persist import ForeignRecord, SessionRecord, restore_session
from toktier.store import EndCause, SessionStore
from toktier_client import protocol as P
from toktier_client.shm import HEADER_BYTES, RETIRED_SEQ

from .config import ServerConfig
from .errors import BadRequest, Overloaded, ResourceExhausted, SessionConflict, TokenizerMismatch, TooLarge, code_for
from .shm import ArenaPool, Segment, SessionArena
from .statedir import Record, Snapshot, StaleRecord, WriteBehind

log = logging.getLogger(__name__)

SPECIALS: tuple[P.Specials, ...] = get_args(P.Specials)
#: Largest repair window a client may ask for (bytes); larger is just a full encode.
MAX_WINDOW = 1 << 20
#: What a session costs the memory budget besides its IDs and text: its slot, store and lane
#: entries (measured at ~0.5 KB) plus its id twice (store key, then tombstone), so many
#: sessions with long ids are bounded like any other memory.
SESSION_OVERHEAD_BYTES = 512

#: The two thread pools (see :mod:`toktier_sidecar.server`).
Pool = Literal["bulk", "repair"]


class SessionKey(NamedTuple):
    """A session as the store knows it: the caller's namespace (peer uid, or shared) and its id."""

    namespace: Hashable
    session: str


@dataclass
class Slot:
    """One open session as the sidecar holds it."""

    session: toktier.Session
    arena: SessionArena
    tokenizer: toktier.FrozenTokenizer
    seq: int = 0
    bound_to: int | None = None  # connection id when bind_to_connection
    published: Segment | None = None  # the segment clients were last told about
    overhead: int = 0  # bytes charged to the budget besides the session's own (SESSION_OVERHEAD_BYTES)
    last_op_key: str = ""  # op_key of the op that produced the current state ("" for none)
    last_out: "Outcome | None" = None  # that op's outcome: a re-sent op with the same key gets it again


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


class CachedEncode(NamedTuple):
    """A cached encode's result: its IDs in a handoff segment and what the cache reused."""

    segment: Segment
    layer: P.CacheLayer
    reused_chars: int
    first_changed: int


class Sample(NamedTuple):
    """A served result the shadow verifier may re-check (built only for sampled results)."""

    tokenizer_hash: str
    text: str
    ids: np.ndarray
    context: dict


@dataclass(frozen=True, slots=True)
class Answer:
    """What a finished request sends: ``reply`` (None: nothing, e.g. a one-way request or a
    caller that left), the repair ``path`` of a session result (metrics), and the result the
    shadow verifier may sample."""

    reply: P.Reply | None = None
    path: str | None = None
    sample: Callable[[], Sample | None] | None = None
    sample_chars: int | None = None  # the sample's size in code points (the verifier's budget)


def _nothing(_exc: BaseException) -> None:
    return None


def _no_work() -> None:
    return None


@dataclass(frozen=True)
class Plan:
    """One request, split by thread.  ``Handler.plan`` has already done the loop-thread checks
    (and pinned the session); ``work()`` runs anywhere; then exactly one of ``done(result)``
    (returns the :class:`Answer`) or ``failed(exc)`` runs on the loop thread."""

    work: Callable[[], object]
    done: Callable[[Any], Answer]
    failed: Callable[[BaseException], None] = _nothing

    @classmethod
    def answer(cls, reply: P.Reply | None) -> "Plan":
        """A request fully answered by ``plan`` itself: nothing left to run."""
        answer = Answer(reply)
        return cls(work=_no_work, done=lambda _result: answer)


class Caller(Protocol):
    """The connection a request came from, as handlers see it (the server's peer)."""

    cid: int
    namespace: Hashable  # whose sessions and caches it sees (peer uid, or shared)
    alive: bool
    handoffs: dict[str, Segment]  # stateless results not yet Released
    pending_handoffs: int  # stateless encodes admitted and not answered yet (count toward the limit)
    bound: set[Hashable]  # sessions that end with this connection


@dataclass(frozen=True, slots=True)
class Call:
    """One request being served: its caller, its session key (session ops) and its resolved
    tokenizer (handlers that name one)."""

    caller: Caller
    key: SessionKey | None = None
    tok: toktier.FrozenTokenizer | None = None


R = TypeVar("R")


class Handler(Generic[R]):
    """How the sidecar serves one request type (see the module docstring)."""

    #: Thread pool for work bigger than ``inline_chars``; None: always on the event loop.
    pool: ClassVar[Pool | None] = None
    tag: str = ""  # the wire tag, also the metric label (set by @handles)
    one_way: bool = False  # no reply, ever (set by @handles from the Struct)

    def lane(self, req: R) -> str | None:
        """The session id whose lane orders this request, or None (not a session op)."""
        return None

    def tokenizer(self, req: R) -> tuple[str, P.Specials] | None:
        """The tokenizer (name or hash, specials) to resolve before ``plan``, or None."""
        return None

    def text_chars(self, req: R) -> int:
        """Code points the work tokenizes: decides between the event loop and ``pool``."""
        return 0

    def work_chars(self, svc: "SessionService", key: Hashable | None, req: R) -> int:
        """Code points the work touches, which decides between the event loop and ``pool``:
        ``text_chars`` unless the session's own state adds to it (an edit moves the text after it)."""
        return self.text_chars(req)

    def key(self, namespace: Hashable, lane: str) -> "SessionKey":
        """The store and lane key of ``lane`` (what ``lane(req)`` returned) in the caller's
        ``namespace``; conversations key theirs apart (:mod:`toktier_sidecar.conversations`)."""
        return SessionKey(namespace, lane)

    def plan(self, svc: "SessionService", call: Call, req: R) -> Plan:
        raise NotImplementedError


#: The dispatch table: request type -> its handler.  Filled by :func:`handles`.
HANDLERS: dict[type, Handler[Any]] = {}

H = TypeVar("H", bound=type)


def handles(request_type: type[P.Request]) -> Callable[[H], H]:
    """Class decorator: register the handler class for ``request_type`` (one per type)."""

    def register(cls: H) -> H:
        if request_type in HANDLERS:
            raise TypeError(f"{request_type.__name__} already has a handler")
        handler = cls()
        handler.tag = request_type.__struct_config__.tag
        handler.one_way = request_type.one_way
        HANDLERS[request_type] = handler
        return cls

    return register


@dataclass(frozen=True, slots=True)
class ServerCounts:
    """Numbers only the server knows, for ``Stats`` replies."""

    connections: int = 0
    inflight: int = 0  # requests being processed off the event loop
    verified: int = 0  # results re-checked by the shadow verifier
    mismatches: int = 0


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
        # One full path for every session: parallel CPU chunks, the GPU first when configured
        # and a driver is present (the router probes for one lazily, on the first big encode).
        gpu = None
        if config.gpu:
            from toktier.gpu.router import Router

            gpu = Router()
        self.full_path = toktier.FullPath(toktier.FullPathConfig(), gpu=gpu)
        # Set by the server when the shadow verifier may disable a tokenizer's fast path.
        self.fast_path_disabled: Callable[[str], bool] = lambda tokenizer_hash: False
        # Set by the server: runs on the loading thread after each tokenizer load (the
        # shadow verifier builds its private reference there, not mid-traffic).
        self.on_tokenizer_loaded: Callable[[toktier.FrozenTokenizer], None] = lambda tok: None
        # Set by the server: what only it knows, for Stats replies.
        self.server_counts: Callable[[], ServerCounts] = ServerCounts
        # Set by the server: Metrics.record_op, called on the op's thread after each applied session op.
        self.on_op: Callable[..., None] = lambda *args: None
        self._warned_unspliceable: set[str] = set()  # hashes already warned about (loads run on workers)
        self._warn_lock = threading.Lock()
        self.started = time.monotonic()
        # (namespace, tokenizer hash) -> its cache; added on the loop thread, read by scrapes.
        self._caches: dict[tuple[Hashable, str], toktier.PrefixCache] = {}
        self.default_tokenizer = ""
        self.configured: set[str] = set()  # names preloaded from the config: their variants may load
        # Set by the server with --state-dir/--state-store: told of every change and end (write-behind records).
        self.state: WriteBehind | None = None
        # Set by the server with a restore at start: called (loop thread) after the open sessions'
        # bytes grew, so that sessions restored at start and not open yet give the room back.
        self.on_resized: Callable[[], None] = lambda: None
        # ... and called (loop thread) when a new state takes over a key whose record may be held.
        self.on_superseded: Callable[[SessionKey], None] = lambda key: None
        # The conversation ops' state (templates, counts): defined with their handlers.
        from .conversations import Conversations

        self.conversations: Conversations = Conversations()

    # ------------------------------------------------------------- tokenizers
    def preload(self) -> None:
        """Load the configured tokenizers (blocking; call before serving)."""
        for i, name in enumerate(self.config.tokenizers):
            tok = self.registry.load(name)
            self._loaded(tok)
            self.configured.update((name, tok.name))
            if i == 0:
                self.default_tokenizer = tok.name
            log.info("tokenizer %s loaded (hash %s, family %s)", tok.name, tok.hash[:12], tok.family)

    def find_tokenizer(self, name: str, specials: P.Specials) -> toktier.FrozenTokenizer | None:
        """The served tokenizer for ``name`` (or hash); None if it must be loaded first.
        Raises UnknownTokenizer when it can never be served."""
        if specials not in SPECIALS:
            raise BadRequest(f"specials must be one of {SPECIALS}, not {specials!r}")
        name = name or self.default_tokenizer
        try:
            return self.registry.get(name, specials)
        except toktier.UnknownTokenizer:
            # Loads cost seconds and up to a GB: only a configured tokenizer's other specials
            # variant, or any bundled one when lazy loading is enabled.
            if name in self.bundled and (self.config.lazy_load or name in self.configured):
                return None
            served = sorted(self.configured | (self.bundled if self.config.lazy_load else set()))
            raise toktier.UnknownTokenizer(
                f"tokenizer {name!r} is not served; served: {', '.join(served)}"
            ) from None

    def load_tokenizer(self, name: str, specials: P.Specials) -> toktier.FrozenTokenizer:
        """Load a bundled tokenizer (slow: run in a worker)."""
        tok = self.registry.load(name, specials=specials)
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
    def planned(self, key: SessionKey, slot: Slot, work: Callable[[], Outcome], rid: int, op_key: str = "") -> Plan:
        """The plan of an op on the pinned ``slot``: ``done`` unpins and answers ``Ids``;
        ``failed`` unpins, and ends the session after an unexpected error (it may be half-updated)
        or when its segment could not grow (no shared memory: it cannot take the op)."""

        def done(out: Outcome) -> Answer:
            self.finish(key, slot)
            slot.last_op_key, slot.last_out = op_key, out
            self.changed(key)
            return self.answer(key, rid, out)

        def failed(exc: BaseException) -> None:
            if code_for(exc) is None or isinstance(exc, ResourceExhausted):
                self.store.unpin(key)
                self.close(key)  # unlinks its segment: the memory goes back to the others
            self.finish(key, slot)

        return Plan(work=work, done=done, failed=failed)

    def answer(self, key: SessionKey, rid: int, out: Outcome) -> Answer:
        """The ``Ids`` answer of a session op; the verifier may sample the session's state."""
        slot = self.store.peek(key)
        chars = slot.session.num_chars if slot is not None else None
        return Answer(ids_reply(rid, out), path=out.path, sample=lambda: self.sample(key), sample_chars=chars)

    def replayed(self, key: SessionKey, req: P.Open | P.Append | P.Edit | P.Sync) -> Plan | None:
        """The answer to a re-sent op whose first send was applied (the session's latest op carried
        the same ``op_key``): that op's result again, instead of a conflict.  None otherwise."""
        if not req.op_key:
            return None
        slot = self.store.peek(key)
        if slot is None or slot.last_out is None or slot.last_op_key != req.op_key:
            return None
        self.store.get(key)  # touch
        return Plan.answer(ids_reply(req.id, slot.last_out))

    def sample(self, key: SessionKey) -> Sample | None:
        """The session's current text and IDs, for the shadow verifier (O(N): sampled results only)."""
        slot = self.store.peek(key)
        if slot is None:
            return None
        return Sample(slot.tokenizer.hash, slot.session.text, slot.session.ids,
                      {"session": str(key.session)[:64], "seq": slot.seq})

    def begin_op(self, key: SessionKey, req: P.Append | P.Edit | P.Sync,
                 new_chars: Callable[[toktier.Session], int]) -> Slot:
        """Loop thread: look up, check tokenizer, seq and the size ``new_chars`` gives, pin."""
        slot = self.store.get(key)
        if req.tokenizer and req.tokenizer not in (slot.tokenizer.hash, slot.tokenizer.name):
            raise TokenizerMismatch(
                f"session {req.session!r} uses tokenizer {slot.tokenizer.name} ({slot.tokenizer.hash[:12]}), "
                f"not {req.tokenizer[:64]!r}"
            )
        if req.expect_seq >= 0 and req.expect_seq != slot.seq:
            raise SessionConflict(f"session {req.session!r} is at seq {slot.seq}, not {req.expect_seq}")
        new = new_chars(slot.session)
        if new > self.config.max_session_chars:
            raise TooLarge(f"session text would be {new} code points; the limit is {self.config.max_session_chars}")
        self.store.pin(key)
        return slot

    def run_op(self, slot: Slot, apply: Callable[[toktier.Session], toktier.OpResult]) -> Outcome:
        """Any thread (the lane guarantees exclusivity): apply the op, publish the segment."""
        s = slot.session
        s.fast_path = not self.fast_path_disabled(slot.tokenizer.hash)
        retokenized = s.stats.tokens_retokenized
        r = apply(s)
        out = self._publish(slot, r)
        self.on_op(slot.tokenizer.name, r.path.value, len(r.ids), s.stats.tokens_retokenized - retokenized,
                   s.num_bytes, r.widenings, r.reason)
        return out

    def begin_open(self, key: SessionKey, req: P.Open, tok: toktier.FrozenTokenizer) -> Slot | None:
        """Loop thread: the existing slot to sync (pinned), or None to create one."""
        if len(req.text) > self.config.max_session_chars:
            raise TooLarge(f"text of {len(req.text)} code points exceeds the limit of {self.config.max_session_chars}")
        if req.window and not 16 <= req.window <= MAX_WINDOW:
            raise BadRequest(f"window must be 0 (default) or in [16, {MAX_WINDOW}], not {req.window}")
        slot = self.store.peek(key)
        if slot is None:
            return None
        if req.create_only:  # a recovery re-create: never sync over what another writer rebuilt
            raise SessionConflict(
                f"session {req.session!r} already exists (another writer re-created it after it was lost); "
                "not overwriting it: open it again explicitly to take it over, or close it first")
        if slot.tokenizer.hash != tok.hash:
            raise TokenizerMismatch(
                f"session {req.session!r} is open with tokenizer {slot.tokenizer.name} ({slot.tokenizer.hash[:12]}); "
                f"close it before re-opening with {tok.name} ({tok.hash[:12]})"
            )
        self.store.get(key)  # touch
        self.store.pin(key)
        return slot

    def run_create(self, tok: toktier.FrozenTokenizer, req: P.Open) -> tuple[Slot, Outcome]:
        """Any thread: build a new session whose IDs live in a fresh segment."""
        arena = self.pool.session_arena()
        try:
            session = toktier.Session(tok, req.text, window=req.window or self.config.window or None,
                                      allocator=arena.allocate, full_path=self.full_path)
            slot = Slot(session, arena, tok)
            if req.text:
                path, first_changed = toktier.RepairPath.FULL.value, 0
            else:
                path, first_changed = toktier.RepairPath.NOOP.value, 0
            slot.seq = 1
            seg = self._ids_segment(slot, session.ids, 0)
            seg.publish(slot.seq, session.num_tokens)
            slot.published = seg
            self.on_op(tok.name, path, session.num_tokens, session.num_tokens, session.num_bytes)
            return slot, Outcome(seg, session.num_tokens, slot.seq, first_changed, path, 0, tok.hash)
        except BaseException:
            arena.release()
            raise

    def add(self, key: SessionKey, slot: Slot) -> None:
        """Loop thread: register a created session (may evict others)."""
        slot.overhead = session_overhead(key)
        self.store.add(key, slot, slot.session.nbytes + slot.overhead)
        self.on_resized()

    # ------------------------------------------------------ state that outlives the process
    def changed(self, key: SessionKey) -> None:
        """Loop thread: an op changed the session (its record is written behind)."""
        if self.state is not None:
            self.state.changed(key)

    def supersede(self, key: SessionKey) -> None:
        """Loop thread: a new state takes ``key`` over (see ``WriteBehind.supersede``); one restored
        at start from the old record and still held is released."""
        if self.state is not None:
            self.state.supersede(key)
            self.on_superseded(key)

    def forget(self, key: SessionKey) -> bool:
        """Loop thread: drop the record of a session not open here (a Close after a restart);
        True if there was one."""
        return self.state is not None and self.state.forget(key)

    def state_snapshot(self, key: SessionKey) -> Record | None:
        """Loop thread, no op running on the session: a copy of its state to write (O(N)
        memcpy); None when it is gone or bound to its connection (it ends with it anyway).
        A conversation's is its own (``ConvSlot.snapshot``)."""
        slot = self.store.peek(key)
        if slot is None:
            return None
        if not isinstance(slot, Slot):  # a conversation (toktier_sidecar.conversations.ConvSlot)
            return slot.snapshot(key)
        if slot.bound_to is not None:
            return None
        s = slot.session
        return Snapshot(slot.tokenizer, key.namespace, key.session, slot.seq, s.window, s.text, s.ids.copy(),
                        slot.last_op_key)

    def run_restore(self, rec: SessionRecord, expect_seq: int) -> Slot:
        """Any thread: a slot over a record's state, verified without an encode
        (:func:`toktier.persist.restore_session`: O(N) checks).  Raises StaleRecord when the caller has seen a later ``seq`` (the record
        missed ops a crash lost: a miss, so the caller re-sends its text; an earlier ``seq`` is
        the op's conflict to raise, as without a restart), ForeignRecord / UnknownTokenizer /
        InvalidState when unusable."""
        if expect_seq > rec.seq:
            raise StaleRecord(f"record of session {rec.session[:64]!r} is at seq {rec.seq}, the client at {expect_seq}")
        if len(rec.text) > 4 * self.config.max_session_chars:
            raise ForeignRecord("record text exceeds this server's max_session_chars")
        tok = self.record_tokenizer(rec.tokenizer_hash, rec.tokenizer_name, cast(P.Specials, rec.specials))
        arena = self.pool.session_arena()
        try:
            session = restore_session(tok, rec, window=rec.window or None, allocator=arena.allocate,
                                      full_path=self.full_path)
            slot = Slot(session, arena, tok, seq=rec.seq)
            seg = self._ids_segment(slot, session.ids, 0)
            seg.publish(slot.seq, session.num_tokens)
            slot.published = seg
            if rec.op_key:  # a re-send of the recorded op gets its state again, reported conservatively
                slot.last_op_key = rec.op_key
                slot.last_out = Outcome(seg, session.num_tokens, slot.seq, 0, toktier.RepairPath.FULL.value, 0,
                                        tok.hash)
            return slot
        except BaseException:
            arena.release()
            raise

    def record_tokenizer(self, tok_hash: str, name: str, specials: P.Specials) -> toktier.FrozenTokenizer:
        """Any thread: the tokenizer a record names, loaded by name if it is not served yet (the
        caller checks the hash: a bundled file that changed since is another tokenizer)."""
        try:
            return self.registry.get(tok_hash)
        except toktier.UnknownTokenizer:
            tok = self.find_tokenizer(name, specials)
            return tok if tok is not None else self.load_tokenizer(name, specials)

    def bind(self, key: SessionKey, caller: Caller) -> None:
        """Loop thread: the session ends when ``caller``'s connection does."""
        slot = self.store.peek(key)
        if slot is not None:
            slot.bound_to = caller.cid
            caller.bound.add(key)

    def finish(self, key: SessionKey, slot: Slot) -> None:
        """Loop thread: unpin and account the session's new size."""
        if self.store.peek(key) is slot:
            self.store.unpin(key)
            self.store.resize(key, slot.session.nbytes + slot.overhead)
            self.on_resized()

    def close(self, key: Hashable) -> bool:
        return self.store.close(key)

    def _publish(self, slot: Slot, r: toktier.OpResult) -> Outcome:
        slot.seq += 1
        seg = self._ids_segment(slot, r.ids, r.first_changed)
        seg.publish(slot.seq, len(r.ids))
        if slot.published is not seg:  # the session moved to a bigger segment
            if slot.published is not None:
                _retire(slot.published)
            slot.published = seg
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

    def prefix_cache(self, namespace: Hashable, tok: toktier.FrozenTokenizer) -> toktier.PrefixCache | None:
        """Loop thread: the cache for ``tok`` in ``namespace`` (created on first use), or None
        when cached encodes are answered plainly: both layers off, or the shadow verifier has
        put the tokenizer on the full path (a repair would splice)."""
        cfg = self.config
        if not cfg.tokenizer_cache_enabled or self.fast_path_disabled(tok.hash):
            return None
        key = (namespace, tok.hash)
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = toktier.PrefixCache(
                tok, l0_max_entries=cfg.tokenizer_cache_l0_max_entries,
                l1_max_bytes=cfg.tokenizer_cache_l1_max_memory, enable_l0=cfg.tokenizer_cache_enable_l0,
                enable_l1=cfg.tokenizer_cache_enable_l1, window=cfg.window or None, full_path=self.full_path)
        return cache

    def run_cached_encode(self, cache: toktier.PrefixCache, text: str) -> CachedEncode:
        """Any thread: ``cache.encode(text)`` (exact: the reference's IDs) into a handoff segment."""
        if len(text) > self.config.max_session_chars:
            raise TooLarge(f"text of {len(text)} code points exceeds the limit of {self.config.max_session_chars}")
        r = cache.encode(text)
        return CachedEncode(self.pool.handoff(r.ids), r.layer, r.reused_chars, r.first_changed)

    def caches(self) -> list[tuple[tuple[Hashable, str], toktier.PrefixCache]]:
        """Loop thread: ((namespace, tokenizer hash), cache) of every cache (the state dir writes them)."""
        return list(self._caches.items())

    def cache_stats(self) -> list[tuple[str, toktier.PrefixCacheStats]]:
        """Any thread (metrics scrapes): (tokenizer name, stats) of every cache."""
        return [(cache.tokenizer.name, cache.stats()) for cache in list(self._caches.values())]

    # ------------------------------------------------------------------- misc
    def stats(self, rid: int) -> P.StatsReply:
        st = self.store.stats()
        c = self.server_counts()
        conversations = self.conversations.live  # in the same store: ``sessions`` counts the others
        return P.StatsReply(
            id=rid, sessions=st.live - conversations, bytes_held=st.bytes_held, shm_bytes=self.pool.live_bytes,
            shm_segments=self.pool.live_segments, opened=st.opened, closed=st.ended.get("closed", 0),
            misses=st.misses, evictions=st.evictions, connections=c.connections,
            uptime_s=time.monotonic() - self.started, inflight=c.inflight, verified=c.verified,
            mismatches=c.mismatches, conversations=conversations,
        )

    def snapshot(self, connections: int) -> dict:
        st = self.store.stats()
        fp = self.full_path.stats()
        conv = self.conversations
        return dict(sessions=st.live - conv.live, conversations=conv.live,
                    conversations_ended=dict(conv.ended_by_cause), bytes_held=st.bytes_held,
                    shm_bytes=self.pool.live_bytes, shm_segments=self.pool.live_segments, connections=connections,
                    ended=st.ended, opened=st.opened, misses=st.misses,
                    full_path={"gpu": fp.gpu, "cpu_chunked": fp.chunked,
                               "cpu_single": fp.encodes - fp.gpu - fp.chunked},
                    full_path_chars=fp.chars)

    def tokenizer_list(self, rid: int) -> P.TokenizerList:
        loaded = [P.TokenizerInfo(name=t.name, hash=t.hash, family=t.family or "", specials=t.specials)
                  for t in self.registry]
        available = sorted(set(self.registry.names()) | (self.bundled if self.config.lazy_load else set()))
        return P.TokenizerList(id=rid, available=available, loaded=loaded, default=self.default_tokenizer)

    def shutdown(self) -> None:
        self.store.clear(EndCause.SHUTDOWN)
        self.pool.unlink_all()

    def _ended(self, key: Hashable, slot: Slot, cause: EndCause) -> None:
        if not isinstance(slot, Slot):  # a conversation: its own bookkeeping, then its record as a session's
            slot.ended(cause)
        else:
            if slot.published is not None:  # clients still viewing it learn that it is stale
                _retire(slot.published)
            slot.arena.release()
        if self.state is not None and cause is not EndCause.SHUTDOWN:  # shutdown keeps records for the next run
            self.state.ended(cast(SessionKey, key), closed=cause is EndCause.CLOSED)
        if cause is not EndCause.CLOSED:
            log.debug("session %r ended: %s", key, cause.value)


def session_overhead(key: SessionKey) -> int:
    """What ``key``'s session costs the memory budget besides its own bytes (``SESSION_OVERHEAD_BYTES``)."""
    return SESSION_OVERHEAD_BYTES + 2 * len(key.session.encode("utf-8", "surrogatepass"))


def ids_reply(rid: int, out: Outcome) -> P.Ids:
    return P.Ids(id=rid, segment=out.segment.name, offset=HEADER_BYTES, count=out.count, seq=out.seq,
                 first_changed=out.first_changed, path=cast(P.RepairPathName, out.path), widenings=out.widenings,
                 tokenizer=out.tokenizer)


def _retire(seg: Segment) -> None:
    """Mark a segment its session has left, so views of it read as stale (``Result.valid``)."""
    seg.publish(RETIRED_SEQ, int(seg.header["count"][0]))


# ------------------------------------------------------------------ handlers
S = TypeVar("S", P.Open, P.Append, P.Edit, P.Sync, P.Close)
C = TypeVar("C", P.Append, P.Edit, P.Sync)


class _SessionOp(Handler[S]):
    """A request on one session: ordered in its session's lane."""

    def lane(self, req: S) -> str:
        return req.session


@handles(P.Open)
class OpenHandler(_SessionOp[P.Open]):
    """Create the session, or sync an existing one (same tokenizer) to ``text``: idempotent."""

    pool = "bulk"

    def tokenizer(self, req: P.Open) -> tuple[str, P.Specials]:
        return req.tokenizer, req.specials

    def text_chars(self, req: P.Open) -> int:
        return len(req.text)

    def plan(self, svc: SessionService, call: Call, req: P.Open) -> Plan:
        key, tok, caller = call.key, call.tok, call.caller
        assert key is not None and tok is not None
        replay = svc.replayed(key, req)
        if replay is not None:
            return replay
        if req.bind_to_connection and not caller.alive:
            return Plan.answer(None)  # its connection already ended: the session would end at once
        slot = svc.begin_open(key, req, tok)
        if slot is None:
            def created(res: tuple[Slot, Outcome]) -> Answer:
                new_slot, out = res
                new_slot.last_op_key, new_slot.last_out = req.op_key, out
                svc.add(key, new_slot)
                svc.changed(key)
                return svc.answer(key, req.id, out)
            plan = Plan(work=lambda: svc.run_create(tok, req), done=created)
        else:
            plan = svc.planned(key, slot, lambda: svc.run_op(slot, lambda s: s.sync(req.text)), req.id, req.op_key)
        if not req.bind_to_connection:
            return plan

        def bound(res: object) -> Answer:
            answer = plan.done(res)
            if not caller.alive:  # the connection ended while the Open ran: peer_gone missed it
                svc.close(key)
                return Answer()
            svc.bind(key, caller)
            return answer
        return dataclasses.replace(plan, done=bound)


class _Change(_SessionOp[C]):
    """A change to an open session: checked against its tokenizer, seq and size limit, then
    applied by the core Session in place (IDs written into the session's segment)."""

    pool = "repair"

    def text_chars(self, req: C) -> int:
        return len(req.text)

    def new_chars(self, session: toktier.Session, req: C) -> int:
        """The session's length in code points after ``req``."""
        raise NotImplementedError

    def apply(self, session: toktier.Session, req: C) -> toktier.OpResult:
        raise NotImplementedError

    def plan(self, svc: SessionService, call: Call, req: C) -> Plan:
        key = call.key
        assert key is not None
        replay = svc.replayed(key, req)
        if replay is not None:
            return replay
        slot = svc.begin_op(key, req, lambda s: self.new_chars(s, req))
        return svc.planned(key, slot, lambda: svc.run_op(slot, lambda s: self.apply(s, req)), req.id, req.op_key)


@handles(P.Append)
class AppendHandler(_Change[P.Append]):
    def new_chars(self, session: toktier.Session, req: P.Append) -> int:
        return session.num_chars + len(req.text)

    def apply(self, session: toktier.Session, req: P.Append) -> toktier.OpResult:
        return session.append(req.text)


@handles(P.Edit)
class EditHandler(_Change[P.Edit]):
    def new_chars(self, session: toktier.Session, req: P.Edit) -> int:
        removed = max(0, min(req.end, session.num_chars) - max(req.start, 0))
        return session.num_chars - removed + len(req.text)

    def apply(self, session: toktier.Session, req: P.Edit) -> toktier.OpResult:
        return session.edit(req.start, req.end, req.text)

    def work_chars(self, svc: SessionService, key: Hashable | None, req: P.Edit) -> int:
        # An edit moves the text, IDs and token offsets after it: ~12 ms for 10 characters into
        # the middle of a 12M-character session, too long for the event loop.
        slot = svc.store.peek(key) if key is not None else None
        tail = max(0, slot.session.num_chars - max(req.start, 0)) if slot is not None else 0
        return len(req.text) + tail


@handles(P.Sync)
class SyncHandler(_Change[P.Sync]):
    def new_chars(self, session: toktier.Session, req: P.Sync) -> int:
        return len(req.text)

    def apply(self, session: toktier.Session, req: P.Sync) -> toktier.OpResult:
        return session.sync(req.text)


@handles(P.Close)
class CloseHandler(_SessionOp[P.Close]):
    """End the session and unlink its segment (answered on the loop)."""

    def plan(self, svc: SessionService, call: Call, req: P.Close) -> Plan:
        assert call.key is not None
        existed = svc.close(call.key) or svc.forget(call.key)  # forget: a record not restored yet
        call.caller.bound.discard(call.key)
        return Plan.answer(P.Closed(id=req.id, existed=existed))


@handles(P.Encode)
class EncodeHandler(Handler[P.Encode]):
    """Stateless encode into a one-shot handoff segment the caller must ``Release``: a full
    encode, or with ``cache`` one through the caller's prefix cache for the tokenizer."""

    pool = "bulk"

    def tokenizer(self, req: P.Encode) -> tuple[str, P.Specials]:
        return req.tokenizer, req.specials

    def text_chars(self, req: P.Encode) -> int:
        return len(req.text)

    def plan(self, svc: SessionService, call: Call, req: P.Encode) -> Plan:
        tok, caller = call.tok, call.caller
        assert tok is not None
        limit = svc.config.max_handoffs
        held = len(caller.handoffs) + caller.pending_handoffs  # encodes in flight will hold one each
        if held >= limit:
            raise Overloaded(f"{held} encode results not released or still being encoded (limit {limit}); "
                             "send Release after mapping")
        cache = svc.prefix_cache(caller.namespace, tok) if req.cache else None
        caller.pending_handoffs += 1

        def done(res: Segment | CachedEncode) -> Answer:
            caller.pending_handoffs -= 1
            out = res if isinstance(res, CachedEncode) else CachedEncode(res, "off", 0, 0)
            seg = out.segment
            if not caller.alive:  # the caller left meanwhile: nobody will map or release it
                seg.unlink()
                return Answer()
            caller.handoffs[seg.name] = seg
            count = int(seg.header["count"][0])
            reply = P.Ids(id=req.id, segment=seg.name, offset=HEADER_BYTES, count=count, seq=0,
                          first_changed=out.first_changed, path="full", tokenizer=tok.hash, handoff=True,
                          layer=out.layer, reused_chars=out.reused_chars)
            context = {"op": "encode"} if out.layer == "off" else {"op": "encode", "layer": out.layer}
            return Answer(reply, sample=lambda: Sample(tok.hash, req.text, seg.ids[:count], context),
                          sample_chars=len(req.text))

        def failed(_exc: BaseException) -> None:
            caller.pending_handoffs -= 1

        if cache is not None:
            return Plan(work=lambda: svc.run_cached_encode(cache, req.text), done=done, failed=failed)
        return Plan(work=lambda: svc.run_encode(tok, req.text), done=done, failed=failed)


@handles(P.Release)
class ReleaseHandler(Handler[P.Release]):
    """The caller has mapped a handoff segment: unlink its name (no reply)."""

    def plan(self, svc: SessionService, call: Call, req: P.Release) -> Plan:
        seg = call.caller.handoffs.pop(req.segment, None)
        if seg is not None:
            seg.unlink()
        return Plan.answer(None)


@handles(P.Stats)
class StatsHandler(Handler[P.Stats]):
    def plan(self, svc: SessionService, call: Call, req: P.Stats) -> Plan:
        return Plan.answer(svc.stats(req.id))


@handles(P.ListTokenizers)
class ListTokenizersHandler(Handler[P.ListTokenizers]):
    def plan(self, svc: SessionService, call: Call, req: P.ListTokenizers) -> Plan:
        return Plan.answer(svc.tokenizer_list(req.id))


@handles(P.Ping)
class PingHandler(Handler[P.Ping]):
    """Liveness round trip: answered on the event loop, touching no session."""

    def plan(self, svc: SessionService, call: Call, req: P.Ping) -> Plan:
        return Plan.answer(P.Pong(id=req.id, monotonic=time.monotonic()))
