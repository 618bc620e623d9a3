"""The compiled lane on NFC tokenizers (Qwen3) with marks: Thai, Devanagari, Bengali, combining
accents.

The lane takes a window holding characters that are not NFC-inert only when NFC leaves the new
text as it is (`Lane::nfc_stable`, `charclass.nfc_mark_table`): its edges before inert
characters, every mark one that NFC leaves alone, runs of marks in canonical order, and a
"maybe" mark (nukta, Bengali AA, combining acute) only right after an inert character it does
not compose with.  Checked here against the reference normalizer and the reference encoder, on
adversarial text: marks out of canonical order, pairs NFC composes (``e`` + acute, Bengali E +
AA, NA + nukta), composition exclusions, singletons, Hangul jamo.
"""

from __future__ import annotations

import random
import unicodedata

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import toktier
from conftest import get_tokenizer
from toktier.charclass import nfc_mark_table
from toktier.families import I

THAI = "กขคงจฉชซดตถทนบปผพฟมยรลวสหอฮ"
THAI_MARKS = "\u0e31\u0e34\u0e35\u0e36\u0e37\u0e38\u0e39\u0e3a\u0e47\u0e48\u0e49\u0e4a\u0e4b\u0e4c"
HINDI = ("नमस्ते", "ज़रूरत", "फ़िल्म", "क़लम", "हिन्दी", "भाषा", "ड़", "ढ़", "विद्यालय", "ऩ", "ऱ", "ऴ")
BENGALI = ("বাংলা", "কোথায়", "কা", "কো", "ভাষা", "আমি", "বই")  # the second and fourth: precomposed O
# what NFC changes or composes: decomposed accents, a reordered pair, Bengali E + AA, NA + nukta,
# an exclusion, singletons, a non-starter decomposition, Hangul jamo, a CJK compatibility ideograph
CHANGES = ("e\u0301", "a\u0301\u0323", "\u09c7\u09be", "\u0995\u09c7\u09be", "\u0928\u093c", "\u0958",
           "\u212b", "\u2126", "\u0344", "\u1100\u1161", "\uac00\u11a8", "\uf900", "o\u0308\u0304")
# marks that stay as they are after the right character
STABLE = ("x\u0301", "\u091c\u093c", "\u0995\u09be", "q\u0323", "\u0e01\u0e38\u0e48",
          "\u05d0\u05b7", "\u0627\u064e", "z\u0338")
ALPHABET = (list(THAI) + list(THAI_MARKS) + ["\u0928", "\u091c", "\u093c", "\u094d", "\u093f", "\u0995", "\u09c7",
            "\u09be", "\u09cb", "e", "x", "a", " ", "\n", "\u0301", "\u0323", "\u0300", "\u0308", "\u1100", "\u1161",
            "\u11a8", "\uac00", "\u0958", "\u212b", "\u0344", "\u200d", "!", "1"])


def _lane(name: str = "qwen3"):
    tok = get_tokenizer(name)
    if tok.native is None:
        pytest.skip("the native engine is not built")
    return tok, tok.native.lane()


def test_the_mark_table_agrees_with_the_normalizers():
    tok, _ = _lane()
    table, maybe, pairs = nfc_mark_table(tok.engine.normalize)
    marks = np.flatnonzero(table != 0xFF)
    assert len(marks) > 500 and len(maybe) > 50 and len(pairs) > 500
    for cp in marks.tolist():
        ch = chr(cp)
        assert unicodedata.combining(ch) == table[cp]
        assert unicodedata.normalize("NFC", ch) == ch and tok.engine.normalize("\ue000" + ch) == "\ue000" + ch
    maybe_set = set(maybe.tolist())
    for pair in pairs.tolist():
        a, b = pair >> 21, pair & 0x1FFFFF
        t = chr(a) + chr(b)
        # either normalizer composes it (the engine's Unicode data may be older than Python's:
        # it leaves U+11935 U+11930 alone, Python composes U+11938)
        assert tok.engine.normalize(t) != t or unicodedata.normalize("NFC", t) != t
        if table[b] != 0xFF:
            assert b in maybe_set  # a qualifying mark that composes is a "maybe" one
    # what the lane reads for the common scripts
    assert table[0x0E38] == 103 and table[0x094D] == 9 and 0x093C in maybe_set and 0x09BE in maybe_set
    assert table[0x1161] == 0xFF and table[0x11A8] == 0xFF  # Hangul jamo compose by arithmetic: never taken


@settings(max_examples=600, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=12))
def test_what_the_lane_takes_as_nfc_is_nfc(chars):
    tok, lane = _lane()
    text = "".join(chars)
    if lane.nfc_stable(text):
        assert tok.engine.normalize(text) == text, ascii(text)
        assert unicodedata.is_normalized("NFC", text), ascii(text)


def test_the_lane_takes_ordinary_marked_text_and_refuses_what_nfc_changes():
    tok, lane = _lane()
    for text in ("ภาษาไทยมีวรรณยุกต์ ก่ ข้", "नमस्ते दुनिया ज़रूरत फ़िल्म", "বাংলা ভাষা কা", "naïve x\u0301", *STABLE):
        assert lane.nfc_stable(text), text
        assert tok.engine.normalize(text) == text
    for text in CHANGES:
        assert not lane.nfc_stable(text), ascii(text)
        assert not lane.nfc_stable("ab " + text + " cd"), ascii(text)
    assert _lane("llama3")[1].nfc_stable("x") is None  # no NFC tables: the family has no normalizer


def _script_text(rng: random.Random, n: int) -> str:
    out = []
    while sum(map(len, out)) < n:
        u = rng.random()
        if u < 0.35:
            out.append("".join(rng.choice(THAI) + (rng.choice(THAI_MARKS) if rng.random() < 0.6 else "")
                               for _ in range(rng.randrange(2, 9))))
        elif u < 0.65:
            out.append(rng.choice(HINDI))
        elif u < 0.85:
            out.append(rng.choice(BENGALI))
        else:
            out.append(rng.choice(STABLE))
        out.append(rng.choice((" ", " ", "\n", "। ", ", ")))
    return "".join(out)


@pytest.mark.parametrize("seed", range(6))
def test_marked_sessions_go_through_the_lane_and_stay_exact(seed, tally):
    tok, _ = _lane()
    rng = random.Random(seed)
    s = toktier.Session(tok, _script_text(rng, 6000))
    assert not s._dirty  # (the start text is its own NFC: the lane may run anywhere)
    lane_counts = []
    for op in range(70):
        if op in (40, 69):
            lane_counts.append(s.stats.lane)
        piece = _script_text(rng, rng.choice((1, 5, 40, 400)))[: rng.randrange(1, 500)]
        if op >= 40 and rng.random() < 0.3:  # then things NFC changes or composes across the edge
            piece = rng.choice((rng.choice(CHANGES) + piece, piece + rng.choice(CHANGES), rng.choice(ALPHABET)))
        u = rng.random()
        if u < 0.6:
            r = s.append(piece)
        else:
            a = rng.randrange(max(0, s.num_chars - 3000), s.num_chars + 1)
            r = s.edit(a, min(s.num_chars, a + rng.randrange(4)), piece if rng.random() < 0.85 else "")
        assert np.array_equal(r.ids, tok.encode(s.text)), (seed, op, ascii(piece), r.path)
        tally(tok, "session")
    # the first 40 ops (marked text NFC leaves alone) went through the compiled lane nearly all
    # (before the NFC tables: none did); after the pieces NFC changes, ops near them cannot
    assert lane_counts[0] >= 34, (lane_counts, s.stats)


def test_a_mark_that_composes_with_the_text_before_it_is_exact():
    """An append that starts with a mark composing with the session's last character (``e`` +
    acute, Bengali E + AA, NA + nukta), or reorders with its last marks, changes the text the
    normalizer sees before the append: the lane must decline it (the window holds the text
    before the append, and the check sees the mark after it)."""
    tok, _ = _lane()
    body = _script_text(random.Random(7), 3000)
    for tail, mark in (("cafe", "\u0301"), (" \u09c7", "\u09be"), (" \u0928", "\u093c"), (" a\u0301", "\u0323"),
                       (" \u0e01\u0e48", "\u0e38"), (" \u1100", "\u1161")):
        s = toktier.Session(tok, body + tail)
        r = s.append(mark)
        assert np.array_equal(r.ids, tok.encode(s.text)), ascii(tail + mark)
        r = s.append(" done")
        assert np.array_equal(r.ids, tok.encode(s.text)), ascii(tail + mark)


def test_a_mark_after_the_window_that_would_compose_with_an_edit_is_exact():
    """An acute accent after a run of dot-below marks (class 220, which does not block it) composes
    with the run's starter: turning that starter from ``x`` into ``a`` changes text after the
    edit, however many marks lie between.  The splice's right cut is a stable pair of inert
    characters, so the accent lies between the cuts, in the window the check reads (or the lane
    finds no cut and declines)."""
    tok, _ = _lane()
    body = _script_text(random.Random(11), 2000)
    for k in range(1, 120, 2):
        text = body + " x" + "\u0316" * k + "\u0301" + " tail " + body[:300]
        s = toktier.Session(tok, text)
        assert not s._dirty
        at = len(body) + 1
        r = s.edit(at, at + 1, "a")
        assert np.array_equal(r.ids, tok.encode(s.text)), k


def test_whole_marked_texts_skip_the_normalizer_and_encode_exactly(monkeypatch):
    """`NativeEngine.normalized` (session starts, stateless encodes) answers a text that passes
    the quick check without the reference normalizer (30-90 ms a million characters of Hindi or
    Bengali), and still asks it about everything else."""
    tok, _ = _lane()
    texts = [_script_text(random.Random(seed), 20_000) for seed in range(3)]
    changed = [t[:5000] + c + t[5000:] for t, c in zip(texts, CHANGES)]
    for text in texts + changed:
        assert np.array_equal(tok.native.encode(text), tok.encode(text))
        assert np.array_equal(toktier.Session(tok, text).ids, tok.encode(text))
    calls = []
    real = tok.engine.normalize
    monkeypatch.setattr(tok.engine, "normalize", lambda text: calls.append(len(text)) or real(text))
    for text in texts:
        assert tok.native.normalized(text) is text
    assert not calls
    for text in changed:
        assert tok.native.normalized(text) == unicodedata.normalize("NFC", text)
    assert len(calls) >= len(changed)
