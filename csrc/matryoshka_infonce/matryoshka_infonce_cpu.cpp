// CPU kernels for the single-pass fused Matryoshka InfoNCE (matryoshka_infonce.h). OpenMP over row blocks
// of IT anchors, each walking all JT-wide candidate panels (staggered start, per-panel locks for column
// state, as csrc/multipos_infonce/multipos_infonce_cpu.cpp). Per tile the raw dot products are accumulated
// segment by segment with the acc_nn micro-kernel (csrc/common/cpu_gemm.h) and snapshot after each
// segment: K level logit tiles for the price of one full-width product. Forward keeps an online
// log-sum-exp per level for rows (and columns); backward recomputes, builds the K coefficient tiles,
// suffix-sums them over levels and runs one acc_nn per segment for dq and dd.
// Scratch per thread: O(K * IT * JT + JT * H); shared: one transposed copy of d (and extra_neg),
// O(K * (Bq + Bd + N)) statistics.
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>
#include "common/cpu_gemm.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "common/cpu_math.h"
#include "matryoshka_infonce/matryoshka_infonce.h"
#include "multipos_infonce/multipos_math.h"

namespace tk {
namespace {

constexpr int64_t IT = 256;  // most anchor rows per task (scratch size); a call uses rows_per_task() <= IT

inline int64_t ceil_div(int64_t a, int64_t b);
// Anchor rows per task: up to IT (each candidate panel, from L3 for large Bd, then feeds that many rows of
// products; measured single core, B = C = 2,048, H = 768, gradient in forward: see docs/matryoshka_infonce.md),
// fewer when that would leave under 4 tasks per thread (not under 64), and with the gradient in forward (the task keeps
// its logits, K x rows x (Bd + N)) at most ~8 MiB of logits per thread (at least 32 rows); then evened out
// so that the task count is a multiple of the thread count.
inline int64_t rows_per_task(int64_t Bq, int64_t logit_row_bytes) {
  const int64_t nth = std::max(omp_get_max_threads(), 1);
  const int64_t per = ceil_div(std::max<int64_t>(Bq, 1), 4 * nth);
  int64_t r = std::min<int64_t>(IT, std::max<int64_t>(64, ceil_div(per, 16) * 16));
#ifndef TK_MAT_LOGIT_MIB
#define TK_MAT_LOGIT_MIB 8
#endif
  if (logit_row_bytes > 0)
    r = std::min(r, std::max<int64_t>(32, (int64_t(TK_MAT_LOGIT_MIB) << 20) / logit_row_bytes / 16 * 16));
  // then as many tasks as a multiple of the thread count, equal sizes (an even OpenMP split), unless that
  // would cut blocks below min(r, 64) rows (small batches stay one task per 64 rows, as before)
  const int64_t n = ceil_div(ceil_div(std::max<int64_t>(Bq, 1), r), nth) * nth;
  const int64_t re = ceil_div(std::max<int64_t>(Bq, 1), n);
  return re >= std::min<int64_t>(r, 64) ? re : r;
}
constexpr int64_t JT = 96;  // candidate columns per tile

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

class Locks {
 public:
  explicit Locks(int64_t n) : l_(std::max<int64_t>(n, 1)) { for (auto& x : l_) omp_init_lock(&x); }
  ~Locks() { for (auto& x : l_) omp_destroy_lock(&x); }
  void lock(int64_t i) { omp_set_lock(&l_[i]); }
  bool try_lock(int64_t i) { return omp_test_lock(&l_[i]) != 0; }
  void unlock(int64_t i) { omp_unset_lock(&l_[i]); }
 private:
  std::vector<omp_lock_t> l_;
};

inline int64_t stagger(int64_t ib, int64_t nJB) {
  const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
  return (tid * nJB / std::max<int64_t>(nth, 1) + ib) % std::max<int64_t>(nJB, 1);
}

// batched exp and log-sum-exp merging: the multipos kernel's (csrc/multipos_infonce/multipos_math.h)
using mp::lse_merge;
using mp::vexp_inplace;

// A zero-initialised buffer on a 64-byte boundary (the packed operands: unaligned 64-byte loads split lines).
template <typename T>
class AlignedBuf {
 public:
  AlignedBuf() = default;
  explicit AlignedBuf(size_t n) { resize(n); }
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
  ~AlignedBuf() { std::free(p_); }
  void resize(size_t n) {
    std::free(p_);
    p_ = nullptr;
    n_ = n;
    if (!n) return;
    const size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    p_ = static_cast<T*>(std::aligned_alloc(64, bytes));
    if (!p_) throw std::bad_alloc();
    std::memset(p_, 0, bytes);
  }
  T* data() { return p_; }
  const T* data() const { return p_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

inline bool overlap(int64_t alo, int64_t ahi, int64_t blo, int64_t bhi) { return std::max(alo, blo) <= std::min(ahi, bhi); }

// Positives of a tile (level-independent): for row r, columns pidx[pst[r] .. pst[r + 1]) (tile-local).
struct TilePos {
  std::vector<int32_t> pst, pidx;
  TilePos() : pst(IT + 1), pidx(IT * JT) {}
  void build(int64_t mi, int64_t nj, const int64_t* qlo, const int64_t* qhi, const int64_t* dlo, const int64_t* dhi) {
    int32_t n = 0;
    for (int64_t r = 0; r < mi; ++r) {
      pst[r] = n;
      const int64_t lo = qlo[r], hi = qhi[r];
      if (!mp::count_pos(nj, lo, hi, dlo, dhi)) continue;  // vectorised test first: positives are sparse
      for (int64_t j = 0; j < nj; ++j) {
        pidx[n] = (int32_t)j;
        n += overlap(lo, hi, dlo[j], dhi[j]);
      }
    }
    pst[mi] = n;
  }
};

// ---- fused row passes (explicit float vectors, 16 lanes on AVX-512, else 8; double: plain loops) -------
#if defined(__AVX512F__)
using vfw = vf16;
constexpr int kW = 16;
#else
using vfw = vf8;
constexpr int kW = 8;
#endif
inline vfw vload(const float* p) { vfw v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, vfw v) { std::memcpy(p, &v, sizeof v); }
inline float hmax(vfw v) { float m = v[0]; for (int k = 1; k < kW; ++k) m = std::max(m, v[k]); return m; }
inline float hsum(vfw v) { float s = 0; for (int k = 0; k < kW; ++k) s += v[k]; return s; }

// exp of 16 lanes, always inlined (the shared vf16 fast_exp was an out-of-line call in the row passes: every
// live zmm spilled around it). Same range reduction and polynomial as fast_exp (cpu_math.h): n = round(x / ln 2)
// by vrndscale, 2^n by vscalef; 0 below -87.34 (no subnormal results), clamped above, NaN propagates.
#if defined(__AVX512F__)
__attribute__((always_inline)) inline vfw xexp(vfw xv) {
  const __m512 x0 = (__m512)xv;
  const __mmask16 keep = _mm512_cmp_ps_mask(x0, _mm512_set1_ps(-87.33654f), _CMP_NLT_UQ);  // x >= lo or NaN
  const __m512 x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x0);                 // NaN stays NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894e-2f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459e-1f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201e-1f));
  q = _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return (vfw)_mm512_maskz_scalef_ps(keep, q, n);
}
#else
inline vfw xexp(vfw x) { return fast_exp(x); }
#endif

// z[j] = g[j] * f * kc[j]; returns max_j z[j]
inline float scale_max(const float* g, float f, const float* kc, float* z, int64_t n) {
  vfw vm = vfw{} - std::numeric_limits<float>::infinity();
  const vfw vf = vfw{} + f;
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const vfw v = vload(g + j) * vf * vload(kc + j);
    vstore(z + j, v);
    vm = v > vm ? v : vm;
  }
  float m = hmax(vm);
  for (; j < n; ++j) { z[j] = g[j] * f * kc[j]; m = std::max(m, z[j]); }
  return m;
}
inline double scale_max(const double* g, double f, const double* kc, double* z, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) { z[j] = g[j] * f * kc[j]; m = std::max(m, z[j]); }
  return m;
}
// sum_j exp(z[j] - m)
inline float exp_sum(const float* z, float m, int64_t n) {
  vfw vs = vfw{};
  const vfw vm = vfw{} + m;
  int64_t j = 0;
  for (; j + kW <= n; j += kW) vs += xexp(vload(z + j) - vm);
  float s = hsum(vs);
  for (; j < n; ++j) s += fast_exp(z[j] - m);
  return s;
}
inline double exp_sum(const double* z, double m, int64_t n) {
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += std::exp(z[j] - m);
  return s;
}

// One row of a level tile in the statistics pass: z[j] = g[j] * f * kc[j] (stored) merged into the online
// log-sum-exp (m, s) (log(s) + m). Once m is set (after the row's first tile) the exps are taken against m
// itself in the same pass as the scaling (no separate max pass and re-read); only when the tile's max
// exceeds m by more than 64 (exp could overflow float32 in the sum) the tile is summed again against its max.
inline void scale_lse(const float* g, float f, const float* kc, float* z, int64_t n, float& m, float& s) {
  if (!(m > -std::numeric_limits<float>::infinity())) {
    const float mx = scale_max(g, f, kc, z, n);
    lse_merge(m, s, mx, exp_sum(z, mx, n));
    return;
  }
  vfw vm = vfw{} - std::numeric_limits<float>::infinity(), vs = vfw{};
  const vfw vf = vfw{} + f, vsh = vfw{} + m;
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const vfw v = vload(g + j) * vf * vload(kc + j);
    vstore(z + j, v);
    vm = v > vm ? v : vm;
    vs += xexp(v - vsh);
  }
  float mt = hmax(vm), st = hsum(vs);
  for (; j < n; ++j) {
    z[j] = g[j] * f * kc[j];
    mt = std::max(mt, z[j]);
    st += fast_exp(z[j] - m);
  }
  if (mt > m + 64.f) lse_merge(m, s, mt, exp_sum(z, mt, n));
  else s += st;
}
inline void scale_lse(const double* g, double f, const double* kc, double* z, int64_t n, double& m, double& s) {
  const double mx = scale_max(g, f, kc, z, n);
  lse_merge(m, s, mx, exp_sum(z, mx, n));
}

// One row of the gradient, dense part: z_j = RAW ? src[j] * fz * kc[j] : src[j];
// g_j = rw exp(z_j - lse) (+ cw exp(z_j - cl[j]) when cl); h[j] = g_j * fh * kc[j]; tcl[j] += g_j z_j;
// returns sum_j g_j z_j.
template <bool RAW, bool COLS>
inline float grad_dense(const float* src, float fz, const float* kc, int64_t n, float rw, float lse, float cw,
                        const float* cl, float fh, float* h, float* tcl) {
  const vfw vfz = vfw{} + fz, vrw = vfw{} + rw, vlse = vfw{} + lse, vcw = vfw{} + cw, vfh = vfw{} + fh;
  vfw vsu = vfw{};
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const vfw k = vload(kc + j);
    const vfw z = RAW ? vload(src + j) * vfz * k : vload(src + j);
    vfw g = vrw * xexp(z - vlse);
    if constexpr (COLS) g += vcw * xexp(z - vload(cl + j));
    const vfw u = g * z;
    vsu += u;
    vstore(tcl + j, vload(tcl + j) + u);
    vstore(h + j, g * vfh * k);
  }
  float su = hsum(vsu);
  for (; j < n; ++j) {
    const float z = RAW ? src[j] * fz * kc[j] : src[j];
    float g = rw * fast_exp(z - lse);
    if constexpr (COLS) g += cw * fast_exp(z - cl[j]);
    su += g * z;
    tcl[j] += g * z;
    h[j] = g * fh * kc[j];
  }
  return su;
}
template <bool RAW, bool COLS>
inline double grad_dense(const double* src, double fz, const double* kc, int64_t n, double rw, double lse, double cw,
                         const double* cl, double fh, double* h, double* tcl) {
  double su = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double z = RAW ? src[j] * fz * kc[j] : src[j];
    double g = rw * std::exp(z - lse);
    if constexpr (COLS) g += cw * std::exp(z - cl[j]);
    su += g * z;
    tcl[j] += g * z;
    h[j] = g * fh * kc[j];
  }
  return su;
}

// One row of the gradient for all levels at once (gradient-in-forward path: no column term): walks the levels
// from the top weighted one (top) down, g_l = rw_l exp(z_l - lse_l), keeps the suffix sum
// H_l = sum_{k >= l} g_k f_k kc_k in a register and writes H_l (not h_l: no separate suffix-sum pass);
// adds g_l z_l to tcl[l * JT + j] and returns the row sums in su[l]. Level l: logits z + l * zs, column
// scales kc + l * kcs, output h + l * hs; rw_l = 0 for levels without weight.
constexpr int64_t kMaxFusedK = 16;  // more levels take the per-level coef_tile + suffix-sum path
inline void grad_row_levels(int64_t top, int64_t nj, const float* z, int64_t zs, const float* kc, int64_t kcs,
                            const float* rw, const float* lse, const float* f, float* h, int64_t hs, float* tcl,
                            float* su) {
  vfw vsu[kMaxFusedK];
  for (int64_t l = 0; l <= top; ++l) vsu[l] = vfw{};
  int64_t j = 0;
  for (; j + kW <= nj; j += kW) {
    vfw acc = vfw{};
    for (int64_t l = top; l >= 0; --l) {
      if (rw[l] != 0.f) {
        const vfw zz = vload(z + l * zs + j);
        const vfw g = (vfw{} + rw[l]) * xexp(zz - lse[l]);
        const vfw u = g * zz;
        vsu[l] += u;
        vstore(tcl + l * JT + j, vload(tcl + l * JT + j) + u);
        acc += g * (vfw{} + f[l]) * vload(kc + l * kcs + j);
      }
      vstore(h + l * hs + j, acc);
    }
  }
  for (int64_t l = 0; l <= top; ++l) su[l] = hsum(vsu[l]);
  for (; j < nj; ++j) {
    float acc = 0.f;
    for (int64_t l = top; l >= 0; --l) {
      if (rw[l] != 0.f) {
        const float zz = z[l * zs + j];
        const float g = rw[l] * fast_exp(zz - lse[l]);
        su[l] += g * zz;
        tcl[l * JT + j] += g * zz;
        acc += g * f[l] * kc[l * kcs + j];
      }
      h[l * hs + j] = acc;
    }
  }
}
inline void grad_row_levels(int64_t top, int64_t nj, const double* z, int64_t zs, const double* kc, int64_t kcs,
                            const double* rw, const double* lse, const double* f, double* h, int64_t hs, double* tcl,
                            double* su) {
  for (int64_t l = 0; l <= top; ++l) su[l] = 0;
  for (int64_t j = 0; j < nj; ++j) {
    double acc = 0;
    for (int64_t l = top; l >= 0; --l) {
      if (rw[l] != 0) {
        const double zz = z[l * zs + j];
        const double g = rw[l] * std::exp(zz - lse[l]);
        su[l] += g * zz;
        tcl[l * JT + j] += g * zz;
        acc += g * f[l] * kc[l * kcs + j];
      }
      h[l * hs + j] = acc;
    }
  }
}

// Pack panel b of X (rows [b*JT, b*JT + w)) transposed to (H x w) at out + b*JT*H.
template <typename A>
void pack_panels(const A* X, int64_t ld, int64_t n, int64_t H, A* out) {
  const int64_t nb = ceil_div(n, JT);
#pragma omp parallel for schedule(static) if (nb > 1 && n * H > 65536)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t j0 = b * JT, w = std::min(JT, n - j0);
    gemm::transpose_pack(w, H, X + j0 * ld, ld, out + j0 * H, w);
  }
}

// X (rows x H, row stride ld) in strips of 64 columns: strip s (width min(64, H - 64 s)) is rows x width at
// out + s * rows * 64: the dd product's B operand (the row block's q), packed once per row block instead of
// once per acc_nn call (per candidate panel); the 6 x 64 micro-kernel then reads it without a copy.
constexpr int64_t QW = 64;
template <typename A>
void pack_strips(const A* X, int64_t ld, int64_t rows, int64_t H, A* out) {
  for (int64_t c0 = 0; c0 < H; c0 += QW) {
    const int64_t w = std::min(QW, H - c0);
    A* o = out + (c0 / QW) * rows * QW;
    for (int64_t k = 0; k < rows; ++k) std::memcpy(o + k * w, X + k * ld + c0, sizeof(A) * w);
  }
}

template <typename A>
class Pass {
 public:
  explicit Pass(const MatryoshkaParams& params)
      : p(params), q(static_cast<const A*>(p.q)), d(static_cast<const A*>(p.d)), neg(static_cast<const A*>(p.neg)),
        rho(static_cast<const A*>(p.rho)), kap(static_cast<const A*>(p.kap)), kneg(static_cast<const A*>(p.kneg)),
        Bq(p.Bq), Bd(p.Bd), N(neg ? p.N : 0), H(p.H), K(p.K), it((A)p.inv_temp), cols(p.col_weight != 0.0),
        dpan((size_t)(Bd * H)), npan((size_t)(N * H)), itr(rows_per_task(Bq, (p.dq != nullptr && p.col_weight == 0.0) ? (int64_t)sizeof(A) * p.K * (p.Bd + (p.neg ? p.N : 0)) : 0)),
        nIB(ceil_div(Bq, itr)), nJB(ceil_div(Bd, JT)),
        nNB(ceil_div(N, JT)) {
    pack_panels(d, p.ldd, Bd, H, dpan.data());
    if (N) pack_panels(neg, p.ldn, N, H, npan.data());
  }
  void fwd();
  void bwd();

 private:
  // What the gradient computation shares across threads: per-level coefficients, locks, column sums.
  struct GradState {
    std::vector<A> rw, cw, csum, nsum;
    std::vector<char> nz;
    bool any = false, rows_on = false;
    Locks jlocks, nlocks;
    GradState(const Pass& s, const std::vector<double>& coef)
        : rw(s.K), cw(s.K), csum((size_t)(s.K * s.Bd), A(0)), nsum((size_t)(s.K * s.N), A(0)), nz(s.K),
          jlocks(s.nJB), nlocks(s.nNB) {
      rows_on = s.p.row_weight != 0.0;
      for (int64_t l = 0; l < s.K; ++l) {
        rw[l] = s.Bq ? (A)(coef[l] * s.p.row_weight / (double)s.Bq) : A(0);
        cw[l] = (s.cols && s.Bd) ? (A)(coef[l] * s.p.col_weight / (double)s.Bd) : A(0);
        nz[l] = rw[l] != A(0) || cw[l] != A(0);
        any = any || nz[l];
      }
    }
  };
  // Per-thread scratch of the gradient computation.
  struct Scratch {
    std::vector<A> G, Hs, ea, ca, ddl, usum, tcol;
    AlignedBuf<A> qs;
    std::vector<char> act;
    TilePos tp;
    Scratch(int64_t K, int64_t H)
        : G(IT * JT), Hs(K * IT * JT), ea(JT), ca(JT), ddl(JT * H), usum(K * IT), tcol(K * JT), qs(IT * H), act(K) {}
  };

  // G (mi x nj, ld JT) += q[i0 + r, a:b] . panel rows a..b (panel: H x nj, packed)
  void seg_acc(int64_t i0, int64_t mi, const A* panel, int64_t nj, int64_t a, int64_t b, A* G) const {
    gemm::acc_nn(mi, nj, b - a, q + i0 * p.ldq + a, p.ldq, 1, panel + a * nj, nj, G, JT, A(1));
  }
  // segment [a, b) served from 64-column strips (pack_strips)?
  bool strip_seg(int64_t a, int64_t b) const { return a % QW == 0 && (b % QW == 0 || b == H); }
  // C[:, a:b] += Am (m x kk, strides sam, sak) . Xs[:, a:b], Xs: rows x H in 64-column strips
  void acc_strips(int64_t m, int64_t kk, const A* Am, int64_t sam, int64_t sak, const A* Xs, int64_t rows, int64_t a,
                  int64_t b, A* C, int64_t ldc) const {
    for (int64_t c0 = a; c0 < b; c0 += QW) {
      const int64_t w = std::min(QW, b - c0);
      gemm::acc_nn(m, w, kk, Am, sam, sak, Xs + (c0 / QW) * rows * QW, std::min(QW, H - c0), C + c0, ldc, A(1));
    }
  }
  // Z = inv_temp * G * rho_r * kc_j
  void scale(const A* G, int64_t mi, int64_t nj, const A* rr, const A* kc, A* Z) const {
    for (int64_t r = 0; r < mi; ++r) {
      const A f = it * rr[r];
      const A* g = G + r * JT;
      A* z = Z + r * JT;
#pragma omp simd
      for (int64_t j = 0; j < nj; ++j) z[j] = g[j] * f * kc[j];
    }
  }
  int64_t col_of(int64_t i) const { return i + p.diag_offset; }
  int64_t row_of(int64_t j) const { return j - p.diag_offset; }

  // Level l's coefficient tile: h (mi x nj, ld JT) = g_l * rho * kc * inv_temp with g_l = dL/dz_l, from
  // src = the raw products G (raw: z = inv_temp G rho kc) or the logits z themselves (row stride sld);
  // adds the sums of g_l z_l to the rows (sc.usum) and columns (sc.tcol). negs: the tile is extra negatives
  // (row denominators only); else the positives of sc.tp (and the diagonal fallbacks) apply.
  void coef_tile(const GradState& gs, Scratch& sc, int64_t l, int64_t i0, int64_t mi, int64_t j0, int64_t nj,
                 bool negs, const A* src, int64_t sld, bool raw, A* h) const {
    const A* st = static_cast<const A*>(p.row_stats) + l * 3 * Bq;
    const A* ct = (cols && !negs) ? static_cast<const A*>(p.col_stats) + l * 3 * Bd : nullptr;
    const A* kc = negs ? kneg + l * N + j0 : kap + l * Bd + j0;
    A* tcl = sc.tcol.data() + l * JT;
    const A rwl = gs.rows_on ? gs.rw[l] : A(0), cwl = gs.cw[l];
    for (int64_t r = 0; r < mi; ++r) {
      const int64_t i = i0 + r;
      const A* zr = src + r * sld;
      A* hr = h + r * JT;
      const A f = it * rho[l * Bq + i];
      const A fz = raw ? f : A(1);
      const A lse = st[i], lsep = st[Bq + i];
      A su;
      if (raw)
        su = ct ? grad_dense<true, true>(zr, fz, kc, nj, rwl, lse, cwl, ct + j0, f, hr, tcl)
                : grad_dense<true, false>(zr, fz, kc, nj, rwl, lse, cwl, nullptr, f, hr, tcl);
      else
        su = ct ? grad_dense<false, true>(zr, fz, kc, nj, rwl, lse, cwl, ct + j0, f, hr, tcl)
                : grad_dense<false, false>(zr, fz, kc, nj, rwl, lse, cwl, nullptr, f, hr, tcl);
      if (!negs) {  // sparse part: - rw exp(z - lse_pos) on the positives (and the fallback diagonals)
        auto fix = [&](int64_t j, bool row_pos, bool col_pos) {
          const A z = raw ? zr[j] * fz * kc[j] : zr[j];
          A dg = 0;
          if (row_pos && gs.rows_on) dg -= rwl * mp::vexp(z - lsep);
          if (col_pos && ct) dg -= cwl * mp::vexp(z - ct[Bd + j0 + j]);
          hr[j] += dg * f * kc[j];
          tcl[j] += dg * z;
          su += dg * z;
        };
        for (int32_t k = sc.tp.pst[r]; k < sc.tp.pst[r + 1]; ++k) fix(sc.tp.pidx[k], true, true);
        const int64_t jd = col_of(i);
        if (jd >= j0 && jd < j0 + nj && !overlap(p.q_lo[i], p.q_hi[i], p.d_lo[jd], p.d_hi[jd]))
          fix(jd - j0, st[2 * Bq + i] != A(0), ct && ct[2 * Bd + jd] != A(0));
      }
      sc.usum[l * IT + r] += su;
    }
  }

  // All levels' suffix-summed coefficient tiles H_l of one panel from stored logits (zp: the panel's level
  // tiles, itr x JT each; the gradient-in-forward path, no column term) into sc.Hs, row sums into sc.usum,
  // column sums into sc.tcol; then the positives' sparse corrections (level-independent positions), added to
  // the suffix sums from the top down.
  void coef_panel_fused(const GradState& gs, Scratch& sc, int64_t top, int64_t i0, int64_t mi, int64_t j0, int64_t nj,
                        bool negs, const A* zp, const A* znext) const {
    const A* st = static_cast<const A*>(p.row_stats);
    const A* kc = negs ? kneg + j0 : kap + j0;
    const int64_t kcs = negs ? N : Bd, zs = itr * JT;
    A rw[kMaxFusedK], lse[kMaxFusedK], lsep[kMaxFusedK], f[kMaxFusedK], su[kMaxFusedK];
    for (int64_t r = 0; r < mi; ++r) {
      const int64_t i = i0 + r;
      for (int64_t l = 0; l <= top; ++l) {
        rw[l] = (gs.rows_on && gs.nz[l]) ? gs.rw[l] : A(0);
        lse[l] = st[l * 3 * Bq + i];
        lsep[l] = st[l * 3 * Bq + Bq + i];
        f[l] = it * rho[l * Bq + i];
      }
      const A* zr = zp + r * JT;
      A* hr = sc.Hs.data() + r * JT;
      if (znext)  // the next panel's logits of this row towards L2 while this panel's products run
        for (int64_t l = 0; l <= top; ++l)
          for (int64_t x = 0; x < JT * (int64_t)sizeof(A); x += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(znext + l * zs + r * JT) + x, 0, 2);
      grad_row_levels(top, nj, zr, zs, kc, kcs, rw, lse, f, hr, IT * JT, sc.tcol.data(), su);
      if (!negs) {  // - rw exp(z - lse_pos) on the positives (and the fallback diagonal), all levels
        auto fix = [&](int64_t j, bool diag) {
          A acc = 0;
          for (int64_t l = top; l >= 0; --l) {
            if (rw[l] != A(0) && (!diag || st[l * 3 * Bq + 2 * Bq + i] != A(0))) {
              const A z = zr[l * zs + j];
              const A dg = -rw[l] * mp::vexp(z - lsep[l]);
              acc += dg * f[l] * kc[l * kcs + j];
              sc.tcol[l * JT + j] += dg * z;
              su[l] += dg * z;
            }
            hr[l * IT * JT + j] += acc;
          }
        };
        for (int32_t k = sc.tp.pst[r]; k < sc.tp.pst[r + 1]; ++k) fix(sc.tp.pidx[k], false);
        const int64_t jd = col_of(i);
        if (jd >= j0 && jd < j0 + nj && !overlap(p.q_lo[i], p.q_hi[i], p.d_lo[jd], p.d_hi[jd])) fix(jd - j0, true);
      }
      for (int64_t l = 0; l <= top; ++l) sc.usum[l * IT + r] += su[l];
    }
  }

  // After the coefficient tiles of a panel: suffix sums over levels, dq[:, S_l] += H_l X[:, S_l] and
  // dX[:, S_l] += H_l^T q[:, S_l] (X = d or the extra negatives), column sums merged under the panel lock.
  void finish_panel(GradState& gs, Scratch& sc, int64_t i0, int64_t mi, int64_t j0, int64_t nj, int64_t jb,
                    bool negs, bool summed = false) const {
    const std::vector<int64_t>& seg = p.seg;
    bool have = false;
    for (int64_t l = K - 1; l >= 0; --l) {
      A* h = sc.Hs.data() + l * IT * JT;
      if (have && !summed) {
        const A* h1 = h + IT * JT;
        for (int64_t r = 0; r < mi; ++r) {
          if (gs.nz[l]) {
#pragma omp simd
            for (int64_t j = 0; j < nj; ++j) h[r * JT + j] += h1[r * JT + j];
          } else {
            std::copy(h1 + r * JT, h1 + r * JT + nj, h + r * JT);
          }
        }
      }
      have = have || gs.nz[l];
      sc.act[l] = have;
    }
    const A* X = negs ? neg : d;
    const int64_t ldx = negs ? p.ldn : p.ldd;
    A* dq = static_cast<A*>(p.dq);
    A* dX = static_cast<A*>(negs ? p.dneg : p.dd) + j0 * H;
    for (int64_t l = 0; l < K; ++l)
      if (sc.act[l])
        gemm::acc_nn(mi, seg[l + 1] - seg[l], nj, sc.Hs.data() + l * IT * JT, JT, 1, X + j0 * ldx + seg[l], ldx,
                     dq + i0 * H + seg[l], H, A(1));
    Locks& locks = negs ? gs.nlocks : gs.jlocks;
    const bool direct = !negs && locks.try_lock(jb);
    A* dst = direct ? dX : sc.ddl.data();
    if (!direct) std::fill(sc.ddl.begin(), sc.ddl.begin() + nj * H, A(0));
    for (int64_t l = 0; l < K; ++l)
      if (sc.act[l]) {
        if (strip_seg(seg[l], seg[l + 1]))
          acc_strips(nj, mi, sc.Hs.data() + l * IT * JT, 1, JT, sc.qs.data(), mi, seg[l], seg[l + 1], dst, H);
        else
          gemm::acc_nn(nj, seg[l + 1] - seg[l], mi, sc.Hs.data() + l * IT * JT, 1, JT, q + i0 * p.ldq + seg[l],
                       p.ldq, dst + seg[l], H, A(1));
      }
    if (!direct) {
      locks.lock(jb);
      for (int64_t x = 0; x < nj * H; ++x) dX[x] += sc.ddl[x];
    }
    A* cs = negs ? gs.nsum.data() : gs.csum.data();
    const int64_t n = negs ? N : Bd;
    for (int64_t l = 0; l < K; ++l)
      if (gs.nz[l])
        for (int64_t j = 0; j < nj; ++j) cs[l * n + j0 + j] += sc.tcol[l * JT + j];
    locks.unlock(jb);
  }

  void finish_rows(Scratch& sc, int64_t i0, int64_t mi) const {
    A* drho = static_cast<A*>(p.drho);
    for (int64_t l = 0; l < K; ++l)
      for (int64_t r = 0; r < mi; ++r) drho[l * Bq + i0 + r] = sc.usum[l * IT + r] / rho[l * Bq + i0 + r];
  }

  void finish_norms(const GradState& gs) const {
    A* dkap = static_cast<A*>(p.dkap);
    A* dkneg = static_cast<A*>(p.dkneg);
    for (int64_t x = 0; x < K * Bd; ++x) dkap[x] = gs.csum[x] / kap[x];
    for (int64_t x = 0; x < K * N; ++x) dkneg[x] = gs.nsum[x] / kneg[x];
  }

  // Gradient of row block (i0, mi) from logits already computed: zb (panel-major: per candidate panel p, K
  // level tiles of itr x JT, contiguous, so the gradient pass streams them; see zlog) holds
  // every level's logits of these rows against all candidates (the gradient-in-forward path).
  void grad_rows_from_logits(GradState& gs, Scratch& sc, int64_t i0, int64_t mi, const A* zb) const {
    std::fill(sc.usum.begin(), sc.usum.end(), A(0));
    pack_strips(q + i0 * p.ldq, p.ldq, mi, H, sc.qs.data());
    int64_t top = K - 1;  // the highest weighted level (gs.any: there is one)
    while (top > 0 && !gs.nz[top]) --top;
    const bool fused = top < kMaxFusedK;  // else the per-level tiles + suffix-sum pass
    const int64_t jstart = stagger(i0 / itr, nJB);
    for (int64_t t = 0; t < nJB; ++t) {
      const int64_t jb = (jstart + t) % nJB, j0 = jb * JT, nj = std::min(JT, Bd - j0);
      std::fill(sc.tcol.begin(), sc.tcol.end(), A(0));
      sc.tp.build(mi, nj, p.q_lo + i0, p.q_hi + i0, p.d_lo + j0, p.d_hi + j0);
      if (fused) {
        coef_panel_fused(gs, sc, top, i0, mi, j0, nj, false, zb + zlog(jb, 0, 0),
                         t + 1 < nJB ? zb + zlog((jstart + t + 1) % nJB, 0, 0)
                                     : (gs.rows_on && nNB ? zb + zlog(nJB, 0, 0) : nullptr));
      } else {
        for (int64_t l = 0; l < K; ++l) {
          if (!gs.nz[l]) continue;
          coef_tile(gs, sc, l, i0, mi, j0, nj, false, zb + zlog(jb, l, 0), JT, false, sc.Hs.data() + l * IT * JT);
        }
      }
      finish_panel(gs, sc, i0, mi, j0, nj, jb, false, fused);
    }
    for (int64_t nb = 0; gs.rows_on && nb < nNB; ++nb) {
      const int64_t k0 = nb * JT, nk = std::min(JT, N - k0);
      std::fill(sc.tcol.begin(), sc.tcol.end(), A(0));
      if (fused) {
        coef_panel_fused(gs, sc, top, i0, mi, k0, nk, true, zb + zlog(nJB + nb, 0, 0),
                         nb + 1 < nNB ? zb + zlog(nJB + nb + 1, 0, 0) : nullptr);
      } else {
        for (int64_t l = 0; l < K; ++l) {
          if (!gs.nz[l]) continue;
          coef_tile(gs, sc, l, i0, mi, k0, nk, true, zb + zlog(nJB + nb, l, 0), JT, false, sc.Hs.data() + l * IT * JT);
        }
      }
      finish_panel(gs, sc, i0, mi, k0, nk, nb, true, fused);
    }
    finish_rows(sc, i0, mi);
  }

  const MatryoshkaParams& p;
  const A *q, *d, *neg, *rho, *kap, *kneg;
  const int64_t Bq, Bd, N, H, K;
  const A it;
  const bool cols;
  std::vector<A> dpan, npan;
  const int64_t itr, nIB, nJB, nNB;  // itr: anchor rows per task
  // Offset of row r, level l, candidate panel p (document panels 0..nJB, then extra-negative panels) in a
  // row block's logits: panel-major, each level tile itr x JT contiguous. (A row-major K x itr x (Bd + N)
  // layout made the gradient pass read 384-byte pieces 8 KiB apart from L3: 80% of its time in those loads.)
  int64_t zlog(int64_t p, int64_t l, int64_t r) const { return ((p * K + l) * itr + r) * JT; }
};

template <typename A>
void Pass<A>::fwd() {
  const A ninf = -std::numeric_limits<A>::infinity();
  const A nan = std::numeric_limits<A>::quiet_NaN();
  const size_t nc = cols ? (size_t)(K * Bd) : 0;
  std::vector<A> cm(nc, ninf), cs(nc, A(0)), cpm(nc, ninf), cps(nc, A(0)), cdiag(nc, nan);
  std::vector<int64_t> ccnt(nc, 0);
  Locks locks(nJB);
  A* rs = static_cast<A*>(p.row_stats);
  const std::vector<int64_t>& seg = p.seg;
  // gradient in forward (the wrapper asks for it when the loss has no column term): each row block keeps
  // its logits against all candidates (K x IT x (Bd + N)), so the gradient needs no recomputed products
  const bool gif = p.dq != nullptr && !cols;
  GradState gs(*this, p.coef);

#pragma omp parallel if (nIB > 1)
  {
    std::vector<A> G(IT * JT), Z(IT * JT), e(JT);
    std::vector<A> rm(K * IT), rsum(K * IT), rpm(K * IT), rps(K * IT), rdiag(K * IT);
    std::vector<int64_t> rcnt(K * IT);
    std::vector<A> tm(K * JT), ts(K * JT), tpm(K * JT), tps(K * JT), tdg(K * JT);
    std::vector<int64_t> tc(K * JT);
    TilePos tp;
    std::vector<A> zb(gif ? (size_t)zlog(nJB + nNB, 0, 0) : 0);
    std::unique_ptr<Scratch> sc(gif && gs.any ? new Scratch(K, H) : nullptr);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ib = 0; ib < nIB; ++ib) {
      const int64_t i0 = ib * itr, mi = std::min(itr, Bq - i0);
      std::fill(rm.begin(), rm.end(), ninf);
      std::fill(rsum.begin(), rsum.end(), A(0));
      std::fill(rpm.begin(), rpm.end(), ninf);
      std::fill(rps.begin(), rps.end(), A(0));
      std::fill(rdiag.begin(), rdiag.end(), nan);
      std::fill(rcnt.begin(), rcnt.end(), 0);
      const int64_t jstart = stagger(ib, nJB);
      for (int64_t t = 0; t < nJB; ++t) {
        const int64_t jb = (jstart + t) % nJB, j0 = jb * JT, nj = std::min(JT, Bd - j0);
        for (int64_t r = 0; r < mi; ++r) std::fill(G.data() + r * JT, G.data() + r * JT + nj, A(0));
        tp.build(mi, nj, p.q_lo + i0, p.q_hi + i0, p.d_lo + j0, p.d_hi + j0);
        if (cols) {
          std::fill(tm.begin(), tm.end(), ninf);
          std::fill(tpm.begin(), tpm.end(), ninf);
          std::fill(ts.begin(), ts.end(), A(0));
          std::fill(tps.begin(), tps.end(), A(0));
          std::fill(tdg.begin(), tdg.end(), nan);
          std::fill(tc.begin(), tc.end(), 0);
        }
        for (int64_t l = 0; l < K; ++l) {
          seg_acc(i0, mi, dpan.data() + j0 * H, nj, seg[l], seg[l + 1], G.data());
          for (int64_t r = 0; r < mi; ++r) {
            const int64_t i = i0 + r, x = l * IT + r;
            A* z = gif ? zb.data() + zlog(jb, l, r) : Z.data() + r * JT;
            scale_lse(G.data() + r * JT, it * rho[l * Bq + i], kap + l * Bd + j0, z, nj, rm[x], rsum[x]);
            const int32_t* pi = tp.pidx.data() + tp.pst[r];
            const int64_t np = tp.pst[r + 1] - tp.pst[r];
            if (np) {
              A mx = z[pi[0]];
              for (int64_t k = 1; k < np; ++k) mx = std::max(mx, z[pi[k]]);
              A sum = 0;
              for (int64_t k = 0; k < np; ++k) sum += mp::vexp(z[pi[k]] - mx);
              lse_merge(rpm[x], rps[x], mx, sum);
              rcnt[x] += np;
            }
            const int64_t jd = col_of(i);
            if (jd >= j0 && jd < j0 + nj) rdiag[x] = z[jd - j0];
          }
          if (!cols) continue;
          A* m1 = tm.data() + l * JT;
          A* s1 = ts.data() + l * JT;
          A* m2 = tpm.data() + l * JT;
          A* s2 = tps.data() + l * JT;
          int64_t* c2 = tc.data() + l * JT;
          for (int64_t r = 0; r < mi; ++r) {
            const A* z = Z.data() + r * JT;
#pragma omp simd
            for (int64_t j = 0; j < nj; ++j) m1[j] = std::max(m1[j], z[j]);
            for (int32_t k = tp.pst[r]; k < tp.pst[r + 1]; ++k) {
              const int32_t j = tp.pidx[k];
              m2[j] = std::max(m2[j], z[j]);
              ++c2[j];
            }
          }
          for (int64_t r = 0; r < mi; ++r) {
            const A* z = Z.data() + r * JT;
            for (int64_t j = 0; j < nj; ++j) e[j] = z[j] - m1[j];
            vexp_inplace(e.data(), nj);
#pragma omp simd
            for (int64_t j = 0; j < nj; ++j) s1[j] += e[j];
            for (int32_t k = tp.pst[r]; k < tp.pst[r + 1]; ++k) {
              const int32_t j = tp.pidx[k];
              s2[j] += mp::vexp(z[j] - m2[j]);
            }
          }
          for (int64_t j = 0; j < nj; ++j) {
            const int64_t id = row_of(j0 + j);
            if (id >= i0 && id < i0 + mi) tdg[l * JT + j] = Z[(id - i0) * JT + j];
          }
        }
        if (cols) {
          locks.lock(jb);
          for (int64_t l = 0; l < K; ++l)
            for (int64_t j = 0; j < nj; ++j) {
              const size_t g = (size_t)(l * Bd + j0 + j), x = (size_t)(l * JT + j);
              lse_merge(cm[g], cs[g], tm[x], ts[x]);
              lse_merge(cpm[g], cps[g], tpm[x], tps[x]);
              ccnt[g] += tc[x];
              if (row_of(j0 + j) >= i0 && row_of(j0 + j) < i0 + mi) cdiag[g] = tdg[x];
            }
          locks.unlock(jb);
        }
      }
      for (int64_t nb = 0; nb < nNB; ++nb) {
        const int64_t k0 = nb * JT, nk = std::min(JT, N - k0);
        for (int64_t r = 0; r < mi; ++r) std::fill(G.data() + r * JT, G.data() + r * JT + nk, A(0));
        for (int64_t l = 0; l < K; ++l) {
          seg_acc(i0, mi, npan.data() + k0 * H, nk, seg[l], seg[l + 1], G.data());
          for (int64_t r = 0; r < mi; ++r) {
            const int64_t x = l * IT + r;
            A* z = gif ? zb.data() + zlog(nJB + nb, l, r) : Z.data() + r * JT;
            scale_lse(G.data() + r * JT, it * rho[l * Bq + i0 + r], kneg + l * N + k0, z, nk, rm[x], rsum[x]);
          }
        }
      }
      for (int64_t l = 0; l < K; ++l)
        for (int64_t r = 0; r < mi; ++r) {
          const int64_t i = i0 + r, x = l * IT + r;
          A* st = rs + l * 3 * Bq;
          st[i] = rm[x] + std::log(rsum[x]);
          const bool fb = rcnt[x] == 0;
          st[Bq + i] = fb ? rdiag[x] : rpm[x] + std::log(rps[x]);
          st[2 * Bq + i] = fb ? A(1) : A(0);
        }
      if (sc) grad_rows_from_logits(gs, *sc, i0, mi, zb.data());
    }
  }
  if (gif && gs.any) finish_norms(gs);

  A* cst = static_cast<A*>(p.col_stats);
  A* lv = static_cast<A*>(p.levels);
  double loss = 0.0;
  for (int64_t l = 0; l < K; ++l) {
    const A* st = rs + l * 3 * Bq;
    double lr = 0.0, lc = 0.0;
    for (int64_t i = 0; i < Bq; ++i) lr += (double)st[i] - (double)st[Bq + i];
    if (cols) {
      A* ct = cst + l * 3 * Bd;
      for (int64_t j = 0; j < Bd; ++j) {
        const size_t g = (size_t)(l * Bd + j);
        ct[j] = cm[g] + std::log(cs[g]);
        const int64_t id = row_of(j);
        const bool rfb = id >= 0 && id < Bq && (p.row_none ? p.row_none[id] != 0 : st[2 * Bq + id] != A(0));
        const bool fb = ccnt[g] == 0;
        A lpos = fb ? cdiag[g] : cpm[g] + std::log(cps[g]);
        if (!fb && rfb) {
          const A hi = std::max(lpos, cdiag[g]), lo = std::min(lpos, cdiag[g]);
          lpos = hi + std::log1p(std::exp(lo - hi));
        }
        ct[Bd + j] = lpos;
        ct[2 * Bd + j] = (fb || rfb) ? A(1) : A(0);
        lc += (double)ct[j] - (double)ct[Bd + j];
      }
    }
    double level = 0.0;
    if (p.row_weight != 0.0 && Bq) level += p.row_weight * lr / (double)Bq;
    if (cols && Bd) level += p.col_weight * lc / (double)Bd;
    lv[l] = (A)level;
    if (p.coef[l] != 0.0) loss += p.coef[l] * level;
  }
  *static_cast<A*>(p.loss) = (A)loss;
}

template <typename A>
void Pass<A>::bwd() {
  GradState gs(*this, p.coef);
  if (!gs.any) return;
  const std::vector<int64_t>& seg = p.seg;
#pragma omp parallel if (nIB > 1)
  {
    Scratch sc(K, H);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ib = 0; ib < nIB; ++ib) {
      const int64_t i0 = ib * itr, mi = std::min(itr, Bq - i0);
      std::fill(sc.usum.begin(), sc.usum.end(), A(0));
      pack_strips(q + i0 * p.ldq, p.ldq, mi, H, sc.qs.data());
      const int64_t jstart = stagger(ib, nJB);
      for (int64_t t = 0; t < nJB; ++t) {
        const int64_t jb = (jstart + t) % nJB, j0 = jb * JT, nj = std::min(JT, Bd - j0);
        for (int64_t r = 0; r < mi; ++r) std::fill(sc.G.data() + r * JT, sc.G.data() + r * JT + nj, A(0));
        std::fill(sc.tcol.begin(), sc.tcol.end(), A(0));
        sc.tp.build(mi, nj, p.q_lo + i0, p.q_hi + i0, p.d_lo + j0, p.d_hi + j0);
        for (int64_t l = 0; l < K; ++l) {
          seg_acc(i0, mi, dpan.data() + j0 * H, nj, seg[l], seg[l + 1], sc.G.data());
          if (!gs.nz[l]) continue;
          coef_tile(gs, sc, l, i0, mi, j0, nj, false, sc.G.data(), JT, true, sc.Hs.data() + l * IT * JT);
        }
        finish_panel(gs, sc, i0, mi, j0, nj, jb, false);
      }
      for (int64_t nb = 0; gs.rows_on && nb < nNB; ++nb) {
        const int64_t k0 = nb * JT, nk = std::min(JT, N - k0);
        for (int64_t r = 0; r < mi; ++r) std::fill(sc.G.data() + r * JT, sc.G.data() + r * JT + nk, A(0));
        std::fill(sc.tcol.begin(), sc.tcol.end(), A(0));
        for (int64_t l = 0; l < K; ++l) {
          seg_acc(i0, mi, npan.data() + k0 * H, nk, seg[l], seg[l + 1], sc.G.data());
          if (!gs.nz[l]) continue;
          coef_tile(gs, sc, l, i0, mi, k0, nk, true, sc.G.data(), JT, true, sc.Hs.data() + l * IT * JT);
        }
        finish_panel(gs, sc, i0, mi, k0, nk, nb, true);
      }
      finish_rows(sc, i0, mi);
    }
  }
  finish_norms(gs);
}

}  // namespace

void matryoshka_infonce_fwd_cpu(const MatryoshkaParams& p) {
  if (p.dtype == DType::F32) Pass<float>(p).fwd();
  else if (p.dtype == DType::F64) Pass<double>(p).fwd();
  else fail("matryoshka_infonce CPU kernels take float32 or float64 (the wrapper upcasts halves)");
}

void matryoshka_infonce_bwd_cpu(const MatryoshkaParams& p) {
  if (p.dtype == DType::F32) Pass<float>(p).bwd();
  else if (p.dtype == DType::F64) Pass<double>(p).bwd();
  else fail("matryoshka_infonce CPU kernels take float32 or float64 (the wrapper upcasts halves)");
}

}  // namespace tk
