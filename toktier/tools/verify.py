"""`toktier verify`: differential campaigns against the reference tokenizers.

Levels (``--levels``, comma-separated):

``pieces``
    Every position the family certifies (`boundaries.stable_char_positions`) must
    be a boundary of the reference pre-tokenizer's pieces (HF: the engine's own
    ``pre_tokenize``; tiktoken has no piece API, so there the reference token
    starts are used: BPE never merges across pieces).  One check per certified
    position.  On a sample of positions per text (``--suffix-samples``) the
    stronger splice property is checked too (level ``pieces-suffix``): the
    pieces (tiktoken: IDs) right of q are those of text[q:] alone, and the ones
    left of q do not depend on text past q + 1.  NFC families are checked on the
    normalized text (piece offsets refer to it).
``ids-full``
    `fullpath.encode_full` (texts cut at standalone-stable positions, chunks
    batch-encoded) against one reference encode, with small chunk sizes so every
    segment is cut, and with the default configuration on whole documents.
``ids-repair``
    A seeded replay of appends, mid-text edits, deletions and syncs with
    `toktier.Session`; after every op the session's IDs must equal the
    reference encoding of its text.
``host``
    The GPU path's numpy host models (`toktier.gpu.pieces` / `toktier.gpu.encode`)
    against the reference: IDs per text (``host-ids``) and, for HF engines on
    texts without added-token literals, every piece start (``host-pieces``).
    Runs anywhere; skipped when `toktier.gpu` or the family's model is missing.
``gpu``
    The GPU full path against the reference, when `toktier.gpu` exists and
    reports a usable device; skipped with a message otherwise.

Corpus: ``--corpus PATH...`` (files; directories, recursively; ``.jsonl`` files
with ``--text-field``), the built-in real corpus (`toktier.tools.corpus.samples`, the
default; ``--builtin-seeds`` adds reseeded generated samples), ``--large-chars``
(`corpus.large_text` documents) and ``--adversarial N`` generated texts.  Documents
are split into ``--segment-chars`` texts.  Work units are (tokenizer, level,
document): ``--jobs`` spawns worker processes (each loads its own tokenizers),
``--chunk I/N`` runs the I-th of N strided slices (1-based), ``--state FILE``
records completed units (JSON lines) so an interrupted campaign resumes.

A divergence is shrunk (delta debugging: drop chunks, then characters, while it
still diverges) and written as a JSON reproducer to ``--out``; the exit status is
1 when any divergence was found, 0 otherwise.  ``--inject-faults RATE`` corrupts
a fraction of ID-level results and ``--mutate-predicate`` widens the stable-
boundary predicate: both must make a campaign fail (self-tests of the tool).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .corpus import ADVERSARIAL_ATOMS

LEVELS = ("pieces", "ids-full", "ids-repair", "host", "gpu")
DEFAULT_LEVELS = ("pieces", "ids-full", "ids-repair")
MUTATIONS = ("punct-letter", "space-letter", "letter-apostrophe", "any")

# Continuation appended past q+1 for the left-side independence check.
_LEFT_SUFFIX = "Zq 9\n"
# Chunk sizes for the ids-full level: small enough that every segment is cut.
_FULL_CHUNKS = (512, 4096)
_ADVERSARIAL_PER_UNIT = 500
_REPAIR_SIZES = (1, 2, 5, 40, 300, 1400)

ATOMS = ADVERSARIAL_ATOMS  # the adversarial generator's alphabet (see toktier.tools.corpus)


# ------------------------------------------------------------------------------------------
# documents and work units
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Doc:
    """A lazily loaded piece of corpus: what a worker needs to rebuild its texts."""

    kind: str  # "sample" | "large" | "file" | "jsonl" | "adversarial"
    name: str
    args: tuple = ()

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}:{':'.join(map(str, self.args))}"


@dataclass(frozen=True)
class Unit:
    tokenizer: str
    level: str
    doc: Doc

    @property
    def key(self) -> str:
        return f"{self.tokenizer}|{self.level}|{self.doc.key}"


@dataclass(frozen=True)
class Options:
    """Everything a worker needs (picklable; passed to each spawned worker)."""

    segment_chars: int = 16_384
    suffix_samples: int = 2
    repair_ops: int = 12
    seed: int = 0
    text_field: str = "text"
    inject_faults: float = 0.0
    mutate_predicate: str | None = None
    shrink_seconds: float = 30.0
    max_reproducers_per_unit: int = 1


@dataclass
class UnitResult:
    key: str
    tokenizer: str
    level: str
    doc: str = ""
    family: str | None = None
    checks: dict[str, int] = field(default_factory=dict)  # level label -> count
    divergences: list[dict] = field(default_factory=list)
    n_divergent: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    chars: int = 0
    skipped: str | None = None


def _memo(fn):
    cache: dict = {}

    def wrapper(*args):
        if args not in cache:
            if len(cache) > 4:
                cache.clear()
            cache[args] = fn(*args)
        return cache[args]

    return wrapper


@_memo
def _builtin_samples(seed: int) -> dict[str, str]:
    from .corpus import ADVERSARIAL_ATOMS, samples

    return {s.name: s.text for s in samples(seed=seed)}


def adversarial_texts(seed: int, n: int) -> list[str]:
    """`n` seeded adversarial texts of 0-80 atoms (some repeated runs of one atom)."""
    rng = random.Random(f"adversarial:{seed}")
    out = []
    for _ in range(n):
        k = rng.choice((1, 2, 3, 5, 8, 13, 21, 40, 80))
        if rng.random() < 0.15:
            atom = rng.choice(ATOMS)
            out.append(atom * k)
        else:
            out.append("".join(rng.choice(ATOMS) for _ in range(k)))
    return out


def _segments(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] if text else []


def load_texts(doc: Doc, opts: Options) -> tuple[list[str], str | None]:
    """(segment texts, whole document or None when it is a set of short texts)."""
    if doc.kind == "sample":
        text = _builtin_samples(int(doc.args[0]))[doc.name]
    elif doc.kind == "large":
        from .corpus import large_text

        kind, n, seed = doc.args
        text = large_text(int(n), seed=int(seed), kind=kind)
    elif doc.kind == "file":
        with open(doc.name, encoding="utf-8", errors="replace", newline="") as f:
            text = f.read()
    elif doc.kind == "jsonl":
        start, count = int(doc.args[0]), int(doc.args[1])
        texts = []
        with open(doc.name, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f):
                if i < start or not line.strip():
                    continue
                if i >= start + count:
                    break
                value = json.loads(line).get(opts.text_field)
                if isinstance(value, str) and value:
                    texts.extend(_segments(value, opts.segment_chars))
        return texts, None
    elif doc.kind == "adversarial":
        return adversarial_texts(int(doc.args[0]), int(doc.args[1])), None
    else:
        raise ValueError(f"unknown document kind {doc.kind!r}")
    return _segments(text, opts.segment_chars), text


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def collect_docs(args: argparse.Namespace) -> list[Doc]:
    docs: list[Doc] = []
    for raw in args.corpus or []:
        p = Path(raw)
        files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        if not p.exists():
            raise SystemExit(f"toktier verify: corpus path {raw} does not exist")
        for f in files:
            if f.suffix == ".jsonl":
                with open(f, encoding="utf-8", errors="replace") as fh:
                    n = sum(1 for _ in fh)
                for start in range(0, n, args.jsonl_records):
                    docs.append(Doc("jsonl", str(f), (start, args.jsonl_records)))
            elif not _is_binary(f):
                docs.append(Doc("file", str(f)))
    builtin = args.builtin if args.builtin is not None else not (args.corpus or args.adversarial or args.large_chars)
    if builtin:
        from .corpus import samples

        for seed in _seed_range(args.builtin_seeds):
            for s in samples(seed=seed):
                docs.append(Doc("sample", s.name, (seed,)))
    if args.large_chars:
        from .corpus import LARGE_KINDS

        for seed in _seed_range(args.large_seeds):
            for kind in LARGE_KINDS:
                docs.append(Doc("large", kind, (kind, args.large_chars, seed)))
    if args.adversarial:
        n_units = -(-args.adversarial // _ADVERSARIAL_PER_UNIT)
        for i in range(n_units):
            n = min(_ADVERSARIAL_PER_UNIT, args.adversarial - i * _ADVERSARIAL_PER_UNIT)
            docs.append(Doc("adversarial", f"gen{i}", (args.seed * 1_000_003 + i, n)))
    return docs


def _seed_range(spec: str) -> range:
    if ":" in spec:
        a, b = spec.split(":")
        return range(int(a), int(b))
    return range(int(spec), int(spec) + 1)


# ------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------

_TOKENIZERS: dict[str, object] = {}
_OPTS = Options()


def _init_worker(opts: Options) -> Callable[[], None]:
    """Set the worker's options; returns an undo for the in-process case."""
    global _OPTS
    _OPTS = opts
    if opts.mutate_predicate:
        return mutate_predicate(opts.mutate_predicate)
    return lambda: None


def mutate_predicate(kind: str) -> Callable[[], None]:
    """Widen `Family.stable` by one crossable pair class (self-test of the pieces level).

    Returns a function that restores the original predicate.
    """
    from toktier import families as F

    extra: Callable = {
        "punct-letter": lambda c, x, y: ((c[x] & (F.L | F.N | F.W)) == 0) & ((c[y] & F.L) != 0),
        "space-letter": lambda c, x, y: ((c[x] & F.W) != 0) & ((c[y] & F.L) != 0),
        "letter-apostrophe": lambda c, x, y: ((c[x] & F.L) != 0) & (y == 0x27),
        "any": lambda c, x, y: np.ones(len(x), bool),
    }[kind]
    original = F.Family.stable

    def widened(self, classes, x, y):
        return original(self, classes, x, y) | extra(classes, x, y)

    F.Family.stable = widened  # type: ignore[method-assign]

    def undo() -> None:
        F.Family.stable = original  # type: ignore[method-assign]

    return undo


def _tokenizer(name: str):
    tok = _TOKENIZERS.get(name)
    if tok is None:
        from toktier.registry import load_tokenizer

        tok = _TOKENIZERS[name] = load_tokenizer(name)
    return tok


def _unknown_tokenizers(names: list[str]) -> list[str]:
    """Names that are neither bundled nor an existing file, checked before any work starts.

    Units swallow load errors (missing data is a skip, not a failure), so a typo would
    otherwise yield a green "no divergences in 0 checks" campaign that checked nothing.
    """
    from toktier.registry import list_tokenizers

    known = set(list_tokenizers())
    return [n for n in names if n not in known and not Path(n).is_file()]


def run_unit(unit: Unit, opts: Options | None = None) -> UnitResult:
    """Run one work unit (in a worker process, or in-process with --jobs 1)."""
    opts = opts or _OPTS
    t0 = time.perf_counter()
    res = UnitResult(unit.key, unit.tokenizer, unit.level, doc=unit.doc.key)
    try:
        tok = _tokenizer(unit.tokenizer)
    except Exception as exc:  # missing data is reported, never fatal for the campaign
        res.skipped = f"{type(exc).__name__}: {exc}"
        return res
    res.family = tok.family or "-"
    texts, whole = load_texts(unit.doc, opts)
    res.chars = sum(map(len, texts))
    rng = random.Random(f"{opts.seed}:{unit.key}")
    checker = _LEVEL_RUNNERS[unit.level]
    checker(tok, texts, whole, rng, opts, res)
    res.seconds = time.perf_counter() - t0
    return res


def _divergence(res: UnitResult, opts: Options, label: str, record: Callable[[], dict]) -> None:
    res.n_divergent[label] = res.n_divergent.get(label, 0) + 1
    if len(res.divergences) < opts.max_reproducers_per_unit:
        res.divergences.append(record())


# -- pieces ----------------------------------------------------------------------------

def _piece_bounds(tok, text: str) -> tuple[list, np.ndarray]:
    pieces = tok.engine.pre_tokenize(text)
    return pieces, np.fromiter((a for _, (a, _b) in pieces), dtype=np.int64, count=len(pieces))


def _token_starts(tok, ids: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(tok.token_len[ids], dtype=np.int64)))[:-1]


def pieces_failures(tok, text: str, sample: np.ndarray | None = None) -> tuple[np.ndarray, list[int]]:
    """(certified positions that are not boundaries, sampled positions failing the splice check).

    `sample`: positions for the suffix/prefix check (None: all certified positions).
    """
    from toktier.boundaries import char_byte_offsets, stable_char_positions

    pos = stable_char_positions(tok, text)
    if sample is None:
        sample = pos
    bad_split: list[int] = []
    if hasattr(tok.engine, "pre_tokenize"):
        pieces, starts = _piece_bounds(tok, text)
        missing = pos[~np.isin(pos, starts)]
        for q in map(int, sample):
            right = [(p, (a - q, b - q)) for p, (a, b) in pieces if a >= q]
            left = [pc for pc in pieces if pc[1][1] <= q]
            if (tok.engine.pre_tokenize(text[q:]) != right
                    or [pc for pc in tok.engine.pre_tokenize(text[: q + 1]) if pc[1][1] <= q] != left):
                bad_split.append(q)
        return missing, bad_split
    ids = tok.encode(text)
    starts = _token_starts(tok, ids)
    _, offs = char_byte_offsets(text)
    if tok.table.has_uncertain(ids) and not tok.table.canonical_spans_ok(ids, text.encode("utf-8")):
        # Canonical lengths place tokens only up to the first one whose span is unproven.
        limit = int(starts[int(np.flatnonzero(tok.table.uncertain[ids])[0])])
        pos, sample = pos[offs[pos] <= limit], sample[offs[sample] <= limit]
    missing = pos[~np.isin(offs[pos], starts)]
    for q in map(int, sample):
        k = int(np.searchsorted(starts, offs[q]))
        if k >= len(ids) or starts[k] != offs[q]:
            bad_split.append(q)
            continue
        left = tok.encode(text[: q + 1] + _LEFT_SUFFIX)
        if not np.array_equal(ids[k:], tok.encode(text[q:])) or not np.array_equal(left[:k], ids[:k]):
            bad_split.append(q)
    return missing, bad_split


def _run_pieces(tok, texts, whole, rng, opts, res) -> None:
    from toktier.boundaries import stable_char_positions

    if tok.family_info is None:
        res.skipped = f"no family ({tok.family_reason}): no certified positions to check"
        return
    n = n_suffix = 0
    for text in texts:
        if tok.family_info.nfc:
            text = tok.engine.normalize(text)
        pos = stable_char_positions(tok, text)
        k = min(opts.suffix_samples, len(pos))
        sample = np.sort(pos[rng.sample(range(len(pos)), k)]) if k else pos[:0]
        missing, bad_split = pieces_failures(tok, text, sample)
        n += len(pos)
        n_suffix += len(sample)
        if len(missing) or bad_split:
            q = int(missing[0]) if len(missing) else bad_split[0]
            _divergence(res, opts, "pieces", lambda: _shrunk_record(
                tok, "pieces", text, _pieces_pred(tok), opts,
                detail={"position": q, "context": text[max(0, q - 12) : q + 12],
                        "not_a_boundary": len(missing), "splice_failures": len(bad_split)}))
    res.checks["pieces"] = n
    res.checks["pieces-suffix"] = n_suffix


def _pieces_pred(tok) -> Callable[[str], bool]:
    def diverges(t: str) -> bool:
        if tok.family_info.nfc:
            t = tok.engine.normalize(t)
        missing, bad = pieces_failures(tok, t, None if len(t) <= 2000 else np.zeros(0, np.int64))
        return bool(len(missing) or bad)

    return diverges


# -- ids-full ----------------------------------------------------------------------------

def _maybe_fault(tok, text, ids, rng, opts):
    if opts.inject_faults and rng.random() < opts.inject_faults and len(ids):
        from .faults import KINDS, FaultNotApplicable, corrupt

        for kind in (rng.choice(KINDS), "substitute"):
            try:
                return corrupt(tok, text, ids, kind, rng), kind
            except FaultNotApplicable:
                continue
    return ids, None


def _run_ids_full(tok, texts, whole, rng, opts, res) -> None:
    from toktier.fullpath import FullPathConfig, encode_full

    n = 0
    jobs = [(t, FullPathConfig(chunk_chars=c, min_parallel_chars=0)) for t in texts for c in _FULL_CHUNKS]
    if whole is not None and len(whole) >= FullPathConfig().min_parallel_chars:
        jobs.append((whole, FullPathConfig()))
    for text, cfg in jobs:
        got, fault = _maybe_fault(tok, text, encode_full(tok, text, cfg), rng, opts)
        ref = tok.encode(text)
        n += 1
        if not np.array_equal(got, ref):
            def pred(t: str, cfg=cfg, fault=fault) -> bool:
                g = encode_full(tok, t, cfg)
                if fault:  # an injected fault reproduces on any non-empty text
                    return len(g) > 0
                return not np.array_equal(g, tok.encode(t))

            _divergence(res, opts, "ids-full", lambda: _shrunk_record(
                tok, "ids-full", text, pred, opts,
                detail={"chunk_chars": cfg.chunk_chars, "min_parallel_chars": cfg.min_parallel_chars,
                        "injected_fault": fault, **_id_diff(got, ref)}))
    res.checks["ids-full"] = n


def _id_diff(got: np.ndarray, ref: np.ndarray, w: int = 6) -> dict:
    from toktier.verifier import first_difference

    i = first_difference(got, ref)
    lo = max(0, i - w)
    return {"first_diff": i, "got_len": len(got), "ref_len": len(ref),
            "got_window": got[lo : i + w].tolist(), "ref_window": ref[lo : i + w].tolist()}


# -- ids-repair ----------------------------------------------------------------------------

def repair_ops(rng: random.Random, material: str, n_ops: int) -> list[list]:
    """Seeded appends / edits / syncs drawn from `material` (positions clamp at replay)."""
    ops: list[list] = []
    length = 0
    for _ in range(n_ops):
        n = rng.choice(_REPAIR_SIZES)
        a = rng.randrange(max(1, len(material) - n))
        piece = material[a : a + n]
        u = rng.random()
        if u < 0.6 or length == 0:
            ops.append(["append", piece])
            length += len(piece)
        elif u < 0.85:
            at = rng.randrange(length + 1)
            dl = rng.choice((0, 0, 1, 2, 7, 40, 300))
            ops.append(["edit", at, dl, piece if rng.random() < 0.75 else ""])
            length += len(piece) - dl
        else:
            at = rng.randrange(length + 1)
            dl = rng.choice((0, 1, 5))
            ops.append(["sync", at, dl, piece])
            length += len(piece) - dl
        length = max(length, 0)
    return ops


def replay_ops(tok, ops: list[list], window: int, rng: random.Random | None = None,
               opts: Options | None = None) -> tuple[int, int | None, dict]:
    """Replay; returns (ops checked, index of the first diverging op or None, diff detail)."""
    from toktier.session import Session

    s = Session(tok, window=window)
    for i, op in enumerate(ops):
        if op[0] == "append":
            r = s.append(op[1])
        else:
            n = s.num_chars
            a = min(int(op[1]), n)
            b = min(a + int(op[2]), n)
            if op[0] == "edit":
                r = s.edit(a, b, op[3])
            else:
                t = s.text
                r = s.sync(t[:a] + op[3] + t[b:])
        got = r.ids
        fault = None
        if rng is not None and opts is not None:
            got, fault = _maybe_fault(tok, s.text, got, rng, opts)
        ref = tok.encode(s.text)
        if not np.array_equal(got, ref):
            return i + 1, i, {"path": str(r.path.value), "injected_fault": fault, **_id_diff(np.asarray(got), ref)}
    return len(ops), None, {}


def _run_ids_repair(tok, texts, whole, rng, opts, res) -> None:
    n = 0
    for text in texts:
        if len(text) < 2:
            continue
        ops = repair_ops(rng, text, opts.repair_ops)
        window = rng.choice((64, 256, 512))
        done, bad, detail = replay_ops(tok, ops, window, rng, opts)
        n += done
        if bad is not None:
            fault = detail.get("injected_fault")
            _divergence(res, opts, "ids-repair", lambda: _shrunk_ops_record(
                tok, ops[: bad + 1], window, opts, fault, detail))
    res.checks["ids-repair"] = n


# -- gpu -----------------------------------------------------------------------------------

@_memo  # building a driver compiles/loads the kernels: once per worker process
def gpu_backend() -> tuple[Callable | None, str]:
    """(encode(tok, text) -> ids, why) for the GPU full path, or (None, reason)."""
    try:
        import importlib

        gpu = importlib.import_module("toktier.gpu")
    except ImportError as exc:
        return None, f"toktier.gpu is not available ({exc})"
    try:
        from toktier.gpu.driver import available_driver  # type: ignore[import-not-found]
    except ImportError:
        available_driver = None
    if available_driver is not None:
        try:
            drv = available_driver()
        except Exception as exc:
            return None, f"toktier.gpu driver probe failed ({exc})"
        if drv is None:
            return None, "toktier.gpu reports no usable device (no pycuda or no GPU)"
        return (lambda tok, text: drv.encode(tok, text)[0]), ""
    for probe in ("is_available", "available", "device_available"):
        fn = getattr(gpu, probe, None)
        if callable(fn):
            try:
                if not fn():
                    return None, "toktier.gpu reports no usable device"
            except Exception as exc:
                return None, f"toktier.gpu device probe failed ({exc})"
            break
    else:
        return None, "toktier.gpu has no device probe (is_available)"
    for name in ("encode_full", "encode"):
        fn = getattr(gpu, name, None)
        if callable(fn):
            return fn, ""
    return None, "toktier.gpu has no encode_full(tok, text)"


def _run_gpu(tok, texts, whole, rng, opts, res) -> None:
    encode, why = gpu_backend()
    if encode is None:
        res.skipped = why
        return
    n = 0
    for text in texts + ([whole] if whole else []):
        try:
            got = np.asarray(encode(tok, text), dtype=np.uint32)
        except NotImplementedError as exc:  # family not supported on the GPU
            res.skipped = f"gpu: {exc}"
            return
        ref = tok.encode(text)
        n += 1
        if not np.array_equal(got, ref):
            def pred(t: str) -> bool:
                return not np.array_equal(np.asarray(encode(tok, t), dtype=np.uint32), tok.encode(t))

            _divergence(res, opts, "gpu", lambda: _shrunk_record(tok, "gpu", text, pred, opts,
                                                                  detail=_id_diff(got, ref)))
    res.checks["gpu"] = n


def _host_model():
    try:
        from toktier.gpu import encode as host_encode
        from toktier.gpu import pieces as host_pieces
        from toktier.gpu.tables import rules_for
    except ImportError as exc:
        return None, f"toktier.gpu host models are not available ({exc})"
    return (host_pieces, host_encode, rules_for), ""


def _run_host(tok, texts, whole, rng, opts, res) -> None:
    """The GPU path's numpy host models (pre-tokenizer pieces and BPE) against the reference."""
    model, why = _host_model()
    if model is None:
        res.skipped = why
        return
    host_pieces, host_encode, rules_for = model
    if rules_for(tok) is None:
        res.skipped = f"no GPU pre-tokenizer model for family {tok.family!r}"
        return
    n_ids = n_pieces = 0
    for text in texts:
        if tok.family_info is not None and tok.family_info.nfc and tok.engine.normalize(text) != text:
            text = tok.engine.normalize(text)  # the host model serves NFC-stable text only
        got = np.asarray(host_encode(tok, text), dtype=np.uint32)
        ref = tok.encode(text)
        n_ids += 1
        if not np.array_equal(got, ref):
            def pred(t: str) -> bool:
                return not np.array_equal(np.asarray(host_encode(tok, t), dtype=np.uint32), tok.encode(t))

            _divergence(res, opts, "host-ids", lambda: _shrunk_record(tok, "host-ids", text, pred, opts,
                                                                       detail=_id_diff(got, ref)))
        if hasattr(tok.engine, "pre_tokenize") and not any(lit is not None for *_, lit in host_pieces(tok, text)):
            mine = [a for a, _b, _l in host_pieces(tok, text)]
            theirs = [a for _, (a, _b) in tok.engine.pre_tokenize(text)]
            n_pieces += len(theirs)
            if mine != theirs:
                def pred_p(t: str) -> bool:
                    hp = host_pieces(tok, t)
                    if any(lit is not None for *_, lit in hp):
                        return False
                    return [a for a, _b, _l in hp] != [a for _, (a, _b) in tok.engine.pre_tokenize(t)]

                _divergence(res, opts, "host-pieces", lambda: _shrunk_record(
                    tok, "host-pieces", text, pred_p, opts, detail={"host_pieces": len(mine), "ref_pieces": len(theirs)}))
    res.checks["host-ids"] = n_ids
    if n_pieces:
        res.checks["host-pieces"] = n_pieces


_LEVEL_RUNNERS = {"pieces": _run_pieces, "ids-full": _run_ids_full, "ids-repair": _run_ids_repair,
                  "host": _run_host, "gpu": _run_gpu}


# ------------------------------------------------------------------------------------------
# shrinking (delta debugging)
# ------------------------------------------------------------------------------------------

def shrink_text(text: str, diverges: Callable[[str], bool], deadline: float) -> str:
    """The shortest text found that still diverges: drop chunks, halving their size.

    >>> shrink_text("xxxxAyyyyBzz", lambda t: "A" in t and "B" in t, time.monotonic() + 5)
    'AB'
    """
    cur = text
    size = max(1, len(cur) // 2)
    while size >= 1 and time.monotonic() < deadline:
        changed = False
        i = 0
        while i < len(cur) and time.monotonic() < deadline:
            cand = cur[:i] + cur[i + size :]
            if cand and _safe(diverges, cand):
                cur = cand
                changed = True
            else:
                i += size
        if not changed:
            size //= 2
    return cur


def _safe(pred: Callable, arg) -> bool:
    try:
        return bool(pred(arg))
    except Exception:  # a crash is a different bug; do not shrink towards it
        return False


def _shrunk_record(tok, level: str, text: str, diverges: Callable[[str], bool], opts: Options,
                   detail: dict) -> dict:
    deadline = time.monotonic() + opts.shrink_seconds
    small = shrink_text(text, diverges, deadline) if _safe(diverges, text) else text
    return {
        "tokenizer": tok.name, "tokenizer_hash": tok.hash, "family": tok.family, "level": level,
        "text": small, "original_chars": len(text),
        "original_sha256": hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(),
        "detail": detail,
        "reproduce": _reproduce_hint(level),
    }


def _shrunk_ops_record(tok, ops: list[list], window: int, opts: Options, fault: str | None,
                       detail: dict) -> dict:
    deadline = time.monotonic() + opts.shrink_seconds

    def diverges(candidate: list[list]) -> bool:
        if fault:  # injected: any op that produces IDs reproduces it
            return any(op[0] != "edit" or op[3] for op in candidate)
        return replay_ops(tok, candidate, window)[1] is not None

    cur = [list(op) for op in ops]
    if _safe(diverges, cur):
        # drop ops (from the front: later ops depend on earlier text less than it seems)
        i = 0
        while i < len(cur) and time.monotonic() < deadline:
            cand = cur[:i] + cur[i + 1 :]
            if cand and _safe(diverges, cand):
                cur = cand
            else:
                i += 1
        # shrink each op's text
        for j, op in enumerate(cur):
            k = 1 if op[0] == "append" else 3

            def with_text(t: str, j=j, k=k) -> bool:
                cand = [list(o) for o in cur]
                cand[j][k] = t
                return diverges(cand)

            if op[k] and time.monotonic() < deadline:
                op[k] = shrink_text(op[k], with_text, deadline)
    return {
        "tokenizer": tok.name, "tokenizer_hash": tok.hash, "family": tok.family, "level": "ids-repair",
        "ops": cur, "window": window, "original_ops": len(ops), "detail": detail,
        "reproduce": _reproduce_hint("ids-repair"),
    }


def _reproduce_hint(level: str) -> str:
    if level == "ids-repair":
        return ("s = toktier.Session(toktier.load_tokenizer(tokenizer), window=window); replay ops "
                "(append text | edit start n_deleted text | sync start n_deleted text); compare s.ids "
                "with tok.encode(s.text) after each")
    if level == "pieces":
        return ("q in toktier.boundaries.stable_char_positions(tok, text) must start a piece of "
                "tok.engine.pre_tokenize(text) (NFC families: normalize text first)")
    return "toktier.fullpath.encode_full(tok, text, cfg) must equal tok.encode(text)"


# ------------------------------------------------------------------------------------------
# parent: planning, running, reporting
# ------------------------------------------------------------------------------------------

def _parse_chunk(spec: str | None) -> tuple[int, int]:
    if not spec:
        return 0, 1
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SystemExit(f"toktier verify: --chunk expects I/N (1 <= I <= N), not {spec!r}") from None
    if not 1 <= i <= n:
        raise SystemExit(f"toktier verify: --chunk expects I/N (1 <= I <= N), not {spec!r}")
    return i - 1, n


def _load_state(path: str | None) -> dict[str, dict]:
    done: dict[str, dict] = {}
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:  # a line cut by an interruption
                        continue
                    done[rec["key"]] = rec
    return done


def _write_reproducer(out: Path, rec: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    body = json.dumps(rec, ensure_ascii=False, indent=1, sort_keys=True)
    digest = hashlib.sha256(body.encode()).hexdigest()[:12]
    path = out / f"{rec['tokenizer']}-{rec['level']}-{digest}.json"
    path.write_text(body + "\n", encoding="utf-8")
    return path


class _Totals:
    def __init__(self) -> None:
        self.checks: dict[tuple[str, str], int] = {}
        self.divergent: dict[tuple[str, str], int] = {}
        self.seconds: dict[tuple[str, str], float] = {}
        self.units: dict[tuple[str, str], int] = {}
        self.skipped: dict[tuple[str, str], str] = {}
        self.family: dict[str, str] = {}
        self.doc_chars: dict[str, int] = {}  # corpus size, each document counted once
        self.total_checks = 0

    @property
    def chars(self) -> int:
        return sum(self.doc_chars.values())

    def add(self, rec: dict) -> None:
        tok = rec["tokenizer"]
        checks = rec.get("checks", {})
        # a unit's time is shown on its level's main row (e.g. "host" -> "host-ids")
        main = rec["level"] if rec["level"] in checks else next(iter(checks), None)
        for label, n in checks.items():
            k = (tok, label)
            self.checks[k] = self.checks.get(k, 0) + n
            self.total_checks += n
            if label == main:
                self.seconds[k] = self.seconds.get(k, 0.0) + rec.get("seconds", 0.0)
                self.units[k] = self.units.get(k, 0) + 1
        for label, n in rec.get("n_divergent", {}).items():
            self.divergent[(tok, label)] = self.divergent.get((tok, label), 0) + n
        if rec.get("skipped"):
            self.skipped[(tok, rec["level"])] = rec["skipped"]
        if rec.get("family"):
            self.family[tok] = rec["family"]
        if rec.get("doc"):
            self.doc_chars[rec["doc"]] = max(self.doc_chars.get(rec["doc"], 0), rec.get("chars", 0))

    @property
    def n_divergent(self) -> int:
        return sum(self.divergent.values())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toktier verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="NAME[,NAME...] (default: every bundled tokenizer)")
    p.add_argument("--levels", default=",".join(DEFAULT_LEVELS),
                   help=f"comma-separated subset of {','.join(LEVELS)} (default: %(default)s)")
    p.add_argument("--corpus", nargs="+", metavar="PATH", help="files, directories (recursive), .jsonl files")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text (default: %(default)s)")
    p.add_argument("--jsonl-records", type=int, default=1000, help="JSONL records per work unit")
    p.add_argument("--builtin", action=argparse.BooleanOptionalAction, default=None,
                   help="include the built-in real corpus (default: when no other corpus is given)")
    p.add_argument("--builtin-seeds", default="0", help="seed S or range A:B of the built-in samples")
    p.add_argument("--large-chars", type=int, default=0, help="add corpus.large_text documents of this size")
    p.add_argument("--large-seeds", default="0", help="seed S or range A:B for --large-chars")
    p.add_argument("--adversarial", type=int, default=0, metavar="N", help="add N generated adversarial texts")
    p.add_argument("--segment-chars", type=int, default=16_384, help="split documents into texts of this size")
    p.add_argument("--suffix-samples", type=int, default=2, help="positions per text for the splice check")
    p.add_argument("--repair-ops", type=int, default=12, help="ops per replayed session (ids-repair)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (spawn); 1 runs in-process")
    p.add_argument("--chunk", default=None, metavar="I/N", help="run only the I-th of N slices (1-based)")
    p.add_argument("--state", default=None, metavar="FILE", help="record completed units here and skip them")
    p.add_argument("--out", default="verify-out", metavar="DIR", help="directory for reproducers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shrink-seconds", type=float, default=30.0, help="time budget per reproducer shrink")
    p.add_argument("--inject-faults", type=float, default=0.0, metavar="RATE",
                   help="self-test: corrupt this fraction of ID-level results (must fail the campaign)")
    p.add_argument("--mutate-predicate", choices=MUTATIONS, default=None,
                   help="self-test: widen the stable-boundary predicate (must fail the pieces level)")
    p.add_argument("--json-summary", default=None, metavar="FILE", help="also write the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from toktier.registry import list_tokenizers

    names = [x.strip() for x in args.tokenizer.split(",") if x.strip()] if args.tokenizer else list_tokenizers()
    bad = _unknown_tokenizers(names) if names else [args.tokenizer]
    if bad:
        print(f"toktier verify: unknown tokenizer(s) {', '.join(map(repr, bad))}: neither a bundled name nor "
              f"a tokenizer file; known: {', '.join(list_tokenizers())}", file=sys.stderr)
        return 2
    levels = [x.strip() for x in args.levels.split(",") if x.strip()]
    unknown = [x for x in levels if x not in LEVELS]
    if unknown or not levels:
        print(f"toktier verify: unknown level(s) {unknown}; known: {', '.join(LEVELS)}", file=sys.stderr)
        return 2
    if "gpu" in levels:
        _, why = gpu_backend()
        if why:
            print(f"toktier verify: skipping level gpu: {why}", file=sys.stderr)
            levels = [x for x in levels if x != "gpu"]
    opts = Options(segment_chars=args.segment_chars, suffix_samples=args.suffix_samples,
                   repair_ops=args.repair_ops, seed=args.seed, text_field=args.text_field,
                   inject_faults=args.inject_faults, mutate_predicate=args.mutate_predicate,
                   shrink_seconds=args.shrink_seconds)
    docs = collect_docs(args)
    units = [Unit(t, lv, d) for d in docs for t in names for lv in levels]
    ci, cn = _parse_chunk(args.chunk)
    units = units[ci::cn]
    # Units recorded under other check options (segmenting, sampling, seeds, faults) are redone.
    fingerprint = hashlib.sha256(repr(replace(opts, shrink_seconds=0.0)).encode()).hexdigest()[:16]
    done = {k: r for k, r in _load_state(args.state).items() if r.get("opts") == fingerprint}
    totals = _Totals()
    resumed = 0
    for u in units:
        if u.key in done:
            totals.add(done[u.key])
            resumed += 1
    todo = [u for u in units if u.key not in done]
    out = Path(args.out)
    written: list[Path] = []
    noted: set[tuple[str, str]] = set()
    t0 = time.perf_counter()
    state_f = open(args.state, "a", encoding="utf-8") if args.state else None
    progress = _Progress(len(units), resumed, totals, disabled=args.no_progress)
    try:
        for res in _execute(todo, opts, args.jobs):
            rec = asdict(res)
            divergences = rec.pop("divergences")
            totals.add(rec)
            for d in divergences:
                written.append(_write_reproducer(out, d))
            if res.skipped and not res.checks and (res.tokenizer, res.level) not in noted:
                noted.add((res.tokenizer, res.level))
                progress.note(f"{res.tokenizer} {res.level}: skipped: {res.skipped}")
            if state_f:
                state_f.write(json.dumps({**rec, "opts": fingerprint}, sort_keys=True) + "\n")
                state_f.flush()
            progress.advance(res)
    finally:
        progress.close()
        if state_f:
            state_f.close()
    wall = time.perf_counter() - t0
    _print_summary(totals, names, wall, len(units), resumed, written)
    if args.json_summary:
        summary = {
            "command": ["toktier", "verify", *(argv if argv is not None else sys.argv[1:])],
            "wall_seconds": wall, "units": len(units), "resumed_units": resumed, "chars": totals.chars,
            "rows": [{"tokenizer": t, "family": totals.family.get(t), "level": lv, "checks": n, "divergences": totals.divergent.get((t, lv), 0),
                      "worker_seconds": round(totals.seconds.get((t, lv), 0.0), 2)}
                     for (t, lv), n in sorted(totals.checks.items())],
            "divergences": totals.n_divergent, "reproducers": [str(p) for p in written],
        }
        Path(args.json_summary).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return 1 if totals.n_divergent else 0


def _execute(units: list[Unit], opts: Options, jobs: int) -> Iterator[UnitResult]:
    if jobs <= 1 or len(units) <= 1:
        undo = _init_worker(opts)
        try:
            for u in units:
                yield run_unit(u, opts)
        finally:
            undo()
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(min(jobs, len(units)), initializer=_init_worker, initargs=(opts,)) as pool:
        yield from pool.imap_unordered(run_unit, units, chunksize=1)


class _Progress:
    """A rich progress bar (units, checks, checks/s), or plain periodic lines."""

    def __init__(self, total: int, resumed: int, totals: _Totals, disabled: bool) -> None:
        self.totals = totals
        self.t0 = time.perf_counter()
        self.start_checks = totals.total_checks
        self.bar = None
        if disabled:
            return
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:  # pragma: no cover - rich comes with the tools extra
            return
        self.bar = Progress(
            TextColumn("verify"), BarColumn(), MofNCompleteColumn(), TextColumn("units"),
            TextColumn("{task.fields[checks]:>13,} checks  {task.fields[rate]:>10,.0f}/s  "
                       "{task.fields[div]} divergences"),
            TimeElapsedColumn(), transient=False,
        )
        self.bar.start()
        self.task = self.bar.add_task("verify", total=total, completed=resumed,
                                      checks=totals.total_checks, rate=0.0, div=totals.n_divergent)

    def advance(self, res: UnitResult) -> None:
        if self.bar is None:
            return
        dt = max(1e-9, time.perf_counter() - self.t0)
        self.bar.update(self.task, advance=1, checks=self.totals.total_checks,
                        rate=(self.totals.total_checks - self.start_checks) / dt, div=self.totals.n_divergent)

    def note(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.console.print(msg)
        else:
            print(msg, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _print_summary(totals: _Totals, names: list[str], wall: float, n_units: int, resumed: int,
                   written: list[Path]) -> None:
    fam = totals.family
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text without rich
        print(f"toktier verify: {n_units} units ({resumed} resumed), corpus {totals.chars:,} chars, {wall:.1f} s")
        for (tok, level), n in sorted(totals.checks.items()):
            print(f"{tok:<14} {fam.get(tok, ''):<10} {level:<14} {n:>12,} checks "
                  f"{totals.divergent.get((tok, level), 0):>6} divergences")
        for p in written:
            print(f"reproducer: {p}")
        print(f"{totals.n_divergent} divergence(s) in {totals.total_checks:,} checks")
        return
    table = Table(title=f"toktier verify: {n_units} units ({resumed} resumed), "
                        f"corpus {totals.chars:,} chars, {wall:.1f} s wall")
    for col, just in (("tokenizer", "left"), ("family", "left"), ("level", "left"), ("checks", "right"),
                      ("divergences", "right"), ("worker s", "right"), ("checks/s", "right")):
        table.add_column(col, justify=just)
    for (tok, level), n in sorted(totals.checks.items()):
        sec = totals.seconds.get((tok, level), 0.0)
        table.add_row(tok, fam.get(tok, ""), level, f"{n:,}", str(totals.divergent.get((tok, level), 0)),
                      f"{sec:.1f}" if sec else "", f"{n / sec:,.0f}" if sec else "")
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(table)
    if any(lv == "pieces" for _, lv in totals.checks):
        console.print("pieces: HF engines against the reference pre-tokenizer's pieces; tiktoken engines "
                      "(no piece API) against the reference token starts. pieces-suffix: sampled positions, "
                      "pieces/IDs right of q equal those of text[q:], left of q independent of text past q+1.",
                      markup=False)
    for (tok, level), why in sorted(totals.skipped.items()):
        console.print(f"skipped {tok} {level}: {why}")
    if written:
        console.print(f"[bold red]{totals.n_divergent} divergence(s)[/]; reproducers:")
        for p in written:
            console.print(f"  {p}")
    elif totals.n_divergent:
        console.print(f"[bold red]{totals.n_divergent} divergence(s)[/] (reproducers written in earlier runs)")
    else:
        console.print(f"no divergences in {totals.total_checks:,} checks")


if __name__ == "__main__":
    sys.exit(main())
