"""``--state-dir``: sessions outlive the process (graceful stop, SIGKILL) and resume by repair;
bad records (flipped byte, truncated, another tokenizer, stale, a state that is not the
reference) are counted misses that never yield wrong IDs; the directory must be private."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import toktier
from toktier.persist import SessionRecord, decode_record, encode_record, read_record, write_record
from toktier.session import state_certificate
from toktier.tools.corpus import large_text
from toktier_client import Client, SessionMiss, core
from toktier_client import protocol as P
from toktier_sidecar import Sidecar
from toktier_sidecar.cli import main as cli_main
from toktier_sidecar.statedir import InsecureStateDir, ensure_state_dir, record_name
from sidecar_harness import llama3, registry, sidecar, start_sidecar, wait_until  # noqa: F401  (fixtures)
from sidecar_harness import make_config, shm_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPAIRS = ("noop", "first_window", "widened")


def record_path(state_dir, session: str) -> str:
    return os.path.join(str(state_dir), record_name(os.getuid(), session))


def wait_for_record(state_dir, session: str, seq: int, timeout: float = 30) -> SessionRecord:
    """The session's record once it reached ``seq`` (written behind: poll the file itself)."""
    path = record_path(state_dir, session)
    deadline = time.monotonic() + timeout
    while True:
        try:
            rec = read_record(path)
            if rec.seq == seq:
                return rec
        except (OSError, toktier.TokTierError):
            pass
        assert time.monotonic() < deadline, f"record of {session!r} never reached seq {seq}"
        time.sleep(0.02)


def format2_bytes(rec: SessionRecord) -> bytes:
    """``rec`` as the previous build wrote it (record format 2; ``rec`` made with ``certify=True``)."""
    return encode_record(rec, version=2)


def restores(st) -> dict[str, float]:
    reg = st.sidecar.metrics.registry
    return {r: reg.get_sample_value("toktier_state_restore_total", {"result": r}) or 0.0
            for r in ("ok", "corrupt", "foreign", "stale", "invalid", "error", "store_error")}


def full_encodes(st) -> int:
    return st.sidecar.service.full_path.stats().encodes


# ----------------------------------------------------------------- in-process restarts
def test_graceful_restart_resumes_by_repair(start_sidecar, tmp_path, llama3):
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state))
    assert (os.stat(state).st_mode & 0o777) == 0o700  # created private
    text = large_text(200_000, seed=3)
    with Client(st.path) as c:
        s = c.session("long", text=text)
        r = s.append(" and more")
        text += " and more"
        seq = r.seq
        st.restart()  # graceful: pending records are written at shutdown
        assert full_encodes(st) == 0
        r = s.append(" after the restart")  # same client, same session id: restored, then repaired
        text += " after the restart"
        assert r.path in REPAIRS and r.seq == seq + 1
        assert np.array_equal(r.ids, llama3.encode(text))
        assert full_encodes(st) == 0  # restored from the record: no whole-text encode
        assert restores(st)["ok"] == 1
        r = s.edit(10, 20, "EDITED")  # and it goes on incrementally
        text = text[:10] + "EDITED" + text[20:]
        assert np.array_equal(r.ids, llama3.encode(text))
        assert s.close()
    wait_for_gone(record_path(state, "long"))


def wait_for_gone(path: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} was not removed"
        time.sleep(0.02)


def test_open_after_restart_syncs_by_repair_and_close_forgets(start_sidecar, tmp_path, llama3):
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state))
    with Client(st.path) as c:
        c.session("reopen", text="The quick brown fox jumps")
        c.session("forgotten", text="never touched again")
    st.restart()
    with Client(st.path) as c:  # a new client re-opens with the grown text: a sync, not a full encode
        r = c.session("reopen", text="The quick brown fox jumps over").last
        assert r is not None and r.path in REPAIRS
        assert np.array_equal(r.ids, llama3.encode("The quick brown fox jumps over"))
        assert full_encodes(st) == 0
        closed = c.run(core.request(P.Close(id=c.next_id(), session="forgotten"), P.Closed))
        assert closed.existed  # a record not restored yet is a session too: Close forgets it
    assert restores(st)["ok"] == 1
    wait_for_gone(record_path(state, "forgotten"))


def test_sigkill_keeps_the_written_state_and_resumes_by_repair(tmp_path, llama3):
    """A real ``toktier serve`` killed with SIGKILL: the next process restores the record and the
    same client's next op is a repair with the reference's IDs."""
    state, sock, prefix = tmp_path / "state", str(tmp_path / "t.sock"), f"ttsd{secrets.token_hex(4)}"
    args = [sys.executable, "-m", "toktier", "serve", "--socket", sock, "--shm-prefix", prefix,
            "--state-dir", str(state), "--log-level", "WARNING", "--workers", "2"]
    text = large_text(1_000_000, seed=5)
    proc = serve(args, sock)
    try:
        with Client(sock, reconnect_timeout=60) as c:
            s = c.session("big", text=text)
            for i in range(20):  # a burst, written behind
                r = s.append(f" turn {i}.")
                text += f" turn {i}."
            rec = wait_for_record(state, "big", r.seq)
            assert rec.text == text.encode() and np.array_equal(rec.ids, r.ids)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            proc = serve(args, sock)  # same prefix and runtime dir: it sweeps the dead run's segments
            r2 = s.append(" after SIGKILL")
            text += " after SIGKILL"
            assert r2.path in REPAIRS and r2.seq == r.seq + 1
            assert np.array_equal(r2.ids, llama3.encode(text))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert shm_names(prefix) == []
        assert decode_record(open(record_path(state, "big"), "rb").read()).seq == r2.seq  # kept for next time
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def serve(args: list[str], sock: str) -> subprocess.Popen:
    with contextlib.suppress(FileNotFoundError):  # a killed server leaves its socket file
        os.unlink(sock)
    proc = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "toktier serve exited"
        try:
            with Client(sock, reconnect=False) as c:
                c.ping()
            return proc
        except Exception:
            assert time.monotonic() < deadline, "toktier serve did not start"
            time.sleep(0.05)


# ----------------------------------------------------------------- bad records
def stopped_with_record(start_sidecar, tmp_path, session: str, text: str):
    """A stopped sidecar whose state dir holds ``session``'s record (and the client's seq)."""
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state))
    c = Client(st.path, reconnect_timeout=30)
    s = c.session(session, text=text, recover=True)
    r = s.append(" tail")
    st.stop()
    rec = read_record(record_path(state, session))
    assert rec.seq == r.seq
    return st, state, c, s, text + " tail", r.seq


def flip_a_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)


@pytest.mark.parametrize("damage", [flip_a_byte, truncate], ids=["flipped", "truncated"])
def test_damaged_record_is_a_counted_miss(start_sidecar, tmp_path, llama3, damage):
    st, state, c, s, text, _seq = stopped_with_record(start_sidecar, tmp_path, "dmg", large_text(20_000, seed=9))
    damage(record_path(state, "dmg"))
    st.start()
    with c:
        r = s.append(" more")  # the miss is recovered by re-sending the mirrored text
        text += " more"
        assert r.path == "full" and np.array_equal(r.ids, llama3.encode(text))
    assert restores(st)["corrupt"] == 1 and restores(st)["ok"] == 0


def test_record_for_another_tokenizer_is_foreign(start_sidecar, tmp_path, llama3):
    st, state, c, s, text, seq = stopped_with_record(start_sidecar, tmp_path, "other", "some text to keep")
    cl100k = toktier.load_tokenizer("cl100k_base")  # not served by this sidecar
    other = toktier.Session(cl100k, text)
    write_record(record_path(state, "other"), SessionRecord.of(other, namespace=os.getuid(), session_id="other",
                                                               seq=seq))
    st.start()
    with c:
        r = s.append(" x")
        assert r.path == "full" and np.array_equal(r.ids, llama3.encode(text + " x"))
    assert restores(st)["foreign"] == 1


@pytest.mark.parametrize("fmt", [2, 3])
def test_record_that_is_not_the_reference_is_invalid_without_recovery(start_sidecar, tmp_path, llama3, fmt):
    """Checksummed, yet not the reference encoding of its text.  Format 3: IDs of another state
    (a writer pairing a text with the wrong IDs): their lengths do not tile the text, so the
    record is verified by an encode, which refuses it.  Format 2: IDs its certificate (of other
    IDs) does not vouch for: verified by an encode too."""
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state))
    text = "hello world, hello tokens"
    with Client(st.path) as c:
        s = c.session("liar", text=text)
        seq = s.last.seq
        st.stop()
        good = llama3.encode(text).astype(np.uint32)
        if fmt == 3:
            ids = llama3.encode(text + " and more").astype(np.uint32)  # another state's IDs
            rec = SessionRecord(llama3.hash, llama3.name, llama3.specials, os.getuid(), "liar", seq, 0,
                                text.encode(), ids, "", nchars=len(text))
            write_record(record_path(state, "liar"), rec)
        else:
            ids = good.copy()
            ids[[1, 2]] = ids[[2, 1]]  # not the state its certificate (of `good`) vouches for
            rec = SessionRecord(llama3.hash, llama3.name, llama3.specials, os.getuid(), "liar", seq, 0,
                                text.encode(), ids, state_certificate(llama3, text.encode(), good))
            open(record_path(state, "liar"), "wb").write(format2_bytes(rec))
        st.start()
        with pytest.raises(SessionMiss):  # without recovery the miss is the caller's: never wrong IDs
            s.append("!")
    assert restores(st)["invalid"] == 1
    # the writer thread removes the refused record after the reply
    assert wait_until(lambda: not os.path.exists(record_path(state, "liar")))


def test_stale_record_is_a_miss_not_older_ids(start_sidecar, tmp_path, llama3):
    """A record that missed ops (as after a SIGKILL within the flush delay) is never served:
    the client has seen a later seq, so it is a miss and the client re-sends its text."""
    st, state, c, s, text, _seq = stopped_with_record(start_sidecar, tmp_path, "stale", "first version")
    path = record_path(state, "stale")
    old = open(path, "rb").read()
    st.start()
    with c:
        s.append(" second")
        text += " second"
        st.stop()
        open(path, "wb").write(old)  # roll the record back one op
        st.start()
        r = s.append(" third")
        text += " third"
        assert r.path == "full" and np.array_equal(r.ids, llama3.encode(text))
    assert restores(st)["stale"] == 1


# ----------------------------------------------------------------- the directory
def test_directory_must_be_private(tmp_path, registry):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    os.chmod(shared, 0o770)
    with pytest.raises(InsecureStateDir, match="writable by group or others"):
        Sidecar(make_config(tmp_path, state_dir=str(shared)), registry=registry, install_signals=False)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(InsecureStateDir, match="symlink"):
        ensure_state_dir(str(link))
    if os.geteuid() == 0:  # only root can make a directory someone else owns
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 12345, 12345)
        with pytest.raises(InsecureStateDir, match="owned by uid 12345"):
            ensure_state_dir(str(foreign))
    with pytest.raises(SystemExit, match="refusing state directory"):
        cli_main(["--socket", str(tmp_path / "x.sock"), "--state-dir", str(shared)])
    created = ensure_state_dir(str(tmp_path / "a" / "b"))
    assert os.stat(created).st_mode & 0o777 == 0o700


def test_records_are_named_by_hash_not_by_client_id(start_sidecar, tmp_path):
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state))
    sid = "../../etc/passwd\x00/" + "x" * 200
    with Client(st.path) as c:
        r = c.session(sid, text="payload").append(" more")
        rec = wait_for_record(state, sid, r.seq)
        assert rec.session == sid
    names = os.listdir(state)
    assert names == [record_name(os.getuid(), sid)] and all(ch in "0123456789abcdef." for ch in names[0][:-4])
