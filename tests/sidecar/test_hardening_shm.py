"""Issue 15, shared memory: a full /dev/shm is a typed error (never SIGBUS), and a restart
removes the segments a crashed run left behind (only its own).

Servers run as real ``toktier serve`` processes (so SIGKILL and SIGBUS are real); the
full-/dev/shm case runs server and clients in a private mount namespace with a 2 MiB
tmpfs on /dev/shm (``unshare -m``: needs root)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import posix_ipc
import pytest

from toktier_client import Client
from toktier_sidecar.shm import ArenaPool, InstanceLock, sweep_stale
from sidecar_harness import llama3, registry, shm_names  # noqa: F401  (fixtures)

NOBODY = 65534


def serve(sock: str, prefix: str, *extra: str) -> subprocess.Popen:
    """A ``toktier serve`` process; returns once it accepts connections."""
    proc = subprocess.Popen([sys.executable, "-m", "toktier_sidecar.cli", "--socket", sock, "--shm-prefix", prefix,
                             "--verify-rate", "0", "--workers", "2", "--log-level", "WARNING", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            Client(sock, reconnect=False).close()
            return proc
        except Exception:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("server did not start")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)


FULL_SHM_SCRIPT = textwrap.dedent('''
    import json, os, subprocess, sys, time
    import numpy as np
    import toktier
    from toktier_client import Client, ResourceExhausted, SessionMiss
    sys.path.insert(0, os.path.dirname(sys.argv[3]))
    sock, prefix = sys.argv[1], sys.argv[2]
    from test_hardening_shm import serve, stop
    server = serve(sock, prefix)
    tok = toktier.load_tokenizer("llama3")
    piece = "word " * 20000  # ~20K tokens: ~80 KB of IDs per session
    out = {"errors": [], "opened": 0}
    with Client(sock, reconnect=False) as by, Client(sock, reconnect=False) as off:
        text = "bystander:"
        s = by.session("by", text=text)
        for i in range(200):  # fill /dev/shm with the offender's sessions
            try:
                off.session(f"big{i}", text=f"{i} " + piece)
                out["opened"] += 1
            except ResourceExhausted as exc:
                out["errors"].append(("open", type(exc).__name__, str(exc)))
                break
        exact = True
        for j in range(5):  # the bystander is served, exactly, on a full /dev/shm
            text += f" step {j}, fine."
            exact &= bool(np.array_equal(s.append(f" step {j}, fine.").ids, tok.encode(text)))
        for i in range(3):  # room for a session that then grows until it cannot
            off.call(__import__("toktier_client").protocol.Close(id=off.next_id(), session=f"big{i}"))
        g = off.session("grow", text="start")
        for k in range(200):
            try:
                g.append(piece)
            except ResourceExhausted as exc:
                out["errors"].append(("grow", type(exc).__name__, str(exc)))
                break
        try:
            g.append("more")
            out["after_grow"] = "served"
        except SessionMiss as exc:
            out["after_grow"] = "miss:" + exc.reason
        text += " last."
        exact &= bool(np.array_equal(s.append(" last.").ids, tok.encode(text)))
        st = by.stats()
        out.update(exact=exact, sessions=st.sessions, shm_segments=st.shm_segments,
                   in_dev_shm=len([n for n in os.listdir("/dev/shm") if n.startswith(prefix + "-")]),
                   alive=server.poll() is None)
    stop(server)
    out["rc"] = server.returncode
    out["left"] = len([n for n in os.listdir("/dev/shm") if n.startswith(prefix + "-")])
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a private tmpfs on /dev/shm (unshare -m)")
def test_full_dev_shm_is_a_typed_error_not_sigbus(tmp_path):
    if not shutil.which("unshare"):
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=2m tmpfs /dev/shm"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs (unshare -m failed: {probe.stderr.strip()})")
    script = tmp_path / "full_shm.py"
    script.write_text(FULL_SHM_SCRIPT)
    sock = str(tmp_path / "run" / "t.sock")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size=2m tmpfs /dev/shm && exec "{sys.executable}" "{script}" "{sock}" ttfull "{__file__}"'],
        capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["alive"], out  # the sidecar survived a full /dev/shm (no SIGBUS)
    assert out["opened"] >= 3, out
    kinds = [e[0] for e in out["errors"]]
    assert kinds == ["open", "grow"], out  # the offender got the typed error, both ways
    assert all(e[1] == "ResourceExhausted" and "ENOSPC" in e[2] for e in out["errors"]), out
    assert out["after_grow"] == "miss:closed", out  # the session that could not grow was ended
    assert out["exact"], out  # the bystander kept being served with exact IDs
    assert out["in_dev_shm"] == out["shm_segments"], out  # failed allocations left nothing behind
    assert out["rc"] == 0 and out["left"] == 0, out


def test_restart_sweeps_segments_of_sigkilled_runs(tmp_path, llama3):
    """3 cycles of "10 sessions, SIGKILL": segments pile up until the next start, which removes them."""
    run = tmp_path / "run"
    sock, prefix = str(run / "t.sock"), f"ttsw{secrets.token_hex(3)}"
    left_after_kill = []
    for cycle in range(3):
        proc = serve(sock, prefix)
        assert shm_names(prefix) == [], f"cycle {cycle}: the start did not sweep"
        assert not [f for f in os.listdir(run) if f.endswith(".lock") and str(proc.pid) not in open(run / f).read()]
        with Client(sock, reconnect=False) as c:
            for i in range(10):
                r = c.session(f"s{i}", text=f"session {i} " * 50).last
                assert np.array_equal(r.ids, llama3.encode(f"session {i} " * 50))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        left_after_kill.append(len(shm_names(prefix)))
    assert left_after_kill == [10, 10, 10]  # each crash leaks, each start reclaims
    proc = serve(sock, prefix)
    try:
        assert shm_names(prefix) == []
        with Client(sock, reconnect=False) as c:
            assert c.stats().shm_segments == 0
    finally:
        stop(proc)
    assert shm_names(prefix) == [] and not [f for f in os.listdir(run) if f.endswith(".lock")]


def _foreign_segment(name: str, uid: int) -> None:
    """Create /dev/shm/<name> owned by ``uid`` (a forked child drops privileges)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            posix_ipc.SharedMemory("/" + name, flags=posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def test_sweep_removes_only_provably_dead_own_segments(tmp_path):
    prefix = f"ttown{secrets.token_hex(3)}"
    mine, other_dir = tmp_path / "mine", tmp_path / "other"
    mine.mkdir(mode=0o700)
    other_dir.mkdir(mode=0o700)

    def crashed_instance(directory) -> list[str]:  # a forked "server" that dies holding its lock
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            pool = ArenaPool(prefix)
            InstanceLock(str(directory), prefix, pool.instance).acquire()
            names = [pool.session_arena().allocate(10) is not None and pool.names()[-1] for _ in range(3)]
            os.write(w, json.dumps(names).encode())
            os.kill(os.getpid(), signal.SIGKILL)
        os.close(w)
        names = json.loads(os.read(r, 65536))
        os.close(r)
        os.waitpid(pid, 0)
        return [n.lstrip("/") for n in names]

    dead = crashed_instance(mine)
    dead_elsewhere = crashed_instance(other_dir)  # same prefix, another runtime dir: not provably ours
    live = ArenaPool(prefix)  # a running instance in the same dir: its lock is held
    live_lock = InstanceLock(str(mine), prefix, live.instance).acquire()
    live_seg = live.handoff(np.arange(5, dtype=np.uint32))
    untagged = f"{prefix}-{secrets.token_urlsafe(16)}"  # an older version's name: no instance tag
    posix_ipc.SharedMemory("/" + untagged, flags=posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    foreign = f"{prefix}-{'a' * 12}-{secrets.token_urlsafe(8)}"
    if os.geteuid() == 0:
        _foreign_segment(foreign, NOBODY)
        with open(mine / f"{prefix}-{'a' * 12}.lock", "w"):
            pass  # even with an unlocked lock file of ours, another uid's segment is not touched
    try:
        me = ArenaPool(prefix)
        report = sweep_stale(prefix, str(mine), own_instance=me.instance)
        names = set(shm_names(prefix))
        assert not names & set(dead) and report.removed == 3
        assert set(dead_elsewhere) <= names and live_seg.name.lstrip("/") in names and untagged in names
        assert report.live == 1 and report.unproven >= 3
        assert not (mine / f"{prefix}-{dead[0].split('-')[1]}.lock").exists()  # its lock file went too
        if os.geteuid() == 0:
            assert foreign in names and report.foreign == 1
    finally:
        live_lock.release()
        live.unlink_all()
        for n in shm_names(prefix):
            posix_ipc.unlink_shared_memory("/" + n)
