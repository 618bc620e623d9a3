"""Conversation ops in the sidecar: one handler per ``Conv*`` request, over ``toktier.Conversation``.

This module owns what the sidecar keeps per conversation (:class:`ConvSlot`), the server's
conversation bookkeeping (:class:`Conversations`: compiled templates, counts, the metrics
hook) and the handlers registered in :data:`toktier_sidecar.service.HANDLERS`.  The core
(``toktier.Conversation``, ``toktier.chat``) renders and tokenizes; nothing here does.

* **One store.**  Conversations live in the session store next to the sessions, under
  ``SessionKey(("conversation", namespace), id)``: the same per-peer namespaces, TTL,
  LRU memory budget (each is charged its measured size, :func:`conversation_nbytes`),
  ``max_sessions``, tombstones (a miss says why: ``closed``, ``ttl``, ``memory``...), but
  ids of their own: a session and a conversation may share an id, and a ``Close`` never
  ends a conversation (``ConvClose`` does).
* **Persisted like sessions.**  With ``--state-dir`` / ``--state-store`` a conversation's
  record (:mod:`toktier.conversation_record`: its settings, template source, messages and
  sampled runs, and its IDs' count and CRC-32; not its text or IDs) is written behind on the
  sessions' schedule (:class:`ConvSnapshot`), removed when it ends (on any end in the
  directory, on ``ConvClose`` in a shared store) and kept at shutdown.  After a restart (or on
  another node sharing the store) the conversation's first op restores it (:meth:`Conversations.restore`):
  a replay, i.e. one render and encode of the whole conversation (a session start's cost, not
  a repair's), whose IDs must equal the recorded count and CRC or the record is a miss.  The
  directory's conversation records are restored at start like its sessions' (the server's
  preload, in the background, within the memory budget), so that first op usually finds it
  replayed already.  A record whose ``seq`` is behind the client's ``expect_seq`` is stale (a
  miss), as for sessions.
* **Shared memory.**  Each conversation owns a :class:`~toktier_sidecar.shm.SessionArena`.
  The core keeps its own ID array, so after each op the IDs from ``first_changed`` on are
  copied into the segment (O(changed tokens); the whole array only when the segment grows,
  amortized, or at a fork), then the header is published, exactly as for sessions: a
  client's view is valid until the next op.
* **Threads.**  As for sessions: ``plan`` on the loop thread (validate, look up, check
  ``expect_seq``, pin), the core op in ``work`` (on the loop when the conversation is small,
  else in the ``repair`` pool; opens and forks in ``bulk``), ``done``/``failed`` on the loop
  (unpin, re-charge the budget, reply).  Ops on one conversation run in its lane, in
  arrival order.  A re-sent op with the same ``op_key`` gets its first result again.
  Conversations probe their template's locality in the background (``probe_in_background``):
  the first op meeting a new message kind or tool list renders everything instead of waiting
  0.1-0.6 s for the probe.

Messages arrive as msgpack maps decoded by msgspec (``list[dict[str, Any]]``); here they are
checked to be JSON-able, as a chat template expects, and refused as ``bad_request`` naming
the offending field otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, NamedTuple, TypeVar, cast

import msgspec
import numpy as np

import toktier
from toktier import chat
from toktier.conversation_record import ConversationRecord, encode_conversation_record
from toktier.persist import ForeignRecord
from toktier.store import EndCause, SessionMiss
from toktier_client import protocol as P
from toktier_client.shm import HEADER_BYTES, RETIRED_SEQ

from .errors import BadRequest, ResourceExhausted, SessionConflict, TokenizerMismatch, TooLarge, code_for
from .service import SESSION_OVERHEAD_BYTES, Answer, Call, Handler, Plan, Sample, SessionKey, SessionService, \
    handles
from .shm import Segment, SessionArena
from .statedir import CONVERSATION_KIND, StaleRecord

if TYPE_CHECKING:
    from toktier.conversation import Conversation, ConversationState

log = logging.getLogger(__name__)

#: The first part of every conversation key's namespace (a list in JSON: never a session record's).
KIND = CONVERSATION_KIND
#: Compiled chat templates kept per server (LRU): registered ones and distinct caller sources.
MAX_TEMPLATES = 64
#: Deepest nesting of a message or template variable (tool schemas nest ~10 levels).
MAX_JSON_DEPTH = 64
#: Budget charge per message besides its text (dict, keys and small values as Python objects;
#: ~0.5 KB measured for a message with role, content and one tool call).
MESSAGE_OVERHEAD_BYTES = 512
#: Budget charge per token of one core ``Session``: its uint32 ID and its token-start offset.
TOKEN_BYTES = 8
#: Parameters of ``toktier.Conversation`` itself: never template variables.
RESERVED_KWARGS = frozenset({"tokenizer", "template", "match", "add_generation_prompt", "stop_texts", "full_path",
                             "track_drift", "incremental"})

_JSON_SCALARS = (str, int, float, bool, type(None))


def conversation_key(namespace: Hashable, conversation: str) -> SessionKey:
    return SessionKey((KIND, namespace), conversation)


def check_id(conversation: str, what: str = "conversation") -> str:
    """``conversation`` if its UTF-8 length is within ``MAX_SESSION_ID_BYTES``, else BadRequest."""
    n = len(conversation.encode("utf-8", "surrogatepass"))
    if n > P.MAX_SESSION_ID_BYTES:
        raise BadRequest(f"{what} id of {n} bytes is longer than {P.MAX_SESSION_ID_BYTES} bytes "
                         f"(starts {conversation[:32]!r})")
    return conversation


def json_problem(value: Any, where: str) -> str | None:
    """Why ``value`` is not JSON-able (naming the path below ``where``), or None.  Iterative, so
    a deep structure costs no Python recursion; deeper than ``MAX_JSON_DEPTH`` is refused."""
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, _JSON_SCALARS):
            continue
        if depth >= MAX_JSON_DEPTH:
            return f"{path} is nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(v, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(v))
        elif isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    return f"{path} has a {type(k).__name__} key {k!r}; keys must be strings"
                stack.append((item, f"{path}.{k}", depth + 1))
        else:
            return (f"{path} is {type(v).__name__}, which is not JSON-able (strings, numbers, booleans, null, "
                    "lists and string-keyed maps only)")
    return None


def check_messages(messages: list[dict[str, Any]], field: str = "messages") -> int:
    """Refuse messages a chat template cannot be given (BadRequest naming the field: `field` is
    the request's); returns their text size in code points (strings anywhere in them), which
    decides where the op runs."""
    chars = 0
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str):
            raise BadRequest(f"{field}[{i}].role must be a string, got {type(role).__name__}")
        problem = json_problem(m, f"{field}[{i}]")
        if problem is not None:
            raise BadRequest(problem)
        chars += _text_chars(m)
    return chars


def _text_chars(value: Any) -> int:
    n = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return n


class ConvOptions(NamedTuple):
    """What a conversation was opened with; a re-open must name the same (attach) or conflicts."""

    tokenizer_hash: str
    template: tuple[str, str]  # ("registered", tokenizer name) | ("name", name) | ("source", sha256)
    template_kwargs: bytes  # canonical msgpack (sorted keys)
    match: str
    add_generation_prompt: bool
    stop_texts: tuple[str, ...]
    track_drift: bool | str = True


@dataclass(frozen=True, slots=True)
class ConvOutcome:
    """What a conversation op produced, ready to become a ``ConvIds`` reply."""

    segment: Segment
    count: int
    seq: int
    first_changed: int
    first_changed_message: int
    drift: int | None
    chars: int
    messages: int
    tokenizer: str
    drift_tracked: bool = True


@dataclass(eq=False)
class ConvSlot:
    """One open conversation as the sidecar holds it (the store's value for its key)."""

    conv: "Conversation"
    arena: SessionArena
    tokenizer: toktier.FrozenTokenizer
    options: ConvOptions
    book: "Conversations"
    overhead: int = 0  # SESSION_OVERHEAD_BYTES and the id, as for sessions
    seq: int = 0
    published: Segment | None = None  # the segment clients were last told about
    # Kept by each op (in its worker) so the loop thread never joins the text or copies messages:
    messages: int = 0  # how many messages the conversation holds
    chars: int = 0  # its rendered text's length in code points
    nbytes: int = 0  # what it costs the memory budget (conversation_nbytes)
    resync: bool = False  # an op failed midway: the next publish copies every ID, not just the changed ones
    last_op_key: str = ""
    last_out: ConvOutcome | None = None

    def snapshot(self, key: SessionKey) -> "ConvSnapshot":
        """Loop thread, no op running on it: what its record is made of (O(messages) references
        and one copy of the IDs; encoded on the writer thread)."""
        conv = self.conv
        return ConvSnapshot(self.tokenizer, key.namespace[1], key.session, self.seq, self.last_op_key,
                            self.options.template, conv.state(), np.array(conv.ids, dtype=np.uint32))

    def ended(self, cause: EndCause) -> None:
        """The store ended it (close, TTL, memory, capacity, shutdown): views read as stale, the
        segment's name goes, the count drops (called through ``SessionService._ended``)."""
        if self.published is not None:
            _retire(self.published)
        self.arena.release()
        self.book.ended(cause)


class ConvSnapshot(NamedTuple):
    """A conversation's state for its record, taken on the loop thread (``ConvSlot.snapshot``)."""

    tok: toktier.FrozenTokenizer
    namespace: Hashable  # the peer's (the key's namespace without KIND)
    conversation: str
    seq: int
    op_key: str
    template_ref: tuple[str, str]
    state: "ConversationState"
    ids: np.ndarray

    @property
    def label(self) -> str:
        return f"conversation {self.conversation[:64]!r}"

    def encode(self) -> bytes:
        """Writer thread: the record's bytes."""
        rec = ConversationRecord.from_state(self.state, self.ids, self.tok, namespace=cast(Any, self.namespace),
                                            conversation=self.conversation, seq=self.seq, op_key=self.op_key,
                                            template_ref=self.template_ref)
        return encode_conversation_record(rec)


def conversation_nbytes(text_bytes: int, tokens: int, messages: int, runs: bool, segment: int, overhead: int) -> int:
    """What a conversation costs the memory budget, from what the core holds: a ``Session`` over
    the rendered text (its UTF-8 text, ``TOKEN_BYTES`` per token), a second one over the full
    render once sampled IDs are pinned (the drift reference), the text again as a ``str``,
    the messages (their text is about the rendered text's size, plus ``MESSAGE_OVERHEAD_BYTES``
    each as Python objects), the shared-memory segment (a copy of the IDs) and the slot's
    overhead.  Forks share frozen segments in the core; each is charged in full (conservative)."""
    # `text_bytes`: the rendered text as a str holds it (1, 2 or 4 bytes per code point), from
    # `ConversationResult.text_nbytes` in O(1): joining the text to measure it cost ~0.7 ms an op at 1M.
    session = text_bytes + TOKEN_BYTES * tokens
    return (2 if runs else 1) * session + 2 * text_bytes + MESSAGE_OVERHEAD_BYTES * messages + segment + overhead


class Conversations:
    """The conversation ops' state in one server (no process-wide state): compiled templates
    (LRU, ``MAX_TEMPLATES``; any thread), the live count and ends by cause (loop thread), and
    ``on_result``, set by the server to count each result in its metrics (any thread)."""

    def __init__(self) -> None:
        self._templates: OrderedDict[tuple[str, str], chat.Renderer] = OrderedDict()
        self._lock = threading.Lock()
        self.live = 0
        self.ended_by_cause: dict[str, int] = {c.value: 0 for c in EndCause}
        # (tokenizer name, op tag, drifted) after each applied op.
        self.on_result: Callable[[str, str, bool], None] = lambda tokenizer, op, drifted: None

    # ------------------------------------------------------------- templates
    @staticmethod
    def template_key(tok: toktier.FrozenTokenizer, template: str | None) -> tuple[str, str]:
        if template is None:
            return ("registered", tok.name)
        if template in chat.template_names():
            return ("name", template)
        n = len(template.encode("utf-8", "surrogatepass"))
        if n > P.MAX_TEMPLATE_BYTES:
            raise BadRequest(f"template of {n} bytes exceeds {P.MAX_TEMPLATE_BYTES} bytes")
        return ("source", hashlib.sha256(template.encode("utf-8", "surrogatepass")).hexdigest())

    def template(self, tok: toktier.FrozenTokenizer, template: str | None) -> chat.Renderer:
        """Any thread: the compiled template (``template_for`` reads and compiles a file: kept)."""
        key = self.template_key(tok, template)
        with self._lock:
            t = self._templates.get(key)
            if t is not None:
                self._templates.move_to_end(key)
                return t
        if key[0] == "source":
            assert template is not None
            t = chat.ChatTemplate(template, name="caller's template")
        else:
            t = chat.template_for(tok if key[0] == "registered" else key[1])
        with self._lock:
            self._templates[key] = t
            while len(self._templates) > MAX_TEMPLATES:
                self._templates.popitem(last=False)
        return t

    # ---------------------------------------------------------------- counts
    def added(self) -> None:
        self.live += 1

    def ended(self, cause: EndCause) -> None:
        self.live -= 1
        self.ended_by_cause[cause.value] += 1

    # --------------------------------------------------------------- options
    def options(self, tok: toktier.FrozenTokenizer, req: P.ConvOpen) -> ConvOptions:
        """Loop thread: validate the open's options (BadRequest naming the field)."""
        problem = json_problem(req.template_kwargs, "template_kwargs")
        if problem is not None:
            raise BadRequest(problem)
        if len(req.stop_texts) > 64 or any(not s or len(s) > 256 for s in req.stop_texts):
            raise BadRequest("stop_texts: at most 64 non-empty strings of at most 256 code points each")
        clash = RESERVED_KWARGS & set(req.template_kwargs)
        if clash:
            raise BadRequest(f"template_kwargs may not set {sorted(clash)}: they are ConvOpen's own fields")
        kwargs = msgspec.msgpack.encode(dict(sorted(req.template_kwargs.items())))
        return ConvOptions(tok.hash, self.template_key(tok, req.template), kwargs, req.match,
                           req.add_generation_prompt, tuple(req.stop_texts), req.track_drift)

    # ----------------------------------------------------------------- slots
    def begin(self, svc: SessionService, key: SessionKey, expect_seq: int) -> ConvSlot:
        """Loop thread: the open conversation (touched), its seq checked; not pinned yet."""
        slot = _get(svc, key)
        if expect_seq >= 0 and expect_seq != slot.seq:
            raise SessionConflict(f"conversation {key.session!r} is at seq {slot.seq}, not {expect_seq}")
        return slot

    def replayed(self, svc: SessionService, key: SessionKey, rid: int, op_key: str) -> Plan | None:
        """The answer to a re-sent op whose first send was applied (same ``op_key`` as the
        conversation's latest op): that op's result again.  None otherwise."""
        if not op_key:
            return None
        slot = cast("ConvSlot | None", svc.store.peek(key))
        if slot is None or slot.last_out is None or slot.last_op_key != op_key:
            return None
        _get(svc, key)  # touch
        return Plan.answer(conv_reply(rid, slot.last_out))

    def planned(self, svc: SessionService, key: SessionKey, slot: ConvSlot, op: str,
                apply: Callable[["Conversation"], Any], messages: Callable[[int], int], rid: int, op_key: str) -> Plan:
        """Pin ``slot`` and plan ``apply`` on its conversation: ``done`` unpins, re-charges the
        budget and answers ``ConvIds``; ``failed`` unpins, and ends the conversation after an
        unexpected error or a segment that could not grow (its state may be ahead of its
        segment)."""
        svc.store.pin(key)

        def work() -> ConvOutcome:
            res = apply(slot.conv)
            out = self.publish(slot, res.ids, res.first_changed, res.first_changed_message, res.drift,
                               messages(slot.messages), res.num_chars, res.text_nbytes)
            self.on_result(slot.tokenizer.name, op, res.drift is not None)
            return out

        def done(out: ConvOutcome) -> Answer:
            self.finish(svc, key, slot)
            slot.last_op_key, slot.last_out = op_key, out
            svc.changed(key)  # its record is written behind
            return self.answer(rid, slot, out)

        def failed(exc: BaseException) -> None:
            if code_for(exc) is None or isinstance(exc, ResourceExhausted):
                svc.store.unpin(key)
                svc.close(key)
            # The core checks before it changes anything, but a typed failure from deep inside (the
            # reference engine's) may leave its IDs ahead of the segment: publish all of them next.
            slot.resync = True
            self.finish(svc, key, slot)

        return Plan(work=work, done=done, failed=failed)

    def finish(self, svc: SessionService, key: SessionKey, slot: ConvSlot) -> None:
        """Loop thread: unpin and charge the conversation's new size (may evict others)."""
        if svc.store.peek(key) is slot:
            svc.store.unpin(key)
            svc.store.resize(key, slot.nbytes)
            svc.on_resized()  # sessions restored at start and not open yet give way, as for session ops

    def answer(self, rid: int, slot: ConvSlot, out: ConvOutcome) -> Answer:
        """The ``ConvIds`` answer; the shadow verifier may re-encode a result without drift
        (its IDs must then be the reference encoding of the rendered text)."""
        sample = None
        if not slot.conv.generated:  # text only: the IDs are the reference encoding of the text
            conv, tok = slot.conv, slot.tokenizer
            sample = lambda: Sample(tok.hash, conv.text, np.array(conv.ids, dtype=np.uint32),  # noqa: E731
                                    {"op": "conversation", "seq": out.seq})
        return Answer(conv_reply(rid, out), sample=sample, sample_chars=out.chars)

    def publish(self, slot: ConvSlot, ids: np.ndarray, first_changed: int, first_changed_message: int,
                drift: int | None, messages: int, chars: int, text_nbytes: int) -> ConvOutcome:
        """Any thread (the lane gives exclusivity): copy ``ids[first_changed:]`` into the
        conversation's segment (all of them into a new, bigger one when it must grow: amortized
        doubling), publish the header, and note the conversation's new size."""
        n = len(ids)
        seg = slot.arena.segment
        if seg is None or seg.capacity < n:
            grown = max(n, 2 * seg.capacity) if seg is not None else n
            slot.arena.allocate(grown)  # a fresh segment; the old name is unlinked at once
            seg = slot.arena.segment
            assert seg is not None
            seg.ids[:n] = ids
        else:
            start = 0 if slot.resync else min(max(first_changed, 0), n)
            seg.ids[start:n] = ids[start:]
        slot.resync = False
        slot.seq += 1
        seg.publish(slot.seq, n)
        if slot.published is not seg:
            if slot.published is not None:
                _retire(slot.published)  # clients still viewing it learn that it is stale
            slot.published = seg
        slot.messages, slot.chars = messages, chars
        slot.nbytes = conversation_nbytes(text_nbytes, n, messages, bool(slot.conv.generated), seg.nbytes,
                                          slot.overhead)
        return ConvOutcome(seg, n, slot.seq, first_changed, first_changed_message, drift, slot.chars, messages,
                           slot.tokenizer.hash, slot.conv.track_drift is True)

    def create(self, svc: SessionService, tok: toktier.FrozenTokenizer, opts: ConvOptions, req: P.ConvOpen,
               key: SessionKey) -> tuple[ConvSlot, ConvOutcome]:
        """Any thread: a new empty conversation in a fresh segment."""
        template = self.template(tok, req.template)
        conv = toktier.Conversation(tok, template, match=req.match, add_generation_prompt=req.add_generation_prompt,
                                    stop_texts=tuple(req.stop_texts), full_path=svc.full_path,
                                    track_drift=req.track_drift, probe_in_background=True, **req.template_kwargs)
        slot = ConvSlot(conv, svc.pool.session_arena(), tok, opts, self, overhead=_overhead(key))
        try:
            out = self.publish(slot, conv.ids, 0, 0, None, 0, conv.num_chars, conv.text_nbytes)
        except BaseException:
            slot.arena.release()
            raise
        return slot, out

    def fork(self, svc: SessionService, slot: ConvSlot, key: SessionKey) -> tuple[ConvSlot, ConvOutcome]:
        """Any thread: a copy of ``slot``'s conversation in a fresh segment."""
        conv = slot.conv.fork()
        new = ConvSlot(conv, svc.pool.session_arena(), slot.tokenizer, slot.options, self, overhead=_overhead(key))
        try:
            out = self.publish(new, conv.ids, 0, 0, _result_drift(conv), slot.messages, conv.num_chars,
                               conv.text_nbytes)
        except BaseException:
            new.arena.release()
            raise
        return new, out

    def add(self, svc: SessionService, key: SessionKey, slot: ConvSlot, *, restored: bool = False) -> None:
        """Loop thread: register a created (or restored) conversation (may evict others); a created
        one's record is written behind."""
        svc.store.add(key, slot, slot.nbytes)
        svc.on_resized()
        self.added()
        if not restored:
            svc.changed(key)

    def restore(self, svc: SessionService, rec: ConversationRecord, key: SessionKey, expect_seq: int) -> ConvSlot:
        """Any thread: the conversation of a record, replayed (``ConversationRecord.restore``: one
        render and encode of the whole conversation, its IDs checked against the record's).
        Raises ForeignRecord (another key, tokenizer or build), StaleRecord (behind the client's
        ``expect_seq``), as a session's restore does."""
        if key.namespace != (KIND, rec.namespace) or key.session != rec.conversation:
            raise ForeignRecord("record belongs to another conversation (renamed file, copied key or hash collision)")
        if expect_seq > rec.seq:
            raise StaleRecord(f"record of conversation {rec.conversation[:64]!r} is at seq {rec.seq}, "
                              f"the client at {expect_seq}")
        if _text_chars(rec.messages) > svc.config.max_session_chars:
            raise ForeignRecord("record's messages exceed this server's max_session_chars")
        tok = svc.record_tokenizer(rec.tokenizer_hash, rec.tokenizer_name, "all")
        ref = cast("tuple[str, str]", tuple(rec.template_ref))
        with self._lock:
            compiled = self._templates.get(ref)  # reused when it is the recorded template exactly
        conv = rec.restore(tok, template=compiled, full_path=svc.full_path, probe_in_background=True)
        kwargs = msgspec.msgpack.encode(dict(sorted(rec.render_kwargs.items())))
        opts = ConvOptions(tok.hash, ref, kwargs, rec.match, rec.add_generation_prompt, tuple(rec.stop_texts),
                           rec.track_drift)
        slot = ConvSlot(conv, svc.pool.session_arena(), tok, opts, self, overhead=_overhead(key))
        slot.seq = rec.seq - 1  # publish makes it the record's
        try:
            out = self.publish(slot, conv.ids, 0, 0, _result_drift(conv), conv.num_messages, conv.num_chars,
                               conv.text_nbytes)
        except BaseException:
            slot.arena.release()
            raise
        slot.last_op_key, slot.last_out = rec.op_key, out
        return slot


def _result_drift(conv: "Conversation") -> int | None:
    """The drift a result outside an op reports (a fork's, a restore's): computed only where every
    result has it; ``"on_read"`` leaves it to ``ConvDrift``."""
    return conv.drift if conv.track_drift is True else None


class ConversationMiss(SessionMiss):
    """A conversation that is not open (a ``session_miss`` on the wire, with its ``reason``)."""

    def __str__(self) -> str:
        cid = self.key[-1] if isinstance(self.key, tuple) and self.key else self.key
        if self.reason == "unknown":
            return f"conversation {cid!r} is not open"
        return f"conversation {cid!r} is not open (ended: {self.reason})"


def _get(svc: SessionService, key: SessionKey) -> ConvSlot:
    """Loop thread: the open conversation, touched; a miss says "conversation" and why."""
    try:
        return cast(ConvSlot, svc.store.get(key))
    except SessionMiss as exc:
        raise ConversationMiss(key, exc.reason) from None


def _overhead(key: SessionKey) -> int:
    return SESSION_OVERHEAD_BYTES + 2 * len(key.session.encode("utf-8", "surrogatepass"))


def _retire(seg: Segment) -> None:
    """Mark a segment its conversation has left, so views of it read as stale."""
    seg.publish(RETIRED_SEQ, int(seg.header["count"][0]))


def conv_reply(rid: int, out: ConvOutcome) -> P.ConvIds:
    return P.ConvIds(id=rid, segment=out.segment.name, offset=HEADER_BYTES, count=out.count, seq=out.seq,
                     first_changed=out.first_changed, tokenizer=out.tokenizer,
                     first_changed_message=out.first_changed_message, drift=out.drift, chars=out.chars,
                     messages=out.messages, drift_tracked=out.drift_tracked)


def _book(svc: SessionService) -> Conversations:
    return svc.conversations


def _slot_chars(svc: SessionService, key: Hashable | None) -> int:
    slot = svc.store.peek(key) if key is not None else None
    return slot.chars if isinstance(slot, ConvSlot) else 0


# ------------------------------------------------------------------ handlers
Q = TypeVar("Q", P.ConvOpen, P.ConvAppendMessages, P.ConvSetMessages, P.ConvAppendGenerated, P.ConvFork,
            P.ConvRollback, P.ConvDrift, P.ConvClose)
C = TypeVar("C", P.ConvAppendMessages, P.ConvSetMessages, P.ConvAppendGenerated, P.ConvRollback)


class _ConvOp(Handler[Q]):
    """A request on one conversation: ordered in its conversation's lane, keyed apart from sessions."""

    def lane(self, req: Q) -> str:
        return check_id(req.conversation)

    def key(self, namespace: Hashable, lane: str) -> SessionKey:
        return conversation_key(namespace, lane)


@handles(P.ConvOpen)
class ConvOpenHandler(_ConvOp[P.ConvOpen]):
    """Create an empty conversation, or attach to one opened with the same options."""

    pool = "bulk"

    def tokenizer(self, req: P.ConvOpen) -> tuple[str, P.Specials]:
        return req.tokenizer, "all"  # a template's special-token literals are special tokens

    def work_chars(self, svc: SessionService, key: Hashable | None, req: P.ConvOpen) -> int:
        # Always in a worker: the first open with a template reads and compiles it (milliseconds),
        # and opens are rare next to the ops they enable.
        return svc.config.inline_chars + 1

    def plan(self, svc: SessionService, call: Call, req: P.ConvOpen) -> Plan:
        key, tok = call.key, call.tok
        assert key is not None and tok is not None
        book = _book(svc)
        replay = book.replayed(svc, key, req.id, req.op_key)
        if replay is not None:
            return replay
        opts = book.options(tok, req)
        slot = cast("ConvSlot | None", svc.store.peek(key))
        if slot is not None:
            try:
                svc.store.get(key)  # touch; ends it if its TTL passed (then it is created afresh)
            except SessionMiss:
                slot = None
        if slot is not None:
            if req.create_only:
                raise SessionConflict(f"conversation {req.conversation!r} already exists; not overwriting it")
            if slot.options.tokenizer_hash != opts.tokenizer_hash:
                raise TokenizerMismatch(
                    f"conversation {req.conversation!r} is open with tokenizer {slot.tokenizer.name} "
                    f"({slot.tokenizer.hash[:12]}); close it before re-opening with {tok.name} ({tok.hash[:12]})")
            if slot.options != opts:
                raise SessionConflict(f"conversation {req.conversation!r} is open with another template, "
                                      "template_kwargs, match, add_generation_prompt, stop_texts or track_drift; "
                                      "close it first")
            return Plan.answer(conv_reply(req.id, _current(slot)))

        def created(res: tuple[ConvSlot, ConvOutcome]) -> Answer:
            new_slot, out = res
            if svc.store.peek(key) is not None:  # cannot happen in the lane; never leak a segment
                new_slot.arena.release()
                raise SessionConflict(f"conversation {req.conversation!r} was created meanwhile")
            new_slot.last_op_key, new_slot.last_out = req.op_key, out
            book.add(svc, key, new_slot)
            book.on_result(tok.name, self.tag, False)
            return book.answer(req.id, new_slot, out)

        return Plan(work=lambda: book.create(svc, tok, opts, req, key), done=created)


def _current(slot: ConvSlot) -> ConvOutcome:
    """The conversation's current state as an outcome (an attach changes nothing: first_changed 0,
    since the attaching client holds nothing)."""
    out = slot.last_out
    assert out is not None
    return ConvOutcome(out.segment, out.count, out.seq, 0, 0, out.drift, out.chars, out.messages, out.tokenizer,
                       out.drift_tracked)


class _ConvChange(_ConvOp[C]):
    """A change to an open conversation: validated, then applied by the core Conversation and
    published into the conversation's segment."""

    pool = "repair"

    def request_chars(self, req: C) -> int:
        """Code points the request itself brings (new message text, sampled IDs)."""
        return 0

    def check(self, svc: SessionService, slot: ConvSlot, req: C) -> Any:
        """Loop thread: validate ``req`` against the conversation; returns the core op's argument."""
        raise NotImplementedError

    def apply(self, conv: "Conversation", arg: Any) -> Any:
        raise NotImplementedError

    def messages_after(self, before: int, arg: Any) -> int:
        """How many messages the conversation holds after the op (it held ``before``)."""
        raise NotImplementedError

    def work_chars(self, svc: SessionService, key: Hashable | None, req: C) -> int:
        # Rendering may cover the whole conversation (a template that is not local is rendered
        # in full and diffed), so its size decides where the op runs, as an edit's tail does.
        return _slot_chars(svc, key) + self.request_chars(req)

    def plan(self, svc: SessionService, call: Call, req: C) -> Plan:
        key = call.key
        assert key is not None
        book = _book(svc)
        replay = book.replayed(svc, key, req.id, req.op_key)
        if replay is not None:
            return replay
        slot = book.begin(svc, key, req.expect_seq)
        arg = self.check(svc, slot, req)
        return book.planned(svc, key, slot, self.tag, lambda conv: self.apply(conv, arg),
                            lambda before: self.messages_after(before, arg), req.id, req.op_key)


class _MessagesChange(_ConvChange[C]):
    def request_chars(self, req: C) -> int:
        return _text_chars(req.messages)

    def new_chars(self, slot: ConvSlot, added: int) -> int:
        raise NotImplementedError

    def check(self, svc: SessionService, slot: ConvSlot, req: C) -> Any:
        added = check_messages(req.messages)
        limit = svc.config.max_session_chars
        new = self.new_chars(slot, added)
        if new > limit:  # the template's own text comes on top: checked before, not after, the op
            raise TooLarge(f"conversation text would be about {new} code points; the limit is {limit}")
        return req.messages


@handles(P.ConvAppendMessages)
class ConvAppendMessagesHandler(_MessagesChange[P.ConvAppendMessages]):
    def new_chars(self, slot: ConvSlot, added: int) -> int:
        return slot.chars + added

    def apply(self, conv: "Conversation", arg: Any) -> Any:
        return conv.append_messages(arg)

    def messages_after(self, before: int, arg: Any) -> int:
        return before + len(arg)


@handles(P.ConvSetMessages)
class ConvSetMessagesHandler(_MessagesChange[P.ConvSetMessages]):
    def new_chars(self, slot: ConvSlot, added: int) -> int:
        return added

    def apply(self, conv: "Conversation", arg: Any) -> Any:
        return conv.set_messages(arg)

    def messages_after(self, before: int, arg: Any) -> int:
        return len(arg)  # the kept prefix plus the rest of the new list


@handles(P.ConvAppendGenerated)
class ConvAppendGeneratedHandler(_ConvChange[P.ConvAppendGenerated]):
    def request_chars(self, req: P.ConvAppendGenerated) -> int:
        return len(req.ids) // 4 + _text_chars(req.then)

    def check(self, svc: SessionService, slot: ConvSlot, req: P.ConvAppendGenerated) -> Any:
        # The core checks the IDs against the vocabulary (InvalidTokenIds) before changing anything.
        n, rest = divmod(len(req.ids), 4)
        if rest:
            raise BadRequest(f"ids is {len(req.ids)} bytes: packed uint32 IDs are a multiple of 4 bytes")
        if n > P.MAX_GENERATED_IDS:
            raise BadRequest(f"ids holds {n} IDs; at most {P.MAX_GENERATED_IDS} per request")
        new = slot.chars + check_messages(req.then, "then")  # as append_messages checks its messages
        if req.then and new > svc.config.max_session_chars:
            raise TooLarge(f"conversation text would be about {new} code points; the limit is "
                           f"{svc.config.max_session_chars}")
        return np.frombuffer(req.ids, dtype="<u4").astype(np.uint32, copy=False), req.then

    def apply(self, conv: "Conversation", arg: Any) -> Any:
        ids, then = arg
        return conv.append_generated(ids, then=then)

    def messages_after(self, before: int, arg: Any) -> int:
        return before + 1 + len(arg[1])  # the generated turn (an assistant message), then the rest


@handles(P.ConvRollback)
class ConvRollbackHandler(_ConvChange[P.ConvRollback]):
    def check(self, svc: SessionService, slot: ConvSlot, req: P.ConvRollback) -> Any:
        return req.n_messages  # the core refuses a count out of range (InvalidConversationOp)

    def apply(self, conv: "Conversation", arg: Any) -> Any:
        return conv.rollback(arg)

    def messages_after(self, before: int, arg: Any) -> int:
        return arg


@handles(P.ConvFork)
class ConvForkHandler(_ConvOp[P.ConvFork]):
    """Copy a conversation to a new id (copy-on-write in the core; the IDs into a new segment)."""

    pool = "bulk"

    def work_chars(self, svc: SessionService, key: Hashable | None, req: P.ConvFork) -> int:
        return _slot_chars(svc, key)

    def plan(self, svc: SessionService, call: Call, req: P.ConvFork) -> Plan:
        key = call.key
        assert key is not None
        book = _book(svc)
        new_key = conversation_key(call.caller.namespace, check_id(req.new, "new conversation"))
        replay = book.replayed(svc, new_key, req.id, req.op_key)  # the fork's own result, re-sent
        if replay is not None:
            return replay
        slot = book.begin(svc, key, req.expect_seq)
        if new_key == key or svc.store.peek(new_key) is not None:
            raise SessionConflict(f"conversation {req.new!r} already exists; close it first or fork to a new id")
        svc.store.pin(key)

        def done(res: tuple[ConvSlot, ConvOutcome]) -> Answer:
            book.finish(svc, key, slot)
            new_slot, out = res
            if svc.store.peek(new_key) is not None:  # created through its own lane meanwhile
                new_slot.arena.release()
                raise SessionConflict(f"conversation {req.new!r} was created while forking")
            new_slot.last_op_key, new_slot.last_out = req.op_key, out
            svc.supersede(new_key)  # an earlier run's record of that id, never restored, is replaced
            book.add(svc, new_key, new_slot)
            book.on_result(slot.tokenizer.name, self.tag, out.drift is not None)
            return book.answer(req.id, new_slot, out)

        def failed(_exc: BaseException) -> None:
            book.finish(svc, key, slot)

        return Plan(work=lambda: book.fork(svc, slot, new_key), done=done, failed=failed)


@handles(P.ConvDrift)
class ConvDriftHandler(_ConvOp[P.ConvDrift]):
    """Read the drift (``toktier.Conversation.drift``).  With ``track_drift="on_read"`` that brings
    the drift reference up to date (renders and a repair: in the pool, the conversation pinned);
    the IDs, the seq and the record do not change.  A failure there changes nothing either (the
    core rebuilds the reference from its text), so only an unexpected error ends the
    conversation, as for the other ops."""

    pool = "repair"

    def work_chars(self, svc: SessionService, key: Hashable | None, req: P.ConvDrift) -> int:
        return _slot_chars(svc, key)

    def plan(self, svc: SessionService, call: Call, req: P.ConvDrift) -> Plan:
        key = call.key
        assert key is not None
        book = _book(svc)
        slot = book.begin(svc, key, req.expect_seq)
        svc.store.pin(key)
        seq = slot.seq  # (the lane runs nothing else on this conversation meanwhile)

        def done(drift: int | None) -> Answer:
            book.finish(svc, key, slot)
            return Answer(P.ConvDriftIs(id=req.id, drift=drift, seq=seq, drift_tracked=slot.conv.drift_tracked))

        def failed(exc: BaseException) -> None:
            if code_for(exc) is None or isinstance(exc, ResourceExhausted):
                svc.store.unpin(key)
                svc.close(key)
            book.finish(svc, key, slot)

        return Plan(work=lambda: slot.conv.drift, done=done, failed=failed)


@handles(P.ConvClose)
class ConvCloseHandler(_ConvOp[P.ConvClose]):
    """End the conversation and unlink its segment (answered on the loop)."""

    def plan(self, svc: SessionService, call: Call, req: P.ConvClose) -> Plan:
        assert call.key is not None
        existed = svc.close(call.key) or svc.forget(call.key)  # forget: a record not restored yet
        return Plan.answer(P.Closed(id=req.id, existed=existed))
