"""The derived stable-pair tables (``toktier/families/derive.py``), proven against the references.

* The tables in the family modules (``STABLE_GRID`` and the docstring block) are what a fresh
  derivation computes (quick mode: every representative pair, every context of up to one kind
  a side or two on one side, samples of the longer ones), so they cannot drift.
* Piece level: for every bundled tokenizer in both specials modes, every certified fine kind
  pair with EVERY pair of its representatives, glued into texts with random representatives
  between them, passes `pieces_failures` (a reference boundary at each certified position, and
  the suffix and prefix re-tokenized alone agree); tiktoken engines are checked at the token
  level there.
* ID level: sessions appending and editing such texts stay equal to ``tok.encode``.
* Mutation: widening a family's predicate by any one uncertified group pair is caught by the
  piece-level check.
* The kind partition is sound (swapping a representative for another of its kind never moves
  a reference piece boundary), the grids contain every pair rules A-F certified, and the
  vectorized group lookup agrees with the kind table.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import zlib

import numpy as np
import pytest

import toktier
from conftest import ALL_TOKENIZERS, get_tokenizer
from toktier.boundaries import stable_char_positions
from toktier.families import FAMILIES, cl100k, deepseek, derive, o200k, qwen
from toktier.families.base import format_grid, parse_grid
from toktier.tools.verify import pieces_failures

MODULES = {"cl100k": cl100k, "qwen": qwen, "o200k": o200k, "deepseek": deepseek}
PAIRS_PER_TEXT = 40

_DERIVED: dict[str, derive.Derivation] = {}


def derivation(family: str) -> derive.Derivation:
    """The quick-mode derivation of a family (once per run; skips when a source is missing)."""
    if family not in _DERIVED:
        _DERIVED[family] = derive.derive_family(family, mode="quick", load=get_tokenizer)
    return _DERIVED[family]


def _grid(family: str) -> np.ndarray:
    spec = FAMILIES[family]
    return parse_grid(spec.stable_grid, spec.kinds.groups)


def _certified_fine_pairs(family: str) -> list[tuple[derive.Kind, derive.Kind]]:
    table, grid = FAMILIES[family].kinds, _grid(family)
    g = table.groups.index
    return [(a, b) for a in table.kinds for b in table.kinds if grid[g(a.group), g(b.group)]]


def _context_chars(tok) -> str:
    """Representatives to glue pairs with (NFC families: only NFC-inert ones, so that
    normalization cannot merge a glue character into the pair it touches)."""
    reps = "".join(k.reps for k in FAMILIES[tok.family_info.name].kinds.kinds)
    if tok.family_info.nfc:
        from toktier.families import I

        reps = "".join(c for c in reps if tok.classes[ord(c)] & I)
    return reps


def _glued(pairs: list[str], glue: str, rng: random.Random, per_text: int = PAIRS_PER_TEXT) -> list[str]:
    """Texts of `per_text` pairs each, with 0-2 random glue characters around every pair."""
    pairs = list(pairs)
    rng.shuffle(pairs)
    out = []
    for i in range(0, len(pairs), per_text):
        parts = []
        for p in pairs[i : i + per_text]:
            parts.append("".join(rng.choice(glue) for _ in range(rng.randrange(3))) + p)
        parts.append("".join(rng.choice(glue) for _ in range(rng.randrange(3))))
        out.append("".join(parts))
    return out


def _rep_pairs(pairs) -> list[str]:
    return [x + y for a, b in pairs for x, y in itertools.product(a.reps, b.reps)]


# ------------------------------------------------------------------------------------------
# the tables are the derivation's
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(MODULES))
def test_module_tables_are_what_derive_computes(family):
    d = derivation(family)
    spec, mod = FAMILIES[family], MODULES[family]
    assert spec.stable_grid.strip("\n") == derive.grid_of(d).strip("\n"), (
        f"{family}: STABLE_GRID is stale; run python -m toktier.families.derive --write\n{derive.grid_of(d)}")
    assert derive.docstring_block(mod.__doc__) == derive.render_block(d), (
        f"{family}: the docstring table is stale; run python -m toktier.families.derive --write")
    assert spec.stable_grid == mod.STABLE_GRID
    # `chunk_stable` (no x in W) is what cutting into standalone chunks needs: only pairs after
    # whitespace split differently when text[:q] is tokenized alone, and some do
    table = spec.kinds
    assert d.not_standalone and all(table.kind(a).group in ("sp", "R", "ws") for a, _b in d.not_standalone)


@pytest.mark.parametrize("family", sorted(MODULES))
def test_kind_partition_is_sound(family):
    """Within a fine kind, every representative gives the same reference piece boundaries."""
    table = FAMILIES[family].kinds
    for r in derive.runners(family, get_tokenizer):
        bad = derive.partition_failures(table, r, n_texts=60, seed=zlib.crc32(family.encode()))
        assert not bad, (r.label, bad[:3])


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_groups_match_the_kind_table_and_grids_contain_rules_a_to_f(name):
    tok = get_tokenizer(name)
    fam = tok.family_info
    table = FAMILIES[fam.name].kinds
    # vectorized lookup (cached per class table, and the uncached path) == the table's scalar rule
    specials = [c for c, _ in table.special]
    values = np.unique(tok.classes)
    cps = np.array(specials + [int(np.flatnonzero(tok.classes == v)[0]) for v in values], dtype=np.uint32)
    want = [table.groups.index(table.group_of(int(tok.classes[c]), int(c))) for c in cps]
    assert fam.groups(tok.classes, cps).tolist() == want
    assert fam.groups(tok.classes.copy(), cps).tolist() == want
    # every representative pair rules A-F certified is still certified (and by both paths)
    for a, b in itertools.product(table.kinds, repeat=2):
        x, y = derive.fine_rep_pairs(table, a.name, b.name)
        new = fam.stable(tok.classes, x, y)
        assert np.array_equal(new, fam.stable(tok.classes.copy(), x, y)), (a.name, b.name)
        old = derive.rules_a_f(fam, tok.classes, x, y)
        assert not (old & ~new).any(), (a.name, b.name)


# ------------------------------------------------------------------------------------------
# piece level: every representative pair of every certified kind pair
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("specials", ["all", "none"])
@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_certified_pairs_are_reference_boundaries(name, specials, tally):
    tok = get_tokenizer(name, specials)
    fam = tok.family_info
    pairs = _certified_fine_pairs(fam.name)
    reps = _rep_pairs(pairs)
    # the predicate certifies every one of them (NFC families: when both characters are inert)
    cps = np.array([[ord(p[0]), ord(p[1])] for p in reps], dtype=np.uint32)
    ok = fam.stable(tok.classes, cps[:, 0], cps[:, 1])
    if fam.nfc:
        from toktier.families import I

        inert = ((tok.classes[cps[:, 0]] & I) != 0) & ((tok.classes[cps[:, 1]] & I) != 0)
        assert np.array_equal(ok, inert)
        assert inert.mean() > 0.5
    else:
        assert ok.all()
    rng = random.Random(zlib.crc32(f"{name}/{specials}".encode()))
    checked = 0
    for text in _glued(reps, _context_chars(tok), rng):
        if fam.nfc:
            text = tok.engine.normalize(text)
        missing, bad = pieces_failures(tok, text)
        assert not len(missing) and not bad, (name, specials, text, missing[:3], bad[:3])
        checked += len(stable_char_positions(tok, text))
    tally(tok, "pieces-pairs", checked)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_sessions_on_pair_texts_are_exact(name, tally):
    tok = get_tokenizer(name)
    rng = random.Random(f"session/{name}")
    reps = _rep_pairs(_certified_fine_pairs(tok.family_info.name))
    glue = _context_chars(tok) + "\n\t "
    texts = _glued(reps, glue, rng, per_text=8)
    s = toktier.Session(tok, "".join(texts[:60]))
    for _ in range(20):
        piece = rng.choice(texts)
        if rng.random() < 0.6:
            r = s.append(piece)
        else:
            a = rng.randrange(s.num_chars)
            b = min(s.num_chars, a + rng.randrange(4))
            r = s.edit(a, b, piece[: rng.randrange(len(piece) + 1)])
        assert np.array_equal(r.ids, tok.encode(s.text)), name
        tally(tok, "session-pairs", 1)


# ------------------------------------------------------------------------------------------
# mutation: one uncertified group pair too many is caught
# ------------------------------------------------------------------------------------------

def _mutant(tok, pair: tuple[str, str]) -> toktier.FrozenTokenizer:
    return dataclasses.replace(tok, family_info=dataclasses.replace(tok.family_info, extra_pairs=(pair,)))


def _caught(mutant, texts) -> bool:
    for text in texts:
        if mutant.family_info.nfc:
            text = mutant.engine.normalize(text)
        missing, bad = pieces_failures(mutant, text)
        if len(missing) or bad:
            return True
    return False


#: The bundled tokenizers of each family.
FAMILY_TOKENIZERS = {"cl100k": ("llama3", "cl100k_base"), "qwen": ("qwen3",), "o200k": ("o200k_base",),
                     "deepseek": ("deepseek_v4",)}


def _caught_by_runner(r: derive.Runner, mutant, texts) -> bool:
    """The piece-level check through a derivation runner (tiktoken patterns in HF's regex engine)."""
    for text in texts:
        for q in map(int, stable_char_positions(mutant, text)):
            if derive.check_probe(r, text[: q - 1], text[q - 1], text[q], text[q + 1 :]):
                return True
    return False


@pytest.mark.parametrize("family", sorted(MODULES))
def test_widening_by_any_uncertified_group_pair_is_caught(family):
    """Every "." of the family's grid, certified on its own, fails a piece-level check (on the
    derivation's witnesses or on representative pairs in random contexts): `pieces_failures` on
    one of the family's tokenizers, or, where tiktoken's token-level check cannot see the
    missing piece boundary (BPE cuts there anyway), the same check on the pattern's pieces in
    HF's regex engine."""
    table, grid = FAMILIES[family].kinds, _grid(family)
    d = derivation(family)
    toks = [get_tokenizer(n) for n in FAMILY_TOKENIZERS[family]]
    rs = derive.runners(family, get_tokenizer)
    rng = random.Random(f"mutation/{family}")
    uncaught = []
    for i, j in zip(*np.nonzero(~grid)):
        gx, gy = table.groups[i], table.groups[j]
        fine = [(a, b) for a in table.kinds for b in table.kinds if (a.group, b.group) == (gx, gy)]
        witnesses = [w.u + w.x + w.y + w.v for a, b in fine if (w := d.fine[(a.name, b.name)]) is not None]
        texts = witnesses + _glued(_rep_pairs(fine), _context_chars(toks[0]), rng)
        if any(_caught(_mutant(tok, (gx, gy)), texts) for tok in toks):
            continue
        if not any(_caught_by_runner(r, _mutant(r.tok, (gx, gy)), witnesses) for r in rs):
            uncaught.append((gx, gy))
    assert not uncaught, f"{family}: certifying these uncertified pairs went unnoticed: {uncaught}"


def test_named_mutations_are_caught():
    """The classic crossable pairs, on the reference engines themselves: letter->letter,
    digit->digit, punctuation->line break (Qwen's digits are single pieces: its N->N is
    certified), o200k's line break -> slash."""
    text = "ab 12, 1234 end.\nnext!\r\nmore;\n\n x!\n/path and more!\n/usr/bin ok héllo wörld Ωмега 99.5\n"
    for name, pairs in [("llama3", [("L", "L"), ("N", "N"), ("X", "R")]), ("cl100k_base", [("L", "L"), ("N", "N")]),
                        ("qwen3", [("L", "L"), ("X", "R")]), ("o200k_base", [("L", "L"), ("N", "N"), ("R", "/")]),
                        ("deepseek_v4", [("A", "A"), ("L", "L"), ("N", "N"), ("P", "R")])]:
        tok = get_tokenizer(name)
        groups = FAMILIES[tok.family_info.name].kinds.groups
        for pair in pairs:
            assert not _grid(tok.family_info.name)[groups.index(pair[0]), groups.index(pair[1])], pair
            assert _caught(_mutant(tok, pair), [text]), (name, pair)


# ------------------------------------------------------------------------------------------
# campaign: the pairs rules A-F did not certify, on larger random texts (slow)
# ------------------------------------------------------------------------------------------

def _new_pairs(tok) -> list[str]:
    """Representative pairs the grid certifies and rules A-F did not."""
    table = FAMILIES[tok.family_info.name].kinds
    out = []
    for a, b in _certified_fine_pairs(tok.family_info.name):
        x, y = derive.fine_rep_pairs(table, a.name, b.name)
        new = tok.family_info.stable(tok.classes, x, y) & ~derive.rules_a_f(tok.family_info, tok.classes, x, y)
        out += [chr(p) + chr(q) for p, q in zip(x[new], y[new])]
    return out


def _ids_failures(tok, text: str, positions: np.ndarray) -> list[int]:
    """Positions where the reference IDs do not splice: no token starts there, the IDs after
    it are not the suffix's own, or the IDs before it depend on text past q + 1."""
    from toktier.boundaries import char_byte_offsets

    ids = tok.encode(text)
    _, offs = char_byte_offsets(text)
    starts = np.concatenate(([0], np.cumsum(tok.token_len[ids], dtype=np.int64)))[:-1]
    bad = []
    for q in map(int, positions):
        k = int(np.searchsorted(starts, offs[q]))
        if (k >= len(ids) or starts[k] != offs[q] or not np.array_equal(ids[k:], tok.encode(text[q:]))
                or not np.array_equal(tok.encode(text[: q + 1] + "Zq 9\n")[:k], ids[:k])):
            bad.append(q)
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_campaign_new_pairs(name, tally):
    """Larger random texts dense in the pairs the grids certify beyond rules A-F: every such
    position at the piece level (`pieces_failures`: all certified positions of each text), a
    sample at the ID level, and session edits that insert such pairs."""
    tok = get_tokenizer(name)
    fam = tok.family_info
    new = _new_pairs(tok)
    rng = random.Random(f"campaign/{name}")
    glue = _context_chars(tok) + " \n\t"
    pieces = ids = ops = 0
    for _ in range(40):
        text = "".join(_glued([rng.choice(new) for _ in range(400)], glue, rng, per_text=400))
        if fam.nfc:
            text = tok.engine.normalize(text)
        missing, bad = pieces_failures(tok, text)
        assert not len(missing) and not bad, (name, text)
        cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        q = stable_char_positions(tok, text)
        q = q[~derive.rules_a_f(fam, tok.classes, cps[q - 1], cps[q])]
        pieces += len(q)
        sample = np.sort(rng.sample(list(q), min(100, len(q))))
        assert not _ids_failures(tok, text, sample), name
        ids += len(sample)
        s = toktier.Session(tok, text[: len(text) // 2])
        for _ in range(10):
            a = rng.randrange(s.num_chars)
            r = s.edit(a, a, rng.choice(new)) if rng.random() < 0.5 else s.append(rng.choice(new) * 3)
            assert np.array_equal(r.ids, tok.encode(s.text)), name
            ops += 1
    tally(tok, "pieces-new", pieces)
    tally(tok, "ids-new", ids)
    tally(tok, "session-new", ops)
