"""One dispatch table in the sidecar: every request type has exactly one handler, and an op
added through it (Ping, the issue-12 exercise) works end to end over a real socket."""

from __future__ import annotations

import asyncio
import struct
import time
import urllib.request
from typing import get_args

import msgspec

from toktier_sidecar.service import HANDLERS
from sidecar_raw import Raw
from toktier_client import AsyncClient, Client
from toktier_client import protocol as P
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)


def test_every_request_type_has_one_handler():
    assert set(HANDLERS) == set(get_args(P.Request)) - {P.Hello}  # Hello is the connection's
    for msg_type, handler in HANDLERS.items():
        assert handler.tag == msg_type.__struct_config__.tag and handler.one_way == msg_type.one_way
    pools = {t.__name__: h.pool for t, h in HANDLERS.items()}
    assert pools == {"Open": "bulk", "Encode": "bulk", "Append": "repair", "Edit": "repair", "Sync": "repair",
                     "Close": None, "Stats": None, "ListTokenizers": None, "Ping": None, "Release": None,
                     "ConvOpen": "bulk", "ConvFork": "bulk", "ConvAppendMessages": "repair",
                     "ConvSetMessages": "repair", "ConvAppendGenerated": "repair", "ConvRollback": "repair",
                     "ConvDrift": "repair", "ConvClose": None}
    lanes = {t.__name__ for t, h in HANDLERS.items()
             if h.lane(t(**{f: _dummy(f) for f in t.__struct_fields__})) is not None}
    assert lanes == {"Open", "Append", "Edit", "Sync", "Close"} | {t.__name__ for t in P.CONVERSATION_OPS}


def _dummy(field: str):
    return {"id": 1, "start": 0, "end": 0, "n_messages": 0, "messages": [], "ids": b""}.get(field, "x")


def test_ping_through_a_real_socket(sidecar):
    before = time.monotonic()
    with Client(sidecar.path) as c:
        pong = c.ping()
        assert isinstance(pong, P.Pong) and pong.id > 0
        assert before <= pong.monotonic <= time.monotonic()  # the sidecar's clock (same host)

    async def main() -> list[P.Pong]:
        async with AsyncClient(sidecar.path) as ac:
            return list(await asyncio.gather(*(ac.ping() for _ in range(20))))
    pongs = asyncio.run(main())
    assert len({p.id for p in pongs}) == 20

    r = Raw(sidecar.path)  # hand-written frames: the wire shape of the exercise
    r.send(P.encode_frame(P.Ping(id=41)) + P.encode_frame(P.Ping(id=42)))
    a, b = r.replies(2)
    assert (type(a), a.id, type(b), b.id) == (P.Pong, 41, P.Pong, 42)
    r.close()


def test_ping_is_counted_in_metrics(start_sidecar):
    sc = start_sidecar(metrics_port=0)
    with Client(sc.path) as c:
        c.ping()
        c.ping()
    body = urllib.request.urlopen(f"http://127.0.0.1:{sc.sidecar.metrics_port}/metrics", timeout=5).read().decode()
    assert 'toktier_requests_total{op="ping",outcome="ok"} 2.0' in body


def test_enum_like_fields_are_validated_by_the_decoder(sidecar):
    r = Raw(sidecar.path)
    for rid, body in ((1, {"t": "open", "id": 1, "session": "s", "specials": "weird"}),
                      (2, {"t": "encode", "id": 2, "text": "x", "specials": "some"})):
        raw = msgspec.msgpack.encode(body)
        r.send(struct.pack(">I", len(raw)) + raw)
        (err,) = r.replies(1)
        assert (err.id, err.code, err.fatal) == (rid, P.ErrorCode.BAD_REQUEST, False)
        assert "specials" in err.message
    r.send(P.encode_frame(P.Open(id=3, session="s", text="ok", specials="none")))
    (ok,) = r.replies(1)
    assert isinstance(ok, P.Ids) and ok.id == 3
    r.close()


def test_small_stateless_encode_and_session_ops_interleave(sidecar, llama3):
    """Requests of every kind pipelined on one connection: each answered once, by id."""
    r = Raw(sidecar.path)
    msgs = [P.Open(id=1, session="a", text="one"), P.Ping(id=2), P.Encode(id=3, text="two"),
            P.Append(id=4, session="a", text=" three"), P.Stats(id=5), P.ListTokenizers(id=6),
            P.Close(id=7, session="a")]
    r.send(b"".join(bytes(P.encode_frame(m)) for m in msgs))
    by_id = {x.id: x for x in r.replies(len(msgs))}
    assert {k: type(v).__name__ for k, v in by_id.items()} == {
        1: "Ids", 2: "Pong", 3: "Ids", 4: "Ids", 5: "StatsReply", 6: "TokenizerList", 7: "Closed"}
    assert by_id[3].handoff and by_id[4].seq == 2 and by_id[7].existed
    r.send(P.encode_frame(P.Release(segment=by_id[3].segment)) + P.encode_frame(P.Ping(id=8)))
    (pong,) = r.replies(1)
    assert pong.id == 8
    r.close()
