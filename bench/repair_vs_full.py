"""Repair vs. full re-tokenization on growing real-text sessions.

For each bundled tokenizer, one session per context size (100K, 300K, 1M, 2M,
4M chars of real text) receives the same appends, whose sizes are drawn
log-normally around a 1.4K-char median (P90 ~10K); appends are interleaved across
the sizes so machine noise hits all sizes alike.  In the same run it times:

* repair: `Session.append` (window re-tokenization + certified splice);
* full:   the reference engine re-tokenizing the whole new text (HF `tokenizers`
          for tokenizer.json files, tiktoken for rank files) — what a stateless
          front end does on every call.

It prints P50/P90 of each, their ratio, and the window outcome counts, and
checks the final session IDs against the reference (exit 1 on any mismatch).

    python -m bench.repair_vs_full            # all tokenizers, all sizes
    python -m bench.repair_vs_full --quick    # fewer samples
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time

import numpy as np

from toktier import RepairPath, Session, load_tokenizer
from toktier.tools.corpus import large_text
from toktier.errors import TokenizerDataMissing

SIZES = (100_000, 300_000, 1_000_000, 2_000_000, 4_000_000)
MEDIAN_APPEND = 1400
SIGMA = math.log(10_000 / MEDIAN_APPEND) / 1.2816  # P90 ~ 10K chars


def append_sizes(rng: random.Random, n: int) -> list[int]:
    return [max(1, min(60_000, int(rng.lognormvariate(math.log(MEDIAN_APPEND), SIGMA)))) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def run_tokenizer(name: str, sizes_chars: list[int], n_appends: int, n_full: int, seed: int,
                  kind: str) -> list[dict]:
    """One session per context size; the same appends are applied to all of them,
    interleaved, so machine noise hits every size alike (a fair flatness comparison)."""
    tok = load_tokenizer(name)
    rng = random.Random(seed)
    sizes = append_sizes(rng, n_appends)
    appended = large_text(sum(sizes), seed=seed + 1, kind=kind)
    norm = tok.engine.normalize if tok.family_info is not None and tok.family_info.nfc else (lambda t: t)
    appended = norm(appended)
    contexts = {n: norm(large_text(n, seed=seed, kind=kind)) for n in sizes_chars}
    sessions = {n: Session(tok, contexts[n]) for n in sizes_chars}
    repair_ms: dict[int, list[float]] = {n: [] for n in sizes_chars}
    outcomes = {n: {p.value: 0 for p in RepairPath} for n in sizes_chars}
    pos = 0
    for n_app in sizes:
        chunk = appended[pos : pos + n_app]
        pos += n_app
        for n, session in sessions.items():
            t0 = time.perf_counter()
            r = session.append(chunk)
            repair_ms[n].append((time.perf_counter() - t0) * 1e3)
            outcomes[n][r.path.value] += 1
    rows = []
    for n in list(sessions):
        session = sessions[n]
        full_text = contexts[n] + appended[:pos]
        full_ms = []
        for _ in range(n_full):
            t0 = time.perf_counter()
            ref = tok.encode(full_text)
            full_ms.append((time.perf_counter() - t0) * 1e3)
        rows.append({
            "tokenizer": name, "family": tok.family, "engine": tok.engine.engine_name, "context_chars": n,
            "appends": n_appends, "repair_p50_ms": pct(repair_ms[n], 50), "repair_p90_ms": pct(repair_ms[n], 90),
            "full_p50_ms": pct(full_ms, 50), "full_p90_ms": pct(full_ms, 90),
            "outcomes": outcomes[n], "exact": bool(np.array_equal(session.ids, ref)), "tokens": session.num_tokens,
            "bytes_per_token_arrays": (session.nbytes - session.num_bytes) / max(1, session.num_tokens),
        })
        del sessions[n]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizers", default="cl100k_base,o200k_base,llama3,deepseek_v4,qwen3")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--appends", type=int, default=60)
    ap.add_argument("--full", type=int, default=5, help="full re-tokenizations timed per size")
    ap.add_argument("--quick", action="store_true", help="30 appends, 3 full encodes per size")
    ap.add_argument("--kind", default="code", choices=["code", "english", "mixed", "multilingual"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write rows as JSON to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.appends, args.full = 30, 3
    rows = []
    print(f"# repair vs full re-tokenization — {platform.machine()}, {platform.python_version()}, "
          f"kind={args.kind}, seed={args.seed}, appends median {MEDIAN_APPEND} chars")
    print(f"{'tokenizer':<12} {'family':<9} {'engine':<10} {'context':>9} {'repair P50':>11} {'P90':>8} "
          f"{'full P50':>10} {'P90':>9} {'P50 ratio':>10}  outcomes (first/widened/full)  exact")
    for name in args.tokenizers.split(","):
        try:
            new_rows = run_tokenizer(name, [int(x) for x in args.sizes.split(",")], args.appends, args.full,
                                     args.seed, args.kind)
        except TokenizerDataMissing as exc:
            print(f"{name:<12} skipped: {exc}")
            continue
        for row in new_rows:
            size = row["context_chars"]
            rows.append(row)
            o = row["outcomes"]
            print(f"{name:<12} {row['family'] or '-':<9} {row['engine']:<10} {size:>9,} "
                  f"{row['repair_p50_ms']:>9.3f}ms {row['repair_p90_ms']:>6.2f}ms "
                  f"{row['full_p50_ms']:>8.1f}ms {row['full_p90_ms']:>7.1f}ms "
                  f"{row['full_p50_ms'] / row['repair_p50_ms']:>9.0f}x  "
                  f"{o['first_window']:>5}/{o['widened']}/{o['full']:<18} {row['exact']}", flush=True)
    for name in {r["tokenizer"] for r in rows}:
        mine = [r for r in rows if r["tokenizer"] == name]
        lo = next((r for r in mine if r["context_chars"] == min(x["context_chars"] for x in mine)), None)
        hi = next((r for r in mine if r["context_chars"] == max(x["context_chars"] for x in mine)), None)
        if lo and hi and lo is not hi:
            print(f"{name}: repair P50 at {hi['context_chars']:,} / at {lo['context_chars']:,} chars = "
                  f"{hi['repair_p50_ms'] / lo['repair_p50_ms']:.2f}x (flat = 1.0)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
