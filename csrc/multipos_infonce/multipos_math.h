// Per-tile log-sum-exp bookkeeping and dL/ds for the multi-positive InfoNCE CPU kernels.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include "common/cpu_math.h"

namespace tk {
namespace mp {

constexpr int64_t kTile = 128;  // scratch width for batched exp: tile rows are at most this wide

// exp: tk::fast_exp (csrc/common/cpu_math.h), 0 below -87.3 (incl. -inf), saturating below
// FLT_MAX so masked-out lanes never become inf; NaN propagates.
__attribute__((always_inline)) inline float vexp(float x) { return fast_exp(x); }
inline double vexp(double x) { return std::exp(x); }

// x[0..n) = exp(x[0..n)) in place, eight lanes at a time through the explicit-vector fast_exp.
inline void vexp_inplace(float* x, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    vf16 v;
    std::memcpy(&v, x + j, sizeof v);
    v = fast_exp(v);
    std::memcpy(x + j, &v, sizeof v);
  }
#endif
  for (; j + 8 <= n; j += 8) {
    vf8 v;
    std::memcpy(&v, x + j, sizeof v);
    v = fast_exp(v);
    std::memcpy(x + j, &v, sizeof v);
  }
  for (; j < n; ++j) x[j] = vexp(x[j]);
}
inline void vexp_inplace(double* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] = std::exp(x[j]);
}

// (m, s) represents log(s) + m; merges another (m2, s2), s2 == 0 meaning empty.
template <typename A> inline void lse_merge(A& m, A& s, A m2, A s2) {
  if (s2 == A(0)) return;
  if (m2 > m) { s = s * vexp(m - m2) + s2; m = m2; }
  else s += s2 * vexp(m2 - m);
}

template <typename A> inline A row_max(const A* srow, int64_t n) {
  A mx = srow[0];
#pragma omp simd reduction(max : mx)
  for (int64_t j = 1; j < n; ++j) mx = std::max(mx, srow[j]);
  return mx;
}

// Merges the log-sum-exp of srow[0..n) into (m, s); mx = row_max(srow, n), computed by the caller.
template <typename A> inline void row_update_max(const A* srow, int64_t n, A mx, A& m, A& s) {
  if (n <= 0) return;
  A e[kTile];
  A sum = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t m = std::min<int64_t>(kTile, n - j0);
    for (int64_t j = 0; j < m; ++j) e[j] = srow[j0 + j] - mx;
    vexp_inplace(e, m);
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < m; ++j) sum += e[j];
  }
  lse_merge(m, s, mx, sum);
}

template <typename A> inline void row_update(const A* srow, int64_t n, A& m, A& s) {
  if (n <= 0) return;
  row_update_max(srow, n, row_max(srow, n), m, s);
}

// Number of columns j < n whose span [dlo[j], dhi[j]] overlaps [qlo, qhi] (the row's positives in a tile).
inline int64_t count_pos(int64_t n, int64_t qlo, int64_t qhi, const int64_t* dlo, const int64_t* dhi) {
  int64_t c = 0;
#pragma omp simd reduction(+ : c)
  for (int64_t j = 0; j < n; ++j) c += std::max(qlo, dlo[j]) <= std::min(qhi, dhi[j]);
  return c;
}

template <typename A>
inline void pos_row_update(const A* srow, int64_t n, int64_t qlo, int64_t qhi, const int64_t* dlo, const int64_t* dhi,
                           A& m, A& s, int64_t& cnt) {
  A mx = -std::numeric_limits<A>::infinity();
  int64_t c = 0;
#pragma omp simd reduction(+ : c) reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) {
    const bool pos = std::max(qlo, dlo[j]) <= std::min(qhi, dhi[j]);
    c += pos;
    mx = pos ? std::max(mx, srow[j]) : mx;
  }
  if (!c) return;
  A e[kTile];
  for (int64_t j = 0; j < n; ++j) e[j] = srow[j] - mx;
  vexp_inplace(e, n);
  A sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const bool pos = std::max(qlo, dlo[j]) <= std::min(qhi, dhi[j]);
    sum += pos ? e[j] : A(0);
  }
  lse_merge(m, s, mx, sum);
  cnt += c;
}

// Column statistics of one tile S (mi x nj, row stride ld): all-LSE (tm, ts), positive LSE (tpm, tps), count.
template <typename A>
inline void col_tile_stats(const A* S, int64_t ld, int64_t mi, int64_t nj, const int64_t* qlo, const int64_t* qhi,
                           const int64_t* dlo, const int64_t* dhi, A* tm, A* ts, A* tpm, A* tps, int64_t* tc,
                           bool any_pos = true) {
  const A ninf = -std::numeric_limits<A>::infinity();
  std::fill(tm, tm + nj, ninf);
  std::fill(tpm, tpm + nj, ninf);
  std::fill(ts, ts + nj, A(0));
  std::fill(tps, tps + nj, A(0));
  std::fill(tc, tc + nj, 0);
  if (!any_pos) {  // the caller knows the tile has no positive pair: no span tests
    for (int64_t r = 0; r < mi; ++r) {
      const A* s = S + r * ld;
#pragma omp simd
      for (int64_t j = 0; j < nj; ++j) tm[j] = std::max(tm[j], s[j]);
    }
    for (int64_t r = 0; r < mi; ++r) {
      const A* s = S + r * ld;
      A e1[kTile];
      for (int64_t j = 0; j < nj; ++j) e1[j] = s[j] - tm[j];
      vexp_inplace(e1, nj);
#pragma omp simd
      for (int64_t j = 0; j < nj; ++j) ts[j] += e1[j];
    }
    return;
  }
  for (int64_t r = 0; r < mi; ++r) {
    const A* s = S + r * ld;
    const int64_t lo = qlo[r], hi = qhi[r];
#pragma omp simd
    for (int64_t j = 0; j < nj; ++j) {
      const bool pos = std::max(lo, dlo[j]) <= std::min(hi, dhi[j]);
      tm[j] = std::max(tm[j], s[j]);
      tpm[j] = pos ? std::max(tpm[j], s[j]) : tpm[j];
      tc[j] += pos;
    }
  }
  int64_t npos = 0;
  for (int64_t j = 0; j < nj; ++j) npos += tc[j];
  for (int64_t r = 0; r < mi; ++r) {
    const A* s = S + r * ld;
    A e1[kTile];
    for (int64_t j = 0; j < nj; ++j) e1[j] = s[j] - tm[j];
    vexp_inplace(e1, nj);
#pragma omp simd
    for (int64_t j = 0; j < nj; ++j) ts[j] += e1[j];
  }
  if (!npos) return;  // no positive pair in the tile: the positive sums stay 0 (tps) and tpm -inf
  for (int64_t r = 0; r < mi; ++r) {
    const A* s = S + r * ld;
    const int64_t lo = qlo[r], hi = qhi[r];
    A e2[kTile];
    for (int64_t j = 0; j < nj; ++j) e2[j] = s[j] - tpm[j];
    vexp_inplace(e2, nj);
#pragma omp simd
    for (int64_t j = 0; j < nj; ++j) {
      const bool pos = std::max(lo, dlo[j]) <= std::min(hi, dhi[j]);
      tps[j] += pos ? e2[j] : A(0);
    }
  }
}

template <typename A, bool ROWS, bool COLS>
inline void grad_row_impl(A* srow, int64_t nj, int64_t jdiag, int64_t j0, int64_t qlo, int64_t qhi,
                          const int64_t* dlo, const int64_t* dhi, A rw, A lse, A lsep, bool fb, A cw,
                          const A* cst, int64_t Bd) {
  A ea[kTile], ep[kTile], ca[kTile], cp[kTile];
  // The positive probabilities (ep, cp) only enter on positive pairs and the diagonal fallback: a row
  // segment without any (nearly all of them: positives are sparse) skips their exps.
  int64_t npos = 0;
#pragma omp simd reduction(+ : npos)
  for (int64_t j = 0; j < nj; ++j) npos += std::max(qlo, dlo[j0 + j]) <= std::min(qhi, dhi[j0 + j]);
  const bool diag_in = jdiag >= j0 && jdiag < j0 + nj;
  if (!npos && !(diag_in && ((ROWS && fb) || (COLS && cst[2 * Bd + jdiag] != A(0))))) {
    if constexpr (ROWS) {
      for (int64_t j = 0; j < nj; ++j) ea[j] = srow[j] - lse;
      vexp_inplace(ea, nj);
    }
    if constexpr (COLS) {
      for (int64_t j = 0; j < nj; ++j) ca[j] = srow[j] - cst[j0 + j];
      vexp_inplace(ca, nj);
    }
#pragma omp simd
    for (int64_t j = 0; j < nj; ++j) {
      A g = 0;
      if constexpr (ROWS) g = rw * ea[j];
      if constexpr (COLS) g += cw * ca[j];
      srow[j] = g;
    }
    return;
  }
  for (int64_t j = 0; j < nj; ++j) {
    if constexpr (ROWS) {
      ea[j] = srow[j] - lse;
      ep[j] = srow[j] - lsep;
    }
    if constexpr (COLS) {
      ca[j] = srow[j] - cst[j0 + j];
      cp[j] = srow[j] - cst[Bd + j0 + j];
    }
  }
  if constexpr (ROWS) {
    vexp_inplace(ea, nj);
    vexp_inplace(ep, nj);
  }
  if constexpr (COLS) {
    vexp_inplace(ca, nj);
    vexp_inplace(cp, nj);
  }
#pragma omp simd
  for (int64_t j = 0; j < nj; ++j) {
    const int64_t jj = j0 + j;
    const bool pos = std::max(qlo, dlo[jj]) <= std::min(qhi, dhi[jj]);
    const bool is_diag = jj == jdiag;
    A g = 0;
    if constexpr (ROWS) {
      const bool pr = pos | (fb & is_diag);
      g = rw * (ea[j] - (pr ? ep[j] : A(0)));
    }
    if constexpr (COLS) {
      const bool pc = pos | (is_diag & (cst[2 * Bd + jj] != A(0)));
      g += cw * (ca[j] - (pc ? cp[j] : A(0)));
    }
    srow[j] = g;
  }
}

// Overwrites srow (scores of row i vs columns j0..j0+nj) with dL/ds:
//   rw * (p_all - [j in P_i] p_pos) + cw * (q_all - [i in P'_j] q_pos)
// cst = column stats (3 x Bd) or null when the column loss is off. A weight of 0 switches its term off
// entirely: its stats may be undefined (partial losses of CTDLoss(gather=True)).
template <typename A>
inline void grad_row(A* srow, int64_t nj, int64_t jd, int64_t j0, int64_t qlo, int64_t qhi,
                     const int64_t* dlo, const int64_t* dhi, A rw, A lse, A lsep, bool fb, A cw, const A* cst,
                     int64_t Bd) {  // jd: the column holding row i's diagonal (fallback positive)
  const bool rows = rw != A(0);
  if (rows && cst) grad_row_impl<A, true, true>(srow, nj, jd, j0, qlo, qhi, dlo, dhi, rw, lse, lsep, fb, cw, cst, Bd);
  else if (rows) grad_row_impl<A, true, false>(srow, nj, jd, j0, qlo, qhi, dlo, dhi, rw, lse, lsep, fb, cw, cst, Bd);
  else if (cst) grad_row_impl<A, false, true>(srow, nj, jd, j0, qlo, qhi, dlo, dhi, rw, lse, lsep, fb, cw, cst, Bd);
  else std::fill(srow, srow + nj, A(0));
}

// Extra negatives only enter the row denominators: dL/de = rw * exp(e - lse).
template <typename A> inline void grad_neg_row(A* srow, int64_t n, A rw, A lse) {
  for (int64_t j = 0; j < n; ++j) srow[j] -= lse;
  vexp_inplace(srow, n);
  for (int64_t j = 0; j < n; ++j) srow[j] *= rw;
}

}  // namespace mp
}  // namespace tk
