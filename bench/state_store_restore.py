"""What a broken session affinity costs: the first op on a node that does not hold the session.

Three ``toktier serve`` processes (uvloop, Unix sockets) and one real Valkey/Redis server on a
Unix socket (``valkey-server`` or Debian's ``redis-server``, started here without persistence):

* A and B share the store (``--state-store``); C has none.
* For each size (100K and 1M characters by default) and each of ``--reps`` fresh sessions: the
  session is opened on A (written behind to the store), then the next turn, sent as a stateless
  front end sends it (``Open`` with the whole text plus 1.4K new characters), goes to:

  - **warm**: A again (it holds the session: a sync by repair);
  - **store**: B, which restores the record from the store (GET, checksum, certificate and
    tiling check: no encode) and then repairs;
  - **encode**: C, which has no state: a whole-text encode.

  For scale, **append (A)**: a warm append that sends only the new turn (a client holding the
  session: what affinity buys beyond keeping the state).

Also times the parts of the store path in process (GET of the record, decode + certify).
Prints medians and ratios; asserts nothing.  ``python bench/state_store_restore.py
[--sizes 100000,1000000] [--reps 7]``
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

import toktier
from toktier.persist import decode_record, restore_session
from toktier.tools.corpus import large_text
from toktier_client import Client

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TURN = 1400


def wait(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.01)


def serve(name: str, tmp: str, store: str | None) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(tmp, f"{name}.sock")
    args = [sys.executable, "-m", "toktier", "serve", "--socket", sock, "--shm-prefix", f"ttbench{name}{os.getpid()}",
            "--log-level", "WARNING", "--verify-rate", "0", "--max-session-chars", str(8 << 20)]
    if store:
        args += ["--state-store", store]
    proc = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))

    def up() -> bool:
        assert proc.poll() is None, f"toktier serve {name} exited"
        try:
            with Client(sock, reconnect=False) as c:
                c.ping()
            return True
        except Exception:
            return False
    wait(up)
    return proc, sock


def timed(sock: str, session: str, text: str) -> tuple[float, str]:
    with Client(sock) as c:
        c.ping()  # connected and handshaken before the clock starts
        t0 = time.perf_counter()
        r = c.session(session, text=text).last
        return time.perf_counter() - t0, r.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
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
              f"{'encode/store':>13} {'GET ms':>7} {'certify ms':>11} {'record MB':>10} {'append (A) ms':>14}")
        for size in (int(x) for x in args.sizes.split(",")):
            rows: dict[str, list[float]] = {"warm": [], "store": [], "encode": [], "get": [], "certify": [], "append": []}
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
                rows["certify"].append(t2 - t1)
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
                  f"{med['certify']:>11.2f} {nbytes / 1e6:>10.2f} {med['append']:>14.2f}")
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
