"""``--state-store``: session records shared through a real Valkey/Redis server (started by the
fixture on a unix socket; no mock), so that a conversation moved to another sidecar resumes
there by repair; bad values are counted misses; a dead server never fails an op.  Also the
tokenizer caches' L1 entries kept in ``--state-dir`` across a restart."""

from __future__ import annotations

import contextlib
import doctest
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import toktier
from toktier.persist import SessionRecord, decode_record, encode_record
from toktier.tools.corpus import large_text
from toktier_client import Client, core
from toktier_client import protocol as P
from toktier_sidecar import statestore
from toktier_sidecar.cli import main as cli_main
from toktier_sidecar.statedir import CacheFiles
from toktier_sidecar.statestore import InvalidStateStore, StateStore, parse_store_url
from sidecar_harness import llama3, registry, start_sidecar, wait_until  # noqa: F401  (fixtures)
from test_state_dir import REPAIRS, full_encodes, restores, serve

redis_py = pytest.importorskip("redis", reason="the redis client library: pip install 'toktier[redis]'")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER = shutil.which("valkey-server") or shutil.which("redis-server")


class StoreServer:
    """A real ``valkey-server``/``redis-server`` on a unix socket in a private directory,
    without persistence; ``kill()`` and ``start()`` simulate an outage at the same socket."""

    def __init__(self, directory) -> None:
        self.dir = str(directory)
        self.sock = os.path.join(self.dir, "store.sock")
        self.url = f"unix://{self.sock}?db=0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "StoreServer":
        self.proc = subprocess.Popen(
            [SERVER, "--port", "0", "--unixsocket", self.sock, "--unixsocketperm", "700", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answers() -> bool:
            assert self.proc.poll() is None, f"{SERVER} exited with {self.proc.returncode}"
            try:
                return bool(self.client().ping())
            except (redis_py.RedisError, OSError):
                return False
        assert wait_until(answers, 30), f"{SERVER} did not start"
        return self

    def client(self):
        return redis_py.Redis(unix_socket_path=self.sock, socket_timeout=5)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sock)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


@pytest.fixture
def store_server(tmp_path):
    if SERVER is None:
        pytest.skip("no valkey-server or redis-server binary: apt-get install redis-server (Debian package "
                    "redis-server) or valkey-server")
    d = tmp_path / "store"
    d.mkdir(mode=0o700)
    srv = StoreServer(d).start()
    yield srv
    srv.stop()


def store_ops(st, op: str, result: str) -> float:
    return st.sidecar.metrics.registry.get_sample_value("toktier_state_store_ops_total",
                                                        {"op": op, "result": result}) or 0.0


def stored(srv: StoreServer, session: str, seq: int, *, prefix: str = "toktier:", timeout: float = 30) -> SessionRecord:
    """The session's record in the store once it reached ``seq`` (written behind: poll the server)."""
    store = StateStore(parse_store_url(srv.url), prefix=prefix, ttl=60)
    key = _Key(os.getuid(), session)
    box: list[SessionRecord] = []

    def reached() -> bool:
        data = srv.client().get(store.key(key))
        if data is not None and decode_record(data).seq == seq:
            box.append(decode_record(data))
            return True
        return False
    assert wait_until(reached, timeout), f"record of {session!r} never reached seq {seq} in the store"
    store.close()
    return box[0]


class _Key:
    def __init__(self, namespace, session) -> None:
        self.namespace, self.session = namespace, session


# ----------------------------------------------------------------- configuration
def test_store_urls_and_actionable_errors(tmp_path):
    assert doctest.testmod(statestore, optionflags=doctest.ELLIPSIS).failed == 0
    assert parse_store_url("valkey://cache:6380/3").url == "redis://cache:6380/3"
    assert parse_store_url("valkeys://cache").url == "rediss://cache"
    assert parse_store_url("redis://u:pw@h/1").display == "redis://u:***@h/1"
    for bad, says in [("cache:6379", "unknown scheme"), ("redis://", "no host"), ("redis://h/zero", "not a number"),
                      ("unix://relative.sock", "absolute path"), ("redis://h:99999", "out of range")]:
        with pytest.raises(InvalidStateStore, match=says):
            parse_store_url(bad)
    with pytest.raises(SystemExit, match="unknown scheme 'mysql'.*use redis://"):
        cli_main(["--socket", str(tmp_path / "x.sock"), "--state-store", "mysql://db"])
    with pytest.raises(SystemExit, match="prefix"):
        cli_main(["--socket", str(tmp_path / "x.sock"), "--state-store", "redis://h", "--state-store-prefix", "a b"])


# ----------------------------------------------------------------- the backend itself
def test_round_trip_ttl_and_bounds(store_server, llama3):
    ttl = 120.0
    store = StateStore(parse_store_url(store_server.url), prefix="tt-test:", ttl=ttl, max_value=64 << 10)
    calls: list[tuple[str, str]] = []
    store.on_op = lambda op, result: calls.append((op, result))
    key = _Key(os.getuid(), "../weird id\x00")
    s = toktier.Session(llama3, large_text(5_000, seed=1))
    data = encode_record(SessionRecord.of(s, namespace=key.namespace, session_id=key.session, seq=4))
    assert store.load(key) is None
    store.save(key, data)
    assert store.load(key) == data
    assert 0 < store.ttl_of(key) <= ttl * 1000  # the key expires with the session TTL
    k = store.key(key)
    assert k.startswith("tt-test:s:") and all(ch in "0123456789abcdef" for ch in k[len("tt-test:s:"):])
    big = toktier.Session(llama3, large_text(100_000, seed=2))  # over the 64 KiB bound: not written, old one gone
    store.save(key, encode_record(SessionRecord.of(big, namespace=key.namespace, session_id=key.session, seq=5)))
    assert store.load(key) is None and ("set", "too_large") in calls
    store.save(key, data)
    store.delete(key)
    assert store.load(key) is None
    assert ("get", "ok") in calls and ("get", "miss") in calls and ("delete", "ok") in calls
    store.close()


# ----------------------------------------------------------------- sessions move between sidecars
def test_session_continues_on_another_sidecar_by_repair(store_server, start_sidecar, llama3):
    a = start_sidecar(state_store=store_server.url)
    b = start_sidecar(state_store=store_server.url)
    text = large_text(100_000, seed=11)
    with Client(a.path) as ca:
        s = ca.session("conv", text=text)
        for i in range(5):
            r = s.append(f" turn {i}.")
            text += f" turn {i}."
    rec = stored(store_server, "conv", r.seq)
    assert rec.text == text.encode() and np.array_equal(rec.ids, r.ids)
    ttl_ms = store_server.client().pttl(b"toktier:s:" + _digest("conv"))
    assert 0 < ttl_ms <= a.config.session_ttl * 1000  # keys expire with the session TTL
    text += " The router sent this turn to node B."
    with Client(b.path) as cb:  # node B gets the whole conversation (a stateless front end re-sends it)
        sb = cb.session("conv", text=text)
        assert sb.last.path in REPAIRS and sb.last.seq == r.seq + 1
        assert np.array_equal(sb.last.ids, llama3.encode(text))
        assert full_encodes(b) == 0  # resumed from the store's record: no whole-text encode
        assert restores(b)["ok"] == 1 and store_ops(b, "get", "ok") == 1
        r2 = sb.append(" And goes on there.")
        text += " And goes on there."
        assert r2.path in REPAIRS and np.array_equal(r2.ids, llama3.encode(text))
    assert stored(store_server, "conv", r2.seq).text == text.encode()  # B writes behind too
    with Client(b.path) as cb:  # a brand-new session is a store miss, not an error
        assert cb.session("fresh", text="hello").last.path == "full"
    assert restores(b)["store_error"] == 0 and store_ops(b, "get", "miss") >= 1
    with Client(b.path) as cb:  # Close deletes the shared record
        assert cb.session("conv", text=text).close()
    assert wait_until(lambda: store_server.client().exists(b"toktier:s:" + _digest("conv")) == 0)


def test_state_dir_first_then_the_store(store_server, start_sidecar, tmp_path, llama3):
    """Both configured: the local record is tried first; one the client has moved past (another
    node served later turns) is stale, and the store's newer record serves instead."""
    a = start_sidecar(state_dir=str(tmp_path / "state-a"), state_store=store_server.url)
    b = start_sidecar(state_store=store_server.url)
    text = large_text(30_000, seed=6)
    with Client(a.path) as ca:
        r = ca.session("hop", text=text).append(" one")
        text += " one"
    stored(store_server, "hop", r.seq)
    a.stop()  # A's dir keeps the record at r.seq
    with Client(b.path) as cb:  # B serves the next turn and writes seq r.seq + 1 to the store
        sb = cb.session("hop", text=text + " two")
        text += " two"
        seq = sb.last.seq
    stored(store_server, "hop", seq)
    a.start()
    # A restores its own record at start (the dir's records only: the store's are every node's)...
    assert wait_until(lambda: a.sidecar.preload.done) and len(a.sidecar.preload.held) == 1
    with Client(a.path) as ca:  # ...but a client that saw seq: A's own record is stale, the store's is not
        reply = ca.run(core.request(P.Append(id=ca.next_id(), session="hop", text=" three", expect_seq=seq), P.Ids))
        text += " three"
        assert reply.seq == seq + 1 and reply.path in REPAIRS
        assert restores(a)["stale"] == 1 and restores(a)["ok"] == 1 and full_encodes(a) == 0
        last = ca.session("hop", text=text).last  # the same text: a no-op sync that hands back the IDs
        assert np.array_equal(last.ids, llama3.encode(text))


def _digest(session: str) -> bytes:
    from toktier_sidecar.statedir import key_digest
    return key_digest(os.getuid(), session).encode()


def damage_flip(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("damage,result", [
    (damage_flip, "corrupt"),
    (lambda d: d[:-7], "corrupt"),
    (lambda d: b"not a record at all", "corrupt"),
    ("foreign", "foreign"),
], ids=["flipped", "truncated", "garbage", "other-tokenizer"])
def test_bad_store_values_are_counted_misses(store_server, start_sidecar, llama3, damage, result):
    a = start_sidecar(state_store=store_server.url)
    b = start_sidecar(state_store=store_server.url)
    text = large_text(20_000, seed=4)
    with Client(a.path) as ca:
        r = ca.session("bad", text=text).append(" tail")
        text += " tail"
    stored(store_server, "bad", r.seq)
    k = b"toktier:s:" + _digest("bad")
    if damage == "foreign":
        other = toktier.Session(toktier.load_tokenizer("cl100k_base"), text)
        store_server.client().set(k, encode_record(SessionRecord.of(other, namespace=os.getuid(), session_id="bad",
                                                                    seq=r.seq)))
    else:
        store_server.client().set(k, damage(store_server.client().get(k)))
    with Client(b.path) as cb:
        last = cb.session("bad", text=text + " more").last  # the miss: opened from the text, never wrong IDs
        assert last.path == "full" and np.array_equal(last.ids, llama3.encode(text + " more"))
    assert restores(b)[result] == 1 and restores(b)["ok"] == 0


def test_store_down_never_fails_an_op(store_server, start_sidecar, llama3, caplog):
    st = start_sidecar(state_store=store_server.url, state_flush_delay=0.05, state_store_timeout=0.5)
    text = "a conversation that outlives its store"
    with Client(st.path) as c:
        s = c.session("up", text=text)
        stored(store_server, "up", s.last.seq)
        store_server.kill()
        for i in range(30):  # appends, new sessions, closes: all answered, all exact
            r = s.append(f" {i}")
            text += f" {i}"
            assert np.array_equal(r.ids, llama3.encode(text))
            fresh = c.session(f"new{i}", text=f"new session {i}")
            assert np.array_equal(fresh.last.ids, llama3.encode(f"new session {i}"))
            assert fresh.close()
        assert wait_until(lambda: store_ops(st, "set", "error") + store_ops(st, "set", "skipped") >= 1)
        assert restores(st)["store_error"] >= 1  # lookups of the new sessions could not be done: counted
        warnings = [rec for rec in caplog.records if "state store" in rec.getMessage() and "failed" in rec.getMessage()]
        assert len(warnings) == 1  # logged once per outage, not per op
        store_server.start()  # the store comes back: writes resume after the backoff
        before = store_ops(st, "set", "ok")

        def resumed() -> bool:
            s.append(".")
            return store_ops(st, "set", "ok") > before
        assert wait_until(resumed, 60)


# ----------------------------------------------------------------- two processes, SIGKILL
def free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def scrape(port: int, name: str, labels: str = "") -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name + ("{" if labels else "")) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_sidecar_processes_share_a_store(tmp_path, store_server, llama3):
    """Sidecar A and B are separate ``toktier serve`` processes (own sockets, own state dirs,
    one store).  A session created and appended on A continues on B by repair, and again after
    A is SIGKILLed; the IDs are the reference encoding of the full text."""
    procs = []

    def start(name: str):
        sock, port = str(tmp_path / f"{name}.sock"), free_port()
        args = [sys.executable, "-m", "toktier", "serve", "--socket", sock, "--shm-prefix", f"tt2s{name}{os.getpid()}",
                "--state-dir", str(tmp_path / f"state-{name}"), "--state-store", store_server.url,
                "--metrics-port", str(port), "--log-level", "WARNING", "--workers", "2", "--verify-rate", "0"]
        procs.append(serve(args, sock))
        return sock, port

    try:
        (sock_a, _), (sock_b, port_b) = start("a"), start("b")
        text = large_text(300_000, seed=21)
        with Client(sock_a) as ca:
            s = ca.session("moving", text=text)
            for i in range(10):
                r = s.append(f" step {i}")
                text += f" step {i}"
        stored(store_server, "moving", r.seq)
        procs[0].send_signal(signal.SIGKILL)  # after the flush: B has everything A acknowledged
        procs[0].wait(30)
        text += " on B"
        with Client(sock_b) as cb:
            sb = cb.session("moving", text=text)
            assert sb.last.path in REPAIRS and np.array_equal(sb.last.ids, llama3.encode(text))
            r = sb.append(" and again")
            text += " and again"
            assert np.array_equal(r.ids, llama3.encode(text))
        assert scrape(port_b, "toktier_state_restore_total", 'result="ok"') == 1
        assert scrape(port_b, "toktier_full_path_encodes_total") == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(30)


# ----------------------------------------------------------------- tokenizer caches in --state-dir
def test_l1_entries_survive_a_restart(start_sidecar, tmp_path, llama3):
    state = tmp_path / "state"
    st = start_sidecar(state_dir=str(state), state_cache_flush_interval=0.1)
    system = large_text(40_000, seed=8)
    with Client(st.path) as c:
        assert c.encode(system + " Q1", cache=True).layer == "miss"
        assert c.encode(system + " Q2", cache=True).layer == "l1"
        assert wait_until(lambda: any(n.endswith(".l1") for n in os.listdir(state)))
    st.restart()
    reg = st.sidecar.metrics.registry
    assert reg.get_sample_value("toktier_tokenizer_cache_restored_entries_total", {"result": "ok"}) == 2
    with Client(st.path) as c:  # right after the restart: hits, exact
        r = c.encode(system + " Q2", cache=True)
        assert r.layer == "l0" and np.array_equal(r.ids, llama3.encode(system + " Q2"))
        r = c.encode(system + " Q3", cache=True)
        assert r.layer == "l1" and r.reused_chars > 39_000 and np.array_equal(r.ids, llama3.encode(system + " Q3"))
    st.stop()
    (name,) = [n for n in os.listdir(state) if n.endswith(".l1")]
    data = bytearray((state / name).read_bytes())
    data[100] ^= 0xFF  # the first (most recent) entry is damaged: counted, the others still adopted
    (state / name).write_bytes(bytes(data))
    st.start()
    reg = st.sidecar.metrics.registry
    assert reg.get_sample_value("toktier_tokenizer_cache_restored_entries_total", {"result": "corrupt"}) == 1
    assert reg.get_sample_value("toktier_tokenizer_cache_restored_entries_total", {"result": "ok"}) >= 1
    with Client(st.path) as c:
        r = c.encode(system + " Q4", cache=True)
        assert r.layer == "l1" and np.array_equal(r.ids, llama3.encode(system + " Q4"))


def test_cache_file_is_bounded_by_the_l1_budget(tmp_path, llama3):
    from toktier_sidecar.statedir import StateDir
    cache = toktier.PrefixCache(llama3)
    texts = [large_text(20_000, seed=30 + i) for i in range(6)]
    for t in texts:
        cache.encode(t)
    sd = StateDir(str(tmp_path / "sd"), ttl=60)
    files = CacheFiles(sd, max_bytes=3 * 20_000 + 3 * 4 * 6_000)  # room for about three entries
    n = files.write((os.getuid(), llama3.hash), cache)
    assert 1 <= n < 6
    recs, bad = CacheFiles.read(sd.file(CacheFiles.name(os.getuid(), llama3.hash)))
    assert bad == [] and len(recs) == n and sum(len(r.text) + 4 * len(r.ids) for r in recs) <= files.max_bytes
    assert recs[-1].text == texts[-1].encode()  # the most recently used are the ones kept
