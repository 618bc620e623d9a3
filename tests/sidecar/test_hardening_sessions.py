"""Issue 15, sessions under races: bound sessions end with their connection at any point,
recovery never drops another writer's acknowledged ops, the handoff limit counts encodes in
flight, a close racing an op never yields a reply whose segment is gone, AsyncClient bursts
queue instead of failing, and the shadow verifier stays on its budget."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest

from toktier_client import AsyncClient, Client, Overloaded, SegmentGone, SessionClosed, SessionConflict, SessionMiss
from toktier_client import protocol as P
from toktier_client._session import SessionState
from toktier_sidecar.service import SessionKey
from sidecar_harness import llama3, registry, sidecar, shm_names, start_sidecar, wait_until  # noqa: F401  (fixtures)
from sidecar_raw import Raw


# ------------------------------------------------------------------ bound sessions
def test_bound_session_ends_when_client_leaves_while_its_open_runs(start_sidecar, monkeypatch):
    sc = start_sidecar(inline_chars=0)  # every Open goes to a worker
    svc = sc.sidecar.service
    gates: dict[str, threading.Event] = {}
    entered = threading.Event()
    original = svc.run_create

    def gated(tok, req):
        gate = gates.get(req.session)
        if gate is not None:
            entered.set()
            assert gate.wait(30)
        return original(tok, req)
    monkeypatch.setattr(svc, "run_create", gated)
    for i in range(20):
        entered.clear()
        gates[f"b{i}"] = gate = threading.Event()
        r = Raw(sc.path)
        r.send(P.encode_frame(P.Open(id=1, session=f"b{i}", text="bound text", bind_to_connection=True)))
        r.send(P.encode_frame(P.Open(id=2, session=f"b{i}", text="bound text 2", bind_to_connection=True)))
        r.send(P.encode_frame(P.Open(id=3, session=f"q{i}", text="another", bind_to_connection=True)))
        assert entered.wait(30)
        r.close()  # gone while the first Open runs and the others wait or run
        assert wait_until(lambda: not sc.sidecar.peers)
        gate.set()
    assert wait_until(lambda: svc.store.stats().live == 0 and not shm_names(sc.prefix))


# ------------------------------------------------------------------ recovery
def test_two_recovering_writers_never_lose_acknowledged_ops(sidecar, llama3):
    acked: dict[str, list[str]] = {"a": [], "b": []}
    conflicts = {"a": 0, "b": 0}
    clients = {n: Client(sidecar.path) for n in "ab"}
    sessions = {n: clients[n].session("shared", text="start.", recover=True) for n in "ab"}

    def writer(name: str) -> None:
        for i in range(60):
            piece = f" {name}{i}."
            try:
                sessions[name].append(piece)
                acked[name].append(piece)
            except SessionConflict:  # the other writer moved it: seen, never papered over
                conflicts[name] += 1
    threads = [threading.Thread(target=writer, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for c in clients.values():
        c.close()
    slot = sidecar.sidecar.service.store.peek(SessionKey(os.geteuid(), "shared"))
    text = slot.session.text
    assert sum(conflicts.values()) > 0 and acked["a"] + acked["b"]
    for name, pieces in acked.items():  # every acknowledged op is still in the session
        missing = [p for p in pieces if p not in text]
        assert not missing, (name, missing[:5], conflicts)
    assert text.startswith("start.") and text.count("start.") == 1  # never re-opened from a mirror
    assert len(text) == len("start.") + sum(len(p) for p in acked["a"] + acked["b"])
    assert np.array_equal(slot.session.ids, llama3.encode(text))


def test_recovery_recreates_a_lost_session_but_not_over_another_writer(sidecar, llama3):
    with Client(sidecar.path) as c1, Client(sidecar.path) as c2:
        a = c1.session("lost", text="alpha", recover=True)
        c1.call(P.Close(id=c1.next_id(), session="lost"))  # lost (e.g. evicted)
        r = a.append(" beta")  # a miss: re-created from the mirror
        assert np.array_equal(r.ids, llama3.encode("alpha beta"))
        c2.call(P.Close(id=c2.next_id(), session="lost"))
        c2.session("lost", text="gamma")  # another writer rebuilt it meanwhile
        state = a._state
        with pytest.raises(SessionConflict):  # a's re-create is create_only: it refuses, it does not overwrite
            c1.run(_recreate(c1, state))
        assert np.array_equal(c2.session("lost", text="gamma").last.ids, llama3.encode("gamma"))


def _recreate(c: Client, state: SessionState):
    reply = yield state.open_request(c.next_id(), "alpha beta", create_only=True)
    return reply


def test_a_resent_op_is_answered_not_applied_twice(sidecar, llama3):
    with Client(sidecar.path) as c:
        c.session("idem", text="one")
        op = P.Append(id=c.next_id(), session="idem", text=" two", expect_seq=1, op_key="k.1")
        first = c.call(op)
        again = c.call(op)  # the reply was "lost": the same request, re-sent
        assert (again.seq, again.count, again.segment) == (first.seq, first.count, first.segment)
        with pytest.raises(SessionConflict):  # a different op at the old seq is still a conflict
            c.call(P.Append(id=c.next_id(), session="idem", text=" two", expect_seq=1, op_key="k.2"))
        r = c.session("idem", text="one two").last
        assert r.path == "noop" and np.array_equal(r.ids, llama3.encode("one two"))


# ------------------------------------------------------------------ close racing an op
def test_close_racing_appends_never_returns_a_gone_segment(sidecar, llama3):
    outcomes = {"ok": 0, "closed": 0}
    for race in range(30):
        with Client(sidecar.path) as writer, Client(sidecar.path) as closer:
            s = writer.session(f"race{race}", text="x")
            text = "x"
            done = threading.Event()

            def close_soon() -> None:
                while not done.is_set():
                    closer.call(P.Close(id=closer.next_id(), session=f"race{race}"))
                    time.sleep(0.001)
            t = threading.Thread(target=close_soon)
            t.start()
            try:
                for i in range(5):
                    piece = " word" * (2000 * (i + 1))  # grows: each append may move to a new segment
                    try:
                        r = s.append(piece)
                    except SessionMiss:  # SessionClosed included; never SegmentGone
                        outcomes["closed"] += 1
                        break
                    text += piece
                    if r.valid:
                        assert np.array_equal(r.ids, llama3.encode(text))
                    outcomes["ok"] += 1
            except SegmentGone as exc:  # pragma: no cover - the regression
                pytest.fail(f"a reply whose segment is gone: {exc}")
            finally:
                done.set()
                t.join()
    assert outcomes["closed"] > 0


def test_a_reply_whose_segment_is_gone_is_session_closed():
    state = SessionState("s", "", recover=False, specials="all", window=0, bind_to_connection=False)
    reply = P.Ids(id=3, segment="/ttgone-does-not-exist", offset=64, count=1, seq=2, first_changed=0,
                  path="full", tokenizer="h")
    with pytest.raises(SessionClosed) as info:
        state._accept(reply, None)
    assert isinstance(info.value, SessionMiss) and info.value.reason == "closed"


# ------------------------------------------------------------------ limits
def test_handoff_limit_counts_encodes_in_flight(start_sidecar):
    sc = start_sidecar(max_handoffs=4, inline_chars=0)
    r = Raw(sc.path)
    text = "token " * 20000
    r.send(b"".join(P.encode_frame(P.Encode(id=i, text=text)) for i in range(1, 21)))  # never Released
    replies = r.replies(20, timeout=60)
    ids = [m for m in replies if isinstance(m, P.Ids)]
    refused = [m for m in replies if isinstance(m, P.Error) and m.code is P.ErrorCode.OVERLOADED]
    assert len(ids) == 4 and len(refused) == 16
    assert len(shm_names(sc.prefix)) == 4  # never more segments than the limit
    r.close()
    assert wait_until(lambda: shm_names(sc.prefix) == [])


def test_async_client_bursts_queue_instead_of_overloading(start_sidecar, llama3):
    sc = start_sidecar(max_inflight=4, inline_chars=0)
    text = "burst " * 2000
    expected = llama3.encode(text)

    async def burst(**kw):
        async with AsyncClient(sc.path, **kw) as c:
            results = await asyncio.gather(*(c.encode(text) for _ in range(64)), return_exceptions=True)
            return c.max_inflight, results
    limit, results = asyncio.run(burst())
    assert limit <= 4
    assert all(not isinstance(r, BaseException) and np.array_equal(r.ids, expected) for r in results), \
        [r for r in results if isinstance(r, BaseException)][:3]
    _, unbounded = asyncio.run(burst(max_inflight=64))  # without the bound the server refuses some
    assert any(isinstance(r, Overloaded) for r in unbounded)


def test_shadow_verifier_stays_on_its_budget(start_sidecar):
    # The bucket holds one max_chars sample (1,000 code points) and refills at 10 a second.
    sc = start_sidecar(verify_rate=1.0, verify_max_chars=1000, verify_chars_per_second=10)
    with Client(sc.path) as c:
        c.session("huge", text="long " * 1000)  # 5,000 code points: oversized, never materialized
        for i in range(5):
            c.session(f"mid{i}", text="abcdefgh " * 40)  # 360 code points each: two fit the bucket
    v = sc.sidecar.verifier
    assert v.drain(30)
    st = v.stats
    assert st.dropped_by_reason.get("oversized") == 1
    assert st.dropped_by_reason.get("budget", 0) >= 1
    assert st.checked >= 2 and st.checked + st.dropped == st.offered and st.mismatches == 0


def test_shadow_budget_below_a_sample_still_checks_it(start_sidecar):
    # A sample larger than one second of budget (but within max_chars) is checked, not silently
    # dropped forever: the bucket holds a whole max_chars sample.
    sc = start_sidecar(verify_rate=1.0, verify_max_chars=1000, verify_chars_per_second=10)
    with Client(sc.path) as c:
        c.session("one", text="word " * 150)  # 750 code points, 75 seconds of budget
    v = sc.sidecar.verifier
    assert v.drain(30)
    assert v.stats.checked == 1 and v.stats.mismatches == 0


def test_a_small_edit_far_from_the_end_of_a_big_session_runs_off_the_loop(start_sidecar, monkeypatch):
    # An edit moves everything after it (text, IDs, token offsets): its work is the session's tail,
    # not the few characters it carries, so a mid-session edit of a big session goes to a worker,
    # while an append (and an edit near the end) stays on the loop.
    import toktier
    import toktier.session as ts

    where: list[tuple[str, str]] = []
    real_edit, real_append = ts.Session.edit, ts.Session.append

    def edit(self, start, end, text):
        where.append(("edit", threading.current_thread().name))
        return real_edit(self, start, end, text)

    def append(self, text):
        where.append(("append", threading.current_thread().name))
        return real_append(self, text)

    monkeypatch.setattr(ts.Session, "edit", edit)
    monkeypatch.setattr(ts.Session, "append", append)
    sc = start_sidecar(inline_chars=1000)
    text = "def f(x):\n    return x + 1\n" * 200  # 5,400 characters
    with Client(sc.path) as c:
        s = c.session("big", text=text)
        r = s.edit(10, 12, "yy")  # tail ~5,390 > inline_chars
        text = text[:10] + "yy" + text[12:]
        s.append(" # end")
        text += " # end"
        r = s.edit(len(text) - 3, len(text), "END")  # near the end: little work
        text = text[:-3] + "END"
        assert np.array_equal(r.ids, toktier.load_tokenizer("llama3").encode(text))
    loop = [name for op, name in where if op == "append"][0]
    edits = [name for op, name in where if op == "edit"]
    assert edits[0] != loop and edits[1] == loop, where
