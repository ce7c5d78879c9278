// Attention of a sequence's new query rows over its KV cache kept in blocks, read where they are: the
// CUDA side of `src/ops/paged_attention.rs` (its CPU op is the spec; tests in tests/emu/paged_attention.rs
// and tests/cuda/paged_attention.rs).
//
// Inputs: q (Hq, T, D); a table of 2 * nblocks device addresses (block b's keys at [2b], its values at
// [2b + 1]), each block (Hkv, n_b, D) contiguous; starts (nblocks + 1): block b holds key positions
// starts[b] .. starts[b + 1]. Query row t sees keys 0 ..= L - T + t (L = starts[nblocks]): causal, with the
// queries as the last T keys. GQA: head h reads key head h / (Hq / Hkv).
//
// One block per (row, head), launched as grid (T, Hq). Three passes over the visible keys:
//   1. scores: each warp takes a key, its lanes a slice of D, a shuffle sum; scale * q . k goes to this
//      row's stretch of `scores` (global, L floats a row) and each thread keeps its running maximum;
//   2. p = exp(s - max) in place, and their sum (block reductions);
//   3. out: each thread owns columns of D and walks the keys, sum p_j v_j / sum p_j, rounded once.
// Everything is f32 whatever the storage. Meant for decoding (T of a few rows): the scores need T * L
// floats per head, and a long prompt takes the tiled attention kernels instead.
//
// Check by hand: nvcc -ptx -arch=compute_80 -std=c++17 -Icuda cuda/paged_attention.cu -o /tmp/paged.ptx
#include "common.cuh"

using namespace askgui;

namespace {

template <typename T>
__device__ void paged(const T* __restrict__ q, const unsigned long long* __restrict__ table,
                      const int* __restrict__ starts, T* __restrict__ out, float* __restrict__ scores, int hkv,
                      int nblocks, int d, float scale) {
  extern __shared__ float qs[];  // this row's query, d floats
  __shared__ float scratch[32];
  const int t = gridDim.x, hq = gridDim.y, i = blockIdx.x, h = blockIdx.y;
  const int g = h / (hq / hkv);
  const int total = starts[nblocks];
  const int visible = total - t + i + 1;
  const size_t row = (size_t)h * t + i;
  for (int c = threadIdx.x; c < d; c += blockDim.x) qs[c] = to_f32(q[row * d + c]);
  __syncthreads();
  float* s = scores + row * total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

  float mx = -INFINITY;
  for (int b = 0; b < nblocks && starts[b] < visible; ++b) {
    const int j0 = starts[b], n = starts[b + 1] - j0, take = min(n, visible - j0);
    const T* kb = reinterpret_cast<const T*>(table[2 * b]) + (size_t)g * n * d;
    for (int j = warp; j < take; j += warps) {
      const T* kr = kb + (size_t)j * d;
      float acc = 0.f;
      for (int c = lane; c < d; c += 32) acc += qs[c] * to_f32(kr[c]);
      acc = warp_sum(acc) * scale;
      if (lane == 0) s[j0 + j] = acc;
      mx = fmaxf(mx, acc);
    }
  }
  // The barrier inside block_max also makes every score of pass 1 visible to the whole block.
  mx = block_max(mx, scratch);

  float l = 0.f;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) {
    const float p = expf(s[j] - mx);
    s[j] = p;
    l += p;
  }
  l = block_sum(l, scratch);

  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    for (int b = 0; b < nblocks && starts[b] < visible; ++b) {
      const int j0 = starts[b], n = starts[b + 1] - j0, take = min(n, visible - j0);
      const T* vb = reinterpret_cast<const T*>(table[2 * b + 1]) + (size_t)g * n * d + c;
      for (int j = 0; j < take; ++j) acc += s[j0 + j] * to_f32(vb[(size_t)j * d]);
    }
    out[row * d + c] = from_f32<T>(acc / l);
  }
}

}  // namespace

#define PAGED_KERNELS(T, S)                                                                                     \
  extern "C" __global__ void paged_attention_##S(const T* q, const unsigned long long* table, const int* starts, \
                                                 T* out, float* scores, int hkv, int nblocks, int d,           \
                                                 float scale) {                                                \
    paged<T>(q, table, starts, out, scores, hkv, nblocks, d, scale);                                           \
  }

PAGED_KERNELS(float, f32)
PAGED_KERNELS(__nv_bfloat16, bf16)
