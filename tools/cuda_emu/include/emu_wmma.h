// nvcuda::wmma for the CUDA emulator. The fragment-to-lane layout is unspecified in CUDA, so here every
// lane's fragment is the whole tile: loads fill it all, element-wise loops over x[0..num_elements) mean
// the same thing, and lane l owns accumulator elements e with e % 32 == l: mma_sync computes and
// store_matrix_sync writes only those (so code that read another lane's accumulator values would fail).
// Each operation is a warp collective (all 32 lanes must arrive), and the alignment rules that real
// hardware enforces (256-bit aligned pointer, ldm a multiple of 16 bytes) are checked.
#pragma once
#include "emu_core.h"

namespace nvcuda {
namespace wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
namespace precision {
struct tf32 {};
}
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K> struct Shape;
template <int M, int N, int K> struct Shape<matrix_a, M, N, K> { static constexpr int R = M, C = K; };
template <int M, int N, int K> struct Shape<matrix_b, M, N, K> { static constexpr int R = K, C = N; };
template <int M, int N, int K> struct Shape<accumulator, M, N, K> { static constexpr int R = M, C = N; };

template <typename T> struct Storage { using type = T; };
template <> struct Storage<precision::tf32> { using type = float; };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  using element_type = typename Storage<T>::type;
  static constexpr int R = Shape<Use, M, N, K>::R, C = Shape<Use, M, N, K>::C;
  static constexpr int num_elements = R * C;
  element_type x[R * C];  // logical row-major (r, c) -> x[r * C + c]
};

inline float __float_to_tf32(float f) {  // cvt.rna.tf32.f32: round to nearest, ties away from zero
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&f, &u, 4);
  return f;
}

namespace detail {
template <typename P>
inline void check(const P* p, unsigned ldm, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
    emu::device_error(std::string(what) + ": pointer not 256-bit aligned");
  if ((ldm * sizeof(P)) % 16 != 0) emu::device_error(std::string(what) + ": ldm not a multiple of 16 bytes");
}
inline void collective() { emu::warp_op(emu::OP_WMMA, 0xffffffffu, 0, 0, 32); }
template <typename T> inline float as_mma_input(T v) { return (float)v; }
inline float tf32_bits(float f) {  // the tensor core reads only the tf32 bits of a float operand
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u &= 0xffffe000u;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename L, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, const V& v) {
  for (int e = 0; e < f.num_elements; ++e) f.x[e] = typename fragment<Use, M, N, K, T, L>::element_type(v);
}

template <typename Use, int M, int N, int K, typename T, typename L, typename P>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const P* p, unsigned ldm) {
  static_assert(!std::is_same<Use, accumulator>::value, "accumulator loads take a layout");
  detail::check(p, ldm, "wmma::load_matrix_sync");
  detail::collective();
  constexpr bool rm = std::is_same<L, row_major>::value;
  for (int r = 0; r < f.R; ++r)
    for (int c = 0; c < f.C; ++c) f.x[r * f.C + c] = rm ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}

template <int M, int N, int K, typename T, typename P>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const P* p, unsigned ldm, layout_t l) {
  detail::check(p, ldm, "wmma::load_matrix_sync");
  detail::collective();
  for (int r = 0; r < f.R; ++r)
    for (int c = 0; c < f.C; ++c)
      f.x[r * f.C + c] = l == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}

template <int M, int N, int K, typename T, typename P>
inline void store_matrix_sync(P* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t l) {
  detail::check(p, ldm, "wmma::store_matrix_sync");
  detail::collective();
  const int lane = emu::t_cur->lane;
  for (int e = lane; e < f.num_elements; e += 32) {
    const int r = e / f.C, c = e % f.C;
    p[l == mem_row_major ? (size_t)r * ldm + c : (size_t)c * ldm + r] = f.x[e];
  }
}

template <int M, int N, int K, typename TA, typename LA, typename TB, typename LB, typename TC>
inline void mma_sync(fragment<accumulator, M, N, K, TC>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, TC>& c) {
  detail::collective();
  // Each lane computes the accumulator elements it owns (e % 32 == lane; the ones it stores), so the
  // emulation does the work once per warp; element-wise code on x[] is correct on owned elements.
  constexpr bool tf32 = std::is_same<TA, precision::tf32>::value;
  for (int e = emu::t_cur->lane; e < M * N; e += 32) {
    const int i = e / N, j = e % N;
    float s = (float)c.x[e];
    for (int k = 0; k < K; ++k) {
      float x = (float)a.x[i * K + k], y = (float)b.x[k * N + j];
      if (tf32) { x = detail::tf32_bits(x); y = detail::tf32_bits(y); }
      s += x * y;
    }
    d.x[e] = s;
  }
}

}  // namespace wmma
}  // namespace nvcuda
