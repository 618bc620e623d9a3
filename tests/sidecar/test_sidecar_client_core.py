"""The sans-IO client core (``toktier_client.core``) and the recovery mirror, without sockets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toktier_client import errors as E
from toktier_client import protocol as P
from toktier_client._session import AppendOp, EditOp, SyncOp, TextMirror
from toktier_client.core import Answered, Backoff, Broken, ClientConnection, Failed, Welcomed, expect, request

WELCOME = P.Welcome(version=P.PROTOCOL_VERSION, server="t", max_frame=1 << 22, max_session_chars=100,
                    max_inflight=8, default_tokenizer="llama3")


def frames(*msgs) -> bytes:
    return b"".join(bytes(P.encode_frame(m)) for m in msgs)


def welcomed() -> ClientConnection:
    conn = ClientConnection("test")
    (body,) = P.FrameDecoder().feed(conn.hello())
    assert P.REQUEST_DECODER.decode(body) == P.Hello(version=P.PROTOCOL_VERSION, client="test")
    assert conn.feed(frames(WELCOME)) == [Welcomed(WELCOME)]
    assert conn.usable and conn.welcome == WELCOME
    return conn


def test_handshake_refusal_is_a_typed_broken_event():
    conn = ClientConnection()
    (ev,) = conn.feed(frames(P.Error(id=0, code=P.ErrorCode.OVERLOADED, message="busy", fatal=True)))
    assert isinstance(ev, Broken) and type(ev.error) is E.Overloaded and str(ev.error) == "busy"
    assert not conn.usable and conn.feed(frames(WELCOME)) == []  # nothing after Broken
    with pytest.raises(E.ConnectionLost):
        conn.send(P.Stats(id=1))


def test_first_reply_must_be_welcome():
    conn = ClientConnection()
    (ev,) = conn.feed(frames(P.Closed(id=1, existed=True)))
    assert isinstance(ev, Broken) and isinstance(ev.error, E.ProtocolError)


def test_replies_matched_by_id_in_any_order_and_any_chunking():
    conn = welcomed()
    for i in (1, 2, 3):
        conn.send(P.Stats(id=i) if i != 2 else P.Ping(id=i))
    stream = frames(P.Pong(id=2, monotonic=3.0), P.Error(id=3, code=P.ErrorCode.SESSION_MISS, message="m",
                                                         reason="closed"))
    events = []
    for i in range(len(stream)):  # one byte at a time
        events += conn.feed(stream[i : i + 1])
    assert events[0] == Answered(2, P.Pong(id=2, monotonic=3.0))
    assert isinstance(events[1], Failed) and events[1].id == 3
    err = events[1].error
    assert type(err) is E.SessionMiss and err.reason == "closed" and err.request_id == 3
    assert conn.pending == {1}


def test_abandoned_request_late_reply_is_dropped():
    conn = welcomed()
    conn.send(P.Stats(id=1))
    conn.abandon(1)
    conn.send(P.Close(id=2, session="s"))
    assert conn.feed(frames(P.Closed(id=1, existed=False), P.Closed(id=2, existed=True))) == [
        Answered(2, P.Closed(id=2, existed=True))]
    assert conn.feed(frames(P.Closed(id=99, existed=True))) == []  # never asked: ignored


def test_fatal_or_unattributed_errors_break_the_connection_and_fail_all_pending():
    for err in (P.Error(id=0, code=P.ErrorCode.BAD_FRAME, message="x", fatal=True),
                P.Error(id=0, code=P.ErrorCode.BAD_REQUEST, message="no id"),
                P.Error(id=1, code=P.ErrorCode.FRAME_TOO_LARGE, message="big", fatal=True)):
        conn = welcomed()
        conn.send(P.Stats(id=1))
        conn.send(P.Stats(id=2))
        (ev,) = conn.feed(frames(err))
        assert isinstance(ev, Broken) and ev.error.code is err.code and set(ev.pending) == {1, 2}
        assert conn.connection_lost() is None  # already broken: reported once


def test_garbage_and_oversized_frames_are_protocol_errors():
    conn = welcomed()
    conn.send(P.Stats(id=1))
    (ev,) = conn.feed(b"\x00\x00\x00\x03\xc1\xc1\xc1")
    assert isinstance(ev, Broken) and isinstance(ev.error, E.ProtocolError) and ev.pending == (1,)
    conn = welcomed()
    (ev,) = conn.feed(b"\xff\xff\xff\xff")
    assert isinstance(ev, Broken) and isinstance(ev.error, E.ProtocolError)
    conn = welcomed()
    (ev,) = conn.feed(frames(WELCOME))
    assert isinstance(ev, Broken) and isinstance(ev.error, E.ProtocolError)


def test_connection_lost_is_a_broken_event_once():
    conn = welcomed()
    conn.send(P.Ping(id=5))
    ev = conn.connection_lost()
    assert isinstance(ev, Broken) and isinstance(ev.error, E.ConnectionLost) and ev.pending == (5,)
    assert conn.connection_lost() is None and conn.feed(frames(P.Pong(id=5, monotonic=0.0))) == []


def test_send_refuses_lone_surrogates_before_anything_is_tracked():
    conn = welcomed()
    with pytest.raises(E.InvalidText):
        conn.send(P.Append(id=1, session="s", text="\ud800"))
    assert conn.pending == set()
    conn.send(P.Release(segment="/x"))  # one-way: never pending
    assert conn.pending == set()


def test_request_flow_and_expect():
    flow = request(P.Stats(id=1), P.Pong)
    assert next(flow) == P.Stats(id=1)
    with pytest.raises(E.ProtocolError):
        flow.send(P.Closed(id=1, existed=True))
    with pytest.raises(E.ProtocolError):
        expect(None, P.Ids)


def test_backoff_doubles_until_the_deadline():
    now = [0.0]
    b = Backoff(1.0, clock=lambda: now[0])
    delays = []
    while (d := b.next_delay()) is not None:
        delays.append(d)
        now[0] += d
    assert delays[:3] == [0.01, 0.02, 0.04] and max(delays) == 0.5 and sum(delays) >= 1.0


# ----------------------------------------------------------------- the mirror
def test_mirror_appends_never_copy_the_whole_text():
    base = "x" * 100_000
    m = TextMirror(base)
    for i in range(2000):
        m.append(f" {i}")
        assert m.chunks[0] is base  # the opening text is never copied by an append
    assert len(m.chunks) <= 2 + math.log2(len(m))
    tail_start = len(m) - 5
    m.edit(tail_start, tail_start + 2, "EDIT")  # an edit near the end rebuilds the tail only
    assert m.chunks[0] is base
    expected = base + "".join(f" {i}" for i in range(2000))
    expected = expected[:tail_start] + "EDIT" + expected[tail_start + 2 :]
    assert m.text() == expected and len(m) == len(expected)


def test_mirror_chunks_shrink_geometrically():
    m = TextMirror()
    for i in range(5000):
        m.append("ab" * (i % 7 + 1))
        sizes = [len(c) for c in m.chunks]
        assert all(a >= 2 * b for a, b in zip(sizes, sizes[1:])), sizes
    assert len(m.chunks) <= 1 + math.log2(len(m))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "edit", "sync", "read"]), st.text(max_size=12),
                          st.integers(0, 10_000), st.integers(0, 10_000)), max_size=60))
def test_mirror_matches_a_plain_string(ops):
    m, ref = TextMirror(), ""
    for kind, text, a, b in ops:
        if kind == "append":
            AppendOp(text).apply(m)
            ref += text
        elif kind == "edit":
            start = a % (len(ref) + 1)
            end = start + b % (len(ref) - start + 1)
            EditOp(start, end, text).apply(m)
            ref = ref[:start] + text + ref[end:]
        elif kind == "sync":
            SyncOp(text).apply(m)
            ref = text
        else:
            assert m.text() == ref
        assert len(m) == len(ref)
    assert m.text() == ref


def test_client_package_depends_only_on_the_wire_protocol():
    import subprocess
    import sys

    code = ("import toktier_client, toktier_client.core, sys; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('toktier', 'toktier_sidecar')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
