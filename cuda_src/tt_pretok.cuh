// Regex-free pre-tokenizer kernels: UTF-8 decode, classification, per-family
// piece-start predicates (runs from max/min scans), piece compaction.
// One thread per byte or per character; every rule mirrors toktier/gpu/pretok_model.py
// (the derivation of each rule, alternative by alternative, is in its docstring).
#pragma once
#include "tt_common.cuh"

#define TT_THREADS 256

__device__ inline int tt_gid() { return (int)(blockIdx.x * blockDim.x + threadIdx.x); }

// Class word of char i; out of range reads as a literal (a segment edge with no class bits).
__device__ inline uint32_t tt_c(const TTBufs* b, int i, int n) { return (i >= 0 && i < n) ? b->cls[i] : TT_LIT; }
__device__ inline bool tt_has(uint32_t c, uint32_t bits) { return (c & bits) != 0u; }
__device__ inline bool tt_isP_cl(uint32_t c) { return !tt_has(c, TT_L | TT_N | TT_W | TT_LIT); }
__device__ inline int tt_fold(uint32_t c) { return (int)((c >> TT_FOLD_SHIFT) & 0xFFu); }
__device__ inline int tt_clen(uint32_t c0, uint32_t c1) {
    const int f0 = tt_fold(c0), f1 = tt_fold(c1);
    if (f0 == 's' || f0 == 'd' || f0 == 'm' || f0 == 't') return 1;
    if ((f0 == 'r' && f1 == 'e') || (f0 == 'v' && f1 == 'e') || (f0 == 'l' && f1 == 'l')) return 2;
    return 0;
}

// ---- stage 0: literals, UTF-8 decode, classification ----------------------------------

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_lead(const TTBufs* b) {
    const int i = tt_gid();
    if (i >= b->meta[TT_META_NBYTES]) return;
    b->byte_lit[i] = -1;
    b->cidx[i] = (b->buf[i] & 0xC0) != 0x80 ? 1 : 0;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_mark_literals(const TTBufs* b) {
    const int j = tt_gid();
    if (j >= b->meta[TT_META_NLITS]) return;
    const int s = b->lit_s[j], e = b->lit_e[j];
    b->byte_lit[s] = b->lit_id[j];
    for (int k = s + 1; k < e; ++k) b->byte_lit[k] = -2;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_decode(const TTBufs* b) {
    const int i = tt_gid();
    const int nbytes = b->meta[TT_META_NBYTES];
    if (i >= nbytes) return;
    const uint8_t* p = b->buf + i;
    const uint32_t c0 = p[0];
    if ((c0 & 0xC0u) == 0x80u) return;  // continuation byte
    uint32_t cp;
    if (c0 < 0x80u) cp = c0;
    else if (c0 < 0xE0u) cp = ((c0 & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    else if (c0 < 0xF0u) cp = ((c0 & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    else cp = ((c0 & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
    const int c = b->cidx[i] - 1;
    b->cps[c] = cp;
    b->boff[c] = i;
    b->clit[c] = b->byte_lit[i];
    const int len = c0 < 0x80u ? 1 : (c0 < 0xE0u ? 2 : (c0 < 0xF0u ? 3 : 4));
    if (i + len == nbytes) {  // the last character: publish the count and the end sentinel
        b->meta[TT_META_NCHARS] = c + 1;
        b->boff[c + 1] = nbytes;
    }
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_classify(const TTBufs* b, const TTTables* t) {
    const int i = tt_gid();
    if (i >= b->meta[TT_META_NCHARS]) return;
    if (b->clit[i] != -1) {
        b->cls[i] = TT_LIT;
        return;
    }
    const uint32_t cp = b->cps[i];
    uint32_t c = t->cls_table[cp] & 0xFFFFu;
    if (cp == 10u || cp == 13u) c |= TT_R;
    if (cp == 32u) c |= TT_SP;
    if (cp == 39u) c |= TT_AP;
    if (cp == 47u) c |= TT_SL;
    if ((cp >= 33u && cp <= 47u) || (cp >= 58u && cp <= 64u) || (cp >= 91u && cp <= 96u) || (cp >= 123u && cp <= 126u))
        c |= TT_AA;
    if ((cp >= 65u && cp <= 90u) || (cp >= 97u && cp <= 122u)) c |= TT_Aa;
    b->cls[i] = c;
}

// Whitespace-run rule shared by all families (see pretok_model._whitespace_starts).
__device__ inline bool tt_ws_start(const TTBufs* b, int i, int n, int a, int e, int r, bool y_exists, bool tt_end_whole) {
    if (i == a) return true;
    if (r >= a && i == r + 1 && r + 1 < e && !(tt_end_whole && !y_exists)) return true;
    if (y_exists && i == e - 1 && !tt_has(tt_c(b, e - 1, n), TT_R)) return true;
    return false;
}

// ---- cl100k / Llama-3 / Qwen -----------------------------------------------------------
// scratch: S0 N-run start, S1 W-run start, S2 W-run last, S3 next non-R W, S4 last R

// S0..S4 (cl100k and DeepSeek alike): N-run start, W-run start, W-run last, next non-R W, last R.
__device__ inline void tt_digit_space_flags(const TTBufs* b, int i, uint32_t c, uint32_t p, uint32_t q) {
    b->S[0][i] = (tt_has(c, TT_N) && !tt_has(p, TT_N)) ? i : -1;
    b->S[1][i] = (tt_has(c, TT_W) && !tt_has(p, TT_W)) ? i : -1;
    b->S[2][i] = (tt_has(c, TT_W) && !tt_has(q, TT_W)) ? i : TT_BIG;
    b->S[3][i] = (tt_has(c, TT_W) && !tt_has(c, TT_R)) ? i : TT_BIG;
    b->S[4][i] = tt_has(c, TT_R) ? i : -1;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_cl100k_prep(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const uint32_t c = tt_c(b, i, n), p = tt_c(b, i - 1, n), q = tt_c(b, i + 1, n);
    tt_digit_space_flags(b, i, c, p, q);
}

__device__ inline bool tt_cl_join(const TTBufs* b, int s, int n) {
    const uint32_t p = tt_c(b, s - 1, n), pp = tt_c(b, s - 2, n);
    return (tt_has(p, TT_W) && !tt_has(p, TT_R)) || (tt_isP_cl(p) && !tt_isP_cl(pp) && !tt_has(pp, TT_SP));
}

__device__ inline bool tt_cl_contraction_start(const TTBufs* b, int j, int n, int len) {
    // j starts a letter run joined by a preceding apostrophe and a contraction of `len` letters follows
    const uint32_t c = tt_c(b, j, n);
    if (!tt_has(c, TT_L) || tt_has(tt_c(b, j - 1, n), TT_L)) return false;
    if (!tt_has(tt_c(b, j - 1, n), TT_AP) || !tt_cl_join(b, j, n)) return false;
    return tt_clen(c, tt_c(b, j + 1, n)) == len;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_cl100k_starts(const TTBufs* b, int qwen, int tt_form) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const uint32_t c = tt_c(b, i, n), p = tt_c(b, i - 1, n);
    if (tt_has(c, TT_LIT)) {
        b->pstart[i] = b->clit[i] >= 0 ? 1 : 0;
        return;
    }
    bool st = tt_has(p, TT_LIT);  // first char of a segment
    if (tt_has(c, TT_N)) st |= qwen ? true : ((i - b->S[0][i]) % 3 == 0);
    if (tt_isP_cl(c) && !tt_isP_cl(p) && !tt_has(p, TT_SP)) st = true;
    if (tt_has(c, TT_L)) {
        if (!tt_has(p, TT_L) && !tt_cl_join(b, i, n)) st = true;
        if (tt_cl_contraction_start(b, i - 1, n, 1) || (tt_has(p, TT_L) && tt_cl_contraction_start(b, i - 2, n, 2)))
            st = true;
    }
    if (tt_has(c, TT_W)) {
        const int s = b->S[1][i], e = b->S[2][i] + 1;
        const int a = tt_isP_cl(tt_c(b, s - 1, n)) ? min(b->S[3][s], e) : s;
        const int r = b->S[4][e - 1];
        const bool y = !tt_has(tt_c(b, e, n), TT_LIT);
        st |= tt_ws_start(b, i, n, a, e, r, y, tt_form != 0);
    }
    b->pstart[i] = st ? 1 : 0;
}

// ---- DeepSeek -------------------------------------------------------------------------
// scratch: S0 N-run start, S1 W-run start, S2 W-run last, S3 next non-R W, S4 last R,
//          S5 LM-run start, S6 LM-run last, S7 next non-[A-Za-z]

__device__ inline bool ds_seg(uint32_t c) { return !tt_has(c, TT_N | TT_LIT); }
__device__ inline bool ds_k(uint32_t c) { return tt_has(c, TT_K) && !tt_has(c, TT_N); }
__device__ inline bool ds_segstart(const TTBufs* b, int i, int n) {
    const uint32_t c = tt_c(b, i, n), p = tt_c(b, i - 1, n);
    return ds_seg(c) && (!ds_seg(p) || ds_k(c) != ds_k(p));
}
__device__ inline bool ds_inprev(const TTBufs* b, int i, int n) {
    return i < n && ds_seg(tt_c(b, i, n)) && !ds_segstart(b, i, n);
}
__device__ inline bool ds_LM(uint32_t c) { return ds_seg(c) && tt_has(c, TT_L | TT_M); }
__device__ inline bool ds_PS(uint32_t c) { return ds_seg(c) && tt_has(c, TT_PS) && !tt_has(c, TT_L | TT_M); }
__device__ inline bool ds_O(uint32_t c) { return ds_seg(c) && !tt_has(c, TT_L | TT_M | TT_PS | TT_W); }

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_deepseek_prep(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const uint32_t c = tt_c(b, i, n), p = tt_c(b, i - 1, n), q = tt_c(b, i + 1, n);
    tt_digit_space_flags(b, i, c, p, q);
    const bool lm = ds_LM(c);
    b->S[5][i] = (lm && !(ds_LM(p) && ds_inprev(b, i, n))) ? i : -1;
    b->S[6][i] = (lm && !(ds_LM(q) && ds_inprev(b, i + 1, n))) ? i : TT_BIG;
    b->S[7][i] = !tt_has(c, TT_Aa) ? i : TT_BIG;
}

__device__ inline bool ds_alt1(const TTBufs* b, int i, int n) {
    // ASCII punctuation at a scan position followed by [A-Za-z] (alternative 1)
    if (!ds_inprev(b, i, n) || !tt_has(tt_c(b, i, n), TT_Aa)) return false;
    const uint32_t p = tt_c(b, i - 1, n);
    if (!(ds_PS(p) && tt_has(p, TT_AA))) return false;
    const uint32_t pp = tt_c(b, i - 2, n);
    return !(ds_inprev(b, i - 1, n) && (ds_PS(pp) || tt_has(pp, TT_SP)));
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_deepseek_starts(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const uint32_t c = tt_c(b, i, n), p = tt_c(b, i - 1, n);
    if (tt_has(c, TT_LIT)) {
        b->pstart[i] = b->clit[i] >= 0 ? 1 : 0;
        return;
    }
    bool st = (i == 0) || ds_segstart(b, i, n) || tt_has(p, TT_LIT);
    if (tt_has(c, TT_N)) st |= ((i - b->S[0][i]) % 3 == 0);
    const bool inprev = ds_inprev(b, i, n);
    if (ds_LM(c)) {
        const bool lb = !(ds_LM(p) && inprev);
        bool join = inprev && ((tt_has(p, TT_W) && !tt_has(p, TT_R)) || ds_O(p));
        join |= ds_alt1(b, i, n);
        if (lb && !join) st = true;
        if (!tt_has(c, TT_Aa)) {
            const int s = b->S[5][i];
            if (ds_alt1(b, s, n) && b->S[7][s] == i) st = true;
        }
    }
    if (ds_PS(c) && !(ds_PS(p) && inprev) && !(tt_has(p, TT_SP) && inprev)) st = true;
    if (ds_O(c)) {
        const bool next_lm = ds_LM(tt_c(b, i + 1, n)) && ds_inprev(b, i + 1, n);
        if (next_lm || !(ds_O(p) && inprev)) st = true;
    }
    if (tt_has(c, TT_W)) {
        const int s = b->S[1][i], e = b->S[2][i] + 1;
        const bool absorb = ds_PS(tt_c(b, s - 1, n)) && ds_inprev(b, s, n);
        const int a = absorb ? min(b->S[3][s], e) : s;
        const int r = b->S[4][e - 1];
        const bool y = ds_inprev(b, e, n);
        st |= tt_ws_start(b, i, n, a, e, r, y, false);
    }
    b->pstart[i] = st ? 1 : 0;
}

// ---- o200k ----------------------------------------------------------------------------
// Fixed scratch:  S0 last L, S1 last non-[\r\n/], S2 absorbed (0/1, the chain fixpoint)
// Per round:      S3 blob start, S4 blob last, S5 P-run last, S6 last zone start, S7 last chain start
// Final:          S8 W-run start, S9 W-run last, S10 next free W, S11 N-run start, S12 word-stretch
//                 start, S13 apostrophe-candidate count, S14 last R, S15 chain-of-candidates start,
//                 S16 absorbed apostrophe (0/1), S17 word segment start, S18 word segment last,
//                 S19 last l, S20 last U, S21 next U, S22 last B

__device__ inline bool o_isM(uint32_t c) { return tt_has(c, TT_M) && !tt_has(c, TT_L | TT_LIT); }
__device__ inline bool o_isP(uint32_t c) { return !tt_has(c, TT_L | TT_N | TT_W | TT_M | TT_LIT); }
__device__ inline bool o_word(uint32_t c) { return !tt_has(c, TT_LIT) && tt_has(c, TT_L | TT_M); }
__device__ inline bool o_tU(uint32_t c) { return o_word(c) && tt_has(c, TT_UP) && !tt_has(c, TT_LO); }
__device__ inline bool o_tl(uint32_t c) { return o_word(c) && tt_has(c, TT_LO) && !tt_has(c, TT_UP); }
__device__ inline bool o_tB(uint32_t c) { return o_word(c) && tt_has(c, TT_LO) && tt_has(c, TT_UP); }
__device__ inline bool o_chainable(uint32_t c) { return tt_has(c, TT_R | TT_SL) && !tt_has(c, TT_LIT); }

__device__ inline bool o_blob(const TTBufs* b, int i, int n) {
    if (i < 0 || i >= n) return false;
    const uint32_t c = b->cls[i];
    return (tt_has(c, TT_L) || o_isM(c) || o_isP(c)) && !tt_has(c, TT_LIT) && b->S[2][i] == 0;
}
__device__ inline bool o_Pm(const TTBufs* b, int i, int n) { return o_blob(b, i, n) && o_isP(b->cls[i]); }
__device__ inline bool o_zs(const TTBufs* b, int i, int n) {
    if (!o_Pm(b, i, n) || o_Pm(b, i - 1, n)) return false;
    const int bs = b->S[3][i], be = b->S[4][i] + 1, pe = b->S[5][i] + 1;
    return (pe - i >= 2) || (pe == be) || (i == bs && tt_has(tt_c(b, i - 1, n), TT_SP));
}
__device__ inline bool o_inzone(const TTBufs* b, int i, int n) {
    if (!o_blob(b, i, n)) return false;
    const int z = b->S[6][i];
    return z >= b->S[3][i] && z > b->S[0][i];
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_o200k_init(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const uint32_t c = b->cls[i];
    b->S[0][i] = tt_has(c, TT_L) && !tt_has(c, TT_LIT) ? i : -1;
    b->S[1][i] = !o_chainable(c) ? i : -1;
    b->S[2][i] = 0;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_o200k_round_a(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const bool bl = o_blob(b, i, n);
    b->S[3][i] = (bl && !o_blob(b, i - 1, n)) ? i : -1;
    b->S[4][i] = (bl && !o_blob(b, i + 1, n)) ? i : TT_BIG;
    b->S[5][i] = (o_Pm(b, i, n) && !o_Pm(b, i + 1, n)) ? i : TT_BIG;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_o200k_round_b(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    b->S[6][i] = o_zs(b, i, n) ? i : -1;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_o200k_round_c(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const int j = i - 1;
    bool from = false;
    if (j >= 0 && o_inzone(b, j, n) && !o_inzone(b, i, n) && i == b->S[4][j] + 1 && tt_has(b->cls[i], TT_R))
        from = true;
    b->S[7][i] = from ? i : -1;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_o200k_round_d(const TTBufs* b, int check_only) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const int now = b->S[7][i] > b->S[1][i] ? 1 : 0;
    if (now != b->S[2][i]) {
        b->meta[TT_META_CHANGED] = 1;
        if (!check_only) b->S[2][i] = now;
    }
}

extern "C" __global__ void tt_set_meta(const TTBufs* b, int slot, int value) {
    if (threadIdx.x == 0 && blockIdx.x == 0) b->meta[slot] = value;
}

extern "C" __global__ void tt_o200k_status(const TTBufs* b) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && b->meta[TT_META_CHANGED])
        b->meta[TT_META_STATUS] |= TT_STATUS_CHAIN_UNRESOLVED;
}

__device__ inline bool o_prev_in_blob(const TTBufs* b, int i, int n) {
    return o_blob(b, i - 1, n) && o_blob(b, i, n) && i != b->S[3][i];
}
__device__ inline bool o_wz(const TTBufs* b, int i, int n) {
    return i >= 0 && i < n && o_word(b->cls[i]) && o_blob(b, i, n) && !o_inzone(b, i, n);
}
__device__ inline int o_qlen(const TTBufs* b, int i, int n) { return tt_clen(tt_c(b, i + 1, n), tt_c(b, i + 2, n)); }
__device__ inline bool o_qcand(const TTBufs* b, int i, int n) {
    if (i < 0 || i >= n || !o_Pm(b, i, n) || o_inzone(b, i, n) || !tt_has(b->cls[i], TT_AP)) return false;
    if (b->S[5][i] + 1 - i != 1) return false;
    return o_wz(b, i - 1, n) && o_prev_in_blob(b, i, n) && o_qlen(b, i, n) > 0;
}
__device__ inline bool o_aq(const TTBufs* b, int i, int n) { return i >= 0 && i < n && b->S[16][i] != 0; }
__device__ inline bool o_consumed(const TTBufs* b, int i, int n) {
    return (o_aq(b, i - 1, n) && o_qlen(b, i - 1, n) >= 1) || (o_aq(b, i - 2, n) && o_qlen(b, i - 2, n) == 2);
}
__device__ inline bool o_tstart(const TTBufs* b, int i, int n) {
    return o_wz(b, i, n) && ((o_aq(b, i - 2, n) && o_qlen(b, i - 2, n) == 1) || (o_aq(b, i - 3, n) && o_qlen(b, i - 3, n) == 2));
}
__device__ inline bool o_ws0(const TTBufs* b, int i, int n) {
    return o_wz(b, i, n) && !(o_wz(b, i - 1, n) && o_prev_in_blob(b, i, n));
}
__device__ inline bool o_wseg(const TTBufs* b, int i, int n) { return o_wz(b, i, n) && !o_consumed(b, i, n); }
__device__ inline bool o_sflag(const TTBufs* b, int i, int n) {
    return (o_ws0(b, i, n) && !o_consumed(b, i, n)) || o_tstart(b, i, n);
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_o200k_final_a(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const uint32_t c = tt_c(b, i, n), p = tt_c(b, i - 1, n), q = tt_c(b, i + 1, n);
    b->S[8][i] = (tt_has(c, TT_W) && !tt_has(p, TT_W)) ? i : -1;
    b->S[9][i] = (tt_has(c, TT_W) && !tt_has(q, TT_W)) ? i : TT_BIG;
    b->S[10][i] = (tt_has(c, TT_W) && b->S[2][i] == 0) ? i : TT_BIG;
    b->S[11][i] = (tt_has(c, TT_N) && !tt_has(p, TT_N)) ? i : -1;
    const bool wz = o_wz(b, i, n);
    b->S[12][i] = (wz && !(o_wz(b, i - 1, n) && o_prev_in_blob(b, i, n))) ? i : -1;
    b->S[13][i] = o_qcand(b, i, n) ? 1 : 0;
    b->S[14][i] = tt_has(c, TT_R) ? i : -1;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_o200k_final_b(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    int v = 0;
    if (o_qcand(b, i, n)) {
        const int lstart = b->S[12][i - 1];
        const int prevq = lstart - 1;
        const bool linked = o_qcand(b, prevq, n) && o_qlen(b, prevq, n) == i - lstart;
        if (!linked) v = b->S[13][i];
    }
    b->S[15][i] = v;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_o200k_final_c(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    b->S[16][i] = (o_qcand(b, i, n) && ((b->S[13][i] - b->S[15][i]) % 2 == 0)) ? 1 : 0;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_o200k_final_d(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const uint32_t c = b->cls[i];
    b->S[17][i] = o_sflag(b, i, n) ? i : -1;
    const bool stop_next = (i + 1 >= n) || o_sflag(b, i + 1, n) || !o_wseg(b, i + 1, n);
    b->S[18][i] = stop_next ? i : TT_BIG;
    b->S[19][i] = o_tl(c) ? i : -1;
    b->S[20][i] = o_tU(c) ? i : -1;
    b->S[21][i] = o_tU(c) ? i : TT_BIG;
    b->S[22][i] = o_tB(c) ? i : -1;
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_o200k_starts(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    const uint32_t c = tt_c(b, i, n), p = tt_c(b, i - 1, n);
    if (tt_has(c, TT_LIT)) {
        b->pstart[i] = b->clit[i] >= 0 ? 1 : 0;
        return;
    }
    bool st = (i == 0) || tt_has(p, TT_LIT);
    if (tt_has(c, TT_N)) st |= ((i - b->S[11][i]) % 3 == 0);
    if (tt_has(c, TT_W)) {
        const int s = b->S[8][i], e = b->S[9][i] + 1;
        const int a = min(b->S[10][s], e);
        const int r = b->S[14][e - 1];
        const bool y = e < n && !tt_has(tt_c(b, e, n), TT_LIT);
        st |= tt_ws_start(b, i, n, a, e, r, y, false);
    }
    if (o_blob(b, i, n)) {
        const bool pib = o_prev_in_blob(b, i, n);
        const bool inz = o_inzone(b, i, n);
        if (o_zs(b, i, n) && !(o_inzone(b, i - 1, n) && pib) && !(i == b->S[3][i] && tt_has(p, TT_SP))) st = true;
        const bool Pb = o_Pm(b, i, n) && !o_Pm(b, i - 1, n);
        if (Pb && !inz && !o_aq(b, i, n)) st = true;
        const bool cons = o_consumed(b, i, n);
        if (o_ws0(b, i, n) && !cons) {
            const bool join0 = (pib && o_Pm(b, i - 1, n) && !o_inzone(b, i - 1, n)) ||
                               (tt_has(p, TT_W) && !tt_has(p, TT_R));
            if (!join0) st = true;
        }
        if (o_tstart(b, i, n)) st = true;
        if (o_wz(b, i, n) && !cons) {
            const int w0 = b->S[17][i];
            if (o_tU(c) && i > w0) {
                const int pl = b->S[19][i - 1], pU = b->S[20][i - 1];
                if (pl > pU && pl >= w0) st = true;
            }
        }
        // tail rule, pulled: is i == (last B of its word segment's tail) + 1 ?
        const int j = i - 1;
        if (j >= 0 && o_wseg(b, j, n) && o_tB(b->cls[j])) {
            const int s0 = b->S[17][j], s1 = b->S[18][j] + 1;
            const int z = b->S[19][s1 - 1];
            int m = z >= s0 ? (z + 1 < n ? b->S[21][z + 1] : n) : s0;
            m = min(m, s1);
            const int bb = b->S[22][s1 - 1];
            if (bb == j && bb >= m && bb + 1 < s1) st = true;
        }
    }
    b->pstart[i] = st ? 1 : 0;
}

// ---- pieces ---------------------------------------------------------------------------
// S0 <- pstart, then inclusive sum scan: piece index + 1 at each start.

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_piece_flags(const TTBufs* b) {
    const int i = tt_gid();
    if (i >= b->meta[TT_META_NCHARS]) return;
    b->S[0][i] = b->pstart[i];
}

extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_pieces(const TTBufs* b) {
    const int i = tt_gid();
    const int n = b->meta[TT_META_NCHARS];
    if (i >= n) return;
    if (b->pstart[i]) {
        const int k = b->S[0][i] - 1;
        b->piece_b0[k] = b->boff[i];
        b->piece_lit[k] = b->clit[i] >= 0 ? b->clit[i] : -1;
    }
    if (i == n - 1) b->meta[TT_META_NPIECES] = b->S[0][i];
}
