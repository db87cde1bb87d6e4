// Per-tile log-sum-exp bookkeeping and dL/ds for the multi-positive InfoNCE CPU kernels.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace tk {
namespace mp {

// exp for float that GCC vectorises (Cephes expf polynomial, ~1 ulp on the reduced range);
// 0 below -87.3 (incl. -inf), clamped at 88.3 so masked-out lanes can never become inf.
inline float vexp(float x) {
  x = std::min(x, 88.3762626647949f);
  const bool under = !(x >= -87.3365478515625f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float sc;
  std::memcpy(&sc, &bits, 4);
  return under ? 0.f : y * sc;
}
inline double vexp(double x) { return std::exp(x); }

// (m, s) represents log(s) + m; merges another (m2, s2), s2 == 0 meaning empty.
template <typename A> inline void lse_merge(A& m, A& s, A m2, A s2) {
  if (s2 == A(0)) return;
  if (m2 > m) { s = s * vexp(m - m2) + s2; m = m2; }
  else s += s2 * vexp(m2 - m);
}

template <typename A> inline void row_update(const A* srow, int64_t n, A& m, A& s) {
  if (n <= 0) return;
  A mx = srow[0];
  for (int64_t j = 1; j < n; ++j) mx = std::max(mx, srow[j]);
  A sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += vexp(srow[j] - mx);
  lse_merge(m, s, mx, sum);
}

template <typename A>
inline void pos_row_update(const A* srow, int64_t n, int64_t qlo, int64_t qhi, const int64_t* dlo, const int64_t* dhi,
                           A& m, A& s, int64_t& cnt) {
  A mx = -std::numeric_limits<A>::infinity();
  int64_t c = 0;
  for (int64_t j = 0; j < n; ++j) {
    const bool pos = std::max(qlo, dlo[j]) <= std::min(qhi, dhi[j]);
    c += pos;
    mx = pos ? std::max(mx, srow[j]) : mx;
  }
  if (!c) return;
  A sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const bool pos = std::max(qlo, dlo[j]) <= std::min(qhi, dhi[j]);
    const A e = vexp(srow[j] - mx);
    sum += pos ? e : A(0);
  }
  lse_merge(m, s, mx, sum);
  cnt += c;
}

// Column statistics of one tile S (mi x nj, row stride ld): all-LSE (tm, ts), positive LSE (tpm, tps), count.
template <typename A>
inline void col_tile_stats(const A* S, int64_t ld, int64_t mi, int64_t nj, const int64_t* qlo, const int64_t* qhi,
                           const int64_t* dlo, const int64_t* dhi, A* tm, A* ts, A* tpm, A* tps, int64_t* tc) {
  const A ninf = -std::numeric_limits<A>::infinity();
  std::fill(tm, tm + nj, ninf);
  std::fill(tpm, tpm + nj, ninf);
  std::fill(ts, ts + nj, A(0));
  std::fill(tps, tps + nj, A(0));
  std::fill(tc, tc + nj, 0);
  for (int64_t r = 0; r < mi; ++r) {
    const A* s = S + r * ld;
    const int64_t lo = qlo[r], hi = qhi[r];
    for (int64_t j = 0; j < nj; ++j) {
      const bool pos = std::max(lo, dlo[j]) <= std::min(hi, dhi[j]);
      tm[j] = std::max(tm[j], s[j]);
      tpm[j] = pos ? std::max(tpm[j], s[j]) : tpm[j];
      tc[j] += pos;
    }
  }
  for (int64_t r = 0; r < mi; ++r) {
    const A* s = S + r * ld;
    const int64_t lo = qlo[r], hi = qhi[r];
    for (int64_t j = 0; j < nj; ++j) {
      const bool pos = std::max(lo, dlo[j]) <= std::min(hi, dhi[j]);
      ts[j] += vexp(s[j] - tm[j]);
      const A e = vexp(s[j] - tpm[j]);
      tps[j] += pos ? e : A(0);
    }
  }
}

// Overwrites srow (scores of row i vs columns j0..j0+nj) with dL/ds:
//   rw * (p_all - [j in P_i] p_pos) + cw * (q_all - [i in P'_j] q_pos)
// cst = column stats (3 x Bd) or null when the column loss is off.
template <typename A>
inline void grad_row(A* srow, int64_t nj, int64_t i, int64_t j0, int64_t off, int64_t qlo, int64_t qhi,
                     const int64_t* dlo, const int64_t* dhi, A rw, A lse, A lsep, bool fb, A cw, const A* cst,
                     int64_t Bd) {
  const int64_t jdiag = i + off;  // column holding row i's diagonal
  // A weight of 0 switches its term off entirely: its stats may be undefined (e.g. partial losses).
  const bool rows = rw != A(0);
  if (!rows && !cst) {
    std::fill(srow, srow + nj, A(0));
    return;
  }
  for (int64_t j = 0; j < nj; ++j) {
    const int64_t jj = j0 + j;
    const A s = srow[j];
    const bool pos = std::max(qlo, dlo[jj]) <= std::min(qhi, dhi[jj]);
    const bool is_diag = jj == jdiag;
    A g = 0;
    if (rows) {
      const bool pr = pos || (fb && is_diag);
      const A ep = vexp(s - lsep);
      g = rw * (vexp(s - lse) - (pr ? ep : A(0)));
    }
    if (cst) {
      const bool pc = pos || (is_diag && cst[2 * Bd + jj] != A(0));
      const A ecp = vexp(s - cst[Bd + jj]);
      g += cw * (vexp(s - cst[jj]) - (pc ? ecp : A(0)));
    }
    srow[j] = g;
  }
}

// Extra negatives only enter the row denominators: dL/de = rw * exp(e - lse).
template <typename A> inline void grad_neg_row(A* srow, int64_t n, A rw, A lse) {
  for (int64_t j = 0; j < n; ++j) srow[j] = rw * vexp(srow[j] - lse);
}

}  // namespace mp
}  // namespace tk
