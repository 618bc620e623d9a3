"""Blocking client: one Unix-socket connection, one request at a time.

>>> with Client() as c:          # the default socket (toktier_client.paths)  # doctest: +SKIP
...     s = c.session("conv-1", tokenizer="llama3", recover=True)
...     r = s.append("Hello, world")
...     r.ids            # numpy uint32 view of shared memory, no copy
...     r.first_changed  # KV-cache reuse boundary

Not thread-safe: use one Client per thread, or :class:`toktier_client.AsyncClient`.
With no ``socket_path`` it connects to :func:`toktier_client.paths.default_socket_path`.
Before sending anything it checks who listens (SO_PEERCRED, :mod:`toktier_client.identity`):
the sidecar must run as this process's uid, or as ``expected_server_uid`` /
``$TOKTIER_SERVER_UID``; every segment it maps must be owned by that uid.
``timeout`` (seconds, None = wait forever) bounds each reply; it raises
:class:`~toktier_client.errors.RequestTimeout` and is never retried.
On a dropped connection the client reconnects (waiting up to
``reconnect_timeout`` for a restarting sidecar) and re-sends the request once;
session ops carry the session's ``seq`` so a re-sent op can never apply twice.

A thin adapter: the protocol (handshake, reply matching, typed errors) is the
sans-IO :class:`~toktier_client.core.ClientConnection`, the conversations
(recovery, hand-over) are the flows of :mod:`toktier_client.core` and
:mod:`toktier_client._session`, shared with :class:`~toktier_client.AsyncClient`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
from collections import deque
from collections.abc import Sequence

from . import core
from . import protocol as P
from ._conversation import ConversationHandle, ConversationState
from ._session import AppendOp, EditOp, PendingOp, SessionState, SessionView, SyncOp
from .core import Answered, Backoff, Broken, ClientConnection, Event, Failed, Flow, T, Welcomed
from .errors import ConnectionLost, RequestTimeout, TokTierError
from .identity import expected_server_uid as _expected_uid, verify_server
from .paths import default_socket_path
from .shm import Result

_RECV_BYTES = 1 << 16


class Client:
    """Synchronous TokTier client."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout: float | None = None,
        reconnect: bool = True,
        reconnect_timeout: float = 10.0,
        client_name: str = "toktier_client",
        expected_server_uid: int | None = None,
    ) -> None:
        self.socket_path = default_socket_path() if socket_path is None else os.fspath(socket_path)
        self.server_uid = _expected_uid(expected_server_uid)
        self.timeout = timeout
        self.reconnect = reconnect
        self.reconnect_timeout = reconnect_timeout
        self.client_name = client_name
        self.welcome: P.Welcome | None = None
        self._sock: socket.socket | None = None
        self._conn: ClientConnection | None = None
        self._events: deque[Event] = deque()
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
        try:
            verify_server(sock, self.server_uid, self.socket_path)  # before the first byte leaves
        except BaseException:
            sock.close()
            raise
        conn = ClientConnection(self.client_name)
        self._sock, self._conn, self._events = sock, conn, deque()
        try:
            sock.sendall(conn.hello())
        except OSError:
            pass  # a refusing server may close first: its error frame is still ours to read
        try:
            while True:
                event = self._next_event(conn)
                if isinstance(event, Welcomed):
                    self.welcome = event.welcome
                    return
                if isinstance(event, Broken):
                    raise event.error
        except BaseException:
            self._drop()  # refused, broken or timed out: no half-open connection stays behind
            raise

    def _reconnect(self) -> None:
        backoff = Backoff(self.reconnect_timeout)
        while True:
            try:
                self.connect()
                return
            except ConnectionLost:
                delay = backoff.next_delay()
                if delay is None:
                    raise
                time.sleep(delay)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._conn = None

    def close(self) -> None:
        """Close the connection (sessions stay in the sidecar unless bound to it)."""
        self._drop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------- I/O
    def _write(self, frame: bytes | bytearray) -> None:
        assert self._sock is not None
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            self._drop()
            raise ConnectionLost(f"send failed: {exc}") from exc

    def _next_event(self, conn: ClientConnection) -> Event:
        """The next event of ``conn``, reading the socket as needed."""
        while not self._events:
            if self._sock is None:
                raise ConnectionLost("not connected")
            try:
                data = self._sock.recv(_RECV_BYTES)
            except TimeoutError:
                raise RequestTimeout(f"no reply within {self.timeout} s") from None
            except OSError as exc:
                data, why = b"", f"receive failed: {exc}"
            else:
                why = "the sidecar closed the connection"
            if data:
                self._events.extend(conn.feed(data))
            else:
                self._events.append(conn.connection_lost(why) or Broken(ConnectionLost(why)))
        return self._events.popleft()

    def _roundtrip(self, msg: P.Request) -> P.Reply:
        conn = self._conn
        if conn is None or not conn.usable:
            raise ConnectionLost("not connected")
        self._write(conn.send(msg))
        rid = getattr(msg, "id", 0)
        while True:
            try:
                event = self._next_event(conn)
            except RequestTimeout:
                conn.abandon(rid)
                raise
            if isinstance(event, Broken):
                self._drop()
                raise event.error
            if isinstance(event, (Answered, Failed)) and event.id == rid:
                if isinstance(event, Failed):
                    raise event.error
                return event.reply

    def call(self, msg: P.Request) -> P.Reply | None:
        """Send one request and return its reply; typed error frames are raised.
        Reconnects and re-sends once if the connection drops.  A one-way request (``Release``)
        is sent if the connection is up, and returns None."""
        if msg.one_way:
            if self._conn is not None and self._conn.usable:
                with contextlib.suppress(ConnectionLost):
                    self._write(self._conn.send(msg))
            return None
        if self._conn is None and self.reconnect:
            self._reconnect()
        try:
            return self._roundtrip(msg)
        except ConnectionLost:
            if not self.reconnect:
                raise
            self._reconnect()
            return self._roundtrip(msg)

    def run(self, flow: Flow[T]) -> T:
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
                    reply = self.call(msg)
                except TokTierError as exc:
                    error = exc
        finally:
            flow.close()

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
        specials: P.Specials = "all",
        window: int = 0,
        bind_to_connection: bool = False,
    ) -> "Session":
        """Open (or re-attach to and sync) a session; ``recover=True`` answers session misses
        by re-sending the full text, which the client then mirrors locally."""
        state = SessionState(
            session_id, tokenizer, recover=recover, specials=specials, window=window,
            bind_to_connection=bind_to_connection, owner_uid=self.server_uid,
        )
        s = Session(self, state)
        s.last = self.run(state.open(self.next_id, text))
        return s

    def conversation(
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
    ) -> ConversationHandle:
        """Open (or attach to) a conversation: chat messages in, exact token IDs out
        (``toktier.Conversation`` in the sidecar).  ``template``: None for the tokenizer's
        registered chat template, a registered template name, or a Jinja source;
        ``template_kwargs`` become template variables (``enable_thinking=False``, ``tools=[...]``;
        JSON-able values).  ``match``: how ``set_messages`` compares a re-sent history;
        ``stop_texts``: extra strings a generation may stop with.  ``create_only`` refuses an
        existing conversation (``SessionConflict``).  ``track_drift=False``: no drift reference
        is kept (results' ``drift`` is None, ``drift_tracked`` False; token-in ops cost about
        half); ``"on_read"``: ops cost the same, and the handle's ``drift()`` computes it.  The
        handle's ``last`` is the conversation's current state."""
        state = ConversationState(
            conversation_id, tokenizer, template=template, template_kwargs=dict(template_kwargs), match=match,
            add_generation_prompt=add_generation_prompt, stop_texts=stop_texts, owner_uid=self.server_uid,
            track_drift=track_drift,
        )
        handle = ConversationHandle(self, state)
        handle.last = self.run(state.open(self.next_id, create_only))
        return handle

    def encode(self, text: str, tokenizer: str = "", specials: P.Specials = "all", *,
               cache: bool = False) -> Result:
        """Stateless encode; ``ids`` is a view of a one-shot shared-memory segment.

        ``cache=True``: the sidecar answers through its exact prefix cache for this tokenizer
        (L0: the same text; L1: any cached text sharing a prefix, repaired), so a stateless
        caller that re-sends a growing conversation pays for its new part only.  The IDs are
        the reference's either way; ``Result.layer`` says which cache answered (``"off"``:
        none was consulted), ``reused_chars`` and ``first_changed`` what was reused."""
        return self.run(core.encode(self.next_id, text, tokenizer, specials, self.server_uid, cache))

    def stats(self) -> P.StatsReply:
        return self.run(core.request(P.Stats(id=self.next_id()), P.StatsReply))

    def tokenizers(self) -> P.TokenizerList:
        return self.run(core.request(P.ListTokenizers(id=self.next_id()), P.TokenizerList))

    def ping(self) -> P.Pong:
        """One round trip; the reply carries the sidecar's monotonic clock."""
        return self.run(core.request(P.Ping(id=self.next_id()), P.Pong))


class Session(SessionView):
    """A session bound to one tokenizer.  Each op returns a :class:`Result` whose ``ids`` view
    is valid until the next op on this session (``Result.valid`` tells)."""

    def __init__(self, client: Client, state: SessionState) -> None:
        self._client = client
        self._state = state
        self.last: Result | None = None

    def _op(self, op: PendingOp) -> Result:
        self.last = self._client.run(self._state.op(self._client.next_id, op))
        return self.last

    def append(self, text: str) -> Result:
        return self._op(AppendOp(text))

    def edit(self, start: int, end: int, text: str) -> Result:
        """Replace code points [start, end) with ``text``."""
        return self._op(EditOp(start, end, text))

    def sync(self, text: str) -> Result:
        """Make the session text equal ``text``."""
        return self._op(SyncOp(text))

    def close(self) -> bool:
        """Close the session in the sidecar; True if it existed."""
        return self._client.run(self._state.close(self._client.next_id))

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
