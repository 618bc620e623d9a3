"""Bad input and bad peers, over real sockets, while a well-behaved client keeps being served.

Each case: the offender gets a typed error (or is dropped), the bystander's replies
stay exact, the server keeps no half-updated session and leaks no segment."""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgspec
import numpy as np
import pytest

from sidecar_raw import Bystander, Raw
from toktier.tools.corpus import large_text
from toktier_client import (
    BadRequest,
    Client,
    ConnectionLost,
    FrameTooLarge,
    InvalidText,
    Overloaded,
    SessionConflict,
    SessionMiss,
    TokenizerMismatch,
    TooLarge,
)
from toktier_client import protocol as P
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)
from sidecar_harness import shm_names

E = P.ErrorCode


def test_garbage_bytes(sidecar, llama3):
    with Bystander(sidecar.path, llama3):
        r = Raw(sidecar.path)
        r.send(b"\x00\x00\x00\x08GARBAGE!")
        (err,) = r.replies()
        assert (err.code, err.fatal) == (E.BAD_FRAME, True) and r.closed
        r = Raw(sidecar.path, hello=False)  # garbage instead of a handshake
        r.send(b"GET / HTTP/1.1\r\n\r\n")
        (err,) = r.replies()
        assert err.code is E.FRAME_TOO_LARGE and r.closed


def test_truncated_frame_then_hangup(sidecar, llama3):
    with Bystander(sidecar.path, llama3):
        for cut in (1, 3, 4, 10):
            r = Raw(sidecar.path)
            frame = P.encode_frame(P.Open(id=1, session="t", text="some text " * 20))
            r.send(frame[:cut])
            r.close()
        r = Raw(sidecar.path)
        r.send(struct.pack(">I", 1000) + b"\x81")  # promises 1000 bytes, sends 1, then goes quiet
        assert r.replies(timeout=0.3) == []
        r.close()
    with Client(sidecar.path) as c:
        with pytest.raises(SessionMiss):  # the truncated Open never took effect
            c.call(P.Append(id=c.next_id(), session="t", text="x"))


def test_four_gigabyte_claim(sidecar, llama3):
    with Bystander(sidecar.path, llama3):
        r = Raw(sidecar.path)
        r.send(struct.pack(">I", 0xFFFFFFFF) + b"x" * 100)
        (err,) = r.replies()
        assert (err.code, err.fatal) == (E.FRAME_TOO_LARGE, True) and r.closed
    with Client(sidecar.path) as c:
        c.welcome.max_frame  # the limit is announced in the handshake
        assert c.welcome.max_frame < 0xFFFFFFFF


def test_client_frame_over_limit(start_sidecar, llama3):
    sc = start_sidecar(max_session_chars=1000, max_frame=8000)
    with Client(sc.path) as c:
        with pytest.raises((FrameTooLarge, ConnectionLost)):
            c.session("big", text="x" * 20_000)
        s = c.session("ok", text="fine")  # reconnected transparently
        with pytest.raises(TooLarge):
            s.append("y" * 1000)
        r = s.append(" still fine")
        assert np.array_equal(r.ids, llama3.encode("fine still fine"))
        with pytest.raises(TooLarge):
            c.encode("z" * 1001)


def test_invalid_utf8(sidecar, llama3):
    with Bystander(sidecar.path, llama3), Client(sidecar.path) as c:
        s = c.session("u", text="abc")
        r = Raw(sidecar.path)
        body = msgspec.msgpack.encode(P.Append(id=5, session="u", text="zz"))
        bad = body.replace(b"\xa2zz", b"\xa2\xc3\x28")  # invalid 2-byte sequence
        r.send(struct.pack(">I", len(bad)) + bad + P.encode_frame(P.Stats(id=6)))
        err, stats = r.replies(2)
        assert (err.id, err.code, err.fatal) == (5, E.INVALID_TEXT, False)
        assert stats.id == 6  # the connection goes on
        with pytest.raises(InvalidText):  # lone surrogates are refused before sending
            s.append("\ud800")
        r2 = s.append("d")
        assert np.array_equal(r2.ids, llama3.encode("abcd"))


def test_wrong_messages_and_version(sidecar, llama3):
    with Bystander(sidecar.path, llama3):
        r = Raw(sidecar.path)
        for body in ({"t": "append", "id": 3, "session": 1, "text": "x"}, {"t": "nope", "id": 4},
                     {"id": 5}, {"t": "edit", "id": 6, "session": "s", "start": "a", "end": 1, "text": ""},
                     {"t": "stats"}):
            raw = msgspec.msgpack.encode(body)
            r.send(struct.pack(">I", len(raw)) + raw)
        errs = r.replies(5)
        assert [e.code for e in errs] == [E.BAD_REQUEST] * 5
        assert [e.id for e in errs] == [3, 4, 5, 6, 0]
        raw = msgspec.msgpack.encode([1, 2, 3])  # not a map at all: dropped
        r.send(struct.pack(">I", len(raw)) + raw)
        (err,) = r.replies()
        assert (err.code, err.fatal) == (E.BAD_FRAME, True) and r.closed
        r = Raw(sidecar.path, hello=False)
        r.send(P.encode_frame(P.Hello(version=999)))
        (err,) = r.replies()
        assert err.code is E.VERSION_MISMATCH and r.closed


def test_edit_out_of_range_leaves_session_intact(sidecar, llama3):
    with Client(sidecar.path) as c:
        s = c.session("r", text="0123456789", recover=False)
        for start, end in ((0, 11), (-1, 2), (5, 4), (11, 11)):
            with pytest.raises(ValueError):
                s.edit(start, end, "x")
        r = s.edit(10, 10, "!")
        assert np.array_equal(r.ids, llama3.encode("0123456789!"))


def test_client_vanishes_mid_request(sidecar, llama3):
    big = large_text(150_000, seed=5)
    with Bystander(sidecar.path, llama3):
        for i in range(2):
            r = Raw(sidecar.path)
            r.send(P.encode_frame(P.Open(id=1, session=f"v{i}", text=big)))
            r.send(P.encode_frame(P.Encode(id=2, text=big)))
            r.close()  # gone before the replies
    with Client(sidecar.path) as c:
        # whether the vanished peer's Open ran first (then ours is a noop) or ours did, the
        # session is whole and exact
        for i in range(2):
            s = c.session(f"v{i}", text=big)
            assert s.last.path in ("noop", "full") and np.array_equal(s.last.ids, llama3.encode(big))
            s.close()
        for _ in range(100):  # encode handoffs of dead connections are unlinked
            names = shm_names(sidecar.prefix)
            if len(names) <= 1:  # only the bystander's session
                break
            time.sleep(0.05)
        assert len(names) <= 1, names


def test_inflight_and_connection_limits(start_sidecar, llama3, monkeypatch):
    sc = start_sidecar(max_inflight=4, max_connections=2)
    # Every encode waits at a gate until the test opens it, so no request can finish (and free
    # its in-flight place) before all ten are read: exactly four admitted, six refused.
    gate = threading.Event()
    run_encode = sc.sidecar.service.run_encode

    def gated(tok, text):
        assert gate.wait(30), "the test never opened the gate"
        return run_encode(tok, text)

    monkeypatch.setattr(sc.sidecar.service, "run_encode", gated)
    r = Raw(sc.path)
    r.send(b"".join(P.encode_frame(P.Encode(id=i, text="hello " * 20_000)) for i in range(1, 11)))
    refused = r.replies(6, timeout=30)
    assert [g.code for g in refused] == [E.OVERLOADED] * 6 and sorted(g.id for g in refused) == list(range(5, 11))
    gate.set()
    oks = r.replies(4, timeout=30)
    assert sorted(g.id for g in oks) == [1, 2, 3, 4] and all(isinstance(g, P.Ids) for g in oks)
    assert all(g.count == len(llama3.encode("hello " * 20_000)) for g in oks)
    for g in oks:
        r.send(P.encode_frame(P.Release(segment=g.segment)))
    with Client(sc.path) as c2:
        with pytest.raises(Overloaded):
            Client(sc.path, reconnect=False)
        c2.session("fine", text="ok")
    r.close()


def test_handoffs_must_be_released(start_sidecar):
    sc = start_sidecar(max_handoffs=3)
    r = Raw(sc.path)
    for i in range(1, 4):
        r.send(P.encode_frame(P.Encode(id=i, text="x")))
        assert isinstance(r.replies(1)[0], P.Ids)
    r.send(P.encode_frame(P.Encode(id=9, text="x")))
    (err,) = r.replies(1)
    assert err.code is E.OVERLOADED
    assert len(shm_names(sc.prefix)) == 3
    r.close()
    for _ in range(100):
        if not shm_names(sc.prefix):
            break
        time.sleep(0.02)
    assert shm_names(sc.prefix) == []  # connection closed: its handoffs are unlinked


def test_tokenizer_mismatch_and_conflicts(start_sidecar, llama3):
    sidecar = start_sidecar(lazy_load=True)  # cl100k_base is loaded on first use
    with Client(sidecar.path) as c:
        s = c.session("tm", tokenizer="llama3", text="abc")
        with pytest.raises(TokenizerMismatch):
            c.session("tm", tokenizer="cl100k_base", text="abc")
        with pytest.raises(TokenizerMismatch):
            c.call(P.Append(id=c.next_id(), session="tm", text="d", tokenizer="f" * 64))
        with pytest.raises(SessionConflict):
            c.call(P.Append(id=c.next_id(), session="tm", text="d", expect_seq=999))
        with pytest.raises(BadRequest):
            c.session("w", text="x", window=3)
        r = s.append("d")
        assert np.array_equal(r.ids, llama3.encode("abcd"))


def test_peer_not_reading_replies(sidecar, llama3):
    """A client that floods requests and never reads must not hurt others (reads are paused)."""
    with Bystander(sidecar.path, llama3):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sidecar.path)
        s.sendall(P.encode_frame(P.Hello(version=P.PROTOCOL_VERSION)))
        s.setblocking(False)
        frame = P.encode_frame(P.Stats(id=1))
        try:
            for _ in range(20_000):
                s.send(frame)
        except BlockingIOError:
            pass
        time.sleep(0.2)
        s.close()


def test_client_timeout_is_typed_and_connection_survives(tmp_path):
    """A server that accepts and answers the handshake but then stalls."""
    import threading

    from toktier_client import RequestTimeout

    path = str(tmp_path / "stall.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    welcome = P.Welcome(version=P.PROTOCOL_VERSION, server="stall", max_frame=1 << 20, max_session_chars=10,
                        max_inflight=1, default_tokenizer="x")
    received = []

    def serve():
        conn, _ = srv.accept()
        dec = P.FrameDecoder()
        while True:
            data = conn.recv(65536)
            if not data:
                break
            for body in dec.feed(data):
                msg = P.REQUEST_DECODER.decode(body)
                received.append(msg)
                if isinstance(msg, P.Hello):
                    conn.sendall(P.encode_frame(welcome))
                elif len(received) == 3:  # answer the second Stats only, and late
                    conn.sendall(P.encode_frame(P.Closed(id=received[1].id, existed=False)))
                    conn.sendall(P.encode_frame(P.Closed(id=msg.id, existed=True)))
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with Client(path, timeout=0.2) as c:
        with pytest.raises(RequestTimeout):
            c.stats()
        assert c.call(P.Close(id=c.next_id(), session="s")).existed is True  # the stale reply was skipped
    t.join(5)
    srv.close()
    assert [type(m).__name__ for m in received] == ["Hello", "Stats", "Close"]  # no silent retry


async def test_async_client_gets_typed_refusals(start_sidecar):
    from toktier_client import AsyncClient

    sc = start_sidecar(max_connections=1)
    async with AsyncClient(sc.path) as first:
        with pytest.raises(Overloaded):
            await AsyncClient(sc.path, reconnect=False).connect()
        s = await first.session("still-served", text="yes")
        assert len(s.last.ids) == 1
