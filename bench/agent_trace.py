"""Agent traces against every peer, in one run: latency by context size, correctness, outcomes.

Parts (each returns a JSON-able dict; :mod:`bench.run` calls them and draws the figures):

* :func:`bench_engines`: a *stratified* trace (one session per context size, 100K..4M chars,
  calls drawn from the calibrated agent distributions, chat-template wrapped) replayed through
  every engine of :mod:`bench.baselines` call by call, engines in rotating order so machine noise
  hits them alike.  Per call: wall and process-CPU time, served characters (the whole context)
  and scanned characters (what was actually re-tokenized).  Every engine's IDs are compared with
  the truth on every call it serves: the reference (HF ``tokenizers``/tiktoken) when it ran on that
  call, else TokTier's IDs when fastokens and gigatoken (two independent implementations,
  re-tokenizing from scratch) agree with them, else a fresh reference encode.  Slow engines
  (the reference, tiktoken, gigatoken cold, the L0 cache, which misses into the reference) are
  timed on a few calls per session, spread evenly.
* :func:`bench_outcomes`: a *mixture* trace (sessions from the calibrated distributions,
  compactions and template edits included) replayed through TokTier alone: window outcome of
  every append and edit; IDs checked on every call that did not splice on the first window,
  before every compaction, at every session's end and on a seeded sample of other calls.
* :func:`bench_memory`: bytes per token and resident bytes of a session grown to 500K tokens.
* :func:`ttl_hits`: share of calls that find their token state alive under TTLs of 5 min, 1 h and
  1 day, from the mixture trace's pauses.

    python -m bench.agent_trace --quick        # prints the tables; bench.run also draws figures
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import resource
import sys
import time

import numpy as np

import toktier
from bench import traces as T
from bench.baselines import ENGINES, EngineUnavailable, Request, build, describe

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    def tqdm(x=None, **_k):  # type: ignore[no-redef]
        return x

SIZES = (100_000, 300_000, 1_000_000, 2_000_000, 4_000_000)
SAMPLED = ("hf-tokenizers", "tiktoken", "gigatoken-cold", "l0-exact")  # timed on a few calls only
SEAM_ENGINES = ("toktier", "fastokens", "fastokens-input-cache", "fastokens-segment-cache", "gigatoken",
                "overlap-resync")  # L1 has no boundary without added tokens: it would re-encode everything
EXACT_PEERS = ("fastokens", "fastokens-input-cache", "fastokens-segment-cache", "gigatoken", "hf-tokenizers",
               "tiktoken", "gigatoken-cold")


def machine() -> dict:
    info = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_gb"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    import importlib.metadata as md

    for pkg in ("tokenizers", "tiktoken", "fastokens", "gigatoken", "numpy"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    info["loadavg_start"] = os.getloadavg()
    return info


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


def _request(call: T.Call) -> Request:
    kind = call.op if call.op in ("start", "append", "edit", "compact") else "compact"
    return Request(call.sid, kind, call.text, call.delta, call.start, call.end)


def _first_diff(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    d = np.flatnonzero(a[:m] != b[:m])
    return int(d[0]) if len(d) else m


# ---------------------------------------------------------------------------------------------
# engines on the stratified trace
# ---------------------------------------------------------------------------------------------


def bench_engines(tok_name: str = "llama3", sizes=SIZES, n_calls: int = 40, samples: int = 3, seed: int = 0,
                  engines=ENGINES, out_dir: str | None = None, progress: bool = True, family: str | None = None,
                  sessions_per_size: int = 1) -> dict:
    """``n_calls`` calls in each of ``sessions_per_size`` sessions per size; ``samples`` calls per
    size timed for the slow engines.  ``family="none"`` drops the chat template: plain text, seams
    anywhere (mid-word, mid-number)."""
    tok = toktier.load_tokenizer(tok_name)
    family = family or T.family_template(tok_name)
    header, calls = T.generate_stratified(list(sizes), n_calls, seed, family=family,
                                          sessions_per_size=sessions_per_size)
    if out_dir:
        T.write(os.path.join(out_dir, f"stratified-{tok_name}-{family}-seed{seed}.jsonl"), header, calls)
    built, unavailable = {}, {}
    for name in engines:
        try:
            built[name] = build(name, tok)
        except EngineUnavailable as exc:
            unavailable[name] = str(exc)
    records: list[dict] = []  # one per (engine, call)
    divergences = {n: {"checked": 0, "diverged": 0, "by_op": {}, "examples": []} for n in built}
    outcomes: dict[str, int] = {}
    widen_hist: dict[int, int] = {}
    truth_source = {"reference": 0, "agreement": 0, "adjudicated": 0}
    rng = random.Random(seed)
    by_sid: dict[str, list[dict]] = {}
    for c in calls:
        by_sid.setdefault(c["sid"], []).append(c)
    bar = tqdm(total=len(calls), desc=f"agent trace ({tok_name})", disable=not progress, unit="call")
    for size in sizes:
        sids = [s for s in by_sid if s == f"ctx{size}" or s.startswith(f"ctx{size}-")]
        k_all = samples if (samples >= 5 or size <= 1_000_000) else min(samples, 2)  # quick: fewer at 2M+
        for j, sid in enumerate(sids):  # the size's timed calls spread over its sessions
            n_sess = len(by_sid[sid])
            k = k_all // len(sids) + (1 if j < k_all % len(sids) else 0)
            timed_idx = set(np.linspace(1, n_sess - 1, k).round().astype(int).tolist()) if k else set()
            l0_idx = set(sorted(timed_idx)[:2]) if j == 0 else set()
            for call in T.replay(header, by_sid[sid]):
                req = _request(call)
                ctx_bytes = len(call.text.encode("utf-8"))
                order = list(built)
                rng.shuffle(order)
                got: dict[str, np.ndarray] = {}
                for name in order:
                    eng = built[name]
                    if name in SAMPLED and call.op != "start" and call.index not in timed_idx:
                        continue
                    if name == "l0-exact" and call.op != "start" and (call.index not in l0_idx or
                                                                       (samples < 5 and size > 1_000_000)):
                        continue  # L0 misses into the reference on every new text: timing it twice is enough
                    if call.op == "start" and name in ("l0-exact", "gigatoken-cold", "tiktoken") and size > 1_000_000 \
                            and samples < 5:
                        continue  # quick runs: big starts are timed for the reference and the fast peers only
                    if hasattr(eng, "prepare"):
                        eng.prepare()
                    gc.disable()
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    ids = eng(req)
                    wall = time.perf_counter() - t0
                    cpu = time.process_time() - c0
                    gc.enable()
                    got[name] = np.array(ids, copy=True) if name.startswith("toktier") else ids
                    rec = {"engine": name, "bucket": size, "sid": sid, "call": call.index, "op": call.op,
                           "context_chars": len(call.text), "context_bytes": ctx_bytes, "wall_ms": wall * 1e3,
                           "cpu_ms": cpu * 1e3}
                    if name == "toktier" and eng.last is not None:
                        r = eng.last
                        rec["path"] = r.path.value
                        rec["widenings"] = int(r.widenings)
                        if call.op in ("append", "edit"):
                            outcomes[r.path.value] = outcomes.get(r.path.value, 0) + 1
                            widen_hist[int(r.widenings)] = widen_hist.get(int(r.widenings), 0) + 1
                    records.append(rec)
                # the truth for this call
                if "hf-tokenizers" in got:
                    truth, src = got["hf-tokenizers"], "reference"
                elif tok.engine.engine_name == "tiktoken" and "tiktoken" in got:
                    truth, src = got["tiktoken"], "reference"
                else:
                    t = got.get("toktier")
                    witnesses = [got[w] for w in ("fastokens", "gigatoken") if w in got]
                    if t is not None and len(witnesses) == 2 and all(np.array_equal(t, w) for w in witnesses):
                        truth, src = t, "agreement"
                    else:
                        truth, src = tok.encode(call.text), "adjudicated"
                truth_source[src] += 1
                for name, ids in got.items():
                    d = divergences[name]
                    d["checked"] += 1
                    if not np.array_equal(ids, truth):
                        d["diverged"] += 1
                        d["by_op"][call.op] = d["by_op"].get(call.op, 0) + 1
                        if len(d["examples"]) < 5:
                            i = _first_diff(ids, truth)
                            d["examples"].append({"sid": sid, "call": call.index, "op": call.op, "first_diff": i,
                                                  "len": len(ids), "ref_len": len(truth),
                                                  "got": ids[i:i + 4].tolist(), "ref": truth[i:i + 4].tolist()})
                # scanned characters of this call, per engine
                sess = built["toktier"].session(sid) if "toktier" in built else None
                for rec in records[len(records) - len(got):]:
                    name = rec["engine"]
                    eng = built[name]
                    if name == "toktier" and sess is not None:
                        st = sess.stats
                        prev = getattr(eng, "_prev_retok", {}).get(sid, 0)
                        cpt = len(call.text) / max(1, sess.num_tokens)
                        rec["scanned_chars"] = (st.tokens_retokenized - prev) * cpt if call.op != "start" \
                            else len(call.text)
                        eng.__dict__.setdefault("_prev_retok", {})[sid] = st.tokens_retokenized
                    elif hasattr(eng, "scanned_chars"):
                        prev = eng.__dict__.get("_prev_scanned", 0)
                        rec["scanned_chars"] = eng.scanned_chars - prev
                        eng._prev_scanned = eng.scanned_chars
                    else:
                        rec["scanned_chars"] = len(call.text)  # full re-tokenization (toktier-sync: see below)
                bar.update(1)
            for eng in built.values():
                eng.close(sid)
            gc.collect()
    bar.close()
    for name in ("toktier-sync",):  # same repairs as toktier plus an O(N) compare; scanned as toktier's
        tk = {(r["sid"], r["call"]): r.get("scanned_chars") for r in records if r["engine"] == "toktier"}
        for r in records:
            if r["engine"] == name:
                r["scanned_chars"] = tk.get((r["sid"], r["call"]), r["scanned_chars"])
    cache_stats = {n: {k: getattr(e, k) for k in ("hits", "misses", "partial")} for n, e in built.items()
                   if hasattr(e, "hits")}
    seg = getattr(built.get("fastokens-segment-cache"), "stats", None)
    return {"tokenizer": tok_name, "family": family, "sizes": list(sizes), "calls_per_session": n_calls,
            "sessions_per_size": sessions_per_size,
            "samples": samples,
            "seed": seed, "engines": {n: describe(n) for n in built}, "unavailable": unavailable,
            "records": records, "divergences": divergences, "truth_source": truth_source,
            "outcomes": outcomes, "widenings": {str(k): v for k, v in sorted(widen_hist.items())},
            "cache_stats": cache_stats, "segment_cache_stats": seg() if seg else None,
            "trace_summary": {k: v for k, v in T.summarize(header, calls).items() if k != "gaps"}}


def latency_table(res: dict) -> list[dict]:
    """P50/P90/P99 per engine and context size over the append/edit calls, with ratios to TokTier."""
    rows = []
    recs = [r for r in res["records"] if r["op"] in ("append", "edit")]
    for size in res["sizes"]:
        base = [r["wall_ms"] for r in recs if r["engine"] == "toktier" and r["bucket"] == size]
        b50 = pct(base, 50)
        for name in res["engines"]:
            xs = [r["wall_ms"] for r in recs if r["engine"] == name and r["bucket"] == size]
            if not xs:
                continue
            ctx = [r["context_chars"] for r in recs if r["engine"] == name and r["bucket"] == size]
            served = sum(r.get("context_bytes", r["context_chars"]) for r in recs
                         if r["engine"] == name and r["bucket"] == size)
            cpu = sum(r["cpu_ms"] for r in recs if r["engine"] == name and r["bucket"] == size) / 1e3
            scanned = sum(r.get("scanned_chars", 0) for r in recs if r["engine"] == name and r["bucket"] == size)
            rows.append({"engine": name, "bucket": size, "n": len(xs), "p50": pct(xs, 50), "p90": pct(xs, 90),
                         "p99": pct(xs, 99), "ratio_p50": pct(xs, 50) / b50 if b50 else float("nan"),
                         "ctx_min": min(ctx), "ctx_max": max(ctx),
                         "served_mb_per_core_s": served / 1e6 / cpu if cpu > 0 else float("inf"),
                         "scanned_chars_per_call": scanned / len(xs),
                         "scanned_mchars_per_core_s": scanned / 1e6 / cpu if cpu > 0 else float("inf")})
    return rows


def start_table(res: dict) -> list[dict]:
    rows = []
    for r in res["records"]:
        if r["op"] == "start":
            rows.append({"engine": r["engine"], "bucket": r["bucket"], "ms": r["wall_ms"]})
    return rows


def calls_per_size(res: dict) -> str:
    """'30 calls per size' or '7 sessions x 30 calls per size'."""
    k = res.get("sessions_per_size", 1)
    return f"{k} sessions x {res['calls_per_session']} calls per size" if k > 1 else \
        f"{res['calls_per_session']} calls per size"


def print_engines(res: dict) -> None:
    print(f"\n## Per-call latency on agent traces ({res['tokenizer']}, template {res.get('family')}; "
          f"append/edit calls; "
          f"{calls_per_size(res)}; slow engines timed on {res['samples']} calls per size)")
    print(f"{'engine':<25} {'context':>9} {'n':>4} {'P50 ms':>9} {'P90 ms':>9} {'P99 ms':>9} {'P50 / toktier':>14} "
          f"{'served MB/core-s':>17} {'scanned chars/call':>19} {'scanned Mchar/core-s':>21}")
    for row in latency_table(res):
        print(f"{row['engine']:<25} {row['bucket']:>9,} {row['n']:>4} {row['p50']:>9.3f} {row['p90']:>9.3f} "
              f"{row['p99']:>9.3f} {row['ratio_p50']:>13.1f}x {row['served_mb_per_core_s']:>17.1f} "
              f"{row['scanned_chars_per_call']:>19,.0f} {row['scanned_mchars_per_core_s']:>21.2f}")
    print("\n## Session starts (full-context calls), ms")
    starts = start_table(res)
    names = list(dict.fromkeys(r["engine"] for r in starts))
    print(f"{'engine':<25} " + " ".join(f"{s:>10,}" for s in res["sizes"]))
    for n in names:
        cells = {r["bucket"]: r["ms"] for r in starts if r["engine"] == n}
        print(f"{n:<25} " + " ".join(f"{cells[s]:>10.1f}" if s in cells else f"{'-':>10}" for s in res["sizes"]))
    print("\n## Divergences from the reference (calls served / calls whose IDs differ)")
    for n, d in res["divergences"].items():
        print(f"{n:<25} {d['checked']:>6} served  {d['diverged']:>5} diverged  {d['by_op'] or ''}")
        for ex in d["examples"][:2]:
            print(f"{'':<27}e.g. {ex}")
    print(f"truth per call: {res['truth_source']}")
    if res["unavailable"]:
        print(f"unavailable: {res['unavailable']}")
    print(f"cache hits/misses/partial: {res['cache_stats']}")


# ---------------------------------------------------------------------------------------------
# adversarial seams: correctness of every cache-style design, checked on every call
# ---------------------------------------------------------------------------------------------

ADVERSARIAL_ENGINES = ("toktier", "toktier-sync", "l1-special-prefix", "overlap-resync", "fastokens-input-cache",
                       "fastokens-segment-cache", "gigatoken")


def bench_adversarial(tok_name: str = "llama3", n_sessions: int = 40, calls: int = 60, seed: int = 11,
                      engines=ADVERSARIAL_ENGINES, progress: bool = True) -> dict:
    """Small sessions (a few K chars) over every corpus category (code, CJK, Arabic, emoji ZWJ
    sequences, CRLF, JSON, logs...) with the tokenizer's own added-token literals sprinkled in,
    grown by appends cut at *arbitrary* characters (mid-word, mid-number, mid-whitespace-run,
    inside an added-token literal, between a base character and its combining mark) plus a few
    mid-text edits.  Every engine's IDs are compared with a reference encode on every call."""
    from toktier.tools.corpus import samples

    tok = toktier.load_tokenizer(tok_name)
    rng = random.Random(f"adversarial:{seed}")
    pool = [smp for smp in samples(max_chars_per_sample=40_000, seed=seed) if len(smp.text) >= 5000]
    lits = sorted({lit.content for lit in tok.engine.literals})
    lits = [x for x in lits if "reserved" not in x] or lits
    built = {}
    for name in engines:
        try:
            built[name] = build(name, tok)
        except EngineUnavailable:
            pass
    div = {n: {"checked": 0, "diverged": 0, "examples": []} for n in built}
    by_cat: dict[str, int] = {}
    bar = tqdm(total=n_sessions * (calls + 1), desc=f"adversarial seams ({tok_name})", disable=not progress,
               unit="call")
    for k in range(n_sessions):
        smp = pool[(k * 7) % len(pool)]  # stride through the categories
        by_cat[smp.category] = by_cat.get(smp.category, 0) + 1
        src = smp.text
        # sprinkle literals (and broken halves of literals) at random places
        pieces, pos = [], 0
        while pos < len(src):
            step = rng.randint(50, 1500)
            pieces.append(src[pos:pos + step])
            pos += step
            if lits and rng.random() < 0.6:
                lit = rng.choice(lits)
                pieces.append(lit if rng.random() < 0.85 else lit[: rng.randint(1, len(lit) - 1)])
        stream = "".join(pieces)
        sid = f"adv{k}"
        cut = rng.randint(500, 4000)
        text = stream[:cut]
        reqs = [Request(sid, "start", text)]
        for _ in range(calls):
            if rng.random() < 0.08 and len(text) > 200:  # an edit in the middle (a template rewrite)
                a = rng.randint(len(text) // 2, len(text) - 50)
                b = min(len(text), a + rng.randint(0, 40))
                ins = stream[rng.randint(0, len(stream) - 20):][: rng.randint(0, 20)]
                new = text[:a] + ins + text[b:]
                reqs.append(Request(sid, "edit", new, ins, a, b))
                text = new
                continue
            n = rng.choice((1, 1, 2, 3, 5, 8, 13, 40, 120, 400, 1500))
            if cut >= len(stream):
                break
            delta = stream[cut:cut + n]
            cut += n
            text = text + delta
            reqs.append(Request(sid, "append", text, delta))
        for req in reqs:
            ref = tok.encode(req.text)
            for name, eng in built.items():
                ids = eng(req)
                d = div[name]
                d["checked"] += 1
                if not np.array_equal(ids, ref):
                    d["diverged"] += 1
                    if len(d["examples"]) < 3:
                        i = _first_diff(ids, ref)
                        d["examples"].append({"category": smp.name, "op": req.kind, "first_diff": i,
                                              "text_near": req.text[max(0, len(req.text) - 40):]})
            bar.update(1)
        for eng in built.values():
            eng.close(sid)
    bar.close()
    return {"tokenizer": tok_name, "sessions": n_sessions, "calls_per_session": calls, "seed": seed,
            "categories": by_cat, "divergences": div}


def print_adversarial(res: dict) -> None:
    print(f"\n## Adversarial seams ({res['tokenizer']}, {res['sessions']} sessions x {res['calls_per_session']} calls, "
          f"cuts anywhere; every call checked against the reference)")
    for n, d in res["divergences"].items():
        print(f"  {n:<25} {d['checked']:>6} checked  {d['diverged']:>5} diverged"
              + (f"   e.g. {d['examples'][0]}" if d["examples"] else ""))


# ---------------------------------------------------------------------------------------------
# TokTier alone on the mixture trace
# ---------------------------------------------------------------------------------------------


def bench_outcomes(tok_name: str = "llama3", n_sessions: int = 40, seed: int = 1, check_rate: float = 0.05,
                   heavy: bool = False, out_dir: str | None = None, progress: bool = True,
                   small_contexts: bool = False) -> dict:
    """Replay a mixture trace through TokTier: window outcomes, latency by op, checked states.

    ``small_contexts`` keeps the trace's append/edit shape but starts sessions at 10K-60K
    characters (capped at 400K): the many-appends campaign behind the first-window rate, whose
    outcome depends on the text near the seam, not on the context size.
    """
    tok = toktier.load_tokenizer(tok_name)
    cfg = T.TraceConfig.heavy() if heavy else T.TraceConfig()
    if small_contexts:
        import dataclasses

        cfg = dataclasses.replace(cfg, start_median=20_000.0, start_p90=60_000.0, max_context=400_000)
    header, calls = T.generate_mixture(n_sessions, seed, cfg, family=T.family_template(tok_name))
    if out_dir:
        tag = ("-heavy" if heavy else "") + ("-small" if small_contexts else "")
        T.write(os.path.join(out_dir, f"mixture-{tok_name}-seed{seed}{tag}.jsonl"), header, calls)
    from bench.baselines.full import FastokensFull

    witness = FastokensFull(tok)  # a fast independent witness; disagreements are adjudicated by the reference
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    widen_hist: dict[int, int] = {}
    reasons: dict[str, int] = {}
    by_op: dict[str, dict[str, int]] = {}
    lat: dict[str, list[float]] = {}
    checked = mismatches = adjudicated = 0
    examples = []
    by_sid: dict[str, list[dict]] = {}
    for c in calls:
        by_sid.setdefault(c["sid"], []).append(c)
    bar = tqdm(total=len(calls), desc="mixture replay (toktier)", disable=not progress, unit="call")
    for sid, cs in by_sid.items():
        cs.sort(key=lambda c: c["call"])
        sess = None
        replayed = list(T.replay(header, cs))
        for k, call in enumerate(replayed):
            t0 = time.perf_counter()
            if call.op == "start":
                sess = toktier.Session(tok, call.text)
                r = None
            elif call.op == "append":
                r = sess.append(call.delta)
            elif call.op == "edit":
                r = sess.edit(call.start, call.end, call.delta)
            else:
                r = sess.sync(call.text)
            dt = (time.perf_counter() - t0) * 1e3
            lat.setdefault(call.op, []).append(dt)
            if r is not None:
                p = r.path.value
                by_op.setdefault(call.op, {}).setdefault(p, 0)
                by_op[call.op][p] += 1
                if call.op in ("append", "edit"):
                    outcomes[p] = outcomes.get(p, 0) + 1
                    widen_hist[int(r.widenings)] = widen_hist.get(int(r.widenings), 0) + 1
                    if r.reason:
                        reasons[r.reason] = reasons.get(r.reason, 0) + 1
            nxt = replayed[k + 1] if k + 1 < len(replayed) else None
            must = (r is not None and r.path.value not in ("first_window", "noop")) or nxt is None or \
                (nxt is not None and nxt.op == "compact")
            if must or rng.random() < check_rate:
                checked += 1
                ids = sess.ids
                w = witness(Request(sid, "compact", call.text))
                if not np.array_equal(ids, w):
                    adjudicated += 1
                    ref = tok.encode(call.text)
                    if not np.array_equal(ids, ref):
                        mismatches += 1
                        if len(examples) < 5:
                            examples.append({"sid": sid, "call": call.index, "op": call.op,
                                             "first_diff": _first_diff(ids, ref)})
            bar.update(1)
        del sess, replayed
        gc.collect()
    bar.close()
    summary = T.summarize(header, calls)
    gaps = summary.pop("gaps")
    return {"tokenizer": tok_name, "sessions": n_sessions, "seed": seed, "heavy": heavy, "small_contexts": small_contexts,
            "outcomes": outcomes, "widenings": {str(k): v for k, v in sorted(widen_hist.items())},
            "full_reasons": reasons, "by_op": by_op,
            "latency_ms": {op: {"n": len(x), "p50": pct(x, 50), "p99": pct(x, 99)} for op, x in lat.items()},
            "checked": checked, "mismatches": mismatches, "witness_disagreements": adjudicated,
            "examples": examples, "trace_summary": summary, "ttl": ttl_hits(gaps)}


def ttl_hits(gaps: list[float], ttls=(("5 min", 300), ("1 h", 3600), ("1 day", 86400))) -> dict:
    """Share of non-first calls whose session was used within the TTL (state still alive)."""
    g = np.asarray(gaps, dtype=float)
    return {name: float((g <= s).mean()) if len(g) else float("nan") for name, s in ttls}


def print_outcomes(res: dict) -> None:
    o = res["outcomes"]
    total = sum(o.values())
    fw = o.get("first_window", 0)
    print(f"\n## Window outcomes, mixture trace ({res['sessions']} sessions, {total} appends/edits, "
          f"{'heavy' if res['heavy'] else 'standard'} variant)")
    for k in ("first_window", "widened", "full", "noop"):
        if k in o:
            print(f"  {k:<13} {o[k]:>7}  {o[k] / max(1, total):8.4%}")
    print(f"  widenings histogram: {res['widenings']}   full-path reasons: {res['full_reasons'] or '-'}")
    print(f"  by op: {res['by_op']}")
    print(f"  first-window share: {fw / max(1, total):.4%} (goal >= 99.99%)")
    print(f"  latency by op (ms): " + ", ".join(f"{k} P50 {v['p50']:.2f} P99 {v['p99']:.2f} (n={v['n']})"
                                                for k, v in res["latency_ms"].items()))
    print(f"  checked {res['checked']} states: {res['mismatches']} mismatches vs the reference "
          f"({res['witness_disagreements']} witness disagreements adjudicated)")
    s = res["trace_summary"]
    print(f"  trace: {s['calls']} calls, full-context share {s['full_context_share']:.1%}, append P50/P90 "
          f"{s['append_p50']:.0f}/{s['append_p90']:.0f} chars, context P10/P50/P90 {s['context_p10_chars']:,.0f}/"
          f"{s['context_p50_chars']:,.0f}/{s['context_p90_chars']:,.0f} chars, calls/turn P50/P90 "
          f"{s['calls_per_turn_p50']:.0f}/{s['calls_per_turn_p90']:.0f}, {s['edits']} edits, "
          f"{s['compactions']} compactions")
    print("  token-state TTL hit share: " + ", ".join(f"{k} {v:.1%}" for k, v in res["ttl"].items()))


# ---------------------------------------------------------------------------------------------
# session memory
# ---------------------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def bench_memory(tok_name: str = "llama3", target_tokens: int = 500_000, append_chars: int = 1400,
                 seed: int = 3) -> dict:
    tok = toktier.load_tokenizer(tok_name)
    import tracemalloc

    text = T.large_text(int(target_tokens * 4.5), seed=seed, kind="mixed")
    gc.collect()
    tracemalloc.start()
    rss0 = tracemalloc.get_traced_memory()[0]
    s = toktier.Session(tok, "")
    pos = 0
    samples = []
    t0 = time.perf_counter()
    while s.num_tokens < target_tokens and pos < len(text):
        s.append(text[pos : pos + append_chars])
        pos += append_chars
        if len(samples) == 0 or s.num_tokens >= samples[-1]["tokens"] * 1.25:
            samples.append({"tokens": s.num_tokens, "nbytes": s.nbytes, "text_bytes": s.num_bytes,
                            "rss_delta": tracemalloc.get_traced_memory()[0] - rss0})
    grow_s = time.perf_counter() - t0
    gc.collect()
    final = {"tokens": s.num_tokens, "chars": pos, "nbytes": s.nbytes, "text_bytes": s.num_bytes,
             "rss_delta": tracemalloc.get_traced_memory()[0] - rss0, "appends": pos // append_chars,
             "grow_s": grow_s, "process_rss": _rss()}
    tracemalloc.stop()
    final["bytes_per_token_arrays"] = (s.nbytes - s.num_bytes) / max(1, s.num_tokens)
    final["bytes_per_token_total"] = s.nbytes / max(1, s.num_tokens)
    exact = bool(np.array_equal(s.ids, tok.encode(s.text)))
    return {"final": final, "samples": samples, "exact": exact}


def print_memory(res: dict) -> None:
    f = res["final"]
    print(f"\n## Session memory (grown by {f['appends']} appends of 1.4K chars to {f['tokens']:,} tokens)")
    print(f"  session nbytes {f['nbytes'] / 2**20:.1f} MiB = text {f['text_bytes'] / 2**20:.1f} MiB + arrays "
          f"{(f['nbytes'] - f['text_bytes']) / 2**20:.1f} MiB; {f['bytes_per_token_arrays']:.2f} B/token arrays, "
          f"{f['bytes_per_token_total']:.2f} B/token with text; traced allocations grew "
          f"{f['rss_delta'] / 2**20:.1f} MiB "
          f"(goal <= 8 B/token + text); exact: {res['exact']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="llama3")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    calls = args.calls or (30 if args.quick else 200)
    res = bench_engines(args.tokenizer, [int(x) for x in args.sizes.split(",")], calls, 3 if args.quick else 10,
                        engines=args.engines.split(","))
    print_engines(res)
    out = bench_outcomes(args.tokenizer, 20 if args.quick else 200)
    print_outcomes(out)
    mem = bench_memory(args.tokenizer)
    print_memory(mem)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engines": res, "outcomes": out, "memory": mem}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
