"""Device tables as numpy arrays: exactly the layout the CUDA kernels read.

Three tables per tokenizer, built once and uploaded once:

* **Class table** ``uint32[0x110000]`` (4.4 MB), one word per code point: the
  tokenizer's one class table (``charclass.py`` has the bit layout, the probe and
  the disk cache), with every bit the GPU models read: L N M W (and K for
  DeepSeek), the o200k UP/LO and DeepSeek PS sets, and the contraction fold byte
  (bits 8-15).  The kernels read bits 0-15.

  Classes that are fixed sets of ASCII characters (``\\r\\n``, space, ``'``,
  ``/``, DeepSeek's ``[A-Za-z]`` and ASCII punctuation) are tested on the code
  point itself.

* **Pair table**: open addressing with linear probing, capacity a power of two
  at most half full.  Key ``uint64 (left_id << 32) | right_id``, empty key
  ``2**64-1``, home slot ``(key * 0x9E3779B97F4A7C15 mod 2**64) >> (64 - bits)``.
  Values ``pair_rank`` (merge priority, lower first) and ``pair_merged`` (the id
  the pair becomes).  tiktoken: every split of every mergeable token into two
  mergeable tokens, rank = the merged token's rank; HF: the ``merges`` list,
  rank = its index.

* **Vocab table** (whole-piece lookup; tiktoken always does it, HF when
  ``ignore_merges``): key = FNV-1a-64 of the token bytes, home slot
  ``(key * 0x9E3779B97F4A7C15) >> (64 - bits)``, value = token id; a hit is
  confirmed by comparing bytes against ``tok_blob[tok_off[id]:tok_off[id+1]]``.

``byte_to_id[256]`` gives each single byte's token id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import charclass
from ..errors import UnsupportedTokenizer
from ..families import CLASS_PATTERNS, GPU_CLASS_PATTERNS, GpuRules, gpu_rules

EMPTY64 = np.uint64(0xFFFFFFFFFFFFFFFF)
EMPTY32 = np.uint32(0xFFFFFFFF)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)
TABLE_VERSION = "v1"  # of the BPE tables (the class table's is `charclass.TABLE_VERSION`)


def rules_for(tok) -> GpuRules | None:
    """Which pre-tokenizer rule set models `tok` (its family module says, per pattern), or None
    (unsupported: CPU only)."""
    fam = tok.family_info
    if fam is None or model_gap(tok) is not None:
        return None
    return gpu_rules(tok.engine.facts.split_patterns)


def model_gap(tok) -> str | None:
    """Why the GPU model cannot reproduce `tok` exactly (None: it can); cached per tokenizer.

    The model looks BPE results up by their bytes and splits literals leftmost-longest, so
    it declines (a) a vocab or rank whose id has another canonical spelling in the token
    table (two vocab strings for one id; a special shorter than the rank it shares an id
    with) and (b) tiktoken specials of which one is a prefix of another: tiktoken picks
    among them by its own alternation order, not by length.
    """
    d = derived(tok)
    if "model_gap" in d:
        return d["model_gap"]
    eng, tb = tok.engine, tok.token_bytes
    gap = None
    if eng.engine_name == "tiktoken":
        ranks: dict[bytes, int] = eng._args[2]
        if any(tb[i] != b for b, i in ranks.items()):
            gap = "a rank shares its id with a shorter special token"
        elif _prefix_related([lit.content for lit in eng.literals]):
            gap = "a special token is a prefix of another (tiktoken picks by alternation order, not length)"
    else:
        vocab = eng._tok.get_vocab(with_added_tokens=False)
        if len(set(vocab.values())) != len(vocab):
            gap = "two vocab strings share an id"
    d["model_gap"] = gap
    return gap


def _prefix_related(literals: list[str]) -> bool:
    """Whether one literal is a proper prefix of another: the only case in which a leftmost-first
    alternation and the model's leftmost-longest choice can differ (both take the earliest start)."""
    lits = sorted(set(literals))
    return any(b.startswith(a) for a, b in zip(lits, lits[1:]))  # a prefix sorts right before an extension


def derived(tok) -> dict:
    """The tokenizer's cache of derived, immutable GPU data (class table, BPE tables, literal
    finder): held by the tokenizer object itself, so it lives and dies with it (no global)."""
    return tok.derived


def class_table(tok) -> np.ndarray:
    """The tokenizer's class table with the GPU models' bits (`charclass.class_table`: probed
    from its own engine by the one probe, in the one disk cache)."""
    cached = derived(tok).get("class_table")
    if cached is not None:
        return cached
    fam = tok.family_info
    patterns = {**(fam.class_patterns() if fam is not None else CLASS_PATTERNS), **GPU_CLASS_PATTERNS}
    table = charclass.class_table(tok.engine, tok.engine.class_key, patterns, folds=True)
    derived(tok)["class_table"] = table
    return table


# -- hashing ---------------------------------------------------------------------------------

def mix_slot(keys: np.ndarray, bits: int) -> np.ndarray:
    """Home slot of uint64 keys in a table of 2**bits slots."""
    with np.errstate(over="ignore"):
        return ((keys.astype(np.uint64) * GOLDEN) >> np.uint64(64 - bits)).astype(np.int64)


def fnv1a64(blob: np.ndarray, off: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """FNV-1a 64 of blob[off[i] : off[i] + lens[i]] for every i (vectorized over i)."""
    h = np.full(len(off), FNV_OFFSET, dtype=np.uint64)
    if len(off) == 0:
        return h
    maxlen = int(lens.max()) if len(lens) else 0
    off = off.astype(np.int64)
    with np.errstate(over="ignore"):
        for j in range(maxlen):
            live = lens > j
            idx = np.flatnonzero(live)
            b = blob[off[idx] + j].astype(np.uint64)
            h[idx] = (h[idx] ^ b) * FNV_PRIME
    return h


def build_hash(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Place uint64 keys by linear probing; returns (slot keys, slot -> key index, bits)."""
    n = len(keys)
    bits = max(4, int(np.ceil(np.log2(max(2 * n, 16)))))
    cap = 1 << bits
    slot_keys = np.full(cap, EMPTY64, dtype=np.uint64)
    slot_item = np.full(cap, -1, dtype=np.int64)
    probe = mix_slot(keys, bits)
    pending = np.arange(n)
    while pending.size:
        cand = probe[pending]
        free = slot_keys[cand] == EMPTY64
        idx, cs = pending[free], cand[free]
        uniq, first = np.unique(cs, return_index=True)
        winners = idx[first]
        slot_keys[uniq] = keys[winners]
        slot_item[uniq] = winners
        placed = np.zeros(n, dtype=bool)
        placed[winners] = True
        pending = pending[~placed[pending]]
        probe[pending] = (probe[pending] + 1) & (cap - 1)
    return slot_keys, slot_item, bits


def hash_lookup(slot_keys: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
    """Slot index of each key, or -1 (vectorized linear probing, as the kernels do)."""
    cap = 1 << bits
    out = np.full(len(keys), -1, dtype=np.int64)
    probe = mix_slot(keys, bits)
    pending = np.arange(len(keys))
    while pending.size:
        sk = slot_keys[probe[pending]]
        hit = sk == keys[pending]
        out[pending[hit]] = probe[pending[hit]]
        go = ~hit & (sk != EMPTY64)
        pending = pending[go]
        probe[pending] = (probe[pending] + 1) & (cap - 1)
    return out


# -- BPE tables ------------------------------------------------------------------------------

@dataclass(frozen=True)
class BpeTables:
    byte_to_id: np.ndarray     # uint32[256]
    pair_keys: np.ndarray      # uint64[2**pair_bits]
    pair_rank: np.ndarray      # uint32[2**pair_bits]
    pair_merged: np.ndarray    # uint32[2**pair_bits]
    pair_bits: int
    vocab_keys: np.ndarray     # uint64[2**vocab_bits] FNV-1a-64 of token bytes
    vocab_ids: np.ndarray      # uint32[2**vocab_bits]
    vocab_bits: int
    tok_off: np.ndarray        # uint32[n_ids + 1] offsets into tok_blob
    tok_blob: np.ndarray       # uint8 token bytes, concatenated by id
    max_piece_lookup: int      # longest vocab token (bytes): longer pieces skip the lookup
    whole_piece_lookup: bool   # tiktoken always; HF when ignore_merges

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, np.ndarray)}


def _byte_level_inverse() -> dict[str, int]:
    from ..token_table import byte_level_alphabet

    return byte_level_alphabet()


def bpe_tables(tok) -> BpeTables:
    """Build (or read from the disk cache) the BPE tables of a byte-level tokenizer."""
    cached = derived(tok).get("bpe_tables")
    if cached is not None:
        return cached
    path = charclass.cache_dir() / "gpu_bpe" / f"{tok.hash}-{TABLE_VERSION}.npz"
    tables = None
    try:
        with np.load(path, allow_pickle=False) as z:
            d = {k: z[k] for k in z.files}
        meta = d.pop("meta")
        tables = BpeTables(pair_bits=int(meta[0]), vocab_bits=int(meta[1]), max_piece_lookup=int(meta[2]),
                           whole_piece_lookup=bool(meta[3]), **d)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if tables is None:
        tables = _build_bpe_tables(tok)
        meta = np.array([tables.pair_bits, tables.vocab_bits, tables.max_piece_lookup,
                         int(tables.whole_piece_lookup)], dtype=np.int64)
        charclass.save_npz(path, meta=meta, **tables.arrays())
    derived(tok)["bpe_tables"] = tables
    return tables


def _check_one_merge_per_rank(rank: np.ndarray, merged: np.ndarray) -> None:
    """The kernels merge every pair of a round's rank into one id (tt_bpe.cuh): check it.

    Holds for HF (one merge per rank) and tiktoken (rank == merged id); a file that
    breaks it gets no GPU tables, so the router keeps it on the CPU.
    """
    order = np.lexsort((merged, rank))
    r, m = rank[order], merged[order]
    clash = np.flatnonzero((r[1:] == r[:-1]) & (m[1:] != m[:-1]))
    if len(clash):
        i = int(clash[0])
        raise UnsupportedTokenizer(f"merge rank {int(r[i])} yields two tokens ({int(m[i])}, {int(m[i + 1])}); "
                                   "the GPU BPE kernels need one merged token per rank")


def _build_bpe_tables(tok) -> BpeTables:
    eng = tok.engine
    if hasattr(eng, "_enc"):  # tiktoken
        ranks: dict[bytes, int] = eng._args[2]
        vocab = ranks
        left, right, rank, merged = [], [], [], []
        get = ranks.get
        for t, r in ranks.items():
            for k in range(1, len(t)):
                a = get(t[:k])
                if a is not None:
                    b = get(t[k:])
                    if b is not None:
                        left.append(a), right.append(b), rank.append(r), merged.append(r)
        byte_to_id = np.array([ranks[bytes([b])] for b in range(256)], dtype=np.uint32)
        whole = True
    else:
        model = eng._config["model"]
        dec = _byte_level_inverse()
        svocab: dict[str, int] = model["vocab"]
        vocab = {}
        for s, i in svocab.items():
            if all(ch in dec for ch in s):  # entries outside the byte alphabet are added tokens' text
                vocab[bytes(dec[ch] for ch in s)] = i
        left, right, rank, merged = [], [], [], []
        for r, m in enumerate(model["merges"]):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            left.append(svocab[a]), right.append(svocab[b]), rank.append(r), merged.append(svocab[a + b])
        inv = {v: k for k, v in dec.items()}
        byte_to_id = np.array([svocab[inv[b]] for b in range(256)], dtype=np.uint32)
        whole = bool(model.get("ignore_merges", False))
    keys = (np.array(left, dtype=np.uint64) << np.uint64(32)) | np.array(right, dtype=np.uint64)
    # A pair listed twice (tiktoken: never; HF: never in practice) keeps its lowest rank.
    order = np.lexsort((np.array(rank), keys))
    keys_s = keys[order]
    keep = np.ones(len(keys_s), dtype=bool)
    keep[1:] = keys_s[1:] != keys_s[:-1]
    sel = order[keep]
    keys = keys[sel]
    rank_a = np.array(rank, dtype=np.uint32)[sel]
    merged_a = np.array(merged, dtype=np.uint32)[sel]
    _check_one_merge_per_rank(rank_a, merged_a)
    slot_keys, slot_item, pbits = build_hash(keys)
    pair_rank = np.full(len(slot_keys), EMPTY32, dtype=np.uint32)
    pair_merged = np.full(len(slot_keys), EMPTY32, dtype=np.uint32)
    used = slot_item >= 0
    pair_rank[used] = rank_a[slot_item[used]]
    pair_merged[used] = merged_a[slot_item[used]]
    # token bytes by id (all ids the engine knows: specials' text too, for spans)
    tb = tok.token_bytes
    lens = np.fromiter((len(b) for b in tb), dtype=np.int64, count=len(tb))
    tok_off = np.zeros(len(tb) + 1, dtype=np.int64)
    np.cumsum(lens, out=tok_off[1:])
    tok_blob = np.frombuffer(b"".join(tb), dtype=np.uint8).copy()
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
    vlens = lens[ids]
    # ids whose stored bytes differ from the vocab bytes (HF added tokens shadowing vocab) are skipped
    vb = list(vocab.keys())
    ok = np.fromiter((tb[i] == b for b, i in zip(vb, ids.tolist())), dtype=bool, count=len(ids))
    ids, vlens = ids[ok], vlens[ok]
    vkeys = fnv1a64(tok_blob, tok_off[ids], vlens)
    vslot_keys, vslot_item, vbits = build_hash(vkeys)
    vocab_ids = np.full(len(vslot_keys), EMPTY32, dtype=np.uint32)
    vocab_ids[vslot_item >= 0] = ids[vslot_item[vslot_item >= 0]]
    return BpeTables(
        byte_to_id=byte_to_id, pair_keys=slot_keys, pair_rank=pair_rank, pair_merged=pair_merged, pair_bits=pbits,
        vocab_keys=vslot_keys, vocab_ids=vocab_ids, vocab_bits=vbits, tok_off=tok_off.astype(np.uint32),
        tok_blob=tok_blob, max_piece_lookup=int(vlens.max()), whole_piece_lookup=whole,
    )
