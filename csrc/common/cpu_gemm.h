// Register-blocked CPU micro-kernels for small dense products inside fused ops.
// Header-only and torch-free. Two shapes cover what tiled losses/scorers need:
//
//   dot_nt : C[i][j] = alpha * sum_k A[i][k] * B[j][k]  (+ beta * C[i][j])
//            both operands K-contiguous (query x document dot tiles, H innermost)
//   acc_nn : C[i][j] += alpha * sum_k A(i,k) * B[k][j]
//            B and C N-contiguous; A read through (row, col) strides so the same
//            kernel serves G @ D and G^T @ Q without transposing G.
//   transpose_pack : K-contiguous rows -> N-contiguous panel, so a dot tile reused by
//            many rows can run as acc_nn (the fastest shape here: ~75 GFLOP/s/core on
//            AVX2 vs ~27 for dot_nt's along-K vectors).
//
// float uses AVX-512 (16 lanes) when __AVX512F__ is defined, else AVX2+FMA (8 lanes),
// else a portable scalar path; double always uses the portable path (it exists for
// float64 parity tests, not speed). Interface is stable: other ops copy this file.
#pragma once
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace tk {
namespace gemm {

// ---- SIMD abstraction (float only) ------------------------------------------------
#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vf = __m512;
inline vf v_load(const float* p) { return _mm512_loadu_ps(p); }
inline void v_store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf v_set1(float x) { return _mm512_set1_ps(x); }
inline vf v_zero() { return _mm512_setzero_ps(); }
inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float v_hsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using vf = __m256;
inline vf v_load(const float* p) { return _mm256_loadu_ps(p); }
inline void v_store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf v_set1(float x) { return _mm256_set1_ps(x); }
inline vf v_zero() { return _mm256_setzero_ps(); }
inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float v_hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int kLanes = 1;
using vf = float;
inline vf v_load(const float* p) { return *p; }
inline void v_store(float* p, vf v) { *p = v; }
inline vf v_set1(float x) { return x; }
inline vf v_zero() { return 0.f; }
inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
inline float v_hsum(vf v) { return v; }
#endif

inline const char* simd_name() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

namespace detail {

// MR x NR block of dot products; vectors run along K.
template <int MR, int NR>
inline void dot_nt_block(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                         float* C, int64_t ldc, float alpha, float beta) {
  vf acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = v_zero();
  const int64_t Kv = K - K % kLanes;
  for (int64_t k = 0; k < Kv; k += kLanes) {
    vf b[NR];
    for (int c = 0; c < NR; ++c) b[c] = v_load(B + c * ldb + k);
    for (int r = 0; r < MR; ++r) {
      const vf a = v_load(A + r * lda + k);
      for (int c = 0; c < NR; ++c) acc[r][c] = v_fma(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) {
      float s = v_hsum(acc[r][c]);
      for (int64_t k = Kv; k < K; ++k) s += A[r * lda + k] * B[c * ldb + k];
      float* o = C + r * ldc + c;
      *o = beta == 0.f ? alpha * s : alpha * s + beta * *o;
    }
}

constexpr int kNtMR = 4, kNtNR = 3;  // 12 accumulators + 3 B vectors + 1 A vector = 16 ymm

template <int MR>
inline void dot_nt_row(int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                       float* C, int64_t ldc, float alpha, float beta) {
  int64_t j = 0;
  for (; j + kNtNR <= N; j += kNtNR) dot_nt_block<MR, kNtNR>(K, A, lda, B + j * ldb, ldb, C + j, ldc, alpha, beta);
  switch (N - j) {
    case 2: dot_nt_block<MR, 2>(K, A, lda, B + j * ldb, ldb, C + j, ldc, alpha, beta); break;
    case 1: dot_nt_block<MR, 1>(K, A, lda, B + j * ldb, ldb, C + j, ldc, alpha, beta); break;
    default: break;
  }
}

// MR rows x (NV vectors) columns of C += alpha * A * B; vectors run along N.
template <int MR, int NV>
inline void acc_nn_block(int64_t K, const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb,
                         float* C, int64_t ldc, float alpha) {
  vf acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = v_zero();
  for (int64_t k = 0; k < K; ++k) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = v_load(B + k * ldb + v * kLanes);
    for (int r = 0; r < MR; ++r) {
      const vf a = v_set1(A[r * sam + k * sak]);
      for (int v = 0; v < NV; ++v) acc[r][v] = v_fma(a, b[v], acc[r][v]);
    }
  }
  const vf al = v_set1(alpha);
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      float* o = C + r * ldc + v * kLanes;
      v_store(o, v_fma(al, acc[r][v], v_load(o)));
    }
}

template <int MR>
inline void acc_nn_scalar_cols(int64_t j0, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
                               const float* B, int64_t ldb, float* C, int64_t ldc, float alpha) {
  for (int r = 0; r < MR; ++r)
    for (int64_t j = j0; j < N; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += A[r * sam + k * sak] * B[k * ldb + j];
      C[r * ldc + j] += alpha * s;
    }
}

constexpr int kNnMR = 6, kNnNV = 2;  // 12 accumulators + 2 B vectors + 1 broadcast = 15 ymm

template <int MR>
inline void acc_nn_rows(int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak, const float* B,
                        int64_t ldb, float* C, int64_t ldc, float alpha) {
  int64_t j = 0;
  for (; j + kNnNV * kLanes <= N; j += kNnNV * kLanes)
    acc_nn_block<MR, kNnNV>(K, A, sam, sak, B + j, ldb, C + j, ldc, alpha);
  for (; j + kLanes <= N; j += kLanes) acc_nn_block<MR, 1>(K, A, sam, sak, B + j, ldb, C + j, ldc, alpha);
  if (j < N) acc_nn_scalar_cols<MR>(j, N, K, A, sam, sak, B, ldb, C, ldc, alpha);
}


#if defined(__AVX512F__)
// AVX-512 path of acc_nn (float): BLIS-style register blocks of MR rows x NV zmm columns
// (MR x NV = 24 accumulators: 6 x 4 for 64-column strips, 8 x 3 for 48, 12 x 2 for 32), the A
// operand broadcast straight from memory into the FMA ({1to16}), the last vector of a strip
// masked so any N runs in the same kernel. Loop order: K blocks of kKc (a 64-column strip of B
// is then kKc x 256 B = 32 KiB and stays in L1 while every MR-row block of A streams past it),
// column strips, MR-row blocks. Measured single-core (Xeon, AVX-512, thread CPU time) on
// the fused-loss tile shapes: 155-170 GFLOP/s vs 110-135 for the 6 x 2 kernel below.
constexpr int64_t kKc = 128;

template <int MR, int NV>
__attribute__((always_inline)) inline void acc512_micro(int64_t K, const float* A, int64_t sam, int64_t sak,
                                                        const float* B, int64_t ldb, float* C, int64_t ldc,
                                                        float alpha, __mmask16 tail) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) b[v] = _mm512_loadu_ps(B + v * 16);
    b[NV - 1] = _mm512_maskz_loadu_ps(tail, B + (NV - 1) * 16);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * sam]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
    }
    A += sak;
    B += ldb;
  }
  const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) {
      float* o = C + r * ldc + v * 16;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(al, acc[r][v], _mm512_loadu_ps(o)));
    }
    float* o = C + r * ldc + (NV - 1) * 16;
    _mm512_mask_storeu_ps(o, tail, _mm512_fmadd_ps(al, acc[r][NV - 1], _mm512_maskz_loadu_ps(tail, o)));
  }
}

// All M rows of one strip: MR-row blocks, then one block of the remaining M % MR rows.
template <int MR, int NV>
inline void acc512_rows(int64_t M, int64_t K, const float* A, int64_t sam, int64_t sak, const float* B,
                        int64_t ldb, float* C, int64_t ldc, float alpha, __mmask16 tail) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR) acc512_micro<MR, NV>(K, A + i * sam, sam, sak, B, ldb, C + i * ldc, ldc, alpha, tail);
  A += i * sam;
  C += i * ldc;
  switch (M - i) {
#define TK_ACC512_CASE(x) \
  case x:                 \
    if constexpr (x < MR) acc512_micro<x, NV>(K, A, sam, sak, B, ldb, C, ldc, alpha, tail); \
    break;
    TK_ACC512_CASE(1) TK_ACC512_CASE(2) TK_ACC512_CASE(3) TK_ACC512_CASE(4) TK_ACC512_CASE(5)
    TK_ACC512_CASE(6) TK_ACC512_CASE(7) TK_ACC512_CASE(8) TK_ACC512_CASE(9) TK_ACC512_CASE(10)
    TK_ACC512_CASE(11)
#undef TK_ACC512_CASE
    default: break;
  }
}

// One kc x (16 * NV) strip of B for all M rows. When more than one MR-row block will read it and B's rows
// are not already packed (ldb != strip width), the strip is first copied to a contiguous buffer: a B row
// stride that is a multiple of 1-4 KiB (H = 384, 768) maps a strip's rows onto a few L1 sets, and the
// strip would be re-read from L2 by every row block (measured: 50% of the Matryoshka kernel's time).
template <int MR, int NV>
inline void acc512_strip(int64_t M, int64_t kc, const float* A, int64_t sam, int64_t sak, const float* B,
                         int64_t ldb, float* C, int64_t ldc, float alpha, __mmask16 tail, float* buf) {
  constexpr int64_t W = 16 * NV;
  if (M > MR && ldb != W) {
    for (int64_t k = 0; k < kc; ++k) {
#pragma GCC unroll 4
      for (int v = 0; v < NV - 1; ++v) _mm512_store_ps(buf + k * W + v * 16, _mm512_loadu_ps(B + k * ldb + v * 16));
      _mm512_store_ps(buf + k * W + (NV - 1) * 16, _mm512_maskz_loadu_ps(tail, B + k * ldb + (NV - 1) * 16));
    }
    acc512_rows<MR, NV>(M, kc, A, sam, sak, buf, W, C, ldc, alpha, tail);
  } else {
    acc512_rows<MR, NV>(M, kc, A, sam, sak, B, ldb, C, ldc, alpha, tail);
  }
}

inline void acc_nn_512(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak, const float* B,
                       int64_t ldb, float* C, int64_t ldc, float alpha) {
  if (M <= 0 || N <= 0) return;
  alignas(64) float buf[kKc * 64];
  // strip widths: 48 (8 x 3 blocks) when N splits into those and not into 64s, else 64 (6 x 4) as far as
  // they go, then 32 (12 x 2) and one masked tail. Measured (thread CPU time, one core): the 6 x 4 block
  // runs the Matryoshka dq / dd products (N = 64 ... 256, ldb = 768) at 143-152 GFLOP/s vs 118-125 for 12 x 2.
  const bool w48 = N % 48 == 0 && N % 64 != 0;
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t kc = K - k0 < kKc ? K - k0 : kKc;
    const float* Ak = A + k0 * sak;
    const float* Bk = B + k0 * ldb;
    int64_t j = 0;
    if (w48)
      for (; j + 48 <= N; j += 48) acc512_strip<8, 3>(M, kc, Ak, sam, sak, Bk + j, ldb, C + j, ldc, alpha, 0xFFFF, buf);
    else
      for (; j + 64 <= N; j += 64) acc512_strip<6, 4>(M, kc, Ak, sam, sak, Bk + j, ldb, C + j, ldc, alpha, 0xFFFF, buf);
    for (; j + 32 <= N; j += 32) acc512_strip<12, 2>(M, kc, Ak, sam, sak, Bk + j, ldb, C + j, ldc, alpha, 0xFFFF, buf);
    const int64_t w = N - j;  // 0..31 columns left
    if (w > 16)
      acc512_strip<12, 2>(M, kc, Ak, sam, sak, Bk + j, ldb, C + j, ldc, alpha, (__mmask16)((1u << (w - 16)) - 1), buf);
    else if (w > 0)
      acc512_strip<12, 1>(M, kc, Ak, sam, sak, Bk + j, ldb, C + j, ldc, alpha,
                          (__mmask16)(w == 16 ? 0xFFFFu : (1u << w) - 1), buf);
  }
}
#endif

}  // namespace detail

// C[i*ldc + j] = alpha * sum_k A[i*lda + k] * B[j*ldb + k] + beta * C[i*ldc + j]
// (beta == 0 never reads C).
inline void dot_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                   float* C, int64_t ldc, float alpha, float beta = 0.f) {
  using namespace detail;
  int64_t i = 0;
  for (; i + kNtMR <= M; i += kNtMR) dot_nt_row<kNtMR>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha, beta);
  switch (M - i) {
    case 3: dot_nt_row<3>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha, beta); break;
    case 2: dot_nt_row<2>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha, beta); break;
    case 1: dot_nt_row<1>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, alpha, beta); break;
    default: break;
  }
}

// C[i*ldc + j] += alpha * sum_k A[i*sam + k*sak] * B[k*ldb + j]
inline void acc_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak, const float* B,
                   int64_t ldb, float* C, int64_t ldc, float alpha) {
  using namespace detail;
#if defined(__AVX512F__)
  acc_nn_512(M, N, K, A, sam, sak, B, ldb, C, ldc, alpha);
  return;
#endif
  int64_t i = 0;
  for (; i + kNnMR <= M; i += kNnMR) acc_nn_rows<kNnMR>(N, K, A + i * sam, sam, sak, B, ldb, C + i * ldc, ldc, alpha);
  switch (M - i) {
    case 5: acc_nn_rows<5>(N, K, A + i * sam, sam, sak, B, ldb, C + i * ldc, ldc, alpha); break;
    case 4: acc_nn_rows<4>(N, K, A + i * sam, sam, sak, B, ldb, C + i * ldc, ldc, alpha); break;
    case 3: acc_nn_rows<3>(N, K, A + i * sam, sam, sak, B, ldb, C + i * ldc, ldc, alpha); break;
    case 2: acc_nn_rows<2>(N, K, A + i * sam, sam, sak, B, ldb, C + i * ldc, ldc, alpha); break;
    case 1: acc_nn_rows<1>(N, K, A + i * sam, sam, sak, B, ldb, C + i * ldc, ldc, alpha); break;
    default: break;
  }
}

// Bt[k*ldbt + j] = B[j*ldb + k] for j < N, k < K: turns K-contiguous rows into the
// N-contiguous panel acc_nn wants (dot_nt as acc_nn on a packed panel runs ~2-3x faster
// when the panel is reused by many rows). Blocked so both sides stay in cache.
template <typename T>
inline void transpose_pack(int64_t N, int64_t K, const T* B, int64_t ldb, T* Bt, int64_t ldbt) {
  constexpr int64_t bs = 16;
  for (int64_t j0 = 0; j0 < N; j0 += bs)
    for (int64_t k0 = 0; k0 < K; k0 += bs) {
      const int64_t j1 = j0 + bs < N ? j0 + bs : N, k1 = k0 + bs < K ? k0 + bs : K;
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t j = j0; j < j1; ++j) Bt[k * ldbt + j] = B[j * ldb + k];
    }
}

// Portable double versions (same contracts), blocked 4x4 so the compiler keeps sums in registers.
inline void dot_nt(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B, int64_t ldb,
                   double* C, int64_t ldc, double alpha, double beta = 0.0) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      const double* a = A + i * lda;
      const double* b = B + j * ldb;
      double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      int64_t k = 0;
      for (; k + 4 <= K; k += 4) { s0 += a[k] * b[k]; s1 += a[k + 1] * b[k + 1]; s2 += a[k + 2] * b[k + 2]; s3 += a[k + 3] * b[k + 3]; }
      for (; k < K; ++k) s0 += a[k] * b[k];
      const double s = (s0 + s1) + (s2 + s3);
      double* o = C + i * ldc + j;
      *o = beta == 0.0 ? alpha * s : alpha * s + beta * *o;
    }
}

inline void acc_nn(int64_t M, int64_t N, int64_t K, const double* A, int64_t sam, int64_t sak, const double* B,
                   int64_t ldb, double* C, int64_t ldc, double alpha) {
  for (int64_t i = 0; i < M; ++i) {
    double* c = C + i * ldc;
    for (int64_t k = 0; k < K; ++k) {
      const double a = alpha * A[i * sam + k * sak];  // (no skip of a == 0: 0 * NaN is NaN, as in torch's mm)
      const double* b = B + k * ldb;
      for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}

}  // namespace gemm
}  // namespace tk
