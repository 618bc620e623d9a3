"""Crafted-tokenizer campaign: exact on every file the engines load, or a typed refusal.

Every variant in `crafted.VARIANTS` (added-token id gaps, duplicates of vocab words,
reordered lists, id overrides, unk, lstrip/rstrip/single_word/normalized flags,
overlapping literals, regex variants, NFC/NFKC, GPT-2 ByteLevel, Metaspace BPE,
WordPiece; tiktoken rank files with colliding/overlapping specials) is loaded in
both specials modes and driven through seeded sessions of appends, edits and syncs
that aim at its literals.  Every op's IDs are compared with a reference built
directly from the file (HF `Tokenizer.from_file` / tiktoken's own rank-file loader),
and only `TokTierError`s may escape.  The mutation check swaps in a table built from
the file's declared ids and requires the same campaign to catch it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import random
import unicodedata
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toktier
import toktier.engines
from toktier.tools.corpus import ADVERSARIAL_ATOMS, samples
from toktier.errors import TokTierError, UnsupportedTokenizer

from crafted import VARIANTS, Variant, declared_id_table

OPS_PER_SESSION = 36
SESSIONS = 2


@pytest.fixture(scope="module")
def material() -> list[str]:
    return [s.text[:1500] for s in samples(1500, seed=3)]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, dict]:
    """Variant files, written once per run (both modes load the same file)."""
    cache: dict[str, dict] = {}

    def get(v: Variant) -> dict:
        if v.name not in cache:
            cache[v.name] = v.build(tmp_path_factory.mktemp(v.name))
        return cache[v.name]
    return get  # type: ignore[return-value]


def reference(kwargs: dict, mode: str):
    """The reference encoder, built straight from the file with the engine's own loader."""
    path = kwargs["name_or_path"]
    if "pat_str" in kwargs:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        enc = tiktoken.Encoding(name="crafted-ref", pat_str=kwargs["pat_str"],
                                mergeable_ranks=load_tiktoken_bpe(str(path)), special_tokens=kwargs["special_tokens"])
        if mode == "all":
            return lambda text: np.asarray(enc.encode(text, allowed_special="all"), dtype=np.uint32)
        return lambda text: np.asarray(enc.encode_ordinary(text), dtype=np.uint32)
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(path))
    ref.no_truncation()
    ref.no_padding()
    ref.encode_special_tokens = mode == "none"
    return lambda text: np.asarray(ref.encode(text, add_special_tokens=False).ids, dtype=np.uint32)


def _pieces(rng: random.Random, material: list[str], literals: tuple[str, ...], atoms: bool = True) -> str:
    """A piece of session text aimed at the variant: literals, their fragments, lookalikes, real text."""
    u = rng.random()
    if literals and u < 0.35:
        lit = rng.choice(literals)
        if len(lit) > 1 and rng.random() < 0.3:  # a fragment: the rest may come with a later op
            k = rng.randrange(1, len(lit))
            return lit[:k] if rng.random() < 0.5 else lit[k:]
        return lit
    if atoms and u < 0.55:
        return "".join(rng.choice(ADVERSARIAL_ATOMS) for _ in range(rng.randrange(1, 6)))
    doc = rng.choice(material)
    a = rng.randrange(max(1, len(doc) - 1))
    return doc[a : a + rng.choice((1, 3, 12, 40, 160, 600))]


@dataclasses.dataclass
class Outcome:
    checks: int = 0
    divergences: list = dataclasses.field(default_factory=list)
    untyped: list = dataclasses.field(default_factory=list)
    paths: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def spliced(self) -> int:
        return self.paths["first_window"] + self.paths["widened"]


def campaign(tok, ref, material: list[str], literals: tuple[str, ...], seed: int, atoms: bool = True) -> Outcome:
    """Seeded sessions of appends / edits / syncs; every op checked against `ref`."""
    out = Outcome()
    rng = random.Random(seed)
    for _ in range(SESSIONS):
        start = "".join(_pieces(rng, material, literals, atoms) for _ in range(30))
        try:
            s = toktier.Session(tok, start)
            for _op in range(OPS_PER_SESSION):
                n = s.num_chars
                u = rng.random()
                piece = _pieces(rng, material, literals, atoms)
                if u < 0.5:
                    r = s.append(piece)
                elif u < 0.8:
                    a = rng.randrange(n + 1)
                    b = min(n, a + rng.choice((0, 0, 1, 2, 5, 30)))
                    r = s.edit(a, b, piece if rng.random() < 0.8 else "")
                else:
                    text = s.text
                    a = rng.randrange(n + 1)
                    r = s.sync(text[:a] + piece + text[a + rng.choice((0, 1, 4)):])
                out.paths[r.path.value] += 1
                out.checks += 1
                want = ref(s.text)
                if not np.array_equal(r.ids, want):
                    out.divergences.append((s.text[-200:], r.path.value, r.reason))
                    break
        except TokTierError:
            raise  # a typed error on a loadable file is still a failure here: the reference answered
        except Exception as exc:  # noqa: BLE001 -- exactly what must never escape
            out.untyped.append(repr(exc))
    return out


def check_variant(variant: Variant, kwargs: dict, material: list[str]) -> tuple[list[str], collections.Counter]:
    """Everything the campaign demands of one variant in both modes: (failures, counts)."""
    failures: list[str] = []
    counts: collections.Counter = collections.Counter()
    # Real text with the variant's spellings removed: sessions whose splices nothing may stop.
    # (NFC-normalized: one non-NFC character turns an NFC family's session to the full path.)
    clean = [functools.reduce(lambda t, lit: t.replace(lit, "") if lit.strip() else t, variant.literals,
                              unicodedata.normalize("NFC", doc)) for doc in material]
    for mode in ("all", "none"):
        expect = variant.expected(mode)
        label = f"{variant.name}/{mode}"
        if expect == "refuse":
            try:
                toktier.load_tokenizer(specials=mode, **kwargs)
                failures.append(f"{label}: loaded; expected UnsupportedTokenizer")
            except UnsupportedTokenizer as exc:
                if str(kwargs["name_or_path"]) not in str(exc):
                    failures.append(f"{label}: refusal does not name the file: {exc}")
                counts["refused"] += 1
            continue
        try:
            tok = toktier.load_tokenizer(specials=mode, **kwargs)
        except TokTierError as exc:
            failures.append(f"{label}: refused a file the engine loads: {exc!r}")
            continue
        explained = tok.explain()
        if ("splicing enabled" in explained) != tok.spliceable:
            failures.append(f"{label}: explain() contradicts spliceable: {explained}")
        if (expect == "splice") != tok.spliceable:
            failures.append(f"{label}: expected {expect}: {explained}")
            continue
        if not tok.spliceable and (not tok.family_reason or tok.family_reason not in explained):
            failures.append(f"{label}: no reason given: {explained}")
        ref = reference(kwargs, mode)
        seed = zlib.crc32(label.encode())
        out = campaign(tok, ref, material, variant.literals, seed=seed)
        plain = campaign(tok, ref, clean, (), seed=seed + 1, atoms=False)
        for o in (out, plain):
            if o.untyped:
                failures.append(f"{label}: untyped exceptions {o.untyped[:3]}")
            if o.divergences:
                failures.append(f"{label}: diverged {o.divergences[:1]}")
        if expect == "splice":
            if plain.spliced <= plain.checks // 4:
                failures.append(f"{label}: {plain.spliced} of {plain.checks} plain ops spliced")
            # An ambiguous id or a non-NFC character in the text may rightly stop splices.
            if not variant.text_may_stop_splices and out.spliced <= out.checks // 4:
                failures.append(f"{label}: {out.spliced} of {out.checks} ops spliced")
        elif out.spliced or plain.spliced:
            failures.append(f"{label}: spliced although not spliceable")
        counts["variant-modes"] += 1
        counts["ops"] += out.checks + plain.checks
        counts["spliced"] += out.spliced + plain.spliced
        counts[f"family:{tok.family or 'none'}"] += out.checks + plain.checks
    return failures, counts


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_crafted_variant(variant: Variant, built, material, tally):
    failures, counts = check_variant(variant, built(variant), material)
    assert not failures, "\n".join(failures)
    # Printed with the run's differential-check table: the campaign's size, run by run.
    for key in ("variant-modes", "refused", "ops", "spliced"):
        tally.labelled("crafted", key, counts[key])
    for key, n in counts.items():
        if key.startswith("family:"):
            tally.labelled(key.removeprefix("family:"), "crafted", n)


MUTATION_VARIANTS = [v for v in VARIANTS if v.declared_ids_differ and v.kind == "hf"]


@pytest.mark.parametrize("variant", MUTATION_VARIANTS, ids=[v.name for v in MUTATION_VARIANTS])
def test_declared_id_table_fails_the_campaign(variant: Variant, built, material, monkeypatch):
    """Mutation check: with the table built from the file's declared ids, the campaign fails."""
    kwargs = built(variant)
    monkeypatch.setattr(toktier.engines, "hf_table", lambda *a, **k: declared_id_table(kwargs["name_or_path"]))
    failures, _ = check_variant(dataclasses.replace(variant, expect_none=""), kwargs, material)
    assert failures, f"{variant.name}: a declared-id table passed the campaign"


VERIFY_VARIANTS = ("gap-id", "byte-char-plain", "dup-vocab-id", "overlapping-literals", "qwen3-gap-and-latin1",
                   "nfc-normalizer", "unk-missing-byte", "lstrip", "metaspace-bpe", "wordpiece")


@pytest.mark.parametrize("name", VERIFY_VARIANTS)
def test_verify_on_crafted_files(name, built, tmp_path):
    """`toktier verify` on crafted files: clean exit, no untyped exception, no divergence."""
    from toktier.tools import verify

    variant = next(v for v in VARIANTS if v.name == name)
    path = built(variant)["name_or_path"]
    js = tmp_path / "summary.json"
    rc = verify.main(["--tokenizer", str(path), "--adversarial", "40", "--levels", "pieces,ids-full,ids-repair",
                      "--out", str(tmp_path / "o"), "--no-progress", "--suffix-samples", "1", "--json-summary",
                      str(js), "--shrink-seconds", "2", "--repair-ops", "8"])
    rows = {r["level"]: r for r in json.loads(js.read_text())["rows"]}
    assert rc == 0 and not any(r["divergences"] for r in rows.values()), rows
    assert rows["ids-full"]["checks"] >= 40 and rows["ids-repair"]["checks"] >= 40, rows


@pytest.mark.parametrize("name", [v.name for v in VARIANTS if v.kind == "tiktoken" and v.expect != "refuse"])
def test_verify_checks_on_crafted_rank_files(name, built, material):
    """The verify campaign's piece and replay checks (what `toktier verify` runs) on crafted rank files."""
    import random as _random

    from toktier.tools import verify

    variant = next(v for v in VARIANTS if v.name == name)
    kwargs = built(variant)
    tok = toktier.load_tokenizer(**kwargs)
    rng = _random.Random(5)
    for k in range(6):
        text = "".join(_pieces(rng, material, variant.literals) for _ in range(40))
        if tok.spliceable:
            missing, bad = verify.pieces_failures(tok, text)
            assert not len(missing) and not bad, (name, text)
        done, bad_op, detail = verify.replay_ops(tok, verify.repair_ops(rng, text, 10), 64)
        assert bad_op is None, (name, detail)


GPU_VARIANTS = ("gap-id", "vocab-word-special", "byte-char-plain", "latin1-char", "reversed-list", "id-override",
                "overlapping-literals", "prefix-literals", "dup-vocab-id", "qwen3-gap-and-latin1", "deepseek-reversed",
                "tt-special-collides-rank", "tt-overlapping-specials", "tt-shared-id", "tt-special-is-text")


@pytest.mark.parametrize("name", GPU_VARIANTS)
def test_gpu_host_model_on_crafted_files(name, built, material, monkeypatch):
    """The GPU path's host models either reproduce the reference on a crafted file or decline it,
    and a declined file is one they would get wrong (the gate is not vacuous)."""
    from toktier.gpu import bpe_model, tables

    variant = next(v for v in VARIANTS if v.name == name)
    tok = toktier.load_tokenizer(**built(variant))
    ref = reference(built(variant), "all")
    rng = random.Random(zlib.crc32(name.encode()))

    def texts(n: int):
        for _ in range(n):
            text = "".join(_pieces(rng, material, variant.literals) for _ in range(30))
            # The router sends NFC families NFC-stable text only.
            yield tok.engine.normalize(text) if tok.family_info.nfc else text

    gap = tables.model_gap(tok)
    if gap is None:
        assert tables.rules_for(tok) is not None
        for text in texts(12):
            assert np.array_equal(bpe_model.encode(tok, text), ref(text)), name
        return
    assert tables.rules_for(tok) is None, f"{name}: {gap}, yet the GPU model would take it"
    monkeypatch.setattr(tables, "model_gap", lambda tok: None)
    assert any(not np.array_equal(bpe_model.encode(tok, t), ref(t)) for t in texts(60)), f"{name}: gate vacuous"


_LOADED_CRAFTED: dict[str, tuple] = {}
HYPOTHESIS_VARIANTS = ("byte-char-plain", "latin1-char", "overlapping-literals", "dup-vocab-id",
                       "tt-special-collides-rank", "tt-overlapping-specials")


@pytest.mark.parametrize("name", HYPOTHESIS_VARIANTS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_sessions_on_crafted_files_property(name, built, data, tally):
    """Hypothesis: any ops over the variant's spellings, literal fragments and adversarial atoms stay exact."""
    if name not in _LOADED_CRAFTED:
        variant = next(v for v in VARIANTS if v.name == name)
        kwargs = built(variant)
        _LOADED_CRAFTED[name] = (variant, toktier.load_tokenizer(**kwargs), reference(kwargs, "all"))
    variant, tok, ref = _LOADED_CRAFTED[name]
    frags = [lit[:k] for lit in variant.literals for k in range(1, len(lit))] + [
        lit[k:] for lit in variant.literals for k in range(1, len(lit))]
    atom = st.sampled_from(list(variant.literals) + frags + list(ADVERSARIAL_ATOMS) + ["word ", " the", "\n"])
    text = st.lists(atom, max_size=12).map("".join)
    s = toktier.Session(tok, data.draw(st.lists(atom, min_size=20, max_size=120).map("".join)), window=64)
    for _ in range(data.draw(st.integers(1, 8))):
        n = s.num_chars
        a = data.draw(st.integers(0, n))
        b = data.draw(st.integers(a, min(n, a + 8)))
        if data.draw(st.booleans()):
            s.append(data.draw(text))
        else:
            s.edit(a, b, data.draw(text))
        assert np.array_equal(s.ids, ref(s.text)), (name, s.text)
        tally(tok, "crafted", 1)
