// Qwen2-VL image tiling on the GPU, for a whole batch of RGB8 images in two launches:
//   tiling_hpass                 horizontal antialiased bicubic pass, u8 (h, w, 3) -> u8 (h, nw, 3)
//   tiling_vpass_patchify_<T>    vertical pass fused with rescale + normalise + patchify into pixel_values
// The CPU reference is kernels/src/tiling/mod.rs; the tap tables and descriptors come from
// kernels/src/tiling/plan.rs (BatchPlan), whose tests replay these two kernels on the CPU line by line.
//
// Exactness: the filter taps are the reference's int16 fixed-point weights, accumulated in int32 with the
// same rounding constant, arithmetic shift and clamp to [0, 255] after each pass, so the resized pixels are
// bit-identical to the CPU's; normalisation is (float(v) - mean*255) / (std*255) with IEEE division (no
// fast-math), also bit-identical in f32. bf16 output rounds that f32 to nearest even.
//
// Launch: grid (X, n_images), 1-D blocks; blockIdx.y picks the image's descriptor row, and the blocks of
// x stride over that image's work, so images of different sizes share one launch.
#include "common.cuh"

// Descriptor fields, FIELDS int64 per image: must match `desc` in kernels/src/tiling/plan.rs.
#define D_SRC 0
#define D_W 1
#define D_H 2
#define D_NW 3
#define D_NH 4
#define D_INTER 5
#define D_HTAPS 6
#define D_VTAPS 7
#define D_HPREC 8
#define D_HROUND 9
#define D_VPREC 10
#define D_VROUND 11
#define D_ROW 12
#define D_GH 13
#define D_GW 14
#define D_FIELDS 15

namespace {

__device__ __forceinline__ int clamp8(int a) { return a < 0 ? 0 : (a > 255 ? 255 : a); }

}  // namespace

// src: concatenated input images; inter: concatenated (h, nw, 3) intermediates.
// taps: (start, count, weight offset) triples; weights: int16 fixed point stored as int32.
extern "C" __global__ void tiling_hpass(const uint8_t* __restrict__ src, uint8_t* __restrict__ inter,
                                        const long long* __restrict__ desc, const int* __restrict__ taps,
                                        const int* __restrict__ weights) {
  const long long* d = desc + (long long)blockIdx.y * D_FIELDS;
  const int w = (int)d[D_W], h = (int)d[D_H], nw = (int)d[D_NW];
  const uint8_t* s = src + d[D_SRC];
  uint8_t* o = inter + d[D_INTER];
  const int* t = taps + 3 * d[D_HTAPS];
  const int prec = (int)d[D_HPREC], round = (int)d[D_HROUND];
  // The host checks h * nw < 2^31.
  const int n = h * nw;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int y = i / nw, x = i - y * nw;
    const int start = t[3 * x], count = t[3 * x + 1];
    const int* wt = weights + t[3 * x + 2];
    const uint8_t* row = s + ((long long)y * w + start) * 3;
    int a0 = round, a1 = round, a2 = round;
    for (int j = 0; j < count; ++j) {
      const int k = wt[j];
      a0 += k * (int)row[3 * j];
      a1 += k * (int)row[3 * j + 1];
      a2 += k * (int)row[3 * j + 2];
    }
    uint8_t* q = o + (long long)i * 3;
    q[0] = (uint8_t)clamp8(a0 >> prec);
    q[1] = (uint8_t)clamp8(a1 >> prec);
    q[2] = (uint8_t)clamp8(a2 >> prec);
  }
}

// out: pixel_values (rows, 3 * tp * p * p). One thread per (patch row r, channel, py, px) of an image,
// px fastest so that stores are coalesced; it computes the vertically filtered pixel once and writes all
// tp temporal copies. Rows run over (block row, block column, row in block, column in block).
template <typename T>
__device__ __forceinline__ void vpass_patchify(const uint8_t* __restrict__ inter, T* __restrict__ out,
                                               const long long* __restrict__ desc, const int* __restrict__ taps,
                                               const int* __restrict__ weights, float m0, float m1, float m2,
                                               float s0, float s1, float s2, int p, int merge, int tp) {
  const long long* d = desc + (long long)blockIdx.y * D_FIELDS;
  const int nw = (int)d[D_NW], gh = (int)d[D_GH], gw = (int)d[D_GW];
  const uint8_t* src = inter + d[D_INTER];
  const int* t = taps + 3 * d[D_VTAPS];
  const int prec = (int)d[D_VPREC], round = (int)d[D_VROUND];
  const long long row0 = d[D_ROW];
  const int pp = p * p, dim = 3 * tp * pp, bws = gw / merge;
  const long long stride = (long long)nw * 3;
  // The host checks gh * gw * 3 * p * p * tp < 2^31.
  const int n = gh * gw * 3 * pp;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int px = i % p;
    int e = i / p;
    const int py = e % p;
    e /= p;
    const int c = e % 3;
    const int r = e / 3;
    const int mw = r % merge;
    e = r / merge;
    const int mh = e % merge;
    e /= merge;
    const int bw = e % bws, bh = e / bws;
    const int y = (bh * merge + mh) * p + py, x = (bw * merge + mw) * p + px;
    const int start = t[3 * y], count = t[3 * y + 1];
    const int* wt = weights + t[3 * y + 2];
    const uint8_t* col = src + (long long)start * stride + x * 3 + c;
    int a = round;
    for (int j = 0; j < count; ++j) a += wt[j] * (int)col[j * stride];
    const float mean = c == 0 ? m0 : (c == 1 ? m1 : m2);
    const float sd = c == 0 ? s0 : (c == 1 ? s1 : s2);
    const T v = askgui::from_f32<T>(((float)clamp8(a >> prec) - mean) / sd);
    T* q = out + (row0 + r) * dim + c * tp * pp + py * p + px;
    for (int k = 0; k < tp; ++k) q[k * pp] = v;
  }
}

#define VPASS(NAME, T)                                                                                       \
  extern "C" __global__ void NAME(const uint8_t* __restrict__ inter, T* __restrict__ out,                    \
                                  const long long* __restrict__ desc, const int* __restrict__ taps,          \
                                  const int* __restrict__ weights, float m0, float m1, float m2, float s0,   \
                                  float s1, float s2, int p, int merge, int tp) {                            \
    vpass_patchify<T>(inter, out, desc, taps, weights, m0, m1, m2, s0, s1, s2, p, merge, tp);                \
  }

VPASS(tiling_vpass_patchify_f32, float)
VPASS(tiling_vpass_patchify_bf16, __nv_bfloat16)
