"""Session-start (full tokenization) latency: parallel CPU chunks vs. a single reference encode and peers.

For each tokenizer and size (100K, 1M, 4M chars of real text), in one process:

* reference: one `encode` call of the reference engine (HF `tokenizers` / tiktoken);
* toktier-parallel: `toktier.fullpath.encode_full` (chunks cut at standalone-stable
  boundaries, one thread per core in the native engine);
* toktier-session: `Session(tok, text)`, what a session start costs (the chunk threads also lay
  the IDs, the UTF-8 and the checkpoints out in the session's buffers);
* fastokens, gigatoken: the first encode on a fresh tokenizer object (cold caches;
  construction not timed) on their array paths, when installed and the tokenizer is a
  tokenizer.json.

Prints the median of `--reps` runs, the ratio to the single reference encode, and
whether each output equals the reference (a peer's mismatch is reported, not hidden).

    python -m bench.full_path [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

from toktier import Session, load_tokenizer
from toktier.tools.corpus import large_text
from toktier.fullpath import encode_full


def _peers(tok):
    """Fresh-object makers of the peers on their fastest array paths (`bench.peers`' own factories:
    fastokens' ``encode_batch_flat`` -> numpy, gigatoken's ``encode`` ndarray), when installed and
    able to load this tokenizer's file; each rep times a new object's first encode."""
    from bench.peers import fastokens_factory, gigatoken_factory

    out = {}
    for label, factory in (("fastokens", fastokens_factory), ("gigatoken", gigatoken_factory)):
        try:
            make = factory(tok)
            make()("warm up")
        except Exception as exc:  # not installed, or not this kind of file: reported, not fatal
            print(f"  ({label} unavailable for {tok.name}: {type(exc).__name__})")
            continue
        out[label] = make
    return out


def timed(fn, text, reps, fresh=None):
    """Median ms of `fn(text)`; with `fresh`, each rep times a new object's first encode
    (object construction is not timed)."""
    from bench.peers import fresh_copy

    times, result = [], None
    for _ in range(reps):
        call = fresh() if fresh is not None else fn
        own = fresh_copy(text)  # untimed: a str whose UTF-8 no earlier call made (CPython caches it)
        t0 = time.perf_counter()
        result = call(own)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times)), result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizers", default="llama3,cl100k_base,o200k_base,deepseek_v4")
    ap.add_argument("--sizes", default="100000,1000000,4000000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kind", default="mixed")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.reps = "100000,1000000", 2
    print(f"# full path — {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"kind={args.kind}; medians of {args.reps}")
    print(f"{'tokenizer':<12} {'chars':>9} {'engine':<18} {'ms':>9} {'vs reference':>13} exact")
    ok = True
    for name in args.tokenizers.split(","):
        tok = load_tokenizer(name)
        engines = {"reference": tok.encode, "toktier-parallel": lambda t, _tok=tok: encode_full(_tok, t),
                   "toktier-session": lambda t, _tok=tok: Session(_tok, t).ids}
        peers = _peers(tok)
        for size in map(int, args.sizes.split(",")):
            text = large_text(size, seed=7, kind=args.kind)
            ref_ms, ref = timed(engines["reference"], text, args.reps)
            runs = [(n, f, None) for n, f in engines.items()] + [(n, None, f) for n, f in peers.items()]
            for ename, fn, fresh in runs:
                ms, ids = (ref_ms, ref) if ename == "reference" else timed(fn, text, args.reps, fresh)
                exact = bool(np.array_equal(ids, ref))
                ok &= exact or ename in ("fastokens", "gigatoken")
                print(f"{name:<12} {size:>9,} {ename:<18} {ms:>9.1f} {ref_ms / ms:>12.2f}x {exact}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
