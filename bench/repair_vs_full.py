"""Repair vs. full re-tokenization on growing real-text sessions.

For each bundled tokenizer and each context size (100K, 300K, 1M, 2M, 4M chars)
a session is built on real text, then receives appends whose sizes are drawn
log-normally around a 1.4K-char median (P90 ~10K).  In the same run and process
it times:

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
from toktier.corpus import large_text
from toktier.errors import TokenizerDataMissing

SIZES = (100_000, 300_000, 1_000_000, 2_000_000, 4_000_000)
MEDIAN_APPEND = 1400
SIGMA = math.log(10_000 / MEDIAN_APPEND) / 1.2816  # P90 ~ 10K chars


def append_sizes(rng: random.Random, n: int) -> list[int]:
    return [max(1, min(60_000, int(rng.lognormvariate(math.log(MEDIAN_APPEND), SIGMA)))) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def run_one(name: str, size: int, n_appends: int, n_full: int, seed: int, kind: str) -> dict:
    tok = load_tokenizer(name)
    rng = random.Random(seed)
    sizes = append_sizes(rng, n_appends)
    # The appended material is the same at every context size, so the sizes differ
    # only in how much context precedes the appends (a fair flatness comparison).
    text = large_text(size, seed=seed, kind=kind) + large_text(sum(sizes), seed=seed + 1, kind=kind)
    if tok.family_info is not None and tok.family_info.nfc:
        text = tok.engine.normalize(text)
    session = Session(tok, text[:size])
    pos = size
    repair_ms: list[float] = []
    full_ms: list[float] = []
    outcomes = {p.value: 0 for p in RepairPath}
    for i, n in enumerate(sizes):
        chunk = text[pos : pos + n]
        pos += n
        t0 = time.perf_counter()
        r = session.append(chunk)
        repair_ms.append((time.perf_counter() - t0) * 1e3)
        outcomes[r.path.value] += 1
        if i < n_full:
            full_text = text[:pos]
            t0 = time.perf_counter()
            tok.encode(full_text)
            full_ms.append((time.perf_counter() - t0) * 1e3)
    exact = bool(np.array_equal(session.ids, tok.encode(text[:pos])))
    return {
        "tokenizer": name, "family": tok.family, "engine": tok.engine.engine_name, "context_chars": size,
        "appends": n_appends, "repair_p50_ms": pct(repair_ms, 50), "repair_p90_ms": pct(repair_ms, 90),
        "full_p50_ms": pct(full_ms, 50), "full_p90_ms": pct(full_ms, 90),
        "outcomes": outcomes, "exact": exact, "tokens": session.num_tokens,
        "bytes_per_token_arrays": (session.nbytes - session.num_bytes) / max(1, session.num_tokens),
    }


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
        for size in map(int, args.sizes.split(",")):
            try:
                row = run_one(name, size, args.appends, args.full, args.seed, args.kind)
            except TokenizerDataMissing as exc:
                print(f"{name:<12} skipped: {exc}")
                break
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
