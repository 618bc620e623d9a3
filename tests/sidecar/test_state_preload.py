"""Restore at start (``--state-dir``, ``state_preload``): the records an earlier run left are
restored in the background, most recent first, within the memory budget, and held until their
session's first op, which is then a warm repair; an op that races the preload restores its
record on demand (one restore per record either way); corrupt and foreign records are counted
misses and removed; format-2 records (the previous build's) are read; held sessions give
memory back to open ones.  Real sockets, real ``toktier serve`` processes for the signals,
real tokenizers; every result is compared with the reference encoding of the whole text."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

import toktier
from toktier.persist import SessionRecord, decode_record, read_record, write_record
from toktier.tools.corpus import large_text
from toktier_client import Client, SessionMiss, core
from toktier_client import protocol as P
from toktier_sidecar import Sidecar
from toktier_sidecar.statedir import record_name
from sidecar_harness import llama3, registry, start_sidecar, wait_until  # noqa: F401  (fixtures)
from sidecar_harness import shm_names
from test_state_dir import REPAIRS, format2_bytes, full_encodes, record_path, restores, serve, wait_for_record

EMOJI = " 🚀 naïve café — 東京 ✅ "


def preload(st) -> dict[str, float]:
    reg = st.sidecar.metrics.registry
    return {r: reg.get_sample_value("toktier_state_preload_sessions_total", {"result": r}) or 0.0
            for r in ("restored", "claimed", "released", "skipped_budget", "raced")}


def preloaded(st, timeout: float = 60) -> dict[str, float]:
    """The preload's counters once it finished."""
    assert wait_until(lambda: st.sidecar.preload is not None and st.sidecar.preload.done, timeout), \
        "the restore at start did not finish"
    return preload(st)


def texts_for(n: int, size: int) -> dict[str, str]:
    """``n`` session texts of ``size`` characters, English and emoji-bearing mixed."""
    return {f"s{i}": large_text(size, seed=40 + i, kind="english" if i % 2 else "mixed") + EMOJI
            for i in range(n)}


def write_sessions(st, state, texts: dict[str, str]) -> dict[str, int]:
    """Open every session, change it once, wait until its record holds that state; the seqs.
    Records are then dated one second apart, in the order given (the last is the most recent)."""
    seqs = {}
    with Client(st.path) as c:
        for sid, text in texts.items():
            r = c.session(sid, text=text).append(" tail")
            texts[sid] = text + " tail"
            seqs[sid] = r.seq
    for sid, seq in seqs.items():
        wait_for_record(state, sid, seq)
    now = time.time()
    for i, sid in enumerate(texts):
        os.utime(record_path(state, sid), (now - 100 + i, now - 100 + i))
    return seqs


# ----------------------------------------------------------------- in-process restarts
def test_restored_at_start_then_every_op_is_a_repair_exact(start_sidecar, tmp_path, llama3):
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state))
    texts = texts_for(4, 60_000)
    seqs = write_sessions(st, state, texts)
    st.restart()
    counts = preloaded(st)
    assert counts["restored"] == 4 and counts["skipped_budget"] == 0
    assert st.sidecar.service.store.stats().live == 0  # held, not open: nothing is open before its first op
    assert full_encodes(st) == 0
    with Client(st.path) as c:
        for sid, text in texts.items():
            texts[sid] = text + " after the restart ✅"
            s = c.session(sid, text=texts[sid])  # a new client's Open with the grown text: a sync of the held one
            r = s.last
            assert r.path in REPAIRS and r.seq == seqs[sid] + 1
            assert np.array_equal(r.ids, llama3.encode(texts[sid]))
            r = s.edit(3, 9, "EDIT")
            texts[sid] = texts[sid][:3] + "EDIT" + texts[sid][9:]
            assert np.array_equal(r.ids, llama3.encode(texts[sid]))
    assert full_encodes(st) == 0
    assert restores(st)["ok"] == 4 and preload(st)["claimed"] == 4
    assert st.sidecar.preload.held == {}


def test_close_create_only_and_stale_on_held_sessions(start_sidecar, tmp_path, llama3):
    """A held session's first op gets the checks an on-demand restore makes: a Close forgets its
    record, a recovery re-create replaces it, and a record behind the client's seq is a miss."""
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state))
    texts = {"closed": "to be closed", "recreated": "to be re-created", "stale": "behind the client"}
    seqs = write_sessions(st, state, texts)
    st.restart()
    assert preloaded(st)["restored"] == 3
    with Client(st.path) as c:
        closed = c.run(core.request(P.Close(id=c.next_id(), session="closed"), P.Closed))
        assert closed.existed
        r = c.run(core.request(P.Open(id=c.next_id(), session="recreated", text="fresh text", create_only=True),
                               P.Ids))
        assert r.path == "full" and r.seq == 1  # a new session, not the record's
        with pytest.raises(SessionMiss):  # the client saw a later seq than the record holds
            c.run(core.request(P.Append(id=c.next_id(), session="stale", text="!", expect_seq=seqs["stale"] + 1),
                               P.Ids))
    assert restores(st)["stale"] == 1 and restores(st)["ok"] == 0
    assert st.sidecar.preload.held == {} and preload(st)["released"] == 1  # the Close's
    assert wait_until(lambda: not os.path.exists(record_path(state, "closed")))
    assert wait_until(lambda: not os.path.exists(record_path(state, "stale")))


def test_an_op_racing_the_preload_restores_once(start_sidecar, tmp_path, llama3, monkeypatch):
    """The preload is held on its first record (a test hook).  An op on that very record waits
    for the preload's read and opens what it held; ops on records the preload has not reached
    restore them on demand; when the preload gets there it skips them.  Every record is
    restored once (``ok`` once per session), every result is exact."""
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state))
    texts = texts_for(4, 30_000)
    write_sessions(st, state, texts)  # s3 is the most recent: the preload starts there
    st.stop()
    gate, entered = threading.Event(), threading.Event()
    real = Sidecar._preload_one

    def gated(self, name):
        if name == record_name(os.getuid(), "s3"):
            entered.set()
            assert gate.wait(30)
        return real(self, name)

    monkeypatch.setattr(Sidecar, "_preload_one", gated)
    st.start()
    assert entered.wait(30)
    results = {}

    def first_op(sid: str) -> None:
        with Client(st.path) as c:
            results[sid] = c.session(sid, text=texts[sid] + " raced").last

    waiter = threading.Thread(target=first_op, args=("s3",))
    waiter.start()  # waits for the preload's read of its record
    for sid in ("s0", "s1"):  # not reached yet: restored on demand, while the preload is held
        first_op(sid)
    assert "s3" not in results
    gate.set()
    waiter.join(30)
    counts = preloaded(st)
    first_op("s2")  # reached by the preload after the gate opened: held
    for sid, r in results.items():
        assert r.path in REPAIRS and np.array_equal(r.ids, llama3.encode(texts[sid] + " raced")), sid
    assert restores(st)["ok"] == 4  # one restore per record
    assert counts["raced"] == 2 and counts["restored"] == 2 and preload(st)["claimed"] == 2
    assert full_encodes(st) == 0


def test_corrupt_foreign_and_format2_records_during_the_preload(start_sidecar, tmp_path, llama3):
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state))
    texts = {"good": "kept intact", "flipped": large_text(20_000, seed=1), "other-tok": "another tokenizer",
             "renamed": "filed under another name", "old": "written by the previous build " + EMOJI}
    seqs = write_sessions(st, state, texts)
    st.stop()
    path = record_path(state, "flipped")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    cl100k = toktier.load_tokenizer("cl100k_base")
    write_record(record_path(state, "other-tok"), SessionRecord.of(
        toktier.Session(cl100k, texts["other-tok"]), namespace=os.getuid(), session_id="other-tok",
        seq=seqs["other-tok"]))
    os.replace(record_path(state, "good"), record_path(state, "renamed"))  # "good"'s record, named for "renamed"
    old = SessionRecord.of(toktier.Session(llama3, texts["old"]), namespace=os.getuid(), session_id="old",
                           seq=seqs["old"], certify=True)
    open(record_path(state, "old"), "wb").write(format2_bytes(old))
    st.start()
    counts = preloaded(st)
    assert counts["restored"] == 1  # the format-2 record
    assert restores(st)["corrupt"] == 1 and restores(st)["foreign"] == 2
    for sid in ("flipped", "other-tok", "renamed"):  # removed, as an op's restore removes them
        assert wait_until(lambda: not os.path.exists(record_path(state, sid))), sid
    with Client(st.path) as c:
        r = c.session("old", text=texts["old"] + " and the new build").last
        assert r.path in REPAIRS and np.array_equal(r.ids, llama3.encode(texts["old"] + " and the new build"))
        rec = wait_for_record(state, "old", r.seq)  # rewritten in the new format
        assert rec.version == 3 and rec.nchars == len(texts["old"] + " and the new build")
        for sid in ("flipped", "other-tok", "renamed"):  # misses, answered from the client's text
            s = c.session(sid, text=texts[sid] + " more", recover=True)
            assert s.last.path == "full" and np.array_equal(s.last.ids, llama3.encode(texts[sid] + " more"))
    assert restores(st)["ok"] == 1


def test_the_preload_stays_within_the_memory_budget(start_sidecar, tmp_path, llama3):
    """Records that do not fit next to the open sessions are left to their first op (most recent
    ones held first); held ones give their memory back when open sessions need it; either way
    every op is exact and the records stay."""
    state = tmp_path / "state"
    texts = {f"s{i}": large_text(100_000, seed=60 + i, kind="english") for i in range(5)}  # about equal sizes
    st = start_sidecar(state_dir=str(state))
    write_sessions(st, state, texts)
    st.stop()
    sizes = {sid: os.path.getsize(record_path(state, sid)) for sid in texts}
    budget = int(2.5 * max(sizes.values()))  # room for two restored sessions
    st.config = dataclasses.replace(st.config, memory_budget=budget)
    st.start()
    counts = preloaded(st)
    pre = st.sidecar.preload
    assert counts["restored"] == 2 and counts["skipped_budget"] == 3
    assert pre.bytes <= budget
    assert set(pre.held) == {record_name(os.getuid(), sid) for sid in ("s4", "s3")}  # the most recent
    with Client(st.path) as c:
        # Left to its first op: restored on demand; it takes the room held ones had.
        r = c.session("s0", text=texts["s0"] + " on demand").last
        assert r.path in REPAIRS and np.array_equal(r.ids, llama3.encode(texts["s0"] + " on demand"))
        live = st.sidecar.service.store.stats().bytes_held
        assert live + pre.bytes <= budget and preload(st)["released"] >= 1
        assert os.path.exists(record_path(state, "s3"))  # released, not forgotten
        for sid in ("s4", "s3", "s1"):
            r = c.session(sid, text=texts[sid] + " later").last
            assert r.path in REPAIRS and np.array_equal(r.ids, llama3.encode(texts[sid] + " later")), sid
    assert full_encodes(st) == 0


def test_preload_off_restores_on_demand_only(start_sidecar, tmp_path, llama3):
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state), state_preload=False)
    texts = {"lazy": "restored by its first op"}
    write_sessions(st, state, texts)
    st.restart()
    assert st.sidecar.preload is None
    with Client(st.path) as c:
        r = c.session("lazy", text=texts["lazy"] + "!").last
        assert r.path in REPAIRS and np.array_equal(r.ids, llama3.encode(texts["lazy"] + "!"))
    assert restores(st)["ok"] == 1


# ----------------------------------------------------------------- real processes, signals
def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, name: str, labels: str = "") -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0


def scrape_sum(port: int, name: str) -> float:
    """The sum of every labelled sample of ``name``."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_restart_of_a_real_server_restores_at_start(tmp_path, llama3, sig):
    """``toktier serve`` stopped by a signal; the next process restores every record in the
    background, and the first op on each session is a repair with the reference's IDs."""
    state, sock, prefix = tmp_path / "state", str(tmp_path / "t.sock"), f"ttpl{secrets.token_hex(4)}"
    port = free_port()
    args = [sys.executable, "-m", "toktier", "serve", "--socket", sock, "--shm-prefix", prefix,
            "--state-dir", str(state), "--log-level", "WARNING", "--workers", "2", "--verify-rate", "0",
            "--metrics-port", str(port)]
    texts = texts_for(3, 200_000)
    proc = serve(args, sock)
    try:
        with Client(sock, reconnect_timeout=60) as c:
            sessions = {sid: c.session(sid, text=text) for sid, text in texts.items()}
            for sid, s in sessions.items():
                r = s.append(" turn")
                texts[sid] += " turn"
                wait_for_record(state, sid, r.seq)
            proc.send_signal(sig)
            assert proc.wait(60) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
            proc = serve(args, sock)
            assert wait_until(lambda: scrape(port, "toktier_state_preload_sessions_total", '{result="restored"}')
                              == 3, 60)
            assert scrape(port, "toktier_state_preload_pending") == 0
            assert scrape(port, "toktier_state_preload_held") == 3
            for sid, s in sessions.items():
                r = s.append(" after the restart")
                texts[sid] += " after the restart"
                assert r.path in REPAIRS and np.array_equal(r.ids, llama3.encode(texts[sid])), sid
            assert scrape(port, "toktier_state_preload_sessions_total", '{result="claimed"}') == 3
            assert scrape_sum(port, "toktier_full_path_encodes_total") == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert shm_names(prefix) == []
        for sid in texts:
            assert read_record(record_path(state, sid)).text == texts[sid].encode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_growing_conversation_makes_held_sessions_give_way(start_sidecar, tmp_path, llama3):
    """Conversations share the memory budget: opening and growing one releases sessions restored at
    start (their records stay, restored on demand and exact), as a session op does."""
    from toktier import chat

    state = tmp_path / "state"
    texts = {f"s{i}": large_text(100_000, seed=80 + i, kind="english") for i in range(2)}
    st = start_sidecar(state_dir=str(state))
    write_sessions(st, state, texts)
    st.stop()
    budget = int(3 * max(os.path.getsize(record_path(state, sid)) for sid in texts))
    st.config = dataclasses.replace(st.config, memory_budget=budget)
    st.start()
    assert preloaded(st)["restored"] == 2
    pre = st.sidecar.preload
    messages = [{"role": "user", "content": large_text(40_000, seed=99, kind="english")}]
    with Client(st.path) as c:
        h = c.conversation("conv", tokenizer="llama3")
        r = h.append_messages(messages)
        want = llama3.encode(chat.render(messages, chat.template_for(llama3), add_generation_prompt=True))
        assert np.array_equal(r.ids, want)
        assert preload(st)["released"] >= 1
        assert st.sidecar.service.store.stats().bytes_held + pre.bytes <= budget
        for sid in texts:  # released or still held: either way exact, and no record was lost
            assert os.path.exists(record_path(state, sid))
            r = c.session(sid, text=texts[sid] + " again").last
            assert r.path in REPAIRS and np.array_equal(r.ids, llama3.encode(texts[sid] + " again")), sid
