// The CUDA execution model on a CPU, for running kernels/cuda/*.cu unchanged with the host C++ compiler
// (the CPU executor of the launch plans: kernels/src/emu.rs, feature `cpu-exec`).
//
// What it emulates: blocks of CUDA threads in warps of 32; __syncthreads, __syncwarp, __shfl_xor_sync;
// static shared memory (`__shared__` becomes `thread_local`: one block at a time runs on an OS thread) and
// dynamic shared memory (build.rs rewrites `extern __shared__ T x[];` into a pointer to the block's
// buffer, sized by the launch); atomicAdd; nvcuda::wmma 16x16x16 with bf16 operands and f32 accumulation;
// bf16 conversions with CUDA's rounding. Each CUDA thread is a fiber that runs until its next barrier
// (runtime.cpp); the scheduler resolves a barrier once every thread it names has reached it, so the
// checks a GPU sanitizer makes (divergent barriers, masks that exclude the caller, deadlock, wmma
// alignment) become plain errors. Nothing here is fast: it is a spec executor, not a simulator of timing.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <type_traits>
#include <utility>

#ifndef __global__  // build.rs defines it to find the kernels in preprocessed text
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ thread_local

struct dim3 {
  unsigned x, y, z;
};

struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

// ---- bf16 with CUDA's conversions ----
struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = uint32_t(h.bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even, as __float2bfloat16_rn; NaN becomes CUDA's canonical 0x7fff.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fff};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{uint16_t(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

// ---- device math the kernels use ----
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// Round-to-nearest arithmetic that nvcc never fuses; the host build has no FMA contraction (no -march).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v, std::memory_order_relaxed); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v, std::memory_order_relaxed); }

namespace cuda_emu {

// A warp-collective operation as one lane sees it. The lane blocks in `warp_op` until every lane of
// `mask` has arrived at an op of the same name and site; the scheduler then calls `resolve` once with
// all lanes' ops (nullptr for lanes outside the mask), which checks them and writes each lane's result.
// `resolve` returns nullptr or an error message (kept until the launch ends).
struct WarpOp {
  const char* name;
  const char* file;
  int line;
  unsigned mask;
  const char* (*resolve)(WarpOp* const* lanes);
};

const dim3& thread_idx();
const dim3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
void syncthreads(const char* file, int line);
void warp_op(WarpOp* op);
// The calling lane (0..31) and the block's dynamic shared memory.
int lane_id();
void* dynamic_shared();
// Fails the launch with a message (printf-style) and abandons the calling CUDA thread.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

inline const char* resolve_nothing(WarpOp* const*) { return nullptr; }

inline void syncwarp(const char* file, int line, unsigned mask = 0xffffffffu) {
  WarpOp op{"__syncwarp", file, line, mask, resolve_nothing};
  warp_op(&op);
}

struct ShflOp : WarpOp {
  uint64_t bits;
  int lane_mask;
  int width;
  uint64_t result;
};

const char* resolve_shfl_xor(WarpOp* const* lanes);

template <typename T>
inline T shfl_xor(const char* file, int line, unsigned mask, T v, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "__shfl_xor_sync of a value over 8 bytes");
  ShflOp op;
  op.name = "__shfl_xor_sync";
  op.file = file;
  op.line = line;
  op.mask = mask;
  op.resolve = resolve_shfl_xor;
  op.bits = 0;
  memcpy(&op.bits, &v, sizeof(T));
  op.lane_mask = lane_mask;
  op.width = width;
  warp_op(&op);
  T out;
  memcpy(&out, &op.result, sizeof(T));
  return out;
}

}  // namespace cuda_emu

#define threadIdx (::cuda_emu::thread_idx())
#define blockIdx (::cuda_emu::block_idx())
#define blockDim (::cuda_emu::block_dim())
#define gridDim (::cuda_emu::grid_dim())
#define __syncthreads() ::cuda_emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::cuda_emu::syncwarp(__FILE__, __LINE__ __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_xor_sync(...) ::cuda_emu::shfl_xor(__FILE__, __LINE__, __VA_ARGS__)

#include "cuda_emu_wmma.h"
#include "cuda_emu_registry.h"
