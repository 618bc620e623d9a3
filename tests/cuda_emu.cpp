// A CPU emulator for cuda_src/toktier.cu, for tests on machines without a GPU.
//
// The CUDA sources are compiled as C++ with the shims below.  A launch runs the
// grid block by block.  Kernels without barriers run their threads one after the
// other; kernels with barriers or warp primitives (the scans, the warp- and
// block-per-piece BPE) run each block as blockDim std::threads with std::barrier
// for __syncthreads/__syncwarp and per-warp exchange slots for shuffles, ballots
// and reductions.  __shared__ becomes `static` (blocks run one at a time).
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

struct emu_dim3 { unsigned x, y, z; };
static thread_local emu_dim3 threadIdx, blockIdx;
static emu_dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
using std::max;
using std::min;

static std::unique_ptr<std::barrier<>> g_block_bar;
static std::vector<std::unique_ptr<std::barrier<>>> g_warp_bar;
static uint32_t g_slots[32][32];

static inline int emu_lane() { return (int)(threadIdx.x & 31u); }
static inline int emu_warp() { return (int)(threadIdx.x >> 5); }
static void emu_no_barrier() {
    fprintf(stderr, "cuda_emu: barrier in a kernel launched without threads\n");
    abort();
}
static inline void __syncthreads() {
    if (!g_block_bar) emu_no_barrier();
    g_block_bar->arrive_and_wait();
}
static inline void __syncwarp(unsigned = 0xFFFFFFFFu) {
    if (g_warp_bar.empty()) emu_no_barrier();
    g_warp_bar[emu_warp()]->arrive_and_wait();
}
static inline uint32_t emu_exchange(uint32_t v, int src_lane) {
    const int w = emu_warp();
    g_slots[w][emu_lane()] = v;
    __syncwarp();
    const uint32_t r = g_slots[w][src_lane];
    __syncwarp();
    return r;
}
static inline int __shfl_up_sync(unsigned, int v, int o) {
    const int lane = emu_lane();
    const int r = (int)emu_exchange((uint32_t)v, lane >= o ? lane - o : lane);
    return lane >= o ? r : v;
}
static inline unsigned __ballot_sync(unsigned, int p) {
    const int w = emu_warp();
    g_slots[w][emu_lane()] = p ? 1u : 0u;
    __syncwarp();
    unsigned m = 0;
    for (int l = 0; l < 32; ++l) m |= g_slots[w][l] << l;
    __syncwarp();
    return m;
}
static inline unsigned __reduce_min_sync(unsigned, unsigned v) {
    const int w = emu_warp();
    g_slots[w][emu_lane()] = v;
    __syncwarp();
    unsigned m = 0xFFFFFFFFu;
    for (int l = 0; l < 32; ++l) m = std::min(m, g_slots[w][l]);
    __syncwarp();
    return m;
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicMin(unsigned* p, unsigned v) {
    unsigned old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}

#include "toktier.cu"

// A persistent pool of EMU_POOL workers runs the threads of one block per round.
static std::unique_ptr<std::barrier<>> g_start, g_end;
static void (*g_job)(int tx) = nullptr;
static int g_block_threads = 0;
static int g_block_x = 0;
static bool g_stop = false;

static int g_pool_size = 0;

static void emu_worker(int tx) {
    for (;;) {
        g_start->arrive_and_wait();
        if (g_stop) return;
        if (tx < g_block_threads) {
            blockIdx = {(unsigned)g_block_x, 0, 0};
            threadIdx = {(unsigned)tx, 0, 0};
            g_job(tx);
        }
        g_end->arrive_and_wait();
    }
}

static void* g_fn;
static int g_sig;
static uint64_t g_a0, g_a1, g_a2;
static void emu_call(int) {
    switch (g_sig) {
        case 0: ((void (*)(void*))g_fn)((void*)g_a0); break;
        case 1: ((void (*)(void*, void*))g_fn)((void*)g_a0, (void*)g_a1); break;
        case 2: ((void (*)(void*, int, int))g_fn)((void*)g_a0, (int)g_a1, (int)g_a2); break;
        case 3: ((void (*)(void*, int))g_fn)((void*)g_a0, (int)g_a1); break;
        case 4: ((void (*)(void*, void*, void*))g_fn)((void*)g_a0, (void*)g_a1, (void*)g_a2); break;
        default: abort();
    }
}

// sig: 0 (p), 1 (p, p), 2 (p, i, i), 3 (p, i), 4 (p, p, p)
extern "C" int emu_launch(void* fn, int sig, int grid, int block, int threaded, uint64_t a0, uint64_t a1, uint64_t a2) {
    blockDim = {(unsigned)block, 1, 1};
    gridDim = {(unsigned)grid, 1, 1};
    g_fn = fn, g_sig = sig, g_a0 = a0, g_a1 = a1, g_a2 = a2;
    if (threaded && g_pool_size != block) {
        if (g_pool_size) {  // retire the old pool (its threads are detached)
            g_stop = true;
            g_start->arrive_and_wait();
            g_stop = false;
        }
        g_start = std::make_unique<std::barrier<>>(block + 1);
        g_end = std::make_unique<std::barrier<>>(block + 1);
        for (int t = 0; t < block; ++t) std::thread(emu_worker, t).detach();
        g_pool_size = block;
    }
    for (int bx = 0; bx < grid; ++bx) {
        if (!threaded) {
            blockIdx = {(unsigned)bx, 0, 0};
            for (int tx = 0; tx < block; ++tx) {
                threadIdx = {(unsigned)tx, 0, 0};
                emu_call(tx);
            }
            continue;
        }
        g_block_bar = std::make_unique<std::barrier<>>(block);
        g_warp_bar.clear();
        for (int w = 0; w < (block + 31) / 32; ++w) g_warp_bar.push_back(std::make_unique<std::barrier<>>(32));
        g_job = emu_call;
        g_block_threads = block;
        g_block_x = bx;
        g_start->arrive_and_wait();
        g_end->arrive_and_wait();
        g_block_bar.reset();
        g_warp_bar.clear();
    }
    return 0;
}
