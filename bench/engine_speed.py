"""Single-core encode throughput of the native engine per family and content kind (issue 14).

For each bundled tokenizer and each content kind of ``toktier.tools.corpus.large_text``
(``mixed``, ``code``, ``english``, ``multilingual``), one text of
``--chars`` characters is encoded on one thread by:

* ``native``: ``tok.native.encode(text)`` (a fresh piece cache: ``cold``; the same text
  again: ``warm``, what a server sees once its cache holds the common pieces);
* ``reference``: the reference's fastest array call (``tok.engine.encode_fast``: HF
  ``encode_batch_fast`` ids list -> numpy, tiktoken ``encode_to_numpy``).

Throughput is UTF-8 MB (10^6 bytes) per second, best of ``--repeat``.  Each result is
checked equal to the reference.  NFC families encode the NFC form of the text.

Usage: ``python -m bench.engine_speed [--chars 1000000] [--kinds mixed,code,english,multilingual]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

NAMES = ("cl100k_base", "o200k_base", "llama3", "deepseek_v4", "qwen3")


def main(argv: list[str] | None = None) -> int:
    import toktier
    from toktier.native import NativeEngine
    from toktier.tools.corpus import large_text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=1_000_000)
    ap.add_argument("--kinds", default="mixed,code,english,multilingual")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", action="append", choices=NAMES)
    args = ap.parse_args(argv)
    print(f"{'tokenizer':<12} {'kind':<8} {'MB':>5} {'native cold':>12} {'native warm':>12} {'reference':>10} "
          f"{'ratio':>6}")
    bad = 0
    for name in args.only or NAMES:
        tok = toktier.load_tokenizer(name)
        if tok.native is None:
            print(f"{name:<12} not certified: {tok.native_reason}")
            continue
        for kind in args.kinds.split(","):
            text = large_text(args.chars, kind=kind)
            if tok.family_info.nfc:
                text = tok.engine.normalize(text)
            mb = len(text.encode("utf-8")) / 1e6
            want = tok.engine.encode(text)
            cold = warm = ref = float("inf")
            for _ in range(args.repeat):
                eng = NativeEngine(tok, tok.native._core, tok.native.rules)  # a fresh piece cache
                t0 = time.perf_counter()
                got = eng.encode(text)
                t1 = time.perf_counter()
                got2 = eng.encode(text)
                t2 = time.perf_counter()
                tok.engine.encode_fast(text)
                t3 = time.perf_counter()
                cold, warm, ref = min(cold, t1 - t0), min(warm, t2 - t1), min(ref, t3 - t2)
                if not (np.array_equal(got, want) and np.array_equal(got2, want)):
                    bad += 1
                    print(f"MISMATCH {name} {kind}")
            print(f"{name:<12} {kind:<8} {mb:>5.2f} {mb / cold:>9.1f} MB/s {mb / warm:>9.1f} MB/s "
                  f"{mb / ref:>7.1f} MB/s {ref / warm:>5.1f}x", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
