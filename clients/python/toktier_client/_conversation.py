"""Conversations on the client: sans-IO bookkeeping plus the sync and asyncio handles.

A conversation is ``toktier.Conversation`` kept in the sidecar: chat messages in, the exact
token IDs of their rendered text out, sampled IDs appended verbatim.  This module owns its
client side, shared by :class:`~toktier_client.Client` and :class:`~toktier_client.AsyncClient`:

* :class:`ConversationState` builds the ``Conv*`` requests and runs each op as a flow (see
  :mod:`toktier_client.core`): it turns ``ConvIds`` replies into :class:`ConversationResult`
  objects (zero-copy views, re-mapping only when the sidecar moved the conversation to
  another segment), sends its last seen ``seq`` and a fresh ``op_key`` with every change, so
  a request the client re-sends after a dropped connection is answered with its first
  result instead of being applied twice, and ends the previous result's lease so
  ``ConversationResult.valid`` is exact.
* :class:`ConversationHandle` (blocking) and :class:`AsyncConversationHandle` (asyncio) are
  thin: each method runs one flow through its client.

There is no recovery mirror (as ``Session(recover=True)`` has): a conversation the sidecar
lost (closed, TTL, memory) raises :class:`~toktier_client.errors.SessionMiss`; re-create it
with ``set_messages`` on a new handle.

>>> pack_ids([1, 2, 70000])
b'\\x01\\x00\\x00\\x00\\x02\\x00\\x00\\x00p\\x11\\x01\\x00'
>>> pack_ids([-1])
Traceback (most recent call last):
...
ValueError: token IDs must be in [0, 2**32): found -1 at index 0
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Mapping as MappingABC, Sequence
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

import numpy as np

from . import protocol as P
from .core import Flow, T, expect
from .errors import SegmentGone, SessionClosed, SessionConflict, SessionMiss
from .shm import Lease, Mapping

Messages = Sequence[MappingABC[str, Any]]
MakeRequest = Callable[[int, int, str], P.Request]  # (request id, expect_seq, op_key) -> request


@dataclass(frozen=True, slots=True)
class ConversationResult:
    """One conversation op's outcome.  ``ids`` is a zero-copy read-only ``uint32`` view of the
    conversation's shared-memory segment: valid until the next op on the conversation
    (``valid`` tells exactly); ``ids.copy()`` to keep it longer.

    ``first_changed``: the first token that differs from the previous state (keep the KV cache
    for ``ids[:first_changed]``); ``first_changed_message``: the first message whose tokens
    changed; ``drift``: the first token where the IDs differ from the exact re-render and
    re-tokenization of the messages (None when equal: only sampled IDs can drift; always None
    when ``drift_tracked`` is False: the conversation opened with ``track_drift=False``, or with
    ``"on_read"``, whose drift the handle's ``drift()`` computes);
    ``chars``: the rendered text's length in code points; ``messages``: messages held."""

    ids: np.ndarray
    first_changed: int
    first_changed_message: int
    drift: int | None
    chars: int
    messages: int
    seq: int
    tokenizer: str
    segment: str
    _mapping: Mapping
    _lease: Lease | None = None
    drift_tracked: bool = True

    @property
    def valid(self) -> bool:
        """True while ``ids`` still shows the conversation's current state: False once a later op
        ran (through any client), once the conversation moved to another segment, was closed,
        expired or was evicted, or this client saw it missing."""
        if self._lease is not None and not self._lease.live:
            return False
        return self._mapping.seq == self.seq

    def __len__(self) -> int:
        return len(self.ids)


def pack_ids(ids: Any) -> bytes:
    """Sampled token IDs (a numpy integer array, or a sequence of ints) as the wire packs them:
    little-endian uint32.  Raises TypeError / ValueError (nothing is sent) for non-integers,
    more than one dimension, values outside uint32, or more than ``MAX_GENERATED_IDS``."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"token IDs must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token IDs must be integers, got dtype {arr.dtype}")
    if arr.size > P.MAX_GENERATED_IDS:
        raise ValueError(f"{arr.size} token IDs in one append; at most {P.MAX_GENERATED_IDS}")
    if arr.dtype.kind == "i" or arr.dtype.itemsize > 4:
        bad = np.flatnonzero((arr < 0) | (arr > 0xFFFFFFFF))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"token IDs must be in [0, 2**32): found {int(arr[i])} at index {i}")
    return arr.astype("<u4", copy=False).tobytes()


def as_messages(messages: Messages) -> list[dict[str, Any]]:
    """``messages`` as the wire carries them: a list of plain dicts (shallow copies).  Raises
    TypeError for anything else (a single message passed alone included)."""
    if isinstance(messages, (str, bytes, MappingABC)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, MappingABC):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        out.append(dict(m))
    return out


class ConversationState:
    """Per-conversation client state; owns the conversation's current mapping and the latest
    result's lease."""

    def __init__(self, conversation_id: str, tokenizer: str, *, template: str | None,
                 template_kwargs: dict[str, Any], match: P.MatchMode, add_generation_prompt: bool,
                 stop_texts: Sequence[str] = (), owner_uid: int | None = None,
                 track_drift: bool | str = True) -> None:
        self.conversation_id = conversation_id
        self.tokenizer = tokenizer  # as the caller named it (name or hash)
        self.tokenizer_hash = ""  # learned from the first reply
        self.template = template
        self.template_kwargs = template_kwargs
        self.match = match
        self.add_generation_prompt = add_generation_prompt
        if isinstance(stop_texts, str):
            raise TypeError("stop_texts is a list of strings, not one string")
        self.stop_texts = list(stop_texts)
        if track_drift not in (True, False, "on_read") or not isinstance(track_drift, (bool, str)):
            raise ValueError(f"track_drift={track_drift!r}: use True (drift in every result), False (no drift "
                             "reference) or 'on_read' (computed by drift())")
        self.track_drift: bool | str = track_drift
        self.owner_uid = owner_uid  # the server's verified uid: every mapped segment must be its
        self.seq = -1  # unknown until the first reply
        self.closed = False
        self._writer = secrets.token_hex(8)  # 64 random bits: op keys no other writer can guess
        self._op_numbers = itertools.count(1)
        self._mapping: Mapping | None = None
        self._lease: Lease | None = None

    # --------------------------------------------------------------------- flows
    def open(self, next_id: Callable[[], int], create_only: bool = False) -> Flow[ConversationResult]:
        """Create the conversation, or attach to it (same tokenizer and options)."""
        reply = yield P.ConvOpen(
            id=next_id(), conversation=self.conversation_id, tokenizer=self.tokenizer_hash or self.tokenizer,
            template=self.template, template_kwargs=self.template_kwargs, match=self.match,
            add_generation_prompt=self.add_generation_prompt, stop_texts=self.stop_texts, create_only=create_only,
            op_key=self._op_key(), track_drift=self.track_drift)
        return self._accept(reply)

    def op(self, next_id: Callable[[], int], make: MakeRequest) -> Flow[ConversationResult]:
        """One change: ``make(request id, expect_seq, op_key)`` builds its request."""
        try:
            reply = yield make(next_id(), self.seq, self._op_key())
        except (SessionMiss, SessionConflict):
            self._end_lease()  # the sidecar's conversation is not the state this client last saw
            raise
        return self._accept(reply)

    def fork(self, next_id: Callable[[], int], new_id: str) -> Flow[tuple["ConversationState", ConversationResult]]:
        """A new conversation ``new_id`` copied from this one; returns its state and first result."""
        new = ConversationState(new_id, self.tokenizer, template=self.template,
                                template_kwargs=self.template_kwargs, match=self.match,
                                add_generation_prompt=self.add_generation_prompt, stop_texts=self.stop_texts,
                                owner_uid=self.owner_uid, track_drift=self.track_drift)
        new.tokenizer_hash = self.tokenizer_hash
        reply = yield P.ConvFork(id=next_id(), conversation=self.conversation_id, new=new_id, expect_seq=self.seq,
                                 op_key=new._op_key())
        return new, new._accept(reply)

    def drift(self, next_id: Callable[[], int]) -> Flow[int | None]:
        """The conversation's drift now (``ConvDrift``); the IDs and the seq do not change."""
        try:
            reply = yield P.ConvDrift(id=next_id(), conversation=self.conversation_id, expect_seq=self.seq)
        except (SessionMiss, SessionConflict):
            self._end_lease()  # the sidecar's conversation is not the state this client last saw
            raise
        return expect(reply, P.ConvDriftIs).drift

    def close(self, next_id: Callable[[], int]) -> Flow[bool]:
        """Close the conversation in the sidecar; True if it existed."""
        self.closed = True
        self._mapping = None
        self._end_lease()
        reply = yield P.ConvClose(id=next_id(), conversation=self.conversation_id)
        return expect(reply, P.Closed).existed

    # ------------------------------------------------------------------ requests
    def append_messages(self, messages: Messages) -> MakeRequest:
        msgs = as_messages(messages)
        return lambda rid, seq, key: P.ConvAppendMessages(id=rid, conversation=self.conversation_id, messages=msgs,
                                                          expect_seq=seq, op_key=key)

    def set_messages(self, messages: Messages) -> MakeRequest:
        msgs = as_messages(messages)
        return lambda rid, seq, key: P.ConvSetMessages(id=rid, conversation=self.conversation_id, messages=msgs,
                                                       expect_seq=seq, op_key=key)

    def append_generated(self, ids: Any, then: Messages | None = None) -> MakeRequest:
        packed = pack_ids(ids)
        after = as_messages(then) if then is not None else []
        return lambda rid, seq, key: P.ConvAppendGenerated(id=rid, conversation=self.conversation_id, ids=packed,
                                                           expect_seq=seq, op_key=key, then=after)

    def rollback(self, n_messages: int) -> MakeRequest:
        if not isinstance(n_messages, int) or isinstance(n_messages, bool):
            raise TypeError(f"n_messages must be an int, not {n_messages!r}")
        return lambda rid, seq, key: P.ConvRollback(id=rid, conversation=self.conversation_id, n_messages=n_messages,
                                                    expect_seq=seq, op_key=key)

    def _op_key(self) -> str:
        """A key no other op (of any writer) carries: a re-sent request keeps its key."""
        return f"{self._writer}.{next(self._op_numbers)}"

    # ------------------------------------------------------------------- replies
    def _accept(self, reply: P.Reply | None) -> ConversationResult:
        ids = expect(reply, P.ConvIds)
        mapping = self._mapping
        if mapping is None or mapping.name != ids.segment:
            try:
                mapping = self._mapping = Mapping.open(ids.segment, self.owner_uid)
            except SegmentGone:  # the op was applied, then the conversation ended before we mapped it
                self._mapping = None
                self._end_lease()
                raise SessionClosed(f"conversation {self.conversation_id!r} ended before its result could be "
                                    "read (closed, expired or evicted meanwhile)", request_id=ids.id) from None
        self.seq = ids.seq
        self.tokenizer_hash = ids.tokenizer
        self._end_lease()
        self._lease = Lease()
        return ConversationResult(
            ids=mapping.view(ids.offset, ids.count), first_changed=ids.first_changed,
            first_changed_message=ids.first_changed_message, drift=ids.drift, chars=ids.chars,
            messages=ids.messages, seq=ids.seq, tokenizer=ids.tokenizer, segment=ids.segment, _mapping=mapping,
            _lease=self._lease, drift_tracked=ids.drift_tracked)

    def _end_lease(self) -> None:
        if self._lease is not None:
            self._lease.end()
            self._lease = None


# ----------------------------------------------------------------------- handles
class _SyncRunner(Protocol):
    def run(self, flow: Flow[T]) -> T: ...

    def next_id(self) -> int: ...


class _AsyncRunner(Protocol):
    def run(self, flow: Flow[T]) -> Awaitable[T]: ...

    def next_id(self) -> int: ...


class _View:
    _state: ConversationState

    @property
    def id(self) -> str:
        return self._state.conversation_id

    @property
    def tokenizer_hash(self) -> str:
        return self._state.tokenizer_hash


class ConversationHandle(_View):
    """A conversation in the sidecar, driven by a blocking :class:`~toktier_client.Client`.

    Each op returns a :class:`ConversationResult` whose ``ids`` view is valid until the next
    op on this conversation.  Not thread-safe (as the client is not)."""

    def __init__(self, client: _SyncRunner, state: ConversationState) -> None:
        self._client = client
        self._state = state
        self.last: ConversationResult | None = None

    def _op(self, make: MakeRequest) -> ConversationResult:
        self.last = self._client.run(self._state.op(self._client.next_id, make))
        return self.last

    def append_messages(self, messages: Messages) -> ConversationResult:
        """Append chat messages (dicts with ``role`` and JSON-able fields)."""
        return self._op(self._state.append_messages(messages))

    def set_messages(self, messages: Messages) -> ConversationResult:
        """Make the messages equal ``messages``: what changed is repaired as one exact edit."""
        return self._op(self._state.set_messages(messages))

    def append_generated(self, ids: Any, then: Messages | None = None) -> ConversationResult:
        """Append sampled token IDs verbatim (numpy integer array or list of ints); ``then``:
        messages that follow the generated turn (tool results), appended in the same op."""
        return self._op(self._state.append_generated(ids, then))

    def rollback(self, n_messages: int) -> ConversationResult:
        """Roll back by ``n_messages`` messages (``toktier.Conversation.rollback``)."""
        return self._op(self._state.rollback(n_messages))

    def fork(self, new_id: str) -> "ConversationHandle":
        """A new conversation ``new_id`` with this one's state (this one is unchanged); its
        ``last`` is its first result."""
        state, result = self._client.run(self._state.fork(self._client.next_id, new_id))
        handle = ConversationHandle(self._client, state)
        handle.last = result
        return handle

    def drift(self) -> int | None:
        """The first token where the IDs differ from the exact re-render of the messages (None:
        equal, or the conversation opened with ``track_drift=False``).  With
        ``track_drift="on_read"`` this is where the sidecar computes it, for every op since the
        last read at once (ops' results then carry none).  Changes nothing: ``last`` stays valid."""
        return self._client.run(self._state.drift(self._client.next_id))

    def close(self) -> bool:
        """Close the conversation in the sidecar; True if it existed."""
        return self._client.run(self._state.close(self._client.next_id))

    def __enter__(self) -> "ConversationHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncConversationHandle(_View):
    """asyncio twin of :class:`ConversationHandle`.  Ops on one handle are serialized by a lock
    (the sidecar orders them anyway; the lock also guarantees a reply's segment is mapped
    before the next op can replace it); different conversations run concurrently."""

    def __init__(self, client: _AsyncRunner, state: ConversationState) -> None:
        self._client = client
        self._state = state
        self._lock = asyncio.Lock()
        self.last: ConversationResult | None = None

    async def _op(self, make: MakeRequest) -> ConversationResult:
        async with self._lock:
            self.last = await self._client.run(self._state.op(self._client.next_id, make))
            return self.last

    async def append_messages(self, messages: Messages) -> ConversationResult:
        return await self._op(self._state.append_messages(messages))

    async def set_messages(self, messages: Messages) -> ConversationResult:
        return await self._op(self._state.set_messages(messages))

    async def append_generated(self, ids: Any, then: Messages | None = None) -> ConversationResult:
        """Append sampled token IDs verbatim; ``then``: messages that follow them, in the same op."""
        return await self._op(self._state.append_generated(ids, then))

    async def rollback(self, n_messages: int) -> ConversationResult:
        return await self._op(self._state.rollback(n_messages))

    async def fork(self, new_id: str) -> "AsyncConversationHandle":
        async with self._lock:
            state, result = await self._client.run(self._state.fork(self._client.next_id, new_id))
        handle = AsyncConversationHandle(self._client, state)
        handle.last = result
        return handle

    async def drift(self) -> int | None:
        """See :meth:`ConversationHandle.drift`."""
        async with self._lock:
            return await self._client.run(self._state.drift(self._client.next_id))

    async def close(self) -> bool:
        async with self._lock:
            return await self._client.run(self._state.close(self._client.next_id))

    async def __aenter__(self) -> "AsyncConversationHandle":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
