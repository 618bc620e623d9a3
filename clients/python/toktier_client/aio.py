"""asyncio client: one connection, many concurrent requests (pipelined, replies matched by id).

Bound a request with ``asyncio.wait_for``; a cancelled request's late reply is discarded.

>>> async with AsyncClient() as c:       # the default socket (toktier_client.paths)  # doctest: +SKIP
...     s = await c.session("conv-1", tokenizer="llama3")
...     r = await s.append("Hello")
...     r.ids                                   # zero-copy numpy view

At most ``max_inflight`` requests are on the wire at once (default: the server's
per-connection limit, at most 32); more wait their turn in the client instead of
getting ``Overloaded``.  The server is verified as :class:`~toktier_client.Client`
does it (SO_PEERCRED before the first byte, segment owners).

Ops on one :class:`AsyncSession` are serialized by a per-session lock (the
sidecar orders them anyway; the lock also guarantees a reply's segment is mapped
before the next op can replace it).  Different sessions run concurrently.

A thin adapter over the same sans-IO core as :class:`~toktier_client.Client`
(:mod:`toktier_client.core`): each connection is one ``ClientConnection`` whose
events resolve futures; the flows (recovery, hand-over) are shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Sequence
from typing import Optional, cast

from . import core
from . import protocol as P
from ._conversation import AsyncConversationHandle, ConversationState
from ._session import AppendOp, EditOp, PendingOp, SessionState, SessionView, SyncOp
from .core import Answered, Backoff, Broken, ClientConnection, Event, Failed, Flow, T, Welcomed
from .errors import ConnectionLost, TokTierError
from .identity import expected_server_uid as _expected_uid, verify_server
from .paths import default_socket_path
from .shm import Result

_WRITE_HIGH_WATER = 1 << 20
#: Most requests on the wire per client when not configured (the server's default allows 64).
DEFAULT_MAX_INFLIGHT = 32


class _Protocol(asyncio.Protocol):
    """Thin adapter for one connection: bytes <-> its ``ClientConnection``; events -> futures."""

    def __init__(self, client_name: str, server_uid: int, path: str) -> None:
        loop = asyncio.get_running_loop()
        self.server_uid, self.path = server_uid, path
        self.conn = ClientConnection(client_name)
        self.transport: asyncio.Transport | None = None
        self.welcomed: asyncio.Future[P.Welcome] = loop.create_future()
        self.futures: dict[int, asyncio.Future[P.Reply]] = {}
        self._drained = asyncio.Event()
        self._drained.set()

    @property
    def usable(self) -> bool:
        return self.conn.usable and self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream transport (uvloop's too)
        try:  # who listens, before the first byte leaves
            verify_server(transport.get_extra_info("socket"), self.server_uid, self.path)
        except TokTierError as exc:
            self.conn.connection_lost()
            self.welcomed.set_exception(exc)
            self.transport.abort()
            return
        self.transport.write(self.conn.hello())

    def data_received(self, data: bytes) -> None:
        self._handle(self.conn.feed(data))

    def connection_lost(self, exc: Exception | None) -> None:
        self._drained.set()
        lost = self.conn.connection_lost()
        if lost is not None:
            self._handle([lost])

    def pause_writing(self) -> None:
        self._drained.clear()

    def resume_writing(self) -> None:
        self._drained.set()

    def _handle(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Welcomed):
                if not self.welcomed.done():
                    self.welcomed.set_result(event.welcome)
            elif isinstance(event, (Answered, Failed)):
                fut = self.futures.pop(event.id, None)
                if fut is None or fut.done():
                    continue
                if isinstance(event, Failed):
                    fut.set_exception(event.error)
                else:
                    fut.set_result(event.reply)
            elif isinstance(event, Broken):
                if not self.welcomed.done():
                    self.welcomed.set_exception(event.error)
                futures, self.futures = self.futures, {}
                for fut in futures.values():
                    if not fut.done():
                        fut.set_exception(event.error)
                if self.transport is not None:
                    self.transport.abort()

    def request(self, msg: P.Request) -> Optional[asyncio.Future[P.Reply]]:
        """Write ``msg``; the future of its reply (None for a one-way request)."""
        if not self.usable:
            raise ConnectionLost("not connected")
        frame = self.conn.send(msg)
        fut = None
        if not msg.one_way:
            fut = self.futures[getattr(msg, "id", 0)] = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(frame)
        return fut

    def abandon(self, request_id: int) -> None:
        self.futures.pop(request_id, None)
        self.conn.abandon(request_id)

    async def drain(self) -> None:
        if self.transport is not None and self.transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
            await self._drained.wait()


class AsyncClient:
    """asyncio TokTier client; ``await AsyncClient(path).connect()`` or ``async with``."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        reconnect: bool = True,
        reconnect_timeout: float = 10.0,
        connect_timeout: float = 10.0,
        client_name: str = "toktier_client.aio",
        expected_server_uid: int | None = None,
        max_inflight: int | None = None,
    ) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, not {max_inflight}")
        self.socket_path = default_socket_path() if socket_path is None else os.fspath(socket_path)
        self.server_uid = _expected_uid(expected_server_uid)
        self.max_inflight = max_inflight
        self._slots: asyncio.Semaphore | None = None  # sized at the first handshake when not configured
        self.reconnect = reconnect
        self.reconnect_timeout = reconnect_timeout
        self.connect_timeout = connect_timeout
        self.client_name = client_name
        self.welcome: P.Welcome | None = None
        self._proto: _Protocol | None = None
        self._ids = itertools.count(1)
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> "AsyncClient":
        loop = asyncio.get_running_loop()
        try:
            _, proto = await loop.create_unix_connection(
                lambda: _Protocol(self.client_name, self.server_uid, self.socket_path), self.socket_path)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {self.socket_path}: {exc}") from exc
        try:
            welcome = await asyncio.wait_for(proto.welcomed, self.connect_timeout)
        except asyncio.TimeoutError:
            if proto.transport is not None:
                proto.transport.abort()
            raise ConnectionLost(
                f"no handshake reply from {self.socket_path} within {self.connect_timeout} s") from None
        except BaseException:
            if proto.transport is not None:
                proto.transport.abort()
            raise
        self._proto, self.welcome = proto, welcome
        if self._slots is None:
            self.max_inflight = self.max_inflight or min(welcome.max_inflight, DEFAULT_MAX_INFLIGHT)
            self._slots = asyncio.Semaphore(self.max_inflight)
        return self

    async def _reconnect(self, broken: _Protocol | None) -> None:
        async with self._connect_lock:
            if self._proto is not broken and self._proto is not None and self._proto.usable:
                return  # another task already reconnected
            backoff = Backoff(self.reconnect_timeout)
            while True:
                try:
                    await self.connect()
                    return
                except ConnectionLost:
                    delay = backoff.next_delay()
                    if delay is None:
                        raise
                    await asyncio.sleep(delay)

    async def close(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------- I/O
    async def _roundtrip(self, msg: P.Request) -> P.Reply:
        if self._slots is None:
            return await self._send_and_wait(msg)
        async with self._slots:  # a burst queues here instead of getting Overloaded
            return await self._send_and_wait(msg)

    async def _send_and_wait(self, msg: P.Request) -> P.Reply:
        proto = self._proto
        if proto is None:
            raise ConnectionLost("not connected")
        fut = proto.request(msg)
        assert fut is not None
        try:
            await proto.drain()
            return await fut
        finally:
            proto.abandon(getattr(msg, "id", 0))  # no-op once answered; drops a cancelled one's reply

    async def call(self, msg: P.Request) -> P.Reply | None:
        """Send one request, await its reply; reconnect and re-send once if the connection drops.
        A one-way request (``Release``) is sent if the connection is up, and returns None."""
        proto = self._proto
        if msg.one_way:
            if proto is not None and proto.usable:
                with contextlib.suppress(ConnectionLost):
                    proto.request(msg)
            return None
        if (proto is None or not proto.usable) and self.reconnect:
            await self._reconnect(proto)
        try:
            return await self._roundtrip(msg)
        except ConnectionLost:
            if not self.reconnect:
                raise
            await self._reconnect(self._proto)
            return await self._roundtrip(msg)

    async def run(self, flow: Flow[T]) -> T:
        """Drive a sans-IO flow: send each request it yields, resume it with the reply or error."""
        reply: P.Reply | None = None
        error: TokTierError | None = None
        try:
            while True:
                try:
                    msg = flow.send(reply) if error is None else flow.throw(error)
                except StopIteration as stop:
                    return stop.value
                reply, error = None, None
                try:
                    reply = await self.call(msg)
                except TokTierError as exc:
                    error = exc
        finally:
            flow.close()

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
        specials: P.Specials = "all",
        window: int = 0,
        bind_to_connection: bool = False,
    ) -> "AsyncSession":
        state = SessionState(
            session_id, tokenizer, recover=recover, specials=specials, window=window,
            bind_to_connection=bind_to_connection, owner_uid=self.server_uid,
        )
        s = AsyncSession(self, state)
        async with s._lock:
            s.last = await self.run(state.open(self.next_id, text))
        return s

    async def conversation(
        self,
        conversation_id: str,
        tokenizer: str = "",
        template: str | None = None,
        *,
        match: P.MatchMode = "strict",
        add_generation_prompt: bool = True,
        stop_texts: Sequence[str] = (),
        create_only: bool = False,
        track_drift: bool | str = True,
        **template_kwargs: object,
    ) -> AsyncConversationHandle:
        """asyncio twin of :meth:`toktier_client.Client.conversation`."""
        state = ConversationState(
            conversation_id, tokenizer, template=template, template_kwargs=dict(template_kwargs), match=match,
            add_generation_prompt=add_generation_prompt, stop_texts=stop_texts, owner_uid=self.server_uid,
            track_drift=track_drift,
        )
        handle = AsyncConversationHandle(self, state)
        async with handle._lock:
            handle.last = await self.run(state.open(self.next_id, create_only))
        return handle

    async def encode(self, text: str, tokenizer: str = "", specials: P.Specials = "all", *,
                     cache: bool = False) -> Result:
        """Stateless encode; ``cache=True`` answers through the sidecar's prefix cache (see
        :meth:`toktier_client.Client.encode`)."""
        return await self.run(core.encode(self.next_id, text, tokenizer, specials, self.server_uid, cache))

    async def stats(self) -> P.StatsReply:
        return await self.run(core.request(P.Stats(id=self.next_id()), P.StatsReply))

    async def tokenizers(self) -> P.TokenizerList:
        return await self.run(core.request(P.ListTokenizers(id=self.next_id()), P.TokenizerList))

    async def ping(self) -> P.Pong:
        """One round trip; the reply carries the sidecar's monotonic clock."""
        return await self.run(core.request(P.Ping(id=self.next_id()), P.Pong))


class AsyncSession(SessionView):
    """asyncio twin of :class:`toktier_client.client.Session`."""

    def __init__(self, client: AsyncClient, state: SessionState) -> None:
        self._client = client
        self._state = state
        self._lock = asyncio.Lock()
        self.last: Result | None = None

    async def _op(self, op: PendingOp) -> Result:
        async with self._lock:
            self.last = await self._client.run(self._state.op(self._client.next_id, op))
            return self.last

    async def append(self, text: str) -> Result:
        return await self._op(AppendOp(text))

    async def edit(self, start: int, end: int, text: str) -> Result:
        return await self._op(EditOp(start, end, text))

    async def sync(self, text: str) -> Result:
        return await self._op(SyncOp(text))

    async def close(self) -> bool:
        async with self._lock:
            return await self._client.run(self._state.close(self._client.next_id))
