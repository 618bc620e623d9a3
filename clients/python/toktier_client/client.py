"""Blocking client: one Unix-socket connection, one request at a time.

>>> with Client("/run/toktier/toktier.sock") as c:                    # doctest: +SKIP
...     s = c.session("conv-1", tokenizer="llama3", recover=True)
...     r = s.append("Hello, world")
...     r.ids            # numpy uint32 view of shared memory, no copy
...     r.first_changed  # KV-cache reuse boundary

Not thread-safe: use one Client per thread, or :class:`toktier_client.AsyncClient`.
``timeout`` (seconds, None = wait forever) bounds each reply; it raises
:class:`~toktier_client.errors.RequestTimeout` and is never retried.
On a dropped connection the client reconnects (waiting up to
``reconnect_timeout`` for a restarting sidecar) and re-sends the request once;
session ops carry the session's ``seq`` so a re-sent op can never apply twice.
"""

from __future__ import annotations

import itertools
import os
import socket
import time

import msgspec

from . import protocol as P
from ._session import PendingOp, SessionState, SessionView, result_from
from .errors import (
    ConnectionLost,
    InvalidText,
    ProtocolError,
    RequestTimeout,
    SessionConflict,
    SessionMiss,
    error_from_code,
)
from .shm import Mapping, Result

_RECV_BYTES = 1 << 16


def _encode(msg: P._Msg) -> bytearray:
    try:
        return P.encode_frame(msg)
    except UnicodeEncodeError as exc:  # lone surrogates: local misuse, nothing was sent
        raise InvalidText(f"text is not valid Unicode: {exc}") from None


class Client:
    """Synchronous TokTier client."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        timeout: float | None = None,
        reconnect: bool = True,
        reconnect_timeout: float = 10.0,
        client_name: str = "toktier_client",
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.timeout = timeout
        self.reconnect = reconnect
        self.reconnect_timeout = reconnect_timeout
        self.client_name = client_name
        self.welcome: P.Welcome | None = None
        self._sock: socket.socket | None = None
        self._decoder = P.FrameDecoder()
        self._replies: list[bytes] = []
        self._ids = itertools.count(1)
        self.connect()

    # --------------------------------------------------------------- connection
    def connect(self) -> None:
        """(Re)connect and handshake."""
        self._drop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise ConnectionLost(f"cannot connect to {self.socket_path}: {exc}") from exc
        self._sock = sock
        self._decoder = P.FrameDecoder()
        self._replies = []
        try:
            sock.sendall(_encode(P.Hello(version=P.PROTOCOL_VERSION, client=self.client_name)))
        except OSError:
            pass  # a refusing server may close first: its error frame is still ours to read
        reply = self._read_reply()
        if isinstance(reply, P.Error):
            self._drop()
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, P.Welcome):
            self._drop()
            raise ProtocolError(f"expected Welcome, got {type(reply).__name__}")
        self.welcome = reply
        self._decoder.max_frame = max(reply.max_frame, 1 << 20)

    def _reconnect(self) -> None:
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.01
        while True:
            try:
                self.connect()
                return
            except ConnectionLost:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Close the connection (sessions stay in the sidecar unless bound to it)."""
        self._drop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------- I/O
    def _send(self, msg: P._Msg) -> None:
        frame = _encode(msg)
        if self._sock is None:
            raise ConnectionLost("not connected")
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            self._drop()
            raise ConnectionLost(f"send failed: {exc}") from exc

    def _read_reply(self) -> P.Reply:
        while not self._replies:
            if self._sock is None:
                raise ConnectionLost("not connected")
            try:
                data = self._sock.recv(_RECV_BYTES)
            except TimeoutError:
                raise RequestTimeout(f"no reply within {self.timeout} s") from None
            except OSError as exc:
                self._drop()
                raise ConnectionLost(f"receive failed: {exc}") from exc
            if not data:
                self._drop()
                raise ConnectionLost("the sidecar closed the connection")
            try:
                self._replies.extend(self._decoder.feed(data))
            except P.FrameTooLargeError as exc:
                self._drop()
                raise ProtocolError(str(exc)) from None
        body = self._replies.pop(0)
        try:
            return P.REPLY_DECODER.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._drop()
            raise ProtocolError(f"undecodable reply: {exc}") from None

    def _roundtrip(self, msg: P._Msg) -> P.Reply:
        self._send(msg)
        while True:
            reply = self._read_reply()
            if isinstance(reply, P.Error):
                if reply.fatal:
                    self._drop()
                if reply.id in (0, msg.id):
                    raise error_from_code(reply.code, reply.message, reply.id)
            elif getattr(reply, "id", None) == msg.id:
                return reply
            # a reply to an earlier, abandoned request: skip it

    def call(self, msg: P._Msg) -> P.Reply:
        """Send one request and return its reply; typed error frames are raised.
        Reconnects and re-sends once if the connection drops."""
        if self._sock is None and self.reconnect:
            self._reconnect()
        try:
            return self._roundtrip(msg)
        except ConnectionLost:
            if not self.reconnect:
                raise
            self._reconnect()
            return self._roundtrip(msg)

    def next_id(self) -> int:
        return next(self._ids)

    # ------------------------------------------------------------------ API
    def session(
        self,
        session_id: str,
        tokenizer: str = "",
        text: str = "",
        *,
        recover: bool = False,
        specials: str = "all",
        window: int = 0,
        bind_to_connection: bool = False,
    ) -> "Session":
        """Open (or re-attach to and sync) a session; ``recover=True`` answers session misses
        by re-sending the full text, which the client then mirrors locally."""
        state = SessionState(
            session_id, tokenizer, recover=recover, specials=specials, window=window,
            bind_to_connection=bind_to_connection,
        )
        s = Session(self, state)
        s.last = s._open(text)
        return s

    def encode(self, text: str, tokenizer: str = "", specials: str = "all") -> Result:
        """Stateless full encode; ``ids`` is a view of a one-shot shared-memory segment."""
        reply = self.call(P.Encode(id=self.next_id(), text=text, tokenizer=tokenizer, specials=specials))
        if not isinstance(reply, P.Ids):
            raise ProtocolError(f"expected Ids, got {type(reply).__name__}")
        try:
            mapping = Mapping.open(reply.segment)
        finally:
            if reply.handoff:
                self._send(P.Release(segment=reply.segment))
        return result_from(reply, mapping)

    def stats(self) -> P.StatsReply:
        return self.call(P.Stats(id=self.next_id()))  # type: ignore[return-value]

    def tokenizers(self) -> P.TokenizerList:
        return self.call(P.ListTokenizers(id=self.next_id()))  # type: ignore[return-value]


class Session(SessionView):
    """A session bound to one tokenizer.  Each op returns a :class:`Result` whose ``ids`` view
    is valid until the next op on this session."""

    def __init__(self, client: Client, state: SessionState) -> None:
        self._client = client
        self._state = state
        self.last: Result | None = None

    def _open(self, text: str) -> Result:
        reply = self._client.call(self._state.open_request(self._client.next_id(), text))
        return self._state.accept(reply, text)  # type: ignore[arg-type]

    def _op(self, op: PendingOp) -> Result:
        st = self._state
        try:
            reply = self._client.call(st.op_request(self._client.next_id(), op))
        except (SessionMiss, SessionConflict):
            if not st.recover:
                raise
            self.last = self._open(st.recovery_text(op))
            return self.last
        self.last = st.accept_op(reply, op)  # type: ignore[arg-type]
        return self.last

    def append(self, text: str) -> Result:
        return self._op(PendingOp("append", text))

    def edit(self, start: int, end: int, text: str) -> Result:
        """Replace code points [start, end) with ``text``."""
        return self._op(PendingOp("edit", text, start, end))

    def sync(self, text: str) -> Result:
        """Make the session text equal ``text``."""
        return self._op(PendingOp("sync", text))

    def close(self) -> bool:
        """Close the session in the sidecar; True if it existed."""
        reply = self._client.call(self._state.close_request(self._client.next_id()))
        return bool(getattr(reply, "existed", False))

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
