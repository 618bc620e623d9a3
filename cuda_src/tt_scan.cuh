// Device-wide inclusive scans over int32 with the element count in device memory.
// Three phases (tile scan -> scan of tile aggregates in one block -> apply), so the
// grid depends only on buffer capacity and nothing returns to the host.
#pragma once
#include <stdint.h>

#define TT_SCAN_THREADS 256
#define TT_SCAN_ITEMS 4
#define TT_SCAN_TILE (TT_SCAN_THREADS * TT_SCAN_ITEMS)
#define TT_FULL_MASK 0xFFFFFFFFu

struct TTOpMax {
    __device__ static int apply(int a, int b) { return a > b ? a : b; }
    __device__ static int ident() { return -TT_BIG - 1; }
};
struct TTOpMin {
    __device__ static int apply(int a, int b) { return a < b ? a : b; }
    __device__ static int ident() { return TT_BIG; }
};
struct TTOpSum {
    __device__ static int apply(int a, int b) { return a + b; }
    __device__ static int ident() { return 0; }
};

// Inclusive scan of one value per thread across the block (blockDim.x == TT_SCAN_THREADS).
template <class Op>
__device__ int tt_block_scan(int v, int* warp_tot) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(TT_FULL_MASK, v, o);
        if (lane >= o) v = Op::apply(u, v);
    }
    if (lane == 31) warp_tot[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int w = lane < (TT_SCAN_THREADS / 32) ? warp_tot[lane] : Op::ident();
        for (int o = 1; o < 32; o <<= 1) {
            const int u = __shfl_up_sync(TT_FULL_MASK, w, o);
            if (lane >= o) w = Op::apply(u, w);
        }
        if (lane < (TT_SCAN_THREADS / 32)) warp_tot[lane] = w;
    }
    __syncthreads();
    if (warp > 0) v = Op::apply(warp_tot[warp - 1], v);
    __syncthreads();
    return v;
}

template <class Op, bool REV>
__device__ void tt_scan_tiles(int* data, const int* n_ptr, int* aggs) {
    __shared__ int warp_tot[32];
    __shared__ int incl[TT_SCAN_THREADS];
    const int n = *n_ptr;
    const int base = blockIdx.x * TT_SCAN_TILE;
    if (base >= n) return;  // whole block exits together
    int v[TT_SCAN_ITEMS];
    int acc = Op::ident();
#pragma unroll
    for (int k = 0; k < TT_SCAN_ITEMS; ++k) {
        const int i = base + threadIdx.x * TT_SCAN_ITEMS + k;
        const int p = REV ? n - 1 - i : i;
        v[k] = i < n ? data[p] : Op::ident();
        acc = Op::apply(acc, v[k]);
        v[k] = acc;
    }
    const int tot = tt_block_scan<Op>(acc, warp_tot);
    incl[threadIdx.x] = tot;
    __syncthreads();
    const int excl = threadIdx.x > 0 ? incl[threadIdx.x - 1] : Op::ident();
#pragma unroll
    for (int k = 0; k < TT_SCAN_ITEMS; ++k) {
        const int i = base + threadIdx.x * TT_SCAN_ITEMS + k;
        if (i < n) data[REV ? n - 1 - i : i] = Op::apply(excl, v[k]);
    }
    if (threadIdx.x == TT_SCAN_THREADS - 1) aggs[blockIdx.x] = tot;
}

template <class Op>
__device__ void tt_scan_aggs(int* aggs, const int* n_ptr) {
    __shared__ int warp_tot[32];
    __shared__ int incl[TT_SCAN_THREADS];
    const int n = *n_ptr;
    const int tiles = (n + TT_SCAN_TILE - 1) / TT_SCAN_TILE;
    int carry = Op::ident();
    for (int b = 0; b < tiles; b += TT_SCAN_THREADS) {
        const int i = b + (int)threadIdx.x;
        const int v = i < tiles ? aggs[i] : Op::ident();
        const int in = tt_block_scan<Op>(v, warp_tot);
        incl[threadIdx.x] = in;
        __syncthreads();
        const int ex = threadIdx.x > 0 ? incl[threadIdx.x - 1] : Op::ident();
        if (i < tiles) aggs[i] = Op::apply(carry, ex);  // exclusive prefix of tile i
        carry = Op::apply(carry, incl[TT_SCAN_THREADS - 1]);
        __syncthreads();
    }
}

template <class Op, bool REV>
__device__ void tt_scan_apply(int* data, const int* n_ptr, const int* aggs) {
    const int n = *n_ptr;
    const int base = blockIdx.x * TT_SCAN_TILE;
    if (blockIdx.x == 0 || base >= n) return;
    const int pre = aggs[blockIdx.x];
    for (int k = threadIdx.x; k < TT_SCAN_TILE; k += TT_SCAN_THREADS) {
        const int i = base + k;
        if (i < n) {
            const int p = REV ? n - 1 - i : i;
            data[p] = Op::apply(pre, data[p]);
        }
    }
}

#define TT_SCAN_KERNELS(NAME, OP, REV)                                                                   \
    extern "C" __global__ void __launch_bounds__(TT_SCAN_THREADS) NAME##_tiles(int* d, const int* n, int* a) { \
        tt_scan_tiles<OP, REV>(d, n, a);                                                                 \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(TT_SCAN_THREADS) NAME##_aggs(int* a, const int* n) {      \
        tt_scan_aggs<OP>(a, n);                                                                          \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(TT_SCAN_THREADS) NAME##_apply(int* d, const int* n,       \
                                                                              const int* a) {            \
        tt_scan_apply<OP, REV>(d, n, a);                                                                 \
    }
