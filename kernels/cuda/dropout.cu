// Inverted dropout with a counter-based mask: the CUDA side of `src/ops/dropout.rs`, whose mask layout
// and reference are in `src/dropout.rs` (the spec; tests in tests/emu/dropout.rs and tests/cuda/).
//
// Element e = offset + i keeps word e % 4 of philox4x32_10([lo(e/4), hi(e/4), lo(layer), hi(layer)],
// [lo(seed), hi(seed)]) and is dropped when that word is below `threshold` (round(p * 2^32)). One thread
// per group of four elements, one Philox evaluation each, grid-stride. y = x * (kept ? scale : 0) in f32,
// rounded once: bit for bit the CPU op. The backward is this kernel on the upstream gradient.
//
// Check by hand: nvcc -ptx -arch=compute_80 -std=c++17 -Icuda cuda/dropout.cu -o /tmp/dropout.ptx
#include "common.cuh"

using namespace askgui;

namespace {

// Random123's philox4x32_10; the 32x32 -> 64-bit products are mul.wide.u32 on the GPU.
__device__ __forceinline__ void philox4x32_10(unsigned int c[4], unsigned int k0, unsigned int k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned long long p0 = (unsigned long long)0xD2511F53u * c[0];
    const unsigned long long p1 = (unsigned long long)0xCD9E8D57u * c[2];
    const unsigned int n0 = (unsigned int)(p1 >> 32) ^ c[1] ^ k0;
    const unsigned int n2 = (unsigned int)(p0 >> 32) ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = (unsigned int)p1;
    c[2] = n2;
    c[3] = (unsigned int)p0;
  }
}

template <typename T>
__device__ void dropout(const T* __restrict__ x, T* __restrict__ y, unsigned long long n, unsigned long long seed,
                        unsigned long long layer, unsigned long long offset, unsigned int threshold, float scale) {
  const unsigned long long first = offset / 4, groups = (offset + n - 1) / 4 - first + 1;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long g = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const unsigned long long group = first + g;
    unsigned int w[4] = {(unsigned int)group, (unsigned int)(group >> 32), (unsigned int)layer,
                         (unsigned int)(layer >> 32)};
    philox4x32_10(w, (unsigned int)seed, (unsigned int)(seed >> 32));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned long long e = group * 4 + j;
      if (e < offset || e - offset >= n) continue;
      const unsigned long long i = e - offset;
      y[i] = from_f32<T>(to_f32(x[i]) * (w[j] >= threshold ? scale : 0.f));
    }
  }
}

}  // namespace

#define DROPOUT_KERNEL(T, S)                                                                              \
  extern "C" __global__ void dropout_##S(const T* x, T* y, unsigned long long n, unsigned long long seed, \
                                         unsigned long long layer, unsigned long long offset,             \
                                         unsigned int threshold, float scale) {                           \
    dropout<T>(x, y, n, seed, layer, offset, threshold, scale);                                           \
  }

DROPOUT_KERNEL(float, f32)
DROPOUT_KERNEL(__nv_bfloat16, bf16)
