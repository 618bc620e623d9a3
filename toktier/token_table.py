"""Per-token facts that repair relies on, read from the reference engine itself.

Repair turns token IDs back into byte spans (a token's start is the sum of the
byte lengths before it), so the id -> bytes table must be the one the *engine*
uses.  A tokenizer file's declared ids are not: HF `tokenizers` gives an added
token whose content is already a vocab word that word's id, numbers new added
tokens in list order (gaps and overrides in the file are ignored), and two vocab
strings may share one id.  So the table is built from the engine's own maps
(`get_vocab`, `get_added_tokens_decoder`, `id_to_token`; tiktoken's ranks and
`decode_single_token_bytes`) and cross-checked by encoding probes at load.

Every id gets its *canonical* bytes; an id is **uncertain** when the span it
covers in a text is not always those bytes:

* ambiguous: the engine can emit it for several byte strings (an added token
  whose content equals a vocab string with other bytes, e.g. ``"Ġ"`` vs ``" "``;
  two vocab strings or two specials with one id);
* unknown: no byte string is known (an unknown-token id, a gap in the ids).

A token list containing uncertain ids is accepted for splicing only when
`canonical_spans_ok` proves, by walking the text, that each of them covers its
canonical bytes; otherwise the caller takes the full path.

>>> t = TokenTable.build({0: [b"a"], 1: [b"b", b"bb"], 3: [b"c"]}, literal_ids={}, problems=())
>>> t.token_len.tolist(), t.uncertain_ids().tolist()
([1, 1, 0, 1], [1, 2])
>>> import numpy as np
>>> t.canonical_spans_ok(np.array([0, 1, 3], dtype=np.uint32), b"abc")
True
>>> t.canonical_spans_ok(np.array([0, 1, 3], dtype=np.uint32), b"abbc")   # 1 covered "bb"
False
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2 ByteLevel alphabet: the character standing for each byte -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = 256 + extra
            extra += 1
    return {chr(cp): b for b, cp in mapping.items()}


def utf8_byte_probe_chars() -> list[str]:
    """One short text per byte value that valid UTF-8 can contain (all but C0, C1, F5-FF).

    Encoding each of them alone shows whether every text byte has a token.
    """
    chars = [chr(c) for c in range(0x80)]
    chars += [chr(0x80 | (c & 0x3F)) if c < 0xC0 else "" for c in range(0x80, 0xC0)]  # C2 80..BF
    chars += [chr((lead - 0xC0) << 6 | 0x00) for lead in range(0xC2, 0xE0)]  # 2-byte leads
    chars += [chr(0x0800 if lead == 0xE0 else (lead - 0xE0) << 12) for lead in range(0xE0, 0xF0)]
    chars += [chr(0x10000 if lead == 0xF0 else (lead - 0xF0) << 18) for lead in range(0xF0, 0xF5)]
    return [c for c in chars if c]


def _byte_level_decoder(alphabet: dict[str, int]):
    """A fast `str -> bytes | None` for byte-level strings (None: a character outside the alphabet)."""
    table = {cp: "\uffff" for cp in range(0x180)}  # anything not in the alphabet fails latin-1
    table.update({ord(c): chr(b) for c, b in alphabet.items()})

    def decode(s: str) -> bytes | None:
        try:
            return s.translate(table).encode("latin-1")
        except UnicodeEncodeError:
            return None

    return decode


@dataclass(frozen=True, eq=False)
class TokenTable:
    """Canonical bytes per id, the ids whose span may differ, and the literals' ids.

    `token_len` is read-only; `alternatives[id]` lists every byte string the
    engine may emit `id` for (only for ambiguous ids); `literal_ids` maps each
    added-token / special content to the id the engine emits for it.
    """

    token_bytes: list[bytes] = field(repr=False)
    token_len: np.ndarray = field(repr=False)  # uint32 canonical byte length per id
    uncertain: np.ndarray = field(repr=False)  # bool per id: span not always token_bytes[id]
    alternatives: Mapping[int, tuple[bytes, ...]] = field(repr=False)
    literal_ids: Mapping[str, int] = field(repr=False)
    problems: tuple[str, ...] = ()
    any_uncertain: bool = False
    #: Ids whose spellings are not all known (an unknown-token id covers whatever text has no
    #: token): never proven by a walk, whatever bytes they are listed with.
    unknown: frozenset[int] = frozenset()

    @classmethod
    def build(cls, spans: Mapping[int, bytes | Sequence[bytes]], *, literal_ids: Mapping[str, int],
              problems: Iterable[str], unknown: Iterable[int] = ()) -> "TokenTable":
        """From every (id -> the byte string(s) the engine may emit it for).

        Ids in `unknown` (and ids absent from `spans`) are uncertain.
        """
        unknown = set(unknown)
        size = max(max(spans, default=-1), max(unknown, default=-1)) + 1
        table: list[bytes] = [b""] * size
        alts: dict[int, tuple[bytes, ...]] = {}
        for i, options in spans.items():
            if isinstance(options, bytes):  # the common case: one span
                table[i] = options
                continue
            opts = tuple(dict.fromkeys(o for o in options if o))  # distinct, order kept
            if not opts:
                continue
            # The shortest (then smallest) alternative: a byte or vocab word is what ordinary text holds,
            # a longer literal spelling the rare case; deterministic, unlike the engine's hash-map order.
            table[i] = min(opts, key=lambda b: (len(b), b))
            if len(opts) > 1:
                alts[i] = opts
        token_len = np.fromiter(map(len, table), dtype=np.uint32, count=size)
        uncertain = token_len == 0
        if alts:
            uncertain[np.fromiter(alts, dtype=np.int64, count=len(alts))] = True
        if unknown:
            uncertain[np.fromiter(unknown, dtype=np.int64, count=len(unknown))] = True
        token_len.setflags(write=False)
        uncertain.setflags(write=False)
        return cls(table, token_len, uncertain, alts, dict(literal_ids), tuple(problems), bool(uncertain.any()),
                   frozenset(i for i in unknown if table[i]))  # (ids without bytes fail the walk anyway)

    def __len__(self) -> int:
        return len(self.token_bytes)

    @property
    def max_token_bytes(self) -> int:
        return int(self.token_len.max()) if len(self.token_len) else 0

    def spans_consistent(self, ids: np.ndarray, text: bytes) -> bool:
        """Whether `ids` can tile `text` with each token covering one of its allowed byte strings.

        A load-time check (probes are short): where several alternatives fit, each is tried.
        """
        seqs = [(self.token_bytes[i], *self.alternatives.get(i, ())) for i in ids.tolist()]

        def fits(k: int, pos: int) -> bool:
            if k == len(seqs):
                return pos == len(text)
            return any(b and text.startswith(b, pos) and fits(k + 1, pos + len(b)) for b in dict.fromkeys(seqs[k]))

        return fits(0, 0)

    def uncertain_ids(self) -> np.ndarray:
        return np.flatnonzero(self.uncertain).astype(np.uint32)

    def has_uncertain(self, ids: np.ndarray) -> bool:
        """Whether `ids` holds an uncertain id (O(len(ids)); False at once when none exist)."""
        return self.any_uncertain and bool(self.uncertain[ids].any())

    def canonical_spans_ok(self, ids: np.ndarray, text: bytes) -> bool:
        """Whether every token of `ids` covers exactly its canonical bytes when `ids` encodes `text`.

        Walks left to right: all tokens before an uncertain one are certain (or
        proven), so its start is exact; it is proven only when its canonical bytes
        are the *only* alternative present in `text` there.  An id with no known
        bytes, or with spellings not all known (`unknown`), is never proven.  Certain tokens need no check: the engine emits them
        for their canonical bytes only.  The lengths must also sum to len(text).
        """
        lens = self.token_len[ids]
        if int(lens.sum(dtype=np.int64)) != len(text):
            return False
        where = np.flatnonzero(self.uncertain[ids]) if self.any_uncertain else ()
        if not len(where):
            return True
        starts = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        for k in where.tolist():
            i = int(ids[k])
            pos = int(starts[k])
            canon = self.token_bytes[i]
            if not canon or i in self.unknown or text[pos:pos + len(canon)] != canon:
                return False
            for alt in self.alternatives.get(i, ()):
                if alt != canon and text[pos:pos + len(alt)] == alt:
                    return False  # the engine may have emitted it for `alt`: not provable
        return True


def hf_table(tok, *, byte_level: bool, added: Mapping[int, object]) -> TokenTable:
    """The table of an HF `tokenizers.Tokenizer`, from the engine's own maps.

    `added` is the engine's `get_added_tokens_decoder()` (true id -> AddedToken).
    Vocab strings are byte-level strings when `byte_level` (anything else cannot be
    decoded to bytes here: those ids are unknown unless an added token names them).
    """
    vocab: dict[str, int] = tok.get_vocab(with_added_tokens=False)
    dec = byte_level_alphabet()
    spans: dict[int, list[bytes]] = {}
    unknown: set[int] = set()
    decode = _byte_level_decoder(dec)
    for s, i in vocab.items():
        b = decode(s) if byte_level else None
        if b is None:  # not a byte-level string: BPE over byte-level text never emits it
            if int(i) not in added:
                unknown.add(int(i))
            continue
        prev = spans.get(i)
        spans[i] = b if prev is None else [*([prev] if isinstance(prev, bytes) else prev), b]
    literal_ids: dict[str, int] = {}
    for i, a in added.items():
        i, content = int(i), a.content
        literal_ids[content] = i
        prev = spans.get(i)
        if prev is None:
            spans[i] = content.encode("utf-8")
        else:  # the content is a vocab string too: both spans are possible
            spans[i] = [*([prev] if isinstance(prev, bytes) else prev), content.encode("utf-8")]
    problems: list[str] = []
    model = tok.model
    unk = getattr(model, "unk_token", None)
    if unk is not None:
        uid = tok.token_to_id(unk)
        if uid is not None:
            unknown.add(int(uid))  # it covers whatever text has no token: never a fixed span
    if byte_level:
        missing = [b for b, c in ((b, c) for c, b in dec.items()) if c not in vocab]
        reachable = [b for b in missing if not (b in (0xC0, 0xC1) or b >= 0xF5)]
        if reachable:
            shown = ", ".join(f"0x{b:02X}" for b in reachable[:8]) + (" ..." if len(reachable) > 8 else "")
            how = f"emits {unk!r} for them" if unk is not None else "drops them"
            problems.append(f"byte-level vocab misses {len(reachable)} text byte(s) ({shown}); the engine {how}")
    return TokenTable.build(spans, literal_ids=literal_ids, problems=problems, unknown=unknown)


def tiktoken_table(ranks: Mapping[bytes, int], special_tokens: Mapping[str, int]) -> TokenTable:
    """The table of a `tiktoken.Encoding` built from exactly these ranks and special tokens."""
    spans: dict[int, bytes | list[bytes]] = {int(i): b for b, i in ranks.items()}
    if len(spans) < len(ranks):  # several byte strings with one rank
        for b, i in ranks.items():
            prev = spans[i]
            if isinstance(prev, bytes):
                spans[i] = prev = [prev]
            if b not in prev:
                prev.append(b)
    for s, i in special_tokens.items():
        prev = spans.get(int(i))
        b = s.encode("utf-8")
        spans[int(i)] = b if prev is None else [*([prev] if isinstance(prev, bytes) else prev), b]
    return TokenTable.build(spans, literal_ids=dict(special_tokens), problems=())


def cross_check(table: TokenTable, encode_batch, literal_contents: Iterable[str], normalize=None,
                vocab_sample: int = 2048) -> list[str]:
    """Encode probes with the engine and check the table against what comes back.

    Probes: every active literal alone (a single token must be its id), one text per
    UTF-8 byte value, and an even sample of vocab tokens whose bytes are text.  Each
    result must tile its probe (normalized by `normalize`, literals raw) with every
    token covering one of the byte strings the table allows for it.  Returns the
    problems found.
    """
    lits = [c for c in dict.fromkeys(literal_contents) if c]
    singles = utf8_byte_probe_chars()
    ids = np.arange(len(table), dtype=np.int64)
    step = max(1, len(ids) // vocab_sample)
    sample: list[str] = []
    for i in ids[::step].tolist():
        try:
            sample.append(table.token_bytes[i].decode("utf-8"))
        except UnicodeDecodeError:
            continue
    problems: list[str] = []
    if lits and _literals_pass_joined(table, encode_batch, lits):
        lits = []  # all verified in one encode (tiktoken: ~0.3 ms a probe with 1K specials)
    rest = singles + [s for s in sample if s]
    joined = "\n".join(rest)
    (got,) = encode_batch([joined])
    raw = (normalize(joined) if normalize else joined).encode("utf-8")
    if len(got) and int(got.max()) < len(table) and table.canonical_spans_ok(got, raw):
        rest = []  # one encode tiles every byte and sampled token: no need to probe them one by one
    probes = lits + rest
    results = encode_batch(probes)
    for k, (text, got) in enumerate(zip(probes, results)):
        raw = text.encode("utf-8") if k < len(lits) or normalize is None else normalize(text).encode("utf-8")
        if len(got) and int(got.max()) >= len(table):
            problems.append(f"probe {text!r} gives id {int(got.max())}, outside the table")
        elif k < len(lits) and len(got) == 1:
            # A literal alone is its own token: the id the table names, with these bytes among its spans.
            i = int(got[0])
            if i != table.literal_ids.get(text) or raw not in (table.token_bytes[i], *table.alternatives.get(i, ())):
                problems.append(f"added token {text!r} encodes as id {i}; the table says "
                                f"{table.literal_ids.get(text)} with bytes {table.token_bytes[i]!r}")
        elif not table.spans_consistent(got, raw):  # (a literal that overlapping literals split, too)
            problems.append(f"probe {text!r}: token bytes {[table.token_bytes[i] for i in got.tolist()[:4]]} "
                            f"do not tile its {len(raw)} bytes")
        if len(problems) >= 3:
            problems.append("(further probes not checked)")
            break
    return problems


def _literals_pass_joined(table: TokenTable, encode_batch, lits: list[str], sep: str = "\n") -> bool:
    """Whether every literal, encoded between separators in one text, is exactly its own id.

    Literals are extracted before pre-tokenization, so one alone encodes as it does
    between separators; any surprise sends the caller to one probe per literal.
    """
    joined, sep_ids = encode_batch([sep.join(lits), sep])
    expected: list[int] = []
    for k, lit in enumerate(lits):
        i = table.literal_ids.get(lit)
        if i is None or i >= len(table) or lit.encode("utf-8") not in (table.token_bytes[i], *table.alternatives.get(i, ())):
            return False
        expected.append(i)
        if k + 1 < len(lits):
            expected.extend(sep_ids.tolist())
    return np.array_equal(joined, np.asarray(expected, dtype=joined.dtype))
