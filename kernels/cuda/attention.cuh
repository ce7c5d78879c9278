// Shared by the attention kernels (attention.cu: CUDA cores; attention_tc.cu: tensor cores): tile sizes,
// mask kinds and the visible key range of a query row. See attention.cu for shapes and semantics.
#pragma once
#include "common.cuh"

namespace askgui {
namespace attn {

constexpr int BQ = 64;        // query rows per tile
constexpr int BK = 64;        // key rows per tile
constexpr int THREADS = 256;  // 16 x 16
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// MASK_CAUSAL_BLOCK: the segments of MASK_BLOCK, causal inside each (packed sequences; Tq == Tk).
enum Mask : int { MASK_NONE = 0, MASK_CAUSAL = 1, MASK_BLOCK = 2, MASK_CAUSAL_BLOCK = 3 };

// The segment s with cu[s] <= i < cu[s + 1] (cu[0] = 0, cu[nseg] = T > i): empty segments are skipped.
__device__ __forceinline__ int segment_of(const int* cu, int nseg, int i) {
  int a = 0, b = nseg;
  while (b - a > 1) {
    const int m = (a + b) >> 1;
    if (cu[m] <= i) a = m; else b = m;
  }
  return a;
}

// Keys [lo, hi) that query row i may see before key padding; an empty range for rows past tq.
__device__ __forceinline__ void row_keys(int i, int tq, int tk, int mask, const int* cu, int nseg, int& lo,
                                         int& hi) {
  lo = 0;
  hi = 0;
  if (i >= tq) return;
  if (mask == MASK_CAUSAL) {
    hi = tk - tq + i + 1;
  } else if (mask == MASK_BLOCK || mask == MASK_CAUSAL_BLOCK) {
    const int s = segment_of(cu, nseg, i);
    lo = cu[s];
    hi = mask == MASK_BLOCK ? cu[s + 1] : i + 1;
  } else {
    hi = tk;
  }
}

// Query rows [qlo, qhi) that may see some key of the tile k0..k0 + nk (the backward's outer range).
__device__ __forceinline__ void tile_queries(int k0, int nk, int tq, int tk, int mask, const int* cu, int nseg,
                                             int& qlo, int& qhi) {
  qlo = 0;
  qhi = tq;
  if (mask == MASK_CAUSAL) {
    qlo = max(0, k0 - (tk - tq));
  } else if (mask == MASK_BLOCK || mask == MASK_CAUSAL_BLOCK) {  // Tq == Tk: the segments of the first and last key
    qlo = mask == MASK_BLOCK ? cu[segment_of(cu, nseg, k0)] : k0;
    qhi = cu[segment_of(cu, nseg, k0 + nk - 1) + 1];
  }
}

}  // namespace attn
}  // namespace askgui
