"""Cliff catalogue: ordinary agent content shapes vs prose, op latency as a ratio in one run.

    python -m bench.cliffs [--sizes 200000,1000000] [--tokenizers llama3,qwen3,o200k_base,...] [--ops 20] [--warm]
                           [--appends-only]

For each tokenizer, shape and context size: a session starts on ``size`` characters of the
shape, then ``--ops`` ops (three quarters small appends of the same shape, one quarter
one-character edits in the last quarter of the text), the ids checked against the reference
after every fifth op and the last (the state carries over, so a wrong splice stays visible).
Reports op P50/P99 (ms, the `Session` call only) and P50 as a ratio to prose of the same
tokenizer and size measured in the same run, plus the repair path counts.  Times are measured,
never asserted.

Shapes (each a `lambda rng, n: str` of about n characters, deterministic from `rng`):
- prose; word-per-line, word-per-line-crlf; prose+word-list-tail (prose, then a 25K-char list);
  separator-lines; markdown-table; ls-listing; csv; log-lines; prose+nfd-name (one decomposed
  name at the start)
- git-diff (unified diff hunks of Python-like code); json-lines (one object a line);
  minified-js (no spaces, a newline every ~20K chars)
- base64 (76-column lines), base64-oneline (no newlines); dna (ACGT, 60-column lines),
  dna-oneline (no newlines)
- thai, khmer, lao (words with no spaces between them, a space every few hundred chars);
  devanagari (Hindi with matras and viramas, "\u0964" sentence ends); bengali (vowel signs, the
  AA sign NFC may compose); emoji-zwj (ZWJ sequences between short words)
- run-a, run-space, run-digit, run-equals: the whole context one repeated character, appends
  more of the same; prose+run-100k: prose, then a newline and a 100K-character run of "a"
  (n/2 characters below 200K)

Besides the path counts, each row lists `Session.stats.full_reasons` for the ops (the initial
encode's "initial text" is left out).
"""

from __future__ import annotations

import argparse
import base64
import random
import time

import numpy as np

import toktier
from toktier.tools.corpus import large_text


def _words(rng: random.Random) -> str:
    return rng.choice(("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "kilo", "zulu"))


_PY_LINES = ("def {w}(self, x):", "    return self.{w}(x) + {d}", "    if {w} is None:",
             "        raise ValueError('{w}')", "    for i in range({d}):", "        {w}_total += i * {d}",
             "import {w}", "from .{w} import {w}_{d}", "    # TODO: {w} {d}", "class {W}({W}Base):",
             "    {w} = [{d}, {d}, {d}]", "        yield {w}[i]")


def _py_line(rng: random.Random) -> str:
    w = _words(rng)
    return rng.choice(_PY_LINES).format(w=w, W=w.capitalize(), d=rng.randrange(100))


def _diff_lines(rng: random.Random, n: int) -> str:
    """Whole hunk body lines (context, removed, added) until at least n characters."""
    out = ""
    while len(out) < n:
        out += rng.choice("+- ") + _py_line(rng) + "\n"
    return out


def _git_diff(rng: random.Random, n: int) -> str:
    out, size = [], 0
    while size < n:
        f = f"src/{_words(rng)}/{_words(rng)}.py"
        parts = [f"diff --git a/{f} b/{f}\n", f"index {rng.getrandbits(28):07x}..{rng.getrandbits(28):07x} 100644\n",
                 f"--- a/{f}\n", f"+++ b/{f}\n"]
        for _ in range(rng.randrange(1, 4)):
            a = rng.randrange(1, 900)
            parts.append(f"@@ -{a},7 +{a},8 @@ def {_words(rng)}(self):\n")
            for _ in range(3):
                parts.append(" " + _py_line(rng) + "\n")
            parts.append("-" + _py_line(rng) + "\n")
            parts.append("+" + _py_line(rng) + "\n")
            parts.append("+" + _py_line(rng) + "\n")
            for _ in range(3):
                parts.append(" " + _py_line(rng) + "\n")
        chunk = "".join(parts)
        out.append(chunk)
        size += len(chunk)
    return "".join(out)[:n]


def _json_line(rng: random.Random) -> str:
    tags = ",".join(f'"{rng.choice("abcdefgh")}"' for _ in range(rng.randrange(0, 4)))
    return (f'{{"id": {rng.randrange(10**5)}, "name": "{_words(rng)}", "score": {rng.random():.2f}, '
            f'"tags": [{tags}]}}\n')


_JS = ("function(a,b){{return a+b}};", "var {v}=e.map(function(t){{return t*{d}}});", "if(!{v})throw new Error(\"{w}\");",
       "{v}.{w}={v}.{w}||{{}};", "for(var i=0;i<{v}.length;i++){{{v}[i]+={d}}}", "return{v}?{v}.{w}:null}};",
       "Object.defineProperty({v},\"{w}\",{{value:!0}});", "{v}=({v}&{d})>>>0,", "case {d}:{v}.push(\"{w}\");break;",
       "var {v}=require(\"./{w}\"),")


def _minified_js(rng: random.Random, n: int) -> str:
    out, size, next_nl = [], 0, rng.randrange(18_000, 22_000)
    while size < n:
        piece = rng.choice(_JS).format(v=rng.choice("abcdefghnrstuxyz") + rng.choice(("", "e", "t", "n")),
                                       w=_words(rng), d=rng.randrange(1000))
        if size + len(piece) > next_nl:
            piece += "\n"
            next_nl += rng.randrange(18_000, 22_000)
        out.append(piece)
        size += len(piece)
    return "".join(out)[:n]


def _base64(rng: random.Random, n: int, newlines: bool) -> str:
    raw = base64.b64encode(rng.randbytes(n * 3 // 4 + 3)).decode("ascii")
    if not newlines:
        return raw[:n]
    return "".join(raw[i:i + 76] + "\n" for i in range(0, n, 77))[:n]


def _dna(rng: random.Random, n: int, newlines: bool) -> str:
    raw = "".join(rng.choices("ACGT", k=n))
    if not newlines:
        return raw
    return "".join(raw[i:i + 60] + "\n" for i in range(0, n, 61))[:n]


THAI_WORDS = ("สวัสดี", "ประเทศ", "ไทย", "ภาษา", "คน", "บ้าน", "โรงเรียน", "นักเรียน", "ครู", "หนังสือ",
              "อาหาร", "น้ำ", "กิน", "ดื่ม", "ไป", "มา", "ทำงาน", "วันนี้", "พรุ่งนี้", "เมื่อวาน", "ความรัก",
              "ความสุข", "รถยนต์", "ถนน", "เมือง", "ตลาด", "ร้าน", "ซื้อ", "ขาย", "เงิน", "เวลา", "ดีมาก")
KHMER_WORDS = ("សួស្តី", "កម្ពុជា", "ភាសា", "ខ្មែរ", "សាលារៀន", "សៀវភៅ", "ទឹក", "បាយ", "ផ្ទះ", "ការងារ",
               "ថ្ងៃនេះ", "ប្រទេស")
LAO_WORDS = ("ສະບາຍດີ", "ປະເທດ", "ລາວ", "ພາສາ", "ໂຮງຮຽນ", "ປຶ້ມ", "ນ້ຳ", "ເຂົ້າ", "ເຮືອນ", "ເຮັດວຽກ",
             "ມື້ນີ້", "ຂອບໃຈ")
HINDI_WORDS = ("भारत", "हिंदी", "भाषा", "किताब", "विद्यालय", "प्रश्न", "उत्तर", "क्योंकि", "स्वतंत्रता", "कृपया",
               "धन्यवाद", "पानी", "घर", "काम", "आज", "कल", "मैं", "हम", "है", "हैं", "और", "में", "के", "लिए",
               "अच्छा", "शिक्षा", "राष्ट्र", "संस्कृति", "प्रधानमंत्री", "ज़िंदगी")


def _no_space_script(words: tuple[str, ...]):
    """Words run together, a space only every 200-600 characters (Thai, Khmer, Lao)."""

    def make(rng: random.Random, n: int) -> str:
        out, size, gap = [], 0, rng.randrange(200, 600)
        while size < n:
            w = rng.choice(words)
            gap -= len(w)
            if gap <= 0:
                w += " "
                gap = rng.randrange(200, 600)
            out.append(w)
            size += len(w)
        return "".join(out)[:n]

    return make


# Bengali with vowel signs: AA (U+09BE) is a "maybe" mark for NFC (E + AA composes to O), and
# the precomposed O and AU (U+09CB, U+09CC) are what NFC text holds.
BENGALI_WORDS = ("বাংলা", "ভাষা", "আমি", "তুমি", "কোথায়", "বাড়ি", "কাজ", "ভালো", "দেশ", "মানুষ", "সময়", "কথা",
                 "পানি", "বই", "স্কুল", "শিক্ষক", "ছাত্র", "গৌরব", "রাজ্য", "সরকার")


def _sentences(words: tuple[str, ...]):
    """Words with spaces, 5-12 a sentence, each ended by a danda (Hindi, Bengali)."""
    def make(rng: random.Random, n: int) -> str:
        out, size = [], 0
        while size < n:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 13))) + "। "
            out.append(sentence)
            size += len(sentence)
        return "".join(out)[:n]

    return make


_devanagari = _sentences(HINDI_WORDS)
_bengali = _sentences(BENGALI_WORDS)


_ZWJ = "\u200d"
EMOJI_ZWJ = (
    _ZWJ.join(("\U0001F468", "\U0001F469", "\U0001F467", "\U0001F466")),  # family: man, woman, girl, boy
    "\U0001F3F3\ufe0f" + _ZWJ + "\U0001F308",  # rainbow flag
    "\U0001F469\U0001F3FD" + _ZWJ + "\U0001F4BB",  # woman technologist, medium skin tone
    "\U0001F9D1" + _ZWJ + "\U0001F680",  # astronaut
    "\u2764\ufe0f" + _ZWJ + "\U0001F525",  # heart on fire
    "\U0001F43B" + _ZWJ + "\u2744\ufe0f",  # polar bear
    _ZWJ.join(("\U0001F469", "\u2764\ufe0f", "\U0001F48B", "\U0001F468")),  # kiss
    "\U0001F3F4" + _ZWJ + "\u2620\ufe0f",  # pirate flag
    "\U0001F937\U0001F3FB" + _ZWJ + "\u2640\ufe0f",  # woman shrugging, light skin tone
    "\U0001F441\ufe0f" + _ZWJ + "\U0001F5E8\ufe0f",  # eye in speech bubble
)


def _emoji_zwj(rng: random.Random, n: int) -> str:
    out, size = [], 0
    while size < n:
        if rng.random() < 0.3:
            piece = rng.choice(("ok", "lol", "yes", "nice", "go", "wow", "same")) + " "
        else:
            piece = "".join(rng.choice(EMOJI_ZWJ) for _ in range(rng.randrange(1, 5))) + rng.choice(("", " ", "\n"))
        out.append(piece)
        size += len(piece)
    return "".join(out)[:n]


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
    "git-diff": _git_diff,
    "json-lines": lambda rng, n: "".join(_json_line(rng) for _ in range(n // 60 + 1))[:n],
    "minified-js": _minified_js,
    "base64": lambda rng, n: _base64(rng, n, newlines=True),
    "base64-oneline": lambda rng, n: _base64(rng, n, newlines=False),
    "thai": _no_space_script(THAI_WORDS),
    "khmer": _no_space_script(KHMER_WORDS),
    "lao": _no_space_script(LAO_WORDS),
    "devanagari": _devanagari,
    "bengali": _bengali,
    "emoji-zwj": _emoji_zwj,
    "run-a": lambda rng, n: "a" * n,
    "run-space": lambda rng, n: " " * n,
    "run-digit": lambda rng, n: "0" * n,
    "run-equals": lambda rng, n: "=" * n,
    "prose+run-100k": lambda rng, n: (large_text(n - min(100_000, n // 2), seed=7, kind="english") + "\n"
                                      + "a" * (min(100_000, n // 2) - 1)),
    "dna": lambda rng, n: _dna(rng, n, newlines=True),
    "dna-oneline": lambda rng, n: _dna(rng, n, newlines=False),
}


def _prose_piece(rng: random.Random, n: int) -> str:
    return " " + large_text(n, seed=rng.randrange(1000), kind="english")


# What gets appended where the context's own generator does not fit a 40-character piece.
APPENDS = {
    "prose": _prose_piece,
    "prose+word-list-tail": lambda rng, n: "".join(_words(rng) + "\n" for _ in range(n // 6 + 1)),
    "prose+nfd-name": _prose_piece,
    "prose+run-100k": lambda rng, n: "a" * n,
    # Diff body lines, one JSON record, one 39-char line (line-structured blobs keep their newlines).
    "git-diff": lambda rng, n: _diff_lines(rng, n),
    "json-lines": lambda rng, n: _json_line(rng),
    "base64": lambda rng, n: _base64(rng, n - 1, newlines=False) + "\n",
    "dna": lambda rng, n: _dna(rng, n - 1, newlines=False) + "\n",
    "devanagari": lambda rng, n: " " + _devanagari(rng, n - 1),
    "bengali": lambda rng, n: " " + _bengali(rng, n - 1),
    "emoji-zwj": lambda rng, n: " " + _emoji_zwj(rng, n - 1),
}


def warm_up(tok: toktier.FrozenTokenizer) -> None:
    """A few untimed ops on a small text of every shape: the tables a tokenizer builds lazily on
    first use (cuts inside long pieces, ...) are then built before anything is timed."""
    rng = random.Random("warm-up")
    for shape, make in SHAPES.items():
        s = toktier.Session(tok, make(rng, 30_000))
        s.append(APPENDS.get(shape, make)(rng, 40))
        s.edit(s.num_chars - 100, s.num_chars - 99, "x")


def run(tok_name: str, shape: str, size: int, n_ops: int, seed: int,
        tok: toktier.FrozenTokenizer | None = None, appends_only: bool = False) -> dict:
    tok = tok or toktier.load_tokenizer(tok_name)
    rng = random.Random(f"{seed}/{shape}/{size}")
    make = SHAPES[shape]
    s = toktier.Session(tok, make(rng, size))
    times = []
    for k in range(n_ops):
        if appends_only or k % 4 != 3:
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
            "paths": f"{st.first_window}/{st.widened}/{st.full - 1}",
            "reasons": {k: v for k, v in st.full_reasons.items() if k != "initial text"}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="200000")
    ap.add_argument("--tokenizers", default="llama3,qwen3,o200k_base,deepseek_v4,cl100k_base")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ops", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--appends-only", action="store_true",
                    help="every op an append (the single-piece goal: append P99 at 1M characters)")
    ap.add_argument("--warm", action="store_true",
                    help="load each tokenizer once and warm it up (untimed) before its rows; without it "
                         "every row loads its own, so a lazily built table lands in that row's first op")
    args = ap.parse_args()
    print(f"{'tokenizer':<12} {'shape':<22} {'chars':>9} {'P50 ms':>8} {'P99 ms':>8} {'x prose':>8}  paths first/widened/full")
    for name in args.tokenizers.split(","):
        tok = None
        if args.warm:
            tok = toktier.load_tokenizer(name)
            warm_up(tok)
        for size in map(int, args.sizes.split(",")):
            prose = None
            for shape in args.shapes.split(","):
                try:
                    r = run(name, shape, size, args.ops, args.seed, tok, args.appends_only)
                except toktier.ReferenceEngineError as exc:  # the reference itself cannot encode it
                    print(f"{name:<12} {shape:<22} {size:>9,}  reference engine failed: {exc}", flush=True)
                    continue
                if shape == "prose":
                    prose = r["p50"]
                ratio = f"{r['p50'] / prose:.1f}x" if prose else "-"
                reasons = "; ".join(f"{k}: {v}" for k, v in r["reasons"].items())
                print(f"{name:<12} {shape:<22} {size:>9,} {r['p50']:>8.2f} {r['p99']:>8.2f} {ratio:>8}  {r['paths']}"
                      + (f"  full: {reasons}" if reasons else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
