// TokTier GPU full path: shared definitions (class bits, device structs, hashing).
// The layouts here are mirrored by toktier/gpu/tables.py (tables) and
// toktier/gpu/driver.py (the Bufs/Tables structs: every field is 8 bytes).
#pragma once
#include <stdint.h>

// ---- class bits: bits 0-15 come from the probed table (tables.py), 16+ are derived here
#define TT_L 1u
#define TT_N 2u
#define TT_M 4u
#define TT_W 8u
#define TT_K 16u
#define TT_UP 32u
#define TT_LO 64u
#define TT_PS 128u
#define TT_FOLD_SHIFT 8
#define TT_R (1u << 16)      /* \r \n */
#define TT_SP (1u << 17)     /* U+0020 */
#define TT_AP (1u << 18)     /* ' */
#define TT_SL (1u << 19)     /* / */
#define TT_AA (1u << 20)     /* DeepSeek ASCII punctuation */
#define TT_Aa (1u << 21)     /* [A-Za-z] */
#define TT_LIT (1u << 31)    /* inside an added-token literal (split out by the host) */

#define TT_BIG 0x7FFFFFFF
#define TT_EMPTY64 0xFFFFFFFFFFFFFFFFull
#define TT_EMPTY32 0xFFFFFFFFu
#define TT_GOLDEN 0x9E3779B97F4A7C15ull
#define TT_FNV_OFFSET 0xCBF29CE484222325ull
#define TT_FNV_PRIME 0x100000001B3ull

// meta[] slots (device ints; the host reads them once per request)
#define TT_META_NBYTES 0
#define TT_META_NCHARS 1
#define TT_META_NPIECES 2
#define TT_META_NTOKENS 3
#define TT_META_STATUS 4
#define TT_META_NSMALL 5
#define TT_META_NWARP 6
#define TT_META_NBLOCK 7
#define TT_META_CHANGED 8
#define TT_META_NLITS 9
#define TT_META_SLOTS 16

// status bits: the host falls back to the CPU path when any is set
#define TT_STATUS_CHAIN_UNRESOLVED 1   /* o200k chain fixpoint needs more rounds than captured */

#define TT_NSCRATCH 24

// Per-request buffers of one size bucket (device memory, pointers only).
struct TTBufs {
    uint8_t* buf;          // UTF-8 input, cap_bytes
    int* meta;             // TT_META_SLOTS
    int* lit_s;            // literal spans (byte offsets) and ids, cap_lits
    int* lit_e;
    int* lit_id;
    int* byte_lit;         // per byte: -1 text, id at a literal's first byte, -2 inside
    int* cidx;             // per byte: inclusive count of lead bytes
    uint32_t* cps;         // per char: code point
    int* boff;             // per char: byte offset (cap_bytes + 1)
    int* clit;             // per char: literal id / -1 / -2
    uint32_t* cls;         // per char: class bits
    int* pstart;           // per char: 1 when a piece starts
    int* S[TT_NSCRATCH];   // per char scratch (flags, then scans in place)
    int* aggs;             // scan tile aggregates
    int* piece_b0;         // per piece: first byte
    int* piece_b1;         // per piece: end byte
    int* piece_lit;        // per piece: literal id or -1
    int* pcnt;             // per piece: output token count (then inclusive offsets)
    int* list_small;       // dispatch lists (piece indices), counts in meta
    int* list_warp;
    int* list_block;
    uint32_t* out_tok;     // per byte: tokens of the piece starting there
    uint32_t* scr_a;       // block-per-piece scratch (per byte)
    uint32_t* scr_b;
    uint32_t* scr_c;
    uint32_t* ids;         // output ids
    int* spans;            // output token byte offsets
    int64_t cap_bytes;
    int64_t cap_lits;
};

// Per-tokenizer tables (uploaded once, layout in tables.py).
struct TTTables {
    const uint32_t* cls_table;   // [0x110000]
    const uint32_t* byte_to_id;  // [256]
    const uint64_t* pair_keys;   // [1 << pair_bits]
    const uint32_t* pair_rank;
    const uint32_t* pair_merged;
    const uint64_t* vocab_keys;  // [1 << vocab_bits]
    const uint32_t* vocab_ids;
    const uint32_t* tok_off;     // [n_ids + 1]
    const uint8_t* tok_blob;
    int64_t pair_bits;
    int64_t vocab_bits;
    int64_t max_piece_lookup;
    int64_t whole_lookup;
};

__host__ __device__ inline uint32_t tt_slot(uint64_t key, int bits) {
    return (uint32_t)((key * TT_GOLDEN) >> (64 - bits));
}

// Merge rank and result of the pair (a, b); false when the pair never merges.
__device__ inline bool tt_pair_lookup(const TTTables* t, uint32_t a, uint32_t b, uint32_t* rank, uint32_t* merged) {
    const uint64_t key = ((uint64_t)a << 32) | (uint64_t)b;
    const int bits = (int)t->pair_bits;
    const uint32_t mask = (1u << bits) - 1u;
    uint32_t s = tt_slot(key, bits);
    for (;;) {
        const uint64_t k = t->pair_keys[s];
        if (k == key) {
            *rank = t->pair_rank[s];
            *merged = t->pair_merged[s];
            return true;
        }
        if (k == TT_EMPTY64) return false;
        s = (s + 1u) & mask;
    }
}

// Whole-piece vocabulary lookup (FNV-1a-64 + byte compare); TT_EMPTY32 when absent.
__device__ inline uint32_t tt_vocab_lookup(const TTTables* t, const uint8_t* p, int len) {
    uint64_t h = TT_FNV_OFFSET;
    for (int j = 0; j < len; ++j) h = (h ^ (uint64_t)p[j]) * TT_FNV_PRIME;
    const int bits = (int)t->vocab_bits;
    const uint32_t mask = (1u << bits) - 1u;
    uint32_t s = tt_slot(h, bits);
    for (;;) {
        const uint64_t k = t->vocab_keys[s];
        if (k == TT_EMPTY64) return TT_EMPTY32;
        if (k == h) {
            const uint32_t id = t->vocab_ids[s];
            const uint32_t o = t->tok_off[id];
            if ((int)(t->tok_off[id + 1] - o) == len) {
                bool same = true;
                for (int j = 0; j < len && same; ++j) same = t->tok_blob[o + j] == p[j];
                if (same) return id;
            }
        }
        s = (s + 1u) & mask;
    }
}

__device__ inline uint32_t tt_tok_len(const TTTables* t, uint32_t id) { return t->tok_off[id + 1] - t->tok_off[id]; }

// The host packs these structs as arrays of uint64 (driver.py); keep the counts in sync.
static_assert(sizeof(TTBufs) == 52 * 8, "TTBufs layout changed: update driver._BUF_FIELDS");
static_assert(sizeof(TTTables) == 13 * 8, "TTTables layout changed: update driver._tok");
