// nvcuda::wmma for the CPU executor (included by cuda_emu.h): 16x16x16 tiles with bf16 (or f32) operands
// and f32 accumulation, with the rules of the CUDA programming guide checked at every call.
//
// Each lane holds a whole 16x16 tile as its fragment (row-major, whatever the fragment's layout tag), so
// loads need no exchange. mma_sync is a warp collective: it is computed once per warp, after checking that
// every lane brought bitwise identical operands; a kernel that relies on the hardware's fragment layout
// (per-lane edits of `x[]`) fails that check. store_matrix_sync first fills the destination tile with NaN,
// then each lane writes only its own 8 elements when it resumes: a reader that skips the __syncwarp a GPU
// needs after a store reads NaN.
#pragma once

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the CPU executor emulates 16x16x16 wmma tiles only");
  static constexpr int num_elements = 256;
  T x[256];
};

namespace detail {

inline float as_float(float v) { return v; }
inline float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T> T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// The guide's rules for a wmma memory operand: a 256-bit aligned pointer, and a leading dimension that is
// a multiple of 16 bytes (8 elements of 16 bits, 4 of 32 bits).
template <class T>
inline void check_operand(const char* what, const T* p, unsigned ldm) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
    cuda_emu::fail("%s: pointer %p is not 256-bit (32-byte) aligned (offset %u bytes past a 32-byte boundary)", what,
                   static_cast<const void*>(p), unsigned(reinterpret_cast<uintptr_t>(p) % 32));
  if ((ldm * sizeof(T)) % 16 != 0)
    cuda_emu::fail("%s: leading dimension %u elements of %zu bytes is not a multiple of 16 bytes", what, ldm, sizeof(T));
}

// Element (r, c) of a 16x16 tile stored at p with leading dimension ldm.
template <class T>
inline T& at(T* p, unsigned ldm, int r, int c, bool col) {
  return col ? p[c * ldm + r] : p[r * ldm + c];
}

template <class Layout> constexpr bool is_col() { return std::is_same_v<Layout, col_major>; }

}  // namespace detail

template <class Use, class T, class Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, float v) {
  const T t = detail::from_float<T>(v);
  for (int i = 0; i < 256; ++i) f.x[i] = t;
}

// matrix_a / matrix_b: the layout is the fragment's type.
template <class Use, class T, class Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load takes a layout_t");
  detail::check_operand("wmma::load_matrix_sync", p, ldm);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = detail::at(p, ldm, r, c, detail::is_col<Layout>());
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
  detail::check_operand("wmma::load_matrix_sync", p, ldm);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = detail::at(p, ldm, r, c, l == mem_col_major);
}

namespace detail {

template <class TA, class LA, class TB, class LB>
struct MmaOp : cuda_emu::WarpOp {
  fragment<accumulator, 16, 16, 16, float>* d;
  const fragment<matrix_a, 16, 16, 16, TA, LA>* a;
  const fragment<matrix_b, 16, 16, 16, TB, LB>* b;
  const fragment<accumulator, 16, 16, 16, float>* c;
};

template <class Op>
inline const Op* first_lane(cuda_emu::WarpOp* const* lanes) {
  for (int l = 0; l < 32; ++l)
    if (lanes[l]) return static_cast<const Op*>(lanes[l]);
  return nullptr;
}

// d = a b + c once per warp, after checking that every lane brought the same operands.
template <class TA, class LA, class TB, class LB>
const char* resolve_mma(cuda_emu::WarpOp* const* lanes) {
  using Op = MmaOp<TA, LA, TB, LB>;
  if (lanes[0] == nullptr || lanes[0]->mask != 0xffffffffu) return "wmma::mma_sync needs all 32 lanes of the warp";
  const Op* o = first_lane<Op>(lanes);
  for (int l = 1; l < 32; ++l) {
    const Op* p = static_cast<const Op*>(lanes[l]);
    if (memcmp(p->a, o->a, sizeof(*o->a)) || memcmp(p->b, o->b, sizeof(*o->b)) || memcmp(p->c, o->c, sizeof(*o->c)))
      return "wmma::mma_sync: lanes hold different operand fragments (a kernel that edits fragment elements per "
             "lane relies on the hardware's fragment layout)";
  }
  float out[256];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float acc = o->c->x[i * 16 + j];
      for (int k = 0; k < 16; ++k) acc = fmaf(as_float(o->a->x[i * 16 + k]), as_float(o->b->x[k * 16 + j]), acc);
      out[i * 16 + j] = acc;
    }
  for (int l = 0; l < 32; ++l) memcpy(static_cast<const Op*>(lanes[l])->d->x, out, sizeof(out));
  return nullptr;
}

struct StoreOp : cuda_emu::WarpOp {
  float* p;
  unsigned ldm;
  bool col;
  const fragment<accumulator, 16, 16, 16, float>* f;
};

const char* resolve_store(cuda_emu::WarpOp* const* lanes);

}  // namespace detail

template <class TA, class LA, class TB, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, TA, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, TB, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
  detail::MmaOp<TA, LA, TB, LB> op;
  op.name = "wmma::mma_sync";
  op.file = "wmma";
  op.line = 0;
  op.mask = 0xffffffffu;
  op.resolve = detail::resolve_mma<TA, LA, TB, LB>;
  op.d = &d;
  op.a = &a;
  op.b = &b;
  op.c = &c;
  cuda_emu::warp_op(&op);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  detail::check_operand("wmma::store_matrix_sync", p, ldm);
  detail::StoreOp op;
  op.name = "wmma::store_matrix_sync";
  op.file = "wmma";
  op.line = 0;
  op.mask = 0xffffffffu;
  op.resolve = detail::resolve_store;
  op.p = p;
  op.ldm = ldm;
  op.col = l == mem_col_major;
  op.f = &f;
  cuda_emu::warp_op(&op);
  // This lane's share of the tile: elements 8 * lane .. 8 * lane + 7 in row-major order.
  const int lane = cuda_emu::lane_id();
  for (int e = 8 * lane; e < 8 * lane + 8; ++e) detail::at(p, ldm, e / 16, e % 16, op.col) = f.x[e];
}

}  // namespace wmma
}  // namespace nvcuda
