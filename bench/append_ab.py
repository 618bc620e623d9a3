"""Session appends with this build's compiled engine against another build's, in one process.

What `bench.engine_speed --ab` is for the engine alone, this is for `Session.append`: the
compiled repair lane (`repair.hpp`) and everything around it.  TREE is a checkout whose
``toktier/native`` holds a built extension (``git worktree add /tmp/wt HEAD``, then
``python setup.py build_ext --inplace`` there).  Both builds get the same tokenizer tables;
each has its own sessions over the same context and receives the same appends, and the two
alternate append by append in a seeded random order, so the machine's drift hits both alike.

Per (context size, append size): ``--appends`` appends of that many characters (``english``
or ``code`` from `toktier.tools.corpus.large_text`), after ``--warm`` untimed ones; the P50 of
each build's ``Session.append`` wall time (``time.perf_counter``; the lane may use its chunk
threads) and the ratio other / this (above 1: this build is faster).  ``--sweep-mb N`` reads N
MB of other memory before every timed call: the cold caches a server's append sees after the
engine's other work.  Every session's IDs are checked equal to the reference encoding of its
text at the end of each row.

Usage: ``python -m bench.append_ab --ab /tmp/wt [--sizes 100000] [--appends 10,1400,16000]
[--kinds english,code] [--count 60] [--sweep-mb 0] [--lane-threads 0]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from .engine_speed import _load_extension


def _engine_for(tok, module):
    """A certified-table `NativeEngine` of `tok` built with extension `module`, its lane and piece
    caches made from that module (the caches are lent from a pool, so pre-filled ones serve)."""
    import toktier.native as tn

    mine = tn._core
    tn._core = module
    try:
        eng, why = tn.build(tok)
        if eng is None:
            raise SystemExit(f"{tok.name}: {why}")
        eng.lane()
        eng._caches = [module.PieceCacheBox() for _ in range(tn.MAX_IDLE_CACHES)]
    finally:
        tn._core = mine
    return eng


def main(argv: list[str] | None = None) -> int:
    import toktier
    from toktier.tools.corpus import large_text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ab", metavar="TREE", required=True, help="the other checkout (its built extension)")
    ap.add_argument("--tokenizer", default="llama3")
    ap.add_argument("--sizes", default="100000", help="context sizes in characters, comma-separated")
    ap.add_argument("--appends", default="10,1400,16000", help="append sizes in characters")
    ap.add_argument("--kinds", default="english,code")
    ap.add_argument("--count", type=int, default=60, help="timed appends per row and build")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--sweep-mb", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lane-threads", type=int, default=0, help="threads the lane may use (0: every core)")
    args = ap.parse_args(argv)

    import toktier.native as tn

    tok = toktier.load_tokenizer(args.tokenizer)
    if tok.native is None:
        raise SystemExit(f"{tok.name}: no native engine ({tok.native_reason})")
    other_mod = _load_extension(args.ab)
    engines = {"this": tok.native, "other": _engine_for(tok, other_mod)}
    mods = {"this": tn._core, "other": other_mod}
    if args.lane_threads:
        for eng in engines.values():
            eng.lane_threads = args.lane_threads
    sweep = np.ones(args.sweep_mb << 18, dtype=np.float32) if args.sweep_mb else None
    rng = random.Random(args.seed)

    def use(name: str) -> None:
        object.__setattr__(tok, "native", engines[name])
        tn._core = mods[name]

    print(f"## append A/B: this tree vs {args.ab} ({tok.name}; P50 ms of Session.append, "
          f"{args.count} appends a row; sweep {args.sweep_mb} MB)\n")
    print("| context | kind | append chars | this | other | other / this |")
    print("|---:|---|---:|---:|---:|---:|")
    try:
        for size in (int(x) for x in args.sizes.split(",") if x):
            for kind in args.kinds.split(","):
                ctx = large_text(size, seed=7, kind=kind)
                for n in (int(x) for x in args.appends.split(",") if x):
                    deltas = [large_text(n, seed=3000 + i, kind=kind) for i in range(args.warm + args.count)]
                    sessions = {}
                    for name in engines:
                        use(name)
                        sessions[name] = toktier.Session(tok, ctx)
                    times: dict[str, list[float]] = {name: [] for name in engines}
                    for i, d in enumerate(deltas):
                        order = list(engines)
                        rng.shuffle(order)
                        for name in order:
                            use(name)
                            if sweep is not None:
                                sweep.sum()
                            t = time.perf_counter()
                            sessions[name].append(d)
                            dt = time.perf_counter() - t
                            if i >= args.warm:
                                times[name].append(dt)
                    for name, s in sessions.items():
                        use(name)
                        if s.ids.tolist() != tok.encode(s.text).tolist():
                            raise SystemExit(f"MISMATCH: build {name}, {kind} {size} + {n}-char appends")
                    a, b = (statistics.median(times[k]) * 1e3 for k in ("this", "other"))
                    print(f"| {size:,} | {kind} | {n:,} | {a:.3f} | {b:.3f} | {b / a:.2f}x |", flush=True)
    finally:
        use("this")
    print("\nevery session equal to the reference encoding")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
