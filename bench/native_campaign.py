"""Differential campaign of the native engine against the references (issue 14, point 2(d)).

For each bundled tokenizer, generated texts (real corpus slices recombined, adversarial
atoms, random code points from every plane, the tokenizer's literals; every fourth text all
ASCII, for the block scanner, and every fourth ASCII with a wider character every 30-3000
characters, for the UTF-8 narrowed ahead of the pieces) are checked at two levels until the
targets are reached:

* pieces: the native scanner's split of every literal-free segment against the
  reference pre-tokenizer: HF's own ``pre_tokenize_str`` for tokenizer.json files; for
  tiktoken files (no piece API) the ``regex`` module running the same pattern, with the
  scanner given a class table probed from ``regex`` (both sides on one Unicode table;
  the production table is covered at the ID level);
* IDs: ``NativeEngine.encode`` against the reference ``encode`` (and the token byte
  offsets against the reference's token spans).

NFC families (qwen3): pieces are compared on the NFC-normalized text; IDs on it for every other
text, and on the text as generated for the rest (the native engine's own NFC form, `nfc_form`).

Usage: ``python -m bench.native_campaign [--pieces 1e8] [--ids 1e7] [--only llama3] [--jobs 2]``.
Prints one line per tokenizer (counts, mismatches, seconds) and writes
``bench/native_campaign.json``.  Any mismatch is printed with a reproducer and makes
the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable
from pathlib import Path

import numpy as np

NAMES = ("cl100k_base", "o200k_base", "o200k_harmony", "llama3", "deepseek_v4", "qwen3")
EXTRA = ["'", "'s", "'re", "'LL", "ſ", "/", "//", "\u0301", "ǅ", "ʰ", "あ", "ー", "・", "A", "a", "\n", "\r",
         " ", "  ", ".", "\t", "\u200d", "中", "Ab", "aB", "\u3000", "\x00", "1", "゛", "\u00a0", "'Ve", "+/", "/\n"]


def _assemble(n_chars: int, part: Callable[[], str]) -> str:
    """At least ``n_chars`` characters of ``part()`` results, concatenated."""
    parts: list[str] = []
    size = 0
    while size < n_chars:
        parts.append(part())
        size += len(parts[-1])
    return "".join(parts)


def _real_slice(rng: random.Random, real: list[str]) -> str:
    src = rng.choice(real)
    a = rng.randrange(max(1, len(src) - 2000))
    return src[a:a + rng.randint(1, 2000)]


def _text(rng: random.Random, real: list[str], atoms: list[str], lits: list[str], n_chars: int) -> str:
    def part() -> str:
        kind = rng.random()
        if kind < 0.5:
            return _real_slice(rng, real)
        if kind < 0.85:
            return "".join(rng.choice(atoms) for _ in range(rng.randint(1, 80)))
        if kind < 0.97:
            cps = [rng.choice((rng.randrange(0x80), rng.randrange(0x80, 0x3000), rng.randrange(0x3000, 0x10000),
                               rng.randrange(0x10000, 0x110000))) for _ in range(rng.randint(1, 40))]
            return "".join(chr(c) for c in cps if not 0xD800 <= c <= 0xDFFF)
        return rng.choice(lits) if lits else " "
    return _assemble(n_chars, part)


# ASCII atoms for the block scanner (`Engine::pretok_block`): its views end at moving positions,
# so runs of every class, contractions, digit runs and whitespace tails land on their edges.
ASCII_ATOMS = ["a", "Z", "word", " word", "  x", "s", "re", "LL", "'", "'s", "'T", "'re", "'VE", "'ll", "'d", "'m",
               "''", "x's", " 's", "!'s", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n ", "\n  ", "\t\n",
               "\x0b", "\x0c", "1", "12", "123", "1234", "!", "!!", " !", "...", "(", "_", "-", "/", "\x00", "\x7f"]


def _ascii_text(rng: random.Random, real: list[str], n_chars: int) -> str:
    """An all-ASCII text (a 1-byte str): real slices with other characters dropped, atoms, and
    runs of one atom 50-300 long (longer than a block view)."""
    def part() -> str:
        kind = rng.random()
        if kind < 0.5:
            return "".join(c for c in _real_slice(rng, real) if c < "\x80")
        if kind < 0.9:
            return "".join(rng.choice(ASCII_ATOMS) for _ in range(rng.randint(1, 200)))
        return rng.choice(ASCII_ATOMS) * rng.randint(50, 300)
    return _assemble(n_chars, part)


def _sparse_wide_text(rng: random.Random, real: list[str], n_chars: int) -> str:
    """An ASCII text (`_ascii_text`) with a wider character every 30-3000 characters (gaps log-
    uniform): a 2- or 4-byte str that is mostly ASCII, as most real contexts are, whose UTF-8 the
    engine narrows ahead of the pieces (engine.hpp `segment_log`) instead of converting each one."""
    chars = list(_ascii_text(rng, real, n_chars))
    at = 0
    while True:
        at += int(math.exp(rng.uniform(math.log(30), math.log(3000))))
        if at >= len(chars):
            break
        c = rng.choice((rng.randrange(0x80, 0x800), rng.randrange(0x800, 0xD800), rng.randrange(0xE000, 0x10000),
                        rng.randrange(0x10000, 0x110000)))
        chars[at] = chr(c)
    return "".join(chars)


def _regex_table():
    import regex

    from toktier.charclass import probe_table
    from toktier.engines import all_code_points
    from toktier.families import TABLE_PATTERNS

    cps = all_code_points()
    s = cps.astype("<u4").tobytes().decode("utf-32-le")

    class Prober:
        def probe_class(self, pattern: str) -> np.ndarray:
            mask = np.zeros(0x110000, dtype=bool)
            hits = np.array([m.start() for m in regex.finditer(pattern, s)], dtype=np.int64)
            mask[cps[hits]] = True
            return mask

    return probe_table(Prober(), TABLE_PATTERNS, folds=True)


def _regex_starts(compiled, text: str) -> np.ndarray:
    out, pos = [], 0
    for m in compiled.finditer(text):
        a, b = m.span()
        if a > pos:
            out.append(pos)
        if b > a:
            out.append(a)
        pos = b
    if pos < len(text):
        out.append(pos)
    return np.array(out, dtype=np.int64)


def run_one(name: str, target_pieces: int, target_ids: int, seed: int) -> dict:
    import toktier
    from toktier import native
    from toktier.families import FAMILIES
    from toktier.native import certify
    from toktier.gpu.pretok_model import split_literals
    from toktier.gpu.tables import bpe_tables
    from toktier.tools.corpus import ADVERSARIAL_ATOMS, samples

    tok = toktier.load_tokenizer(name)
    if tok.native is None:
        return {"name": name, "error": tok.native_reason}
    rng = random.Random(seed)
    real = [s.text for s in samples(max_chars_per_sample=200_000)]
    atoms = list(ADVERSARIAL_ATOMS) + EXTRA * 2
    lits = [lit.content for lit in tok.engine.literals]
    nfc = tok.family_info.nfc
    tiktoken = tok.engine.engine_name == "tiktoken"
    if tiktoken:
        import regex

        pattern = tok.engine.pat_str
        compiled = regex.compile(pattern)
        rules = next(str(r) for spec in FAMILIES.values() for sp, r in spec.splits.items() if sp == (pattern,))
        bt = bpe_tables(tok)
        piece_engine = native._core.CoreEngine(
            rules, _regex_table(), bt.byte_to_id, bt.pair_keys, bt.pair_rank, bt.pair_merged, bt.pair_bits,
            bt.vocab_keys, bt.vocab_ids, bt.vocab_bits, bt.tok_off, bt.tok_blob, bt.max_piece_lookup,
            bt.whole_piece_lookup, False, [], [])
    n_pieces = n_ids = n_texts = 0
    bad: list[str] = []
    t0 = time.time()
    while (n_pieces < target_pieces or n_ids < target_ids) and len(bad) < 5:
        # every fourth text all ASCII: what the block scanner serves in long views; every fourth
        # mostly ASCII with sparse wider characters
        if n_texts % 4 == 3:
            text = _ascii_text(rng, real, 64_000)
        elif n_texts % 4 == 1:
            text = _sparse_wide_text(rng, real, 64_000)
        else:
            text = _text(rng, real, atoms, lits, 64_000)
        raw = text
        if nfc:
            text = tok.engine.normalize(text)  # the pieces are compared on normalized segments
        n_texts += 1
        if n_pieces < target_pieces:
            if tiktoken:
                got = piece_engine.pieces(text)[0]
                want = _regex_starts(compiled, text)
                n_pieces += len(want)
                if not np.array_equal(got, want):
                    bad.append(f"pieces differ (seed {seed}, text {n_texts})")
            else:
                for a, b, lit in split_literals(tok, text):
                    if lit is not None:
                        continue
                    seg = text[a:b]
                    want = np.array([o[0] for _, o in tok.engine.pre_tokenize(seg)], dtype=np.int64)
                    got = tok.native.pieces(seg)[0]
                    n_pieces += len(want)
                    if not np.array_equal(got, want):
                        bad.append(f"pieces differ (seed {seed}, text {n_texts}): {seg[:80]!r}")
                        break
        if n_ids < target_ids:
            if nfc and n_texts % 2:
                text = raw  # the IDs of every other text as given: the native path's own NFC form
            want = tok.engine.encode(text)
            got, starts = tok.native.encode_with_starts(text)
            n_ids += len(want)
            if not np.array_equal(got, want):
                bad.append(f"ids differ (seed {seed}, text {n_texts})")
            elif starts is not None:
                # (an id spelled two ways covers the spelling the text holds: o200k_harmony's 200018)
                ref_starts = certify._reference_starts(tok.table, want, text.encode("utf-8"))
                if ref_starts is None or not np.array_equal(starts, ref_starts):
                    bad.append(f"offsets differ (seed {seed}, text {n_texts})")
    return {"name": name, "family": tok.family, "pieces": n_pieces, "ids": n_ids, "texts": n_texts,
            "chars": n_texts * 64_000, "mismatches": bad, "seconds": round(time.time() - t0, 1),
            "nfc_rewrites": tok.native.nfc_rewrites, "nfc_fallbacks": tok.native.nfc_fallbacks,
            "piece_reference": "regex module (same pattern, regex-probed classes)" if tiktoken
            else "HF pre_tokenize_str"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pieces", type=float, default=1e8)
    ap.add_argument("--ids", type=float, default=1e7)
    ap.add_argument("--only", action="append", choices=NAMES)
    ap.add_argument("--jobs", type=int, default=2, help="processes per tokenizer (each with its own seed)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("native_campaign.json")))
    args = ap.parse_args(argv)
    names = args.only or list(NAMES)
    per_p, per_i = int(args.pieces / args.jobs) + 1, int(args.ids / args.jobs) + 1
    results = []
    with ProcessPoolExecutor(args.jobs) as pool:
        futs = {(n, j): pool.submit(run_one, n, per_p, per_i, 1000 * j + 7) for n in names for j in range(args.jobs)}
        for n in names:
            parts = [futs[(n, j)].result() for j in range(args.jobs)]
            if any("error" in p for p in parts):
                print(f"{n}: not certified: {parts[0].get('error')}")
                results.append(parts[0])
                continue
            agg = {"name": n, "family": parts[0]["family"], "piece_reference": parts[0]["piece_reference"]}
            for k in ("pieces", "ids", "texts", "chars", "nfc_rewrites", "nfc_fallbacks"):
                agg[k] = sum(p[k] for p in parts)
            agg["mismatches"] = [m for p in parts for m in p["mismatches"]]
            agg["seconds"] = max(p["seconds"] for p in parts)
            results.append(agg)
            print(f"{n:<12} pieces {agg['pieces']:>13,}  ids {agg['ids']:>12,}  chars {agg['chars']:>13,}  "
                  f"mismatches {len(agg['mismatches'])}  {agg['seconds']:.0f} s  ({agg['piece_reference']})"
                  + (f"  texts in NFC form {agg['nfc_rewrites']:,}, to the reference {agg['nfc_fallbacks']:,}"
                     if agg["nfc_rewrites"] or agg["nfc_fallbacks"] else ""), flush=True)
            for m in agg["mismatches"]:
                print("   ", m)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 1 if any(r.get("mismatches") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
