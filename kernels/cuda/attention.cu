// FlashAttention-2 style attention, forward and backward (Tri Dao, "FlashAttention-2: Faster Attention
// with Better Parallelism and Work Partitioning", 2023), for `ops::attention` (kernels/src/ops/attention.rs,
// launch code in kernels/src/ops/attention/cuda.rs; the CPU op and `attention_reference` are the spec).
//
// Shapes: q (B, Hq, Tq, D), k, v (B, Hkv, Tk, D), GQA Hq % Hkv == 0; the backward reads q, O, dO packed as
// (B, Hq, Tq, 3D). Masks: none, causal (the queries are the last Tq of the Tk positions), block-diagonal
// over `cu` (nseg + 1 boundaries, Tq == Tk), the same segments causal inside each (packed sequences), and an
// optional key padding `keep` (B, Tk), 1 = real key.
// A query row with no visible key outputs exactly 0, has lse = -inf and contributes no gradient.
//
// Key choices:
// - straightforward shared-memory tiling on CUDA cores, correctness first: 64 x 64 tiles, 256 threads as
//   16 x 16 (thread (ty, tx) owns 4 rows ty*4.. and the 16-strided columns tx + 16 c), tiles converted to
//   f32 in shared memory, every product, statistic and accumulator in f32 whatever the storage (f32/bf16);
// - the head dimension is a template `DP` (a multiple of 16, 32..128); a smaller D runs in the next DP
//   with zero padding in shared memory, so loops have constant trip counts;
// - forward: one block per (query tile, b * Hq + h); online softmax in base 2 (scores pre-multiplied by
//   scale * log2 e); only the key tiles that some row of the tile may see are visited (causal prefix,
//   the rows' segments); writes O and the natural-log logsumexp (B, Hq, Tq) kept for the backward;
// - backward: `attention_delta` computes D_i = rowsum(dO_i * O_i); then one block per (key tile,
//   b * Hq + h) recomputes P = exp(S - lse) over the query tiles that can see its keys and accumulates
//   dV += P^T dO, dK += dS^T Q in registers, dQ += dS K by f32 atomicAdd; dK, dV go to the kv head's rows
//   by atomicAdd too (the Hq / Hkv query heads of a group share them). All three land in one zeroed f32
//   buffer laid out as the op's output [dq, dk, dv]; `attention_cast_bf16` rounds it for bf16. The
//   backward comes with 64 x 64 tiles and 32 x 32 ones (`attention_bwd_small_*`), which fit the 101,376
//   bytes of shared memory of sm_86/sm_89 at every DP; the launch plan (kernels/src/plan/attention.rs)
//   picks the largest that fits the device;
// - bf16 has tensor-core twins of these kernels in attention_tc.cu (same contract); these CUDA-core ones
//   serve f32, and bf16 on devices without the shared memory the tensor-core ones need.
//
// Compile check: nvcc -ptx -arch=compute_80 -std=c++17 -Icuda cuda/attention.cu (build.rs does this);
// executed on a CPU: cargo test -p askgui-kernels --features cpu-exec --test emu attention.
#include "attention.cuh"

namespace askgui {
namespace attn {

// Dynamic shared memory of the forward, in bytes (the Rust side computes the same number).
template <int DP>
constexpr int fwd_smem_bytes() {
  return (BQ * (DP + 1) + BK * (DP + 1) + BQ * (BK + 1)) * 4 + (2 * BQ + BK) * 4;
}

// Forward of one (query tile, b * hq + h). q rows are qs elements apart (D, or 3D inside the packed
// [q, O, dO] when the backward recomputes lse); out (B, Hq, Tq, D), lse (B, Hq, Tq).
template <typename T, int DP>
__device__ __forceinline__ void forward(const T* __restrict__ q, int qs, const T* __restrict__ k,
                                        const T* __restrict__ v,
                                        T* __restrict__ out, float* __restrict__ lse,
                                        const uint8_t* __restrict__ keep, const int* __restrict__ cu, int nseg,
                                        int hq, int hkv, int tq, int tk, int d, int mask, int has_keep,
                                        float scale) {
  constexpr int LD = DP + 1;  // odd row stride: the 16 rows a half-warp reads fall in distinct banks
  constexpr int PD = BK + 1;
  constexpr int DC = DP / 16;  // output columns per thread
  extern __shared__ float smem[];
  float* Qs = smem;              // (BQ, LD)
  float* KVs = Qs + BQ * LD;     // (BK, LD): K, then V, of the current key tile
  float* Ps = KVs + BK * LD;     // (BQ, PD): probabilities of the current key tile
  int* row_lo = reinterpret_cast<int*>(Ps + BQ * PD);  // (BQ)
  int* row_hi = row_lo + BQ;                            // (BQ)
  int* key_ok = row_hi + BQ;                            // (BK): 1 = a real key of this tile

  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int q0 = blockIdx.x * BQ;
  const int bh = blockIdx.y;
  const int b = bh / hq, h = bh % hq;
  const long long kvh = (long long)b * hkv + h / (hq / hkv);
  const int nq = min(BQ, tq - q0);
  const T* qp = q + ((long long)bh * tq + q0) * qs;
  const T* kp = k + kvh * tk * d;
  const T* vp = v + kvh * tk * d;
  const float sl2 = scale * LOG2E;

  for (int x = tid; x < BQ * DP; x += THREADS) {
    const int r = x / DP, c = x % DP;
    Qs[r * LD + c] = (r < nq && c < d) ? to_f32(qp[(long long)r * qs + c]) : 0.f;
  }
  if (tid < BQ) row_keys(q0 + tid, tq, tk, mask, cu, nseg, row_lo[tid], row_hi[tid]);
  // Keys any row of the tile may see: lo and hi are non-decreasing in the row for every mask.
  int klo = 0, khi = 0, dummy;
  row_keys(q0, tq, tk, mask, cu, nseg, klo, dummy);
  row_keys(q0 + nq - 1, tq, tk, mask, cu, nseg, dummy, khi);
  __syncthreads();

  float m[4], l[4], acc[4][DC];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < DC; ++c) acc[r][c] = 0.f;
  }

  for (int k0 = klo; k0 < khi; k0 += BK) {
    const int nk = min(BK, khi - k0);
    for (int x = tid; x < BK * DP; x += THREADS) {
      const int r = x / DP, c = x % DP;
      KVs[r * LD + c] = (r < nk && c < d) ? to_f32(kp[(long long)(k0 + r) * d + c]) : 0.f;
    }
    if (tid < BK) key_ok[tid] = tid < nk && (!has_keep || keep[(long long)b * tk + k0 + tid] != 0);
    __syncthreads();

    // S = Q K^T for rows ty*4 + r, keys tx + 16 c.
    float s[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[r][c] = 0.f;
#pragma unroll 8
    for (int x = 0; x < DP; ++x) {
      float qa[4], kb[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) qa[r] = Qs[(ty * 4 + r) * LD + x];
#pragma unroll
      for (int c = 0; c < 4; ++c) kb[c] = KVs[(tx + 16 * c) * LD + x];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[r][c] = fmaf(qa[r], kb[c], s[r][c]);
    }

    // Online softmax; a row's 64 scores sit in the 16 lanes of one half-warp.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = ty * 4 + r;
      const int lo = row_lo[i], hi = row_hi[i];
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int jj = tx + 16 * c, j = k0 + jj;
        const bool ok = key_ok[jj] && j >= lo && j < hi;
        s[r][c] = ok ? s[r][c] * sl2 : -INFINITY;
        mx = fmaxf(mx, s[r][c]);
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float mnew = fmaxf(m[r], mx);
      // Nothing visible yet: keep everything at zero (and avoid -inf - -inf).
      const float alpha = mnew == -INFINITY ? 1.f : exp2f(m[r] - mnew);
      float rs = 0.f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float p = mnew == -INFINITY ? 0.f : exp2f(s[r][c] - mnew);
        rs += p;
        Ps[i * PD + tx + 16 * c] = p;
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) rs += __shfl_xor_sync(0xffffffffu, rs, o);
      l[r] = l[r] * alpha + rs;
      m[r] = mnew;
#pragma unroll
      for (int c = 0; c < DC; ++c) acc[r][c] *= alpha;
    }
    __syncthreads();  // K no longer read, P complete

    for (int x = tid; x < BK * DP; x += THREADS) {
      const int r = x / DP, c = x % DP;
      KVs[r * LD + c] = (r < nk && c < d) ? to_f32(vp[(long long)(k0 + r) * d + c]) : 0.f;
    }
    __syncthreads();

    // acc += P V for rows ty*4 + r, columns tx + 16 c.
#pragma unroll 4
    for (int jj = 0; jj < BK; ++jj) {
      float pv[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) pv[r] = Ps[(ty * 4 + r) * PD + jj];
#pragma unroll
      for (int c = 0; c < DC; ++c) {
        const float vv = KVs[jj * LD + tx + 16 * c];
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[r][c] = fmaf(pv[r], vv, acc[r][c]);
      }
    }
    __syncthreads();  // before the next tile overwrites KVs and Ps
  }

#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = ty * 4 + r;
    if (i >= nq) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    T* op = out + ((long long)bh * tq + q0 + i) * d;
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const int col = tx + 16 * c;
      if (col < d) op[col] = from_f32<T>(acc[r][c] * inv);
    }
    if (tx == 0) lse[(long long)bh * tq + q0 + i] = l[r] > 0.f ? (m[r] + log2f(l[r])) * LN2 : -INFINITY;
  }
}


// delta[row] = sum_c dO[row, c] * O[row, c] over the packed rows [q, O, dO] (3D each); one warp per row.
template <typename T>
__device__ __forceinline__ void delta(const T* __restrict__ qod, float* __restrict__ out, long long rows, int d) {
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warps leave together
  const T* p = qod + row * 3 * d;
  float acc = 0.f;
  for (int c = lane; c < d; c += 32) acc += to_f32(p[d + c]) * to_f32(p[2 * d + c]);
  acc = warp_sum(acc);
  if (lane == 0) out[row] = acc;
}

// Backward of one (key tile, b * hq + h), with TK-row key tiles and TQ-row query tiles (64 x 64 where
// the shared memory allows; 32 x 32 fits 101,376 bytes, the sm_86/sm_89 opt-in, up to DP 128). Thread
// (ty, tx) owns key rows ty*RK.. and query columns tx + 16 c (c < CQ) of S^T, key rows ty*RK.. of dK and
// dV, query rows ty*RQ.. of the tile's dQ. dacc = [dq (B, Hq, Tq, D), dk (B, Hkv, Tk, D), dv (same)] in
// f32, zeroed by the caller, accumulated by atomicAdd.
template <int DP, int TQ, int TK>
constexpr int bwd_smem_bytes() {
  return (2 * TQ * (DP + 1) + 2 * TK * (DP + 1) + TK * (TQ + 1)) * 4 + (4 * TQ + TK) * 4;
}

template <typename T, int DP, int TQ, int TK>
__device__ __forceinline__ void backward(const T* __restrict__ qod, const T* __restrict__ k,
                                         const T* __restrict__ v, const float* __restrict__ lse,
                                         const float* __restrict__ dlt, float* __restrict__ dacc,
                                         const uint8_t* __restrict__ keep, const int* __restrict__ cu, int nseg,
                                         int nb, int hq, int hkv, int tq, int tk, int d, int mask, int has_keep,
                                         float scale) {
  static_assert(TQ % 16 == 0 && TK % 16 == 0 && TQ <= 64 && TK <= 64, "tiles of 16..64 rows");
  constexpr int LD = DP + 1;
  constexpr int SD = TQ + 1;
  constexpr int DC = DP / 16;
  constexpr int RK = TK / 16;  // key rows per thread
  constexpr int RQ = TQ / 16;  // query rows per thread (dQ)
  constexpr int CQ = TQ / 16;  // query columns per thread (S^T)
  extern __shared__ float smem[];
  float* Ks = smem;               // (TK, LD)
  float* Vs = Ks + TK * LD;       // (TK, LD)
  float* Qs = Vs + TK * LD;       // (TQ, LD)
  float* dOs = Qs + TQ * LD;      // (TQ, LD)
  float* Ss = dOs + TQ * LD;      // (TK, SD): P^T, then dS^T, of the current query tile
  float* lse_s = Ss + TK * SD;    // (TQ) lse in base 2
  float* dlt_s = lse_s + TQ;      // (TQ)
  int* row_lo = reinterpret_cast<int*>(dlt_s + TQ);  // (TQ)
  int* row_hi = row_lo + TQ;                          // (TQ)
  int* key_ok = row_hi + TQ;                          // (TK)

  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int k0 = blockIdx.x * TK;
  const int bh = blockIdx.y;
  const int b = bh / hq, h = bh % hq;
  const long long kvh = (long long)b * hkv + h / (hq / hkv);
  const int nk = min(TK, tk - k0);
  const T* kp = k + (kvh * tk + k0) * d;
  const T* vp = v + (kvh * tk + k0) * d;
  const long long nq_all = (long long)nb * hq * tq * d, nk_all = (long long)nb * hkv * tk * d;
  float* dq = dacc;
  float* dk = dacc + nq_all + (kvh * tk + k0) * d;
  float* dv = dacc + nq_all + nk_all + (kvh * tk + k0) * d;
  const float sl2 = scale * LOG2E;

  for (int x = tid; x < TK * DP; x += THREADS) {
    const int r = x / DP, c = x % DP;
    const bool in = r < nk && c < d;
    Ks[r * LD + c] = in ? to_f32(kp[(long long)r * d + c]) : 0.f;
    Vs[r * LD + c] = in ? to_f32(vp[(long long)r * d + c]) : 0.f;
  }
  if (tid < TK) key_ok[tid] = tid < nk && (!has_keep || keep[(long long)b * tk + k0 + tid] != 0);

  // Query rows that may see some key of the tile.
  int qlo, qhi;
  tile_queries(k0, nk, tq, tk, mask, cu, nseg, qlo, qhi);

  float dka[RK][DC], dva[RK][DC];
#pragma unroll
  for (int r = 0; r < RK; ++r)
#pragma unroll
    for (int c = 0; c < DC; ++c) dka[r][c] = dva[r][c] = 0.f;

  for (int q0 = qlo; q0 < qhi; q0 += TQ) {
    const int nq = min(TQ, qhi - q0);
    __syncthreads();  // the previous tile's readers of Qs, dOs, Ss are done (and K, V are loaded)
    const T* qp = qod + ((long long)bh * tq + q0) * 3 * d;
    for (int x = tid; x < TQ * DP; x += THREADS) {
      const int r = x / DP, c = x % DP;
      const bool in = r < nq && c < d;
      Qs[r * LD + c] = in ? to_f32(qp[(long long)r * 3 * d + c]) : 0.f;
      dOs[r * LD + c] = in ? to_f32(qp[(long long)r * 3 * d + 2 * d + c]) : 0.f;
    }
    if (tid < TQ) {
      const bool in = tid < nq;
      const long long row = (long long)bh * tq + q0 + tid;
      lse_s[tid] = in ? lse[row] * LOG2E : -INFINITY;
      dlt_s[tid] = in ? dlt[row] : 0.f;
      row_keys(in ? q0 + tid : tq, tq, tk, mask, cu, nseg, row_lo[tid], row_hi[tid]);
    }
    __syncthreads();

    // S^T = K Q^T and dP^T = V dO^T for keys ty*RK + r, queries tx + 16 c.
    float p[RK][CQ], dp[RK][CQ];
#pragma unroll
    for (int r = 0; r < RK; ++r)
#pragma unroll
      for (int c = 0; c < CQ; ++c) p[r][c] = dp[r][c] = 0.f;
#pragma unroll 4
    for (int x = 0; x < DP; ++x) {
      float ka[RK], va[RK], qb[CQ], ob[CQ];
#pragma unroll
      for (int r = 0; r < RK; ++r) {
        ka[r] = Ks[(ty * RK + r) * LD + x];
        va[r] = Vs[(ty * RK + r) * LD + x];
      }
#pragma unroll
      for (int c = 0; c < CQ; ++c) {
        qb[c] = Qs[(tx + 16 * c) * LD + x];
        ob[c] = dOs[(tx + 16 * c) * LD + x];
      }
#pragma unroll
      for (int r = 0; r < RK; ++r)
#pragma unroll
        for (int c = 0; c < CQ; ++c) {
          p[r][c] = fmaf(ka[r], qb[c], p[r][c]);
          dp[r][c] = fmaf(va[r], ob[c], dp[r][c]);
        }
    }
#pragma unroll
    for (int r = 0; r < RK; ++r) {
      const int jj = ty * RK + r, j = k0 + jj;
#pragma unroll
      for (int c = 0; c < CQ; ++c) {
        const int i = tx + 16 * c;
        const bool ok = key_ok[jj] && j >= row_lo[i] && j < row_hi[i] && lse_s[i] != -INFINITY;
        p[r][c] = ok ? exp2f(p[r][c] * sl2 - lse_s[i]) : 0.f;
        Ss[jj * SD + i] = p[r][c];
      }
    }
    __syncthreads();

    // dV += P^T dO for keys ty*RK + r, columns tx + 16 c.
#pragma unroll 4
    for (int i = 0; i < TQ; ++i) {
      float pa[RK];
#pragma unroll
      for (int r = 0; r < RK; ++r) pa[r] = Ss[(ty * RK + r) * SD + i];
#pragma unroll
      for (int c = 0; c < DC; ++c) {
        const float o = dOs[i * LD + tx + 16 * c];
#pragma unroll
        for (int r = 0; r < RK; ++r) dva[r][c] = fmaf(pa[r], o, dva[r][c]);
      }
    }
    __syncthreads();

    // dS = scale * P * (dP - D_i), stored transposed like P.
#pragma unroll
    for (int r = 0; r < RK; ++r)
#pragma unroll
      for (int c = 0; c < CQ; ++c) {
        const int i = tx + 16 * c;
        Ss[(ty * RK + r) * SD + i] = scale * p[r][c] * (dp[r][c] - dlt_s[i]);
      }
    __syncthreads();

    // dK += dS^T Q for keys ty*RK + r; dQ += dS K for queries ty*RQ + r (atomics: other key tiles add too).
#pragma unroll 4
    for (int i = 0; i < TQ; ++i) {
      float sa[RK];
#pragma unroll
      for (int r = 0; r < RK; ++r) sa[r] = Ss[(ty * RK + r) * SD + i];
#pragma unroll
      for (int c = 0; c < DC; ++c) {
        const float qv = Qs[i * LD + tx + 16 * c];
#pragma unroll
        for (int r = 0; r < RK; ++r) dka[r][c] = fmaf(sa[r], qv, dka[r][c]);
      }
    }
    float dqa[RQ][DC];
#pragma unroll
    for (int r = 0; r < RQ; ++r)
#pragma unroll
      for (int c = 0; c < DC; ++c) dqa[r][c] = 0.f;
#pragma unroll 4
    for (int jj = 0; jj < TK; ++jj) {
      float sa[RQ];
#pragma unroll
      for (int r = 0; r < RQ; ++r) sa[r] = Ss[jj * SD + ty * RQ + r];
#pragma unroll
      for (int c = 0; c < DC; ++c) {
        const float kv = Ks[jj * LD + tx + 16 * c];
#pragma unroll
        for (int r = 0; r < RQ; ++r) dqa[r][c] = fmaf(sa[r], kv, dqa[r][c]);
      }
    }
#pragma unroll
    for (int r = 0; r < RQ; ++r) {
      const int i = ty * RQ + r;
      if (i >= nq) continue;
      float* dqp = dq + ((long long)bh * tq + q0 + i) * d;
#pragma unroll
      for (int c = 0; c < DC; ++c) {
        const int col = tx + 16 * c;
        if (col < d) atomicAdd(dqp + col, dqa[r][c]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < RK; ++r) {
    const int jj = ty * RK + r;
    if (jj >= nk) continue;
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const int col = tx + 16 * c;
      if (col < d) {
        atomicAdd(dk + (long long)jj * d + col, dka[r][c]);  // dS carries the scale already
        atomicAdd(dv + (long long)jj * d + col, dva[r][c]);
      }
    }
  }
}

}  // namespace attn
}  // namespace askgui

using askgui::attn::THREADS;

// The backward with TQ x TK tiles: attention_bwd_<NAME>_<DP> (64 x 64) or attention_bwd_small_<NAME>_<DP>
// (32 x 32, for devices whose shared memory does not hold the large tiles).
#define ASKGUI_ATTENTION_BWD(NAME, T, DP, TILES, TQ, TK)                                                    \
  extern "C" __global__ void __launch_bounds__(THREADS) attention_bwd_##TILES##NAME##_##DP(                \
      const T* qod, const T* k, const T* v, const float* lse, const float* dlt, float* dacc,                \
      const uint8_t* keep, const int* cu, int nseg, int nb, int hq, int hkv, int tq, int tk, int d,         \
      int mask, int has_keep, float scale) {                                                                \
    askgui::attn::backward<T, DP, TQ, TK>(qod, k, v, lse, dlt, dacc, keep, cu, nseg, nb, hq, hkv, tq, tk, d, \
                                          mask, has_keep, scale);                                           \
  }

#define ASKGUI_ATTENTION(NAME, T, DP)                                                                       \
  extern "C" __global__ void __launch_bounds__(THREADS) attention_fwd_##NAME##_##DP(                        \
      const T* q, int qs, const T* k, const T* v, T* out, float* lse, const uint8_t* keep, const int* cu,   \
      int nseg, int hq, int hkv, int tq, int tk, int d, int mask, int has_keep, float scale) {              \
    askgui::attn::forward<T, DP>(q, qs, k, v, out, lse, keep, cu, nseg, hq, hkv, tq, tk, d, mask, has_keep,    \
                                 scale);                                                                    \
  }                                                                                                         \
  ASKGUI_ATTENTION_BWD(NAME, T, DP, , 64, 64)                                                             \
  ASKGUI_ATTENTION_BWD(NAME, T, DP, small_, 32, 32)

#define ASKGUI_ATTENTION_DTYPE(NAME, T)                                                              \
  ASKGUI_ATTENTION(NAME, T, 32)                                                                      \
  ASKGUI_ATTENTION(NAME, T, 64)                                                                      \
  ASKGUI_ATTENTION(NAME, T, 80)                                                                      \
  ASKGUI_ATTENTION(NAME, T, 96)                                                                      \
  ASKGUI_ATTENTION(NAME, T, 128)                                                                     \
  extern "C" __global__ void attention_delta_##NAME(const T* qod, float* out, long long rows, int d) { \
    askgui::attn::delta<T>(qod, out, rows, d);                                                       \
  }

ASKGUI_ATTENTION_DTYPE(f32, float)
ASKGUI_ATTENTION_DTYPE(bf16, __nv_bfloat16)


// out[i] = bf16(acc[i]): the f32 gradient accumulator rounded once.
extern "C" __global__ void attention_cast_bf16(const float* acc, __nv_bfloat16* out, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16_rn(acc[i]);
}
