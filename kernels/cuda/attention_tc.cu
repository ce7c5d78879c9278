// Tensor-core attention kernels for bf16 storage (nvcuda::wmma 16x16x16, bf16 operands, f32 accumulate):
// the same contract as attention.cu (shapes, masks, the saved logsumexp, the [dq, dk, dv] f32
// accumulator, argument lists), so kernels/src/ops/attention/cuda.rs swaps them in for bf16 where the
// device has the shared memory (94 KiB forward at D 128: every GPU from sm_80; backward 89 KiB at D 64,
// 97 KiB at D 80, 121 KiB at D 128: sm_86/sm_89 run D 96 and 128 on CUDA cores).
//
// Why: the CUDA-core kernels spend their time in f32 FMAs; here the four products per tile (S, P V in the
// forward; S^T, dP^T, P^T dO, dS^T Q, dS K in the backward) run on tensor cores, while the softmax, the
// masks and the statistics stay in f32 as before. P and dS are rounded to bf16 for their products, as in
// FlashAttention-2. Measured on an H100 (bf16, decoder-3b: T 4096, D 128, causal, Hq 16, Hkv 2): forward
// 1.36 ms against 3.6 ms on CUDA cores, forward + backward kernels 6.7 ms against 12.1 (PyTorch sdpa
// flash: 0.34 / 1.2 ms). The backward is the bigger remaining cost (dQ atomics, one block per SM).
//
// Compile check: nvcc -ptx -arch=compute_80 -std=c++17 -Icuda cuda/attention_tc.cu (build.rs does this).
#include <mma.h>

#include "attention.cuh"

namespace askgui {
namespace attn {

// ---- Tensor-core forward for bf16 (nvcuda::wmma 16x16x16, f32 accumulate) ----
// Same tiles, masks and outputs as `forward`, 4 warps of 16 query rows each. Per key tile a warp computes
// its S (16 x 64) = Q K^T with wmma into shared memory, runs the online softmax with 2 lanes per row
// (interleaved columns 2c + half), writes P as bf16 and computes P V (16 x DP) with wmma; the running
// output stays in registers (DP / 2 per lane), rescaled by exp2(m_old - m_new) per row. The row sum l
// adds the f32 p (P V multiplies their bf16 roundings, as FlashAttention-2 does), so the saved logsumexp
// is the one the backward's P = exp(S - lse) needs.
constexpr int TC_WARPS = 4;
constexpr int TC_THREADS = 32 * TC_WARPS;

// Copies rows [0, n) of a bf16 matrix (row stride `stride` elements, d columns) into an (R, DP) shared
// tile with row stride LD, zero-filling rows >= n and columns >= d. 16-byte vector copies when every
// row start is 16-byte aligned and d is a multiple of 8 (then a vector is wholly inside or outside).
template <int R, int DP, int LD>
__device__ __forceinline__ void load_tile(__nv_bfloat16* dst, const __nv_bfloat16* src, long long stride, int n,
                                          int d) {
  const bool vec = d % 8 == 0 && stride % 8 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  if (vec) {
    constexpr int V = DP / 8;
    for (int x = threadIdx.x; x < R * V; x += TC_THREADS) {
      const int r = x / V, c = (x % V) * 8;
      uint4 val = make_uint4(0u, 0u, 0u, 0u);
      if (r < n && c < d) val = *reinterpret_cast<const uint4*>(src + r * stride + c);
      *reinterpret_cast<uint4*>(dst + r * LD + c) = val;
    }
  } else {
    const __nv_bfloat16 zero = __float2bfloat16(0.f);
    for (int x = threadIdx.x; x < R * DP; x += TC_THREADS) {
      const int r = x / DP, c = x % DP;
      dst[r * LD + c] = (r < n && c < d) ? src[r * stride + c] : zero;
    }
  }
}

template <int DP>
struct TcLayout {
  static constexpr int LDH = DP + 8;  // bf16 row stride of the Q, K, V tiles (wmma: a multiple of 8)
  static constexpr int LDS = BK + 4;  // f32 row stride of a warp's scores (a multiple of 4)
  static constexpr int LDP = BK + 8;  // bf16 row stride of a warp's probabilities
  static constexpr int LDO = DP + 4;  // f32 row stride of a warp's P V
  // Every part is a multiple of 32 bytes, so every wmma pointer is 256-bit aligned. A warp's P V (f32)
  // shares its bytes with the warp's scores: the scores are dead once P is written (a __syncwarp apart),
  // which keeps DP 128 within 101,376 bytes (the sm_86/sm_89 opt-in).
  static constexpr int TILE = BQ * LDH * 2;
  static constexpr int SO = 16 * LDS * 4 > 16 * LDO * 4 ? 16 * LDS * 4 : 16 * LDO * 4;  // scores, then P V
  static constexpr int WARP = SO + 16 * LDP * 2;
  static constexpr int BYTES = 3 * TILE + TC_WARPS * WARP + (2 * BQ + BK) * 4;
};

template <int DP>
__device__ __forceinline__ void forward_tc(const __nv_bfloat16* __restrict__ q, int qs,
                                           const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                                           __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
                                           const uint8_t* __restrict__ keep, const int* __restrict__ cu, int nseg,
                                           int hq, int hkv, int tq, int tk, int d, int mask, int has_keep,
                                           float scale) {
  using namespace nvcuda;
  using L = TcLayout<DP>;
  using bf16 = __nv_bfloat16;
  constexpr int LDH = L::LDH, LDS = L::LDS, LDP = L::LDP, LDO = L::LDO;
  constexpr int KD = DP / 16;  // wmma steps over the head dim
  constexpr int OC = DP / 2;   // output columns per lane
  extern __shared__ __align__(128) unsigned char tc_smem[];
  bf16* Qs = reinterpret_cast<bf16*>(tc_smem);                 // (BQ, LDH)
  bf16* Ks = reinterpret_cast<bf16*>(tc_smem + L::TILE);       // (BK, LDH)
  bf16* Vs = reinterpret_cast<bf16*>(tc_smem + 2 * L::TILE);   // (BK, LDH)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  unsigned char* wb = tc_smem + 3 * L::TILE + warp * L::WARP;
  float* Sf = reinterpret_cast<float*>(wb);                                     // (16, LDS)
  float* Of = Sf;                                                               // (16, LDO), after P
  bf16* Pb = reinterpret_cast<bf16*>(wb + L::SO);                               // (16, LDP)
  int* row_lo = reinterpret_cast<int*>(tc_smem + 3 * L::TILE + TC_WARPS * L::WARP);  // (BQ)
  int* row_hi = row_lo + BQ;                                                          // (BQ)
  int* key_ok = row_hi + BQ;                                                          // (BK)

  const int q0 = blockIdx.x * BQ;
  const int bh = blockIdx.y;
  const int b = bh / hq, h = bh % hq;
  const long long kvh = (long long)b * hkv + h / (hq / hkv);
  const int nq = min(BQ, tq - q0);
  const bf16* qp = q + ((long long)bh * tq + q0) * qs;
  const bf16* kp = k + kvh * tk * d;
  const bf16* vp = v + kvh * tk * d;
  const float sl2 = scale * LOG2E;

  load_tile<BQ, DP, LDH>(Qs, qp, qs, nq, d);
  if (tid < BQ) row_keys(q0 + tid, tq, tk, mask, cu, nseg, row_lo[tid], row_hi[tid]);
  int klo = 0, khi = 0, dummy;
  row_keys(q0, tq, tk, mask, cu, nseg, klo, dummy);
  row_keys(q0 + nq - 1, tq, tk, mask, cu, nseg, dummy, khi);
  __syncthreads();

  wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> qa[KD];
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) wmma::load_matrix_sync(qa[kk], Qs + warp * 16 * LDH + kk * 16, LDH);

  const int r = lane >> 1, half = lane & 1;  // this lane's row among the warp's 16, its column parity
  const int i = warp * 16 + r;
  const int lo = row_lo[i], hi = row_hi[i];
  float m = -INFINITY, l = 0.f, o[OC];
#pragma unroll
  for (int c = 0; c < OC; ++c) o[c] = 0.f;

  for (int k0 = klo; k0 < khi; k0 += BK) {
    const int nk = min(BK, khi - k0);
    load_tile<BK, DP, LDH>(Ks, kp + (long long)k0 * d, d, nk, d);
    load_tile<BK, DP, LDH>(Vs, vp + (long long)k0 * d, d, nk, d);
    if (tid < BK) key_ok[tid] = tid < nk && (!has_keep || keep[(long long)b * tk + k0 + tid] != 0);
    __syncthreads();

    // S (16 x BK) = Q_w K^T: K row-major (key, d) is K^T column-major.
#pragma unroll
    for (int n = 0; n < BK / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> kb;
        wmma::load_matrix_sync(kb, Ks + n * 16 * LDH + kk * 16, LDH);
        wmma::mma_sync(acc, qa[kk], kb, acc);
      }
      wmma::store_matrix_sync(Sf + n * 16, acc, LDS, wmma::mem_row_major);
    }
    __syncwarp();

    float s[BK / 2];
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < BK / 2; ++c) {
      const int jj = 2 * c + half, j = k0 + jj;
      const bool ok = key_ok[jj] && j >= lo && j < hi;
      s[c] = ok ? Sf[r * LDS + jj] * sl2 : -INFINITY;
      mx = fmaxf(mx, s[c]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float mnew = fmaxf(m, mx);
    const float alpha = mnew == -INFINITY ? 1.f : exp2f(m - mnew);
    float rs = 0.f;
#pragma unroll
    for (int c = 0; c < BK / 2; ++c) {
      const float p = mnew == -INFINITY ? 0.f : exp2f(s[c] - mnew);
      Pb[r * LDP + 2 * c + half] = __float2bfloat16_rn(p);
      rs += p;
    }
    rs += __shfl_xor_sync(0xffffffffu, rs, 1);
    l = l * alpha + rs;
    m = mnew;
#pragma unroll
    for (int c = 0; c < OC; ++c) o[c] *= alpha;
    __syncwarp();

    // P V (16 x DP), added to the running output.
#pragma unroll
    for (int n = 0; n < KD; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> pa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> vb;
        wmma::load_matrix_sync(pa, Pb + kk * 16, LDP);
        wmma::load_matrix_sync(vb, Vs + kk * 16 * LDH + n * 16, LDH);
        wmma::mma_sync(acc, pa, vb, acc);
      }
      wmma::store_matrix_sync(Of + n * 16, acc, LDO, wmma::mem_row_major);
    }
    __syncwarp();
#pragma unroll
    for (int c = 0; c < OC; ++c) o[c] += Of[r * LDO + 2 * c + half];
    __syncthreads();  // every warp is done with Ks, Vs before the next tile overwrites them
  }

  if (i < nq) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    bf16* op = out + ((long long)bh * tq + q0 + i) * d;
#pragma unroll
    for (int c = 0; c < OC; ++c) {
      const int col = 2 * c + half;
      if (col < d) op[col] = __float2bfloat16_rn(o[c] * inv);
    }
    if (half == 0) lse[(long long)bh * tq + q0 + i] = l > 0.f ? (m + log2f(l)) * LN2 : -INFINITY;
  }
}


// ---- Tensor-core backward for bf16 ----
// One block per (key tile, b * Hq + h), 4 warps; warp w owns keys w*16.. for S^T, dP^T, dK, dV and query
// rows w*16.. for dQ. Per query tile: S^T = K Q^T and dP^T = V dO^T (wmma, f32) into shared memory;
// P^T = exp(S^T - lse) and dS^T = scale P^T (dP^T - D) per element (2 lanes per key row) rounded to bf16;
// dV += P^T dO and dK += dS^T Q in register fragments (f32); after a block barrier dQ = dS K (dS read
// column-major from dS^T) goes through shared memory to f32 atomicAdd, as in the CUDA-core kernel; dK, dV
// are added to the kv head's rows at the end. Products take bf16 operands (P, dS rounded as in
// FlashAttention-2), accumulate in f32.
template <int DP>
struct TcBwdLayout {
  static constexpr int LDH = DP + 8;  // bf16 row stride of K, V, Q, dO tiles
  static constexpr int LDS = BQ + 4;  // f32 row stride of S^T, dP^T (key rows, query columns)
  static constexpr int LDP = BQ + 8;  // bf16 row stride of P^T, dS^T
  static constexpr int LDO = DP + 4;  // f32 row stride of the dQ (and final dK, dV) staging
  static constexpr int TILE = 64 * LDH * 2;
  // The dQ / dK / dV staging rows share their bytes with S^T and dP^T, which are dead once P^T and dS^T
  // are written (a block barrier before the first staging store): DP 80 then fits the sm_86/sm_89 opt-in.
  static constexpr int ST = 2 * BK * LDS * 4 > BQ * LDO * 4 ? 2 * BK * LDS * 4 : BQ * LDO * 4;
  static constexpr int BYTES = 4 * TILE + ST + 2 * BK * LDP * 2 + (2 * BQ) * 4 + (2 * BQ + BK) * 4;
};

template <int DP>
__device__ __forceinline__ void backward_tc(const __nv_bfloat16* __restrict__ qod, const __nv_bfloat16* __restrict__ k,
                                            const __nv_bfloat16* __restrict__ v, const float* __restrict__ lse,
                                            const float* __restrict__ dlt, float* __restrict__ dacc,
                                            const uint8_t* __restrict__ keep, const int* __restrict__ cu, int nseg,
                                            int nb, int hq, int hkv, int tq, int tk, int d, int mask, int has_keep,
                                            float scale) {
  using namespace nvcuda;
  using L = TcBwdLayout<DP>;
  using bf16 = __nv_bfloat16;
  constexpr int LDH = L::LDH, LDS = L::LDS, LDP = L::LDP, LDO = L::LDO;
  constexpr int KD = DP / 16;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  unsigned char* p8 = tc_smem;
  bf16* Ks = reinterpret_cast<bf16*>(p8);                    // (BK, LDH)
  bf16* Vs = reinterpret_cast<bf16*>(p8 + L::TILE);          // (BK, LDH)
  bf16* Qs = reinterpret_cast<bf16*>(p8 + 2 * L::TILE);      // (BQ, LDH)
  bf16* dOs = reinterpret_cast<bf16*>(p8 + 3 * L::TILE);     // (BQ, LDH)
  p8 += 4 * L::TILE;
  float* St = reinterpret_cast<float*>(p8);                  // (BK, LDS): S^T
  float* dPt = St + BK * LDS;                                // (BK, LDS): dP^T
  float* stage = St;                                         // (BQ, LDO): dQ rows, then dK / dV rows
  p8 += L::ST;
  bf16* Pt = reinterpret_cast<bf16*>(p8);                    // (BK, LDP): P^T
  bf16* dSt = Pt + BK * LDP;                                 // (BK, LDP): dS^T
  p8 += 2 * BK * LDP * 2;
  float* lse_s = reinterpret_cast<float*>(p8);               // (BQ), base 2
  float* dlt_s = lse_s + BQ;                                 // (BQ)
  int* row_lo = reinterpret_cast<int*>(dlt_s + BQ);          // (BQ)
  int* row_hi = row_lo + BQ;                                 // (BQ)
  int* key_ok = row_hi + BQ;                                 // (BK)

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int k0 = blockIdx.x * BK;
  const int bh = blockIdx.y;
  const int b = bh / hq, h = bh % hq;
  const long long kvh = (long long)b * hkv + h / (hq / hkv);
  const int nk = min(BK, tk - k0);
  const bf16* kp = k + (kvh * tk + k0) * d;
  const bf16* vp = v + (kvh * tk + k0) * d;
  const long long nq_all = (long long)nb * hq * tq * d, nk_all = (long long)nb * hkv * tk * d;
  float* dq = dacc;
  float* dk = dacc + nq_all + (kvh * tk + k0) * d;
  float* dv = dacc + nq_all + nk_all + (kvh * tk + k0) * d;
  const float sl2 = scale * LOG2E;

  load_tile<BK, DP, LDH>(Ks, kp, d, nk, d);
  load_tile<BK, DP, LDH>(Vs, vp, d, nk, d);
  if (tid < BK) key_ok[tid] = tid < nk && (!has_keep || keep[(long long)b * tk + k0 + tid] != 0);

  int qlo, qhi;
  tile_queries(k0, nk, tq, tk, mask, cu, nseg, qlo, qhi);

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> dka[KD], dva[KD];
#pragma unroll
  for (int n = 0; n < KD; ++n) {
    wmma::fill_fragment(dka[n], 0.f);
    wmma::fill_fragment(dva[n], 0.f);
  }
  const int r = lane >> 1, half = lane & 1;  // elementwise: key row warp*16 + r, query columns 2c + half
  const int jj = warp * 16 + r, j = k0 + jj;

  for (int q0 = qlo; q0 < qhi; q0 += BQ) {
    const int nq = min(BQ, qhi - q0);
    __syncthreads();  // the previous tile's readers are done (and K, V, key_ok are loaded)
    const bf16* qp = qod + ((long long)bh * tq + q0) * 3 * d;
    load_tile<BQ, DP, LDH>(Qs, qp, 3 * d, nq, d);
    load_tile<BQ, DP, LDH>(dOs, qp + 2 * d, 3 * d, nq, d);
    if (tid < BQ) {
      const bool in = tid < nq;
      const long long row = (long long)bh * tq + q0 + tid;
      lse_s[tid] = in ? lse[row] * LOG2E : -INFINITY;
      dlt_s[tid] = in ? dlt[row] : 0.f;
      row_keys(in ? q0 + tid : tq, tq, tk, mask, cu, nseg, row_lo[tid], row_hi[tid]);
    }
    __syncthreads();

    // S^T (16 keys x BQ) = K_w Q^T and dP^T = V_w dO^T: Q, dO row-major are Q^T, dO^T column-major.
#pragma unroll
    for (int n = 0; n < BQ / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> s, dp;
      wmma::fill_fragment(s, 0.f);
      wmma::fill_fragment(dp, 0.f);
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> bq;
        wmma::load_matrix_sync(a, Ks + warp * 16 * LDH + kk * 16, LDH);
        wmma::load_matrix_sync(bq, Qs + n * 16 * LDH + kk * 16, LDH);
        wmma::mma_sync(s, a, bq, s);
        wmma::load_matrix_sync(a, Vs + warp * 16 * LDH + kk * 16, LDH);
        wmma::load_matrix_sync(bq, dOs + n * 16 * LDH + kk * 16, LDH);
        wmma::mma_sync(dp, a, bq, dp);
      }
      wmma::store_matrix_sync(St + warp * 16 * LDS + n * 16, s, LDS, wmma::mem_row_major);
      wmma::store_matrix_sync(dPt + warp * 16 * LDS + n * 16, dp, LDS, wmma::mem_row_major);
    }
    __syncwarp();

#pragma unroll 8
    for (int c = 0; c < BQ / 2; ++c) {
      const int i = 2 * c + half;
      const bool ok = key_ok[jj] && j >= row_lo[i] && j < row_hi[i] && lse_s[i] != -INFINITY;
      const float p = ok ? exp2f(St[jj * LDS + i] * sl2 - lse_s[i]) : 0.f;
      Pt[jj * LDP + i] = __float2bfloat16_rn(p);
      dSt[jj * LDP + i] = __float2bfloat16_rn(scale * p * (dPt[jj * LDS + i] - dlt_s[i]));
    }
    __syncwarp();

    // dV_w += P^T_w dO, dK_w += dS^T_w Q.
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> pa, sa;
      wmma::load_matrix_sync(pa, Pt + warp * 16 * LDP + kk * 16, LDP);
      wmma::load_matrix_sync(sa, dSt + warp * 16 * LDP + kk * 16, LDP);
#pragma unroll
      for (int n = 0; n < KD; ++n) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> bo;
        wmma::load_matrix_sync(bo, dOs + kk * 16 * LDH + n * 16, LDH);
        wmma::mma_sync(dva[n], pa, bo, dva[n]);
        wmma::load_matrix_sync(bo, Qs + kk * 16 * LDH + n * 16, LDH);
        wmma::mma_sync(dka[n], sa, bo, dka[n]);
      }
    }
    __syncthreads();  // every warp's dS^T rows are in place

    // dQ (query rows w*16.., DP) = dS K: dS = (dS^T)^T, read column-major from dS^T.
#pragma unroll
    for (int n = 0; n < KD; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> sa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> kb;
        wmma::load_matrix_sync(sa, dSt + kk * 16 * LDP + warp * 16, LDP);
        wmma::load_matrix_sync(kb, Ks + kk * 16 * LDH + n * 16, LDH);
        wmma::mma_sync(acc, sa, kb, acc);
      }
      wmma::store_matrix_sync(stage + warp * 16 * LDO + n * 16, acc, LDO, wmma::mem_row_major);
    }
    __syncwarp();
    for (int x = lane; x < 16 * d; x += 32) {
      const int rr = x / d, c = x % d, i = warp * 16 + rr;
      if (i < nq) atomicAdd(dq + ((long long)bh * tq + q0 + i) * d + c, stage[(warp * 16 + rr) * LDO + c]);
    }
  }

  // dK, dV rows of this warp's keys, through the staging rows of the warp.
  __syncwarp();
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int n = 0; n < KD; ++n)
      wmma::store_matrix_sync(stage + warp * 16 * LDO + n * 16, pass == 0 ? dka[n] : dva[n], LDO,
                              wmma::mem_row_major);
    __syncwarp();
    float* dst = pass == 0 ? dk : dv;
    for (int x = lane; x < 16 * d; x += 32) {
      const int rr = x / d, c = x % d, key = warp * 16 + rr;
      if (key < nk) atomicAdd(dst + (long long)key * d + c, stage[key * LDO + c]);
    }
    __syncwarp();
  }
}

}  // namespace attn
}  // namespace askgui

using askgui::attn::TC_THREADS;
#define ASKGUI_ATTENTION_TC(DP)                                                                           \
  extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_fwd_tc_bf16_##DP(                    \
      const __nv_bfloat16* q, int qs, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out, \
      float* lse, const uint8_t* keep, const int* cu, int nseg, int hq, int hkv, int tq, int tk, int d,   \
      int mask, int has_keep, float scale) {                                                             \
    askgui::attn::forward_tc<DP>(q, qs, k, v, out, lse, keep, cu, nseg, hq, hkv, tq, tk, d, mask, has_keep, \
                                 scale);                                                                  \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_bwd_tc_bf16_##DP(                    \
      const __nv_bfloat16* qod, const __nv_bfloat16* k, const __nv_bfloat16* v, const float* lse,         \
      const float* dlt, float* dacc, const uint8_t* keep, const int* cu, int nseg, int nb, int hq, int hkv, \
      int tq, int tk, int d, int mask, int has_keep, float scale) {                                       \
    askgui::attn::backward_tc<DP>(qod, k, v, lse, dlt, dacc, keep, cu, nseg, nb, hq, hkv, tq, tk, d, mask,  \
                                  has_keep, scale);                                                       \
  }
ASKGUI_ATTENTION_TC(32)
ASKGUI_ATTENTION_TC(64)
ASKGUI_ATTENTION_TC(80)
ASKGUI_ATTENTION_TC(96)
ASKGUI_ATTENTION_TC(128)

