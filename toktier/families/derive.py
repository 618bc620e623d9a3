r"""Derive each family's stable kind pairs by probing the reference pre-tokenizer.

``python -m toktier.families.derive`` prints, per family, the grid of stable group
pairs that ``Family.stable`` reads (the family module's ``STABLE_GRID`` and docstring
block); ``--write`` rewrites them in the family modules; ``--mode full`` enumerates
every context of up to two kinds a side instead of a sample (minutes); ``--fine`` also
prints every fine kind pair with its witness.

Definition.  A fine kind pair (a, b) is *stable* when, for every probe text
``u + x + y + v`` with x a representative of a, y one of b, and u, v every sequence
of 0-2 kinds (representatives rotated), with q = len(u) + 1:

1. q is a piece boundary of the reference pieces of u+x+y+v;
2. the pieces right of q are those of y+v, shifted by q;
3. the pieces left of q are those of u+x+y left of q (and q is a boundary there).

Every (x, y) representative pair is probed (phase 0), then every context of at most
one kind a side or of two kinds on one side only (phase 1), every context with two
kinds on one side and one on the other (phase 2), and the 2+2 contexts (phase 3).
``MODES`` sets the budget: ``quick`` (the tests') samples phases 2 and 3, ``default``
runs phase 2 whole and samples phase 3, ``full`` runs everything.  A pair is rejected
at its first failing probe, which is kept as a witness.  A group pair (what the
predicate sees) is stable when every fine pair in it is: a code point of a group
behaves like one of the group's fine kinds, so the intersection holds for all of them.
Phases 0-1 also check that u+x tokenized alone gives the pieces left of q (what
`Family.chunk_stable` certifies); the pairs that fail it are recorded
(`Derivation.not_standalone`): all of them follow whitespace, which `chunk_stable`
excludes.

Engines.  HF tokenizers are probed through their own pre-tokenizer object (without
the normalizer: the NFC condition is a separate conjunct of the predicate).
tiktoken has no piece API: its pattern is probed through HF ``tokenizers``' regex
engine (Oniguruma) as a ``Split`` (the HF form of the same pattern) and, when the
``regex`` module is installed, through ``regex`` (a backtracking engine like tiktoken's
fancy-regex); the tests then prove every certified pair on the tiktoken engine itself
at the token level (``verify.pieces_failures``).  A family with several sources (cl100k: Llama-3's
tokenizer.json and cl100k_base's pattern) certifies what all of them certify.

The finite contexts are evidence, not the proof: the proof is each family module's
argument over its pattern's alternatives (no match holds the pair, the scan restarts
at q, look-ahead reads at most one character past a match); the enumeration makes sure
no pair is certified that a short context breaks, and no pair the argument misses is
left out.
"""

from __future__ import annotations

import argparse
import itertools
import random
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..charclass import K
from .base import Family, Kind, KindTable, format_grid, parse_grid

#: Per family: the bundled tokenizers whose pre-tokenizers are probed, and how.
#: "engine": the HF tokenizer's own pre-tokenizer; "onig": the pattern(s) as HF Splits;
#: "regex": the pattern(s) through the `regex` module (a third, backtracking engine).
SOURCES: dict[str, tuple[tuple[str, str], ...]] = {
    "cl100k": (("llama3", "engine"), ("cl100k_base", "onig"), ("cl100k_base", "regex")),
    "qwen": (("qwen3", "engine"),),
    "o200k": (("o200k_base", "onig"), ("o200k_base", "regex")),
    "deepseek": (("deepseek_v4", "engine"),),
}

#: Context budgets per pair, (phase 2, phase 3): None = every context, n = a seeded sample of n.
MODES: dict[str, tuple[int | None, int | None]] = {
    "quick": (400, 400),  # what the tests run (seconds)
    "default": (None, 1500),  # the CLI's default
    "full": (None, None),  # every context of up to two kinds a side (minutes)
}


# ------------------------------------------------------------------------------------------
# piece boundaries of one text, as a bit mask (bit p: a piece starts at p; bit 0 always)
# ------------------------------------------------------------------------------------------

@dataclass
class Runner:
    """One reference pre-tokenizer: `mask(text)` = bit mask of its piece starts."""

    label: str
    tok: object  # the FrozenTokenizer whose class table the representatives are checked against
    pieces: Callable[[str], list[tuple[int, int]]]
    _cache: dict = field(default_factory=dict, repr=False)
    calls: int = 0

    def mask(self, text: str) -> int:
        self.calls += 1
        m = 1
        for a, _b in self.pieces(text):
            m |= 1 << a
        return m

    def cached(self, text: str) -> int:
        m = self._cache.get(text)
        if m is None:
            if len(self._cache) > 1 << 20:  # bounded: full mode probes tens of millions of texts
                self._cache.clear()
            m = self._cache[text] = self.mask(text)
        return m


def _hf_pieces(pre) -> Callable[[str], list[tuple[int, int]]]:
    return lambda s: [ab for _p, ab in pre.pre_tokenize_str(s)]


def _regex_pieces(patterns: tuple[str, ...]):
    import regex

    compiled = [regex.compile(p) for p in patterns]

    def pieces(s: str) -> list[tuple[int, int]]:
        spans = [(0, len(s))]
        for rx in compiled:  # each stage splits every piece of the previous one (HF Split semantics)
            out = []
            for a, b in spans:
                pos = a
                for m in rx.finditer(s, a, b):
                    if m.start() == m.end():
                        continue
                    if m.start() > pos:
                        out.append((pos, m.start()))
                    out.append(m.span())
                    pos = m.end()
                if pos < b:
                    out.append((pos, b))
            spans = out
        return spans

    return pieces


def make_runner(tok, how: str) -> Runner:
    """A `Runner` over `tok`'s pre-tokenizer: its own object ("engine"), or its pattern(s) in
    HF tokenizers' regex engine ("onig") or the `regex` module ("regex")."""
    patterns = tuple(tok.engine.facts.split_patterns)
    if how == "engine":
        return Runner(f"{tok.name} (its pre-tokenizer)", tok, _hf_pieces(tok.engine._tok.pre_tokenizer))
    if how == "onig":
        from tokenizers import Regex
        from tokenizers import pre_tokenizers as pt

        splits = [pt.Split(Regex(p), behavior="isolated") for p in patterns]
        pre = splits[0] if len(splits) == 1 else pt.Sequence(splits)
        return Runner(f"{tok.name} pattern in tokenizers' Oniguruma", tok, _hf_pieces(pre))
    if how == "regex":
        return Runner(f"{tok.name} pattern in the regex module", tok, _regex_pieces(patterns))
    raise ValueError(how)


def runners(family: str, load: Callable[[str], object] | None = None) -> list[Runner]:
    """The family's `SOURCES` as runners (a source needing a missing `regex` module is skipped)."""
    if load is None:
        from toktier import load_tokenizer as load
    out = []
    for name, how in SOURCES[family]:
        if how == "regex":
            try:
                import regex  # noqa: F401
            except ImportError:
                continue
        out.append(make_runner(load(name), how))
    return out


# ------------------------------------------------------------------------------------------
# the enumeration
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Witness:
    """A probe that breaks a pair: the runner, the texts, and which condition failed."""

    runner: str
    u: str
    x: str
    y: str
    v: str
    why: str
    phase: int = 0

    def __str__(self) -> str:
        return f"{self.u + self.x!r}|{self.y + self.v!r}: {self.why} ({self.runner})"


_STANDALONE = "text[:q] alone splits differently"


def check_probe(r: Runner, u: str, x: str, y: str, v: str, standalone: bool = False) -> str | None:
    """None when q = len(u)+1 splits u+x+y+v as the definition requires, else why not.

    `standalone`: also require the pieces of u+x alone to be those left of q (what cutting a
    text into chunks at q needs, `Family.chunk_stable`); a failure of that alone is `_STANDALONE`.
    """
    q = len(u) + 1
    full = r.mask(u + x + y + v)
    if not (full >> q) & 1:
        return "not a boundary"
    if full >> q != r.cached(y + v):
        return "right pieces differ"
    if full & ((1 << (q + 1)) - 1) != r.cached(u + x + y):
        return "left pieces differ"
    if standalone and full & ((1 << q) - 1) != r.cached(u + x):
        return _STANDALONE
    return None


def _contexts(kinds: tuple[Kind, ...], left: int, right: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    n = range(len(kinds))
    for lu in itertools.product(n, repeat=left):
        for lv in itertools.product(n, repeat=right):
            yield lu, lv


def _probes(table: KindTable, a: Kind, b: Kind, phase2: int | None, phase3: int | None, rng: random.Random):
    """Probe texts (u, x, y, v) for the fine pair (a, b), phase by phase."""
    kinds = table.kinds
    reps = [k.reps for k in kinds]

    def pick(ks: tuple[int, ...]) -> str:
        return "".join(rng.choice(reps[k]) for k in ks)

    # phase 0: every representative pair, alone and in a random one-kind context each side
    for x in a.reps:
        for y in b.reps:
            yield 0, "", x, y, ""
            yield 0, pick((rng.randrange(len(kinds)),)), x, y, pick((rng.randrange(len(kinds)),))
    # phase 1: every context of at most one kind a side, or two kinds on one side only
    for left, right in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 2)]:
        for lu, lv in _contexts(kinds, left, right):
            yield 1, pick(lu), rng.choice(a.reps), rng.choice(b.reps), pick(lv)
    # phase 2: two kinds on one side and one on the other; phase 3: two on each side
    for phase, shapes, limit in ((2, [(2, 1), (1, 2)], phase2), (3, [(2, 2)], phase3)):
        if limit is None:
            for left, right in shapes:
                for lu, lv in _contexts(kinds, left, right):
                    yield phase, pick(lu), rng.choice(a.reps), rng.choice(b.reps), pick(lv)
        else:
            for _ in range(limit):
                left, right = rng.choice(shapes)
                lu = tuple(rng.randrange(len(kinds)) for _ in range(left))
                lv = tuple(rng.randrange(len(kinds)) for _ in range(right))
                yield phase, pick(lu), rng.choice(a.reps), rng.choice(b.reps), pick(lv)


@dataclass
class Derivation:
    """What `derive` found for one family."""

    family: str
    table: KindTable
    fine: dict[tuple[str, str], Witness | None]  # fine pair -> None (stable) or a witness
    runners: list[str]
    probes: int = 0
    seconds: float = 0.0
    #: Stable fine pairs whose left side tokenized alone splits differently (phases 0-1), with a
    #: witness: `Family.chunk_stable` must exclude them (it excludes every x in W).
    not_standalone: dict[tuple[str, str], Witness] = field(default_factory=dict)

    @property
    def matrix(self) -> np.ndarray:
        """bool[g, g]: group pair stable iff every fine pair inside it is."""
        g = self.table.groups
        out = np.ones((len(g), len(g)), dtype=bool)
        for (a, b), w in self.fine.items():
            if w is not None:
                out[g.index(self.table.kind(a).group), g.index(self.table.kind(b).group)] = False
        return out

    def stable_fine(self) -> list[tuple[str, str]]:
        return [p for p, w in self.fine.items() if w is None]

    def lost_to_grouping(self) -> list[tuple[str, str]]:
        """Stable fine pairs whose group pair is not certified (another fine pair in it is not)."""
        g, m = self.table.groups, self.matrix
        return [(a, b) for a, b in self.stable_fine()
                if not m[g.index(self.table.kind(a).group), g.index(self.table.kind(b).group)]]


def derive(family: str, table: KindTable, rs: list[Runner], *, mode: str = "default", seed: int = 0,
           pairs=None) -> Derivation:
    """Decide every fine kind pair of `table` against every runner (see the module docstring)."""
    check_representatives(table, rs)
    t0 = time.perf_counter()
    fine: dict[tuple[str, str], Witness | None] = {}
    not_standalone: dict[tuple[str, str], Witness] = {}
    n = 0
    for a in table.kinds:
        for b in table.kinds:
            if pairs is not None and (a.name, b.name) not in pairs:
                continue
            rng = random.Random(f"{seed}:{family}:{a.name}:{b.name}")
            found = alone = None
            for phase, u, x, y, v in _probes(table, a, b, *MODES[mode], rng):
                n += 1
                for r in rs:
                    why = check_probe(r, u, x, y, v, standalone=alone is None and phase <= 1)
                    if why == _STANDALONE:
                        alone = Witness(r.label, u, x, y, v, why, phase)
                    elif why:
                        found = Witness(r.label, u, x, y, v, why, phase)
                        break
                if found:
                    break
            fine[(a.name, b.name)] = found
            if found is None and alone is not None:
                not_standalone[(a.name, b.name)] = alone
    return Derivation(family, table, fine, [r.label for r in rs], n, time.perf_counter() - t0, not_standalone)


def check_representatives(table: KindTable, rs: list[Runner]) -> None:
    """Every representative lies in its kind's group by the engine's own class table."""
    for r in rs:
        fam: Family = r.tok.family_info
        for k in table.kinds:
            for ch in k.reps:
                bits = int(r.tok.classes[ord(ch)]) & ~(0 if fam.exclude_k_pairs else K)
                g = table.group_of(bits, ord(ch))
                assert g == k.group, f"{r.tok.name}: representative {ch!r} of kind {k.name} is in group {g}"


def partition_failures(table: KindTable, r: Runner, n_texts: int = 200, length: int = 8,
                       seed: int = 0) -> list[tuple[str, str]]:
    """Texts where swapping one representative for another of the same fine kind moves a
    piece boundary (an unsound partition): [(text, swapped text)]."""
    rng = random.Random(f"partition:{seed}")
    bad = []
    kinds = table.kinds
    for _ in range(n_texts):
        ks = [rng.randrange(len(kinds)) for _ in range(length)]
        chars = [rng.choice(kinds[k].reps) for k in ks]
        text = "".join(chars)
        base = r.mask(text)
        for i, k in enumerate(ks):
            for alt in kinds[k].reps:
                if alt != chars[i]:
                    other = text[:i] + alt + text[i + 1 :]
                    if r.mask(other) != base:
                        bad.append((text, other))
    return bad


# ------------------------------------------------------------------------------------------
# the historical predicate (rules A-F), for the before/after comparison
# ------------------------------------------------------------------------------------------

def rules_a_f(fam: Family, classes: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The hand-picked rules A-F the derived grids replaced (kept to show the grids are a superset)."""
    from ..charclass import HOST_I as I, K, L, M, N, W

    cx, cy = classes[x], classes[y]
    y_r = (y == 0x0A) | (y == 0x0D)
    rule_a = ((cx & W) == 0) & ((cy & W) != 0) & ~y_r
    rule_b = ((cx & L) != 0) & ((cy & (L | N | M | W)) == 0) & (y != 0x27)
    if fam.exclude_k_pairs:
        rule_b &= ~(((cx & K) != 0) & ((cy & K) != 0))
    rule_cd = ((cx & N) != 0) != ((cy & N) != 0)
    rule_e = ((cx & L) != 0) & y_r
    rule_f = ((x == 0x0A) | (x == 0x0D)) & ((cy & W) == 0)
    if fam.slash_after_newline:
        rule_f &= y != 0x2F
    ok = rule_a | rule_b | rule_cd | rule_e | rule_f
    if fam.nfc:
        ok &= ((cx & I) != 0) & ((cy & I) != 0)
    return ok


def fine_rep_pairs(table: KindTable, a: str, b: str) -> tuple[np.ndarray, np.ndarray]:
    """Every (x, y) representative pair of fine kinds a, b as code point arrays."""
    xs, ys = zip(*itertools.product(table.kind(a).reps, table.kind(b).reps))
    return np.array(list(map(ord, xs)), dtype=np.uint32), np.array(list(map(ord, ys)), dtype=np.uint32)


# ------------------------------------------------------------------------------------------
# rendering, and the family modules' derived blocks
# ------------------------------------------------------------------------------------------

_BEGIN = "    .. derived stable-pair table (python -m toktier.families.derive --write)\n"
_END = "    .. end derived table\n"
_GRID_RE = re.compile(r'(STABLE_GRID = """\n)(.*?)(""")', re.S)


def render_block(d: Derivation) -> str:
    """The docstring block: kinds, the group grid, and the stable fine pairs grouping hides."""
    t = d.table
    out = [_BEGIN, "\n", "    Kinds (group, fine kind, code points; the representatives are in ``KINDS``):\n", "\n"]
    w = max(map(len, t.groups))
    v = max(len(k.name) for k in t.kinds)
    for g in t.groups:
        out += [f"    {g:<{w}}  {k.name:<{v}}  {k.what}\n" for k in t.kinds if k.group == g]
    out += ["\n", "    Stable pairs (row: x group, column: y group; + = certified):\n", "\n",
            format_grid(d.matrix, t.groups, indent="    ")]
    lost = d.lost_to_grouping()
    if lost:
        text = ("Stable at the fine level but not certified (their group pair holds an unstable fine "
                "pair; the predicate's groups do not tell the fine kinds apart): "
                + ", ".join(f"{a}->{b}" for a, b in lost) + ".")
        out += ["\n", textwrap.fill(text, width=92, initial_indent="    ", subsequent_indent="    ") + "\n"]
    out += ["\n", _END]
    return "".join(out)


def grid_of(d: Derivation) -> str:
    return format_grid(d.matrix, d.table.groups, indent="")


def module_path(family: str) -> Path:
    return Path(__file__).with_name(f"{family}.py")


def docstring_block(doc: str) -> str | None:
    """The derived block of a family module's docstring, or None."""
    i, j = doc.find(_BEGIN), doc.find(_END)
    return doc[i : j + len(_END)] if i >= 0 and j > i else None


def write_module(d: Derivation) -> bool:
    """Rewrite the family module's derived docstring block and `STABLE_GRID`; True if changed."""
    path = module_path(d.family)
    src = path.read_text(encoding="utf-8")
    old_block = docstring_block(src)
    assert old_block is not None, f"{path}: no derived block markers"
    new = src.replace(old_block, render_block(d))
    new = _GRID_RE.sub(lambda m: m.group(1) + grid_of(d) + m.group(3), new, count=1)
    if new != src:
        path.write_text(new, encoding="utf-8")
        return True
    return False


def derive_family(family: str, *, mode: str = "default", seed: int = 0, load=None) -> Derivation:
    from . import FAMILIES

    table = FAMILIES[family].kinds
    return derive(family, table, runners(family, load), mode=mode, seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toktier.families.derive", description=__doc__.split("\n\n")[0])
    p.add_argument("families", nargs="*", default=list(SOURCES))
    p.add_argument("--mode", choices=list(MODES), default="default",
                   help="context budget: quick (the tests'), default, full (every 2+2 context; minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", action="store_true", help="rewrite the family modules' derived tables")
    p.add_argument("--fine", action="store_true", help="also list every fine pair with its witness")
    args = p.parse_args(argv)
    from . import FAMILIES

    rc = 0
    for fam in args.families:
        d = derive_family(fam, mode=args.mode, seed=args.seed)
        print(f"== {fam}: {d.probes:,} probes in {d.seconds:.1f} s against {'; '.join(d.runners)}")
        print(render_block(d))
        spec = FAMILIES[fam]
        try:
            current = parse_grid(spec.stable_grid, spec.kinds.groups)
        except AssertionError:
            current = None
        if current is None or not np.array_equal(current, d.matrix):
            print(f"   !! {fam}: the module's STABLE_GRID differs from this derivation")
            rc = 1
        if args.fine:
            for (a, b), w in d.fine.items():
                print(f"   {a:>3} -> {b:<3} {'stable' if w is None else w}")
        if args.write and write_module(d):
            print(f"   wrote {module_path(fam)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
