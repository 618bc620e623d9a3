"""Rules E and F (a line break after a letter; a line-break run before non-space) in every family.

Piece level: every class representative on either side of ``\\n``, ``\\r`` and ``\\r\\n``, in
random contexts, for every bundled tokenizer in both specials modes; each certified position
must be a piece boundary of the reference and splice (suffix and prefix re-tokenized alone give
the same pieces/IDs).  Mutation: dropping o200k's ``/`` exclusion, or certifying punctuation
before a line break, must be caught.  ID level: the shapes that used to fall to the full path
(one word per line, CRLF, separator lines, markdown tables) now splice, exactly.
"""

from __future__ import annotations

import dataclasses
import random
import zlib

import numpy as np
import pytest

import toktier
from conftest import ALL_TOKENIZERS, get_tokenizer
from toktier.boundaries import stable_char_positions
from toktier.tools.verify import pieces_failures

# Representatives of every class the predicate distinguishes, and of what each family treats
# specially: Latin/Greek/Cyrillic/CJK/kana/Arabic/Hangul letters, uppercase, marks, digits of
# several scripts, punctuation incl. ' and /, symbols, emoji, whitespace kinds, controls.
REPS = ("a", "Z", "é", "ß", "Ω", "ж", "中", "あ", "ア", "・", "م", "한", "ǅ", "ʰ", "\u0301", "\u0651",
        "0", "7", "٣", "½", "Ⅻ", "'", "/", ",", ".", "!", "-", "_", "(", "<", "|", "=", "#", "…", "€", "©",
        "😀", "\u200d", " ", "\t", "\u3000", "\u00a0", "\x0b", "\x0c", "\x85", "\u2028", "\x00", "\x1f")
BREAKS = ("\n", "\r", "\r\n", "\n\n")


def _texts(seed: int, n: int = 24) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(40):
            x, y = rng.choice(REPS), rng.choice(REPS)
            parts.append(x + rng.choice(BREAKS) + y if rng.random() < 0.8 else rng.choice(REPS) * 3)
        out.append("".join(parts))
    return out


@pytest.mark.parametrize("specials", ["all", "none"])
@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_line_break_pairs_are_reference_boundaries(name, specials, tally):
    tok = get_tokenizer(name, specials)
    checked = 0
    for text in _texts(zlib.crc32(f"{name}/{specials}".encode())):
        if tok.family_info.nfc:
            text = tok.engine.normalize(text)
        missing, bad = pieces_failures(tok, text)
        assert not len(missing) and not bad, (name, specials, text)
        checked += len(stable_char_positions(tok, text))
    tally(tok, "pieces-EF", checked)


def _mutant(tok, **change) -> toktier.FrozenTokenizer:
    return dataclasses.replace(tok, family_info=dataclasses.replace(tok.family_info, **change))


def test_dropping_o200k_slash_exclusion_is_caught():
    tok = get_tokenizer("o200k_base")
    bad = _mutant(tok, slash_after_newline=False)
    text = "x!\n/path and more!\n/usr/bin ok"
    assert not any(len(m) or b for m, b in [pieces_failures(tok, text)])
    missing, split = pieces_failures(bad, text)
    assert len(missing) or split, "a certified R->/ inside o200k's punctuation piece went unnoticed"


def test_certifying_punctuation_before_a_line_break_is_caught(monkeypatch):
    """P->R is not stable (punctuation absorbs [\\r\\n]*): a predicate that allows it must fail."""
    from toktier.families.base import Family

    tok = get_tokenizer("llama3")
    text = "end.\nnext line!\r\nmore;\n\ndone"
    original = Family.stable

    def widened(self, classes, x, y):
        return original(self, classes, x, y) | (((y == 0x0A) | (y == 0x0D)) & np.isin(x, [ord("."), ord("!")]))

    monkeypatch.setattr(Family, "stable", widened)
    missing, split = pieces_failures(tok, text)
    assert len(missing) or split


SHAPES = {
    "word-per-line": lambda rng, n: "".join(rng.choice(("alpha", "bravo", "delta", "kilo", "zulu")) + "\n"
                                            for _ in range(n)),
    "word-per-line-crlf": lambda rng, n: "".join(rng.choice(("alpha", "bravo", "delta")) + "\r\n" for _ in range(n)),
    "separator-lines": lambda rng, n: "".join(rng.choice(("=" * 40, "-" * 40, "#" * 12)) + "\nsection text\n"
                                              for _ in range(n)),
    "markdown-table": lambda rng, n: "| a | b |\n|---|---|\n" + "".join(f"| {rng.randrange(99)} | x{rng.randrange(9)} |\n"
                                                                        for _ in range(n)),
    "ls-listing": lambda rng, n: "".join(f"-rw-r--r-- 1 user staff {rng.randrange(10**6)} Nov 30 file_{i}.py\n"
                                         for i in range(n)),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", ["llama3", "o200k_base", "deepseek_v4", "qwen3", "cl100k_base"])
def test_line_shaped_content_splices_exactly(name, shape, tally):
    tok = get_tokenizer(name)
    rng = random.Random(f"{name}/{shape}")
    make = SHAPES[shape]
    s = toktier.Session(tok, make(rng, 600))
    for _ in range(15):
        if rng.random() < 0.75:
            r = s.append(make(rng, rng.randrange(1, 4)))
        else:
            a = rng.randrange(max(1, s.num_chars - 2000), s.num_chars)
            r = s.edit(a, a + 1, rng.choice(("x", "\n", "y\n", "")))
        assert np.array_equal(r.ids, tok.encode(s.text)), (name, shape)
        tally(tok, "session", 1)
    assert s.stats.full <= 1 + s.stats.ops // 5, (name, shape, s.stats)  # the start, and few fallbacks
