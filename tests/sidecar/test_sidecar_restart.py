"""Sidecar restarts: clients reconnect, see session misses, recover by re-sending the text."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest

from sidecar_texts import apply_op, random_op
from toktier_client import AsyncClient, Client, SessionConflict, SessionMiss
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)
from sidecar_harness import shm_names, wait_until


def test_restart_recovers_sessions_exactly(sidecar, llama3):
    with Client(sidecar.path) as c:
        sessions = {f"r{i}": c.session(f"r{i}", text=f"session {i}: hello", recover=True) for i in range(5)}
        texts = {k: f"session {k[1:]}: hello" for k in sessions}
        rng = random.Random(7)
        for round_ in range(3):
            sidecar.restart()
            assert shm_names(sidecar.prefix) == []  # the old server unlinked everything
            for k, s in sessions.items():
                kind, args = random_op(rng, texts[k])
                r = getattr(s, kind)(*args)
                texts[k] = apply_op(texts[k], kind, args)
                assert r.path == "full" and r.first_changed == 0  # re-opened from the mirrored text
                assert np.array_equal(r.ids, llama3.encode(texts[k]))
                assert s.text == texts[k]
                r = s.append(" next")  # and the session continues incrementally
                texts[k] += " next"
                assert np.array_equal(r.ids, llama3.encode(texts[k]))
        assert c.stats().sessions == 5


def test_without_recovery_the_miss_is_raised(sidecar):
    with Client(sidecar.path) as c:
        s = c.session("plain", text="abc")
        sidecar.restart()
        with pytest.raises(SessionMiss) as ei:
            s.append("d")
        assert isinstance(ei.value, KeyError)


def test_async_clients_ride_through_a_restart(sidecar, llama3):
    async def main() -> None:
        async with AsyncClient(sidecar.path, reconnect_timeout=30) as c:
            ss = [await c.session(f"a{i}", text=f"async {i}", recover=True) for i in range(6)]
            texts = [f"async {i}" for i in range(6)]
            restarter = threading.Thread(target=lambda: (time.sleep(0.05), sidecar.restart()))
            restarter.start()
            for step in range(15):
                rs = await asyncio.gather(*(s.append(f" {step}") for s in ss))
                for i, r in enumerate(rs):
                    texts[i] += f" {step}"
                    assert np.array_equal(r.ids, llama3.encode(texts[i]))
                await asyncio.sleep(0.02)
            restarter.join()
            assert (await c.stats()).sessions == 6
    asyncio.run(main())


def test_conflict_is_raised_even_with_recovery(sidecar, llama3):
    """Recovery never re-opens over another writer's acknowledged ops (issue 15): a conflict
    is the caller's to see, with or without ``recover``."""
    with Client(sidecar.path) as c1, Client(sidecar.path) as c2:
        a = c1.session("dup", text="one", recover=True)
        b = c2.session("dup", text="one two")  # moves the session under a's feet
        with pytest.raises(SessionConflict):  # a's seq is stale: b's text must survive
            a.append(" three")
        r = b.append(" x")  # b's acknowledged state is intact and b goes on
        assert np.array_equal(r.ids, llama3.encode("one two x"))


def test_clients_ride_through_restarts_with_sessions_restored_at_start(start_sidecar, tmp_path, llama3):
    """With ``--state-dir``, each restart restores the sessions in the background: the clients'
    next ops are repairs, never re-encodes, and their IDs are the reference's."""
    st = start_sidecar(state_dir=str(tmp_path / "state"), state_flush_delay=0.01)
    with Client(st.path, reconnect_timeout=30) as c:
        texts = {f"p{i}": f"session {i}: " + "hello world. " * (200 * (i + 1)) + "🚀" for i in range(4)}
        sessions = {k: c.session(k, text=t, recover=True) for k, t in texts.items()}
        for round_ in range(2):
            st.restart()  # graceful: pending records are written at shutdown
            assert wait_until(lambda: st.sidecar.preload.done, 30)
            for k, s in sessions.items():
                ops = [("append", (f" turn {round_}: naïve café ✅",)), ("edit", (10, 16, "EDITED"))]
                for kind, args in ops:
                    r = getattr(s, kind)(*args)
                    texts[k] = apply_op(texts[k], kind, args)
                    assert r.path != "full"  # restored at start: a repair
                    assert np.array_equal(r.ids, llama3.encode(texts[k]))
        assert st.sidecar.service.full_path.stats().encodes == 0
