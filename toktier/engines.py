"""Reference engines: thin, explicit wrappers over HF `tokenizers` and `tiktoken`.

An engine owns one reference tokenizer object and answers the questions the rest
of TokTier asks of it: full encodes (the contract's reference), the token table
(`token_table.py`: bytes per id, read from the engine's own maps, never the file's
declared ids), the added-token literals active in the chosen specials mode, the facts
family detection needs (normalizer, pre-tokenizer patterns, model flags), and
code-point class probes run through the engine's *own* regex engine.

Nothing here decides whether a splice is safe; that is `families/`.  Every encode
failure of the engine (an exception or a Rust panic) is re-raised as
`ReferenceEngineError`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from .errors import ReferenceEngineError
from .token_table import hf_table, tiktoken_table

Specials = Literal["all", "none"]

# All Unicode scalar values except surrogates, as one string, for class probes.
_MAX_CP = 0x110000


def all_code_points() -> np.ndarray:
    """uint32 array of every Unicode scalar value (surrogates excluded)."""
    cps = np.arange(_MAX_CP, dtype=np.uint32)
    return cps[(cps < 0xD800) | (cps > 0xDFFF)]


def _cps_to_str(cps: np.ndarray) -> str:
    return cps.astype("<u4").tobytes().decode("utf-32-le")


def engine_failure(exc: BaseException) -> bool:
    """Whether `exc` is the engine's own failure: an exception, or a Rust panic (pyo3's
    PanicException derives from BaseException, so `except Exception` misses it)."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def _reference_call(fn):
    """Re-raise an engine failure inside `fn` as `ReferenceEngineError` (no untyped escape)."""
    @functools.wraps(fn)
    def call(self, *args):
        try:
            return fn(self, *args)
        except BaseException as exc:
            if not engine_failure(exc) or isinstance(exc, ReferenceEngineError):
                raise
            raise ReferenceEngineError(f"{self.engine_name} failed in {fn.__name__}: {exc!r}") from exc
    return call


@dataclass(frozen=True)
class AddedLiteral:
    """An added-token literal as the reference extracts it."""

    content: str
    special: bool
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False
    normalized: bool = False


@dataclass(frozen=True)
class EngineFacts:
    """Configuration facts read from the tokenizer itself, for family detection."""

    engine: str  # "tokenizers" or "tiktoken"
    normalizer: str  # "none", "nfc", or a description of anything else
    split_patterns: tuple[str, ...]  # pre-tokenizer regexes in application order
    byte_level: bool  # byte-level BPE whose token bytes tile the (normalized) text
    problems: tuple[str, ...] = field(default=())  # reasons a splice cannot be proven


class HFEngine:
    """HF `tokenizers` reference: `encode(text, add_special_tokens=False)`."""

    engine_name = "tokenizers"

    def __init__(self, path: str, specials: Specials) -> None:
        import tokenizers

        self.version = tokenizers.__version__
        self.path = path
        self._tok = tokenizers.Tokenizer.from_file(path)
        # Truncation/padding shape batches for a model; a prompt's tokens are never cut.
        self._tok.no_truncation()
        self._tok.no_padding()
        if specials == "none":
            # Special added tokens become plain text; non-special ones still match.
            self._tok.encode_special_tokens = True
        self.specials = specials
        with open(path, "rb") as f:
            self._config = json.loads(f.read())
        # Added tokens as the engine holds them (true ids, flags): never the file's declared ids.
        self._added = self._tok.get_added_tokens_decoder()
        added = [
            AddedLiteral(content=a.content, special=bool(a.special), lstrip=bool(a.lstrip), rstrip=bool(a.rstrip),
                         single_word=bool(a.single_word), normalized=bool(a.normalized))
            for _, a in sorted(self._added.items())
        ]
        self.literals: tuple[AddedLiteral, ...] = tuple(
            a for a in added if not (specials == "none" and a.special)
        )
        try:
            self.facts = self._facts()
        except (AttributeError, TypeError, KeyError, ValueError) as exc:  # a shape the engine accepts, we do not
            self.facts = EngineFacts("tokenizers", "unknown", (), False, (f"configuration not understood ({exc!r})",))
        self.table = hf_table(self._tok, byte_level=self.facts.byte_level, added=self._added)

    @property
    def token_bytes(self) -> list[bytes]:
        return self.table.token_bytes

    @property
    def class_key(self) -> str:
        """Disk-cache key of probed class tables: what a probe's answer depends on (the regex
        engine's version, and the normalizer, which the NFC-inert bit reads), not the vocab."""
        return f"{self.engine_name}-{self.version}-{self.facts.normalizer[:40]}".replace("/", "_")

    # -- reference encodes -------------------------------------------------
    @_reference_call
    def encode(self, text: str) -> np.ndarray:
        enc = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, dtype=np.uint32)

    @_reference_call
    def encode_fast(self, text: str) -> np.ndarray:
        """The same IDs as `encode` through the library's offsets-free pipeline.

        `encode_batch_fast` skips offset tracking (20-40% of a small encode) and
        releases the GIL; the repair hot path uses it, verification keeps `encode`.
        """
        enc = self._tok.encode_batch_fast([text], add_special_tokens=False)[0]
        return np.asarray(enc.ids, dtype=np.uint32)

    @_reference_call
    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode many texts; releases the GIL and runs in parallel inside the engine."""
        encs = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def fresh_copy(self) -> "HFEngine":
        """A new engine object from the same file (the verifier never trusts a long-lived one)."""
        return HFEngine(self.path, self.specials)

    # -- probes ------------------------------------------------------------
    def probe_class(self, pattern: str) -> np.ndarray:
        """Boolean mask over code points matched by `pattern` in this engine's regex engine."""
        from tokenizers import Regex
        from tokenizers.pre_tokenizers import Split

        cps = all_code_points()
        mask = np.zeros(_MAX_CP, dtype=bool)
        splitter = Split(Regex(pattern), behavior="removed")
        step = 1 << 16
        for lo in range(0, len(cps), step):
            chunk = cps[lo : lo + step]
            text = _cps_to_str(chunk)
            kept = np.ones(len(chunk), dtype=bool)  # True = matched (removed)
            for _piece, (a, b) in splitter.pre_tokenize_str(text):
                kept[a:b] = False
            mask[chunk[kept]] = True
        return mask

    def pre_tokenize(self, text: str) -> list[tuple[str, tuple[int, int]]]:
        """Reference pre-tokenizer pieces of `text` (normalizer first, no added-token split)."""
        norm = self._tok.normalizer.normalize_str(text) if self._tok.normalizer else text
        pre = self._tok.pre_tokenizer
        return pre.pre_tokenize_str(norm) if pre else [(norm, (0, len(norm)))]

    def normalize(self, text: str) -> str:
        n = self._tok.normalizer
        return n.normalize_str(text) if n is not None else text

    # -- internals ----------------------------------------------------------
    def _facts(self) -> EngineFacts:
        """What the configuration says (read from the file: the engine exposes no regex/flags API)."""
        cfg = self._config
        if not isinstance(cfg, dict):
            return EngineFacts("tokenizers", "unknown", (), False, ("tokenizer.json is not a JSON object",))
        problems: list[str] = []
        norm = cfg.get("normalizer")
        if norm is None or (norm.get("type") == "Sequence" and not norm.get("normalizers")):
            normalizer = "none"
        elif norm.get("type") == "NFC":
            normalizer = "nfc"
        else:
            normalizer = json.dumps(norm, sort_keys=True)[:200]
            problems.append(f"normalizer {normalizer} has no proven splice rule")
        patterns: list[str] = []
        byte_level = False
        pre = cfg.get("pre_tokenizer")
        steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else ([pre] if pre else [])
        for i, step in enumerate(steps):
            kind = step.get("type")
            if kind == "Split":
                pat = step.get("pattern", {})
                if "Regex" not in pat or step.get("behavior") != "Isolated" or step.get("invert"):
                    problems.append(f"pre-tokenizer step {i}: Split form {step!r} not proven")
                else:
                    patterns.append(pat["Regex"])
            elif kind == "ByteLevel" and i == len(steps) - 1:
                if step.get("add_prefix_space") or step.get("use_regex", True):
                    problems.append("ByteLevel with add_prefix_space or its own regex is not proven")
                byte_level = True
            else:
                problems.append(f"pre-tokenizer step {i} of type {kind!r} not proven")
        model = cfg.get("model", {})
        if model.get("type") != "BPE":
            problems.append(f"model type {model.get('type')!r} is not BPE")
        for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                problems.append(f"BPE option {key}={model.get(key)!r} not proven")
        if model.get("byte_fallback"):
            problems.append("byte_fallback BPE not proven")
        if not self._tok.pre_tokenizer and not byte_level:
            problems.append("no pre-tokenizer")
        for lit in self.literals:
            if lit.lstrip or lit.rstrip or lit.single_word:
                problems.append(f"added token {lit.content!r} uses lstrip/rstrip/single_word")
                break
            if lit.normalized and normalizer != "none":
                problems.append(f"added token {lit.content!r} is matched after normalization")
                break
        return EngineFacts("tokenizers", normalizer, tuple(patterns), byte_level, tuple(problems))


class TiktokenEngine:
    """tiktoken reference: `encode(text, allowed_special="all")` or `encode_ordinary`."""

    engine_name = "tiktoken"

    def __init__(
        self,
        name: str,
        pat_str: str,
        mergeable_ranks: dict[bytes, int],
        special_tokens: dict[str, int],
        specials: Specials,
    ) -> None:
        import tiktoken

        self.version = tiktoken.__version__
        self._args = (name, pat_str, mergeable_ranks, special_tokens)
        self._enc = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=mergeable_ranks, special_tokens=special_tokens
        )
        self.specials = specials
        self.pat_str = pat_str
        self.literals: tuple[AddedLiteral, ...] = (
            tuple(AddedLiteral(content=s, special=True) for s in special_tokens) if specials == "all" else ()
        )
        self.table = tiktoken_table(mergeable_ranks, special_tokens if specials == "all" else {})
        self.facts = EngineFacts("tiktoken", "none", (pat_str,), True, self.table.problems)

    @property
    def token_bytes(self) -> list[bytes]:
        return self.table.token_bytes

    @property
    def class_key(self) -> str:
        """Disk-cache key of probed class tables (see `HFEngine.class_key`)."""
        return f"{self.engine_name}-{self.version}"

    @_reference_call
    def encode(self, text: str) -> np.ndarray:
        if self.specials == "all":
            return self._enc.encode_to_numpy(text, allowed_special="all").astype(np.uint32, copy=False)
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)

    encode_fast = encode  # tiktoken has no slower offsets-tracking path to skip

    @_reference_call
    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self.specials == "all":
            out = self._enc.encode_batch(list(texts), allowed_special="all")
        else:
            out = self._enc.encode_ordinary_batch(list(texts))
        return [np.asarray(o, dtype=np.uint32) for o in out]

    def fresh_copy(self) -> "TiktokenEngine":
        return TiktokenEngine(*self._args, specials=self.specials)

    def probe_class(self, pattern: str) -> np.ndarray:
        """Boolean mask over code points matched by `pattern` in tiktoken's regex engine.

        tiktoken drops text no match covers, so encoding every code point with a
        byte-only vocabulary and pattern `pattern` returns exactly the matched chars.
        """
        import tiktoken

        probe = tiktoken.Encoding(
            name="toktier-class-probe",
            pat_str=pattern,
            mergeable_ranks={bytes([i]): i for i in range(256)},
            special_tokens={},
        )
        cps = all_code_points()
        mask = np.zeros(_MAX_CP, dtype=bool)
        step = 1 << 16
        for lo in range(0, len(cps), step):
            chunk = cps[lo : lo + step]
            raw = bytes(probe.encode_ordinary(_cps_to_str(chunk)))
            matched = np.frombuffer(raw.decode("utf-8").encode("utf-32-le"), dtype="<u4")
            mask[matched] = True
        return mask

    def normalize(self, text: str) -> str:
        return text
