// TokTier GPU full path: the one translation unit PyCUDA (or nvcc -cubin) builds.
// Bytes -> code points -> classes -> piece starts -> pieces -> BPE -> ids + spans,
// every count in device memory; toktier/gpu/driver.py launches (and graph-captures)
// the kernels in order.
#include "tt_common.cuh"
#include "tt_scan.cuh"
#include "tt_pretok.cuh"
#include "tt_bpe.cuh"

TT_SCAN_KERNELS(tt_scan_max, TTOpMax, false)
TT_SCAN_KERNELS(tt_scan_min_rev, TTOpMin, true)
TT_SCAN_KERNELS(tt_scan_sum, TTOpSum, false)
