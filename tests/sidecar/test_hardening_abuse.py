"""Issue 15, connection abuse by an admitted uid: silent and idle connections, frames that
announce more than the server may buffer, long session ids, tokenizer loads, deeply nested
msgpack, handlers that blow up.  Each time the offender gets a typed error (or is closed),
the sidecar keeps serving everyone else with exact IDs."""

from __future__ import annotations

import socket
import threading

import msgspec
import numpy as np
import pytest

from toktier_client import BadRequest, Client, InternalError, Overloaded, UnknownTokenizer
from toktier_client import protocol as P
from toktier_sidecar import service as service_mod
from sidecar_harness import llama3, registry, sidecar, start_sidecar, wait_until  # noqa: F401  (fixtures)
from sidecar_raw import Bystander, Raw

E = P.ErrorCode


def test_silent_connections_are_closed_and_free_their_slots(start_sidecar, llama3):
    sc = start_sidecar(handshake_timeout=0.3, max_connections=4)
    silent = [Raw(sc.path, hello=False) for _ in range(4)]  # hold every slot, never say Hello
    assert wait_until(lambda: len(sc.sidecar.peers) == 4)
    with pytest.raises(Overloaded):
        Client(sc.path, reconnect=False)
    for r in silent:  # each one is told why, then closed
        (err,) = r.replies(timeout=20)
        assert err.code is E.BAD_REQUEST and err.fatal and "no Hello" in err.message and r.closed
        r.close()
    assert wait_until(lambda: not sc.sidecar.peers)
    with Client(sc.path, reconnect=False) as c:  # the slots are free again
        assert np.array_equal(c.session("ok", text="served").last.ids, llama3.encode("served"))


def test_idle_connections_are_closed_unless_they_hold_bound_sessions(start_sidecar):
    sc = start_sidecar(idle_timeout=0.3)
    idle = Raw(sc.path)
    holder = Raw(sc.path)
    holder.send(P.encode_frame(P.Open(id=1, session="mine", text="x", bind_to_connection=True)))
    (ids,) = holder.replies(1)
    assert isinstance(ids, P.Ids)
    assert idle.replies(timeout=20) == [] and idle.closed  # closed without a word: it was idle
    holder.send(P.encode_frame(P.Ping(id=2)))
    (pong,) = holder.replies(1)
    assert isinstance(pong, P.Pong)  # still open: closing it would end its bound session
    with Client(sc.path, reconnect=False) as c:
        assert c.stats().sessions == 1


def test_frames_announcing_more_than_the_buffer_budget_are_refused(start_sidecar, llama3):
    mib = 1 << 20
    sc = start_sidecar(max_frame=mib, max_buffered_bytes=3 * mib)
    budget = sc.sidecar.buffer_budget
    with Bystander(sc.path, llama3):
        slow = []
        for i in range(3):  # three senders each announce a full frame and send half of it
            r = Raw(sc.path)
            r.send(P.HEADER.pack(mib) + b"\x00" * (mib // 2))
            slow.append(r)
        assert wait_until(lambda: budget.used == 3 * mib)
        greedy = Raw(sc.path)
        greedy.send(P.HEADER.pack(mib) + b"\x00" * 1000)
        (err,) = greedy.replies(timeout=20)
        assert err.code is E.OVERLOADED and err.fatal and "buffer budget" in err.message and greedy.closed
        assert budget.used <= budget.limit
        for r in slow:
            r.close()
        assert wait_until(lambda: budget.used == 0)  # a closed connection gives its share back
        with Client(sc.path, reconnect=False) as c:  # a full-size frame fits again
            text = "y" * (mib // 2)
            assert np.array_equal(c.session("big", text=text).last.ids, llama3.encode(text))


def test_session_ids_are_bounded_and_counted(sidecar, llama3):
    with Client(sidecar.path) as c:
        with pytest.raises(BadRequest, match="longer than 256 bytes") as info:
            c.session("x" * (1 << 20), text="a")
        assert len(str(info.value)) < 400  # the error never echoes the whole id
        with pytest.raises(BadRequest):
            c.session("é" * 129, text="a")  # 258 bytes of UTF-8
        long_id = "k" * 256
        s = c.session(long_id, text="")
        assert c.stats().bytes_held >= service_mod.SESSION_OVERHEAD_BYTES + 2 * 256  # ids cost budget
        s.close()
        with pytest.raises(KeyError) as miss:
            c.call(P.Append(id=c.next_id(), session=long_id, text="x"))
        assert len(str(miss.value)) < 400
        assert np.array_equal(c.session("fine", text="still served").last.ids, llama3.encode("still served"))


def test_tokenizers_load_only_when_configured(sidecar, llama3):
    with Client(sidecar.path) as c:
        with pytest.raises(UnknownTokenizer, match="served: llama3$"):
            c.session("x", tokenizer="cl100k_base", text="a")
        assert "cl100k_base" not in c.tokenizers().available
        # a configured tokenizer's other specials variant still loads: the literal is plain text
        assert len(c.session("plain", tokenizer="llama3", text="<|eot_id|>", specials="none").last.ids) > 1
        assert len(c.session("special", tokenizer="llama3", text="<|eot_id|>").last.ids) == 1


def test_tokenizer_loads_never_stall_the_event_loop(start_sidecar, monkeypatch):
    sc = start_sidecar(lazy_load=True)
    gate, entered = threading.Event(), threading.Event()
    original = sc.sidecar.service.load_tokenizer

    def slow_load(name, specials):
        entered.set()
        assert gate.wait(30)
        return original(name, specials)
    monkeypatch.setattr(sc.sidecar.service, "load_tokenizer", slow_load)
    loader = Client(sc.path, reconnect=False)
    t = threading.Thread(target=lambda: loader.session("l", tokenizer="o200k_base", text="hi"), daemon=True)
    t.start()
    try:
        assert entered.wait(30)
        with Client(sc.path, reconnect=False) as c:  # the load is in progress: others are served
            assert c.ping().monotonic > 0
            assert len(c.session("meanwhile", text="fine").last.ids) > 0
            assert c.encode("x" * 50_000).ids.size > 0  # the bulk pool is not held by the load either
    finally:
        gate.set()
        t.join(60)
        loader.close()


def test_deeply_nested_msgpack_is_a_typed_protocol_error(sidecar, llama3):
    with Bystander(sidecar.path, llama3):
        for body, code in (
            # 1,000 levels in a field msgspec skips: it recurses (RecursionError, formerly a traceback)
            (b"\x83\xa1t\xa4ping\xa2id\x01\xa1x" + b"\x91" * 1000 + b"\x00", E.BAD_FRAME),
            (b"\x83\xa1t\xa4ping\xa2id\x01\xa1x" + b"\x91" * 100_000 + b"\x00", E.BAD_FRAME),
            (b"\x82\xa1t\xa4ping\xa2id" + b"\x91" * 1000 + b"\x01", E.BAD_FRAME),  # no readable id
            (b"\x91" * 1000 + b"\x00", E.BAD_FRAME),  # not a map at all
        ):
            r = Raw(sidecar.path)
            r.send(P.HEADER.pack(len(body)) + body)
            (err,) = r.replies(timeout=20)
            assert err.code is code, err
            r.close()
        assert Raw(sidecar.path) is not None  # still accepting


def test_every_escape_from_a_handler_is_a_typed_error_frame(sidecar, monkeypatch):
    handler = service_mod.HANDLERS[P.Ping]
    monkeypatch.setattr(type(handler), "plan", lambda self, svc, call, req: 1 / 0)
    with Client(sidecar.path) as c:
        with pytest.raises(InternalError, match="ZeroDivisionError"):
            c.ping()
        monkeypatch.setattr(type(handler), "lane", lambda self, req: [][1])
        with pytest.raises(InternalError, match="IndexError"):
            c.ping()
        monkeypatch.undo()
        assert c.ping().monotonic > 0  # the same connection goes on
