"""The sans-IO client core (h11-style): requests in, bytes out; bytes in, events out.

No sockets and no asyncio here: :class:`~toktier_client.Client` (blocking) and
:class:`~toktier_client.AsyncClient` (asyncio) are thin adapters that move bytes
between a socket and one :class:`ClientConnection` per connection, and drive the
same *flows* (the multi-request conversations: an op with its recovery re-open,
an encode with its ``Release``)::

    conn = ClientConnection("my-engine")
    sock.sendall(conn.hello())
    sock.sendall(conn.send(P.Stats(id=1)))     # raises InvalidText before sending lone surrogates
    for event in conn.feed(sock.recv(65536)):  # Welcomed / Answered / Failed / Broken
        ...
    conn.abandon(request_id)                   # timed out or cancelled: a late reply is dropped
    conn.connection_lost()                     # the socket died: Broken(ConnectionLost)

>>> conn = ClientConnection("doc")
>>> hello = conn.hello()
>>> welcome = P.Welcome(version=P.PROTOCOL_VERSION, server="s", max_frame=1 << 20, max_session_chars=10,
...                     max_inflight=4, default_tokenizer="llama3")
>>> [type(e).__name__ for e in conn.feed(P.encode_frame(welcome))]
['Welcomed']
>>> _ = conn.send(P.Close(id=7, session="s"))
>>> conn.feed(P.encode_frame(P.Closed(id=7, existed=True)))
[Answered(id=7, reply=Closed(id=7, existed=True))]
>>> _ = conn.send(P.Close(id=8, session="gone"))
>>> (ev,) = conn.feed(P.encode_frame(P.Error(id=8, code=P.ErrorCode.SESSION_MISS, message="m", reason="ttl")))
>>> type(ev.error).__name__, isinstance(ev.error, KeyError), ev.error.reason
('SessionMiss', True, 'ttl')

A *flow* is a generator that yields requests and receives their replies (or has
the ``RemoteError`` thrown in); it returns the caller's result.  Adapters drive
it with their own I/O (``Client.run``, ``AsyncClient.run``: a ten-line loop
each), so the recovery and hand-over logic exists once.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable, Generator, TypeVar, Union

import msgspec

from . import protocol as P
from .errors import ConnectionLost, InvalidText, ProtocolError, RemoteError, TokTierError, error_from_frame
from .shm import Lease, Mapping, Result

T = TypeVar("T")

#: A conversation of one or more requests: yields each request, is sent its reply (None for
#: a one-way request) or has its error thrown in, returns the result.
Flow = Generator[P.Request, Union[P.Reply, None], T]

#: Replies may be bigger than the client's requests; never accept less than this.
MIN_REPLY_FRAME = 1 << 20


# ------------------------------------------------------------------------ events
@dataclass(frozen=True, slots=True)
class Welcomed:
    """The handshake succeeded."""

    welcome: P.Welcome


@dataclass(frozen=True, slots=True)
class Answered:
    """The reply to pending request ``id``."""

    id: int
    reply: P.Reply


@dataclass(frozen=True, slots=True)
class Failed:
    """Pending request ``id`` failed with a typed error frame; the connection goes on."""

    id: int
    error: RemoteError


@dataclass(frozen=True, slots=True)
class Broken:
    """The connection is unusable (fatal error frame, undecodable bytes, socket gone): the
    handshake, if still pending, and every pending request (``pending``) fail with ``error``."""

    error: TokTierError
    pending: tuple[int, ...] = ()


Event = Union[Welcomed, Answered, Failed, Broken]


class State(enum.Enum):
    AWAIT_WELCOME = "await_welcome"
    OPEN = "open"
    CLOSED = "closed"


class ClientConnection:
    """Protocol state for one client connection: framing, handshake, reply matching."""

    def __init__(self, client_name: str = "toktier_client", *, max_frame: int = P.DEFAULT_MAX_FRAME) -> None:
        self.client_name = client_name
        self.state = State.AWAIT_WELCOME
        self.welcome: P.Welcome | None = None
        self._decoder = P.FrameDecoder(max_frame)
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: set[int] = set()

    @property
    def usable(self) -> bool:
        """Handshake done and nothing broke."""
        return self.state is State.OPEN

    @property
    def pending(self) -> frozenset[int]:
        """Ids of the requests sent and not answered (nor abandoned) yet."""
        return frozenset(self._pending)

    def hello(self) -> bytes:
        """The first frame to send."""
        return bytes(self._encode(P.Hello(version=P.PROTOCOL_VERSION, client=self.client_name)))

    def send(self, request: P.Request) -> bytearray:
        """The frame for ``request`` (tracked until answered unless it is one-way).

        Raises :class:`InvalidText` (nothing is sent) for text that is not valid Unicode, and
        :class:`ConnectionLost` when the connection is not open."""
        if self.state is not State.OPEN or isinstance(request, P.Hello):
            raise ConnectionLost("not connected" if self.state is not State.OPEN else "Hello is sent by hello()")
        frame = self._encode(request)
        if not request.one_way:
            self._pending.add(getattr(request, "id"))
        return frame

    def abandon(self, request_id: int) -> None:
        """Stop waiting for ``request_id`` (timed out, cancelled): its late reply is dropped."""
        self._pending.discard(request_id)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Bytes from the socket -> events, in arrival order (nothing after a ``Broken``)."""
        if self.state is State.CLOSED:
            return []
        try:
            bodies = self._decoder.feed(data)
        except P.FrameTooLargeError as exc:
            return [self._break(ProtocolError(f"bad reply from the sidecar: {exc}"))]
        events: list[Event] = []
        for body in bodies:
            try:
                msg = P.REPLY_DECODER.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                events.append(self._break(ProtocolError(f"undecodable reply: {exc}")))
                break
            event = self._event(msg)
            if event is not None:
                events.append(event)
            if self.state is State.CLOSED:
                break
        return events

    def connection_lost(self, message: str = "the sidecar closed the connection") -> Broken | None:
        """The socket closed or failed: ``Broken(ConnectionLost)`` (None if already broken)."""
        if self.state is State.CLOSED:
            return None
        return self._break(ConnectionLost(message))

    # ----------------------------------------------------------------- internal
    def _event(self, msg: P.Reply) -> Event | None:
        if self.state is State.AWAIT_WELCOME:
            if isinstance(msg, P.Welcome):
                self.state = State.OPEN
                self.welcome = msg
                self._decoder.max_frame = max(msg.max_frame, MIN_REPLY_FRAME)
                return Welcomed(msg)
            if isinstance(msg, P.Error):
                return self._break(error_from_frame(msg))
            return self._break(ProtocolError(f"expected Welcome, got {type(msg).__name__}"))
        if isinstance(msg, P.Welcome):
            return self._break(ProtocolError("a second Welcome"))
        if isinstance(msg, P.Error) and (msg.fatal or msg.id == 0):
            return self._break(error_from_frame(msg))  # about the connection, not one request
        if msg.id not in self._pending:
            return None  # the late reply to an abandoned request
        self._pending.discard(msg.id)
        if isinstance(msg, P.Error):
            return Failed(msg.id, error_from_frame(msg))
        return Answered(msg.id, msg)

    def _break(self, error: TokTierError) -> Broken:
        pending, self._pending = tuple(self._pending), set()
        self.state = State.CLOSED
        return Broken(error, pending)

    def _encode(self, msg: P.Request) -> bytearray:
        try:
            return P.encode_frame(msg, self._encoder)
        except UnicodeEncodeError as exc:  # lone surrogates: local misuse, nothing was sent
            raise InvalidText(f"text is not valid Unicode: {exc}") from None


class Backoff:
    """Reconnect policy shared by both clients: retry after 10 ms, doubling up to 0.5 s, until
    ``timeout`` seconds have passed (then ``next_delay()`` is None)."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._deadline = clock() + timeout
        self._delay = 0.01

    def next_delay(self) -> float | None:
        if self._clock() >= self._deadline:
            return None
        delay, self._delay = self._delay, min(self._delay * 2, 0.5)
        return delay


# ------------------------------------------------------------------------- flows
R = TypeVar("R")


def expect(reply: P.Reply | None, reply_type: type[R]) -> R:
    """``reply`` if it is a ``reply_type``; else the server broke the protocol."""
    if not isinstance(reply, reply_type):
        raise ProtocolError(f"expected {reply_type.__name__}, got {type(reply).__name__}")
    return reply


def request(msg: P.Request, reply_type: type[R]) -> Flow[R]:
    """One request, one reply of ``reply_type``."""
    return expect((yield msg), reply_type)


def encode(next_id: Callable[[], int], text: str, tokenizer: str, specials: P.Specials,
           owner_uid: int | None = None, cache: bool = False) -> Flow[Result]:
    """Stateless encode (through the sidecar's prefix cache when ``cache``): map the one-shot
    segment (it must be owned by ``owner_uid``, the server's uid), then ``Release`` it (even if
    mapping failed).  Raises TypeError (nothing is sent) when ``cache`` is not a bool."""
    if not isinstance(cache, bool):
        raise TypeError(f"cache must be True or False, not {cache!r}")
    reply = expect((yield P.Encode(id=next_id(), text=text, tokenizer=tokenizer, specials=specials,
                                   cache=cache)), P.Ids)
    try:
        mapping = Mapping.open(reply.segment, owner_uid)
    finally:
        if reply.handoff:
            yield P.Release(segment=reply.segment)
    return result_from(reply, mapping)


def result_from(reply: P.Ids, mapping: Mapping, lease: Lease | None = None) -> Result:
    return Result(
        ids=mapping.view(reply.offset, reply.count),
        first_changed=reply.first_changed,
        path=reply.path,
        widenings=reply.widenings,
        seq=reply.seq,
        tokenizer=reply.tokenizer,
        segment=reply.segment,
        _mapping=mapping,
        _lease=lease,
        layer=reply.layer,
        reused_chars=reply.reused_chars,
    )
