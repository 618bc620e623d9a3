"""Load-time certification of the native engine for one tokenizer.

A native engine serves a tokenizer only after every check here passed; each check
returns None or the reason it failed (which `FrozenTokenizer.explain` shows).

(a) Class tables: the scanner reads only the tokenizer's class table, and every bit of
    it was probed by running the class's regex through the tokenizer's *own* regex
    engine over all 1,114,112 code points (`charclass.probe_table`), so the table equals
    the reference's classes everywhere by construction.  The literal ASCII sets of the
    patterns (``\\r\\n``, the space, ``'``, ``/``, DeepSeek's ``[A-Za-z]`` and ASCII
    punctuation) are tested on the code point itself.
(b) BPE consistency (`bpe_consistency`): every byte has its one-byte token; every merge
    yields the concatenation of its parts (lengths, and a composable 64-bit hash of the
    bytes); HF merges are listed once each (HF keeps a repeated pair's last rank); tiktoken
    pairs rank as the token they make; the whole-piece vocabulary lost no entry.  (Two HF
    merges may make the same token: HF's heap accepts an entry when the pair now at its
    position makes the entry's token, and that pair is always the recorded one, because a
    symbol only grows to the right and a grown neighbour makes a longer token.)
(c) Self-check corpus (`self_check`): code, prose in many scripts, contractions in every
    case and fold, digit runs, whitespace and line-break mixtures, o200k case changes,
    ``/`` chains, long runs, and the tokenizer's own literals in context; IDs and token
    byte offsets must equal the reference's.
(d) The differential campaigns (``bench/native_campaign.py``) and (e) the shadow verifier
    (`toktier.verifier.Verifier.check` demotes the engine on a confirmed mismatch) run
    after load.
"""

from __future__ import annotations

import numpy as np

_B = np.uint64(0x100000001B3)  # the polynomial hash's base (any odd 64-bit constant works)


def _poly_hashes(blob: np.ndarray, off: np.ndarray) -> np.ndarray:
    """H(t) = sum t[k] * B^(len-1-k) mod 2^64 of every token t = blob[off[i]:off[i+1]]."""
    lens = (off[1:] - off[:-1]).astype(np.int64)
    h = np.zeros(len(lens), dtype=np.uint64)
    start = off[:-1].astype(np.int64)
    with np.errstate(over="ignore"):
        for j in range(int(lens.max()) if len(lens) else 0):
            live = np.flatnonzero(lens > j)
            h[live] = h[live] * _B + (blob[start[live] + j].astype(np.uint64) + np.uint64(1))
    return h


def _powers(n: int) -> np.ndarray:
    p = np.ones(n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(1, n + 1):
            p[i] = p[i - 1] * _B
    return p


def bpe_consistency(tok, bt) -> str | None:
    """Check (b); None when the BPE tables are consistent with the reference's model."""
    from ..gpu.tables import EMPTY32, EMPTY64

    tb = tok.token_bytes
    for b in range(256):
        if tb[int(bt.byte_to_id[b])] != bytes([b]):
            return f"byte 0x{b:02x} has no one-byte token"
    used = bt.pair_keys != EMPTY64
    keys = bt.pair_keys[used]
    left = (keys >> np.uint64(32)).astype(np.int64)
    right = (keys & np.uint64(0xFFFFFFFF)).astype(np.int64)
    merged = bt.pair_merged[used].astype(np.int64)
    rank = bt.pair_rank[used]
    off = bt.tok_off.astype(np.int64)
    lens = off[1:] - off[:-1]
    if (lens[merged] != lens[left] + lens[right]).any():
        return "a merge's token is not as long as its two parts"
    h = _poly_hashes(bt.tok_blob, off)
    pw = _powers(int(lens.max()))
    with np.errstate(over="ignore"):
        joined = h[left] * pw[lens[right]] + h[right]
    if (joined != h[merged]).any():
        return "a merge's token is not the concatenation of its two parts"
    eng = tok.engine
    if eng.engine_name == "tiktoken":
        if (rank.astype(np.int64) != merged).any():
            return "a tiktoken pair does not rank as the token it makes"
        expected_vocab = sum(1 for t, i in eng._args[2].items() if tb[i] == t)
        if expected_vocab != len(eng._args[2]):
            return "a rank's id has other canonical bytes"
    else:
        model = eng._config["model"]
        pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        if len(set(pairs)) != len(pairs):
            return "a merge is listed twice (HF keeps the last, ranks would differ)"
        if len(pairs) != int(used.sum()):
            return "merges and the pair table differ in size"
        from ..token_table import byte_level_alphabet

        dec = byte_level_alphabet()
        in_alphabet = sum(1 for s in model["vocab"] if all(ch in dec for ch in s))
        if int((bt.vocab_ids != EMPTY32).sum()) != in_alphabet:
            return "a vocab entry's id has other canonical bytes (an added token shadows it)"
    if (bt.vocab_ids != EMPTY32).sum() == 0:
        return "empty vocabulary"
    return None


def corpus(tok) -> list[str]:
    """The self-check texts: every class, rule and literal of the families, in context."""
    base = [
        "def f(x):\n    return x**2  # comment\n\tif a<b>c: pass\r\n\r\n",
        "Hello, world! It's a test; we'll see. I'M HERE'S THEY'RE we've 'd 'LL 'Re ſ'ſ can'ſt",
        "The year 2024: 1234567 apples, 3.14159, 1e-9, ٣٤٥ ½ Ⅻ ① 𝟘𝟙𝟚 0x1F",
        "中文字符测试，日本語のテキスト、カタカナ・ひらがな。한국어 텍스트 ã ñ",
        "مرحبا بالعالم  Привет мир  Γειά σου κόσμε  שלום עולם  नमस्ते दुनिया",
        "emoji 😀👍🏽 👨‍👩‍👧 🇺🇸 ✨ ™ © … “quotes” «guillemets» ‘single’",
        "HTMLParser XMLHttpRequest iPhone McDonald's ǅungla ǈǉ ʰʱ İstanbul ΣΑΣ ﬁne",
        "a/b//c\n/\n/d +/\n/ ?!\n\n  \t \u00a0\u2003\u3000 x\u200b\u200dy\ufeff",
        "   leading and trailing   \n\n\n   \r\n \r \n\t\t\n",
        "e\u0301 a\u0308 \u0915\u094d\u0937 \u3099\u309a \u20dd x\u0651y",
        "'s's't'''''re've 'm'd'll  ' s  'x ''S",
        "<html><body class=\"a\">&amp; &#x27;</body></html>\n{\"k\": [1, 2, null]}",
        "| col | col2 |\n|-----|------|\n| 1 | 2 |\n",
        "a" * 300 + " " * 300 + "1" * 100 + "\n" * 50 + "ab" * 100 + "!" * 80 + "中" * 60,
    ]
    lits = [lit.content for lit in tok.engine.literals if lit.content][:24]
    for lit in lits:
        base.append(f"x{lit}y {lit}\n\n{lit}{lit} \u00a0\u00a0{lit}< {lit[:-1]}")
    joined = "".join(base)
    return base + [joined, joined[::-1], " " + joined + " ", "\n".join(base)]


def self_check(tok, eng) -> str | None:
    """Check (c); None when the engine reproduces the reference on the whole corpus."""
    nfc = tok.family_info.nfc
    for text in corpus(tok):
        if nfc:
            text = tok.engine.normalize(text)
        want = tok.engine.encode(text)
        got, starts = eng.encode_with_starts(text)
        if not np.array_equal(got, want):
            m = min(len(got), len(want))
            diff = np.flatnonzero(got[:m] != want[:m])
            i = int(diff[0]) if len(diff) else m
            return f"self-check corpus: IDs differ from the reference at token {i} of {text[:40]!r}..."
        ref_starts = _reference_starts(tok.table, want, text.encode("utf-8"))
        if ref_starts is None:
            return "self-check corpus: the reference's IDs do not tile the text with their byte strings"
        if starts is not None and not np.array_equal(starts, ref_starts):
            return "self-check corpus: token byte offsets differ from the reference's token spans"
    return None


def _reference_starts(table, ids: np.ndarray, data: bytes) -> np.ndarray | None:
    """Each token's byte start where the reference's `ids` encode `data`: the prefix sums of the
    canonical lengths, except that an id the engine may emit for several byte strings (o200k_harmony's
    200018 is both ``<|endofprompt|>`` and ``<|reserved_200018|>``) covers the one of them the text
    holds there; None where that is not exactly one, or the spans do not tile `data`."""
    lens = table.token_len[ids].astype(np.int64)
    if not table.has_uncertain(ids):
        return np.concatenate(([0], np.cumsum(lens)[:-1])) if len(lens) else lens
    starts = np.zeros(len(ids), dtype=np.int64)
    pos = 0
    for k, i in enumerate(ids.tolist()):
        starts[k] = pos
        if not table.uncertain[i]:
            pos += int(lens[k])
            continue
        fits = {b for b in (table.token_bytes[i], *table.alternatives.get(i, ())) if b and data.startswith(b, pos)}
        if len(fits) != 1 or i in table.unknown:
            return None
        pos += len(fits.pop())
    return starts if pos == len(data) else None


def certify(tok, eng) -> str | None:
    """All load-time checks; None when `eng` may serve `tok`."""
    from ..gpu.tables import bpe_tables

    return bpe_consistency(tok, bpe_tables(tok)) or self_check(tok, eng)
