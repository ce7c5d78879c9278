// Masked cross-entropy over a large vocabulary (V up to 152k): the CUDA side of
// `src/ops/cross_entropy.rs`, whose CPU kernel is the spec.
//
// Forward: one block per row, one pass over the logits with an online logsumexp (each thread keeps a
// running max m and sum s of exp(x - m), rescaled when m grows; the block then combines the (m, s) pairs).
// It writes the row's loss `lse - logits[label]` and its `lse` (f32), which the op keeps for backward.
// Unsupervised rows (mask == 0) read nothing but the mask. A one-block kernel then takes the mean over
// the supervised rows (count from the host, which validated the labels).
// Backward: one more pass, `scale * (exp(x - lse) - onehot)` written straight into dlogits (zeros on
// unsupervised rows): no probability tensor is ever materialised.
// Math in f32 (expf/logf, not the fast intrinsics: the loss of a 152k vocabulary sums 152k terms).
// Infinite logits as the CPU op defines them: with k logits at +inf the softmax is 1/k on them (loss ln k
// when the label is one of them, else +inf); a row of only -inf logits has loss +inf and no gradient;
// NaN stays NaN.
//
// Check by hand: nvcc -ptx -arch=compute_80 -std=c++17 -Icuda cuda/cross_entropy.cu -o /tmp/ce.ptx
#include "common.cuh"

using namespace askgui;

namespace {

template <typename T>
__device__ void ce_fwd(const T* __restrict__ logits, const unsigned int* __restrict__ labels,
                       const T* __restrict__ mask, float* __restrict__ loss, float* __restrict__ lse, int v) {
  __shared__ float scratch[32];
  const int r = blockIdx.x;
  if (to_f32(mask[r]) == 0.f) {
    if (threadIdx.x == 0) {
      loss[r] = 0.f;
      lse[r] = 0.f;
    }
    return;
  }
  const T* row = logits + (size_t)r * v;
  // Online (m, s): s sums exp(x - m); once m is +inf, s counts the +inf logits instead.
  float m = -INFINITY, s = 0.f;
  for (int i = threadIdx.x; i < v; i += blockDim.x) {
    const float x = to_f32(row[i]);
    if (x > m) {
      s = s * expf(m - x) + 1.f;  // m == -inf or x == +inf: expf(-inf) = 0, the sum restarts at 1
      m = x;
    } else if (x == INFINITY) {
      s += 1.f;  // another +inf logit
    } else if (x != -INFINITY) {
      s += expf(x - m);  // NaN logits propagate through here
    }
  }
  const float mx = block_max(m, scratch);
  float part = m == -INFINITY ? 0.f : (mx == INFINITY ? (m == INFINITY ? s : 0.f) : s * expf(m - mx));
  if (s != s) part = s;  // a NaN seen by any thread reaches the total (fmaxf above drops NaN)
  const float total = block_sum(part, scratch);
  if (threadIdx.x == 0) {
    const float xl = to_f32(row[labels[r]]);
    float l, nll;
    if (total != total) {
      l = nll = total;
    } else if (mx == INFINITY) {  // softmax uniform over the `total` +inf logits
      l = INFINITY;
      nll = xl == INFINITY ? logf(total) : INFINITY;
    } else if (mx == -INFINITY) {  // every logit -inf: no probability anywhere
      l = -INFINITY;
      nll = INFINITY;
    } else {
      l = mx + logf(total);
      nll = l - xl;
    }
    lse[r] = l;
    loss[r] = nll;
  }
}

// out[0] = sum(loss) / count (0 when count == 0). One block.
template <typename T>
__device__ void ce_mean(const float* __restrict__ loss, int n, int count, T* __restrict__ out) {
  __shared__ float scratch[32];
  float s = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += loss[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) out[0] = from_f32<T>(count > 0 ? s / (float)count : 0.f);
}

template <typename T>
__device__ void ce_bwd(const T* __restrict__ logits, const unsigned int* __restrict__ labels,
                       const T* __restrict__ mask, const float* __restrict__ lse, float scale, T* __restrict__ out,
                       int v) {
  const int r = blockIdx.x;
  T* o = out + (size_t)r * v;
  if (to_f32(mask[r]) == 0.f) {
    for (int i = threadIdx.x; i < v; i += blockDim.x) o[i] = from_f32<T>(0.f);
    return;
  }
  const T* row = logits + (size_t)r * v;
  const float l = lse[r];
  const int label = (int)labels[r];
  if (l == -INFINITY) {  // every logit -inf: the forward's loss is +inf and nothing has a gradient
    for (int i = threadIdx.x; i < v; i += blockDim.x) o[i] = from_f32<T>(0.f);
    return;
  }
  // lse = +inf: the softmax is 1/k on the k +inf logits (uniform per row, so the barrier is uniform).
  float inv_k = 0.f;
  if (l == INFINITY) {
    __shared__ float scratch[32];
    float k = 0.f;
    for (int i = threadIdx.x; i < v; i += blockDim.x) k += to_f32(row[i]) == INFINITY ? 1.f : 0.f;
    inv_k = 1.f / block_sum(k, scratch);
  }
  for (int i = threadIdx.x; i < v; i += blockDim.x) {
    const float x = to_f32(row[i]);
    const float p = l == INFINITY ? (x == INFINITY ? inv_k : 0.f) : expf(x - l);
    o[i] = from_f32<T>(scale * (i == label ? p - 1.f : p));
  }
}

}  // namespace

#define CE_KERNELS(T, S)                                                                                  \
  extern "C" __global__ void ce_fwd_##S(const T* logits, const unsigned int* labels, const T* mask,       \
                                        float* loss, float* lse, int v) {                                 \
    ce_fwd<T>(logits, labels, mask, loss, lse, v);                                                        \
  }                                                                                                       \
  extern "C" __global__ void ce_mean_##S(const float* loss, int n, int count, T* out) {                   \
    ce_mean<T>(loss, n, count, out);                                                                      \
  }                                                                                                       \
  extern "C" __global__ void ce_bwd_##S(const T* logits, const unsigned int* labels, const T* mask,       \
                                        const float* lse, float scale, T* out, int v) {                   \
    ce_bwd<T>(logits, labels, mask, lse, scale, out, v);                                                  \
  }

CE_KERNELS(float, f32)
CE_KERNELS(__nv_bfloat16, bf16)
