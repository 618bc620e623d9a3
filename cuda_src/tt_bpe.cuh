// Round-parallel BPE kernels, dispatched by piece length, and output compaction.
// Schedule (== toktier/gpu/bpe_model.py): each round takes the minimum merge rank of
// a piece and merges all leftmost non-overlapping occurrences of it.
#pragma once
#include "tt_common.cuh"
#include "tt_scan.cuh"

#define TT_SMALL_MAX 32
#define TT_WARP_MAX 128
#define TT_WARPS_PER_BLOCK 8
#define TT_BLOCK_THREADS 256

// Per piece: literal or whole-vocab hit -> one token; else push on a length-bucket list.
extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_dispatch(const TTBufs* b, const TTTables* t) {
    const int k = tt_gid();
    const int np = b->meta[TT_META_NPIECES];
    if (k >= np) return;
    const int b0 = b->piece_b0[k];
    const int b1 = k + 1 < np ? b->piece_b0[k + 1] : b->meta[TT_META_NBYTES];
    b->piece_b1[k] = b1;
    const int len = b1 - b0;
    const int lit = b->piece_lit[k];
    if (lit >= 0) {
        b->out_tok[b0] = (uint32_t)lit;
        b->pcnt[k] = 1;
        return;
    }
    if (len == 1) {
        b->out_tok[b0] = t->byte_to_id[b->buf[b0]];
        b->pcnt[k] = 1;
        return;
    }
    if (t->whole_lookup && len <= (int)t->max_piece_lookup) {
        const uint32_t id = tt_vocab_lookup(t, b->buf + b0, len);
        if (id != TT_EMPTY32) {
            b->out_tok[b0] = id;
            b->pcnt[k] = 1;
            return;
        }
    }
    if (len <= TT_SMALL_MAX) b->list_small[atomicAdd(&b->meta[TT_META_NSMALL], 1)] = k;
    else if (len <= TT_WARP_MAX) b->list_warp[atomicAdd(&b->meta[TT_META_NWARP], 1)] = k;
    else b->list_block[atomicAdd(&b->meta[TT_META_NBLOCK], 1)] = k;
}

// A round merges every chosen pair into the same id: equal ranks mean equal merged
// tokens (HF: one merge per rank; tiktoken: rank == merged id), which tables.py
// checks when it builds the table.  So a round carries (rank, merged) as scalars.

// Thread per piece (<= 32 bytes).  Tokens live in a per-thread array (dynamic indexing
// after compaction puts it in local memory, L1-resident); the round's rank, its merged
// id and the positions holding it are registers: a 32-bit mask, one bit per pair.
extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_bpe_small(const TTBufs* b, const TTTables* t) {
    const int e = tt_gid();
    if (e >= b->meta[TT_META_NSMALL]) return;
    const int k = b->list_small[e];
    const int b0 = b->piece_b0[k];
    int n = b->piece_b1[k] - b0;
    uint32_t tok[TT_SMALL_MAX];
    for (int j = 0; j < n; ++j) tok[j] = t->byte_to_id[b->buf[b0 + j]];
    for (;;) {
        uint32_t best = TT_EMPTY32, best_m = 0, at = 0;  // at: bit j <=> pair j has rank best
        for (int j = 0; j + 1 < n; ++j) {
            uint32_t r = TT_EMPTY32, m = 0;
            if (!tt_pair_lookup(t, tok[j], tok[j + 1], &r, &m)) continue;
            if (r < best) {
                best = r;
                best_m = m;
                at = 1u << j;
            } else if (r == best) {
                at |= 1u << j;
            }
        }
        if (best == TT_EMPTY32) break;
        int w = 0;
        for (int j = 0; j < n;) {  // leftmost non-overlapping, compacted in place (w <= j)
            if ((at >> j) & 1u) {
                tok[w++] = best_m;
                j += 2;
            } else {
                tok[w++] = tok[j];
                j += 1;
            }
        }
        n = w;
    }
    for (int j = 0; j < n; ++j) b->out_tok[b0 + j] = tok[j];
    b->pcnt[k] = n;
}

// Warp per piece (33-128 bytes): tokens in shared memory, ranks reduced with a warp
// min, candidate pairs as ballots, compaction by popcounts.
extern "C" __global__ void __launch_bounds__(TT_WARPS_PER_BLOCK * 32) tt_bpe_warp(const TTBufs* b, const TTTables* t) {
    __shared__ uint32_t s_tok[TT_WARPS_PER_BLOCK][2][TT_WARP_MAX];
    __shared__ uint32_t s_merged[TT_WARPS_PER_BLOCK];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int e = blockIdx.x * TT_WARPS_PER_BLOCK + warp;
    if (e >= b->meta[TT_META_NWARP]) return;  // warp-uniform
    const int k = b->list_warp[e];
    const int b0 = b->piece_b0[k];
    int n = b->piece_b1[k] - b0;
    int cur = 0;
    for (int j = lane; j < n; j += 32) s_tok[warp][0][j] = t->byte_to_id[b->buf[b0 + j]];
    __syncwarp();
    for (;;) {
        uint32_t rq[TT_WARP_MAX / 32];
        uint32_t best = TT_EMPTY32, my_m = 0;
#pragma unroll
        for (int q = 0; q < TT_WARP_MAX / 32; ++q) {
            const int j = lane + 32 * q;
            uint32_t r = TT_EMPTY32, m = 0;
            if (j + 1 < n && !tt_pair_lookup(t, s_tok[warp][cur][j], s_tok[warp][cur][j + 1], &r, &m)) r = TT_EMPTY32;
            rq[q] = r;
            if (r < best) {
                best = r;
                my_m = m;
            }
        }
        const uint32_t lane_best = best;
        best = __reduce_min_sync(TT_FULL_MASK, best);
        if (best == TT_EMPTY32) break;
        if (lane_best == best) s_merged[warp] = my_m;  // every writer stores the same id
        __syncwarp();
        const uint32_t merged = s_merged[warp];
        uint32_t cand[TT_WARP_MAX / 32];
#pragma unroll
        for (int q = 0; q < TT_WARP_MAX / 32; ++q) cand[q] = __ballot_sync(TT_FULL_MASK, rq[q] == best && lane + 32 * q + 1 < n);
        // leftmost non-overlapping: take(j) = cand(j) && !take(j-1)  (same in every lane)
        uint32_t take[TT_WARP_MAX / 32];
        bool prev_taken = false;
#pragma unroll
        for (int q = 0; q < TT_WARP_MAX / 32; ++q) {
            uint32_t tw = 0;
            for (int bit = 0; bit < 32; ++bit) {
                const bool tk = ((cand[q] >> bit) & 1u) && !prev_taken;
                tw |= (tk ? 1u : 0u) << bit;
                prev_taken = tk;
            }
            take[q] = tw;
        }
        // token j survives unless pair j-1 was taken; its new index = survivors before it
        uint32_t keep[TT_WARP_MAX / 32];
        uint32_t carry_in = 0;
#pragma unroll
        for (int q = 0; q < TT_WARP_MAX / 32; ++q) {
            keep[q] = ~((take[q] << 1) | carry_in);
            carry_in = take[q] >> 31;
        }
        int before[TT_WARP_MAX / 32];
        int acc = 0;
#pragma unroll
        for (int q = 0; q < TT_WARP_MAX / 32; ++q) {
            before[q] = acc;
            const int valid = n - 32 * q;
            const uint32_t vm = valid >= 32 ? TT_FULL_MASK : (valid <= 0 ? 0u : ((1u << valid) - 1u));
            acc += __popc(keep[q] & vm);
        }
        const int nxt = cur ^ 1;
#pragma unroll
        for (int q = 0; q < TT_WARP_MAX / 32; ++q) {
            const int j = lane + 32 * q;
            if (j < n && ((keep[q] >> lane) & 1u)) {
                const int idx = before[q] + __popc(keep[q] & ((1u << lane) - 1u));
                s_tok[warp][nxt][idx] = ((take[q] >> lane) & 1u) ? merged : s_tok[warp][cur][j];
            }
        }
        __syncwarp();
        n = acc;
        cur = nxt;
    }
    for (int j = lane; j < n; j += 32) b->out_tok[b0 + j] = s_tok[warp][cur][j];
    if (lane == 0) b->pcnt[k] = n;
}

// Block per piece (> 128 bytes, any length).  Tokens and pair ranks live in per-byte
// global scratch at the piece's offset (double-buffered tokens); each round walks the
// piece in chunks of TT_BM_BITS pairs held as shared-memory bitmaps, one word per
// thread:
//   cand  bit j: pair j has the round's rank (built with ballots, coalesced reads);
//   take  bit j: cand(j) && !take(j-1), leftmost non-overlapping.  A word's last take
//         bit depends on the bit entering it only when the word is all candidates
//         (then it passes the entering bit through, 32 being even); otherwise it is
//         the parity of its top run of candidates.  A block max-scan of
//         (word index, that bit) over words with a non-candidate finds each word's
//         entering bit, so a round is O(n) whatever the run lengths;
//   keep  bit j: token j survives (pair j-1 not taken); popcounts and a block sum
//         scan place the survivors.
#define TT_BM_WORDS TT_BLOCK_THREADS
#define TT_BM_BITS (TT_BM_WORDS * 32)
extern "C" __global__ void __launch_bounds__(TT_BLOCK_THREADS) tt_bpe_block(const TTBufs* b, const TTTables* t) {
    __shared__ uint32_t s_best;
    __shared__ uint32_t s_merged;
    __shared__ int s_warp[32];
    __shared__ uint32_t s_cand[TT_BM_WORDS];
    __shared__ uint32_t s_take[TT_BM_WORDS];
    __shared__ uint32_t s_keep[TT_BM_WORDS];
    __shared__ int s_off[TT_BM_WORDS];   // survivors before each word, within the chunk
    __shared__ int s_last[TT_BM_WORDS];  // inclusive max-scan of (word + 1) << 1 | last take bit
    __shared__ int s_chunk_take;          // take bit of the previous chunk's last pair
    __shared__ int s_chunk_kept;          // survivors of this chunk
    const int e = blockIdx.x;
    if (e >= b->meta[TT_META_NBLOCK]) return;
    const int k = b->list_block[e];
    const int b0 = b->piece_b0[k];
    const int tid = (int)threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    int n = b->piece_b1[k] - b0;
    uint32_t* cur = b->scr_a + b0;
    uint32_t* nxt = b->scr_b + b0;
    uint32_t* rk = b->scr_c + b0;
    for (int j = tid; j < n; j += TT_BLOCK_THREADS) cur[j] = t->byte_to_id[b->buf[b0 + j]];
    __syncthreads();
    for (;;) {
        if (tid == 0) s_best = TT_EMPTY32;
        __syncthreads();
        uint32_t mine = TT_EMPTY32, mine_m = 0;
        for (int j = tid; j + 1 < n; j += TT_BLOCK_THREADS) {
            uint32_t r = TT_EMPTY32, m = 0;
            if (!tt_pair_lookup(t, cur[j], cur[j + 1], &r, &m)) r = TT_EMPTY32;
            rk[j] = r;
            if (r < mine) {
                mine = r;
                mine_m = m;
            }
        }
        atomicMin(&s_best, mine);
        __syncthreads();
        const uint32_t best = s_best;
        if (best == TT_EMPTY32) break;
        if (mine == best) s_merged = mine_m;  // every writer stores the same id
        if (tid == 0) s_chunk_take = 0;
        __syncthreads();
        const uint32_t merged = s_merged;
        int out = 0;  // survivors written so far this round
        for (int base = 0; base < n; base += TT_BM_BITS) {
            for (int w = warp; w < TT_BM_WORDS; w += TT_BLOCK_THREADS / 32) {
                const int j = base + 32 * w + lane;
                const uint32_t bits = __ballot_sync(TT_FULL_MASK, j + 1 < n && rk[j] == best);
                if (lane == 0) s_cand[w] = bits;
            }
            __syncthreads();
            const int enter_chunk = s_chunk_take;
            const uint32_t cand = s_cand[tid];
            int key = 0;  // words whose last take bit ignores the entering bit
            if (cand != TT_FULL_MASK) key = ((tid + 1) << 1) | (__clz((int)~cand) & 1);
            const int last = tt_block_scan<TTOpMax>(key, s_warp);
            s_last[tid] = last;
            __syncthreads();
            const int before = tid > 0 ? s_last[tid - 1] : 0;
            const uint32_t enter = before > 0 ? (uint32_t)(before & 1) : (uint32_t)enter_chunk;
            uint32_t take = 0, prev = enter;
            for (int bit = 0; bit < 32; ++bit) {
                const uint32_t tk = ((cand >> bit) & 1u) & (prev ^ 1u);
                take |= tk << bit;
                prev = tk;
            }
            const int valid = n - base - 32 * tid;
            const uint32_t vm = valid >= 32 ? TT_FULL_MASK : (valid <= 0 ? 0u : ((1u << valid) - 1u));
            const uint32_t keep = ~((take << 1) | enter) & vm;
            const int incl = tt_block_scan<TTOpSum>(__popc(keep), s_warp);
            s_take[tid] = take;
            s_keep[tid] = keep;
            s_off[tid] = incl - __popc(keep);
            if (tid == TT_BLOCK_THREADS - 1) {
                s_chunk_take = (int)prev;
                s_chunk_kept = incl;
            }
            __syncthreads();
            for (int w = warp; w < TT_BM_WORDS; w += TT_BLOCK_THREADS / 32) {
                const int j = base + 32 * w + lane;
                const uint32_t kw = s_keep[w];
                if ((kw >> lane) & 1u) {
                    const int idx = out + s_off[w] + __popc(kw & ((1u << lane) - 1u));
                    nxt[idx] = ((s_take[w] >> lane) & 1u) ? merged : cur[j];
                }
            }
            out += s_chunk_kept;
            __syncthreads();
        }
        n = out;
        uint32_t* tmp = cur;
        cur = nxt;
        nxt = tmp;
        __syncthreads();
    }
    for (int j = tid; j < n; j += TT_BLOCK_THREADS) b->out_tok[b0 + j] = cur[j];
    if (tid == 0) b->pcnt[k] = n;
}

// S1 <- pcnt, then inclusive sum scan: output offsets.
extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_count_flags(const TTBufs* b) {
    const int k = tt_gid();
    if (k >= b->meta[TT_META_NPIECES]) return;
    b->S[1][k] = b->pcnt[k];
}

// Piece k writes its ids and the byte offset of each (spans: prefix sum of token lengths).
extern "C" __global__ void __launch_bounds__(TT_THREADS) tt_emit(const TTBufs* b, const TTTables* t) {
    const int k = tt_gid();
    const int np = b->meta[TT_META_NPIECES];
    if (k >= np) return;
    const int cnt = b->pcnt[k];
    const int off = b->S[1][k] - cnt;
    int pos = b->piece_b0[k];
    for (int j = 0; j < cnt; ++j) {
        const uint32_t id = b->out_tok[b->piece_b0[k] + j];
        b->ids[off + j] = id;
        b->spans[off + j] = pos;
        pos += (int)tt_tok_len(t, id);
    }
    if (k == np - 1) b->meta[TT_META_NTOKENS] = b->S[1][k];
}
