"""Sidecar round trip vs in-process repair vs a stateless baseline.

For sessions of 100K, 1M and 4M characters, append 1.4K characters at a time and
report P50/P99 of:

* in-process: ``toktier.Session.append`` (the repair itself, no I/O);
* sidecar: the same append through ``toktier_client.Client`` -> Unix socket ->
  sidecar (separate process, uvloop) -> repair in shared memory -> reply -> numpy view;
* stateless: ``Client.encode(whole_text)``: send everything, re-tokenize everything.

Also: what handing over a 1M-token result costs (mapping a segment, building the
view) compared with the ways that copy (``tolist()``, a msgpack list over the socket).

Prints ratios; asserts nothing about time.  ``python bench/sidecar_roundtrip.py
[--sizes 100000,1000000,4000000] [--appends 200] [--baseline-runs 5]``
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

import msgspec
import numpy as np

import toktier
from toktier.tools.corpus import large_text
from toktier_client import Client
from toktier_client.shm import Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APPEND_CHARS = 1400


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e3  # ms


def start_sidecar(sock_path: str, prefix: str, tokenizer: str) -> tuple[subprocess.Popen, socket.socket]:
    """The sidecar as its own process (its own GIL), started the systemd way; returns the process
    and the notification socket (keep it open: the sidecar reports STOPPING=1 on it)."""
    notify_path = sock_path + ".notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    env = dict(os.environ, PYTHONPATH=ROOT, NOTIFY_SOCKET=notify_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toktier_sidecar.cli", "--socket", sock_path, "--tokenizer", tokenizer, "--shm-prefix",
         prefix, "--log-level", "WARNING"], cwd=ROOT, env=env)
    notify.settimeout(120)
    while b"READY=1" not in notify.recv(4096):
        pass
    return proc, notify


def appends(seed: int, n: int) -> list[str]:
    src = large_text(APPEND_CHARS * n, seed=seed)
    return [src[i * APPEND_CHARS : (i + 1) * APPEND_CHARS] for i in range(n)]


def bench_size(client: Client, tok, n_chars: int, n_appends: int, baseline_runs: int) -> dict:
    """Interleave each append in-process and through the sidecar, so both see the same session
    sizes and machine state; the sidecar's added cost is the paired per-op difference."""
    text = large_text(n_chars, seed=1)
    chunks = appends(2, n_appends)
    local = toktier.Session(tok, text)
    s = client.session(f"bench-{n_chars}", text=text)
    n_tokens = len(s.last.ids)
    t_local, t_side = [], []
    for i, c in enumerate(chunks):
        if i % 2:  # alternate which goes first, so neither gets the warmer caches
            t0 = time.perf_counter()
            local.append(c)
            t1 = time.perf_counter()
            r = s.append(c)
            t2 = time.perf_counter()
            t_local.append(t1 - t0)
            t_side.append(t2 - t1)
        else:
            t0 = time.perf_counter()
            r = s.append(c)
            t1 = time.perf_counter()
            local.append(c)
            t2 = time.perf_counter()
            t_side.append(t1 - t0)
            t_local.append(t2 - t1)
    assert np.array_equal(r.ids, local.ids), "sidecar and in-process disagree"
    # Stateless baseline at the session's starting size (the most favourable size for it):
    # send the whole text plus one append, re-tokenize all of it.
    first = text + chunks[0]
    t_base = []
    for _ in range(baseline_runs):
        t0 = time.perf_counter()
        e = client.encode(first)
        t_base.append(time.perf_counter() - t0)
    assert np.array_equal(e.ids, tok.encode(first))
    s.close()
    return dict(chars=n_chars, tokens=n_tokens, local=t_local, side=t_side, base=t_base,
                added=[b - a for a, b in zip(t_local, t_side)])


def handover(client: Client, tok) -> None:
    """What a 1M-token result costs to hand over, by mechanism."""
    sample = large_text(200_000, seed=3)
    text = large_text(int(1_000_000 * len(sample) / len(tok.encode(sample))), seed=3)  # ~1M tokens
    s = client.session("handover", text=text)
    r = s.last
    n = len(r.ids)
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        m = Mapping.open(r.segment)
        v = m.view(64, n)
    t_map = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        v = r._mapping.view(64, n)
    t_view = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    total = int(v.sum(dtype=np.uint64))
    t_touch = time.perf_counter() - t0
    t0 = time.perf_counter()
    lst = r.ids.tolist()
    t_list = time.perf_counter() - t0
    t0 = time.perf_counter()
    cp = r.ids.copy()
    t_copy = time.perf_counter() - t0
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(list[int])
    t0 = time.perf_counter()
    dec.decode(enc.encode(lst))
    t_msgpack = time.perf_counter() - t0
    t0 = time.perf_counter()
    dec2 = msgspec.msgpack.Decoder()
    np.frombuffer(dec2.decode(enc.encode(cp.tobytes())), dtype=np.uint32)
    t_bytes = time.perf_counter() - t0
    print(f"\nHanding over a {n / 1e6:.2f}M-token result ({n * 4 / 2**20:.1f} MiB of uint32), per result:")
    print(f"  cached mapping, new view (every op)   {t_view * 1e6:10.1f} us")
    print(f"  first map of a segment (shm_open+mmap) {t_map * 1e6:10.1f} us   (only when a session moves segment)")
    print(f"  reading all IDs once through the view  {t_touch * 1e3:10.2f} ms   (page faults on first touch; sum={total % 997})")
    print(f"  ids.copy() (numpy memcpy)              {t_copy * 1e3:10.2f} ms")
    print(f"  ids.tolist() (list[int] for vLLM/SGLang){t_list * 1e3:9.2f} ms")
    print(f"  msgpack list[int] encode+decode        {t_msgpack * 1e3:10.2f} ms   (what a copy-over-the-socket protocol pays, before I/O)")
    print(f"  msgpack bytes encode+decode            {t_bytes * 1e3:10.2f} ms")
    s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000,1000000,4000000")
    ap.add_argument("--appends", type=int, default=200)
    ap.add_argument("--baseline-runs", type=int, default=5)
    ap.add_argument("--tokenizer", default="llama3")
    args = ap.parse_args()
    tok = toktier.load_tokenizer(args.tokenizer)
    tmp = tempfile.mkdtemp(prefix="toktier-bench-")
    sock_path = os.path.join(tmp, "bench.sock")
    prefix = f"ttbench{secrets.token_hex(3)}"
    proc, notify = start_sidecar(sock_path, prefix, args.tokenizer)
    try:
        with Client(sock_path) as client:
            print(f"tokenizer {tok.name}; append {APPEND_CHARS} chars; {args.appends} appends per size; "
                  f"{os.cpu_count()} CPUs; times in ms")
            print(f"{'chars':>9} {'tokens':>9} | {'in-proc P50':>11} {'P99':>7} | {'sidecar P50':>11} {'P99':>7} | "
                  f"{'added P50':>9} {'P99':>7} | {'stateless P50':>13} | {'stateless/sidecar':>17}")
            for n in (int(x) for x in args.sizes.split(",")):
                res = bench_size(client, tok, n, args.appends, args.baseline_runs)
                l50, l99 = pct(res["local"], 50), pct(res["local"], 99)
                s50, s99 = pct(res["side"], 50), pct(res["side"], 99)
                a50, a99 = pct(res["added"], 50), pct(res["added"], 99)
                b50 = pct(res["base"], 50)
                print(f"{n:>9,} {res['tokens']:>9,} | {l50:>11.3f} {l99:>7.3f} | {s50:>11.3f} {s99:>7.3f} | "
                      f"{a50:>9.3f} {a99:>7.3f} | {b50:>13.1f} | {b50 / s50:>16.0f}x")
            print("added = paired per-append difference (sidecar - in-process, same append, same session size)")
            handover(client, tok)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        notify.close()
        leaked = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
        if leaked:
            print(f"WARNING: leaked segments {leaked}")


if __name__ == "__main__":
    main()
