"""Single-core encode throughput of the native engine per family and content kind (issue 14).

For each bundled tokenizer and each content kind, ``--texts`` different texts of ``--chars``
characters are encoded on one thread:

* ``new``: text 0 first (untimed), then texts 1.. once each: the piece cache holds the
  kind's common pieces but not these texts, which is what a session start or a big append
  of fresh material sees;
* ``cold``: a fresh piece cache;
* ``warm``: the same text again (every piece cached);
* ``reference``: the reference's fastest array call (``tok.engine.encode_fast``: HF
  ``encode_batch_fast`` ids list -> numpy, tiktoken ``encode_to_numpy``).

Kinds: ``english``, ``code``, ``mixed``, ``multilingual`` (``toktier.tools.corpus.large_text``),
``cjk`` (the corpus' CJK samples, reshuffled), ``listing`` (``ls -l`` lines of the corpus'
source file names) and ``table`` (a markdown table of words, counts, amounts and codes); all are
deterministic.  Throughput is UTF-8 MB (10^6 bytes) per second of the calling thread's CPU time
(``time.thread_time``: on a shared machine, time spent preempted is not counted; nor is work a
reference hands to threads of its own), median over
``--repeat`` rounds.  Each result is checked equal to the reference.  NFC families encode the
NFC form of the text (the engine's NFC check skipped, as `NativeEngine` does once the reference
normalizer has confirmed the text).

``--ab TREE`` compares this build with another one in the same process: TREE is a checkout
whose ``toktier/native`` holds a built extension (e.g. ``git worktree add /tmp/wt HEAD`` and
``python setup.py build_ext --inplace`` there).  Both engines get the same tables; their calls
alternate text by text, and the ``new`` medians of both are printed with their ratio (with
``--cold``, each timed encode gets a fresh piece cache instead: every piece is BPE'd, which is
where the BPE loops differ).
``--scanner-ab`` does the same with a second engine of this build whose block scanner is off
(`CoreEngine.use_block_scanner`): the block scanner's share of the speed.

Usage: ``python -m bench.engine_speed [--chars 400000] [--kinds english,code,cjk,listing,table]
[--only llama3] [--ab /tmp/wt [--cold]] [--scanner-ab]``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import random
import statistics
import time

import numpy as np

NAMES = ("llama3", "cl100k_base", "o200k_base", "qwen3", "deepseek_v4")
KINDS = ("english", "code", "cjk", "listing", "table", "mixed", "multilingual")


def make_text(kind: str, n: int, seed: int) -> str:
    """`n` characters of content `kind` (deterministic in `seed`)."""
    from toktier.tools import corpus

    if kind in corpus.LARGE_KINDS:
        return corpus.large_text(n, seed=500 + seed, kind=kind)
    rng = random.Random(f"engine_speed:{kind}:{seed}")
    parts: list[str] = []
    total = 0
    if kind == "cjk":
        texts = [s.text for s in corpus._samples(corpus._POOL_SAMPLE_CHARS, 0) if s.category == "cjk"]
        pool = [t[j:j + 2000] for t in texts for j in range(0, len(t), 2000)]
        while total < n:
            parts.append(rng.choice(pool))
            total += len(parts[-1])
    elif kind == "listing":
        names = sorted({name for name, _ in corpus._python_sources()} | {name for name, _ in corpus._c_sources()})
        while total < n:
            line = "%s 1 user staff %8d %s %2d %02d:%02d /srv/app/%s\n" % (
                rng.choice(("-rw-r--r--", "-rwxr-xr-x", "drwxr-xr-x")), rng.randrange(1, 10**7),
                rng.choice(("Jan", "Feb", "Mar", "Nov", "Dec")), rng.randrange(1, 29), rng.randrange(24),
                rng.randrange(60), rng.choice(names).lstrip("/"))
            parts.append(line)
            total += len(line)
    elif kind == "table":
        words = ("alpha beta gamma delta region total revenue cost units price margin north south east west "
                 "q1 q2 q3 q4").split()
        parts.append("| name | group | count | amount | pct | code |\n|---|---|---|---|---|---|\n")
        while total < n:
            line = "| %s | %s | %d | %.2f | %d%% | %s-%04d |\n" % (
                rng.choice(words), rng.choice(words).title(), rng.randrange(10**6), rng.random() * 1e4,
                rng.randrange(100), rng.choice(words)[:3].upper(), rng.randrange(10000))
            parts.append(line)
            total += len(line)
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    return "".join(parts)[:n]


def _load_extension(tree: str):
    """The `_engine` extension built in another checkout, loaded beside this one."""
    paths = glob.glob(os.path.join(tree, "toktier", "native", "_engine*.so"))
    if not paths:
        raise SystemExit(f"no built extension under {tree}/toktier/native")
    spec = importlib.util.spec_from_file_location("engine_speed_other._engine", paths[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _core_for(tok, module):
    """A `CoreEngine` of `module` over `tok`'s tables (`toktier.native.build` with that module)."""
    import toktier.native as tn

    mine = tn._core
    tn._core = module
    try:
        eng, why = tn.build(tok)
    finally:
        tn._core = mine
    if eng is None:
        raise SystemExit(f"{tok.name}: {why}")
    return eng._core


def main(argv: list[str] | None = None) -> int:
    import toktier
    import toktier.native as tn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=400_000)
    ap.add_argument("--texts", type=int, default=4, help="texts per kind (the first only warms the cache)")
    ap.add_argument("--kinds", default="english,code,cjk,listing,table")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", action="append", choices=NAMES)
    ap.add_argument("--ab", metavar="TREE", help="compare with the extension built in TREE (in-process)")
    ap.add_argument("--cold", action="store_true",
                    help="with --ab/--scanner-ab: a fresh piece cache for every timed encode")
    ap.add_argument("--scanner-ab", action="store_true",
                    help="compare this build with itself, its block scanner switched off (in-process)")
    args = ap.parse_args(argv)
    clock = time.thread_time
    other = _load_extension(args.ab) if args.ab else None
    ab = other is not None or args.scanner_ab
    if not ab:
        print(f"{'tokenizer':<12} {'kind':<8} {'MB':>5} {'new':>11} {'cold':>11} {'warm':>11} {'reference':>11}")
    else:
        label = args.ab if other is not None else "per-character scanner"
        col = "cold" if args.cold else "new"
        print(f"{'tokenizer':<12} {'kind':<8} {'MB':>5} {col + ' (' + label + ')':>24} {col + ' (this)':>12} "
              f"{'ratio':>6}")
    bad = 0
    for name in args.only or NAMES:
        tok = toktier.load_tokenizer(name)
        if tok.native is None:
            print(f"{name:<12} not certified: {tok.native_reason}")
            continue
        cores = {"this": tok.native._core}
        mods = {"this": tn._core}
        if other is not None:
            cores["other"], mods["other"] = _core_for(tok, other), other
        elif args.scanner_ab:  # the same tables and code, `Engine::pretok_block` off
            cores["other"], mods["other"] = _core_for(tok, tn._core), tn._core
            cores["other"].use_block_scanner(False)
        nfc = bool(tok.family_info.nfc)
        for kind in args.kinds.split(","):
            xs = [make_text(kind, args.chars, i) for i in range(args.texts)]
            if nfc:
                xs = [tok.engine.normalize(x) for x in xs]
            mbs = [len(x.encode("utf-8")) / 1e6 for x in xs]
            wants = [tok.engine.encode(x) for x in xs]
            new = {k: [] for k in cores}
            cold, warm, ref = [], [], []
            for r in range(args.repeat):
                caches = {k: mods[k].PieceCacheBox() for k in cores}
                for k in cores:
                    cores[k].encode(xs[0], caches[k], False, not nfc)
                for i in range(1, len(xs)):
                    for k in (sorted(cores) if (r + i) % 2 else sorted(cores, reverse=True)):
                        cache = mods[k].PieceCacheBox() if args.cold else caches[k]
                        t0 = clock()
                        st, ids, _ = cores[k].encode(xs[i], cache, False, not nfc)
                        new[k].append(mbs[i] / (clock() - t0))
                        if st != 0 or not np.array_equal(ids, wants[i]):
                            bad += 1
                            print(f"MISMATCH {name} {kind} text {i} ({k})")
                if not ab:
                    fresh = mods["this"].PieceCacheBox()
                    t0 = clock()
                    st, ids, _ = cores["this"].encode(xs[1], fresh, False, not nfc)
                    t1 = clock()
                    st2, ids2, _ = cores["this"].encode(xs[1], fresh, False, not nfc)
                    t2 = clock()
                    tok.engine.encode_fast(xs[1])
                    t3 = clock()
                    cold.append(mbs[1] / (t1 - t0))
                    warm.append(mbs[1] / (t2 - t1))
                    ref.append(mbs[1] / (t3 - t2))
                    if st or st2 or not (np.array_equal(ids, wants[1]) and np.array_equal(ids2, wants[1])):
                        bad += 1
                        print(f"MISMATCH {name} {kind} (cold/warm)")
            med = {k: statistics.median(v) for k, v in new.items()}
            mb = statistics.mean(mbs)
            if not ab:
                print(f"{name:<12} {kind:<8} {mb:>5.2f} {med['this']:>6.1f} MB/s {statistics.median(cold):>6.1f} MB/s "
                      f"{statistics.median(warm):>6.1f} MB/s {statistics.median(ref):>6.1f} MB/s", flush=True)
            else:
                print(f"{name:<12} {kind:<8} {mb:>5.2f} {med['other']:>19.1f} MB/s {med['this']:>7.1f} MB/s "
                      f"{med['this'] / med['other']:>5.2f}x", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
