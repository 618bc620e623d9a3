"""Stateless front ends (issue 16): every call sends its whole text, no session id.  Same run, ratios.

Traces (per context size N in ``--sizes``; ``--quick``: 100K, 1M and fewer calls):

* ``agent``: the stratified agent trace of :mod:`bench.traces` (one session per size, calls drawn
  from the calibrated agent distributions, chat-template wrapped, ``<think>`` blocks the template
  drops: edits), replayed with the session id removed: the stateless engines get each call's
  whole text, the session engine gets the op (append / edit) as a client with a session id would.
* ``branching``: one system prompt + tool schema (~30K characters) shared by ``--convs``
  conversations that diverge right after it; each conversation's history brings it to N.  Then
  rounds of turns (~1.4K characters each, conversations interleaved); every 3rd turn is followed by
  a *retry* that replaces the last turn with another (the conversation continues from the retry),
  every 4th by an exact *resend*; halfway, conversation 0 spawns a sub-agent: a branch of its current
  text that goes on as one more conversation.

Engines (one fresh instance per trace and size, except the stateless peers):

* ``prefix-cache``: ``toktier.PrefixCache(tok).encode(text)`` (defaults: L0 4096 keys, L1 256 MiB);
  its ``.ids`` is a read-only view (copied on write if kept).  Results are dropped before the next
  call, as a server drops an answer it has sent.
* ``sessions``: TokTier sessions driven by the op (``Session(tok, text)`` at a start,
  ``append(delta)``, ``edit(start, end, delta)`` for an agent edit or a retry, ``sync(text)`` for a
  resend, ``fork()`` + ``append`` for the sub-agent); ``.ids`` is a view.  The reference point.
* ``sglang-l1``: :class:`bench.baselines.caches.SpecialBoundaryPrefixCache` (SGLang Model Gateway /
  Dynamo style L1: prefixes ending at special tokens, chained blake2b, suffix encoded by HF).
* ``fastokens``: fastokens with ``FASTOKENS_INPUT_CACHE=8`` (read by its constructor) on its array
  path, ``encode_batch_flat([text])`` + ``np.frombuffer`` (:func:`bench.peers.fastokens_factory`).
* ``gigatoken``: one warm object, ``encode(text)`` (a uint32 ndarray).
* ``hf``: HF ``tokenizers`` ``encode(text, add_special_tokens=False).ids`` as a uint32 array (the
  reference, :class:`bench.baselines.full.HFFull`); timed on the checked calls only.

Timings are ``time.perf_counter`` around the call alone (building the text is outside), with the
engines in a seeded random order per call and the garbage collector off during each call.  P50 and
P99 are over the steady-state calls (everything but the starts, which are reported apart).
"vs sess" is an engine's P50 over the sessions' P50; "vs peer" the fastest peer's P50 (fastokens,
gigatoken, sglang-l1, hf) over the engine's P50 (> 1: faster than every peer).

Checks: the reference (``hf``) runs on every ``--check-every``-th call and on every start;
on the other calls the truth is the sessions' IDs when fastokens and gigatoken (two independent
implementations) both agree with them, else a fresh reference encode.  Every engine's IDs are compared
with the truth on every call; a mismatch is printed and the run exits 1.

Restart (``--restart-size``, default 1M characters; ``--restart-only`` skips the traces): per text
kind (English; the emoji-bearing multilingual text), a session written with ``toktier.persist``,
then its first 1.4K-character append after a restore at start (the record restored beforehand,
then other sessions' records, as the sidecar's preload does), the on-demand path (``read_record``
+ ``restore_session`` + the first append, timed together: an op that races the preload), the
same for a format-2 record (the first restore after an upgrade), against a warm session's append
of the same kind (P50; see ``restart_bench``).  The goal is a ratio of at most 3.

The machine is shared and noisy: read the ratios within one run.

    python -m bench.stateless --quick
    python -m bench.stateless --sizes 100000 300000 1000000 2000000 4000000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np

import toktier
from bench import traces as T
from bench.agent_trace import machine
from bench.baselines import EngineUnavailable, Request
from bench.baselines.caches import SpecialBoundaryPrefixCache
from bench.baselines.full import HFFull
from bench.peers import fresh_copy
from toktier import persist
from toktier.tools.corpus import large_text

SIZES = (100_000, 300_000, 1_000_000, 2_000_000, 4_000_000)
QUICK_SIZES = (100_000, 1_000_000)
SYSTEM_CHARS = 30_000
TURN_CHARS = 1_400
PEERS = ("fastokens", "gigatoken", "sglang-l1", "hf")
ENGINES = ("prefix-cache", "sessions") + PEERS


@dataclass
class Call:
    """One request: the whole text (what a stateless engine sees) and the op a session client sends."""

    sid: str
    label: str  # start | append | edit | retry | resend | fork
    text: str
    delta: str = ""
    start: int = 0
    end: int = 0
    parent: str = ""  # fork: the conversation branched


# -- traces ------------------------------------------------------------------------------------
def agent_calls(tok_name: str, size: int, n_calls: int, seed: int):
    """The stratified agent trace's session at `size` (bench.traces), its session id kept only for
    the session engine."""
    header, calls = T.generate_stratified([size], n_calls, seed, family=T.family_template(tok_name))
    for c in T.replay(header, calls):
        if c.op == "start":
            yield Call("agent", "start", c.text)
        elif c.op == "append":
            yield Call("agent", "append", c.text, c.delta)
        else:  # an edit (the template dropped a think block) or a compaction: both are edits of the text
            yield Call("agent", "edit", c.text, c.delta, c.start, c.end)


def _system_prompt(render: T.Renderer) -> str:
    """~30K characters: instructions and a JSON tool schema, as one system turn."""
    rng = random.Random(16)
    words = large_text(40_000, seed=16, kind="english").split()
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}_{rng.choice(words).strip('.,;:')[:12]}",
        "description": " ".join(rng.choice(words) for _ in range(25)),
        "parameters": {"type": "object", "properties": {
            f"arg{j}": {"type": rng.choice(["string", "integer", "number", "boolean"]),
                        "description": " ".join(rng.choice(words) for _ in range(8))} for j in range(5)},
            "required": ["arg0"]}}} for i in range(24)]
    schema = json.dumps(tools, indent=2)
    head = large_text(max(1000, SYSTEM_CHARS - len(schema) - 200), seed=17, kind="english")
    return render.head + render.turn("system", head + "\n\n# Tools\n\n" + schema)


def branching_calls(tok_name: str, size: int, convs: int, turns: int, seed: int):
    render = T.Renderer(T.family_template(tok_name))
    system = _system_prompt(render)
    rng = random.Random(f"branching:{seed}:{size}")
    material = large_text(convs * (size + (turns + 4) * 2 * TURN_CHARS), seed=seed, kind="mixed")
    cursor = 0

    def take(n: int) -> str:
        nonlocal cursor
        out = material[cursor : cursor + n]
        cursor += n
        return out

    texts: dict[str, str] = {}
    last_turn: dict[str, int] = {}  # where each conversation's last turn starts
    roles = ("user", "assistant", "tool")
    for c in range(convs):  # each conversation's own history, in turns of ~20K characters
        sid = f"conv{c}"
        hist = []
        n = max(0, size - len(system))
        while n > 0:
            k = min(n, 20_000)
            hist.append(render.turn(roles[len(hist) % 3], take(k)))
            n -= k
        texts[sid] = system + "".join(hist)
        yield Call(sid, "start", texts[sid])
    for t in range(turns):
        if t == turns // 2:  # conversation 0 spawns a sub-agent over its whole context
            sid = "sub0"
            delta = render.turn("user", "[sub-agent task] " + take(TURN_CHARS))
            texts[sid] = texts["conv0"] + delta
            last_turn[sid] = len(texts["conv0"])
            yield Call(sid, "fork", texts[sid], delta, parent="conv0")
        for sid in list(texts):
            delta = render.turn(roles[(t + 1) % 3], take(TURN_CHARS + rng.randrange(-400, 400)))
            last_turn[sid] = len(texts[sid])
            texts[sid] += delta
            yield Call(sid, "append", texts[sid], delta)
            if t % 3 == 2:  # a retry: the last turn replaced by another answer
                a = last_turn[sid]
                delta = render.turn(roles[(t + 1) % 3], take(TURN_CHARS + rng.randrange(-400, 400)))
                end = len(texts[sid])
                texts[sid] = texts[sid][:a] + delta
                yield Call(sid, "retry", texts[sid], delta, a, end)
            if t % 4 == 3:  # the same request again (a client timeout)
                yield Call(sid, "resend", texts[sid])


# -- engines -----------------------------------------------------------------------------------
class Sessions:
    def __init__(self, tok) -> None:
        self.tok = tok
        self.s: dict[str, toktier.Session] = {}

    def __call__(self, c: Call) -> np.ndarray:
        if c.label == "start":
            s = self.s[c.sid] = toktier.Session(self.tok, c.text)
            return s.ids
        if c.label == "fork":
            s = self.s[c.sid] = self.s[c.parent].fork()
            return s.append(c.delta).ids
        s = self.s[c.sid]
        if c.label == "append":
            return s.append(c.delta).ids
        if c.label in ("edit", "retry"):
            return s.edit(c.start, c.end, c.delta).ids
        return s.sync(c.text).ids  # resend: nothing changed


def build_engines(tok, peers: dict) -> dict:
    cache = toktier.PrefixCache(tok)
    sgl = SpecialBoundaryPrefixCache(tok)
    try:
        hf = HFFull(tok)
        ref = lambda c: hf(Request("stateless", "compact", c.text))  # noqa: E731
    except EngineUnavailable:  # a tiktoken reference
        ref = lambda c: tok.encode(c.text)  # noqa: E731
    eng = {
        "prefix-cache": lambda c: cache.encode(c.text),
        "sessions": Sessions(tok),
        "sglang-l1": lambda c: sgl(Request("stateless", "compact", c.text)),
        "hf": ref,
    }
    eng.update({name: (lambda f: (lambda c: f(c.text)))(make()) for name, make in peers.items()})
    eng["_cache"] = cache
    return eng


def peer_factories(tok) -> tuple[dict, dict]:
    from bench.peers import fastokens_factory, gigatoken_factory

    made, missing = {}, {}
    for name, factory in (("fastokens", lambda: fastokens_factory(tok, "8")),
                          ("gigatoken", lambda: gigatoken_factory(tok))):
        try:
            made[name] = factory()
            made[name]()  # build once now: an unavailable peer is reported, not fatal
        except Exception as exc:  # noqa: BLE001 - a missing optional peer
            missing[name] = f"{type(exc).__name__}: {exc}"
            made.pop(name, None)
    return made, missing


# -- one (trace, size) -------------------------------------------------------------------------
def run_trace(tok, trace: str, calls, peers: dict, check_every: int, seed: int, log) -> dict:
    eng = build_engines(tok, peers)
    cache: toktier.PrefixCache = eng.pop("_cache")
    names = [n for n in ENGINES if n in eng]
    rng = random.Random(f"order:{seed}:{trace}")
    times: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    layers: dict[str, int] = {}
    mismatches: list[str] = []
    n_calls = checked = adjudicated = 0
    for i, c in enumerate(calls):
        ref_call = c.label == "start" or i % check_every == 0
        order = [n for n in names if n != "hf" or ref_call]
        rng.shuffle(order)
        got: dict[str, np.ndarray] = {}
        for name in order:
            own = replace(c, text=fresh_copy(c.text))  # untimed: no engine finds another's UTF-8 made
            gc.disable()
            t0 = time.perf_counter()
            r = eng[name](own)
            dt = time.perf_counter() - t0
            gc.enable()
            if name == "prefix-cache":
                layers[f"{c.label}:{r.layer}"] = layers.get(f"{c.label}:{r.layer}", 0) + 1
                r = r.ids
            got[name] = r
            times[name].setdefault(c.label, []).append(dt)
        if ref_call:
            truth = got["hf"]
            checked += 1
        else:
            s = got["sessions"]
            if all(w in got and np.array_equal(got[w], s) for w in ("fastokens", "gigatoken")):
                truth = s
            else:
                truth = tok.encode(c.text)
                adjudicated += 1
        for name, ids in got.items():
            if not np.array_equal(ids, truth):
                m = min(len(ids), len(truth))
                d = np.flatnonzero(np.asarray(ids[:m]) != truth[:m])
                at = int(d[0]) if len(d) else m
                mismatches.append(f"{trace} {len(c.text)} call {i} ({c.label}): {name} differs from the reference "
                                  f"at token {at} (len {len(ids)} vs {len(truth)})")
                log(mismatches[-1])
        n_calls += 1
        got.clear()
        r = ids = truth = None  # dropped before the next call, as a server drops an answer it has sent
    st = cache.stats()
    held = st.bytes_held["l1"] + st.bytes_held["l0"]
    hot = sum(h.charge for h in getattr(cache, "_hot", {}).values())  # (older caches have none)
    return {"calls": n_calls, "checked": checked, "adjudicated": adjudicated, "mismatches": mismatches,
            "times": times, "layers": layers, "lookups": {f"{a}:{b}": n for (a, b), n in st.lookups.items()},
            "bytes_held": held, "hot_bytes": hot, "distinct_chars": _distinct_chars(cache),
            "full_fallbacks": st.full_fallbacks, "collisions": st.collisions}


def _distinct_chars(cache: toktier.PrefixCache) -> int:
    """Characters of text the cache holds, each shared block once (text nodes + entries' tails)."""
    nodes = sum(n.chars - (n.parent.chars if n.parent else 0) for n in cache._nodes.values())
    tails = sum(e.nchars - (e.text_leaf.chars if e.text_leaf else 0) for e in cache._lru)
    return nodes + tails


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def summarize(res: dict) -> dict:
    """P50/P99 of steady-state calls (not starts) and of starts, per engine."""
    out = {}
    for name, by_label in res["times"].items():
        steady = [t for lab, ts in by_label.items() if lab != "start" for t in ts]
        out[name] = {"p50": pct(steady, 50), "p99": pct(steady, 99), "n": len(steady),
                     "start_p50": pct(by_label.get("start", []), 50),
                     "by_label": {lab: pct(ts, 50) for lab, ts in by_label.items()}}
    return out


def print_table(trace: str, size: int, res: dict, out=print) -> dict:
    s = summarize(res)
    sess = s["sessions"]["p50"]
    peer_p50 = {n: s[n]["p50"] for n in PEERS if n in s and n != "hf"}
    if "hf" in s:
        peer_p50["hf"] = s["hf"]["p50"]
    fastest = min(peer_p50, key=peer_p50.get) if peer_p50 else None
    out(f"\n{trace}, {size:,} chars: {res['calls']} calls, {res['checked']} checked against the reference, "
        f"{res['adjudicated']} adjudicated, {len(res['mismatches'])} mismatches; fastest peer: {fastest}")
    out("| engine | P50 ms | P99 ms | n | vs sess | vs peer | start P50 ms | P50 by call kind (ms) |")
    out("|---|---:|---:|---:|---:|---:|---:|---|")
    for name in ENGINES:
        if name not in s:
            continue
        e = s[name]
        vs_peer = peer_p50[fastest] / e["p50"] if fastest else float("nan")
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(e["by_label"].items()) if k != "start")
        out(f"| {name} | {e['p50']:.3f} | {e['p99']:.2f} | {e['n']} | {e['p50'] / sess:.1f}x | {vs_peer:.2f}x | "
            f"{e['start_p50']:.1f} | {kinds} |")
    lk = res["lookups"]
    total = res["calls"]
    l0 = lk.get("l0:hit", 0)
    l1 = lk.get("l1:hit", 0)
    per_char = res["bytes_held"] / max(1, res["distinct_chars"])
    out(f"prefix-cache: L0 hits {l0}/{total} ({l0 / total:.0%}), L1 hits {l1}/{total} ({l1 / total:.0%}), "
        f"misses {total - l0 - l1}; by call kind and layer {dict(sorted(res['layers'].items()))}; "
        f"held {res['bytes_held'] / 1e6:.1f} MB for {res['distinct_chars'] / 1e6:.2f}M distinct characters "
        f"({per_char:.2f} B/char; live sessions {res['hot_bytes'] / 1e6:.1f} MB of it, "
        f"{(res['bytes_held'] - res['hot_bytes']) / max(1, res['distinct_chars']):.2f} B/char without them); "
        f"full-path fallbacks {res['full_fallbacks']}, collisions {res['collisions']}")
    return {"summary": s, "fastest_peer": fastest}


# -- restart -----------------------------------------------------------------------------------
RESTART_KINDS = ("english", "mixed")


def restart_bench(tok, size: int, reps: int, out=print, kinds=RESTART_KINDS, others: int = 3) -> dict:
    """First op on a `size`-character session after a restart vs a warm append (see the docstring),
    per text kind (``english``: 1 byte per character; ``mixed``: the emoji-bearing multilingual
    text, a 4-byte-per-character str).  Per rep, in process, P50 over `reps`:

    * *lazy* (format 3, the sidecar's on-demand path, an op that races the preload):
      ``read_record`` + ``restore_session`` + the first 1.4K-character append, timed together;
    * *lazy, format 2*: the same for the previous build's record (the first restore after an upgrade);
    * *preloaded*: the record restored first (then `others` other sessions' records, as a
      restore at start goes on to other sessions and sweeps the caches), then the first append
      alone: what the first op after the restore at start costs;
    * *warm*: an append on a session that has served ops all along, back to back (the CPU
      caches hold the engine's tables and the session's tail);
    * *warm, swept*: the same warm session's append right after the `others` restores (the
      same memory sweep the *preloaded* op sees: a server interleaves other sessions' work).

    Ratios are each first op over the warm append (the goal: at most 3x); the preloaded op is
    also given over the swept warm append (like for like).  Medians and minima: on a shared
    2-core machine a ms-long step is often descheduled for a few ms."""
    render = T.Renderer(T.family_template(tok.name))
    res_all: dict = {"size": size, "reps": reps, "kinds": {}}
    exact = True
    for kind in kinds:
        text = render.head + render.turn("user", large_text(size, seed=5, kind=kind))
        more = large_text((4 * reps + 30) * TURN_CHARS, seed=6, kind=kind)
        deltas = [render.turn("assistant" if i % 2 else "user", more[i * TURN_CHARS : (i + 1) * TURN_CHARS])
                  for i in range(4 * reps + 30)]
        s = toktier.Session(tok, text)
        rec = persist.SessionRecord.of(s, namespace=0, session_id="bench", seq=1)
        old = persist.encode_record(persist.SessionRecord.of(s, namespace=0, session_id="bench", seq=1, certify=True), version=2)
        times: dict[str, list[float]] = {k: [] for k in ("lazy", "lazy_restore", "lazy2", "preload_restore",
                                                         "preloaded", "warm", "warm_swept")}
        d = 0
        ws = s.fork()  # the warm session of the swept mode
        ws.append(deltas[-1])
        with tempfile.TemporaryDirectory() as tmp:
            path, path2 = os.path.join(tmp, "s.rec"), os.path.join(tmp, "s2.rec")
            persist.write_record(path, rec)
            with open(path2, "wb") as f:
                f.write(old)
            other_paths = []
            for j in range(others):
                o = os.path.join(tmp, f"o{j}.rec")
                persist.write_record(o, persist.SessionRecord.of(
                    toktier.Session(tok, large_text(size, seed=70 + j, kind=kind)), namespace=0,
                    session_id=f"o{j}", seq=1))
                other_paths.append(o)
            for i in range(reps):
                for mode in random.Random(i).sample(["lazy", "lazy2", "preloaded", "warm_swept"], 4):
                    delta = deltas[d]
                    d += 1
                    gc.collect()
                    gc.disable()
                    if mode == "warm_swept":
                        held = [persist.restore_session(tok, persist.read_record(o)) for o in other_paths]
                        t0 = time.perf_counter()
                        op = ws.append(delta)
                        times["warm_swept"].append(time.perf_counter() - t0)
                        del held
                        gc.enable()
                        continue
                    if mode == "preloaded":
                        t0 = time.perf_counter()
                        r = persist.restore_session(tok, persist.read_record(path))
                        times["preload_restore"].append(time.perf_counter() - t0)
                        held = [persist.restore_session(tok, persist.read_record(o)) for o in other_paths]
                        t0 = time.perf_counter()
                        op = r.append(delta)
                        times["preloaded"].append(time.perf_counter() - t0)
                        del held
                    else:
                        p = path if mode == "lazy" else path2
                        t0 = time.perf_counter()
                        r = persist.restore_session(tok, persist.read_record(p))
                        t1 = time.perf_counter()
                        op = r.append(delta)
                        times[mode].append(time.perf_counter() - t0)
                        if mode == "lazy":
                            times["lazy_restore"].append(t1 - t0)
                    gc.enable()
                    if i == 0:
                        exact &= bool(np.array_equal(op.ids, tok.encode(text + delta)))
        w = s.fork()
        for _ in range(3 * reps):
            gc.disable()
            t0 = time.perf_counter()
            w.append(deltas[d])
            times["warm"].append(time.perf_counter() - t0)
            gc.enable()
            d += 1
        exact &= bool(np.array_equal(w.ids, tok.encode(w.text)))
        exact &= bool(np.array_equal(ws.ids, tok.encode(ws.text)))
        res = {k: pct(v, 50) for k, v in times.items()}
        res.update({f"{k}_min": 1000 * min(v) for k, v in times.items()})
        res["record_bytes"] = rec.nbytes
        for k in ("lazy", "lazy2", "preloaded"):
            res[f"{k}_ratio"] = res[k] / res["warm"]
        res["preloaded_swept_ratio"] = res["preloaded"] / res["warm_swept"]
        res_all["kinds"][kind] = res
        out(f"\nrestart, {size:,} chars, {kind} (record {rec.nbytes / 1e6:.1f} MB), P50 (min) of {reps}, ms:\n"
            f"  warm append {res['warm']:.3f} ({res['warm_min']:.3f}); after the same sweep "
            f"{res['warm_swept']:.3f} ({res['warm_swept_min']:.3f})\n"
            f"  first op after the restore at start {res['preloaded']:.3f} ({res['preloaded_min']:.3f}): "
            f"{res['preloaded_ratio']:.1f}x warm, {res['preloaded_swept_ratio']:.1f}x swept; the restore itself "
            f"{res['preload_restore']:.2f} ({res['preload_restore_min']:.2f}), in the background\n"
            f"  on demand (racing the preload): restore + first op {res['lazy']:.2f} ({res['lazy_min']:.2f}): "
            f"{res['lazy_ratio']:.1f}x; the restore {res['lazy_restore']:.2f} ({res['lazy_restore_min']:.2f})\n"
            f"  on demand, format-2 record: {res['lazy2']:.2f} ({res['lazy2_min']:.2f}): {res['lazy2_ratio']:.1f}x"
            f"   (goal <= 3x)")
    res_all["exact"] = exact
    out(f"restored IDs exact: {exact}")
    return res_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="llama3")
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--traces", nargs="+", default=["agent", "branching"], choices=["agent", "branching"])
    ap.add_argument("--calls", type=int, default=40, help="agent trace: calls per size")
    ap.add_argument("--convs", type=int, default=4, help="branching trace: conversations")
    ap.add_argument("--turns", type=int, default=9, help="branching trace: rounds of turns")
    ap.add_argument("--check-every", type=int, default=1, help="the reference on every N-th call (and every start)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--restart-size", type=int, default=1_000_000, help="0: skip the restart measurement")
    ap.add_argument("--restart-reps", type=int, default=7)
    ap.add_argument("--restart-only", action="store_true", help="only the restart measurement")
    ap.add_argument("--quick", action="store_true", help="100K and 1M, fewer calls")
    ap.add_argument("--json", help="write every timing and summary here")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes = args.sizes or list(QUICK_SIZES)
        args.calls, args.convs, args.turns = min(args.calls, 16), min(args.convs, 3), min(args.turns, 6)
    sizes = args.sizes or list(SIZES)
    tok = toktier.load_tokenizer(args.tokenizer)
    peers, missing = peer_factories(tok)
    info = machine()
    print(f"# bench.stateless {' '.join(sys.argv[1:])}\nmachine: {info}\npeers unavailable: {missing or 'none'}")
    report: dict = {"args": vars(args), "machine": info, "unavailable": missing, "runs": []}
    failures = 0
    for trace in ([] if args.restart_only else args.traces):
        for size in sizes:
            if trace == "agent":
                calls = list(agent_calls(args.tokenizer, size, args.calls, args.seed))
            else:
                calls = list(branching_calls(args.tokenizer, size, args.convs, args.turns, args.seed))
            res = run_trace(tok, trace, calls, peers, args.check_every, args.seed,
                            log=lambda m: print("MISMATCH", m, flush=True))
            table = print_table(trace, size, res)
            failures += len(res["mismatches"])
            report["runs"].append({"trace": trace, "size": size, **{k: v for k, v in res.items() if k != "times"},
                                   **table})
            sys.stdout.flush()
            del calls, res
            gc.collect()
    if args.restart_size:
        report["restart"] = restart_bench(tok, args.restart_size, reps=args.restart_reps)
        failures += not report["restart"]["exact"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print(f"\n{failures} mismatches" if failures else "\nevery checked result equals the reference")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
