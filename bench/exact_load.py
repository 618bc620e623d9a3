"""Exactness-checked load on a real sidecar, and the shadow verifier's cost to other clients.

Two parts, each against its own real ``toktier serve`` process (started the systemd way: a Unix
socket in a private 0700 temp dir, readiness over ``NOTIFY_SOCKET``, SIGTERM at the end, then a
check that no shared-memory segment of its prefix is left in ``/dev/shm``).

``--part exact`` (default 240 s)
    One sidecar serving 5 tokenizers (``--tokenizer`` each: llama3, cl100k_base, o200k_base,
    deepseek_v4, qwen3; lazy loading stays off) with its default shadow verifier (rate 0.01 and
    the default budget).  50 concurrent sessions, spread round-robin over the 5 tokenizers and
    over several connections: 40 on 4 ``AsyncClient`` connections (uvloop, one task per session)
    and 10 on 2 synchronous ``Client`` connections, each driven by its own thread.  Every session
    runs a random mix of ops until the deadline: ``open`` with a 2K-60K-character context,
    ``append`` of 10-4K characters, ``edit`` of a random range (biased to the end and the start),
    ``sync`` to a rewritten text (compaction, several local rewrites, a new text, or the same
    text), and ``close`` followed by a re-open (the same id with a new context, or a new id with
    the current text).  Text comes from ``toktier.tools.corpus`` (code, prose, multilingual,
    CJK, emoji, CRLF, JSON, logs) plus generated file listings, tables, chat turns with the
    tokenizer's own special-token literals (and fragments of them), adversarial runs (spaces,
    digits, newlines, tabs, CRLF, ``ADVERSARIAL_ATOMS``) and NFD-decomposed text (mostly for
    qwen3, whose normalizer composes it).  A session whose text passes ``--max-text`` characters
    is compacted (``sync``) or closed and re-opened.

    Exactness: every op's IDs (copied out of shared memory right after the reply) are compared
    with ``toktier.load_tokenizer(name).encode(full_text)`` -- the reference engine, run in
    ``--checkers`` helper processes of the load generator (the HF reference ``encode`` holds the
    GIL, so threads would neither run in parallel nor leave the generator's event loop alone).
    A session waits for its previous op's check before it sends its next op, so the checker can
    lag by at most one op per session and is never skipped (``--check-fraction`` < 1 checks a
    random fraction instead; the output says which).  Also checked: ``ids[:first_changed]`` of a
    reply equals the previous reply's IDs (the KV-reuse promise).  A divergence prints a
    reproducer (tokenizer, previous text, op) and writes it as JSON, with an in-process replay
    through ``toktier.Session`` to tell the core from the sidecar.

    Figures: ops per type; divergences; first_changed violations; errors by exception type;
    P50/P99 latency per op type -- client-side wall time of the one call (``await
    session.append(...)`` etc.), including the socket round trip, the sidecar's work, mapping the
    result, and any wait for the generator's own loop/GIL (it shares 2 cores with the sidecar
    and the checkers), excluding content generation and checking; repair paths; check lag (op
    reply to check result); the sidecar's ``stats()`` (verified/mismatches) and its
    ``toktier_shadow_*`` and fallback metrics.

``--part shadow``
    The P99 experiment, llama3 only, once per verifier setting (a) ``--verify-rate 0``,
    (b) the default rate 0.01, (c) ``--verify-rate 1.0`` (the verifier budget at its defaults:
    ``verify_max_chars`` 256K, ``verify_chars_per_second`` 1M).  Client A (its own process)
    opens a ``--big-chars`` (default 12M) session, then appends 1.4K characters at
    ``--a-rate`` per second, cutting the session back to its start size every 20 appends (an
    untimed edit) so it stays at ~12M.  Client B (this process, one ``Client``) opens a
    100K-character session and appends 1.4K characters in a tight loop for ``--b-seconds``
    after a warm-up, also cut back every 20 appends (the cuts are not in B's figures).  B's
    P50/P99 per setting is the append call's wall time; the ratios (b)/(a), (c)/(a) are the
    figures the goal (<= 1.5x) is about.  Also printed: the sidecar's shadow counters (checked,
    dropped by reason) and A's open time and append count.  B's and A's final IDs are checked
    against the reference.

Usage::

    python -m bench.exact_load --part exact [--duration 240] [--json out.json]
    python -m bench.exact_load --part shadow [--big-chars 12000000] [--b-seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
import urllib.request

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZERS = ("llama3", "cl100k_base", "o200k_base", "deepseek_v4", "qwen3")
CHAT_FAMILY = {"llama3": "llama3", "qwen3": "chatml", "deepseek_v4": "deepseek"}
OP_TYPES = ("open", "append", "edit", "sync", "close")


# ---------------------------------------------------------------------------------------------
# the sidecar process
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sidecar:
    """``toktier serve`` as its own process, started the systemd way (Type=notify)."""

    def __init__(self, tokenizers, extra: list[str] = (), metrics: bool = True) -> None:
        self.dir = tempfile.mkdtemp(prefix="toktier-xl-")  # 0700: the server checks it is private
        self.sock = os.path.join(self.dir, "toktier.sock")
        self.prefix = f"ttxl{secrets.token_hex(3)}"
        self.metrics_port = free_port() if metrics else None
        notify_path = os.path.join(self.dir, "notify")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(notify_path)
        cmd = [sys.executable, "-m", "toktier", "serve", "--socket", self.sock, "--shm-prefix", self.prefix,
               "--log-level", "WARNING"]
        for t in tokenizers:
            cmd += ["--tokenizer", t]
        if self.metrics_port:
            cmd += ["--metrics-port", str(self.metrics_port)]
        cmd += list(extra)
        self.cmd = cmd
        env = dict(os.environ, PYTHONPATH=ROOT, NOTIFY_SOCKET=notify_path)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        self.notify.settimeout(300)
        while b"READY=1" not in self.notify.recv(4096):
            pass
        self.start_s = time.perf_counter() - t0

    def metrics(self) -> list[str]:
        if not self.metrics_port:
            return []
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode().splitlines()

    def cpu_s(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            return 0.0

    def stop(self) -> tuple[int | None, list[str]]:
        """SIGTERM, wait; returns (exit code, leaked segment names)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = None
        self.notify.close()
        leaked = sorted(n for n in os.listdir("/dev/shm") if n.startswith(self.prefix))
        return rc, leaked


def metric_lines(lines: list[str], *prefixes: str) -> list[str]:
    return [ln for ln in lines if ln.startswith(prefixes) and not ln.startswith("#")
            and not ln.split(" ")[0].split("{")[0].endswith("_created")]


# ---------------------------------------------------------------------------------------------
# content
# ---------------------------------------------------------------------------------------------


class Material:
    """Text pools, built once (deterministic for the seed)."""

    def __init__(self, seed: int) -> None:
        from toktier.tools import corpus as C

        self.C = C
        self.pools = {
            "code": C.large_text(400_000, seed=seed + 1, kind="code"),
            "prose": C.large_text(400_000, seed=seed + 2, kind="english"),
            "multi": C.large_text(400_000, seed=seed + 3, kind="multilingual"),
            "mixed": C.large_text(400_000, seed=seed + 4, kind="mixed"),
        }
        by_cat: dict[str, list[str]] = collections.defaultdict(list)
        for s in C.samples(60_000, seed=seed):
            by_cat[s.category].append(s.text)
        for cat in ("cjk", "emoji", "crlf", "json", "logs", "arabic", "cyrillic"):
            if by_cat.get(cat):
                self.pools[cat] = "".join(by_cat[cat])
        # decomposed text: accented Latin, Hangul, kana with voicing marks, Vietnamese ...
        nfd_src = self.pools["multi"][:200_000] + self.pools.get("cjk", "")[:100_000]
        self.pools["nfd"] = unicodedata.normalize("NFD", nfd_src)
        paths = []
        for base in (os.path.join(ROOT, "toktier"), os.path.dirname(os.__file__)):
            for dirpath, dirnames, files in os.walk(base):
                dirnames[:] = [d for d in dirnames if d != "__pycache__"][:12]
                for f in files[:40]:
                    paths.append(os.path.relpath(os.path.join(dirpath, f), os.path.dirname(base)))
                if len(paths) > 4000:
                    break
        self.paths = paths or ["a/b.py", "c/d.txt"]
        self.atoms = C.ADVERSARIAL_ATOMS

    def slice(self, rng: random.Random, kind: str, n: int) -> str:
        pool = self.pools[kind]
        if n >= len(pool):
            return pool
        start = rng.randrange(0, len(pool) - n)
        return pool[start : start + n]


class Content:
    """Per-tokenizer text generator (contexts, deltas, edits, rewrites)."""

    KINDS = ("code", "prose", "multi", "mixed", "cjk", "emoji", "crlf", "json", "logs", "arabic", "cyrillic",
             "listing", "table", "chat", "adversarial", "nfd", "specials")

    def __init__(self, mat: Material, tokenizer: str, literals: list[str]) -> None:
        self.mat, self.tokenizer = mat, tokenizer
        self.family = CHAT_FAMILY.get(tokenizer)
        lits = [s for s in literals if "reserved" not in s and "place▁holder" not in s]
        lits += [s for s in literals if s not in lits][:6]
        self.literals = lits or ["<|endoftext|>"]
        w = {k: 1.0 for k in self.KINDS}
        w.update(code=3, prose=2, multi=2, mixed=2, chat=3, adversarial=2.5, listing=1.5, table=1.5, specials=1.5)
        w["nfd"] = 4.0 if tokenizer == "qwen3" else 0.4
        self.kinds = [k for k in self.KINDS if k in mat.pools or k in ("listing", "table", "chat", "adversarial",
                                                                       "specials")]
        self.weights = [w[k] for k in self.kinds]

    # -- pieces ---------------------------------------------------------------------------------
    def listing(self, rng: random.Random, n: int) -> str:
        out, total = [], 0
        style = rng.choice(("ls", "find", "tree", "du"))
        while total < n:
            p = rng.choice(self.mat.paths)
            if style == "ls":
                line = (f"{rng.choice(['-rw-r--r--', 'drwxr-xr-x', '-rwxr-xr-x', 'lrwxrwxrwx'])} "
                        f"{rng.randint(1, 12):>2} user  staff {rng.randint(0, 9_999_999):>9} "
                        f"{rng.choice(['Jan', 'Feb', 'Mar', 'Oct'])} {rng.randint(1, 28):>2} "
                        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {os.path.basename(p)}\n")
            elif style == "find":
                line = "./" + p + "\n"
            elif style == "tree":
                depth = p.count("/")
                line = "│   " * min(depth, 5) + rng.choice(("├── ", "└── ")) + os.path.basename(p) + "\n"
            else:
                line = f"{rng.randint(0, 99999)}\t{p}\n"
            out.append(line)
            total += len(line)
        return "".join(out)

    def table(self, rng: random.Random, n: int) -> str:
        cols = rng.randint(2, 7)
        md = rng.random() < 0.6
        words = self.mat.slice(rng, rng.choice(("prose", "multi", "code")), 2000).split()
        out, total = [], 0
        if md:
            head = "| " + " | ".join(f"col_{i}" for i in range(cols)) + " |\n"
            out.append(head + "|" + "|".join(rng.choice(("---", ":---:", "---:", "-----------")) for _ in range(cols))
                       + "|\n")
        while total < n:
            cells = []
            for _ in range(cols):
                r = rng.random()
                if r < 0.4:
                    cells.append(f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 6)}f}")
                elif r < 0.5:
                    cells.append(str(rng.randint(0, 10 ** rng.randint(1, 15))))
                else:
                    cells.append(rng.choice(words) if words else "x")
            if md:
                line = "| " + " | ".join(c.ljust(rng.choice((0, 8, 14))) for c in cells) + " |\n"
            else:
                line = rng.choice((",", "\t", ";")).join(cells) + rng.choice(("\n", "\r\n"))
            out.append(line)
            total += len(line)
        return "".join(out)

    def chat(self, rng: random.Random, n: int) -> str:
        turns, total = [], 0
        roles = ["system", "user", "assistant", "tool"] if self.family == "deepseek" else ["system", "user",
                                                                                           "assistant"]
        while total < n:
            k = max(1, int(n / rng.randint(1, 4)))
            content = self.mat.slice(rng, rng.choice(("prose", "code", "multi", "json", "mixed")), k)
            if rng.random() < 0.2:
                content = "<think>\n" + content[: k // 2] + "\n</think>\n\n" + content[k // 2 :]
            turns.append((rng.choice(roles[1:]) if turns else rng.choice(roles), content))
            total += k + 30
        if self.family:
            return self.C.chat_wrap(turns, self.family, add_generation_prompt=rng.random() < 0.3)
        sep = rng.choice(self.literals)
        return "".join(f"{sep}{role}: {c}" for role, c in turns)

    @property
    def C(self):
        return self.mat.C

    def adversarial(self, rng: random.Random, n: int) -> str:
        out, total = [], 0
        while total < n:
            r = rng.random()
            if r < 0.15:
                s = " " * rng.randint(1, 300)
            elif r < 0.27:
                s = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 200)))
            elif r < 0.37:
                s = rng.choice(("\n", "\r\n", "\n\n", "\r")) * rng.randint(1, 80)
            elif r < 0.42:
                s = "\t" * rng.randint(1, 40) + " " * rng.randint(0, 5)
            elif r < 0.50:
                lit = rng.choice(self.literals)
                cut = rng.randint(1, max(1, len(lit) - 1))
                s = rng.choice((lit, lit[:cut], lit[cut:], lit + lit, " " + lit + " ", lit + "\n"))
            elif r < 0.55:
                s = rng.choice(("    " * rng.randint(1, 8) + "x = 1\n", " \n" * rng.randint(1, 20),
                                "1,234,567.89 ", "2024-01-0" + str(rng.randint(1, 9)) + "T12:00:00Z "))
            else:
                s = "".join(rng.choice(self.mat.atoms) for _ in range(rng.randint(1, 12)))
            out.append(s)
            total += len(s)
        return "".join(out)

    def specials(self, rng: random.Random, n: int) -> str:
        out, total = [], 0
        while total < n:
            s = rng.choice(self.literals) + self.mat.slice(rng, rng.choice(("prose", "code", "multi")),
                                                             rng.randint(0, 200))
            out.append(s)
            total += len(s)
        return "".join(out)

    def piece(self, rng: random.Random, n: int, kind: str | None = None) -> str:
        kind = kind or rng.choices(self.kinds, self.weights)[0]
        if kind == "listing":
            s = self.listing(rng, n)
        elif kind == "table":
            s = self.table(rng, n)
        elif kind == "chat":
            s = self.chat(rng, n)
        elif kind == "adversarial":
            s = self.adversarial(rng, n)
        elif kind == "specials":
            s = self.specials(rng, n)
        else:
            s = self.mat.slice(rng, kind, n)
        if len(s) > n and rng.random() < 0.7:
            s = s[:n]  # may cut a literal, a CRLF or a combining sequence: on purpose
        return s

    # -- ops ------------------------------------------------------------------------------------
    def delta(self, rng: random.Random) -> str:
        n = int(math.exp(rng.uniform(math.log(10), math.log(4000))))
        return self.piece(rng, n)

    def context(self, rng: random.Random) -> str:
        n = int(math.exp(rng.uniform(math.log(2000), math.log(60_000))))
        parts, total = [], 0
        if self.family and rng.random() < 0.6:
            parts.append(self.chat(rng, int(n * rng.uniform(0.3, 1.0))))
            total += len(parts[-1])
        while total < n:
            p = self.piece(rng, rng.randint(200, max(300, n // 3)))
            parts.append(p)
            total += len(p)
        return "".join(parts)[:n]

    def edit(self, rng: random.Random, text: str) -> tuple[int, int, str]:
        L = len(text)
        r = rng.random()
        if r < 0.3:
            start = rng.randint(max(0, L - 500), L)
        elif r < 0.45:
            start = rng.randint(0, min(L, 300))
        else:
            start = rng.randint(0, L)
        q = rng.random()
        span = 0 if q < 0.25 else rng.randint(1, 50) if q < 0.7 else rng.randint(50, 2000)
        end = min(L, start + span)
        q = rng.random()
        repl = "" if q < 0.2 else self.piece(rng, rng.randint(1, 20)) if q < 0.6 else self.piece(rng, rng.randint(
            10, 1000))
        if start == end and not repl:
            repl = self.piece(rng, rng.randint(1, 30))
        return start, end, repl

    def rewrite(self, rng: random.Random, text: str, compact: bool = False) -> tuple[str, str]:
        """A rewritten text for ``sync``; returns (how, text)."""
        r = 0.0 if compact else rng.random()
        L = len(text)
        if r < 0.45:  # compaction: keep a head and a tail, summarize the middle
            head = text[: rng.randint(0, min(L, 8000))]
            tail = text[L - rng.randint(0, min(L, 25_000)) :] if L else ""
            summary = "\n[summary of earlier turns]\n" + self.piece(rng, rng.randint(50, 2000)) + "\n"
            return "compact", head + summary + tail
        if r < 0.85:  # several local rewrites at once (the sidecar diffs them)
            new = text
            for _ in range(rng.randint(2, 5)):
                a, b, s = self.edit(rng, new)
                new = new[:a] + s + new[b:]
            return "local", new
        if r < 0.95:
            return "new", self.context(rng)
        return "same", text


# ---------------------------------------------------------------------------------------------
# the checker (helper processes of the load generator)
# ---------------------------------------------------------------------------------------------

_REF: dict = {}


def _checker_init(names: tuple[str, ...]) -> None:
    import toktier

    os.nice(10)  # the sidecar and the generator come first; checks lag instead (bounded: see above)

    for n in names:
        _REF[n] = toktier.load_tokenizer(n)


def _check(name: str, text: str, ids: np.ndarray) -> tuple:
    """(ok, n_ref, n_got, first_diff, ref_window, got_window, seconds) against tok.encode(text)."""
    t0 = time.perf_counter()
    ref = np.asarray(_REF[name].encode(text), dtype=np.uint32)
    dt = time.perf_counter() - t0
    if len(ref) == len(ids) and np.array_equal(ref, ids):
        return True, len(ref), len(ids), -1, None, None, dt
    n = min(len(ref), len(ids))
    diff = np.nonzero(ref[:n] != ids[:n])[0]
    i = int(diff[0]) if len(diff) else n
    lo = max(0, i - 4)
    return False, len(ref), len(ids), i, ref[lo : i + 8].tolist(), ids[lo : i + 8].tolist(), dt


# ---------------------------------------------------------------------------------------------
# part 1: the exactness-checked load
# ---------------------------------------------------------------------------------------------


class Tally:
    """Shared counters (the loop thread, the client threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lat: dict[str, list[float]] = collections.defaultdict(list)
        self.ops = collections.Counter()
        self.sync_kinds = collections.Counter()
        self.paths: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.errors = collections.Counter()
        self.error_examples: list[str] = []
        self.checked = 0
        self.unchecked = 0
        self.divergences = 0
        self.fc_violations = 0
        self.fc_examples: list[str] = []
        self.check_lag: list[float] = []
        self.check_s = 0.0
        self.check_chars = 0
        self.wait_for_check_s = 0.0
        self.by_tok = collections.Counter()
        self.reproducers: list[str] = []

    def op(self, kind: str, seconds: float, path: str, tok: str) -> None:
        with self.lock:
            self.lat[kind].append(seconds)
            self.ops[kind] += 1
            self.by_tok[tok] += 1
            if path:
                self.paths[kind][path] += 1

    def error(self, where: str, exc: BaseException) -> None:
        with self.lock:
            self.errors[f"{where}:{type(exc).__name__}"] += 1
            if len(self.error_examples) < 8:
                self.error_examples.append(f"{where}: {type(exc).__name__}: {str(exc)[:300]}")


class Job:
    """One op waiting for its check: what is needed to report a divergence."""

    __slots__ = ("future", "tok", "sid", "kind", "args", "prev_text", "text", "done_at")

    def __init__(self, future, tok, sid, kind, args, prev_text, text, done_at) -> None:
        self.future, self.tok, self.sid, self.kind, self.args = future, tok, sid, kind, args
        self.prev_text, self.text, self.done_at = prev_text, text, done_at


class Driver:
    """One logical session: its text, its sidecar session, its next op."""

    def __init__(self, idx: int, tok: str, content: Content, seed: int, max_text: int) -> None:
        self.idx, self.tok, self.content = idx, tok, content
        self.rng = random.Random(f"xl:{seed}:{idx}")
        self.gen = 0
        self.sid = ""
        self.session = None
        self.text = ""
        self.prev_ids: np.ndarray | None = None
        self.pending: Job | None = None
        self.max_text = max_text
        self.reopen_next: str | None = None  # after a close: the text of the re-open

    def new_sid(self) -> str:
        self.gen += 1
        return f"xl-{self.idx}-{self.tok}-{self.gen}"

    def plan(self) -> tuple[str, tuple, str]:
        """(op kind, op args, resulting text)."""
        rng, c = self.rng, self.content
        if self.session is None:
            if self.reopen_next is not None:
                text, self.reopen_next = self.reopen_next, None
                return "open", (self.sid if rng.random() < 0.5 else self.new_sid(),), text
            return "open", (self.new_sid(),), c.context(rng)
        L = len(self.text)
        if L > self.max_text:
            if rng.random() < 0.75:
                how, new = c.rewrite(rng, self.text, compact=True)
                return "sync", (how,), new
            return "close", (), self.text
        r = rng.random()
        if r < 0.55:
            d = c.delta(rng)
            return "append", (d,), self.text + d
        if r < 0.82:
            a, b, s = c.edit(rng, self.text)
            return "edit", (a, b, s), self.text[:a] + s + self.text[b:]
        if r < 0.95:
            how, new = c.rewrite(rng, self.text)
            return "sync", (how,), new
        return "close", (), self.text

    def closed(self) -> None:
        """After a close: re-open with a new context, or the current text (same or new id)."""
        self.session = None
        self.prev_ids = None
        self.reopen_next = self.content.context(self.rng) if self.rng.random() < 0.5 else self.text


class ExactLoad:
    def __init__(self, args, side: Sidecar, mat: Material, literals: dict[str, list[str]], pool) -> None:
        self.args, self.side, self.pool = args, side, pool
        self.tally = Tally()
        self.deadline = 0.0
        self.check_rng = random.Random(args.seed + 99)
        self.out_dir = args.out_dir or side.dir
        contents = {t: Content(mat, t, literals[t]) for t in TOKENIZERS}
        self.drivers = [Driver(i, TOKENIZERS[i % len(TOKENIZERS)], contents[TOKENIZERS[i % len(TOKENIZERS)]],
                               args.seed, args.max_text) for i in range(args.sessions)]

    # -- checks ---------------------------------------------------------------------------------
    def submit(self, d: Driver, kind: str, args: tuple, prev_text: str | None, ids: np.ndarray, fc: int) -> None:
        t = self.tally
        if kind != "open" and d.prev_ids is not None and fc > 0:
            if fc > len(d.prev_ids) or fc > len(ids) or not np.array_equal(ids[:fc], d.prev_ids[:fc]):
                with t.lock:
                    t.fc_violations += 1
                    if len(t.fc_examples) < 5:
                        t.fc_examples.append(f"{d.tok} {d.sid} {kind}: first_changed={fc} prev={len(d.prev_ids)} "
                                             f"now={len(ids)}")
        d.prev_ids = ids
        if self.args.check_fraction < 1.0 and self.check_rng.random() >= self.args.check_fraction:
            with t.lock:
                t.unchecked += 1
            return
        fut = self.pool.submit(_check, d.tok, d.text, ids)
        d.pending = Job(fut, d.tok, d.sid, kind, args, prev_text, d.text, time.perf_counter())

    def settle(self, job: Job, res: tuple) -> None:
        ok, n_ref, n_got, i, ref_w, got_w, dt = res
        t = self.tally
        with t.lock:
            t.checked += 1
            t.check_s += dt
            t.check_chars += len(job.text)
            t.check_lag.append(time.perf_counter() - job.done_at)
        if not ok:
            with t.lock:
                t.divergences += 1
                k = t.divergences
            self.report_divergence(k, job, n_ref, n_got, i, ref_w, got_w)

    def report_divergence(self, k, job: Job, n_ref, n_got, i, ref_w, got_w) -> None:
        path = os.path.join(self.out_dir, f"divergence-{k}.json")
        rec = dict(tokenizer=job.tok, session=job.sid, op=job.kind, args=list(job.args), prev_text=job.prev_text,
                   text=job.text, n_ref=n_ref, n_served=n_got, first_diff=i, ref_window=ref_w, served_window=got_w)
        replay = "not run"
        try:
            import toktier

            tok = toktier.load_tokenizer(job.tok)
            if job.kind == "open" or job.prev_text is None:
                s = toktier.Session(tok, job.text)
            else:
                s = toktier.Session(tok, job.prev_text)
                if job.kind == "append":
                    s.append(job.args[0])
                elif job.kind == "edit":
                    s.edit(*job.args)
                else:
                    s.sync(job.text)
            core_ok = np.array_equal(np.asarray(s.ids), tok.encode(job.text))
            replay = "core Session matches the reference (sidecar-only divergence)" if core_ok else \
                "core Session ALSO diverges (core bug)"
        except Exception as exc:  # noqa: BLE001
            replay = f"replay failed: {type(exc).__name__}: {exc}"
        rec["in_process_replay"] = replay
        with open(path, "w") as f:
            json.dump(rec, f, ensure_ascii=False)
        msg = (f"DIVERGENCE #{k}: tokenizer={job.tok} session={job.sid} op={job.kind} "
               f"args={[a if not isinstance(a, str) else (a[:60] + ('...' if len(a) > 60 else '')) for a in job.args]!r}"
               f" prev_len={len(job.prev_text) if job.prev_text is not None else None} len={len(job.text)} "
               f"ref_tokens={n_ref} served_tokens={n_got} first_diff={i} ref[{max(0, i - 4)}:]={ref_w} "
               f"served={got_w}; {replay}; reproducer: {path} (replay: toktier.Session(load_tokenizer(tokenizer), "
               f"prev_text), then the op; compare .ids with tok.encode(text))")
        print(msg, file=sys.stderr, flush=True)
        with self.tally.lock:
            self.tally.reproducers.append(msg)

    # -- async sessions ---------------------------------------------------------------------------
    async def run_async(self, d: Driver, client) -> None:
        t = self.tally
        while time.perf_counter() < self.deadline:
            if d.pending is not None:
                w0 = time.perf_counter()
                job, d.pending = d.pending, None
                try:
                    res = await asyncio.wrap_future(job.future)
                except Exception as exc:  # noqa: BLE001
                    t.error("checker", exc)
                else:
                    self.settle(job, res)
                with t.lock:
                    t.wait_for_check_s += time.perf_counter() - w0
                if time.perf_counter() >= self.deadline:
                    break
            kind, args, new_text = d.plan()
            prev = d.text if d.session is not None else None
            t0 = time.perf_counter()
            try:
                if kind == "open":
                    d.sid = args[0]
                    d.session = await client.session(d.sid, tokenizer=d.tok, text=new_text)
                    r = d.session.last
                elif kind == "append":
                    r = await d.session.append(args[0])
                elif kind == "edit":
                    r = await d.session.edit(*args)
                elif kind == "sync":
                    r = await d.session.sync(new_text)
                else:
                    await d.session.close()
                    r = None
                dt = time.perf_counter() - t0
                ids = np.array(r.ids, dtype=np.uint32, copy=True) if r is not None else None
            except Exception as exc:  # noqa: BLE001 - counted; the session starts over
                t.error(kind, exc)
                await self.reset_async(d)
                continue
            self.after(d, kind, args, new_text, prev, r, ids, dt)

    async def reset_async(self, d: Driver) -> None:
        if d.session is not None:
            try:
                await d.session.close()
            except Exception:  # noqa: BLE001
                pass
        d.session, d.prev_ids, d.reopen_next = None, None, None

    def after(self, d: Driver, kind, args, new_text, prev, r, ids, dt) -> None:
        t = self.tally
        if kind == "sync":
            with t.lock:
                t.sync_kinds[args[0]] += 1
        t.op(kind, dt, r.path if r is not None else "", d.tok)
        if kind == "close":
            d.closed()
            return
        d.text = new_text
        self.submit(d, kind, args, prev, ids, r.first_changed)

    # -- thread sessions ---------------------------------------------------------------------------
    def run_thread(self, drivers: list[Driver], name: str) -> None:
        from toktier_client import Client

        t = self.tally
        rng = random.Random(name)
        try:
            client = Client(self.side.sock, client_name=name)
        except Exception as exc:  # noqa: BLE001
            t.error("connect", exc)
            return
        try:
            while time.perf_counter() < self.deadline:
                d = rng.choice(drivers)
                if d.pending is not None:
                    w0 = time.perf_counter()
                    job, d.pending = d.pending, None
                    try:
                        self.settle(job, job.future.result())
                    except Exception as exc:  # noqa: BLE001
                        t.error("checker", exc)
                    with t.lock:
                        t.wait_for_check_s += time.perf_counter() - w0
                kind, args, new_text = d.plan()
                prev = d.text if d.session is not None else None
                t0 = time.perf_counter()
                try:
                    if kind == "open":
                        d.sid = args[0]
                        d.session = client.session(d.sid, tokenizer=d.tok, text=new_text)
                        r = d.session.last
                    elif kind == "append":
                        r = d.session.append(args[0])
                    elif kind == "edit":
                        r = d.session.edit(*args)
                    elif kind == "sync":
                        r = d.session.sync(new_text)
                    else:
                        d.session.close()
                        r = None
                    dt = time.perf_counter() - t0
                    ids = np.array(r.ids, dtype=np.uint32, copy=True) if r is not None else None
                except Exception as exc:  # noqa: BLE001
                    t.error(kind, exc)
                    if d.session is not None:
                        try:
                            d.session.close()
                        except Exception:  # noqa: BLE001
                            pass
                    d.session, d.prev_ids, d.reopen_next = None, None, None
                    continue
                self.after(d, kind, args, new_text, prev, r, ids, dt)
            for d in drivers:  # settle the last checks, close
                if d.pending is not None:
                    job, d.pending = d.pending, None
                    try:
                        self.settle(job, job.future.result())
                    except Exception as exc:  # noqa: BLE001
                        t.error("checker", exc)
                if d.session is not None:
                    try:
                        d.session.close()
                    except Exception as exc:  # noqa: BLE001
                        t.error("final-close", exc)
        finally:
            client.close()

    async def main(self) -> dict:
        from toktier_client import AsyncClient

        a = self.args
        n_thread = min(a.thread_sessions, len(self.drivers)) if a.thread_clients else 0
        async_drivers = self.drivers[: len(self.drivers) - n_thread]
        thread_drivers = self.drivers[len(self.drivers) - n_thread :]
        clients = [await AsyncClient(self.side.sock, client_name=f"xl-async-{i}").connect()
                   for i in range(a.async_connections)]
        cpu0, side0, t0 = time.process_time(), self.side.cpu_s(), time.perf_counter()
        self.deadline = t0 + a.duration
        threads = []
        for k in range(a.thread_clients if n_thread else 0):
            mine = thread_drivers[k :: a.thread_clients]
            th = threading.Thread(target=self.run_thread, args=(mine, f"xl-thread-{k}"), daemon=True)
            th.start()
            threads.append(th)
        tasks = [asyncio.ensure_future(self.run_async(d, clients[i % len(clients)]))
                 for i, d in enumerate(async_drivers)]
        await asyncio.gather(*tasks)
        for d in async_drivers:
            if d.pending is not None:
                job, d.pending = d.pending, None
                try:
                    self.settle(job, await asyncio.wrap_future(job.future))
                except Exception as exc:  # noqa: BLE001
                    self.tally.error("checker", exc)
        loop = asyncio.get_running_loop()
        for th in threads:
            await loop.run_in_executor(None, th.join, 120)
        wall = time.perf_counter() - t0
        cpu, side_cpu = time.process_time() - cpu0, self.side.cpu_s() - side0
        stats = await clients[0].stats()
        for d in async_drivers:
            if d.session is not None:
                try:
                    await d.session.close()
                except Exception as exc:  # noqa: BLE001
                    self.tally.error("final-close", exc)
        stats_after = await clients[0].stats()
        for c in clients:
            await c.close()
        return dict(wall_s=wall, loadgen_cpu_s=cpu, sidecar_cpu_s=side_cpu, stats=_struct(stats),
                    stats_after_close=_struct(stats_after))


def _struct(msg) -> dict:
    import msgspec

    return msgspec.to_builtins(msg)


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e3 if len(xs) else float("nan")


def part_exact(args) -> dict:
    import toktier
    import uvloop

    t_setup = time.perf_counter()
    literals = {}
    for t in TOKENIZERS:
        tok = toktier.load_tokenizer(t)  # qwen3's file must exist under the data dir
        literals[t] = [lit.content for lit in tok.engine.literals]
        del tok
    mat = Material(args.seed)
    ctx = mp.get_context("spawn")
    pool = cf.ProcessPoolExecutor(args.checkers, mp_context=ctx, initializer=_checker_init,
                                  initargs=(TOKENIZERS,))
    list(pool.map(time.sleep, [0.01] * args.checkers))  # start and load every checker now
    side = Sidecar(TOKENIZERS)
    setup_s = time.perf_counter() - t_setup
    print(f"[exact] sidecar up in {side.start_s:.1f} s ({' '.join(side.cmd[2:])}); setup {setup_s:.1f} s; "
          f"{args.sessions} sessions x {len(TOKENIZERS)} tokenizers for {args.duration:.0f} s ...",
          file=sys.stderr, flush=True)
    run = ExactLoad(args, side, mat, literals, pool)
    try:
        res = uvloop.run(run.main())
        metrics = metric_lines(side.metrics(), "toktier_shadow", "toktier_full_path_fallbacks")
    finally:
        rc, leaked = side.stop()
        pool.shutdown(cancel_futures=True)
    t = run.tally
    res.update(
        part="exact", duration_s=args.duration, sessions=args.sessions, tokenizers=list(TOKENIZERS),
        connections=dict(async_connections=args.async_connections, thread_clients=args.thread_clients,
                         thread_sessions=min(args.thread_sessions, args.sessions) if args.thread_clients else 0),
        check_mode=("every op" if args.check_fraction >= 1.0 else f"random {args.check_fraction:.0%} of ops"),
        checkers=args.checkers, cpus=os.cpu_count(),
        ops=dict(t.ops), ops_by_tokenizer=dict(t.by_tok), sync_kinds=dict(t.sync_kinds),
        paths={k: dict(v) for k, v in t.paths.items()},
        latency_ms={k: dict(n=len(v), p50=pct(v, 50), p99=pct(v, 99), max=max(v) * 1e3) for k, v in t.lat.items()},
        checked=t.checked, unchecked=t.unchecked, divergences=t.divergences, first_changed_violations=t.fc_violations,
        first_changed_examples=t.fc_examples,
        errors=dict(t.errors), error_examples=t.error_examples, reproducers=t.reproducers,
        check_lag_ms=dict(p50=pct(t.check_lag, 50), p99=pct(t.check_lag, 99)),
        check_cpu_s=t.check_s, check_chars=t.check_chars, wait_for_check_s=t.wait_for_check_s,
        sidecar_exit=rc, leaked_segments=leaked, sidecar_metrics=metrics)
    return res


def print_exact(r: dict) -> None:
    total = sum(r["ops"].values())
    print(f"\n## Exactness-checked load: {r['sessions']} sessions, {len(r['tokenizers'])} tokenizers "
          f"({', '.join(r['tokenizers'])}), {r['duration_s']:.0f} s, {r['cpus']} CPUs")
    c = r["connections"]
    print(f"connections: {c['async_connections']} AsyncClient ({r['sessions'] - c['thread_sessions']} sessions) + "
          f"{c['thread_clients']} Client in threads ({c['thread_sessions']} sessions); wall {r['wall_s']:.1f} s; "
          f"load generator CPU {r['loadgen_cpu_s']:.0f} s, sidecar CPU {r['sidecar_cpu_s']:.0f} s")
    print(f"checking: {r['check_mode']} against toktier.load_tokenizer(name).encode(full text), in "
          f"{r['checkers']} checker processes; checked {r['checked']:,} of {total - r['ops'].get('close', 0):,} "
          f"results ({r['unchecked']} unchecked by sampling); reference time {r['check_cpu_s']:.0f} s over "
          f"{r['check_chars'] / 1e6:.0f}M chars; check lag P50 {r['check_lag_ms']['p50']:.0f} ms "
          f"P99 {r['check_lag_ms']['p99']:.0f} ms; sessions waited {r['wait_for_check_s']:.0f} s in total for "
          f"their previous op's check")
    print(f"DIVERGENCES: {r['divergences']}    first_changed violations: {r['first_changed_violations']}")
    for m in r["reproducers"]:
        print("  " + m)
    for m in r["first_changed_examples"]:
        print("  first_changed: " + m)
    print(f"ops: {total:,} total ({total / r['wall_s']:.1f}/s); by tokenizer {r['ops_by_tokenizer']}; "
          f"sync kinds {r['sync_kinds']}")
    print(f"{'op':<8} {'n':>7} {'P50 ms':>9} {'P99 ms':>9} {'max ms':>9}   repair paths")
    for op in OP_TYPES:
        lat = r["latency_ms"].get(op)
        if not lat:
            continue
        print(f"{op:<8} {lat['n']:>7,} {lat['p50']:>9.2f} {lat['p99']:>9.2f} {lat['max']:>9.1f}   "
              f"{r['paths'].get(op, {})}")
    print(f"errors: {r['errors'] or 'none'}")
    for e in r["error_examples"]:
        print("  " + e)
    st = r["stats"]
    print(f"sidecar stats (before the final closes): verified {st.get('verified', 0)} mismatches "
          f"{st.get('mismatches', 0)} "
          f"sessions {st.get('sessions')} opened {st.get('opened')} closed {st.get('closed')} misses "
          f"{st.get('misses')} evictions {st.get('evictions')} shm_segments {st.get('shm_segments')}")
    sa = r["stats_after_close"]
    print(f"after the final closes: sessions {sa.get('sessions')} shm_segments {sa.get('shm_segments')}; "
          f"sidecar exit code {r['sidecar_exit']}; leaked segments after SIGTERM: {r['leaked_segments'] or 'none'}")
    print("sidecar metrics:")
    for ln in r["sidecar_metrics"]:
        print("  " + ln)


# ---------------------------------------------------------------------------------------------
# part 2: the shadow verifier's cost to another client's P99
# ---------------------------------------------------------------------------------------------

APPEND = 1400
CUT_EVERY = 20


def client_a(argv: list[str]) -> int:
    """Client A (its own process): the big session, appends at a fixed rate until the stop file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--role")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--chars", type=int, required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--stop", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from toktier.tools.corpus import large_text
    from toktier_client import Client

    text = large_text(a.chars, seed=21, kind="mixed")
    src = large_text(APPEND * 400, seed=22, kind="mixed")
    chunks = [src[i * APPEND : (i + 1) * APPEND] for i in range(400)]
    client = Client(a.socket, client_name="shadow-A")
    t0 = time.perf_counter()
    s = client.session("big-A", tokenizer="llama3", text=text)
    open_s = time.perf_counter() - t0
    with open(a.ready, "w") as f:
        f.write(str(open_s))
    lat, n, errors, cur = [], 0, 0, text
    nxt = time.perf_counter()
    while not os.path.exists(a.stop):
        nxt += 1.0 / a.rate
        d = nxt - time.perf_counter()
        if d > 0:
            time.sleep(d)
        c = chunks[n % len(chunks)]
        t1 = time.perf_counter()
        try:
            s.append(c)
            lat.append(time.perf_counter() - t1)
            cur += c
            n += 1
            if n % CUT_EVERY == 0:
                s.edit(len(text), len(cur), "")
                cur = text
        except Exception as exc:  # noqa: BLE001
            errors += 1
            print(f"[A] {type(exc).__name__}: {exc}", file=sys.stderr)
            break
    final_ok = None
    try:
        import toktier

        final_ok = bool(np.array_equal(np.asarray(s.last.ids), toktier.load_tokenizer("llama3").encode(cur)))
        s.close()
    except Exception as exc:  # noqa: BLE001
        print(f"[A] final: {type(exc).__name__}: {exc}", file=sys.stderr)
    client.close()
    with open(a.out, "w") as f:
        json.dump(dict(open_s=open_s, appends=n, errors=errors, p50=pct(lat, 50), p99=pct(lat, 99),
                       final_exact=final_ok), f)
    return 0


def shadow_condition(label: str, rate: float, args, tok, b_text: str, b_chunks: list[str],
                     budget: int | None = None) -> dict:
    from toktier_client import Client

    extra = ["--verify-rate", str(rate), "--max-session-chars", str(max(16 * 1024 * 1024, args.big_chars * 2)),
             "--memory-budget", "4G"]
    if budget is not None:
        extra += ["--verify-chars-per-second", str(budget)]
    side = Sidecar(("llama3",), extra)
    ready, stop, out = (os.path.join(side.dir, n) for n in ("a.ready", "a.stop", "a.json"))
    a_proc = subprocess.Popen([sys.executable, "-m", "bench.exact_load", "--role", "A", "--socket", side.sock,
                               "--chars", str(args.big_chars), "--rate", str(args.a_rate), "--ready", ready,
                               "--stop", stop, "--out", out], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        t0 = time.perf_counter()
        while not os.path.exists(ready):
            if a_proc.poll() is not None:
                raise RuntimeError(f"client A exited with {a_proc.returncode} before its session was open")
            if time.perf_counter() - t0 > 900:
                raise RuntimeError("client A's open took over 15 minutes")
            time.sleep(0.2)
        cpu0 = side.cpu_s()
        client = Client(side.sock, client_name="shadow-B")
        s = client.session("small-B", tokenizer="llama3", text=b_text)
        cur, n = b_text, 0
        lat: list[float] = []
        warm_end = time.perf_counter() + args.b_warmup
        end = warm_end + args.b_seconds
        stats0 = None
        while True:
            now = time.perf_counter()
            if now >= end:
                break
            if stats0 is None and now >= warm_end:
                stats0 = client.stats()
            c = b_chunks[n % len(b_chunks)]
            t1 = time.perf_counter()
            s.append(c)
            dt = time.perf_counter() - t1
            if now >= warm_end:
                lat.append(dt)
            cur += c
            n += 1
            if n % CUT_EVERY == 0:
                s.edit(len(b_text), len(cur), "")  # back to 100K (untimed)
                cur = b_text
        side_cpu = side.cpu_s() - cpu0
        b_exact = bool(np.array_equal(np.asarray(s.last.ids), tok.encode(cur)))
        stats1 = client.stats()
        metrics = metric_lines(side.metrics(), "toktier_shadow")
        s.close()
        client.close()
    finally:
        with open(stop, "w"):
            pass
        try:
            a_proc.wait(120)
        except subprocess.TimeoutExpired:
            a_proc.kill()
        rc, leaked = side.stop()
    a_res = {}
    if os.path.exists(out):
        with open(out) as f:
            a_res = json.load(f)
    return dict(label=label, rate=rate, budget=budget, b_appends=len(lat), b_p50=pct(lat, 50), b_p99=pct(lat, 99),
                b_p999=pct(lat, 99.9), b_max=max(lat) * 1e3 if lat else float("nan"), b_exact=b_exact,
                verified=stats1.verified - (stats0.verified if stats0 else 0), mismatches=stats1.mismatches,
                a=a_res, sidecar_cpu_s=side_cpu, metrics=metrics, sidecar_exit=rc, leaked=leaked)


def part_shadow(args) -> dict:
    import toktier
    from toktier.tools.corpus import large_text

    tok = toktier.load_tokenizer("llama3")
    b_text = large_text(100_000, seed=31, kind="mixed")
    src = large_text(APPEND * 400, seed=32, kind="mixed")
    b_chunks = [src[i * APPEND : (i + 1) * APPEND] for i in range(400)]
    rows = []
    conds = [("(a) verifier off", 0.0, None), ("(b) default rate 0.01", 0.01, None), ("(c) rate 1.0", 1.0, None)]
    for i, budget in enumerate(int(x) for x in args.also_budget.split(",") if x.strip()):
        conds.append((f"({chr(ord('d') + i)}) 0.01, {budget // 1024}K ch/s", 0.01, budget))
    conds = [(label + (f" #{k + 1}" if args.repeat > 1 else ""), rate, budget)
             for k in range(args.repeat) for label, rate, budget in conds]  # interleaved repeats
    for label, rate, budget in conds:
        print(f"[shadow] {label}: starting (A opens {args.big_chars / 1e6:g}M chars) ...", file=sys.stderr,
              flush=True)
        r = shadow_condition(label, rate, args, tok, b_text, b_chunks, budget)
        print(f"[shadow] {label}: B P50 {r['b_p50']:.2f} ms P99 {r['b_p99']:.2f} ms ({r['b_appends']} appends); "
              f"A open {r['a'].get('open_s', float('nan')):.1f} s, {r['a'].get('appends')} appends",
              file=sys.stderr, flush=True)
        rows.append(r)
    return dict(part="shadow", repeat=args.repeat, big_chars=args.big_chars, a_rate=args.a_rate, b_seconds=args.b_seconds,
                b_warmup=args.b_warmup, b_chars=len(b_text), append_chars=APPEND, rows=rows, cpus=os.cpu_count())


def print_shadow(r: dict) -> None:
    print(f"\n## Shadow verifier vs another client's P99 (llama3, {r['cpus']} CPUs)")
    print(f"A: one {r['big_chars'] / 1e6:g}M-character session, {r['append_chars']}-char appends at "
          f"{r['a_rate']:g}/s (cut back every {CUT_EVERY}); B: one {r['b_chars'] / 1e3:.0f}K-character session, "
          f"{r['append_chars']}-char appends in a tight loop for {r['b_seconds']:g} s after {r['b_warmup']:g} s "
          f"warm-up (cut back to {r['b_chars'] / 1e3:.0f}K every {CUT_EVERY}, untimed)")
    n_set = len(r["rows"]) // r.get("repeat", 1)
    print(f"{'setting':<26} {'B appends':>9} {'B P50 ms':>9} {'B P99 ms':>9} {'P99.9':>8} {'max':>8} "
          f"{'P99/(a)':>8} {'P50/(a)':>8} {'verified':>9} {'mism.':>6} {'A open s':>9} {'A appends':>9} "
          f"{'A P99 ms':>9} exact(B,A)")
    for i, row in enumerate(r["rows"]):
        a = row["a"]
        base = r["rows"][i - i % n_set]  # the (a) row of the same round
        print(f"{row['label']:<26} {row['b_appends']:>9,} {row['b_p50']:>9.2f} {row['b_p99']:>9.2f} "
              f"{row['b_p999']:>8.1f} {row['b_max']:>8.1f} {row['b_p99'] / base['b_p99']:>7.2f}x "
              f"{row['b_p50'] / base['b_p50']:>7.2f}x {row['verified']:>9} {row['mismatches']:>6} "
              f"{a.get('open_s', float('nan')):>9.1f} {a.get('appends', 0):>9} {a.get('p99', float('nan')):>9.2f} "
              f"{row['b_exact']},{a.get('final_exact')}  sidecar CPU {row.get('sidecar_cpu_s', 0):.0f} s")
    for row in r["rows"]:
        print(f"{row['label']}: sidecar exit {row['sidecar_exit']}, leaked {row['leaked'] or 'none'}; shadow metrics:")
        for ln in row["metrics"]:
            print("    " + ln)
    for k in range(r.get("repeat", 1)):
        rows = r["rows"][k * n_set : (k + 1) * n_set]
        base = rows[0]
        print(f"round {k + 1}: ratio B P99 " + ", ".join(f"{row['label'][:3]}/(a) = {row['b_p99'] / base['b_p99']:.2f}x"
                                                  for row in rows[1:]) + " (goal: <= 1.5x)")
    if r.get("repeat", 1) > 1:  # per setting: the median P99 over the rounds
        med = [float(np.median([r["rows"][k * n_set + j]["b_p99"] for k in range(r["repeat"])]))
               for j in range(n_set)]
        print("median over rounds: B P99 " + ", ".join(f"{r['rows'][j]['label'][:3]} {med[j]:.2f} ms ({med[j] / med[0]:.2f}x)"
                                                     for j in range(n_set)))


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--role" in argv:
        return client_a(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("exact", "shadow"), default="exact")
    ap.add_argument("--duration", type=float, default=240.0)
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--async-connections", type=int, default=4)
    ap.add_argument("--thread-clients", type=int, default=2)
    ap.add_argument("--thread-sessions", type=int, default=10, help="sessions driven by the Client threads")
    ap.add_argument("--checkers", type=int, default=max(2, os.cpu_count() or 2))
    ap.add_argument("--check-fraction", type=float, default=1.0,
                    help="fraction of ops checked against the reference (default: every op)")
    ap.add_argument("--max-text", type=int, default=100_000, help="compact or re-open a session beyond this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", help="where divergence reproducers go (default: the sidecar's temp dir)")
    ap.add_argument("--big-chars", type=int, default=12_000_000, help="client A's session size (shadow part)")
    ap.add_argument("--a-rate", type=float, default=50.0, help="client A's appends per second (shadow part)")
    ap.add_argument("--b-seconds", type=float, default=30.0)
    ap.add_argument("--b-warmup", type=float, default=3.0)
    ap.add_argument("--also-budget", default="",
                    help="comma-separated verify_chars_per_second values: extra settings at rate 0.01 (shadow part)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole sequence of settings this many times, interleaved (shadow part)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    if args.part == "exact":
        res = part_exact(args)
        print_exact(res)
        ok = res["divergences"] == 0
    else:
        res = part_shadow(args)
        print_shadow(res)
        ok = all(r["b_exact"] and r["mismatches"] == 0 for r in res["rows"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, ensure_ascii=False, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
