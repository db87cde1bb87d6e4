// Branch-free float exp (Cephes expf polynomial; std::exp calls libm per element, which
// dominated the CPU kernels). ~2 ulp on [-87, 88]; exp(-inf) = 0, NaN propagates, large
// arguments saturate at exp(88.38) < FLT_MAX instead of inf. double keeps std::exp: it is the gradcheck path.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tk {

// exp(xc) / 2^n for n = round(xc / ln2): Cody-Waite reduction r = xc - n ln2, then the Cephes
// expf minimax polynomial on [-ln2/2, ln2/2]. Shared by the scalar and vector fast_exp.
template <typename V>
inline V exp_core(V xc, V n) {
  V r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V p = r * 0.0f + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

inline float fast_exp(float x) {
  const float lo = -87.33654f, hi = 88.3762626647949f;
  // Written as selects and arithmetic only, so the vectoriser if-converts it.
  const float keep = x >= lo ? 1.0f : 0.0f;  // 0 for x < lo and -inf; NaN * 0 stays NaN
  float xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  // exp(x) = 2^n * exp_core, n = round(x / ln2) by the 1.5*2^23 trick
  const float shift = 12582912.0f;
  const float n = (xc * 1.44269504088896341f + shift) - shift;
  const float p = exp_core(xc, n);
  // 2^n via the exponent bits; n in [-126, 128] after the clamp, so the scale is split in two.
  const int32_t ni = (int32_t)n;
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  const int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  return p * s1 * s2 * keep;
}

inline double fast_exp(double x) { return std::exp(x); }

// The same exp on a GCC/Clang vector of 8 floats (one AVX2 register; selects on wider
// vectors than the target has were lowered element by element). Explicit vector code,
// because the auto-vectoriser kept the scalar version scalar inside the row-block loops.
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

inline vf8 fast_exp(vf8 x) {
  const vf8 lo = vf8{} + -87.33654f, hi = vf8{} + 88.3762626647949f;
  const vf8 keep = (vf8)((x >= lo) & (vi8{} + 0x3f800000));  // 1.0f where x >= lo, else 0
  vf8 xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vf8 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vf8 p = exp_core(xc, n);
  const vi8 ni = __builtin_convertvector(n, vi8);
  const vi8 n1 = ni >> 1, n2 = ni - n1;
  const vf8 s1 = (vf8)((n1 + 127) << 23), s2 = (vf8)((n2 + 127) << 23);
  return p * s1 * s2 * keep;
}

#if defined(__AVX512F__)
// The same exp on 16 floats (one zmm register), for the batched exps of the fused losses on AVX-512.
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

inline vf16 fast_exp(vf16 x) {
  const vf16 lo = vf16{} + -87.33654f, hi = vf16{} + 88.3762626647949f;
  const vf16 keep = (vf16)((x >= lo) & (vi16{} + 0x3f800000));
  vf16 xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vf16 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vf16 p = exp_core(xc, n);
  const vi16 ni = __builtin_convertvector(n, vi16);
  const vi16 n1 = ni >> 1, n2 = ni - n1;
  const vf16 s1 = (vf16)((n1 + 127) << 23), s2 = (vf16)((n2 + 127) << 23);
  return p * s1 * s2 * keep;
}
#endif

// C[r, j] = sum_k A(r, k) * Bm[k, j] for r < 16, j < W, with A(r, k) = A[r*a_rs + k*a_ks].
// W must be a multiple of 16 and Bm/C rows W-wide (callers pad with zeros): 4 rows x 16
// columns of accumulators stay in registers, so each loaded B vector feeds 4 FMAs.
inline void gemm16(int64_t K, int64_t W, const float* A, int64_t a_rs, int64_t a_ks, const float* Bm, int64_t ldb,
                   float* C, int64_t ldc) {
  for (int r0 = 0; r0 < 16; r0 += 4)
    for (int64_t j0 = 0; j0 < W; j0 += 16) {
      vf8 acc[4][2] = {};
      for (int64_t k = 0; k < K; ++k) {
        vf8 b0, b1;
        std::memcpy(&b0, Bm + k * ldb + j0, sizeof b0);
        std::memcpy(&b1, Bm + k * ldb + j0 + 8, sizeof b1);
        for (int i = 0; i < 4; ++i) {
          const float a = A[(r0 + i) * a_rs + k * a_ks];
          acc[i][0] += a * b0;
          acc[i][1] += a * b1;
        }
      }
      for (int i = 0; i < 4; ++i) {
        std::memcpy(C + (r0 + i) * ldc + j0, &acc[i][0], sizeof(vf8));
        std::memcpy(C + (r0 + i) * ldc + j0 + 8, &acc[i][1], sizeof(vf8));
      }
    }
}
inline void gemm16(int64_t K, int64_t W, const double* A, int64_t a_rs, int64_t a_ks, const double* Bm, int64_t ldb,
                   double* C, int64_t ldc) {
  for (int r = 0; r < 16; ++r)
    for (int64_t j = 0; j < W; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += A[r * a_rs + k * a_ks] * Bm[k * ldb + j];
      C[r * ldc + j] = acc;
    }
}

}  // namespace tk
