// Attention of a sequence's new query rows over its KV cache kept in blocks, read where they are: the
// CUDA side of `src/ops/paged_attention.rs` (its CPU op is the spec; tests in tests/emu/paged_attention.rs
// and tests/cuda/paged_attention.rs).
//
// Inputs: q (Hq, T, D) and one table of u64 words, uploaded once per call: for block b, words 4b .. 4b+3
// are the addresses of its keys and values, its first key position and its head stride (elements), and
// word 4n + 2 is the number of keys L (n blocks). Block b holds positions start_b .. start_{b+1}; key j of
// head g is at address + g * head_stride + (j - start_b) * D, so a block may be a view narrowed along the
// positions (a cut prefix). Query row t sees keys 0 ..= L - T + t (causal, the queries being the last T
// keys); query head h reads key head h / (Hq / Hkv) (GQA).
//
// Split over keys (as flash-decoding does), so that a decode step of a few heads fills the GPU:
//   paged_attention_part: grid (S, T, Hq), one block per CHUNK keys of a row and head. Scores into shared
//     memory (a warp a key, lanes over D, a shuffle sum), their max m and p = exp(s - m) with sum l, and
//     acc = sum p_j v_j (a thread a column of D); writes (m, l, acc) to `part`. A chunk past the row's
//     visible keys writes m = -inf, l = 0, acc = 0.
//   paged_attention_combine: grid (T, Hq): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M the
//     largest m_s (chunk 0 always sees a key, so M is finite), rounded once to the storage type.
// Everything is f32 whatever the storage.
//
// Check by hand: nvcc -ptx -arch=compute_80 -std=c++17 -Icuda cuda/paged_attention.cu -o /tmp/paged.ptx
#include "common.cuh"

using namespace askgui;

namespace {

struct Blocks {
  const unsigned long long* table;
  int n;
  __device__ int start(int b) const { return (int)table[4 * b + 2]; }
  __device__ size_t head_stride(int b) const { return (size_t)table[4 * b + 3]; }
  template <typename T> __device__ const T* keys(int b) const { return reinterpret_cast<const T*>(table[4 * b]); }
  template <typename T> __device__ const T* values(int b) const {
    return reinterpret_cast<const T*>(table[4 * b + 1]);
  }
};

template <typename T>
__device__ void part(const T* __restrict__ q, Blocks blocks, float* __restrict__ out, int hkv, int d, int chunk,
                     float scale) {
  extern __shared__ float smem[];  // q (d floats), then the chunk's scores (chunk floats)
  __shared__ float scratch[32];
  float* qs = smem;
  float* s = smem + d;
  const int splits = gridDim.x, t = gridDim.y, hq = gridDim.z;
  const int c0 = blockIdx.x * chunk, i = blockIdx.y, h = blockIdx.z;
  const int g = h / (hq / hkv);
  const int visible = blocks.start(blocks.n) - t + i + 1;
  const size_t row = (size_t)h * t + i;
  float* rec = out + (row * splits + blockIdx.x) * (d + 2);
  if (c0 >= visible) {  // the same for every thread of the block: none reaches a barrier
    for (int c = threadIdx.x; c < d + 2; c += blockDim.x) rec[c] = c == 0 ? -INFINITY : 0.f;
    return;
  }
  const int c1 = min(c0 + chunk, visible);
  for (int c = threadIdx.x; c < d; c += blockDim.x) qs[c] = to_f32(q[row * d + c]);
  int b0 = 0;
  while (blocks.start(b0 + 1) <= c0) ++b0;
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float mx = -INFINITY;
  for (int b = b0; b < blocks.n && blocks.start(b) < c1; ++b) {
    const int lo = max(blocks.start(b), c0), hi = min(blocks.start(b + 1), c1);
    const T* kb = blocks.keys<T>(b) + g * blocks.head_stride(b) + (size_t)(lo - blocks.start(b)) * d;
    for (int j = warp; j < hi - lo; j += warps) {
      const T* kr = kb + (size_t)j * d;
      float acc = 0.f;
      for (int c = lane; c < d; c += 32) acc += qs[c] * to_f32(kr[c]);
      acc = warp_sum(acc) * scale;
      if (lane == 0) s[lo - c0 + j] = acc;
      mx = fmaxf(mx, acc);
    }
  }
  mx = block_max(mx, scratch);  // its barrier also publishes the scores

  float l = 0.f;
  for (int j = threadIdx.x; j < c1 - c0; j += blockDim.x) {
    const float p = expf(s[j] - mx);
    s[j] = p;
    l += p;
  }
  l = block_sum(l, scratch);

  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    for (int b = b0; b < blocks.n && blocks.start(b) < c1; ++b) {
      const int lo = max(blocks.start(b), c0), hi = min(blocks.start(b + 1), c1);
      const T* vb = blocks.values<T>(b) + g * blocks.head_stride(b) + (size_t)(lo - blocks.start(b)) * d + c;
      for (int j = 0; j < hi - lo; ++j) acc += s[lo - c0 + j] * to_f32(vb[(size_t)j * d]);
    }
    rec[2 + c] = acc;
  }
  if (threadIdx.x == 0) {
    rec[0] = mx;
    rec[1] = l;
  }
}

template <typename T>
__device__ void combine(const float* __restrict__ part, T* __restrict__ out, int splits, int d) {
  const int t = gridDim.x, i = blockIdx.x, h = blockIdx.y;
  const size_t row = (size_t)h * t + i;
  const float* recs = part + row * splits * (d + 2);
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, recs[s * (d + 2)]);
  float l = 0.f;
  for (int s = 0; s < splits; ++s) l += expf(recs[s * (d + 2)] - m) * recs[s * (d + 2) + 1];
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < splits; ++s) acc += expf(recs[s * (d + 2)] - m) * recs[s * (d + 2) + 2 + c];
    out[row * d + c] = from_f32<T>(acc / l);
  }
}

}  // namespace

#define PAGED_KERNELS(T, S)                                                                                     \
  extern "C" __global__ void paged_attention_part_##S(const T* q, const unsigned long long* table, float* out,  \
                                                      int hkv, int nblocks, int d, int chunk, float scale) {    \
    part<T>(q, Blocks{table, nblocks}, out, hkv, d, chunk, scale);                                              \
  }                                                                                                             \
  extern "C" __global__ void paged_attention_combine_##S(const float* part, T* out, int splits, int d) {        \
    combine<T>(part, out, splits, d);                                                                           \
  }

PAGED_KERNELS(float, f32)
PAGED_KERNELS(__nv_bfloat16, bf16)
