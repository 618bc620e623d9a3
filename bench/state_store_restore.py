"""What a broken session affinity costs: the first op on a node that does not hold the session.

Three ``toktier serve`` processes (uvloop, Unix sockets) and one real Valkey/Redis server on a
Unix socket (``valkey-server`` or Debian's ``redis-server``, started here without persistence):

* A and B share the store (``--state-store``); C has none.
* For each size (100K and 1M characters by default) and each of ``--reps`` fresh sessions: the
  session is opened on A (written behind to the store), then the next turn, sent as a stateless
  front end sends it (``Open`` with the whole text plus 1.4K new characters), goes to:

  - **warm**: A again (it holds the session: a sync by repair);
  - **store**: B, which restores the record from the store (GET, checksum, ID range and
    tiling checks: no encode) and then repairs;
  - **encode**: C, which has no state: a whole-text encode.

  For scale, **append (A)**: a warm append that sends only the new turn (a client holding the
  session: what affinity buys beyond keeping the state).

Also times the parts of the store path in process (GET of the record, decode + verify).
Prints medians and ratios; asserts nothing.  ``python bench/state_store_restore.py
[--sizes 100000,1000000] [--reps 7]``

``--part restart`` measures restore at start instead (``--state-dir``, no store): see
:func:`restart_part`.  ``python -m bench.state_store_restore --part restart --sizes 1000000
--sessions 4 --rounds 3``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import toktier
from toktier.persist import decode_record, restore_session
from toktier.tools.corpus import large_text
from toktier_client import Client
from toktier_sidecar.statedir import record_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TURN = 1400


def wait(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.01)


def start_serve(argv: list[str], sock: str) -> subprocess.Popen:
    """Run ``toktier serve`` with ``argv`` (listening on ``sock``; a stale socket file is removed)
    and return once it answers a ping."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))

    def up() -> bool:
        assert proc.poll() is None, f"toktier serve ({sock}) exited"
        try:
            with Client(sock, reconnect=False) as c:
                c.ping()
            return True
        except Exception:
            return False
    wait(up)
    return proc


def serve(name: str, tmp: str, store: str | None) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(tmp, f"{name}.sock")
    args = [sys.executable, "-m", "toktier", "serve", "--socket", sock, "--shm-prefix", f"ttbench{name}{os.getpid()}",
            "--log-level", "WARNING", "--verify-rate", "0", "--max-session-chars", str(8 << 20)]
    if store:
        args += ["--state-store", store]
    return start_serve(args, sock), sock


def timed(sock: str, session: str, text: str) -> tuple[float, str]:
    with Client(sock) as c:
        c.ping()  # connected and handshaken before the clock starts
        t0 = time.perf_counter()
        r = c.session(session, text=text).last
        return time.perf_counter() - t0, r.path


# -- restore at start (--state-dir), issue 16 --------------------------------------------------
def scrape(port: int, name: str, labels: str = "") -> float | None:
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def restart_part(args) -> None:
    """``--part restart``: one ``toktier serve --state-dir`` with ``--sessions`` sessions per text
    kind (English; the emoji-bearing multilingual text) of each size, restarted ``--rounds`` times
    (SIGTERM, then a fresh process on the same directory).  Per round:

    * **preload**: seconds from the new process answering a ping to the restore at start having
      finished (``toktier_state_preload_seconds`` gauge: the preload's own clock), and sessions held;
    * **first op**: a 1.4K-character append on every session once the preload is done (each
      session's first op after the restart: the held session opened, then a repair), against
      **warm**: the same sessions' appends before the restart (median of three rounds over the
      sessions), and **2nd op**: each session's next append, right after the first ops (the
      same minute of a shared machine);
    * with ``--no-preload`` (the baseline, ``--no-state-preload``) every first op restores its
      session on demand;
    * **raced**: the first op is sent the moment the server answers, to the session the preload
      reaches last (the oldest record; English in even rounds, mixed in odd ones): restored on
      demand while the preload runs (or, if the preload got there first, opened from it), then
      repaired.

    Timing is at the client (``perf_counter`` around ``append``: IPC included, ~0.1 ms)."""
    tok = toktier.load_tokenizer("llama3")
    tmp = tempfile.mkdtemp(prefix="ttpreload")
    state, sock, port = os.path.join(tmp, "state"), os.path.join(tmp, "t.sock"), free_port()
    argv = [sys.executable, "-m", "toktier", "serve", "--socket", sock, "--shm-prefix", f"ttbenchpl{os.getpid()}",
            "--log-level", "WARNING", "--verify-rate", "0", "--max-session-chars", str(8 << 20),
            "--state-dir", state, "--metrics-port", str(port), "--memory-budget", args.memory_budget]
    if args.no_preload:  # the baseline: every session restored by its first op
        argv.append("--no-state-preload")

    def start() -> subprocess.Popen:
        return start_serve(argv, sock)

    def stop(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)

    kinds = ("english", "mixed")
    proc = start()
    try:
        with Client(sock, reconnect_timeout=120) as c:
            sessions, texts = {}, {}
            for size in (int(x) for x in args.sizes.split(",")):
                for kind in kinds:
                    for i in range(args.sessions):
                        sid = f"{kind}-{size}-{i}"
                        texts[sid] = large_text(size, seed=200 + i, kind=kind)
                        sessions[sid] = c.session(sid, text=texts[sid])
            turn = iter(range(10**6))

            def append(sid: str) -> tuple[float, str]:
                k = next(turn)
                delta = large_text(TURN, seed=5000 + k, kind=sid.split("-")[0])
                t0 = time.perf_counter()
                r = sessions[sid].append(delta)
                dt = time.perf_counter() - t0
                texts[sid] += delta
                if k % 7 == 0:  # spot checks against the reference (not timed)
                    assert np.array_equal(r.ids, tok.encode(texts[sid])), f"{sid}: IDs differ from the reference"
                return dt, r.path

            print(f"toktier serve --state-dir: {len(sessions)} sessions ({args.sessions} per kind and size, sizes "
                  f"{args.sizes}), {args.rounds} restarts (SIGTERM); next op = append of {TURN} chars")
            print(f"{'round':>5} {'kind':>8} {'warm ms':>8} {'first op ms':>12} {'first/warm':>11} {'2nd op ms':>10} "
                  f"{'first/2nd':>10} {'preload s':>10} {'held':>5} {'raced op ms':>12} {'raced/warm':>11} "
                  f"{'raced path':>18}")
            rows = []
            for rnd in range(args.rounds):
                warm: dict[str, list[float]] = {k: [] for k in kinds}
                target_kind = kinds[rnd % 2]  # the kind whose first op races the preload this round
                for _ in range(3):
                    for sid in sessions:
                        warm[sid.split("-")[0]].append(append(sid)[0])
                for sid in sessions:  # the other kind's records become the more recent: read first
                    if not sid.startswith(target_kind):
                        warm[sid.split("-")[0]].append(append(sid)[0])
                time.sleep(1.0)  # the records are written behind (0.25 s)
                stop(proc)
                order = sorted(sessions, key=lambda sid: os.path.getmtime(
                    os.path.join(state, record_name(os.getuid(), sid))))
                proc = start()
                c.ping()  # reconnected and handshaken before the clock starts
                raced_sid = order[0]  # the oldest record, of the target kind: the preload reaches it last
                assert raced_sid.startswith(target_kind)
                raced_dt, raced_path = append(raced_sid)
                if not args.no_preload:
                    wait(lambda: scrape(port, "toktier_state_preload_pending") == 0 and
                         (scrape(port, "toktier_state_preload_seconds") or 0) > 0, 300)
                pre_s = scrape(port, "toktier_state_preload_seconds")
                held = scrape(port, "toktier_state_preload_held")
                raced = scrape(port, "toktier_state_preload_sessions_total", '{result="raced"}')
                raced_path = f"{raced_path}/{'raced' if raced or args.no_preload else 'held'}"  # on demand, or held
                first: dict[str, list[float]] = {k: [] for k in kinds}
                second: dict[str, list[float]] = {k: [] for k in kinds}
                for sid in sessions:
                    if sid == raced_sid:
                        continue
                    dt, path = append(sid)
                    assert path != "full", f"{sid}: first op after the restart took the full path"
                    first[sid.split("-")[0]].append(dt)
                for sid in sessions:
                    second[sid.split("-")[0]].append(append(sid)[0])
                for kind in kinds:
                    w, f, s2 = (1000 * statistics.median(x[kind]) for x in (warm, first, second))
                    raced_kind = raced_sid.split("-")[0] == kind
                    row = {"round": rnd, "kind": kind, "warm_ms": w, "first_ms": f, "second_ms": s2,
                           "preload_s": pre_s, "held": held, "warm_all": [1000 * x for x in warm[kind]],
                           "first_all": [1000 * x for x in first[kind]], "second_all": [1000 * x for x in second[kind]]}
                    if raced_kind:
                        row.update(raced_ms=1000 * raced_dt, raced_path=raced_path)
                    rows.append(row)
                    print(f"{rnd:>5} {kind:>8} {w:>8.3f} {f:>12.3f} {f / w:>10.1f}x {s2:>10.3f} {f / s2:>9.1f}x {pre_s:>10.2f} "
                          f"{held:>5.0f} " + (f"{1000 * raced_dt:>12.2f} {1000 * raced_dt / w:>10.1f}x {raced_path:>18}"
                                              if raced_kind else ""))
            if args.json:
                import json

                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    finally:
        if proc.poll() is None:
            stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("store", "restart"), default="store")
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sessions", type=int, default=4, help="restart: sessions per text kind and size")
    ap.add_argument("--rounds", type=int, default=3, help="restart: restarts")
    ap.add_argument("--memory-budget", default="2G", help="restart: the server's --memory-budget")
    ap.add_argument("--json", help="restart: write the rows here")
    ap.add_argument("--no-preload", action="store_true", help="restart: the baseline, --no-state-preload (every "
                    "first op restores its session on demand)")
    args = ap.parse_args()
    if args.part == "restart":
        restart_part(args)
        return
    import redis

    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        sys.exit("needs valkey-server or redis-server (apt-get install redis-server)")
    tmp = tempfile.mkdtemp(prefix="ttstore")
    store_sock = os.path.join(tmp, "store.sock")
    store = subprocess.Popen([binary, "--port", "0", "--unixsocket", store_sock, "--save", "", "--appendonly", "no",
                              "--dir", tmp], stdout=subprocess.DEVNULL)
    procs = []
    try:
        r = redis.Redis(unix_socket_path=store_sock)
        wait(lambda: os.path.exists(store_sock) and r.ping())
        url = f"unix://{store_sock}?db=0"
        (pa, a), (pb, b), (pc, c) = serve("a", tmp, url), serve("b", tmp, url), serve("c", tmp, None)
        procs = [pa, pb, pc]
        tok = toktier.load_tokenizer("llama3")
        print(f"store: {os.path.basename(binary)} on a unix socket; {args.reps} sessions per size; "
              f"next turn = Open(whole text + {TURN} chars)")
        print(f"{'chars':>9} {'warm (A) ms':>12} {'store (B) ms':>13} {'encode (C) ms':>14} {'store/warm':>11} "
              f"{'encode/store':>13} {'GET ms':>7} {'verify ms':>11} {'record MB':>10} {'append (A) ms':>14}")
        for size in (int(x) for x in args.sizes.split(",")):
            rows: dict[str, list[float]] = {"warm": [], "store": [], "encode": [], "get": [], "verify": [], "append": []}
            nbytes = 0
            for rep in range(args.reps):
                sid = f"bench-{size}-{rep}"
                text = large_text(size, seed=100 + rep)
                with Client(a) as ca:
                    ca.session(sid, text=text)
                wait(lambda: any(decode_record(r.get(k)).session == sid for k in r.keys("toktier:s:*")))
                key = next(k for k in r.keys("toktier:s:*") if decode_record(r.get(k)).session == sid)
                t0 = time.perf_counter()
                data = r.get(key)
                t1 = time.perf_counter()
                restore_session(tok, decode_record(data))
                t2 = time.perf_counter()
                rows["get"].append(t1 - t0)
                rows["verify"].append(t2 - t1)
                nbytes = len(data)
                nxt = text + large_text(TURN, seed=900 + rep)
                for name, sock in (("store", b), ("warm", a), ("encode", c)):
                    dt, path = timed(sock, sid, nxt)
                    rows[name].append(dt)
                    if name != "encode":
                        assert path != "full", f"{name}: expected a repair, got {path}"
                with Client(a) as ca:  # for scale: a warm append that sends only the new turn
                    sa = ca.session(sid, text=nxt)
                    turn = large_text(TURN, seed=1900 + rep)
                    t0 = time.perf_counter()
                    sa.append(turn)
                    rows["append"].append(time.perf_counter() - t0)
                for sock in (a, b, c):
                    with Client(sock) as cl:
                        cl.session(sid).close()
            med = {k: 1000 * statistics.median(v) for k, v in rows.items()}
            print(f"{size:>9} {med['warm']:>12.2f} {med['store']:>13.2f} {med['encode']:>14.2f} "
                  f"{med['store'] / med['warm']:>10.1f}x {med['encode'] / med['store']:>12.1f}x {med['get']:>7.2f} "
                  f"{med['verify']:>11.2f} {nbytes / 1e6:>10.2f} {med['append']:>14.2f}")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(60)
        store.terminate()
        store.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
