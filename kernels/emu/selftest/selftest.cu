// Kernels that break the CUDA execution model on purpose, for the CPU executor's own tests
// (kernels/tests/emu/checks.rs): each must be refused with a message that names the rule.
#include <cuda_bf16.h>
#include <mma.h>

// Half the block waits at one barrier, half at another.
extern "C" __global__ void divergent_syncthreads(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.f;
}

// The first warp returns; the others still wait at a barrier.
extern "C" __global__ void sync_after_exit(float* out) {
  if (threadIdx.x < 32) return;
  __syncthreads();
  out[threadIdx.x] = 1.f;
}

// Lane 0 waits at __syncthreads while its warp waits for it in a shuffle.
extern "C" __global__ void warp_deadlock(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x % 32 == 0) {
    __syncthreads();
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  }
  out[threadIdx.x] = v;
}

// A warp stores a tile and reads another lane's part of it without the __syncwarp a GPU needs.
extern "C" __global__ void wmma_read_without_syncwarp(float* out) {
  using namespace nvcuda;
  __align__(32) __shared__ float tile[16 * 16];
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 2.f);
  wmma::store_matrix_sync(tile, acc, 16, wmma::mem_row_major);
  out[threadIdx.x] = tile[(threadIdx.x * 8 + 8) % 256];  // the next lane's first element
}

// The same with the __syncwarp: every read sees 2.
extern "C" __global__ void wmma_read_with_syncwarp(float* out) {
  using namespace nvcuda;
  __align__(32) __shared__ float tile[16 * 16];
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 2.f);
  wmma::store_matrix_sync(tile, acc, 16, wmma::mem_row_major);
  __syncwarp();
  out[threadIdx.x] = tile[(threadIdx.x * 8 + 8) % 256];
}
