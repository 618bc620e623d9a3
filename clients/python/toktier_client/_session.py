"""Sans-IO session bookkeeping shared by the sync and asyncio clients.

A :class:`SessionState` builds request messages, turns ``Ids`` replies into
:class:`~toktier_client.shm.Result` objects (re-mapping only when the sidecar
moved the session to a bigger segment), tracks the session's ``seq`` so retried
ops cannot be applied twice, and, when recovery is enabled, mirrors the session
text so a session miss can be answered by re-opening with the full text.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import protocol as P
from .errors import ProtocolError
from .shm import Mapping, Result


@dataclass(frozen=True, slots=True)
class PendingOp:
    """An op as the caller asked for it, kept to update the mirror after success."""

    kind: str  # "append" | "edit" | "sync"
    text: str
    start: int = 0
    end: int = 0

    def apply(self, old: str) -> str:
        """The session text after this op (the client-side mirror of the sidecar's splice)."""
        if self.kind == "append":
            return old + self.text
        if self.kind == "edit":
            return old[: self.start] + self.text + old[self.end :]
        return self.text


class SessionState:
    """Per-session client state; owns the session's current mapping."""

    def __init__(
        self,
        session_id: str,
        tokenizer: str,
        *,
        recover: bool,
        specials: str,
        window: int,
        bind_to_connection: bool,
    ) -> None:
        self.session_id = session_id
        self.tokenizer = tokenizer  # as the caller named it (name or hash)
        self.tokenizer_hash = ""  # learned from the first reply
        self.recover = recover
        self.specials = specials
        self.window = window
        self.bind_to_connection = bind_to_connection
        self.seq = -1  # unknown until the first reply
        self.text: str | None = "" if recover else None
        self.closed = False
        self._mapping: Mapping | None = None

    # ------------------------------------------------------------------ requests
    def open_request(self, rid: int, text: str) -> P.Open:
        return P.Open(
            id=rid,
            session=self.session_id,
            tokenizer=self.tokenizer_hash or self.tokenizer,
            text=text,
            specials=self.specials,
            window=self.window,
            bind_to_connection=self.bind_to_connection,
        )

    def op_request(self, rid: int, op: PendingOp) -> P.Append | P.Edit | P.Sync:
        common = dict(id=rid, session=self.session_id, expect_seq=self.seq, tokenizer=self.tokenizer_hash)
        if op.kind == "append":
            return P.Append(text=op.text, **common)
        if op.kind == "edit":
            return P.Edit(start=op.start, end=op.end, text=op.text, **common)
        return P.Sync(text=op.text, **common)

    def recovery_text(self, op: PendingOp | None) -> str:
        """Full text to re-open with after a miss/conflict (only when ``recover`` is on);
        the current mapping is dropped (the re-open may land in another segment)."""
        assert self.text is not None
        self._mapping = None
        return self.text if op is None else op.apply(self.text)

    def close_request(self, rid: int) -> P.Close:
        """Mark the session closed (its mapping dropped) and build the ``Close`` message."""
        self.closed = True
        self._mapping = None
        return P.Close(id=rid, session=self.session_id)

    # ------------------------------------------------------------------- replies
    def accept(self, reply: P.Ids, new_text: str | None) -> Result:
        """Turn an ``Ids`` reply into a Result; ``new_text`` updates the mirror."""
        if not isinstance(reply, P.Ids) or reply.handoff:
            raise ProtocolError(f"expected a session Ids reply, got {type(reply).__name__}")
        mapping = self._mapping
        if mapping is None or mapping.name != reply.segment:
            mapping = self._mapping = Mapping.open(reply.segment)
        self.seq = reply.seq
        self.tokenizer_hash = reply.tokenizer
        if self.text is not None and new_text is not None:
            self.text = new_text
        return result_from(reply, mapping)

    def accept_op(self, reply: P.Ids, op: PendingOp) -> Result:
        """`accept` for the reply to `op` (the mirror, if kept, gets the op applied)."""
        return self.accept(reply, op.apply(self.text) if self.text is not None else None)


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
        if self._state.text is None:
            raise AttributeError("the session text is mirrored only with recover=True")
        return self._state.text


def result_from(reply: P.Ids, mapping: Mapping) -> Result:
    return Result(
        ids=mapping.view(reply.offset, reply.count),
        first_changed=reply.first_changed,
        path=reply.path,
        widenings=reply.widenings,
        seq=reply.seq,
        tokenizer=reply.tokenizer,
        segment=reply.segment,
        _mapping=mapping,
    )
