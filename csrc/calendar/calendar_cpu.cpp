// CPU kernels for the soft-calendar ops: one row per OpenMP iteration, softmax
// and its use fused so the probabilities never leave a thread-local buffer.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include "calendar/calendar.h"

namespace tk {
namespace {

// Writes softmax(x * inv_tau) into p[0..n) and returns nothing; A is the accumulation type.
template <typename T, typename A>
inline void row_softmax(const T* x, int64_t n, A inv_tau, A* p) {
  A m = -std::numeric_limits<A>::infinity();
  for (int64_t c = 0; c < n; ++c) { p[c] = load(x, c) * inv_tau; m = std::max(m, p[c]); }
  A s = 0;
  for (int64_t c = 0; c < n; ++c) { p[c] = std::exp(p[c] - m); s += p[c]; }
  const A inv = A(1) / s;
  for (int64_t c = 0; c < n; ++c) p[c] *= inv;
}

int64_t max_levels_n(const CalendarParams& p) {
  int64_t n = 1;
  for (int l = 0; l < p.num_levels; ++l) n = std::max(n, p.levels[l].n);
  return n;
}

template <typename T>
void scalar_fwd(const CalendarParams& p) {
  using A = typename Acc<T>::type;
  const int64_t nmax = max_levels_n(p);
  A* out = static_cast<A*>(p.out);
#pragma omp parallel
  {
    std::vector<A> buf(nmax);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p.B; ++b) {
      A u = p.accumulate ? out[b] : A(0);
      for (int l = 0; l < p.num_levels; ++l) {
        const auto& L = p.levels[l];
        row_softmax(static_cast<const T*>(L.logits) + b * L.row_stride, L.n, (A)p.inv_tau, buf.data());
        A e = 0;
        for (int64_t c = 0; c < L.n; ++c) e += (A)c * buf[c];
        u += (A)L.weight * e;
      }
      out[b] = u;
    }
  }
}

template <typename T>
void scalar_bwd(const CalendarParams& p) {
  using A = typename Acc<T>::type;
  const int64_t nmax = max_levels_n(p);
  const A* g = static_cast<const A*>(p.grad_out);
#pragma omp parallel
  {
    std::vector<A> buf(nmax);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p.B; ++b) {
      for (int l = 0; l < p.num_levels; ++l) {
        const auto& L = p.levels[l];
        row_softmax(static_cast<const T*>(L.logits) + b * L.row_stride, L.n, (A)p.inv_tau, buf.data());
        A e = 0;
        for (int64_t c = 0; c < L.n; ++c) e += (A)c * buf[c];
        // d e / d logit_c = p_c (c - e) / tau
        const A k = g[b] * (A)L.weight * (A)p.inv_tau;
        T* gl = static_cast<T*>(L.grad_logits) + b * L.n;
        for (int64_t c = 0; c < L.n; ++c) store(gl, c, k * buf[c] * ((A)c - e));
      }
    }
  }
}

template <typename T>
void context_fwd(const CalendarParams& p) {
  using A = typename Acc<T>::type;
  const int64_t nmax = max_levels_n(p), D = p.dim;
#pragma omp parallel
  {
    std::vector<A> buf(nmax), acc(D);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p.B; ++b) {
      for (int l = 0; l < p.num_levels; ++l) {
        const auto& L = p.levels[l];
        const A* tab = static_cast<const A*>(L.table);
        row_softmax(static_cast<const T*>(L.logits) + b * L.row_stride, L.n, (A)p.inv_tau, buf.data());
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t c = 0; c < L.n; ++c) {
          const A pc = buf[c];
          const A* row = tab + c * D;
          for (int64_t j = 0; j < D; ++j) acc[j] += pc * row[j];
        }
        T* o = static_cast<T*>(p.out) + b * p.out_row_stride + L.out_col;
        for (int64_t j = 0; j < D; ++j) store(o, j, acc[j]);
      }
    }
  }
}

template <typename T>
void context_bwd(const CalendarParams& p) {
  using A = typename Acc<T>::type;
  const int64_t nmax = max_levels_n(p), D = p.dim;
#pragma omp parallel
  {
    std::vector<A> buf(nmax), gp(nmax), gin(D);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p.B; ++b) {
      for (int l = 0; l < p.num_levels; ++l) {
        const auto& L = p.levels[l];
        const A* tab = static_cast<const A*>(L.table);
        const T* go = static_cast<const T*>(p.grad_out) + b * p.out_row_stride + L.out_col;
        for (int64_t j = 0; j < D; ++j) gin[j] = load(go, j);
        row_softmax(static_cast<const T*>(L.logits) + b * L.row_stride, L.n, (A)p.inv_tau, buf.data());
        // dL/dp_c = <g, T[c]>;  dL/dlogit_c = p_c (dL/dp_c - sum_k p_k dL/dp_k) / tau
        T* gl = static_cast<T*>(L.grad_logits) + b * L.n;
        A dot = 0;
        for (int64_t c = 0; c < L.n; ++c) {
          const A* row = tab + c * D;
          A s = 0;
          for (int64_t j = 0; j < D; ++j) s += gin[j] * row[j];
          gp[c] = s;
          dot += buf[c] * s;
        }
        for (int64_t c = 0; c < L.n; ++c) store(gl, c, buf[c] * (gp[c] - dot) * (A)p.inv_tau);
      }
    }
  }
}

}  // namespace

void calendar_scalar_fwd_cpu(const CalendarParams& p) { dispatch_float(p.dtype, [&](auto t) { scalar_fwd<decltype(t)>(p); }); }
void calendar_scalar_bwd_cpu(const CalendarParams& p) { dispatch_float(p.dtype, [&](auto t) { scalar_bwd<decltype(t)>(p); }); }
void calendar_context_fwd_cpu(const CalendarParams& p) { dispatch_float(p.dtype, [&](auto t) { context_fwd<decltype(t)>(p); }); }
void calendar_context_bwd_cpu(const CalendarParams& p) { dispatch_float(p.dtype, [&](auto t) { context_bwd<decltype(t)>(p); }); }

}  // namespace tk
