// RMSNorm and LayerNorm over the last dimension, forward and backward: the CUDA side of
// `src/ops/norm.rs` (its CPU kernels are the spec; tests in tests/cuda/norm_rope_ce.rs).
//
// Forward: one block per row (blockDim a multiple of 32), row statistics in f32 whatever the storage
// dtype; the output is rounded once. LayerNorm uses two passes (mean, then centred variance), not
// E[x^2] - E[x]^2, so rows with a large mean keep their precision.
//
// Backward writes one buffer `[dx (rows*d), dw (d), db (d)]` (as the CPU op). dx is per row. The parameter
// gradients are column sums over rows: each block walks rows blockIdx.x, +gridDim.x, ... and accumulates
// its own partial sums in f32 (in shared memory when they fit, else in its row of `partial`); every
// column is owned by one thread (i = threadIdx.x + k * blockDim.x) so no atomics are needed. A second
// kernel sums the partials over blocks in a fixed order: deterministic results, run to run.
//
// Check by hand: nvcc -ptx -arch=compute_80 -std=c++17 -Icuda cuda/norm.cu -o /tmp/norm.ptx
#include "common.cuh"

using namespace askgui;

namespace {

template <typename T>
__device__ void rms_fwd(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int d, float eps) {
  __shared__ float scratch[32];
  const size_t off = (size_t)blockIdx.x * d;
  x += off;
  y += off;
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = to_f32(x[i]);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / d + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) y[i] = from_f32<T>(to_f32(x[i]) * inv * to_f32(w[i]));
}

template <typename T>
__device__ void ln_fwd(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
                       int d, float eps) {
  __shared__ float scratch[32];
  const size_t off = (size_t)blockIdx.x * d;
  x += off;
  y += off;
  float s = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) s += to_f32(x[i]);
  const float mean = block_sum(s, scratch) / d;
  float v = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float c = to_f32(x[i]) - mean;
    v += c * c;
  }
  const float inv = rsqrtf(block_sum(v, scratch) / d + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x)
    y[i] = from_f32<T>((to_f32(x[i]) - mean) * inv * to_f32(w[i]) + to_f32(b[i]));
}

// out[0 .. rows*d) = dx; the block's parameter partials (p floats: dw, then db for LayerNorm) go to
// partial[blockIdx.x * p ..]. p == 0: no parameter gradient (frozen), `partial` is never touched.
// acc_shared: accumulate in dynamic shared memory (p floats) and copy to `partial` at the end.
template <typename T, bool LN>
__device__ void norm_bwd(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ g,
                         T* __restrict__ out, float* __restrict__ partial, int rows, int d, float eps, int p,
                         int acc_shared) {
  extern __shared__ float acc_smem[];
  __shared__ float scratch[32];
  float* acc = acc_shared ? acc_smem : partial + (size_t)blockIdx.x * p;
  for (int i = threadIdx.x; i < p; i += blockDim.x) acc[i] = 0.f;
  // The db half of `acc` is zeroed by other threads than the ones that own its columns.
  __syncthreads();
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const size_t off = (size_t)r * d;
    const T* xr = x + off;
    const T* gr = g + off;
    T* dx = out + off;
    if (!LN) {
      // gw = g * w; dx = inv * gw - x * inv^3 * mean(gw * x); dw += g * x * inv.
      float ss = 0.f, dot = 0.f;
      for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float xv = to_f32(xr[i]);
        ss += xv * xv;
        dot += to_f32(gr[i]) * to_f32(w[i]) * xv;
      }
      ss = block_sum(ss, scratch);
      dot = block_sum(dot, scratch);
      const float inv = rsqrtf(ss / d + eps);
      const float c = inv * inv * inv * dot / d;
      for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float xv = to_f32(xr[i]), gv = to_f32(gr[i]);
        dx[i] = from_f32<T>(inv * gv * to_f32(w[i]) - xv * c);
        if (p) acc[i] += gv * xv * inv;
      }
    } else {
      // h = g * w, xhat = (x - mean) * inv; dx = inv * (h - mean(h) - xhat * mean(h * xhat));
      // dw += g * xhat; db += g.
      float s = 0.f;
      for (int i = threadIdx.x; i < d; i += blockDim.x) s += to_f32(xr[i]);
      const float mean = block_sum(s, scratch) / d;
      float v = 0.f, sh = 0.f, shc = 0.f;
      for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float c = to_f32(xr[i]) - mean, h = to_f32(gr[i]) * to_f32(w[i]);
        v += c * c;
        sh += h;
        shc += h * c;
      }
      v = block_sum(v, scratch);
      sh = block_sum(sh, scratch);
      shc = block_sum(shc, scratch);
      const float inv = rsqrtf(v / d + eps);
      const float mh = sh / d, mhx = shc * inv / d;
      for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float gv = to_f32(gr[i]);
        const float xh = (to_f32(xr[i]) - mean) * inv;
        dx[i] = from_f32<T>(inv * (gv * to_f32(w[i]) - mh - xh * mhx));
        if (p) {
          acc[i] += gv * xh;
          acc[d + i] += gv;
        }
      }
    }
  }
  if (p && acc_shared) {
    __syncthreads();
    float* dst = partial + (size_t)blockIdx.x * p;
    for (int i = threadIdx.x; i < p; i += blockDim.x) dst[i] = acc[i];
  }
}

// out[out_off + j] = sum over blocks b (in order) of partial[b * p + j], for j < p.
template <typename T>
__device__ void param_reduce(const float* __restrict__ partial, int blocks, int p, T* __restrict__ out,
                             unsigned long long out_off) {
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < p; j += gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int b = 0; b < blocks; ++b) s += partial[(size_t)b * p + j];
    out[out_off + j] = from_f32<T>(s);
  }
}

}  // namespace

#define NORM_KERNELS(T, S)                                                                                 \
  extern "C" __global__ void rms_norm_fwd_##S(const T* x, const T* w, T* y, int d, float eps) {           \
    rms_fwd<T>(x, w, y, d, eps);                                                                           \
  }                                                                                                        \
  extern "C" __global__ void layer_norm_fwd_##S(const T* x, const T* w, const T* b, T* y, int d, float eps) { \
    ln_fwd<T>(x, w, b, y, d, eps);                                                                         \
  }                                                                                                        \
  extern "C" __global__ void rms_norm_bwd_##S(const T* x, const T* w, const T* g, T* out, float* partial,  \
                                              int rows, int d, float eps, int p, int acc_shared) {         \
    norm_bwd<T, false>(x, w, g, out, partial, rows, d, eps, p, acc_shared);                                \
  }                                                                                                        \
  extern "C" __global__ void layer_norm_bwd_##S(const T* x, const T* w, const T* g, T* out, float* partial, \
                                                int rows, int d, float eps, int p, int acc_shared) {       \
    norm_bwd<T, true>(x, w, g, out, partial, rows, d, eps, p, acc_shared);                                 \
  }                                                                                                        \
  extern "C" __global__ void norm_param_reduce_##S(const float* partial, int blocks, int p, T* out,        \
                                                   unsigned long long out_off) {                           \
    param_reduce<T>(partial, blocks, p, out, out_off);                                                     \
  }

NORM_KERNELS(float, f32)
NORM_KERNELS(__nv_bfloat16, bf16)
