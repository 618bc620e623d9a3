"""Wire protocol and the sans-IO server connection, without sockets."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toktier_sidecar.connection import ServerConnection
from toktier_client import errors as E
from toktier_client import protocol as P

WELCOME = P.Welcome(version=P.PROTOCOL_VERSION, server="test", max_frame=1024, max_session_chars=100,
                    max_inflight=2, default_tokenizer="llama3")
HELLO = P.encode_frame(P.Hello(version=P.PROTOCOL_VERSION))


def replies(data: bytes) -> list:
    return [P.REPLY_DECODER.decode(b) for b in P.FrameDecoder().feed(data)]


def opened(**kw) -> ServerConnection:
    c = ServerConnection(WELCOME, max_frame=kw.get("max_frame", 1024), max_inflight=kw.get("max_inflight", 2))
    assert c.feed(HELLO) == []
    assert replies(c.data_to_send()) == [WELCOME]
    return c


ALL_REQUESTS = [
    P.Hello(version=1, client="x"),
    P.Open(id=1, session="s", tokenizer="llama3", text="héllo", specials="none", window=64, bind_to_connection=True),
    P.Append(id=2, session="s", text="x", expect_seq=3, tokenizer="abc"),
    P.Edit(id=3, session="s", start=1, end=2, text="y"),
    P.Sync(id=4, session="s", text="z"),
    P.Encode(id=5, text="t"),
    P.Close(id=6, session="s"),
    P.Stats(id=7),
    P.ListTokenizers(id=8),
    P.Ping(id=9),
    P.Release(segment="/x"),
]
ALL_REPLIES = [
    WELCOME,
    P.Ids(id=1, segment="/s", offset=64, count=3, seq=2, first_changed=1, path="first_window", tokenizer="h"),
    P.Closed(id=2, existed=True),
    P.TokenizerList(id=3, available=["a"], loaded=[P.TokenizerInfo(name="a", hash="h", family="f")]),
    P.StatsReply(id=4, sessions=1, bytes_held=2, shm_bytes=3, shm_segments=1, opened=1, closed=0, misses=0,
                 evictions={"ttl": 0}, connections=1, uptime_s=1.5),
    P.Error(id=5, code=P.ErrorCode.SESSION_MISS, message="m", fatal=False),
    P.Error(id=6, code=P.ErrorCode.SESSION_MISS, message="m", reason="ttl"),
    P.Pong(id=7, monotonic=12.5),
]


@pytest.mark.parametrize("msg", ALL_REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_roundtrip(msg):
    (body,) = P.FrameDecoder().feed(P.encode_frame(msg))
    assert P.REQUEST_DECODER.decode(body) == msg


@pytest.mark.parametrize("msg", ALL_REPLIES, ids=lambda m: type(m).__name__)
def test_replies_roundtrip(msg):
    (body,) = P.FrameDecoder().feed(P.encode_frame(msg))
    assert P.REPLY_DECODER.decode(body) == msg


def test_every_error_code_has_a_client_class():
    for code in P.ErrorCode:
        exc = E.error_from_code(code, "msg", 7)
        assert exc.code is code and exc.request_id == 7 and str(exc) == "msg"
    assert isinstance(E.error_from_code(P.ErrorCode.SESSION_MISS, ""), KeyError)
    assert isinstance(E.error_from_code(P.ErrorCode.INVALID_EDIT_RANGE, ""), ValueError)
    assert isinstance(E.error_from_code(P.ErrorCode.PERMISSION_DENIED, ""), PermissionError)


@settings(max_examples=60, deadline=None)
@given(msgs=st.lists(st.sampled_from(ALL_REQUESTS), min_size=1, max_size=8), cuts=st.lists(st.integers(0, 400)))
def test_frame_decoder_any_chunking(msgs, cuts):
    stream = b"".join(P.encode_frame(m) for m in msgs)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    d = P.FrameDecoder(max_frame=1024)
    bodies = []
    for a, b in zip(points, points[1:]):
        bodies += d.feed(stream[a:b])
    assert [P.REQUEST_DECODER.decode(b) for b in bodies] == msgs and d.buffered == 0


def test_frame_too_large_refused_from_header_alone():
    d = P.FrameDecoder(max_frame=1024)
    with pytest.raises(P.FrameTooLargeError) as ei:
        d.feed(struct.pack(">I", 0xFFFFFFFF))
    assert ei.value.claimed == 0xFFFFFFFF and d.buffered == 0


def test_handshake_required_and_version_checked():
    c = ServerConnection(WELCOME, max_frame=1024, max_inflight=2)
    assert c.feed(P.encode_frame(P.Stats(id=1))) == []
    (err,) = replies(c.data_to_send())
    assert err.code is P.ErrorCode.BAD_REQUEST and err.fatal and c.closing

    c = ServerConnection(WELCOME, max_frame=1024, max_inflight=2)
    c.feed(P.encode_frame(P.Hello(version=99)))
    (err,) = replies(c.data_to_send())
    assert err.code is P.ErrorCode.VERSION_MISMATCH and err.fatal and c.closing


def test_oversized_frame_is_fatal():
    c = opened()
    assert c.feed(struct.pack(">I", (4 << 30) - 1)) == []
    (err,) = replies(c.data_to_send())
    assert err.code is P.ErrorCode.FRAME_TOO_LARGE and err.fatal and c.closing
    assert c.feed(P.encode_frame(P.Stats(id=1))) == []  # nothing more is accepted


def test_garbage_body_is_fatal_bad_frame():
    c = opened()
    c.feed(struct.pack(">I", 3) + b"\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    (err,) = replies(c.data_to_send())
    assert err.code is P.ErrorCode.BAD_FRAME and err.fatal and c.closing


def test_invalid_utf8_fails_only_that_request():
    c = opened()
    body = msgspec.msgpack.encode(P.Append(id=42, session="s", text="ok"))
    bad = body.replace(b"\xa2ok", b"\xa2\xff\xfe")
    reqs = c.feed(struct.pack(">I", len(bad)) + bad + P.encode_frame(P.Stats(id=43)))
    assert reqs == [P.Stats(id=43)]
    (err,) = replies(c.data_to_send())
    assert (err.id, err.code, err.fatal) == (42, P.ErrorCode.INVALID_TEXT, False) and not c.closing


def test_wrong_schema_gets_bad_request_with_its_id():
    c = opened()
    body = msgspec.msgpack.encode({"t": "append", "id": 9, "session": 5, "text": "x"})
    assert c.feed(struct.pack(">I", len(body)) + body) == []
    (err,) = replies(c.data_to_send())
    assert (err.id, err.code, err.fatal) == (9, P.ErrorCode.BAD_REQUEST, False)


def test_inflight_limit_answers_overloaded():
    c = opened(max_inflight=2)
    frames = b"".join(P.encode_frame(P.Stats(id=i)) for i in (1, 2, 3))
    assert [r.id for r in c.feed(frames)] == [1, 2]
    (err,) = replies(c.data_to_send())
    assert (err.id, err.code) == (3, P.ErrorCode.OVERLOADED)
    c.reply(P.Closed(id=1, existed=False))
    assert [r.id for r in c.feed(P.encode_frame(P.Stats(id=4)))] == [4]


def test_release_needs_no_slot_and_duplicate_hello_is_fatal():
    c = opened(max_inflight=1)
    c.feed(P.encode_frame(P.Stats(id=1)))
    assert c.feed(P.encode_frame(P.Release(segment="/a"))) == [P.Release(segment="/a")]
    c.feed(HELLO)
    (err,) = replies(c.data_to_send())
    assert err.code is P.ErrorCode.BAD_REQUEST and c.closing
