"""Append latency against every peer on its fastest array path (issue 14, part 1).

Workload (one process, one run; every engine is timed on the same texts, interleaved call by
call, so the ratios are same-run ratios even on a noisy machine):

* context: ``<|start_header_id|>user<|end_header_id|>\\n\\n`` + ``large_text(N, kind="code")`` +
  ``<|eot_id|>`` (Llama 3 chat format around Python source), N in ``--sizes`` characters;
* ``chat-1.4K``: ``--appends`` appends, each one turn ``<|start_header_id|>{assistant|user}
  <|end_header_id|>\\n\\n`` + ~1.4K characters of code + ``<|eot_id|>`` (1,400 characters in all);
* ``plain-256`` / ``plain-1.4K`` / ``plain-16K``: the same number of appends of raw English text
  (``large_text(n, kind="english")``, no template) of 256, 1,400 and 16,000 characters
  (``plain-10``, 10 characters, on request: ``--workloads plain-10``);
* ``--content KIND`` takes the context body, the chat turns' bodies, the plain appends and the
  session starts' contexts from that kind instead: `large_text`'s ``mixed`` / ``multilingual`` (CJK,
  Arabic, Cyrillic, emoji, JSON, logs, CRLF text: the content agents also carry), ``english`` or
  ``code``, or bench.engine_speed's ``cjk``, ``listing`` (`ls -l` lines) and ``table`` (a markdown
  table of numbers and codes).

Each (size, workload) starts fresh: every engine first sees the context untimed (our session is
built, each stateless peer encodes it once so its caches hold it, the peer process seeds its
session), then the appends.  What is not fresh: TokTier's piece caches are pooled per tokenizer
(as in a server, where sessions share them), and the plain appends of every cell come from one
479K-character English pool (pydoc topics and the Python license), which the first cell's 25
appends of 16K mostly cover.  So the first cell run appends text TokTier has not seen, and later
cells largely text its caches hold (the peers keep no such cache): measured 2026-12-04, the
first cell's plain-16K read 0.35-0.36 ms whichever size it was, later cells 0.21-0.36 ms.  The engines run in a seeded random order on every call, so the
one timed right after another engine's call (whose worker threads may still be spinning, and
which flushed the caches) is not always the same.  (Until 1 December 2026 the order rotated call
by call.  A rotation keeps the cyclic order: TokTier always ran right after the peer process's
call, whose whole-text API encode sweeps the caches, and fastokens always right after TokTier.)
``--settle-ms N`` sleeps N ms before each timed call; it is off by default because it hurts short
calls: measured 2026-11-30, a 5 ms sleep made TokTier's 256-character appends at 100K 0.066 ->
0.15 ms (a core that slept wakes with cold caches), while toktier 0.3.0's worker process, when
called between our appends (no sleep), took them from 0.045 to 0.094 ms.

What each timing includes (``time.perf_counter`` around):

* ``toktier``: ``Session.append(delta)``; its result's ``ids`` is a uint32 view of the session
  buffer (no copy, no list).
* ``fastokens`` 0.3.5 (constructed with ``FASTOKENS_INPUT_CACHE=8``; the constructor reads it):
  ``encode_batch_flat([whole_text])`` + ``np.frombuffer(ids, uint32)``.
* ``gigatoken`` 0.10.0 (one warm object): ``encode(whole_text)``, which returns a uint32 ndarray.
* ``tiktoken`` (o200k_base rows only): ``encode_to_numpy(whole_text, allowed_special="all")``.
* ``hf`` (the reference, llama3): ``encode(whole_text, add_special_tokens=False).ids`` converted
  once with ``np.asarray(..., uint32)``: the Python list is its only output.  Timed on every 8th
  call only (the checked calls), so its P50 is over those.
* ``tt03-api`` (PyPI ``toktier`` 0.3.0 in its own venv and process,
  ``bench/peer_worker_toktier03.py``): ``Tokenizer.encode(whole_text, session=sid)`` timed inside
  the worker (its ``Encoding`` and ids tuple included; pipe excluded).  ``rt`` columns are the
  round trip seen from here: sending the whole text over the pipe, the call, the reply.
* ``tt03-core``: its Rust core directly (``SessionStore.append(handle, delta, ...)``, see the
  worker's docstring: a route its admission refuses for our file), timed inside the worker; the
  reply carries the whole stream as bytes.  ``rt`` as above (only the delta is sent).

Concatenating the whole text for the stateless peers happens before their timer starts, and so does
a copy of it (`fresh_copy`): each timed call gets a str object no other engine has read, because
CPython caches a str's UTF-8 in the object for the next C extension that asks (until 4 December 2026
the second of fastokens and gigatoken found it made: 0.4-0.8 ms per 1M characters in its favour).  Every
8th call (i % 8 == 0) each engine's ids are compared with the reference (HF ``tokenizers`` for
llama3, tiktoken for o200k_base); a mismatch is printed and counted, never hidden.  "TokTier lead"
is the faster of fastokens/gigatoken's P50 divided by ours (> 1: we are faster).

Session starts (``--starts``, default 1M and 4M): ``Session(tok, context)`` (our full path: parallel
chunks on this machine's cores, laid out in the session's buffers by the chunk threads), the same
start through ``Session._full`` (the general path, which every start took before 1 December 2026:
the A/B of that change), ``toktier.fullpath.encode_full`` alone, fastokens' first
``encode_batch_flat`` on a fresh object (construction untimed, cache empty), gigatoken's first
``encode`` on a fresh object, each also as one long-lived object across the texts (caches warm from
the earlier ones, as in a server), and the peer's first ``encode(text, session=...)``/core ``put``.
Two ratio columns: against fastokens' fresh object, and against the fastest of all the stateless
rows (on `large_text` contexts, which reuse a pool's material, fastokens' long-lived object is often
that row: see bench/RESULTS.md, 2026-12-04).

    python -m bench.peers --quick            # 30K, 100K, 1M; 10 appends
    python -m bench.peers                    # 30K ... 4M; 25 appends
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from toktier import Session, load_tokenizer
from toktier.fullpath import encode_full
from toktier.tools.corpus import LARGE_KINDS, large_text

from bench.engine_speed import KINDS as CONTENT_KINDS
from bench.engine_speed import make_text

ROOT = Path(__file__).resolve().parent.parent
PEER_PY = ROOT / ".venv-peer" / "bin" / "python"
WORKER = ROOT / "bench" / "peer_worker_toktier03.py"
U32 = np.uint32
HDR = "<|start_header_id|>{role}<|end_header_id|>\n\n"
EOT = "<|eot_id|>"


# -- workload -------------------------------------------------------------------------------
def body_text(n: int, seed: int, kind: str) -> str:
    """``n`` characters of content ``kind``: `large_text`'s kinds, or engine_speed's generated ones
    (``cjk``, ``listing``: `ls -l` lines, ``table``: a markdown table of numbers and codes)."""
    if kind in LARGE_KINDS:
        return large_text(n, seed=seed, kind=kind)
    return make_text(kind, n, seed)


def context_text(n: int, content: str | None = None, seed: int = 7) -> str:
    return HDR.format(role="user") + body_text(n, seed, content or "code") + EOT


def deltas(workload: str, count: int, content: str | None = None) -> list[str]:
    out = []
    for i in range(count):
        if workload == "chat-1.4K":
            role = "assistant" if i % 2 == 0 else "user"
            head = HDR.format(role=role)
            body = body_text(1400 - len(head) - len(EOT), 1000 + i, content or "code")
            out.append(head + body + EOT)
        else:
            n = {"plain-10": 10, "plain-256": 256, "plain-1.4K": 1400, "plain-16K": 16000}[workload]
            out.append(body_text(n, 2000 + i, content or "english"))
    return out


# -- the peer process ---------------------------------------------------------------------------
class PeerProc:
    def __init__(self, tokenizer_json: str) -> None:
        home = tempfile.mkdtemp(prefix="toktier03-home-")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(TOKTIER_HOME=home, TOKTIER_OFFLINE="1", HF_HUB_OFFLINE="1")
        self.p = subprocess.Popen([str(PEER_PY), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=env, cwd=tempfile.gettempdir())
        self.info = self.call({"op": "init", "tokenizer_json": tokenizer_json, "home": home})[0]["info"]

    def call(self, req: dict, payload: str = "") -> tuple[dict, np.ndarray | None, float]:
        data = payload.encode("utf-8")
        req = dict(req, nbytes=len(data))
        t0 = time.perf_counter()
        self.p.stdin.write(json.dumps(req).encode() + b"\n")
        if data:
            self.p.stdin.write(data)
        self.p.stdin.flush()
        rep = json.loads(self.p.stdout.readline())
        raw = self.p.stdout.read(rep["nbytes"]) if rep["nbytes"] else b""
        rt = time.perf_counter() - t0
        if not rep.get("ok"):
            raise RuntimeError(f"peer worker: {rep.get('error')}\n{rep.get('trace', '')}")
        return rep, (np.frombuffer(raw, dtype=U32) if raw else None), rt

    def close(self) -> None:
        try:
            self.call({"op": "quit"})
        except Exception:
            pass
        self.p.wait(timeout=30)


# -- engines ------------------------------------------------------------------------------------
def fastokens_factory(tok, cache: str | None = "8"):
    from bench.baselines.full import _fastokens_tokenizer

    def make():
        t = _fastokens_tokenizer(tok, input_cache=cache)

        def enc(text: str) -> np.ndarray:
            flat, _off = t.encode_batch_flat([text])
            return np.frombuffer(flat, dtype=U32)
        return enc
    return make


def gigatoken_factory(tok):
    from bench.baselines.full import _gigatoken

    build = _gigatoken(tok)

    def make():
        t = build()
        return t.encode  # uint32 ndarray
    return make


def tiktoken_encoder(tok):
    from bench.baselines.full import TiktokenFull

    e = TiktokenFull(tok)._enc
    return lambda text: e.encode_to_numpy(text, allowed_special="all")


def hf_encoder(tok):
    t = tok.engine._tok
    return lambda text: np.asarray(t.encode(text, add_special_tokens=False).ids, dtype=U32)


def fresh_copy(text: str) -> str:
    """A new str object equal to `text`.  CPython keeps a non-ASCII str's UTF-8 inside the object the
    first time a C extension asks for it (`PyUnicode_AsUTF8AndSize`, which PyO3 uses), so an engine
    handed the object another engine (or the reference) already read gets that conversion free
    (0.4-0.8 ms per 1M characters of a 2-byte str).  A front end gets a new str per request: every
    timed call here gets its own copy, made before its timer starts."""
    return text[:-1] + text[-1:] if len(text) > 1 else text  # (a 0-1 character str caches nothing worth it)


def p50(xs) -> float:
    return float(np.median(xs)) * 1e3 if xs else float("nan")


# -- one (tokenizer, size, workload) ------------------------------------------------------------
def run_cell(tok, name, size, workload, n_appends, stateless, ref, peer, peer_api_appends, log, settle=0.0,
             content=None):
    ctx = context_text(size, content)
    ds = deltas(workload, n_appends, content)
    times: dict[str, list[float]] = {}
    rts: dict[str, list[float]] = {}
    paths: dict[str, dict[str, int]] = {}
    bad: dict[str, int] = {}
    # seeding (untimed)
    s = Session(tok, ctx)
    encs = {k: f() for k, f in stateless.items()}
    for e in encs.values():
        e(ctx)
    sid = None
    if peer is not None:
        peer.call({"op": "core_start"}, ctx)
        sid = f"{name}-{size}-{workload}"
        peer.call({"op": "api_encode", "session": sid}, ctx)
    text = ctx

    def step_toktier(i, d, text, check, want):
        t0 = time.perf_counter()
        r = s.append(d)
        times.setdefault("toktier", []).append(time.perf_counter() - t0)
        want["toktier"] = r.ids
        paths.setdefault("toktier", {}).setdefault(str(r.path), 0)
        paths["toktier"][str(r.path)] += 1

    def step_stateless(k, e):
        def step(i, d, text, check, want):
            text = fresh_copy(text)
            t0 = time.perf_counter()
            ids = e(text)
            times.setdefault(k, []).append(time.perf_counter() - t0)
            want[k] = ids
        return step

    def step_peer(i, d, text, check, want):
        rep, ids, rt = peer.call({"op": "core_append", "want_ids": check}, d)
        times.setdefault("tt03-core", []).append(rep["t_inner_s"])
        rts.setdefault("tt03-core", []).append(rt)
        paths.setdefault("tt03-core", {}).setdefault(rep["path"], 0)
        paths["tt03-core"][rep["path"]] += 1
        if check:
            want["tt03-core"] = ids
        if i < peer_api_appends:
            rep, ids, rt = peer.call({"op": "api_encode", "session": sid, "want_ids": check}, text)
            times.setdefault("tt03-api", []).append(rep["t_inner_s"])
            rts.setdefault("tt03-api", []).append(rt)
            if check:
                want["tt03-api"] = ids
                key = f"{rep.get('backend')}/{rep.get('path')}"
                paths.setdefault("tt03-api", {}).setdefault(key, 0)
                paths["tt03-api"][key] += 1

    steps = [step_toktier, *(step_stateless(k, e) for k, e in encs.items())]
    if peer is not None:
        steps.append(step_peer)
    rng = random.Random(f"{name}-{size}-{workload}")
    for i, d in enumerate(ds):
        text = text + d
        check = i % 8 == 0
        want = {}
        # A seeded random order per call: whatever runs right after another engine's call (a peer
        # process's worker threads still spinning, caches just flushed) hits every engine alike.
        for step in rng.sample(steps, len(steps)):
            if settle:
                time.sleep(settle)  # let the previous engine's worker threads go idle (see the docstring)
            step(i, d, text, check, want)
        if check:
            t0 = time.perf_counter()
            rids = ref(text)
            times.setdefault("ref", []).append(time.perf_counter() - t0)
            for k, ids in want.items():
                if ids is None or not np.array_equal(np.asarray(ids), rids):
                    bad[k] = bad.get(k, 0) + 1
                    log(f"  MISMATCH {name} {size} {workload} call {i}: {k} "
                        f"({None if ids is None else len(ids)} ids vs {len(rids)})")
    return {k: p50(v) for k, v in times.items()}, {k: p50(v) for k, v in rts.items()}, \
        {k: len(v) for k, v in times.items()}, paths, bad


def session_starts(tok, size, stateless, peer, reps=3, extra=None, seed=0, content=None):
    """Median of ``reps`` session starts, each on a *different* context text (seeds 11, 12, ...), so
    no whole-input cache can answer.  Stateless peers use one warm object (built and used on an
    unrelated text before, construction untimed), as a server would; a new session's text is new
    to it.  The peer's rows are timed inside its process.  ``extra`` ({label: fn(text) -> ids})
    adds rows timed the same way (bench/gpu_session_start.py adds the GPU path).  Per text, every
    engine runs once, in a seeded random order (so no row always follows the same other one, or
    always runs first after the reference encode that checks them)."""
    ctxs = [context_text(size, content, seed=11 + j) for j in range(reps)]
    refs = [tok.encode(c) for c in ctxs]
    warm_text = large_text(50_000, seed=99, kind="english")

    def general(c):
        # the path every start took before the staged one (`Session._full`: the str's UTF-8 copy,
        # the chunks' ids concatenated, both copied again, the checkpoints walked), for the A/B
        s = Session(tok, "")
        s._full(c.encode("utf-8"), len(c), reason="initial text", text=c)
        return s.ids

    # label -> (prepare(text) -> fn, untimed; or None: fn itself)
    rows: dict[str, tuple] = {
        "toktier Session(tok, ctx) (full path)": (None, lambda c: Session(tok, c).ids),
        "toktier Session, general path (Session._full)": (None, general),
        "toktier encode_full": (None, lambda c: encode_full(tok, c)),
    }
    for label, fn in (extra or {}).items():
        rows[label] = (None, fn)
    for k, f in stateless.items():
        def fresh(c, f=f):
            # untimed: a fresh object, its lazy set-up done on an unrelated text
            e = f()
            e(warm_text)
            return e
        rows[f"{k} (fresh object warmed on other text)"] = (fresh, None)
        e = f()
        e(warm_text)
        rows[f"{k} (one warm object across the {reps} texts)"] = (None, e)
    inner: dict[str, list[float]] = {}
    if peer is not None:
        inner = {"tt03-core put (inner)": [], "tt03-api encode(session=new) (inner)": []}

        def core(c):
            rep, ids, rt = peer.call({"op": "core_start", "want_ids": True}, c)
            inner["tt03-core put (inner)"].append(rep["t_inner_s"])
            return ids

        def api(c):
            n = len(inner["tt03-api encode(session=new) (inner)"])
            rep, ids, rt = peer.call({"op": "api_encode", "session": f"start-{size}-{n}-{time.time()}",
                                      "want_ids": True}, c)
            inner["tt03-api encode(session=new) (inner)"].append(rep["t_inner_s"])
            return ids
        rows["tt03-core put (round trip)"] = (None, core)
        rows["tt03-api encode(session=new) (round trip)"] = (None, api)
    times: dict[str, list[float]] = {k: [] for k in rows}
    exact: dict[str, bool] = {k: True for k in rows}
    rng = random.Random(seed * 1_000_003 + size)
    for c, r in zip(ctxs, refs):
        order = list(rows)
        rng.shuffle(order)
        for label in order:
            prep, fn = rows[label]
            if prep is not None:
                fn = prep(c)
            own = fresh_copy(c)
            t0 = time.perf_counter()
            ids = fn(own)
            times[label].append(time.perf_counter() - t0)
            exact[label] &= ids is not None and bool(np.array_equal(np.asarray(ids), r))
    out = {k: p50(v) for k, v in times.items()}
    for k, v in inner.items():
        out[k] = p50(v)
        exact[k] = exact[k.replace("(inner)", "(round trip)")]
    return out, exact


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="30000,100000,300000,1000000,2000000,4000000")
    ap.add_argument("--appends", type=int, default=25)
    ap.add_argument("--quick", action="store_true", help="30K,100K,1M; 10 appends")
    ap.add_argument("--workloads", default="chat-1.4K,plain-256,plain-1.4K,plain-16K")
    ap.add_argument("--o200k-sizes", default="100000,1000000",
                    help="sizes of the o200k_base rows (chat-1.4K only); empty to skip")
    ap.add_argument("--starts", default="1000000,4000000", help="session-start sizes; empty to skip")
    ap.add_argument("--start-reps", type=int, default=5, help="texts per session-start size (each engine once per text)")
    ap.add_argument("--no-peer", action="store_true", help="skip toktier 0.3.0")
    ap.add_argument("--settle-ms", type=float, default=0.0, help="sleep before each timed call (default none)")
    ap.add_argument("--content", choices=CONTENT_KINDS, default=None,
                    help="content of the llama3 rows' context body, appends and session starts (default: code "
                         "context, code chat turns, English plain appends, code starts)")
    ap.add_argument("--peer-api-appends", type=int, default=25,
                    help="calls of the 0.3.0 public API lane per cell (it re-encodes in full: slow)")
    ap.add_argument("--peer-api-appends-large", type=int, default=9,
                    help="the same for contexts of 1M characters and more")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.appends = "30000,100000,1000000", 10
        args.o200k_sizes, args.starts = "100000", "1000000"
    sizes = [int(x) for x in args.sizes.split(",") if x]
    workloads = args.workloads.split(",")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    print(f"## peers — {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; P50 ms per append, {args.appends} appends; "
          f"one run, engines interleaved call by call")
    tok = load_tokenizer("llama3")
    tjson = getattr(tok.engine, "path")
    peer = None
    if not args.no_peer and PEER_PY.exists():
        try:
            peer = PeerProc(tjson)
            print("\ntoktier 0.3.0 worker: " + json.dumps(peer.info, default=str))
        except Exception as exc:
            print(f"\ntoktier 0.3.0 could not start: {type(exc).__name__}: {exc}")
            peer = None
    stateless = {"fastokens": fastokens_factory(tok), "gigatoken": gigatoken_factory(tok)}
    ref = hf_encoder(tok)
    all_paths = []
    mism = 0
    print("\n| tokenizer | context | workload | TokTier | fastokens | gigatoken | TokTier lead | HF ref "
          "| tt03-api inner (rt) | tt03-core inner (rt) | lead vs tt03-core inner | checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for w in workloads:
            api_n = args.peer_api_appends if size < 1_000_000 else args.peer_api_appends_large
            t, rt, n, paths, bad = run_cell(tok, "llama3", size, w, args.appends, stateless, ref, peer,
                                            min(api_n, args.appends), log, args.settle_ms / 1000, args.content)
            mism += sum(bad.values())
            best = min(t["fastokens"], t["gigatoken"])
            lead = best / t["toktier"]
            api = f"{t['tt03-api']:.2f} ({rt['tt03-api']:.2f}) n={n['tt03-api']}" if "tt03-api" in t else "-"
            core = f"{t['tt03-core']:.3f} ({rt['tt03-core']:.3f})" if "tt03-core" in t else "-"
            vcore = f"{t['tt03-core'] / t['toktier']:.2f}x" if "tt03-core" in t else "-"
            chk = "all equal" if not bad else "MISMATCH " + ",".join(f"{k}:{v}" for k, v in bad.items())
            cell = f"{w} {args.content}" if args.content else w
            print(f"| llama3 | {size:,} | {cell} | {t['toktier']:.3f} | {t['fastokens']:.3f} | {t['gigatoken']:.3f} "
                  f"| **{lead:.2f}x** | {t['ref']:.1f} (n={n['ref']}) | {api} | {core} | {vcore} | {chk} |", flush=True)
            all_paths.append((f"llama3 {size} {w}", paths))
    if args.o200k_sizes:
        otok = load_tokenizer("o200k_base")
        ost = {"fastokens": fastokens_factory(otok), "gigatoken": gigatoken_factory(otok),
               "tiktoken": (lambda e=tiktoken_encoder(otok): e)}
        oref = otok.encode
        print("\n| tokenizer | context | workload | TokTier | fastokens | gigatoken | tiktoken `encode_to_numpy` "
              "| TokTier lead (vs faster of fastokens/gigatoken) | lead vs tiktoken | checks |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for size in [int(x) for x in args.o200k_sizes.split(",") if x]:
            t, rt, n, paths, bad = run_cell(otok, "o200k_base", size, "chat-1.4K", args.appends, ost, oref, None,
                                            0, log, args.settle_ms / 1000)
            mism += sum(bad.values())
            best = min(t["fastokens"], t["gigatoken"])
            chk = "all equal" if not bad else "MISMATCH " + ",".join(f"{k}:{v}" for k, v in bad.items())
            print(f"| o200k_base | {size:,} | chat-1.4K (headers are plain text here) | {t['toktier']:.3f} "
                  f"| {t['fastokens']:.3f} | {t['gigatoken']:.3f} | {t['tiktoken']:.3f} | **{best / t['toktier']:.2f}x** "
                  f"| {t['tiktoken'] / t['toktier']:.2f}x | {chk} |", flush=True)
            all_paths.append((f"o200k_base {size}", paths))
    starts = [int(x) for x in args.starts.split(",") if x]
    if starts:
        what = args.content or "code"
        print(f"\n| session start (llama3, chat context of {what}) | engine | ms (median of {args.start_reps}) | exact "
              "| vs fastokens fresh | vs fastest stateless row |")
        print("|---|---|---|---|---|---|")
        for size in starts:
            out, exact = session_starts(tok, size, stateless, peer, reps=args.start_reps, content=args.content)
            f = out["fastokens (fresh object warmed on other text)"]
            # a long-lived object (its caches warm from earlier texts) is a peer's fastest path too
            best = min(v for k, v in out.items() if k.split(" ")[0] in stateless)
            for k, v in out.items():
                print(f"| {size:,} | {k} | {v:.1f} | {exact[k]} | {f / v:.2f}x | {best / v:.2f}x |", flush=True)
    print("\nroutes (counts per cell; TokTier RepairPath, 0.3.0 core path, 0.3.0 API backend/path on checked calls):")
    for cell, paths in all_paths:
        print(f"- {cell}: " + "; ".join(f"{k}: {v}" for k, v in paths.items()))
    if peer is not None:
        rep, _, _ = peer.call({"op": "explain"})
        ex = rep["explain"]
        keep = {k: ex.get(k) for k in ("routing_policy", "backend", "planned_backend", "fallback_chain",
                                       "plan_reasons", "certification", "session_repair", "store", "state_encode")}
        print("\ntoktier 0.3.0 explain() (selected keys): " + json.dumps(keep, default=str))
        print("toktier 0.3.0 core stats: " + json.dumps(rep["core_stats"], default=str))
        peer.close()
    print(f"\nmismatches: {mism}")
    return 0 if mism == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
