"""Fuzz the server with random bytes and random valid-but-wrong messages over real sockets.

Afterwards the server still serves exact results to a well-behaved client and no
shared-memory segment is left behind except those of sessions still open."""

from __future__ import annotations

import socket
import struct

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toktier_client import Client
from toktier_client import protocol as P
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)
from sidecar_harness import shm_names

ints = st.one_of(st.integers(-3, 40), st.integers(-(2**63), 2**64 - 1))
texts = st.one_of(st.text(max_size=50), st.sampled_from(["", "<|eot_id|>", "🙂" * 5, "a\r\n", "123 456"]))
names = st.sampled_from(["", "llama3", "cl100k_base", "nope", "../../etc/passwd", "f" * 64])
sessions = st.sampled_from(["a", "b", "", "x" * 256, "x" * 300])  # 300 bytes: refused (issue 15)

requests = st.one_of(
    st.builds(P.Open, id=ints, session=sessions, tokenizer=names, text=texts,
              specials=st.sampled_from(["all", "none", "weird"]), window=ints, bind_to_connection=st.booleans()),
    st.builds(P.Append, id=ints, session=sessions, text=texts, expect_seq=ints, tokenizer=names),
    st.builds(P.Edit, id=ints, session=sessions, start=ints, end=ints, text=texts, expect_seq=ints),
    st.builds(P.Sync, id=ints, session=sessions, text=texts, expect_seq=ints),
    st.builds(P.Encode, id=ints, text=texts, tokenizer=st.sampled_from(["", "llama3", "nope"]),
              specials=st.sampled_from(["all", "none", "x"])),
    st.builds(P.Close, id=ints, session=sessions),
    st.builds(P.Stats, id=ints),
    st.builds(P.Release, segment=st.sampled_from(["/x", "/dev/shm", "", "/toktier-abc"])),
    st.builds(P.Hello, version=ints),
)
mangled = st.one_of(
    st.dictionaries(st.sampled_from(["t", "id", "session", "text", "start", "end", "segment"]),
                    st.one_of(ints, st.text(max_size=8), st.binary(max_size=8), st.none(), st.floats()),
                    max_size=6),
    st.lists(ints, max_size=4),
)


def frame_of(item) -> bytes:
    if isinstance(item, bytes):
        return item  # raw bytes, no framing at all
    if isinstance(item, P._Msg):
        return bytes(P.encode_frame(item))
    body = msgspec.msgpack.encode(item)
    return struct.pack(">I", len(body)) + body


def converse(path: str, items: list, hello: bool) -> list:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    try:
        data = (bytes(P.encode_frame(P.Hello(version=1))) if hello else b"") + b"".join(map(frame_of, items))
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)  # EOF: the server answers what it has, then closes
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server already dropped us (a fatal frame): fine
        dec = P.FrameDecoder(1 << 30)
        out = []
        while True:
            try:
                chunk = s.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += [P.REPLY_DECODER.decode(b) for b in dec.feed(chunk)]  # replies are always well-formed
        return out
    finally:
        s.close()


@settings(max_examples=80, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(items=st.lists(st.one_of(requests, mangled, st.binary(max_size=40)), max_size=8), hello=st.booleans())
def test_fuzz_server_survives(sidecar, llama3, items, hello):
    replies = converse(sidecar.path, items, hello)
    for r in replies:
        assert isinstance(r, (P.Welcome, P.Ids, P.Closed, P.StatsReply, P.TokenizerList, P.Error))
        if isinstance(r, P.Error):
            assert r.code is not P.ErrorCode.INTERNAL, r.message


def test_after_fuzzing_the_server_is_healthy(sidecar, llama3):
    test_fuzz_server_survives(sidecar, llama3)  # run the campaign against this server, then check it
    with Client(sidecar.path) as c:
        s = c.session("healthy", text="after the storm")
        r = s.append(", calm")
        assert np.array_equal(r.ids, llama3.encode("after the storm, calm"))
        st_ = c.stats()
        assert st_.shm_segments == st_.sessions  # one segment per open session, no strays
        assert len(shm_names(sidecar.prefix)) == st_.sessions
        for sid in ("a", "b", "", "x" * 256, "healthy"):
            c.call(P.Close(id=c.next_id(), session=sid))
        assert c.stats().sessions == 0
    assert shm_names(sidecar.prefix) == []
