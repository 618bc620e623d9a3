"""Cliff catalogue: ordinary agent content shapes vs prose, op latency as a ratio in one run.

    python -m bench.cliffs [--sizes 200000,1000000] [--tokenizers llama3,qwen3,o200k_base,...] [--ops 20]

For each tokenizer, shape and context size: a session starts on ``size`` characters of the
shape, then ``--ops`` ops (three quarters small appends of the same shape, one quarter
one-character edits in the last quarter of the text), each op's result checked against the
reference.  Reports op P50/P99 (ms, the `Session` call only) and P50 as a ratio to prose of the
same tokenizer and size measured in the same run, plus the repair path counts.  Times are
measured, never asserted.

Shapes still to add to the catalogue (issue 13): git diff hunks, minified JS, base64, Thai/Khmer
without spaces, Devanagari with marks, emoji ZWJ runs, 100K-character single-character runs.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

import toktier
from toktier.tools.corpus import large_text


def _words(rng: random.Random) -> str:
    return rng.choice(("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "kilo", "zulu"))


SHAPES = {
    "prose": lambda rng, n: large_text(n, seed=rng.randrange(1000), kind="english"),
    "word-per-line": lambda rng, n: "".join(_words(rng) + "\n" for _ in range(n // 6 + 1))[:n],
    "word-per-line-crlf": lambda rng, n: "".join(_words(rng) + "\r\n" for _ in range(n // 7 + 1))[:n],
    "prose+word-list-tail": lambda rng, n: large_text(n - 25_000, seed=3, kind="english")
    + "".join(_words(rng) + "\n" for _ in range(25_000 // 6)),
    "separator-lines": lambda rng, n: "".join(rng.choice(("=" * 60, "-" * 60)) + "\n" + _words(rng) + " section\n"
                                              for _ in range(n // 80 + 1))[:n],
    "markdown-table": lambda rng, n: "".join(f"|{_words(rng)}|{rng.randrange(10**4)}|---|x|\n"
                                             for _ in range(n // 20 + 1))[:n],
    "ls-listing": lambda rng, n: "".join(f"-rw-r--r--  1 dev staff {rng.randrange(10**7):>8} Nov 30 12:{rng.randrange(60):02d}"
                                         f" src/{_words(rng)}_{i}.py\n" for i in range(n // 60 + 1))[:n],
    "csv": lambda rng, n: "".join(f"{i},{_words(rng)},{rng.random():.4f},{rng.randrange(10**6)}\n"
                                  for i in range(n // 30 + 1))[:n],
    "log-lines": lambda rng, n: "".join(f"2026-11-30T12:{rng.randrange(60):02d}:{rng.randrange(60):02d}Z INFO "
                                        f"worker[{rng.randrange(64)}] {_words(rng)} done in {rng.randrange(999)}ms\n"
                                        for _ in range(n // 60 + 1))[:n],
    "prose+nfd-name": lambda rng, n: "re\u0301sume\u0301.txt\n" + large_text(n, seed=5, kind="english"),
}


def _prose_piece(rng: random.Random, n: int) -> str:
    return " " + large_text(n, seed=rng.randrange(1000), kind="english")


# What gets appended where the context's own generator does not fit a 40-character piece.
APPENDS = {
    "prose": _prose_piece,
    "prose+word-list-tail": lambda rng, n: "".join(_words(rng) + "\n" for _ in range(n // 6 + 1)),
    "prose+nfd-name": _prose_piece,
}


def run(tok_name: str, shape: str, size: int, n_ops: int, seed: int) -> dict:
    tok = toktier.load_tokenizer(tok_name)
    rng = random.Random(f"{seed}/{shape}/{size}")
    make = SHAPES[shape]
    s = toktier.Session(tok, make(rng, size))
    times = []
    for k in range(n_ops):
        if k % 4 != 3:
            piece = APPENDS.get(shape, make)(rng, 40)
            t0 = time.perf_counter()
            r = s.append(piece)
        else:
            a = rng.randrange(s.num_chars * 3 // 4, s.num_chars)
            t0 = time.perf_counter()
            r = s.edit(a, a + 1, rng.choice("xyz\n"))
        times.append(time.perf_counter() - t0)
        if k % 5 == 4 or k == n_ops - 1:
            assert np.array_equal(r.ids, tok.encode(s.text)), (tok_name, shape, size, k)
    st = s.stats
    ms = np.array(times) * 1000
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "paths": f"{st.first_window}/{st.widened}/{st.full - 1}"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="200000")
    ap.add_argument("--tokenizers", default="llama3,qwen3,o200k_base,deepseek_v4,cl100k_base")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ops", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{'tokenizer':<12} {'shape':<22} {'chars':>9} {'P50 ms':>8} {'P99 ms':>8} {'x prose':>8}  paths first/widened/full")
    for name in args.tokenizers.split(","):
        for size in map(int, args.sizes.split(",")):
            prose = None
            for shape in args.shapes.split(","):
                r = run(name, shape, size, args.ops, args.seed)
                if shape == "prose":
                    prose = r["p50"]
                ratio = f"{r['p50'] / prose:.1f}x" if prose else "-"
                print(f"{name:<12} {shape:<22} {size:>9,} {r['p50']:>8.2f} {r['p99']:>8.2f} {ratio:>8}  {r['paths']}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
