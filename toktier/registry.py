"""Frozen tokenizers and the registry that holds many versions side by side.

`load_tokenizer` turns a bundled name or a file into an immutable
`FrozenTokenizer`: the reference engine, its content hash, its family (or the
reason it has none), the probed class table, the literal index and per-token byte
lengths.  A `Registry` keeps loaded tokenizers by name and by hash; an entry never
changes after registration.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from . import bundled
from .charclass import nfc_inert_mask, probe_classes
from .engines import HFEngine, Specials, TiktokenEngine, engine_failure
from .errors import UnknownTokenizer, UnsupportedTokenizer
from .families import I, Family, detect_family
from .literals import LiteralIndex
from .native import ENGINE_CHOICES, EngineChoice, NativeEngine
from .native import attach as attach_native
from .token_table import TokenTable, cross_check


@dataclass(frozen=True, eq=False)
class FrozenTokenizer:
    """An immutable reference tokenizer plus everything repair needs to know about it.

    >>> tok = load_tokenizer("cl100k_base")
    >>> tok.family, tok.encode("hello world").tolist()
    ('cl100k', [15339, 1917])
    """

    name: str
    hash: str
    specials: Specials
    family_info: Family | None
    family_reason: str | None
    engine: HFEngine | TiktokenEngine = field(repr=False)
    classes: np.ndarray | None = field(repr=False)  # uint8[0x110000], read-only
    literals: LiteralIndex = field(repr=False)
    table: TokenTable = field(repr=False)  # per-token bytes and lengths, from the engine
    max_token_bytes: int = 0
    #: Lazily derived, immutable data of optional paths (the GPU's tables); filled at most once
    #: per key (a race computes a value twice, never a different one).  Not copied by `replace`.
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    #: The certified native engine (`toktier.native`), or None with `native_reason` saying why
    #: the reference engine serves `encode_fast`.  Set once by the loader.
    native: NativeEngine | None = field(default=None, init=False, repr=False, compare=False)
    native_reason: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def family(self) -> str | None:
        """Family label ("cl100k", "o200k", "deepseek", "qwen+nfc", ...) or None."""
        return self.family_info.label if self.family_info else None

    @property
    def token_bytes(self) -> list[bytes]:
        """Canonical bytes of every id (see `toktier.token_table`)."""
        return self.table.token_bytes

    @property
    def token_len(self) -> np.ndarray:
        """uint32 canonical byte length per id, read-only."""
        return self.table.token_len

    @property
    def spliceable(self) -> bool:
        """Whether sessions may repair by splicing (else every op takes the full path)."""
        return self.family_info is not None

    def explain(self) -> str:
        """One paragraph: family, whether splicing is enabled and, if not, why.

        >>> print(load_tokenizer("cl100k_base").explain().splitlines()[0])
        cl100k_base: tiktoken engine, family cl100k, splicing enabled
        """
        engine = f"{self.engine.engine_name} engine"
        if self.family_info is None:
            head = f"{self.name}: {engine}, no proven family, splicing disabled (every op re-tokenizes the whole text)"
            lines = [head, f"  why: {self.family_reason}"]
        else:
            lines = [f"{self.name}: {engine}, family {self.family}, splicing enabled"]
        if self.native is not None and self.native.demoted is None:
            lines.append(f"  fast encodes: native engine, certified at load (rules {self.native.rules})")
        else:
            why = self.native.demoted if self.native is not None else self.native_reason
            lines.append(f"  fast encodes: reference engine ({why})")
        n_unc = int(self.table.uncertain.sum())
        lines.append(f"  specials={self.specials}, {len(self.table):,} ids, {len(self.engine.literals):,} active "
                     f"literal(s), longest token {self.max_token_bytes} B, hash {self.hash[:12]}")
        if self.family_info is not None and n_unc:
            amb = len(self.table.alternatives)
            lines.append(f"  {n_unc:,} id(s) without one fixed byte span ({amb:,} ambiguous, the rest unknown/unused): "
                         "a window that holds one is spliced only when the text proves its span")
        return "\n".join(lines)

    def encode(self, text: str) -> np.ndarray:
        """The reference full tokenization of `text` (uint32)."""
        return self.engine.encode(text)

    def encode_fast(self, text: str) -> np.ndarray:
        """`encode`'s IDs through the fastest certified engine (repair hot path, full-path chunks):
        the native engine when it is certified and not demoted, else the reference's fastest call."""
        nat = self.native
        if nat is not None and nat.demoted is None:
            return nat.encode(text)
        return self.engine.encode_fast(text)

    @property
    def engine_label(self) -> str:
        """Which engine serves `encode_fast`: "native" or the reference engine's name."""
        nat = self.native
        return "native" if nat is not None and nat.demoted is None else self.engine.engine_name

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return self.engine.encode_batch(texts)


def list_tokenizers() -> list[str]:
    """Bundled tokenizer names."""
    return sorted(bundled.BUNDLED)


def _content_hash(engine_name: str, version: str, file_bytes: bytes, pattern: str,
                  specials: dict[str, int] | None, mode: Specials) -> str:
    h = hashlib.sha256()
    for part in (engine_name.encode(), version.encode(), hashlib.sha256(file_bytes).digest(),
                 pattern.encode(), repr(sorted((specials or {}).items())).encode(), mode.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def load_tokenizer(name_or_path: str | Path, *, specials: Specials = "all", pat_str: str | None = None,
                   special_tokens: dict[str, int] | None = None, engine: EngineChoice = "auto") -> FrozenTokenizer:
    """Load a bundled name, a `tokenizer.json`, or a `.tiktoken` rank file (needs `pat_str`).

    `specials="all"` recognizes added/special-token text as the tokens (what servers
    do after rendering a chat template); `specials="none"` treats it as plain text
    (HF `encode_special_tokens=True`, tiktoken `encode_ordinary`).

    `engine` picks what serves fast encodes (session windows, the full path):
    ``"auto"`` the native engine when it certifies for this file (`toktier.native`),
    else the reference; ``"native"`` the same but raises `UnsupportedTokenizer` with
    the reason when it cannot certify; ``"reference"`` HF `tokenizers` / tiktoken only.
    `encode` is always the reference.
    """
    if specials not in ("all", "none"):
        raise ValueError(f"specials must be 'all' or 'none', not {specials!r}")
    if engine not in ENGINE_CHOICES:
        raise ValueError(f"engine must be one of {ENGINE_CHOICES}, not {engine!r}")
    tok = _load(name_or_path, specials, pat_str, special_tokens)
    nat, why = attach_native(tok, engine)
    object.__setattr__(tok, "native", nat)  # frozen: set once, here, before anyone sees `tok`
    object.__setattr__(tok, "native_reason", why)
    return tok


def _load(name_or_path: str | Path, specials: Specials, pat_str: str | None,
          special_tokens: dict[str, int] | None) -> FrozenTokenizer:
    key = str(name_or_path)
    if key in bundled.BUNDLED:
        spec = bundled.BUNDLED[key]
        path = spec.path()
        if spec.kind == "hf":
            return _build_hf(spec.name, path, specials)
        return _build_tiktoken(spec.name, path, spec.pat_str, spec.special_tokens, specials)
    path = Path(key)
    if not path.is_file():
        raise UnknownTokenizer(
            f"unknown tokenizer {key!r}: not a bundled name ({', '.join(list_tokenizers())}) nor a file"
        )
    if path.name.endswith(".json"):
        return _build_hf(path.stem if path.name != "tokenizer.json" else path.parent.name, path, specials)
    if path.name.endswith((".tiktoken", ".tiktoken.gz")):
        if not pat_str:
            raise UnsupportedTokenizer(f"{path}: a tiktoken rank file needs pat_str= (its pre-tokenizer regex)")
        return _build_tiktoken(path.name.split(".")[0], path, pat_str, special_tokens or {}, specials)
    raise UnsupportedTokenizer(f"{path}: expected a tokenizer.json or a .tiktoken rank file")


def _finish(name: str, digest: str, specials: Specials, engine: HFEngine | TiktokenEngine) -> FrozenTokenizer:
    facts = engine.facts
    table = engine.table
    family, reason = detect_family(facts.normalizer, facts.split_patterns, facts.byte_level,
                                   facts.problems + table.problems)
    if family is not None:
        # The table must agree with what the engine emits before any splice relies on it.
        # HF's batch call is one native call; tiktoken's spawns a thread task per text (slower for probes).
        batch = engine.encode_batch if engine.engine_name == "tokenizers" else (lambda ts: list(map(engine.encode, ts)))
        normalize = engine.normalize if family.nfc else None  # NFC families' tokens tile the normalized text
        mismatches = cross_check(table, batch, (lit.content for lit in engine.literals), normalize)
        if mismatches:
            family, reason = None, "token table disagrees with the engine: " + "; ".join(mismatches)
    extra = {I: lambda: nfc_inert_mask(engine.normalize)} if family and family.nfc else None
    classes = probe_classes(engine, family.class_patterns(), engine.class_key, extra) if family else None
    return FrozenTokenizer(
        name=name, hash=digest, specials=specials, family_info=family, family_reason=reason, engine=engine,
        classes=classes, literals=LiteralIndex(lit.content for lit in engine.literals),
        table=table, max_token_bytes=table.max_token_bytes,
    )


def _build_hf(name: str, path: Path, specials: Specials) -> FrozenTokenizer:
    raw = path.read_bytes()
    try:
        engine = HFEngine(str(path), specials)
    except BaseException as exc:  # the engine's own parse error (or panic), re-typed
        if not engine_failure(exc):
            raise
        raise UnsupportedTokenizer(f"{path}: not a loadable tokenizer.json ({exc})") from exc
    digest = _content_hash(engine.engine_name, engine.version, raw, "", None, specials)
    return _finish(name, digest, specials, engine)


def _build_tiktoken(name: str, path: Path, pat_str: str, special_tokens: dict[str, int],
                    specials: Specials) -> FrozenTokenizer:
    raw = path.read_bytes()
    try:
        ranks = bundled.load_rank_file(path)
    except ValueError as exc:
        raise UnsupportedTokenizer(f"{path}: not a tiktoken rank file ({exc})") from exc
    _check_rank_file(path, ranks, special_tokens)
    try:
        engine = TiktokenEngine(name, pat_str, ranks, special_tokens, specials)
    except BaseException as exc:  # tiktoken refuses (or panics on) duplicate ranks, bad patterns
        if not engine_failure(exc):
            raise
        raise UnsupportedTokenizer(f"{path}: tiktoken cannot build an encoding from it ({exc})") from exc
    digest = _content_hash(engine.engine_name, engine.version, raw, pat_str, special_tokens, specials)
    return _finish(name, digest, specials, engine)


def _check_rank_file(path: Path, ranks: dict[bytes, int], special_tokens: dict[str, int]) -> None:
    """Refuse rank files on which even tiktoken's full encode has no answer."""
    missing = [b for b in range(256) if bytes([b]) not in ranks and not (b in (0xC0, 0xC1) or b >= 0xF5)]
    if missing:
        shown = ", ".join(f"0x{b:02X}" for b in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise UnsupportedTokenizer(
            f"{path}: the rank file has no token for {len(missing)} text byte(s) ({shown}); tiktoken panics on "
            "any text containing one, so no encoding of it can be guaranteed"
        )
    bad = [s for s, i in special_tokens.items() if not s or not isinstance(i, int) or i < 0]
    if bad:
        raise UnsupportedTokenizer(f"{path}: special tokens need non-empty text and an id >= 0: {bad[:4]!r}")


class Registry:
    """Loaded tokenizers by name and by hash; entries are immutable once registered.

    Thread-safe.  Loading the same name twice returns the registered entry; a
    different file under an already registered name is refused (register it under
    another name — versions live side by side, addressed by hash).
    """

    def __init__(self) -> None:
        self._by_hash: dict[str, FrozenTokenizer] = {}
        self._by_name: dict[tuple[str, Specials], str] = {}
        self._lock = threading.Lock()

    def load(self, name_or_path: str | Path, *, specials: Specials = "all", **kwargs: object) -> FrozenTokenizer:
        with self._lock:
            digest = self._by_name.get((str(name_or_path), specials))
            if digest is not None:
                return self._by_hash[digest]
        tok = load_tokenizer(name_or_path, specials=specials, **kwargs)  # type: ignore[arg-type]
        return self.register(tok, alias=str(name_or_path))

    def register(self, tok: FrozenTokenizer, alias: str | None = None) -> FrozenTokenizer:
        with self._lock:
            existing = self._by_hash.setdefault(tok.hash, tok)
            for name in {tok.name, alias} - {None}:
                bound = self._by_name.setdefault((name, tok.specials), tok.hash)  # type: ignore[arg-type]
                if bound != tok.hash and name == alias:
                    raise ValueError(f"name {name!r} is already bound to tokenizer {bound[:12]}")
            return existing

    def get(self, name_or_hash: str, specials: Specials = "all") -> FrozenTokenizer:
        with self._lock:
            if name_or_hash in self._by_hash:
                return self._by_hash[name_or_hash]
            digest = self._by_name.get((name_or_hash, specials))
            if digest is not None:
                return self._by_hash[digest]
            known = sorted({n for n, _ in self._by_name})
        raise UnknownTokenizer(f"tokenizer {name_or_hash!r} is not registered; registered: {', '.join(known) or 'none'}")

    def names(self) -> list[str]:
        with self._lock:
            return sorted({n for n, _ in self._by_name})

    def __iter__(self):
        with self._lock:
            return iter(list(self._by_hash.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_hash)
