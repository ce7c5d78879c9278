// Rotate-half RoPE with cos/sin tables (RoPE, M-RoPE and the vision 2D rotary all reduce to this), forward
// and transpose (the backward): the CUDA side of `src/ops/rope.rs`, whose CPU kernel is the spec.
//
//   forward:    y1 = x1 c1 - x2 s1     y2 = x2 c2 + x1 s2      (pair (i, i + D/2))
//   transpose:  y1 = x1 c1 + x2 s2     y2 = x2 c2 - x1 s1
//
// x and y are contiguous (rows, D). The tables are broadcast views of x's shape (stride 0 where they
// broadcast, unit last stride): every row's table offset is computed from its leading indices and the
// tables' strides (`RopeIdx`, passed by value), so tables are never materialised at x's size.
// One thread per pair, grid-stride loop; math in f32, one rounding per output.
//
// Check by hand: nvcc -ptx -arch=compute_80 -std=c++17 -Icuda cuda/rope.cu -o /tmp/rope.ptx
#include "common.cuh"

using namespace askgui;

// Must match `RopeIdx` in src/ops/rope.rs (#[repr(C)]): leading dims of x with the tables' strides, size-1
// dims dropped and mergeable neighbours merged by the host, at most ROPE_MAX_LEAD of them.
#define ROPE_MAX_LEAD 6
struct RopeIdx {
  unsigned int rank;
  unsigned int pad;
  unsigned long long dims[ROPE_MAX_LEAD];
  unsigned long long cos_stride[ROPE_MAX_LEAD];
  unsigned long long sin_stride[ROPE_MAX_LEAD];
};

namespace {

template <typename T, bool TRANSPOSE>
__device__ void rope(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                     T* __restrict__ y, RopeIdx idx, unsigned long long pairs, int h) {
  for (unsigned long long p = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; p < pairs;
       p += (unsigned long long)gridDim.x * blockDim.x) {
    const unsigned long long row = p / h;
    const int i = (int)(p - row * h);
    unsigned long long rest = row, co = 0, so = 0;
#pragma unroll
    for (int k = ROPE_MAX_LEAD - 1; k >= 0; --k) {
      if (k < (int)idx.rank) {
        const unsigned long long q = rest % idx.dims[k];
        rest /= idx.dims[k];
        co += q * idx.cos_stride[k];
        so += q * idx.sin_stride[k];
      }
    }
    const size_t xo = (size_t)row * 2 * h;
    const float x1 = to_f32(x[xo + i]), x2 = to_f32(x[xo + i + h]);
    const float c1 = to_f32(cos[co + i]), c2 = to_f32(cos[co + i + h]);
    const float s1 = to_f32(sin[so + i]), s2 = to_f32(sin[so + i + h]);
    float y1, y2;
    if (!TRANSPOSE) {
      y1 = x1 * c1 - x2 * s1;
      y2 = x2 * c2 + x1 * s2;
    } else {
      y1 = x1 * c1 + x2 * s2;
      y2 = x2 * c2 - x1 * s1;
    }
    y[xo + i] = from_f32<T>(y1);
    y[xo + i + h] = from_f32<T>(y2);
  }
}

}  // namespace

#define ROPE_KERNELS(T, S)                                                                               \
  extern "C" __global__ void rope_fwd_##S(const T* x, const T* cos, const T* sin, T* y, RopeIdx idx,     \
                                          unsigned long long pairs, int h) {                             \
    rope<T, false>(x, cos, sin, y, idx, pairs, h);                                                       \
  }                                                                                                      \
  extern "C" __global__ void rope_bwd_##S(const T* x, const T* cos, const T* sin, T* y, RopeIdx idx,     \
                                          unsigned long long pairs, int h) {                             \
    rope<T, true>(x, cos, sin, y, idx, pairs, h);                                                        \
  }

ROPE_KERNELS(float, f32)
ROPE_KERNELS(__nv_bfloat16, bf16)
