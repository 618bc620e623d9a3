"""Crafted tokenizer files: real reference files with one thing changed, as vendors ship them.

Each variant is a `tokenizer.json` (HF) or a tiktoken rank file + special tokens
derived from a bundled reference file, or a small tokenizer trained here with HF
`tokenizers` itself (Metaspace BPE, WordPiece).  `expect` says what TokTier must
do with it: "splice" (a proven family: sessions repair), "full" (served exactly,
every op through the full path) or "refuse" (typed `UnsupportedTokenizer`).

`declared_id_table` rebuilds the id -> bytes table the way TokTier once did, from
the file's *declared* ids; the campaign's mutation check proves it would fail.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from toktier import bundled
from toktier.families import _QWEN
from toktier.token_table import TokenTable, byte_level_alphabet


@dataclass(frozen=True)
class Variant:
    name: str
    expect: str  # "splice", "full" or "refuse"
    kind: str  # "hf" or "tiktoken"
    build: Callable[[Path], dict] = field(repr=False)  # writes the files, returns load_tokenizer kwargs
    literals: tuple[str, ...] = ()  # texts worth putting into the sessions (literals and lookalikes)
    declared_ids_differ: bool = False  # the file's declared ids are not the engine's
    # The literals include an id the engine emits for two byte strings, or text NFC changes: the
    # sessions that hold them may rightly take the full path (the span is unprovable there).
    text_may_stop_splices: bool = False
    expect_none: str = ""  # what specials="none" must do, when it differs (an inactive special literal)

    def expected(self, mode: str) -> str:
        return self.expect_none if mode == "none" and self.expect_none else self.expect


def _flags(**kw) -> dict:
    return {"special": True, "normalized": False, "lstrip": False, "rstrip": False, "single_word": False} | kw


def _add(j: dict, content: str, id: int, **kw) -> None:
    j["added_tokens"].append(dict(_flags(**kw), id=id, content=content))


def _byte_char(b: int) -> str:
    return {v: k for k, v in byte_level_alphabet().items()}[b]


def _drop_byte(j: dict, b: int, unk: bool) -> None:
    """Remove one byte's symbol (and every merge that needs it); optionally name an unk token."""
    ch = _byte_char(b)
    model = j["model"]
    old = model["vocab"].pop(ch)
    model["vocab"] = {s: i for s, i in model["vocab"].items() if ch not in s}
    merges = model["merges"]
    model["merges"] = [m for m in merges if ch not in (m if isinstance(m, str) else "".join(m))]
    if unk:
        model["vocab"]["<unk>"] = old
        model["unk_token"] = "<unk>"


def _set_pre(j: dict, pre: dict) -> None:
    j["pre_tokenizer"] = pre


def _split_regex(j: dict) -> dict:
    steps = j["pre_tokenizer"]["pretokenizers"]
    return next(s for s in steps if s.get("type") == "Split")


_HF_BASES = {"llama3": "llama3", "qwen3": "qwen3", "deepseek": "deepseek_v4"}
_JSON_CACHE: dict[str, dict] = {}


def _base_json(base: str) -> dict:
    if base not in _JSON_CACHE:
        path = bundled.BUNDLED[_HF_BASES[base]].path()
        _JSON_CACHE[base] = json.loads(path.read_text(encoding="utf-8"))
    return copy.deepcopy(_JSON_CACHE[base])


def _hf(base: str, mutate: Callable[[dict], None]) -> Callable[[Path], dict]:
    def build(d: Path) -> dict:
        j = _base_json(base)
        mutate(j)
        p = d / "tokenizer.json"
        p.write_text(json.dumps(j, ensure_ascii=False), encoding="utf-8")
        return {"name_or_path": p}
    return build


def _trained(model: str) -> Callable[[Path], dict]:
    """A small tokenizer trained here with HF `tokenizers` (no hub): Metaspace BPE or WordPiece."""
    def build(d: Path) -> dict:
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

        from toktier.tools import corpus

        text = [s.text[:3000] for s in corpus.samples(3000, seed=0)]
        if model == "metaspace-bpe":
            tok = Tokenizer(models.BPE(unk_token="<unk>"))
            tok.pre_tokenizer = pre_tokenizers.Metaspace()
            trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
        else:
            tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
            tok.normalizer = normalizers.BertNormalizer()
            tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
            trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
        tok.train_from_iterator(text, trainer)
        p = d / "tokenizer.json"
        tok.save(str(p))
        return {"name_or_path": p}
    return build


def _tiktoken(ranks_mut: Callable[[dict], None] | None, specials: dict[str, int], pat: str = "") -> Callable[[Path], dict]:
    def build(d: Path) -> dict:
        ranks = bundled.load_rank_file(bundled.BUNDLED["cl100k_base"].path())
        if ranks_mut:
            ranks_mut(ranks)
        import base64

        p = d / "crafted.tiktoken"
        with open(p, "wb") as f:
            for b, r in sorted(ranks.items(), key=lambda kv: kv[1]):
                f.write(base64.b64encode(b) + b" " + str(r).encode() + b"\n")
        return {"name_or_path": p, "pat_str": pat or bundled.CL100K_PAT, "special_tokens": dict(specials)}
    return build


def _dup_rank(ranks: dict) -> None:
    ranks[b"zzqq"] = 100


def _drop_rank_byte(ranks: dict) -> None:
    del ranks[b"\x01"]


def _rank_gaps(ranks: dict) -> None:
    for b in [b for b, r in ranks.items() if r >= 90_000 and r % 7 == 0]:
        del ranks[b]


def _shuffle(seed: int) -> Callable[[dict], None]:
    def mutate(j: dict) -> None:
        random.Random(seed).shuffle(j["added_tokens"])
    return mutate


def _chain(*fns: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(j: dict) -> None:
        for f in fns:
            f(j)
    return mutate


CL = bundled.CL100K_SPECIALS
OVERLAP = ("<|a|>", "<|a|>b", "a|>b<", "<|")
TOOL = ("<|tool|>", "<|tool_call|>", "<|tool_call_end|>")

VARIANTS: tuple[Variant, ...] = (
    # -- added tokens whose declared ids are not the engine's -------------------------------
    Variant("gap-id", "splice", "hf", _hf("llama3", lambda j: _add(j, "<|gap|>", 130000)), ("<|gap|>",), True),
    Variant("far-gap-ids", "splice", "hf", _hf("llama3", lambda j: (_add(j, "<|far1|>", 200000),
                                                                     _add(j, "<|far2|>", 150000))),
            ("<|far1|>", "<|far2|>"), True),
    Variant("vocab-word-special", "splice", "hf", _hf("llama3", lambda j: _add(j, "hello", 128256)),
            ("hello", " hello", "hellothere"), True),
    Variant("vocab-word-plain", "splice", "hf", _hf("llama3", lambda j: _add(j, "hello", 128256, special=False)),
            ("hello", " hello", "hellohello"), True),
    Variant("byte-char-plain", "splice", "hf", _hf("llama3", lambda j: _add(j, "\u0120", 128256, special=False)),
            ("\u0120", " ", " \u0120 ", "\u0120the"), True, text_may_stop_splices=True),
    Variant("byte-char-special", "splice", "hf", _hf("llama3", lambda j: _add(j, "\u0120", 128256)),
            ("\u0120", " ", "\u0120\u0120"), True, text_may_stop_splices=True),
    Variant("latin1-char", "splice", "hf", _hf("llama3", lambda j: _add(j, "§", 128256, special=False)),
            ("§", " §", "§§", "\u00a7x"), True, text_may_stop_splices=True),
    Variant("space-the", "splice", "hf", _hf("llama3", lambda j: _add(j, " the", 128256, special=False)),
            (" the", " then", "the"), False),
    Variant("double-newline", "splice", "hf", _hf("llama3", lambda j: _add(j, "\n\n", 128256)),
            ("\n\n", "\n", "\n\n\n", " \n\n "), False),
    Variant("reversed-list", "splice", "hf", _hf("llama3", lambda j: j["added_tokens"].reverse()),
            ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|reserved_special_token_5|>"), True),
    Variant("shuffled-list", "splice", "hf", _hf("llama3", _shuffle(7)),
            ("<|begin_of_text|>", "<|eot_id|>", "<|end_header_id|>", "<|reserved_special_token_77|>"), True),
    Variant("id-override", "splice", "hf", _hf("llama3", lambda j: _add(j, "<|x|>", 100)), ("<|x|>",), True),
    Variant("same-declared-id", "splice", "hf", _hf("llama3", lambda j: (_add(j, "<|p|>", 128300),
                                                                         _add(j, "<|q|>", 128300))),
            ("<|p|>", "<|q|>"), True),
    Variant("duplicate-entry", "splice", "hf", _hf("llama3", lambda j: _add(j, "<|eot_id|>", 128999)),
            ("<|eot_id|>",), True),
    Variant("overlapping-literals", "splice", "hf",
            _hf("llama3", lambda j: [_add(j, c, 128256 + k) for k, c in enumerate(OVERLAP)]), OVERLAP + ("<|a|>b<|a|>",)),
    Variant("prefix-literals", "splice", "hf",
            _hf("llama3", lambda j: [_add(j, c, 128256 + k, special=False) for k, c in enumerate(TOOL)]), TOOL),
    Variant("normalized-flag", "splice", "hf", _hf("llama3", lambda j: _add(j, "<|nm|>", 128256, normalized=True)),
            ("<|nm|>",)),
    Variant("dup-vocab-id", "splice", "hf", _hf("llama3", lambda j: j["model"]["vocab"].__setitem__("zzqq", 100)),
            ("zzqq", "§", " zzqq", "\u00a7"), text_may_stop_splices=True),
    Variant("merges-not-ignored", "splice", "hf", _hf("llama3", lambda j: j["model"].__setitem__("ignore_merges", False)),
            ()),
    Variant("qwen-regex", "splice", "hf", _hf("llama3", lambda j: _split_regex(j)["pattern"].__setitem__("Regex", _QWEN)),
            ("12345",)),
    Variant("nfc-normalizer", "splice", "hf", _hf("llama3", lambda j: j.__setitem__("normalizer", {"type": "NFC"})),
            ("e\u0301", "\u00e9", "A\u030a"), text_may_stop_splices=True),
    Variant("qwen3-gap-and-latin1", "splice", "hf", _hf("qwen3", lambda j: (_add(j, "<|gap|>", 300000),
                                                                             _add(j, "é", 151700, special=False))),
            ("<|gap|>", "é", "e\u0301", "<|im_start|>"), True, text_may_stop_splices=True),
    Variant("deepseek-reversed", "splice", "hf", _hf("deepseek", lambda j: j["added_tokens"].reverse()),
            ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"), True),
    # -- features that break "token bytes tile the text", or have no proven rule: full path --
    Variant("lstrip", "full", "hf", _hf("llama3", lambda j: _add(j, "<|ls|>", 128256, lstrip=True)), ("<|ls|>", " <|ls|>"),
            expect_none="splice"),
    Variant("rstrip", "full", "hf", _hf("llama3", lambda j: _add(j, "<|rs|>", 128256, rstrip=True)), ("<|rs|>", "<|rs|> "),
            expect_none="splice"),
    Variant("single-word", "full", "hf", _hf("llama3", lambda j: _add(j, "word", 128256, special=False, single_word=True)),
            ("word", " word ", "swordfish")),
    Variant("unk-missing-byte", "full", "hf", _hf("llama3", lambda j: _drop_byte(j, 0x01, unk=True)), ("\x01", "a\x01b")),
    Variant("missing-byte-no-unk", "full", "hf", _hf("llama3", lambda j: _drop_byte(j, 0x02, unk=False)), ("\x02",)),
    Variant("byte-fallback", "full", "hf", _hf("llama3", lambda j: j["model"].__setitem__("byte_fallback", True)), ()),
    Variant("unknown-regex", "full", "hf",
            _hf("llama3", lambda j: _split_regex(j)["pattern"].__setitem__("Regex", r"\p{N}{1,4}|[^\p{N}]+")), ("12345",)),
    Variant("split-removed", "full", "hf", _hf("llama3", lambda j: _split_regex(j).__setitem__("behavior", "Removed")), ()),
    Variant("nfkc-normalizer", "full", "hf", _hf("llama3", lambda j: j.__setitem__("normalizer", {"type": "NFKC"})),
            ("ﬁ", "①", "Ⅻ")),
    Variant("lowercase", "full", "hf", _hf("llama3", lambda j: j.__setitem__("normalizer", {"type": "Lowercase"})),
            ("HELLO", "Hello")),
    Variant("gpt2-bytelevel", "full", "hf", _hf("llama3", lambda j: _set_pre(j, {
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True})), ("'s", " 123")),
    Variant("prefix-space", "full", "hf", _hf("llama3", lambda j: _set_pre(j, {
        "type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True})), ()),
    Variant("metaspace-bpe", "full", "hf", _trained("metaspace-bpe"), ("<s>", "</s>", "<unk>")),
    Variant("wordpiece", "full", "hf", _trained("wordpiece"), ("[CLS]", "[SEP]", "##")),
    # -- tiktoken rank files and special tokens -------------------------------------------------
    Variant("tt-special-collides-rank", "splice", "tiktoken", _tiktoken(None, CL | {"<|x|>": 100}),
            ("<|x|>", "\u0089", "<|endoftext|>"), text_may_stop_splices=True),
    Variant("tt-overlapping-specials", "splice", "tiktoken",
            _tiktoken(None, CL | {c: 100300 + k for k, c in enumerate(OVERLAP)}), OVERLAP + ("<|a|>b<|a|>",)),
    Variant("tt-gap-ids", "splice", "tiktoken", _tiktoken(None, {"<|far|>": 250000, "<|endoftext|>": 100257}),
            ("<|far|>",)),
    Variant("tt-shared-id", "splice", "tiktoken", _tiktoken(None, {"<|p|>": 100300, "<|q|>": 100300}),
            ("<|p|>", "<|q|>"), text_may_stop_splices=True),
    Variant("tt-special-is-text", "splice", "tiktoken", _tiktoken(None, {"hello": 100300, " the": 100301}),
            ("hello", " the", " then")),
    Variant("tt-rank-gaps", "splice", "tiktoken", _tiktoken(_rank_gaps, CL), ()),
    Variant("tt-o200k-pattern", "splice", "tiktoken", _tiktoken(None, CL, bundled.O200K_PAT), ("'s", "Hello")),
    Variant("tt-unknown-pattern", "full", "tiktoken", _tiktoken(None, CL, r"\p{L}+|\p{N}+|[^\p{L}\p{N}]+"), ()),
    Variant("tt-duplicate-rank", "refuse", "tiktoken", _tiktoken(_dup_rank, CL), ()),
    Variant("tt-missing-byte", "refuse", "tiktoken", _tiktoken(_drop_rank_byte, CL), ()),
    Variant("tt-empty-special", "refuse", "tiktoken", _tiktoken(None, {"": 100300}), ()),
)


def declared_id_table(path: Path) -> TokenTable:
    """The id -> bytes table built from the file's *declared* ids (the old, wrong way)."""
    j = json.loads(Path(path).read_text(encoding="utf-8"))
    vocab = j["model"]["vocab"]
    added = {t["content"]: int(t["id"]) for t in j.get("added_tokens", [])}
    dec = byte_level_alphabet()
    spans: dict[int, bytes] = {}
    for s, i in vocab.items():
        if s in added or not all(c in dec for c in s):
            continue
        spans[i] = bytes(dec[c] for c in s)
    for content, i in added.items():
        spans[i] = content.encode("utf-8")
    return TokenTable.build(spans, literal_ids=added, problems=())
