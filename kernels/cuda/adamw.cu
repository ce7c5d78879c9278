// The fused AdamW step: the CUDA side of `src/ops/adamw.rs`, whose element update is specified in
// `src/adamw.rs` (each operation rounded once, in that order; tests in tests/emu/adamw.rs and tests/cuda/).
// The __f*_rn intrinsics keep nvcc from fusing a multiply and an add into one FMA, which would round once
// where the spec rounds twice. One thread per element, grid-stride.
//
// Check by hand: nvcc -ptx -arch=compute_80 -std=c++17 -Icuda cuda/adamw.cu -o /tmp/adamw.ptx
#include "common.cuh"

extern "C" __global__ void adamw_step_f32(const float* __restrict__ p, const float* __restrict__ g,
                                          const float* __restrict__ state, float* __restrict__ out,
                                          unsigned long long n, int has_decay, float decay, float one_minus_b1,
                                          float b2, float one_minus_b2, float inv_bc2_sqrt, float eps,
                                          float step_size) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float pi = p[i];
    const float gi = g[i], mi = state[i], vi = state[n + i];
    if (has_decay) pi = __fadd_rn(__fmul_rn(pi, decay), 0.f);
    const float m = __fadd_rn(mi, __fadd_rn(__fmul_rn(__fsub_rn(gi, mi), one_minus_b1), 0.f));
    const float v =
        __fadd_rn(__fadd_rn(__fmul_rn(vi, b2), 0.f), __fadd_rn(__fmul_rn(__fmul_rn(gi, gi), one_minus_b2), 0.f));
    const float denom = __fadd_rn(__fmul_rn(__fadd_rn(__fmul_rn(__fsqrt_rn(v), inv_bc2_sqrt), 0.f), 1.f), eps);
    out[i] = __fsub_rn(pi, __fadd_rn(__fmul_rn(__fdiv_rn(m, denom), step_size), 0.f));
    out[n + i] = m;
    out[2 * n + i] = v;
  }
}
