"""Sans-IO server side of one connection: bytes in, requests out; replies in, bytes out.

No sockets and no asyncio here (h11-style), so every protocol rule is testable
with plain byte strings::

    conn = ServerConnection(welcome, max_frame=..., max_inflight=...)
    requests = conn.feed(data)        # decoded, admitted requests, in arrival order
    transport.write(conn.data_to_send())  # handshake replies and protocol errors
    transport.write(conn.reply(msg))  # a reply to a request from `requests`
    if conn.closing: ...              # send what is pending, then close

Rules enforced here:

* the first frame must be ``Hello`` with our protocol version (else a fatal
  ``version_mismatch``/``bad_request`` error);
* a header claiming more than ``max_frame`` bytes is a fatal ``frame_too_large``
  (nothing of the claimed body is buffered): ``max_frame`` is the per-connection cap
  on buffered frame bytes;
* an incomplete frame reserves its announced length from the server-wide
  :class:`BufferBudget` first; a frame announcing more than the budget has left is a
  fatal ``overloaded`` (so N slow senders cannot make the server hold N x ``max_frame``);
* a body that is not a msgpack map, or is nested too deeply to decode, is a fatal
  ``bad_frame``; a map that is not a valid request (wrong fields/types, invalid
  UTF-8 inside a string, a session id longer than ``MAX_SESSION_ID_BYTES``) fails
  only that request (``bad_request``/``invalid_text``, with the request's id when it
  can be read) and the connection goes on;
* more than ``max_inflight`` unanswered requests: the excess ones get
  ``overloaded`` at once.

Timeouts (no Hello within the handshake timeout, idleness) need a clock and live in
the server; :attr:`ServerConnection.awaiting_hello` tells it which state applies.
"""

from __future__ import annotations

import enum

import msgspec

from toktier_client import protocol as P


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    OPEN = "open"
    CLOSING = "closing"


class BufferBudget:
    """Bytes that incomplete frames of all connections may hold together (one per server,
    used from the event-loop thread only)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, nbytes: int) -> bool:
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.used -= nbytes


class ServerConnection:
    """Protocol state for one client connection."""

    def __init__(self, welcome: P.Welcome, *, max_frame: int, max_inflight: int,
                 budget: BufferBudget | None = None) -> None:
        self.welcome = welcome
        self.max_inflight = max_inflight
        self.state = State.AWAIT_HELLO
        self.inflight = 0
        self._decoder = P.FrameDecoder(max_frame)
        self._budget = budget if budget is not None else BufferBudget(max_frame)
        self._reserved = 0  # bytes of the budget held for the incomplete frame
        self._out = bytearray()
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def closing(self) -> bool:
        return self.state is State.CLOSING

    @property
    def awaiting_hello(self) -> bool:
        return self.state is State.AWAIT_HELLO

    def discard(self) -> None:
        """The connection is gone: return its share of the buffer budget."""
        self._budget.give(self._reserved)
        self._reserved = 0
        self.state = State.CLOSING

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def feed(self, data: bytes) -> list[P.Request]:
        """Frames in ``data`` -> admitted requests (Release included, Hello consumed)."""
        if self.state is State.CLOSING:
            return []
        try:
            bodies = self._decoder.feed(data)
        except P.FrameTooLargeError as exc:
            self._fail(0, P.ErrorCode.FRAME_TOO_LARGE, str(exc), fatal=True)
            return []
        if not self._reserve(self._decoder.pending):
            return []
        admitted: list[P.Request] = []
        for body in bodies:
            msg = self._decode(body)
            if msg is None:
                if self.state is State.CLOSING:
                    break
                continue
            if self.state is State.AWAIT_HELLO:
                self._handshake(msg)
            elif isinstance(msg, P.Hello):
                self._fail(0, P.ErrorCode.BAD_REQUEST, "duplicate Hello", fatal=True)
            elif isinstance(msg, P.Release):
                admitted.append(msg)
            elif (problem := _field_problem(msg)) is not None:
                self._fail(msg.id, P.ErrorCode.BAD_REQUEST, problem)
            elif self.inflight >= self.max_inflight:
                self._fail(msg.id, P.ErrorCode.OVERLOADED,
                           f"more than {self.max_inflight} requests in flight on this connection")
            else:
                self.inflight += 1
                admitted.append(msg)
            if self.state is State.CLOSING:
                break
        return admitted

    def reply(self, msg: P.Reply) -> bytes:
        """Frame a reply to an admitted request (one that ``feed`` returned)."""
        frame = P.encode_frame(msg, self._encoder)
        self.inflight -= 1  # only once the reply exists: a failed encode is answered by an error
        return frame

    def error(self, request_id: int, code: P.ErrorCode, message: str, reason: str = "") -> bytes:
        """Frame a typed error reply to an admitted request."""
        return self.reply(P.Error(id=request_id, code=code, message=message, reason=reason))

    # ----------------------------------------------------------------- internal
    def _reserve(self, pending: int) -> bool:
        """Hold budget for the incomplete frame (``pending`` bytes announced); False (and a fatal
        error) when the server-wide budget cannot cover it."""
        if pending == self._reserved:
            return True
        self._budget.give(self._reserved)
        self._reserved = 0
        if self._budget.take(pending):
            self._reserved = pending
            return True
        self._fail(0, P.ErrorCode.OVERLOADED,
                   f"a frame of {pending} bytes does not fit in the sidecar's buffer budget "
                   f"({self._budget.limit - self._budget.used} of {self._budget.limit} bytes free); retry later",
                   fatal=True)
        self._decoder = P.FrameDecoder(self._decoder.max_frame)  # drop what was buffered
        return False

    def _decode(self, body: bytes) -> P.Request | None:
        try:
            return P.REQUEST_DECODER.decode(body)
        except msgspec.ValidationError as exc:
            rid = P.salvage_request_id(body)
            if rid is None:  # not even a map: the peer speaks something else
                self._fail(0, P.ErrorCode.BAD_FRAME, f"not a request: {exc}", fatal=True)
            else:
                self._fail(rid, P.ErrorCode.BAD_REQUEST, f"invalid request: {exc}",
                           fatal=self.state is State.AWAIT_HELLO)
        except RecursionError:  # msgspec recurses per nesting level: refuse, never crash
            self._fail(0, P.ErrorCode.BAD_FRAME, "undecodable frame: msgpack nested too deeply", fatal=True)
        except msgspec.DecodeError as exc:
            rid = P.salvage_request_id(body)
            if rid is None or self.state is State.AWAIT_HELLO:
                self._fail(0, P.ErrorCode.BAD_FRAME, f"undecodable frame: {exc}", fatal=True)
            else:  # well-formed msgpack around a broken string: invalid UTF-8
                self._fail(rid, P.ErrorCode.INVALID_TEXT, f"invalid request: {exc}")
        return None

    def _handshake(self, msg: P.Request) -> None:
        if not isinstance(msg, P.Hello):
            self._fail(0, P.ErrorCode.BAD_REQUEST, "the first frame must be Hello", fatal=True)
        elif msg.version != P.PROTOCOL_VERSION:
            self._fail(0, P.ErrorCode.VERSION_MISMATCH,
                       f"protocol version {msg.version} is not supported (server speaks {P.PROTOCOL_VERSION})",
                       fatal=True)
        else:
            self.state = State.OPEN
            self._out += P.encode_frame(self.welcome, self._encoder)

    def _fail(self, rid: int, code: P.ErrorCode, message: str, fatal: bool = False) -> None:
        self._out += P.encode_frame(P.Error(id=rid, code=code, message=message, fatal=fatal), self._encoder)
        if fatal:
            self.state = State.CLOSING


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _field_problem(msg: P.Request) -> str | None:
    """Why a decoded request's bounded fields are out of bounds, or None."""
    session = getattr(msg, "session", None)
    if session is not None and (len(session) > P.MAX_SESSION_ID_BYTES
                                or _utf8_len(session) > P.MAX_SESSION_ID_BYTES):
        return (f"session id of {_utf8_len(session)} bytes is longer than {P.MAX_SESSION_ID_BYTES} bytes "
                f"(starts {session[:32]!r})")
    op_key = getattr(msg, "op_key", "")
    if op_key and _utf8_len(op_key) > P.MAX_OP_KEY_BYTES:
        return f"op_key of {_utf8_len(op_key)} bytes is longer than {P.MAX_OP_KEY_BYTES} bytes"
    return None


def refusal(code: P.ErrorCode, message: str) -> bytes:
    """A fatal error frame for a connection refused before any protocol state exists."""
    return P.encode_frame(P.Error(id=0, code=code, message=message, fatal=True))
