// CPU kernels for the soft-calendar ops. Rows are processed in blocks of kRows,
// transposed into a (n, kRows) tile so softmax, exp and the expectations vectorise
// across rows with full vector width (levels are short: 12, 32 classes).
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>
#include "calendar/calendar.h"
#include "common/cpu_math.h"

namespace tk {
namespace {

constexpr int kRows = 16;

// P[c*kRows + r] = softmax(x_r * inv_tau)[c] for rows r < R of the block (other lanes hold finite junk).
template <typename T, typename A>
inline void block_softmax(const T* x, int64_t stride, int R, int64_t n, A inv_tau, A* P) {
  for (int r = 0; r < kRows; ++r) {
    const T* xr = x + (int64_t)std::min(r, R - 1) * stride;  // tail rows repeat the last valid row
    for (int64_t c = 0; c < n; ++c) P[c * kRows + r] = load(xr, c) * inv_tau;
  }
  if constexpr (std::is_same<A, float>::value) {
    constexpr int kV = kRows / 8;  // vf8 registers per row block
    vf8 m[kV], s[kV];
    for (int h = 0; h < kV; ++h) { m[h] = vf8{} - std::numeric_limits<float>::infinity(); s[h] = vf8{}; }
    auto at = [&](int64_t c, int h) { return P + c * kRows + 8 * h; };
    for (int64_t c = 0; c < n; ++c)
      for (int h = 0; h < kV; ++h) {
        vf8 v;
        std::memcpy(&v, at(c, h), sizeof v);
        m[h] = v > m[h] ? v : m[h];
      }
    for (int64_t c = 0; c < n; ++c)
      for (int h = 0; h < kV; ++h) {
        vf8 v;
        std::memcpy(&v, at(c, h), sizeof v);
        v = fast_exp(v - m[h]);
        s[h] += v;
        std::memcpy(at(c, h), &v, sizeof v);
      }
    for (int h = 0; h < kV; ++h) s[h] = 1.0f / s[h];
    for (int64_t c = 0; c < n; ++c)
      for (int h = 0; h < kV; ++h) {
        vf8 v;
        std::memcpy(&v, at(c, h), sizeof v);
        v *= s[h];
        std::memcpy(at(c, h), &v, sizeof v);
      }
  } else {
    A m[kRows], s[kRows];
    for (int r = 0; r < kRows; ++r) { m[r] = -std::numeric_limits<A>::infinity(); s[r] = 0; }
    for (int64_t c = 0; c < n; ++c)
      for (int r = 0; r < kRows; ++r) m[r] = std::max(m[r], P[c * kRows + r]);
    for (int64_t c = 0; c < n; ++c)
      for (int r = 0; r < kRows; ++r) { P[c * kRows + r] = std::exp(P[c * kRows + r] - m[r]); s[r] += P[c * kRows + r]; }
    for (int64_t c = 0; c < n; ++c)
      for (int r = 0; r < kRows; ++r) P[c * kRows + r] /= s[r];
  }
}

// e[r] = sum_c c * P[c][r]
template <typename A>
inline void block_expectation(const A* P, int64_t n, A* e) {
  for (int r = 0; r < kRows; ++r) e[r] = 0;
  for (int64_t c = 0; c < n; ++c) {
    const A* pc = P + c * kRows;
#pragma omp simd
    for (int r = 0; r < kRows; ++r) e[r] += (A)c * pc[r];
  }
}

int64_t max_levels_n(const CalendarParams& p) {
  int64_t n = 1;
  for (int l = 0; l < p.num_levels; ++l) n = std::max(n, p.levels[l].n);
  return n;
}

template <typename Body>
inline void for_row_blocks(int64_t B, Body&& body) {
  const int64_t nblocks = (B + kRows - 1) / kRows;
#pragma omp for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t b0 = blk * kRows;
    body(b0, (int)std::min<int64_t>(kRows, B - b0));
  }
}

template <typename T>
void scalar_fwd(const CalendarParams& p) {
  using A = typename Acc<T>::type;
  const int64_t nmax = max_levels_n(p);
  A* out = static_cast<A*>(p.out);
#pragma omp parallel
  {
    std::vector<A> P(nmax * kRows);
    for_row_blocks(p.B, [&](int64_t b0, int R) {
      A u[kRows], e[kRows];
      for (int r = 0; r < kRows; ++r) u[r] = (p.accumulate && r < R) ? out[b0 + r] : A(0);
      for (int l = 0; l < p.num_levels; ++l) {
        const auto& L = p.levels[l];
        block_softmax(static_cast<const T*>(L.logits) + b0 * L.row_stride, L.row_stride, R, L.n, (A)p.inv_tau, P.data());
        block_expectation(P.data(), L.n, e);
        for (int r = 0; r < kRows; ++r) u[r] += (A)L.weight * e[r];
      }
      for (int r = 0; r < R; ++r) out[b0 + r] = u[r];
    });
  }
}

template <typename T>
void scalar_bwd(const CalendarParams& p) {
  using A = typename Acc<T>::type;
  const int64_t nmax = max_levels_n(p);
  const A* g = static_cast<const A*>(p.grad_out);
#pragma omp parallel
  {
    std::vector<A> P(nmax * kRows);
    for_row_blocks(p.B, [&](int64_t b0, int R) {
      A e[kRows], k[kRows];
      for (int l = 0; l < p.num_levels; ++l) {
        const auto& L = p.levels[l];
        block_softmax(static_cast<const T*>(L.logits) + b0 * L.row_stride, L.row_stride, R, L.n, (A)p.inv_tau, P.data());
        block_expectation(P.data(), L.n, e);
        // d e / d logit_c = p_c (c - e) / tau
        for (int r = 0; r < kRows; ++r) k[r] = (r < R ? g[b0 + r] : A(0)) * (A)L.weight * (A)p.inv_tau;
        for (int64_t c = 0; c < L.n; ++c) {
          A* pc = P.data() + c * kRows;
#pragma omp simd
          for (int r = 0; r < kRows; ++r) pc[r] = k[r] * pc[r] * ((A)c - e[r]);
        }
        T* gl = static_cast<T*>(L.grad_logits) + b0 * L.n;
        for (int r = 0; r < R; ++r)
          for (int64_t c = 0; c < L.n; ++c) store(gl + r * L.n, c, P[c * kRows + r]);
      }
    });
  }
}

inline int64_t pad16(int64_t x) { return (x + 15) / 16 * 16; }

// Zero-padded copies of each level's table for gemm16: T (n, pad16(dim)) for the forward,
// T^T (pad16(dim), pad16(n)) for the backward. Tiny (n x dim), built once per call.
template <typename A>
struct PaddedTables {
  std::vector<std::vector<A>> fwd, bwd;
  PaddedTables(const CalendarParams& p, bool transpose) {
    const int64_t D = p.dim, Dp = pad16(D);
    for (int l = 0; l < p.num_levels; ++l) {
      const auto& L = p.levels[l];
      const A* t = static_cast<const A*>(L.table);
      const int64_t np = pad16(L.n);
      std::vector<A> v(transpose ? Dp * np : L.n * Dp, A(0));
      for (int64_t c = 0; c < L.n; ++c)
        for (int64_t j = 0; j < D; ++j) (transpose ? v[j * np + c] : v[c * Dp + j]) = t[c * D + j];
      (transpose ? bwd : fwd).push_back(std::move(v));
    }
  }
};

template <typename T>
void context_fwd(const CalendarParams& p) {
  using A = typename Acc<T>::type;
  const int64_t nmax = max_levels_n(p), D = p.dim, Dp = pad16(D);
  const PaddedTables<A> tabs(p, false);
#pragma omp parallel
  {
    std::vector<A> P(nmax * kRows), acc(kRows * Dp);
    for_row_blocks(p.B, [&](int64_t b0, int R) {
      for (int l = 0; l < p.num_levels; ++l) {
        const auto& L = p.levels[l];
        block_softmax(static_cast<const T*>(L.logits) + b0 * L.row_stride, L.row_stride, R, L.n, (A)p.inv_tau, P.data());
        // (kRows x n) probabilities @ (n x D) table, as one register-blocked tile product
        gemm16(L.n, Dp, P.data(), 1, kRows, tabs.fwd[l].data(), Dp, acc.data(), Dp);
        for (int r = 0; r < R; ++r) {
          T* o = static_cast<T*>(p.out) + (b0 + r) * p.out_row_stride + L.out_col;
          const A* a = acc.data() + r * Dp;
          for (int64_t j = 0; j < D; ++j) store(o, j, a[j]);
        }
      }
    });
  }
}

template <typename T>
void context_bwd(const CalendarParams& p) {
  using A = typename Acc<T>::type;
  const int64_t nmax = max_levels_n(p), D = p.dim, Dp = pad16(D), npmax = pad16(nmax);
  const PaddedTables<A> tabs(p, true);
#pragma omp parallel
  {
    std::vector<A> P(nmax * kRows), G(kRows * Dp, A(0)), gp(kRows * npmax);
    for_row_blocks(p.B, [&](int64_t b0, int R) {
      for (int l = 0; l < p.num_levels; ++l) {
        const auto& L = p.levels[l];
        const int64_t np = pad16(L.n);
        for (int r = 0; r < kRows; ++r) {
          A* gr = G.data() + r * Dp;
          if (r < R) {
            const T* go = static_cast<const T*>(p.grad_out) + (b0 + r) * p.out_row_stride + L.out_col * p.grad_col_stride;
            for (int64_t j = 0; j < D; ++j) gr[j] = load(go, j * p.grad_col_stride);
          } else {
            std::fill(gr, gr + D, A(0));
          }
        }
        block_softmax(static_cast<const T*>(L.logits) + b0 * L.row_stride, L.row_stride, R, L.n, (A)p.inv_tau, P.data());
        // dL/dp[r, c] = <g_r, T[c]>: (kRows x D) @ (D x n)
        gemm16(D, np, G.data(), Dp, 1, tabs.bwd[l].data(), np, gp.data(), np);
        // dL/dlogit_c = p_c (dL/dp_c - sum_k p_k dL/dp_k) / tau
        for (int r = 0; r < R; ++r) {
          const A* g = gp.data() + r * np;
          A dot = 0;
          for (int64_t c = 0; c < L.n; ++c) dot += P[c * kRows + r] * g[c];
          T* gl = static_cast<T*>(L.grad_logits) + (b0 + r) * L.n;
          for (int64_t c = 0; c < L.n; ++c) store(gl, c, P[c * kRows + r] * (g[c] - dot) * (A)p.inv_tau);
        }
      }
    });
  }
}

}  // namespace

void calendar_scalar_fwd_cpu(const CalendarParams& p) { dispatch_float(p.dtype, [&](auto t) { scalar_fwd<decltype(t)>(p); }); }
void calendar_scalar_bwd_cpu(const CalendarParams& p) { dispatch_float(p.dtype, [&](auto t) { scalar_bwd<decltype(t)>(p); }); }
void calendar_context_fwd_cpu(const CalendarParams& p) { dispatch_float(p.dtype, [&](auto t) { context_fwd<decltype(t)>(p); }); }
void calendar_context_bwd_cpu(const CalendarParams& p) { dispatch_float(p.dtype, [&](auto t) { context_bwd<decltype(t)>(p); }); }

}  // namespace tk
