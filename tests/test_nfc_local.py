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
    # Windows that reach a span still take the full path (a span appended a moment ago blocks
    # the next ~256 bytes of appends); the rest splice.
    assert spliced >= ops // 4, f"only {spliced} of {ops} ops spliced"


def test_appends_far_from_a_decomposed_name_splice():
    tok = get_tokenizer("qwen3")
    s = toktier.Session(tok, "re\u0301sume\u0301.txt\n" + large_text(50_000, seed=1, kind="english"))
    for _ in range(10):
        r = s.append(" and some more prose.")
        assert r.path is toktier.RepairPath.FIRST_WINDOW and np.array_equal(r.ids, tok.encode(s.text))
    r = s.edit(0, 2, "Re")  # right at the span: the full path, with the true reason
    assert r.path is toktier.RepairPath.FULL and "normalizer" in r.reason
    assert np.array_equal(r.ids, tok.encode(s.text))


def test_ignoring_span_deltas_is_caught(monkeypatch):
    """Cached token starts are normalized coordinates: located without the spans' deltas they
    never agree with the fresh window's (exactness holds either way: a splice needs agreement),
    so splices after a decomposed span stop.  The deltas are what makes them splice."""
    tok = get_tokenizer("qwen3")
    text = "re\u0301sume\u0301.txt\n" + large_text(50_000, seed=1, kind="english")
    monkeypatch.setattr(toktier.Session, "_norm", lambda self, x: x)
    s = toktier.Session(tok, text)
    for _ in range(5):
        r = s.append(" and some more prose.")
        assert np.array_equal(r.ids, tok.encode(s.text))
    assert s.stats.first_window + s.stats.widened == 0
