"""asyncio client: one connection, many concurrent requests (pipelined, replies matched by id).

Bound a request with ``asyncio.wait_for``; a cancelled request's late reply is discarded.

>>> async with AsyncClient("/run/toktier/toktier.sock") as c:        # doctest: +SKIP
...     s = await c.session("conv-1", tokenizer="llama3")
...     r = await s.append("Hello")
...     r.ids                                   # zero-copy numpy view

Ops on one :class:`AsyncSession` are serialized by a per-session lock (the
sidecar orders them anyway; the lock also guarantees a reply's segment is mapped
before the next op can replace it).  Different sessions run concurrently.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import msgspec

from . import protocol as P
from ._session import PendingOp, SessionState, SessionView, result_from
from .client import _encode
from .errors import (
    ConnectionLost,
    ProtocolError,
    SessionConflict,
    SessionMiss,
    error_from_code,
)
from .shm import Mapping, Result

_WRITE_HIGH_WATER = 1 << 20


class _Protocol(asyncio.Protocol):
    """Thin adapter: bytes -> frames -> replies -> the owning client."""

    def __init__(self, client: "AsyncClient") -> None:
        self.client = client
        self.decoder = P.FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self._drained = asyncio.Event()
        self._drained.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            bodies = self.decoder.feed(data)
            for body in bodies:
                self.client._dispatch(P.REPLY_DECODER.decode(body), self)
        except (P.FrameTooLargeError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.client._fail_all(ProtocolError(f"bad reply from the sidecar: {exc}"), self)
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._drained.set()
        self.client._fail_all(ConnectionLost("the sidecar closed the connection"), self)

    def pause_writing(self) -> None:
        self._drained.clear()

    def resume_writing(self) -> None:
        self._drained.set()

    async def drain(self) -> None:
        await self._drained.wait()


class AsyncClient:
    """asyncio TokTier client; ``await AsyncClient(path).connect()`` or ``async with``."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        reconnect: bool = True,
        reconnect_timeout: float = 10.0,
        connect_timeout: float = 10.0,
        client_name: str = "toktier_client.aio",
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.reconnect = reconnect
        self.reconnect_timeout = reconnect_timeout
        self.connect_timeout = connect_timeout
        self.client_name = client_name
        self.welcome: P.Welcome | None = None
        self._proto: _Protocol | None = None
        self._pending: dict[int, asyncio.Future[P.Reply]] = {}
        self._welcome_fut: asyncio.Future[P.Reply] | None = None
        self._ids = itertools.count(1)
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> "AsyncClient":
        loop = asyncio.get_running_loop()
        try:
            _, proto = await loop.create_unix_connection(lambda: _Protocol(self), self.socket_path)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {self.socket_path}: {exc}") from exc
        self._proto = proto
        self._welcome_fut = loop.create_future()
        proto.transport.write(_encode(P.Hello(version=P.PROTOCOL_VERSION, client=self.client_name)))
        try:
            reply = await asyncio.wait_for(self._welcome_fut, self.connect_timeout)
        except asyncio.TimeoutError:
            proto.transport.abort()
            raise ConnectionLost(f"no handshake reply from {self.socket_path} within {self.connect_timeout} s") from None
        if isinstance(reply, P.Error):
            proto.transport.close()
            raise error_from_code(reply.code, reply.message)
        self.welcome = reply  # type: ignore[assignment]
        proto.decoder.max_frame = max(self.welcome.max_frame, 1 << 20)
        return self

    async def _reconnect(self, broken: _Protocol | None) -> None:
        async with self._connect_lock:
            if self._proto is not broken and self._proto is not None:
                return  # another task already reconnected
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.reconnect_timeout
            delay = 0.01
            while True:
                try:
                    await self.connect()
                    return
                except ConnectionLost:
                    if loop.time() >= deadline:
                        raise
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)

    async def close(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------- dispatching
    def _dispatch(self, reply: P.Reply, proto: _Protocol) -> None:
        if isinstance(reply, P.Welcome) or (isinstance(reply, P.Error) and self._welcome_fut is not None
                                            and not self._welcome_fut.done()):
            if self._welcome_fut is not None and not self._welcome_fut.done():
                self._welcome_fut.set_result(reply)
            return
        if isinstance(reply, P.Error) and reply.id == 0:
            self._fail_all(error_from_code(reply.code, reply.message), proto)
            return
        fut = self._pending.pop(reply.id, None)  # type: ignore[union-attr]
        if fut is None or fut.done():
            return
        if isinstance(reply, P.Error):
            fut.set_exception(error_from_code(reply.code, reply.message, reply.id))
        else:
            fut.set_result(reply)

    def _fail_all(self, exc: Exception, proto: _Protocol) -> None:
        if proto is not self._proto:
            return
        if self._welcome_fut is not None and not self._welcome_fut.done():
            self._welcome_fut.set_exception(exc)
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._proto = None

    async def _roundtrip(self, msg: P._Msg) -> P.Reply:
        proto = self._proto
        if proto is None or proto.transport is None or proto.transport.is_closing():
            raise ConnectionLost("not connected")
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg.id] = fut  # type: ignore[attr-defined]
        proto.transport.write(_encode(msg))
        if proto.transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
            await proto.drain()
        try:
            return await fut
        finally:
            self._pending.pop(msg.id, None)  # type: ignore[attr-defined]

    async def call(self, msg: P._Msg) -> P.Reply:
        """Send one request, await its reply; reconnect and re-send once if the connection drops."""
        if self._proto is None and self.reconnect:
            await self._reconnect(None)
        try:
            return await self._roundtrip(msg)
        except ConnectionLost:
            if not self.reconnect:
                raise
            await self._reconnect(self._proto)
            return await self._roundtrip(msg)

    def _send_nowait(self, msg: P._Msg) -> None:
        proto = self._proto
        if proto is not None and proto.transport is not None and not proto.transport.is_closing():
            proto.transport.write(_encode(msg))

    def next_id(self) -> int:
        return next(self._ids)

    # ------------------------------------------------------------------- API
    async def session(
        self,
        session_id: str,
        tokenizer: str = "",
        text: str = "",
        *,
        recover: bool = False,
        specials: str = "all",
        window: int = 0,
        bind_to_connection: bool = False,
    ) -> "AsyncSession":
        state = SessionState(
            session_id, tokenizer, recover=recover, specials=specials, window=window,
            bind_to_connection=bind_to_connection,
        )
        s = AsyncSession(self, state)
        async with s._lock:
            s.last = await s._open(text)
        return s

    async def encode(self, text: str, tokenizer: str = "", specials: str = "all") -> Result:
        reply = await self.call(P.Encode(id=self.next_id(), text=text, tokenizer=tokenizer, specials=specials))
        if not isinstance(reply, P.Ids):
            raise ProtocolError(f"expected Ids, got {type(reply).__name__}")
        try:
            mapping = Mapping.open(reply.segment)
        finally:
            if reply.handoff:
                self._send_nowait(P.Release(segment=reply.segment))
        return result_from(reply, mapping)

    async def stats(self) -> P.StatsReply:
        return await self.call(P.Stats(id=self.next_id()))  # type: ignore[return-value]

    async def tokenizers(self) -> P.TokenizerList:
        return await self.call(P.ListTokenizers(id=self.next_id()))  # type: ignore[return-value]


class AsyncSession(SessionView):
    """asyncio twin of :class:`toktier_client.client.Session`."""

    def __init__(self, client: AsyncClient, state: SessionState) -> None:
        self._client = client
        self._state = state
        self._lock = asyncio.Lock()
        self.last: Result | None = None

    async def _open(self, text: str) -> Result:
        reply = await self._client.call(self._state.open_request(self._client.next_id(), text))
        return self._state.accept(reply, text)  # type: ignore[arg-type]

    async def _op(self, op: PendingOp) -> Result:
        st = self._state
        async with self._lock:
            try:
                reply = await self._client.call(st.op_request(self._client.next_id(), op))
            except (SessionMiss, SessionConflict):
                if not st.recover:
                    raise
                self.last = await self._open(st.recovery_text(op))
                return self.last
            self.last = st.accept_op(reply, op)  # type: ignore[arg-type]
            return self.last

    async def append(self, text: str) -> Result:
        return await self._op(PendingOp("append", text))

    async def edit(self, start: int, end: int, text: str) -> Result:
        return await self._op(PendingOp("edit", text, start, end))

    async def sync(self, text: str) -> Result:
        return await self._op(PendingOp("sync", text))

    async def close(self) -> bool:
        async with self._lock:
            reply = await self._client.call(self._state.close_request(self._client.next_id()))
            return bool(getattr(reply, "existed", False))
