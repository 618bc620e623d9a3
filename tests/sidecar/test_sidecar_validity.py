"""``Result.valid`` is exact, and the recovery mirror grows in place, through a real sidecar."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from toktier.tools.corpus import large_text
from toktier_client import AsyncClient, Client, InvalidEditRange, SessionMiss
from toktier_client import protocol as P
from toktier_client.shm import RETIRED_SEQ, Mapping
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)


def test_valid_until_the_next_op_and_not_after_a_failed_one(sidecar):
    with Client(sidecar.path) as c:
        s = c.session("v", text="Hello world")
        r1 = s.append("!")
        assert r1.valid
        with pytest.raises(InvalidEditRange):
            s.edit(5, 500, "x")  # refused: the session did not change
        assert r1.valid
        r2 = s.append("?")
        assert r1.segment == r2.segment and not r1.valid and r2.valid
        r3 = s.sync("Hello world!?")  # a no-op sync is still a later op
        assert r3.path == "noop" and not r2.valid and r3.valid and len(r3.ids) == len(r2.ids)


def test_invalid_after_moving_to_a_bigger_segment(sidecar):
    with Client(sidecar.path) as c1, Client(sidecar.path) as c2:
        a = c1.session("grow", text="start: ")
        b = c2.session("grow", text="start: ")  # re-attaching is a later op (a no-op sync)
        assert not a.last.valid and b.last.valid
        own = b.append(" more")
        assert own.valid
        reply = c1.call(P.Append(id=c1.next_id(), session="grow", text=large_text(30_000, seed=11)))
        assert reply.segment != own.segment  # far beyond the first segment's capacity: moved
        assert not own.valid  # c2 learns it from the retired segment header
        assert own._mapping.seq == RETIRED_SEQ and Mapping.open(reply.segment).seq == reply.seq
        mine = c2.session("grow-own", text="x")
        old = mine.last
        r = mine.append(large_text(30_000, seed=12))  # this client's own op moves it
        assert r.segment != old.segment and not old.valid and r.valid


def test_invalid_after_close_by_anyone(sidecar):
    with Client(sidecar.path) as c1, Client(sidecar.path) as c2:
        own = c1.session("mine", text="x")
        r = own.last
        assert own.close() is True and not r.valid
        theirs = c1.session("shared", text="y")
        r = theirs.last
        assert c2.call(P.Close(id=c2.next_id(), session="shared")).existed
        assert not r.valid  # closed by another connection: the sidecar retired the segment


def test_invalid_after_eviction_and_after_a_miss(start_sidecar, llama3):
    text = large_text(20_000, seed=9)
    sc = start_sidecar(memory_budget=200_000)
    with Client(sc.path) as c:
        sessions = [c.session(f"m{i}", text=text) for i in range(6)]
        assert c.stats().evictions["memory"] >= 1
        assert not sessions[0].last.valid and sessions[-1].last.valid  # evicted: retired
        r = sessions[0].last
        with pytest.raises(SessionMiss) as ei:
            sessions[0].append("!")
        assert ei.value.reason == "memory" and not r.valid


def test_restart_retires_every_segment_and_recovery_gives_a_valid_result(sidecar, llama3):
    with Client(sidecar.path) as c:
        s = c.session("r", text="before", recover=True)
        r = s.last
        sidecar.restart()
        assert not r.valid  # the stopping sidecar retired it
        r2 = s.append(" after")
        assert r2.valid and r2.path == "full" and np.array_equal(r2.ids, llama3.encode("before after"))


def test_stateless_results_stay_valid(sidecar):
    with Client(sidecar.path) as c:
        e = c.encode("one shot")
        s = c.session("other", text="a")
        s.append("b")
        c.encode("another")
        assert e.valid


def test_async_results_are_exact_too(sidecar):
    async def main() -> None:
        async with AsyncClient(sidecar.path) as c:
            s = await c.session("av", text="abc")
            r1 = s.last
            r2 = await s.append("d")
            assert not r1.valid and r2.valid
            await s.close()
            assert not r2.valid
    asyncio.run(main())


def test_recovery_mirror_grows_in_place(sidecar, llama3):
    """Many small ops on a long session never rebuild the mirrored text (object identity of the
    opening text, O(log N) chunks); only recovery joins it."""
    base = large_text(60_000, seed=12)
    with Client(sidecar.path) as c:
        s = c.session("mirror", text=base, recover=True)
        mirror = s._state.mirror
        assert mirror.chunks == (base,) and mirror.chunks[0] is base
        expected = base
        for i in range(150):
            piece = f" turn {i}."
            s.append(piece)
            expected += piece
            assert mirror.chunks[0] is base
        n = len(expected)
        s.edit(n - 4, n - 1, "EDITED")  # an edit near the end: the opening text is untouched
        expected = expected[: n - 4] + "EDITED" + expected[n - 1 :]
        assert mirror.chunks[0] is base and len(mirror.chunks) <= 2 + math.log2(len(mirror))
        assert len(mirror) == len(expected)
        c.call(P.Close(id=c.next_id(), session="mirror"))  # force a miss: recovery joins the text once
        r = s.append(" back")
        expected += " back"
        assert r.path == "full" and np.array_equal(r.ids, llama3.encode(expected))
        assert mirror.chunks == (expected,) and s.text == expected
