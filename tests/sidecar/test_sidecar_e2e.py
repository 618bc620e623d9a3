"""End to end through a real sidecar: Unix socket, shared memory, real tokenizers.

Every reply's IDs are compared with the reference encoding of the session text,
computed independently here; every ``ids`` array is checked to be a view of a
shared-memory mapping (no copy)."""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import time
import urllib.request

import numpy as np
import pytest

import toktier
from sidecar_texts import apply_op, random_op
from toktier.tools.corpus import large_text
from toktier_client import AsyncClient, Client, InvalidEditRange, SessionConflict, SessionMiss, UnknownTokenizer
from toktier_client import protocol as P
from toktier_client.shm import Mapping
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)
from sidecar_harness import backing, shm_names


def assert_zero_copy(r) -> None:
    assert isinstance(backing(r.ids), mmap.mmap), "ids are not a view of a shared-memory mapping"
    assert not r.ids.flags.writeable and r.ids.dtype == np.uint32


async def drive(client: AsyncClient, tok, sid: str, seed: int, n_ops: int) -> int:
    rng = random.Random(seed)
    text = "".join(rng.choice(["Hello world. ", "x = 1\n", "数字 42 "]) for _ in range(rng.randint(0, 5)))
    s = await client.session(sid, tokenizer="llama3", text=text)
    assert np.array_equal(s.last.ids, tok.encode(text))
    checks = 1
    for _ in range(n_ops):
        kind, args = random_op(rng, text)
        r = await getattr(s, kind)(*args)
        text = apply_op(text, kind, args)
        assert np.array_equal(r.ids, tok.encode(text)), (sid, kind, args)
        assert_zero_copy(r)
        assert r.valid and r.path in ("noop", "first_window", "widened", "full")
        assert 0 <= r.first_changed <= len(r.ids)
        checks += 1
    assert await s.close() is True
    return checks


async def test_many_concurrent_sessions(sidecar, llama3):
    async with AsyncClient(sidecar.path) as c:
        checks = await asyncio.gather(*(drive(c, llama3, f"s{i}", seed=i, n_ops=12) for i in range(32)))
        assert sum(checks) == 32 * 13
        st = await c.stats()
        assert (st.sessions, st.opened, st.closed) == (0, 32, 32)
    assert shm_names(sidecar.prefix) == []


async def test_many_connections_share_nothing_unintended(sidecar, llama3):
    async def one(i: int) -> int:
        async with AsyncClient(sidecar.path) as c:
            return await drive(c, llama3, "same-id", seed=100 + i, n_ops=4) if i == 0 else await drive(
                c, llama3, f"own-{i}", seed=100 + i, n_ops=4)
    assert sum(await asyncio.gather(*(one(i) for i in range(8)))) == 8 * 5


def test_views_are_live_shared_memory(sidecar, llama3):
    with Client(sidecar.path) as c:
        s = c.session("live", tokenizer="llama3", text="Hello world")
        r1 = s.append(" and more")
        first = r1.ids.copy()
        r2 = s.edit(0, 5, "Goodbye")
        assert r1.segment == r2.segment  # small session: same segment, rewritten in place
        assert not r1.valid and r2.valid
        # r1's view now shows the new state: it is the same memory, not a copy
        n = min(len(r1.ids), len(r2.ids))
        assert np.array_equal(r1.ids[:n], r2.ids[:n]) and not np.array_equal(first[:n], r2.ids[:n])
        other = Mapping.open(r2.segment)
        assert np.array_equal(other.view(64, len(r2.ids)), llama3.encode("Goodbye world and more"))
        st = os.stat(f"/dev/shm/{r2.segment.lstrip('/')}")
        assert st.st_mode & 0o777 == 0o600


def test_growth_moves_to_bigger_segment_and_unlinks_old(sidecar, llama3):
    text = large_text(30_000, seed=1)
    with Client(sidecar.path) as c:
        s = c.session("grow", tokenizer="llama3", text="start: ")
        seen = {s.last.segment}
        full = "start: "
        for i in range(0, len(text), 3000):
            r = s.append(text[i : i + 3000])
            full += text[i : i + 3000]
            seen.add(r.segment)
            assert np.array_equal(r.ids, llama3.encode(full))
            assert_zero_copy(r)
        assert len(seen) > 1
        live = shm_names(sidecar.prefix)
        assert live == [r.segment.lstrip("/")]  # every outgrown segment was unlinked
        s.close()
    assert shm_names(sidecar.prefix) == []


def test_stateless_encode_is_a_released_handoff(sidecar, llama3):
    text = large_text(50_000, seed=2)
    with Client(sidecar.path) as c:
        r = c.encode(text)
        assert np.array_equal(r.ids, llama3.encode(text))
        assert_zero_copy(r)
        assert r.valid and r.path == "full"
        c.stats()  # a round trip after the Release
        assert shm_names(sidecar.prefix) == []  # the name is gone; our mapping still reads
        assert int(r.ids.sum(dtype=np.int64)) == int(llama3.encode(text).sum(dtype=np.int64))
        assert len(c.encode("").ids) == 0


def test_other_tokenizers_lazy_loaded(start_sidecar):
    sidecar = start_sidecar(lazy_load=True)  # off by default (issue 15): enabled explicitly here
    text = "Hello, world! 12345 don't   stop\n\n東京 🙂 <|endoftext|>"
    with Client(sidecar.path) as c:
        for name in ("cl100k_base", "o200k_base"):
            ref = toktier.load_tokenizer(name)
            s = c.session(f"t-{name}", tokenizer=name, text=text)
            assert s.tokenizer_hash == ref.hash
            assert np.array_equal(s.last.ids, ref.encode(text))
            r = s.append(" more 678")
            assert np.array_equal(r.ids, ref.encode(text + " more 678"))
            assert np.array_equal(c.encode(text, tokenizer=name).ids, ref.encode(text))
        listing = c.tokenizers()
        assert {"llama3", "cl100k_base", "o200k_base"} <= set(listing.available)
        assert {t.name for t in listing.loaded} >= {"llama3", "cl100k_base", "o200k_base"}
        assert listing.default == "llama3"
        s = c.session("by-hash", tokenizer=toktier.load_tokenizer("cl100k_base").hash, text="abc")
        assert s.last.tokenizer == toktier.load_tokenizer("cl100k_base").hash


def test_specials_as_plain_text(sidecar):
    text = "<|begin_of_text|>hi<|eot_id|>"
    plain = toktier.load_tokenizer("llama3", specials="none")
    with Client(sidecar.path) as c:
        s = c.session("plain", tokenizer="llama3", text=text, specials="none")
        assert np.array_equal(s.last.ids, plain.encode(text))
        assert len(s.last.ids) > 3  # the literals were split as text
        s2 = c.session("special", tokenizer="llama3", text=text)
        assert len(s2.last.ids) == 3


def test_large_open_in_worker_while_small_ops_flow(sidecar, llama3):
    big = large_text(400_000, seed=3)

    async def main() -> None:
        async with AsyncClient(sidecar.path) as c:
            small = await c.session("small", tokenizer="llama3", text="a")
            big_task = asyncio.create_task(c.session("big", tokenizer="llama3", text=big))
            text = "a"
            for i in range(20):
                r = await small.append(f" {i}")
                text += f" {i}"
                assert np.array_equal(r.ids, llama3.encode(text))
            b = await big_task
            assert np.array_equal(b.last.ids, llama3.encode(big))
            r = await b.append(" tail")
            assert np.array_equal(r.ids, llama3.encode(big + " tail"))
    asyncio.run(main())


def test_big_append_is_not_queued_behind_session_starts(start_sidecar, llama3):
    """Opens hold the bulk pool; a big append (worker-sized) on another session uses the repair
    pool, so it is answered while both opens are still running (one thread per pool here)."""
    sidecar = start_sidecar(workers=1)
    starts = [large_text(3_000_000, seed=s) for s in (4, 5)]
    base, extra = large_text(2_000, seed=6), large_text(40_000, seed=7)  # extra > inline_chars

    async def main() -> None:
        async with AsyncClient(sidecar.path) as c:
            s = await c.session("agent", tokenizer="llama3", text=base)
            opens = [asyncio.create_task(c.session(f"start{i}", tokenizer="llama3", text=t))
                     for i, t in enumerate(starts)]
            await asyncio.sleep(0.05)  # both opens sent: one runs, one waits for the bulk thread
            r = await s.append(extra)
            assert np.array_equal(r.ids, llama3.encode(base + extra))
            pending = sum(not t.done() for t in opens)
            for t, text in zip(opens, starts):
                assert np.array_equal((await t).last.ids, llama3.encode(text))
            assert pending >= 1, "the append waited for the session starts"
    asyncio.run(main())


def test_open_existing_session_syncs_and_reattaches(sidecar, llama3):
    with Client(sidecar.path) as c1, Client(sidecar.path) as c2:
        a = c1.session("shared", tokenizer="llama3", text="one two three")
        b = c2.session("shared", tokenizer="llama3", text="one two three four")  # same peer uid: same session
        assert b.last.path in ("first_window", "widened", "noop", "full")
        assert np.array_equal(b.last.ids, llama3.encode("one two three four"))
        with pytest.raises(SessionConflict):  # c1's view of the seq is stale
            a.append(" x")


def test_bind_to_connection_closes_with_it(sidecar):
    with Client(sidecar.path) as c:
        c.session("bound", text="x", bind_to_connection=True)
        c.session("free", text="y")
    with Client(sidecar.path) as c:
        assert c.stats().sessions in (1, 2)
        for _ in range(100):
            if c.stats().sessions == 1:
                break
            time.sleep(0.01)
        assert c.stats().sessions == 1
        with pytest.raises(SessionMiss):
            c.call(P.Append(id=c.next_id(), session="bound", text="z"))


def test_typed_errors_keep_session_intact(sidecar, llama3):
    with Client(sidecar.path) as c:
        s = c.session("e", tokenizer="llama3", text="Hello world")
        with pytest.raises(InvalidEditRange):
            s.edit(5, 500, "x")
        with pytest.raises(InvalidEditRange):
            s.edit(6, 2, "x")
        with pytest.raises(UnknownTokenizer):
            c.session("e2", tokenizer="no-such-tokenizer")
        with pytest.raises(KeyError):  # UnknownTokenizer is a KeyError, as in the core
            c.encode("x", tokenizer="nope")
        r = s.append("!")
        assert np.array_equal(r.ids, llama3.encode("Hello world!"))


def test_metrics_endpoint(start_sidecar):
    sc = start_sidecar(metrics_port=0)
    with Client(sc.path) as c:
        s = c.session("m", text="hello")
        s.append(" world")
        with pytest.raises(SessionMiss):
            c.call(P.Append(id=c.next_id(), session="none", text="z"))
    body = urllib.request.urlopen(f"http://127.0.0.1:{sc.sidecar.metrics_port}/metrics", timeout=5).read().decode()
    for needle in ('toktier_requests_total{op="append",outcome="ok"} 1.0',
                   'toktier_requests_total{op="append",outcome="session_miss"} 1.0',
                   "toktier_sessions_live 1.0", "toktier_shm_bytes", "toktier_request_seconds_bucket",
                   'toktier_repair_paths_total{path="full"} 1.0', "toktier_session_misses_total 1.0",
                   'toktier_sessions_ended_total{cause="memory"} 0.0'):
        assert needle in body, needle


def test_ttl_and_memory_eviction_are_typed_misses(start_sidecar, llama3):
    sc = start_sidecar(session_ttl=0.3, sweep_interval=0.05)
    with Client(sc.path) as c:
        s = c.session("idle", text="soon gone")
        for _ in range(200):
            if c.stats().sessions == 0:
                break
            time.sleep(0.02)
        with pytest.raises(SessionMiss) as ei:
            s.append("!")
        assert "ttl" in str(ei.value)
        assert c.stats().evictions["ttl"] == 1
    assert shm_names(sc.prefix) == []

    text = large_text(20_000, seed=9)
    sc = start_sidecar(memory_budget=200_000)
    with Client(sc.path) as c:
        sessions = [c.session(f"m{i}", text=text, recover=True) for i in range(6)]
        st = c.stats()
        assert st.evictions["memory"] >= 1 and st.bytes_held <= 200_000
        assert len(shm_names(sc.prefix)) == st.sessions  # evicted sessions' segments are unlinked
        r = sessions[0].append(" back")  # the oldest was evicted: recovered from the mirror
        assert np.array_equal(r.ids, llama3.encode(text + " back"))


def test_pipelined_ops_on_one_session_apply_in_arrival_order(sidecar, llama3):
    """A big Open goes to a worker; the small ops pipelined behind it must wait for it, in order,
    while another session's ops on the same connection are answered meanwhile."""
    from sidecar_raw import Raw

    big = large_text(120_000, seed=4)
    r = Raw(sidecar.path)
    frames = [P.Open(id=1, session="o", text=big), P.Open(id=2, session="other", text="x")]
    expected = big
    for i in range(3, 13):
        if i % 3 == 0:
            frames.append(P.Edit(id=i, session="o", start=0, end=5, text=f"E{i}", expect_seq=1 if i == 3 else -1))
            expected = f"E{i}" + expected[5:]
        else:
            frames.append(P.Append(id=i, session="o", text=f" a{i}"))
            expected += f" a{i}"
    r.send(b"".join(bytes(P.encode_frame(f)) for f in frames))
    replies = r.replies(12, timeout=60)
    by_id = {x.id: x for x in replies}
    assert all(isinstance(x, P.Ids) for x in replies), replies
    assert [by_id[i].seq for i in range(3, 13)] == list(range(2, 12))
    assert by_id[2].segment != by_id[1].segment
    last = by_id[12]
    assert np.array_equal(Mapping.open(last.segment).view(last.offset, last.count), llama3.encode(expected))
    r.close()


def test_shadow_verifier_checks_served_results(start_sidecar, llama3):
    sc = start_sidecar(verify_rate=1.0, metrics_port=0)
    # the preloaded tokenizer's private reference was built at load time, not mid-traffic
    # (building one holds the GIL ~0.3 s), and the sidecar never rebuilds it
    ref = sc.sidecar.verifier.core.private_reference(llama3.hash)
    assert ref is not None and ref.history_free  # its word cache is off (public API)
    assert sc.sidecar.verifier.config.verifier.rebuild_every is None
    with Client(sc.path) as c:
        s = c.session("v", text="verify me")
        for piece in (" please", ", twice", " 123"):
            s.append(piece)
        c.encode("stateless too")
        assert sc.sidecar.verifier.drain(30) is True
        st = c.stats()
        assert (st.verified, st.mismatches) == (5, 0)
        assert sc.sidecar.verifier.core.private_reference(llama3.hash) is ref
    body = urllib.request.urlopen(f"http://127.0.0.1:{sc.sidecar.metrics_port}/metrics", timeout=5).read().decode()
    assert "toktier_shadow_checked_total" in body


def test_verifier_mismatch_disables_fast_path_until_reenabled(start_sidecar, llama3, monkeypatch):
    """A corrupted fast-path result is caught, the tokenizer goes to the full path, SIGHUP's
    handler re-enables it; every later result is exact."""
    import toktier.session as ts

    corrupt = {"on": False}
    original = ts.Session.append  # every append returns through it (the compiled one-call path's too)

    def faulty_append(self, *a, **k):
        r = original(self, *a, **k)
        if corrupt["on"] and r.path != ts.RepairPath.FULL:
            self._ids.view()[-1] ^= 1  # a silent wrong ID in the served result
        return r

    monkeypatch.setattr(ts.Session, "append", faulty_append)
    sc = start_sidecar(verify_rate=1.0, verify_disable_on_mismatch=True)
    with Client(sc.path) as c:
        s = c.session("m", text="word " * 300)
        corrupt["on"] = True
        s.append(" x")
        corrupt["on"] = False
        assert sc.sidecar.verifier.drain(30) is True
        assert sc.sidecar.verifier.is_disabled(llama3.hash)
        r = s.append(" y")
        assert r.path == "full" and np.array_equal(r.ids, llama3.encode("word " * 300 + " x y"))
        sc.sidecar.reenable_fast_paths()
        r = s.append(" z")
        assert r.path == "first_window" and np.array_equal(r.ids, llama3.encode("word " * 300 + " x y z"))
        assert sc.sidecar.verifier.drain(30) is True
        assert c.stats().mismatches == 1
