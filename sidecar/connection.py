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
  (nothing of the claimed body is buffered);
* a body that is not a msgpack map is a fatal ``bad_frame``; a map that is
  not a valid request (wrong fields/types, invalid UTF-8 inside a string)
  fails only that request (``bad_request``/``invalid_text``, with the request's
  id when it can be read) and the connection goes on;
* more than ``max_inflight`` unanswered requests: the excess ones get
  ``overloaded`` at once.
"""

from __future__ import annotations

import enum

import msgspec

from toktier_client import protocol as P


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    OPEN = "open"
    CLOSING = "closing"


class ServerConnection:
    """Protocol state for one client connection."""

    def __init__(self, welcome: P.Welcome, *, max_frame: int, max_inflight: int) -> None:
        self.welcome = welcome
        self.max_inflight = max_inflight
        self.state = State.AWAIT_HELLO
        self.inflight = 0
        self._decoder = P.FrameDecoder(max_frame)
        self._out = bytearray()
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def closing(self) -> bool:
        return self.state is State.CLOSING

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
        self.inflight -= 1
        return P.encode_frame(msg, self._encoder)

    def error(self, request_id: int, code: P.ErrorCode, message: str, reason: str = "") -> bytes:
        """Frame a typed error reply to an admitted request."""
        return self.reply(P.Error(id=request_id, code=code, message=message, reason=reason))

    # ----------------------------------------------------------------- internal
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


def refusal(code: P.ErrorCode, message: str) -> bytes:
    """A fatal error frame for a connection refused before any protocol state exists."""
    return P.encode_frame(P.Error(id=0, code=code, message=message, fatal=True))
