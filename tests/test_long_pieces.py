"""Cuts inside long pieces (issue 13 part 3): glued pairs and digit triples, proven against the reference.

Piece level (HF engines, whose pre-tokenizer the reference exposes): at every boundary
`glue_mask` calls glued, (a) the reference places no piece boundary, and (b) scanning from
any earlier point of the glued stretch gives the same pieces from there on, which is what
lets a window that starts inside a piece agree with the true scan.

ID level, every bundled tokenizer: sessions on contexts that are one long piece (runs of
one character, DNA, spaces, digits, punctuation, Thai, base64) and on adversarial mixtures
(contractions, case changes, line breaks after space runs, ASCII punctuation before
letters), driven by appends and edits inside the runs; every op equals the reference and
the long-piece shapes splice instead of re-encoding the text.  Mutations that widen the
glue (drop the contraction guard, o200k's case rule, the whitespace cleanliness rule, the
digit-triple test) must be caught.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toktier
from conftest import ALL_TOKENIZERS, get_tokenizer
from toktier.families import glue as glue_mod
from toktier.families.glue import glue_mask

HF_TOKENIZERS = [n for n in ALL_TOKENIZERS if n in ("llama3", "qwen3", "deepseek_v4")]

#: Characters that stress every glue rule: letters of both cases and scripts, marks, the
#: apostrophe and contraction letters, punctuation, digits, every whitespace kind.
ALPHABET = ("a", "b", "s", "t", "A", "B", "é", "É", "ก", "ข", "\u0e34", "\u0301", "中", "'", "=", "-", ".",
            "/", "0", "7", " ", " ", "\t", "\n", "\r", "\u3000", "ß", "Ω", "ʰ", "ǅ", "ſ", "\u212a", "あ", "ア", "・",
            "\u3099", "٣", "½", "\u00a0", "\u2028", "\x0b", "\x85", "\u0308", "\u093f", "क", "😀", "\u200d", "#", "|")


def _cps(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def _pieces(tok, text: str) -> list[tuple[int, int]]:
    return [span for _, span in tok.engine.pre_tokenize(text)]


def _glue_texts(seed: int, n: int = 30) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randrange(3, 9)):
            c = rng.choice(ALPHABET)
            parts.append(c * rng.randrange(1, 12) if rng.random() < 0.6 else "".join(rng.choices(ALPHABET, k=4)))
        out.append("".join(parts))
    return out


def _glue_failures(tok, text: str, mask_fn=glue_mask, tails=("\n", "\r\n", " x", "'s", "aB", "é", "5", "")) -> list:
    """Glued boundaries of `text` violating (a) no piece boundary, (b) the same piece ends from
    any scan start before it, (c) the same start of the piece holding it whatever follows c + 1."""
    cps = _cps(text)
    case = glue_mod.case_table(tok) if tok.family_info.name == "o200k" else None
    g = mask_fn(tok.family_info, tok.classes, cps, ends_text=True, lead_clean=True, case=case)
    glued = np.flatnonzero(g)
    if not len(glued):
        return []
    pieces = _pieces(tok, text)
    starts = {a for a, _ in pieces}
    rng = random.Random(len(text))
    bad = []
    for c in map(int, glued):
        if c in starts:
            bad.append(("boundary", c))
            continue
        m = c - 1  # start of the glued stretch holding boundary c
        while m >= 1 and g[m]:
            m -= 1
        true_after = [b for _, b in pieces if b > c]
        for start in sorted({m, (m + c) // 2, c - 1, rng.randrange(0, c)}):
            sub = [b + start for _, (_, b) in tok.engine.pre_tokenize(text[start:])]
            if [b for b in sub if b > c] != true_after:
                bad.append(("end", c, start))
        holder = next(a for a, b in pieces if a < c < b)
        for tail in tails:
            other = text[: c + 2] + tail
            if c + 2 > len(text):
                continue
            held = [a for a, b in _pieces(tok, other) if a < c < b]
            if held != [holder]:
                bad.append(("start", c, tail))
    return bad


class _O200kPieces:
    """o200k's tokenizer (classes, family, engine) with its regex run by HF's engine as the
    piece oracle: tiktoken exposes no pieces; the ID-level tests below use tiktoken itself."""

    def __init__(self) -> None:
        from tokenizers import Regex, pre_tokenizers

        from toktier.families.o200k import O200K

        self._tok = get_tokenizer("o200k_base")
        self._split = pre_tokenizers.Split(Regex(O200K), behavior="isolated")
        self.engine = self
        # Class tables stay tiktoken's (probed by its engine, under its cache key), as in production.
        self.class_key = self._tok.engine.class_key
        self.probe_class = self._tok.engine.probe_class

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def pre_tokenize(self, text: str):
        return self._split.pre_tokenize_str(text)


@pytest.mark.parametrize("name", HF_TOKENIZERS + ["o200k_base"])
def test_glued_boundaries_are_inside_pieces_with_fixed_starts_and_ends(name, tally):
    tok = _O200kPieces() if name == "o200k_base" else get_tokenizer(name)
    checked = 0
    for text in _glue_texts(hash(name) & 0xFFFF):
        if tok.family_info.nfc:
            text = tok.engine.normalize(text)
        assert not _glue_failures(tok, text), (name, text, _glue_failures(tok, text)[:3])
        case = glue_mod.case_table(tok) if name == "o200k_base" else None
        checked += int(glue_mask(tok.family_info, tok.classes, _cps(text), ends_text=True, lead_clean=True,
                                 case=case).sum())
    tally(getattr(tok, "_tok", tok), "pieces-glue", checked)


def _run_shapes(rng: random.Random) -> dict[str, tuple[str, callable]]:
    """name -> (context generator, append generator)."""
    dna = lambda k: "".join(rng.choice("ACGT") for _ in range(k))  # noqa: E731
    return {
        "dna": (dna, dna),
        "dna-lower": (lambda k: dna(k).lower(), lambda k: dna(k).lower()),
        "run-a": (lambda k: "a" * k, lambda k: "a" * k),
        "run-equals": (lambda k: "=" * k, lambda k: "=" * k),
        "run-space": (lambda k: " " * k, lambda k: " " * k),
        "run-digit": (lambda k: "0" * k, lambda k: "0" * k),
        "digits": (lambda k: "".join(rng.choice("0123456789") for _ in range(k)),
                   lambda k: "".join(rng.choice("0123456789") for _ in range(k))),
        "thai": (lambda k: ("สวัสดีครับผม" * (k // 12 + 1))[:k], lambda k: "ครับ"[: max(1, k % 5)]),
        "base64": (lambda k: "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
                                     for _ in range(k)), lambda k: "QUJD"[: max(1, k % 5)]),
        "mixed-case": (lambda k: "".join(rng.choice("aAbB") for _ in range(k)), lambda k: rng.choice(("aB", "Ba", "b"))),
    }


#: Appends and inserts that end or split a run in every way the glue rules care about.
BREAKERS = ("'s", "'re", " word", "\n", "\r\n", " \n", "\t", "x", "X", "é", "5", "123", ".", "=a", ".abc", "aB", "\u0301",
            "中文", " ", "  ")


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_sessions_on_long_pieces_are_exact_and_splice(name, tally):
    tok = get_tokenizer(name)
    rng = random.Random(f"long/{name}")
    spliced = ops = 0
    for shape, (make, more) in _run_shapes(rng).items():
        text = make(6_000)
        if tok.family_info is not None and tok.family_info.nfc:
            text = tok.engine.normalize(text)
        s = toktier.Session(tok, text)
        for i in range(14):
            u = rng.random()
            if u < 0.45:
                r = s.append(more(rng.randrange(1, 40)))
            elif u < 0.6:
                r = s.append(rng.choice(BREAKERS))
            elif u < 0.85:  # inside the run, far from both ends
                a = rng.randrange(s.num_chars // 4, 3 * s.num_chars // 4)
                r = s.edit(a, a + rng.randrange(0, 3), more(rng.randrange(0, 4)) if rng.random() < 0.7
                           else rng.choice(BREAKERS))
            else:
                a = rng.randrange(max(0, s.num_chars - 200), s.num_chars + 1)
                r = s.edit(a, min(s.num_chars, a + 1), rng.choice(BREAKERS + ("",)))
            assert np.array_equal(r.ids, tok.encode(s.text)), (name, shape, i, r.path)
            ops += 1
            spliced += r.path is not toktier.RepairPath.FULL
            tally(tok, "session", 1)
    if tok.family_info is not None:
        assert spliced >= ops * 3 // 4, (name, spliced, ops)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_appends_to_one_long_piece_splice_without_reencoding(name):
    tok = get_tokenizer(name)
    for text, more in (("ACGT" * 25_000, "GATTACA"), ("=" * 100_000, "===="), (" " * 100_000, "  "),
                       ("7" * 100_000, "123")):
        s = toktier.Session(tok, text)
        for _ in range(5):
            r = s.append(more)
            assert np.array_equal(r.ids, tok.encode(s.text)), (name, text[:4])
        assert s.stats.full == 1 and s.stats.tokens_retokenized < len(s.ids) + 5_000, (name, text[:4], s.stats)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_random_edits_near_runs(data):
    name = data.draw(st.sampled_from(ALL_TOKENIZERS))
    tok = get_tokenizer(name)
    run_char = data.draw(st.sampled_from(("a", "A", "=", " ", "0", "ก", "\t", "'")))
    text = data.draw(st.text(alphabet=st.sampled_from(ALPHABET), max_size=12)) + run_char * 1_500 \
        + data.draw(st.text(alphabet=st.sampled_from(ALPHABET), max_size=12))
    if tok.family_info is not None and tok.family_info.nfc:
        text = tok.engine.normalize(text)
    s = toktier.Session(tok, text)
    for _ in range(4):
        ins = data.draw(st.text(alphabet=st.sampled_from(ALPHABET + (run_char,) * 6), max_size=6))
        a = data.draw(st.integers(0, s.num_chars))
        b = data.draw(st.integers(a, min(s.num_chars, a + 3)))
        r = s.edit(a, b, ins)
        assert np.array_equal(r.ids, tok.encode(s.text)), (name, repr(s.text[max(0, a - 5):a + 10]))


# -- mutations: each widening of the glue must be caught --------------------------------------------

def _caught(tok, texts_and_ops) -> bool:
    """True when some op of these sessions differs from the reference."""
    for text, ops in texts_and_ops:
        s = toktier.Session(tok, text)
        for kind, *args in ops:
            r = s.append(*args) if kind == "append" else s.edit(*args)
            if not np.array_equal(r.ids, tok.encode(s.text)):
                return True
    return False


def _widened(monkeypatch, extra):
    original = glue_mod.glue_mask

    def mutant(fam, classes, cps, **kw):
        return original(fam, classes, cps, **kw) | extra(fam, classes, cps)

    monkeypatch.setattr("toktier.repair_window.glue_mask", mutant)


def test_mutation_whitespace_without_the_line_break_rule_is_caught():
    """``\n`` + spaces + an appended ``\n`` is one piece: gluing spaces without the cleanliness
    rule would keep the earlier piece start (the BPE of long space runs happens to hide it in
    the bundled vocabularies, so this is caught at the piece level, where it is wrong)."""
    tok = get_tokenizer("llama3")
    text = "x\n" + " " * 40 + "y"
    assert not _glue_failures(tok, text)

    def mutant(fam, classes, cps, **kw):
        out = glue_mask(fam, classes, cps, **kw)
        out[1:-1] |= (cps[:-2] == 0x20) & (cps[1:-1] == 0x20) & (cps[2:] == 0x20)
        return out

    assert any(kind == "start" for kind, *_ in _glue_failures(tok, text, mutant))


def test_mutation_o200k_marks_in_letter_glue_is_caught(monkeypatch):
    """o200k's marks belong to the word classes and to punctuation: after ``==`` a run of marks is
    punctuation, but a scan starting inside it reads a word that swallows the next letter."""
    from toktier.charclass import M

    tok = get_tokenizer("o200k_base")
    cases = [("x==" + "\u0e34" * 300, [("append", "ก")]), ("- -" + "\u0e34" * 300, [("append", "กข")])]
    assert not _caught(tok, cases)

    def marks(fam, classes, cps):
        m = (classes[cps] & M) != 0
        out = np.zeros(len(cps), dtype=bool)
        out[1:] = m[:-1] & m[1:]
        return out

    _widened(monkeypatch, marks)
    assert _caught(tok, cases)


def test_mutation_any_token_as_a_digit_cut_is_caught(monkeypatch):
    """Digit cuts are safe because a three-digit token is a whole piece; certifying every token
    edge that way cuts inside pieces (here o200k's run of Thai marks after punctuation)."""
    tok = get_tokenizer("o200k_base")
    cases = [("x==" + "\u0e34" * 300, [("append", "ก")]), ("12" + "3456789" * 300, [("edit", 1, 1, "9")])]
    assert not _caught(tok, cases)
    tok.derived.pop("digit_piece_tokens", None)
    monkeypatch.setattr("toktier.repair_window.digit_piece_tokens",
                        lambda fam, token_bytes: np.ones(len(token_bytes), dtype=bool))
    try:
        assert _caught(tok, cases)
    finally:
        tok.derived.pop("digit_piece_tokens", None)


def test_mutation_letters_after_a_contraction_is_caught():
    """``'t`` ends a piece inside a letter run: gluing every L->L pair misses that boundary."""
    from toktier.charclass import L

    tok = get_tokenizer("llama3")
    text = "we don'tstopnow and it'sfine"
    assert not _glue_failures(tok, text)

    def mutant(fam, classes, cps, **kw):
        out = glue_mask(fam, classes, cps, **kw)
        is_l = (classes[cps] & L) != 0
        out[1:] |= is_l[:-1] & is_l[1:]
        return out

    assert any(kind == "boundary" for kind, *_ in _glue_failures(tok, text, mutant))


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_campaign_long_pieces(name, tally):
    """Long-piece campaign (``--runslow``): piece-level glue proofs on many random texts (HF
    engines, o200k's pattern in HF's engine) and long-piece sessions whose every op is checked."""
    tok = get_tokenizer(name)
    if name in HF_TOKENIZERS or name == "o200k_base":
        oracle = _O200kPieces() if name == "o200k_base" else tok
        positions = 0
        for seed in range(150):
            for text in _glue_texts(seed * 7919 + 17, n=10):
                if tok.family_info.nfc:
                    text = tok.engine.normalize(text)
                assert not _glue_failures(oracle, text), (name, text)
                case = glue_mod.case_table(tok) if name == "o200k_base" else None
                positions += int(glue_mask(tok.family_info, tok.classes, _cps(text), ends_text=True,
                                           lead_clean=True, case=case).sum())
        tally(tok, "pieces-glue", positions)
    rng = random.Random(f"campaign/{name}")
    glued = 0
    for round_ in range(6):
        for shape, (make, more) in _run_shapes(rng).items():
            text = make(3_000 + 500 * round_)
            if tok.family_info is not None and tok.family_info.nfc:
                text = tok.engine.normalize(text)
            s = toktier.Session(tok, text)
            for _ in range(20):
                if rng.random() < 0.6:
                    r = s.append(more(rng.randrange(1, 30)) if rng.random() < 0.8 else rng.choice(BREAKERS))
                else:
                    a = rng.randrange(0, s.num_chars + 1)
                    r = s.edit(a, min(s.num_chars, a + rng.randrange(0, 3)),
                               more(rng.randrange(0, 3)) if rng.random() < 0.7 else rng.choice(BREAKERS))
                assert np.array_equal(r.ids, tok.encode(s.text)), (name, shape)
            glued += s.stats.glued
            tally(tok, "session", s.stats.ops)
    tally(tok, "glued-splices", glued)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_edits_inside_a_long_run_cost_the_run_not_the_text(name, tally):
    """An edit inside a run changes every later token of the run: the window goes to the run's
    end (O(run)), never to a full re-tokenization of the text around it."""
    tok = get_tokenizer(name)
    prose = "Plain words around the run, and some more of them. " * 1_500  # the text: ~5x the run
    rng = random.Random(name)
    for run in ("a" * 30_000, "=" * 30_000, " " * 30_000, "7" * 30_000):
        s = toktier.Session(tok, prose + "\n" + run + "\n" + prose)
        start = len(prose) + 1
        for _ in range(3):
            before = s.stats.tokens_retokenized
            a = start + rng.randrange(1_000, 29_000)
            r = s.edit(a, a + 1, rng.choice(("x", "\n", "Z", " ")))
            assert np.array_equal(r.ids, tok.encode(s.text)), (name, run[0])
            assert r.path is not toktier.RepairPath.FULL, (name, run[0], r.reason)
            # every attempt's window counted (widenings included): still well under the whole text
            assert s.stats.tokens_retokenized - before < len(r.ids) // 2, (name, run[0])
            tally(tok, "session")
