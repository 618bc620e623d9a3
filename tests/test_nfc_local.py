"""Local NFC certification: a span the normalizer changes does not stop splices elsewhere.

qwen3 (NFC tokenizer.json) sessions with decomposed characters, compatibility characters and
Hangul jamo sprinkled in, driven by appends, edits and syncs far from and right at those spans;
every op is checked against the reference, and most ops far from the spans must splice.  A
mutation (ignoring the spans' byte deltas when locating cached tokens) must be caught.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import toktier
from conftest import get_tokenizer
from toktier.nfc_spans import SpanMap, nfc_spans
from toktier.tools.corpus import large_text

NFC_CHANGES = ("e\u0301", "A\u030a", "\u212b", "\u1100\u1161", "o\u0308\u0304", "\u0958", "re\u0301sume\u0301.txt")


def _session_ops(tok, seed: int, n_ops: int = 40):
    rng = random.Random(seed)
    base = large_text(12_000, seed=seed, kind="english")
    # spans NFC changes in the first 2,000 characters; ops mostly in the rest, some right at them
    text = "".join(rng.choice(NFC_CHANGES) + base[i:i + 200] for i in range(0, 2000, 200)) + base[2000:]
    s = toktier.Session(tok, text)
    yield s, None
    for _ in range(n_ops):
        u = rng.random()
        piece = rng.choice((" plain words.", "\nnext line", " more")) if rng.random() < 0.9 else rng.choice(NFC_CHANGES)
        if u < 0.55:
            r = s.append(piece)
        elif u < 0.85:
            a = rng.randrange(s.num_chars + 1) if rng.random() < 0.15 else rng.randrange(4000, s.num_chars + 1)
            r = s.edit(a, min(s.num_chars, a + rng.randrange(3)), piece if rng.random() < 0.8 else "")
        else:
            t = s.text
            a = rng.randrange(len(t) + 1)
            r = s.sync(t[:a] + piece + t[a:])
        yield s, r


@pytest.mark.parametrize("seed", range(4))
def test_sessions_with_nfc_changing_spans_stay_exact_and_splice(seed, tally):
    tok = get_tokenizer("qwen3")
    spliced = ops = 0
    for s, r in _session_ops(tok, seed):
        if r is None:
            assert s._dirty, "the setup must contain spans NFC changes"
            continue
        assert np.array_equal(r.ids, tok.encode(s.text)), (seed, r.path, r.reason)
        ops += 1
        spliced += r.path in (toktier.RepairPath.FIRST_WINDOW, toktier.RepairPath.WIDENED)
        tally(tok, "session")
    # Windows that reach a span splice too (in normalized coordinates), so nearly all ops do.
    assert spliced >= ops * 9 // 10, f"only {spliced} of {ops} ops spliced"


def test_appends_far_from_a_decomposed_name_splice():
    tok = get_tokenizer("qwen3")
    s = toktier.Session(tok, "re\u0301sume\u0301.txt\n" + large_text(50_000, seed=1, kind="english"))
    for _ in range(10):
        r = s.append(" and some more prose.")
        assert r.path is toktier.RepairPath.FIRST_WINDOW and np.array_equal(r.ids, tok.encode(s.text))
    r = s.edit(0, 2, "Re")  # right at the span: spliced in normalized coordinates
    assert r.path is not toktier.RepairPath.FULL and np.array_equal(r.ids, tok.encode(s.text))


def test_ignoring_span_deltas_is_caught(monkeypatch):
    """Cached token starts are normalized coordinates: located without the spans' deltas they
    never agree with the fresh window's (exactness holds either way: a splice needs agreement),
    so splices after a decomposed span stop.  The deltas are what makes them splice."""
    tok = get_tokenizer("qwen3")
    text = "re\u0301sume\u0301.txt\n" + large_text(50_000, seed=1, kind="english")
    monkeypatch.setattr(SpanMap, "to_raw", lambda self, y, inside="invalid": np.asarray(y, np.int64).copy())
    monkeypatch.setattr(SpanMap, "norm", lambda self, x, inside="invalid": x)
    s = toktier.Session(tok, text)
    for _ in range(5):
        r = s.append(" and some more prose.")
        assert np.array_equal(r.ids, tok.encode(s.text))
    assert s.stats.first_window + s.stats.widened == 0


def _expected_spans(tok, text: str) -> list:
    found = nfc_spans(tok, text.encode("utf-8"))
    return [] if found is None else found[0]


def _check(s, tok, r, note=""):
    assert np.array_equal(r.ids, tok.encode(s.text)), (note, r.path, r.reason)
    # The session's spans are exactly the text's (kept, dropped, joined and shifted by the ops).
    assert s._dirty == _expected_spans(tok, s.text), note


@pytest.mark.parametrize("seed", range(3))
def test_windows_that_reach_or_bring_spans_splice(seed, tally):
    """Appends and edits of decomposed text, right at, inside, joining and removing spans."""
    tok = get_tokenizer("qwen3")
    rng = random.Random(100 + seed)
    s = toktier.Session(tok, large_text(6_000, seed=seed, kind="english"))
    pieces = NFC_CHANGES + ("\u0301", "\u0308\u0301", "\u1161", " caf\u00e9", " cafe\u0301", "\u0323\u0302")
    spliced = 0
    n_ops = 60
    for i in range(n_ops):
        u = rng.random()
        piece = rng.choice(pieces) if rng.random() < 0.5 else rng.choice((" word", " x", "e", "\n"))
        if u < 0.5:
            r = s.append(piece)
        elif u < 0.8:  # near the end, where the recent spans are
            a = rng.randrange(max(0, s.num_chars - 300), s.num_chars + 1)
            r = s.edit(a, min(s.num_chars, a + rng.randrange(3)), piece if rng.random() < 0.7 else "")
        else:  # delete or replace right at a span
            spans = s._dirty
            if not spans:
                r = s.append(piece)
            else:
                a_b, _, _ = spans[rng.randrange(len(spans))]
                a = len(s._text[:a_b].decode("utf-8"))
                r = s.edit(a + 1, min(s.num_chars, a + 2), rng.choice(("", "x", "\u0301")))
        _check(s, tok, r, f"op {i}")
        spliced += r.path in (toktier.RepairPath.FIRST_WINDOW, toktier.RepairPath.WIDENED)
        tally(tok, "session")
    assert spliced >= n_ops * 9 // 10, (spliced, s.stats.full_reasons)


def test_random_sessions_with_decomposed_pieces_mostly_splice(tally):
    """The issue's measure: random appends with 10% NFD pieces used to splice ~40% of ops."""
    tok = get_tokenizer("qwen3")
    rng = random.Random(7)
    s = toktier.Session(tok, large_text(20_000, seed=7, kind="english"))
    n = 80
    for _ in range(n):
        piece = rng.choice(NFC_CHANGES) if rng.random() < 0.1 else " " + large_text(40, seed=rng.randrange(99), kind="english")
        r = s.append(piece)
        assert np.array_equal(r.ids, tok.encode(s.text))
        tally(tok, "session")
    assert s.stats.first_window + s.stats.widened >= n - 2, s.stats.full_reasons


def test_long_combining_runs_fall_back_with_the_reason():
    tok = get_tokenizer("qwen3")
    s = toktier.Session(tok, "plain text " + "a" + "\u0301" * 300 + " tail")
    r = s.append("!")
    assert np.array_equal(r.ids, tok.encode(s.text))
    r = s.edit(150, 151, "")  # deep inside the run of marks
    assert np.array_equal(r.ids, tok.encode(s.text))
    assert r.path is not toktier.RepairPath.FULL or "NFC" in r.reason


def test_span_map_matches_the_normalizer_on_real_text():
    tok = get_tokenizer("qwen3")
    text = "".join(c + " mid " for c in NFC_CHANGES) + "end"
    spans, normalized = nfc_spans(tok, text.encode("utf-8"))
    assert normalized == tok.engine.normalize(text).encode("utf-8")
    m = SpanMap(spans)
    raw = np.arange(len(text.encode("utf-8")) + 1)
    norm = m.to_norm(raw)
    back = m.to_raw(norm[norm >= 0])
    assert np.array_equal(back, raw[norm >= 0])
    # outside spans the raw bytes and the normalized bytes agree
    tb = text.encode("utf-8")
    for a, b in zip(raw[norm >= 0][:-1], raw[norm >= 0][1:]):
        if b == a + 1 and norm[b] == norm[a] + 1:
            assert tb[a] == normalized[norm[a]]


@pytest.mark.parametrize("seed", range(3))
def test_the_compiled_lane_serves_ops_after_every_span(seed, tally):
    """A session holding spans the normalizer changes (a decomposed file listing up front) still
    has its appends and edits far after them spliced by the compiled lane (`Session.
    _lane_after_dirty`: run on the text from a checkpoint past the spans, with the checkpoints
    shifted), and each op is exact; ops close after the spans, or bringing new ones, take the
    Python path, exact too.  A wrong shift (a checkpoint off by one byte) makes the lane decline
    every op, which the count below catches."""
    rng = random.Random(seed)
    tok = get_tokenizer("qwen3")
    names = ["re\u0301sume\u0301.pdf", "cafe\u0301 menu.txt", "nai\u0308ve-bayes.ipynb", "\u212bngstrom.dat"]
    listing = "".join(f"-rw-r--r--  1 user  staff  {rng.randrange(10**6)} {n}\n" for n in names)
    text = listing + large_text(30_000, seed=seed, kind="code")
    s = toktier.Session(tok, text)
    assert s._dirty
    lane0, far = s.stats.lane, 0
    for i in range(40):
        u = rng.random()
        piece = large_text(rng.randrange(1, 1500), seed=100 * seed + i, kind="english")
        if i == 30:  # the lane's share is counted before: from here on new spans come near the end
            assert s.stats.lane - lane0 >= far * 2 // 3, (s.stats.lane - lane0, far)
        if i >= 30 and rng.random() < 0.5:
            piece += rng.choice(NFC_CHANGES)
        n = s.num_chars
        if u < 0.5:
            r = s.append(piece)
        elif u < 0.9:
            a = rng.randrange(max(0, n - 3000), n + 1)
            r = s.edit(a, min(n, a + rng.randrange(20)), piece)
        else:  # close after the listing
            a = len(listing) + rng.randrange(200)
            r = s.edit(a, a + 1, piece[:30])
        far += u < 0.9
        assert np.array_equal(r.ids, tok.encode(s.text)), (seed, i, r.path, r.reason)
        tally(tok, "session")
    assert s._dirty == _expected_spans(tok, s.text)
