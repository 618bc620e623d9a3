"""Sans-IO session bookkeeping shared by the sync and asyncio clients.

A :class:`SessionState` builds request messages and runs each session op as a
flow (see :mod:`toktier_client.core`): it turns ``Ids`` replies into
:class:`~toktier_client.shm.Result` objects (re-mapping only when the sidecar
moved the session to another segment), tracks the session's ``seq`` so retried
ops cannot be applied twice, ends the previous result's lease so
``Result.valid`` is exact, and, when recovery is enabled, mirrors the session
text (:class:`TextMirror`) so a miss is answered by re-creating the session with
the full text.

Recovery never overwrites another writer's acknowledged ops:

* a *conflict* (the session's seq is not the one this client last saw: another
  writer changed it) is always raised, never answered by a re-open;
* a *miss* is answered by an ``Open(create_only=True)``: if another writer
  re-created the session meanwhile, that is a conflict, raised too;
* every op carries an ``op_key`` (this state's random writer token and a counter),
  so a request the client re-sends after a dropped connection, whose first send
  was applied, is answered with that op's result instead of a conflict.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass
from typing import Callable

from . import protocol as P
from .core import Flow, expect, result_from
from .errors import ProtocolError, SegmentGone, SessionClosed, SessionConflict, SessionMiss
from .shm import Lease, Mapping, Result


class TextMirror:
    """The session text as the sidecar holds it, grown in place: an op costs O(its own text)
    (amortized), not O(session text).

    The text is a list of chunks joined only when the whole text is needed (a re-open
    after a miss, ``Session.text``).  Each chunk is at least twice as long as the next,
    so there are O(log N) chunks; an append merges only the small chunks at the end
    (each code point is copied O(log N) times over the session's life, never once per
    op), and an edit rebuilds only the chunks from the one holding ``start`` on.

    >>> m = TextMirror("Hello")
    >>> m.append(" world"); m.edit(0, 5, "Goodbye"); m.append("!")
    >>> m.text(), len(m)
    ('Goodbye world!', 14)
    """

    __slots__ = ("_chunks", "_len")

    def __init__(self, text: str = "") -> None:
        self._chunks: list[str] = [text] if text else []
        self._len = len(text)

    def __len__(self) -> int:
        return self._len

    @property
    def chunks(self) -> tuple[str, ...]:
        """The chunks as stored (the same ``str`` objects: nothing is copied)."""
        return tuple(self._chunks)

    def text(self) -> str:
        """The whole text (joined once; the mirror keeps the joined string)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def append(self, text: str) -> None:
        if not text:
            return
        chunks = self._chunks
        chunks.append(text)
        while len(chunks) > 1 and len(chunks[-2]) < 2 * len(chunks[-1]):
            last = chunks.pop()
            chunks[-1] += last
        self._len += len(text)

    def edit(self, start: int, end: int, text: str) -> None:
        """Replace code points [start, end) (a range the sidecar accepted)."""
        chunks = self._chunks
        i, offset = len(chunks), self._len
        while i > 0 and offset > start:  # back to the chunk holding `start`
            i -= 1
            offset -= len(chunks[i])
        tail = "".join(chunks[i:])
        del chunks[i:]
        self._len = offset
        self.append(tail[: start - offset] + text + tail[end - offset :])

    def sync(self, text: str) -> None:
        self._chunks = [text] if text else []
        self._len = len(text)


# ------------------------------------------------------------------------ ops
class PendingOp:
    """A change as the caller asked for it: its request, and its effect on the mirror."""

    text: str

    def request(self, rid: int, session: str, expect_seq: int, tokenizer: str,
                op_key: str = "") -> P.Append | P.Edit | P.Sync:
        raise NotImplementedError

    def apply(self, mirror: TextMirror) -> None:
        raise NotImplementedError


@dataclass(slots=True)
class AppendOp(PendingOp):
    text: str

    def request(self, rid: int, session: str, expect_seq: int, tokenizer: str, op_key: str = "") -> P.Append:
        return P.Append(id=rid, session=session, text=self.text, expect_seq=expect_seq, tokenizer=tokenizer,
                        op_key=op_key)

    def apply(self, mirror: TextMirror) -> None:
        mirror.append(self.text)


@dataclass(slots=True)
class EditOp(PendingOp):
    start: int
    end: int
    text: str

    def request(self, rid: int, session: str, expect_seq: int, tokenizer: str, op_key: str = "") -> P.Edit:
        return P.Edit(id=rid, session=session, start=self.start, end=self.end, text=self.text,
                      expect_seq=expect_seq, tokenizer=tokenizer, op_key=op_key)

    def apply(self, mirror: TextMirror) -> None:
        mirror.edit(self.start, self.end, self.text)


@dataclass(slots=True)
class SyncOp(PendingOp):
    text: str

    def request(self, rid: int, session: str, expect_seq: int, tokenizer: str, op_key: str = "") -> P.Sync:
        return P.Sync(id=rid, session=session, text=self.text, expect_seq=expect_seq, tokenizer=tokenizer,
                      op_key=op_key)

    def apply(self, mirror: TextMirror) -> None:
        mirror.sync(self.text)


class SessionState:
    """Per-session client state; owns the session's current mapping and the latest result's lease."""

    def __init__(
        self,
        session_id: str,
        tokenizer: str,
        *,
        recover: bool,
        specials: P.Specials,
        window: int,
        bind_to_connection: bool,
        owner_uid: int | None = None,
    ) -> None:
        self.session_id = session_id
        self.tokenizer = tokenizer  # as the caller named it (name or hash)
        self.tokenizer_hash = ""  # learned from the first reply
        self.recover = recover
        self.specials = specials
        self.window = window
        self.bind_to_connection = bind_to_connection
        self.seq = -1  # unknown until the first reply
        self.mirror: TextMirror | None = TextMirror() if recover else None
        self.closed = False
        self.owner_uid = owner_uid  # the server's verified uid: every mapped segment must be its
        self._writer = secrets.token_hex(8)  # 64 random bits: op keys no other writer can guess
        self._op_numbers = itertools.count(1)
        self._mapping: Mapping | None = None
        self._lease: Lease | None = None

    @property
    def text(self) -> str | None:
        """The mirrored text (None without recovery)."""
        return None if self.mirror is None else self.mirror.text()

    # --------------------------------------------------------------------- flows
    def open(self, next_id: Callable[[], int], text: str) -> Flow[Result]:
        """Open (or re-attach to and sync) the session with ``text``."""
        reply = yield self.open_request(next_id(), text)
        return self._accept(reply, SyncOp(text))

    def op(self, next_id: Callable[[], int], op: PendingOp) -> Flow[Result]:
        """Apply ``op``; with recovery, answer a miss by re-creating the session with the full text.

        A conflict is raised, with or without recovery: another writer changed the session,
        and re-opening from this client's mirror would silently drop that writer's
        acknowledged ops.  The re-create is ``create_only``: if another writer re-created the
        session first, that is a conflict too."""
        try:
            reply = yield op.request(next_id(), self.session_id, self.seq, self.tokenizer_hash, self._op_key())
        except SessionConflict:
            self._end_lease()
            raise
        except SessionMiss:
            self._end_lease()  # the sidecar's session is not the state this client last saw
            if not self.recover:
                raise
            text = self.recovery_text(op)
            reply = yield self.open_request(next_id(), text, create_only=True)
            return self._accept(reply, SyncOp(text))
        return self._accept(reply, op)

    def close(self, next_id: Callable[[], int]) -> Flow[bool]:
        """Close the session in the sidecar; True if it existed."""
        self.closed = True
        self._mapping = None
        self._end_lease()
        reply = yield P.Close(id=next_id(), session=self.session_id)
        return expect(reply, P.Closed).existed

    # ------------------------------------------------------------------ requests
    def open_request(self, rid: int, text: str, *, create_only: bool = False) -> P.Open:
        return P.Open(
            id=rid,
            session=self.session_id,
            tokenizer=self.tokenizer_hash or self.tokenizer,
            text=text,
            specials=self.specials,
            window=self.window,
            bind_to_connection=self.bind_to_connection,
            create_only=create_only,
            op_key=self._op_key(),
        )

    def _op_key(self) -> str:
        """A key no other op (of any writer) carries: a re-sent request keeps its key."""
        return f"{self._writer}.{next(self._op_numbers)}"

    def recovery_text(self, op: PendingOp | None) -> str:
        """Full text to re-open with after a miss/conflict (only when ``recover`` is on): the
        mirror with ``op`` applied (the one place the whole text is built); the current mapping
        is dropped (the re-open may land in another segment)."""
        assert self.mirror is not None
        self._mapping = None
        if op is None:
            return self.mirror.text()
        scratch = TextMirror(self.mirror.text())
        op.apply(scratch)
        return scratch.text()

    # ------------------------------------------------------------------- replies
    def _accept(self, reply: P.Reply | None, op: PendingOp) -> Result:
        """Turn the ``Ids`` reply to ``op`` into a Result; the mirror, if kept, gets ``op``."""
        ids = expect(reply, P.Ids)
        if ids.handoff:
            raise ProtocolError("expected a session Ids reply, got a handoff")
        mapping = self._mapping
        if mapping is None or mapping.name != ids.segment:
            try:
                mapping = self._mapping = Mapping.open(ids.segment, self.owner_uid)
            except SegmentGone:
                # The op was applied, then the session ended (a close, TTL or eviction through
                # another connection) before we mapped its segment: no result exists to read.
                self._mapping = None
                self._end_lease()
                raise SessionClosed(f"session {self.session_id!r} ended before its result could be read "
                                    "(closed, expired or evicted meanwhile)", request_id=ids.id) from None
        self.seq = ids.seq
        self.tokenizer_hash = ids.tokenizer
        if self.mirror is not None:
            op.apply(self.mirror)
        self._end_lease()
        self._lease = Lease()
        return result_from(ids, mapping, self._lease)

    def _end_lease(self) -> None:
        if self._lease is not None:
            self._lease.end()
            self._lease = None


class SessionView:
    """Read-only properties shared by the sync and asyncio session classes."""

    _state: SessionState

    @property
    def id(self) -> str:
        return self._state.session_id

    @property
    def tokenizer_hash(self) -> str:
        return self._state.tokenizer_hash

    @property
    def text(self) -> str:
        """The mirrored session text (only with ``recover=True``)."""
        text = self._state.text
        if text is None:
            raise AttributeError("the session text is mirrored only with recover=True")
        return text
