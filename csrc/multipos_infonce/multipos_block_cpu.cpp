// CPU passes of the blocked multi-positive InfoNCE (multipos_block.h). Used on CPU for the table mode of
// the bias; rows are split into nrt chunks (one OpenMP task each): a chunk keeps its own column statistics,
// dL/du_d partials and table histogram, so no two threads write the same number.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>
#include "multipos_infonce/multipos_block.h"

namespace tk {
namespace {

template <typename A> inline void online_add(A& m, A& s, A x) {
  if (x > m) {
    s = s * std::exp(m - x) + A(1);
    m = x;
  } else {
    s += std::exp(x - m);
  }
}

template <typename A> inline A lse_of(A m, A s) {
  return s > A(0) ? m + std::log(s) : (s == s ? -std::numeric_limits<A>::infinity() : s);
}

template <typename A> struct Pair {
  A x, slope, t;
  int64_t idx;
  bool pr, pc;
};

// x, positives and the table's bin for (row r of the block, column j): the same arithmetic as the CUDA
// kernel and tempokern.reference.offset_bias_lookup.
template <typename A> inline Pair<A> pair_at(const MultiposBlockParams& p, int64_t r, int64_t j) {
  const int64_t i = p.i0 + r;
  Pair<A> e{static_cast<const A*>(p.S)[r * p.lds + j] * (A)p.inv_temp, A(0), A(0), 0, false, false};
  if (p.bias_mode == 1) {
    const A* T = static_cast<const A*>(p.table);
    const A hs = (A)(0.5 * (double)(p.P - 1));
    const A delta = static_cast<const A*>(p.u_d)[j] - static_cast<const A*>(p.u_q)[i];
    const bool in = delta >= A(-1) && delta <= A(1);
    const A dc = delta < A(-1) ? A(-1) : (delta > A(1) ? A(1) : delta);
    const A x = (dc + A(1)) * hs;
    A f = std::floor(x);
    if (!(f >= A(0))) f = A(0);
    if (f > A(p.P - 2)) f = A(p.P - 2);
    e.idx = (int64_t)f;
    e.t = x - f;
    const A v0 = T[e.idx], v1 = T[e.idx + 1];
    e.slope = in ? (v1 - v0) * hs : A(0);
    e.x += v0 + e.t * (v1 - v0);
  } else if (p.bias_mode == 2) {
    e.x += static_cast<const A*>(p.dense)[r * p.ldb + j];
  }
  if (p.pos) {
    const bool ov = std::max(p.q_lo[i], p.d_lo[j]) <= std::min(p.q_hi[i], p.d_hi[j]);
    const bool dg = j == i + p.diag_offset;
    const bool rn = p.row_none[i] != 0;
    e.pr = ov || (rn && dg);
    e.pc = ov || (dg && (rn || p.col_none[j] != 0));
  }
  return e;
}

void check(const MultiposBlockParams& p) {
  if (p.R < 0 || p.C < 0 || p.TR < 1 || p.nct != 1 || p.nrt != (p.R + p.TR - 1) / p.TR)
    throw std::runtime_error("multipos_block: inconsistent CPU tiling");
  if (p.bias_mode == 1 && p.P < 2) throw std::runtime_error("multipos_block: the table needs >= 2 points");
}

template <typename A> void fwd(const MultiposBlockParams& p) {
  const A ninf = -std::numeric_limits<A>::infinity();
  const int64_t C = p.C;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t ch = 0; ch < p.nrt; ++ch) {
    std::vector<A> cm(p.cols ? C : 0, ninf), cs(p.cols ? C : 0, A(0)), cpm(p.cols ? C : 0, ninf),
        cps(p.cols ? C : 0, A(0)), x(C);
    std::vector<uint8_t> pr(C);
    const int64_t r1 = std::min(p.R, (ch + 1) * p.TR);
    const bool hard = p.hard_idx != nullptr;
    for (int64_t r = ch * p.TR; r < r1; ++r) {
      A m = ninf, mp = ninf;
      A hv = ninf;     // hardest negative: strict > over increasing j keeps the lowest column among ties
      int64_t hj = -1;
      for (int64_t j = 0; j < C; ++j) {
        const Pair<A> e = pair_at<A>(p, r, j);
        x[j] = e.x;
        pr[j] = e.pr;
        m = std::max(m, e.x);
        if (e.pr) mp = std::max(mp, e.x);
        if (hard && !e.pr && (hj < 0 || e.x > hv)) {
          hv = e.x;
          hj = j;
        }
        if (p.cols) {
          online_add(cm[j], cs[j], e.x);
          if (e.pc) online_add(cpm[j], cps[j], e.x);
        }
      }
      A s = 0, sp = 0;
      for (int64_t j = 0; j < C; ++j) {
        if (m != ninf) s += std::exp(x[j] - m);
        if (pr[j]) sp += std::exp(x[j] - mp);
      }
      A* out = static_cast<A*>(p.row_part) + (r * p.nslots + p.slot0) * 2;
      out[0] = lse_of(m, s);
      out[1] = lse_of(mp, sp);
      if (hard) {
        static_cast<A*>(p.hard_val)[r] = hv;
        p.hard_idx[r] = hj;
      }
    }
    if (p.cols) {
      A* out = static_cast<A*>(p.col_part) + ch * C * 2;
      for (int64_t j = 0; j < C; ++j) {
        out[2 * j] = lse_of(cm[j], cs[j]);
        out[2 * j + 1] = lse_of(cpm[j], cps[j]);
      }
    }
  }
}

template <typename A> void bwd(const MultiposBlockParams& p) {
  const int64_t C = p.C;
  const bool rows = p.gr != 0.0, cols = p.cols && p.gc != 0.0, table = p.bias_mode == 1;
  const A gr = (A)p.gr, gc = (A)p.gc, it = (A)p.inv_temp;
  const A* rl = static_cast<const A*>(p.row_lse);
  const A* cl = static_cast<const A*>(p.col_lse);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t ch = 0; ch < p.nrt; ++ch) {
    std::vector<A> dud(table ? C : 0, A(0)), hist(table ? p.P : 0, A(0));
    const int64_t r1 = std::min(p.R, (ch + 1) * p.TR);
    for (int64_t r = ch * p.TR; r < r1; ++r) {
      const int64_t i = p.i0 + r;
      A duq = 0;
      for (int64_t j = 0; j < C; ++j) {
        const Pair<A> e = pair_at<A>(p, r, j);
        A g = 0;
        if (rows) g = gr * (std::exp(e.x - rl[i]) - (e.pr ? std::exp(e.x - rl[p.Bq + i]) : A(0)));
        if (cols) g += gc * (std::exp(e.x - cl[j]) - (e.pc ? std::exp(e.x - cl[C + j]) : A(0)));
        static_cast<A*>(p.dS)[r * p.ldo + j] = g * it;
        if (p.bias_mode == 2) static_cast<A*>(p.G)[r * p.ldo + j] = g;
        if (table) {
          const A dD = g * e.slope;
          dud[j] += dD;
          duq -= dD;
          hist[e.idx] += g - g * e.t;
          hist[e.idx + 1] += g * e.t;
        }
      }
      if (table) static_cast<A*>(p.duq_part)[r] = duq;
    }
    if (table) {
      A* out = static_cast<A*>(p.dud_part) + ch * C;
      for (int64_t j = 0; j < C; ++j) out[j] = dud[j];
      double* h = p.hist + ch * p.P;
      for (int64_t k = 0; k < p.P; ++k) h[k] += (double)hist[k];
    }
  }
}

}  // namespace

void multipos_block_fwd_cpu(const MultiposBlockParams& p) {
  check(p);
  if (p.adtype == DType::F64) fwd<double>(p);
  else if (p.adtype == DType::F32 && p.sdtype == DType::F32) fwd<float>(p);
  else throw std::runtime_error("multipos_block CPU: scores must be float32 or float64 like the accumulation");
}

void multipos_block_bwd_cpu(const MultiposBlockParams& p) {
  check(p);
  if (p.odtype != p.adtype || p.sdtype != p.adtype)
    throw std::runtime_error("multipos_block CPU: scores and dS must have the accumulation dtype");
  if (p.adtype == DType::F64) bwd<double>(p);
  else bwd<float>(p);
}

// ---- glue twins (CPU): the same outputs as the CUDA prep / fin kernels ----

void multipos_block_prep_cpu(const MultiposPrepParams& p) {
  const int64_t Bq = p.Bq, Bd = p.Bd;
  std::vector<int64_t> all;
  all.reserve(2 * (Bq + Bd));
  all.insert(all.end(), p.q_lo, p.q_lo + Bq);
  all.insert(all.end(), p.q_hi, p.q_hi + Bq);
  all.insert(all.end(), p.d_lo, p.d_lo + Bd);
  all.insert(all.end(), p.d_hi, p.d_hi + Bd);
  if (p.counter) *p.counter = 0u;
  for (int64_t k = 0; k < p.nzero; ++k) p.zero[k] = 0.0;
  if (all.empty()) return;
  std::vector<int64_t> sorted = all;
  std::sort(sorted.begin(), sorted.end());
  const int64_t mn = sorted.front(), mx = sorted.back();
  const bool fits = (unsigned long long)mx - (unsigned long long)mn < 2147483647ull;
  for (size_t k = 0; k < all.size(); ++k)  // shift, or rank = count of smaller bounds
    p.spans32[k] = fits ? (int32_t)(all[k] - mn)
                        : (int32_t)(std::lower_bound(sorted.begin(), sorted.end(), all[k]) - sorted.begin());
  // overlaps of [lo, hi] with a set of intervals: none iff every partner starts after hi or ends before lo
  // (with lo <= hi for every partner; an inverted partner never overlaps): counted by binary search on the
  // partners' sorted starts and ends, O((Bq + Bd) log) as torch's none_flags
  auto flags = [](const int64_t* lo, const int64_t* hi, int64_t n, const int64_t* plo, const int64_t* phi,
                  int64_t m, uint8_t* out) {
    std::vector<int64_t> s, e;
    int64_t inverted = 0;
    for (int64_t k = 0; k < m; ++k) {
      if (plo[k] > phi[k]) { ++inverted; continue; }
      s.push_back(plo[k]);
      e.push_back(phi[k]);
    }
    std::sort(s.begin(), s.end());
    std::sort(e.begin(), e.end());
    const int64_t valid = m - inverted;
    for (int64_t i = 0; i < n; ++i) {
      if (lo[i] > hi[i]) { out[i] = 1; continue; }
      const int64_t after = (int64_t)(s.end() - std::upper_bound(s.begin(), s.end(), hi[i]));
      const int64_t before = (int64_t)(std::lower_bound(e.begin(), e.end(), lo[i]) - e.begin());
      out[i] = valid - after - before == 0 ? 1 : 0;
    }
  };
  flags(p.q_lo, p.q_hi, Bq, p.d_lo, p.d_hi, Bd, p.row_none);
  flags(p.d_lo, p.d_hi, Bd, p.q_lo, p.q_hi, Bq, p.col_none);
}

namespace {
template <typename A> A lse_strided(const A* x, int64_t n, int64_t st) {  // torch.logsumexp
  A m = -std::numeric_limits<A>::infinity();
  for (int64_t k = 0; k < n; ++k) {
    const A v = x[k * st];
    if (v != v || v > m) m = v;
    if (m != m) break;
  }
  if (std::isinf(m)) m = A(0);
  A s = 0;
  for (int64_t k = 0; k < n; ++k) s += std::exp(x[k * st] - m);
  return std::log(s) + m;
}

template <typename A> A logaddexp_(A a, A b) {  // torch.logaddexp
  if (std::isinf(a) && a == b) return a;
  const A m = std::max(a, b);
  return m + std::log1p(std::exp(-std::abs(a - b)));
}

template <typename A> void fin(const MultiposFinParams& p) {
  const A* rp = static_cast<const A*>(p.row_part);
  const A* cp = static_cast<const A*>(p.col_part);
  A* rl = static_cast<A*>(p.row_lse);
  A* cl = static_cast<A*>(p.col_lse);
  for (int64_t t = 0; t < p.R; ++t) {
    const int64_t i = p.i0 + t;
    rl[i] = lse_strided<A>(rp + t * p.nslots * 2, p.nslots, 2);
    rl[p.Bq + i] = lse_strided<A>(rp + t * p.nslots * 2 + 1, p.nslots, 2);
    if (p.hardest) {
      const A* hv = static_cast<const A*>(p.hard_val) + t * p.nct;
      const int64_t* hi = p.hard_idx + t * p.nct;
      int64_t out = hi[0];
      if (p.nct > 1) {
        A best = hv[0];
        for (int64_t c = 1; c < p.nct && best == best; ++c)
          if (hv[c] != hv[c] || hv[c] > best) best = hv[c];
        out = std::numeric_limits<int64_t>::max();
        for (int64_t c = 0; c < p.nct; ++c)
          if (hv[c] == best && hi[c] >= 0 && hi[c] < out) out = hi[c];
        if (out == std::numeric_limits<int64_t>::max()) out = -1;
      }
      p.hardest[i] = out;
    }
  }
  if (p.cols)
    for (int64_t j = 0; j < p.Bd; ++j)
      for (int k = 0; k < 2; ++k) {
        const A v = lse_strided<A>(cp + j * 2 + k, p.nrt, p.Bd * 2);
        cl[k * p.Bd + j] = p.first ? v : logaddexp_<A>(cl[k * p.Bd + j], v);
      }
  if (!p.last) return;
  double tot = 0.0;
  bool any = false;
  if (p.row_weight != 0.0) {
    double s = 0.0;
    for (int64_t i = 0; i < p.Bq; ++i) s += (double)(A)(rl[i] - rl[p.Bq + i]);
    tot = s / (double)p.Bq * p.row_weight;
    any = true;
  }
  if (p.cols) {
    double s = 0.0;
    for (int64_t j = 0; j < p.Bd; ++j) s += (double)(A)(cl[j] - cl[p.Bd + j]);
    const double tc = s / (double)p.Bd * p.col_weight;
    tot = any ? tot + tc : tc;
  }
  *static_cast<A*>(p.loss) = (A)tot;
}
}  // namespace

namespace {
template <typename A> void tgrad(const MultiposTableGradParams& p) {
  for (int64_t t = 0; t < p.R; ++t) {
    const A* x = static_cast<const A*>(p.duq_part) + t * p.nct;
    A s = 0;
    for (int64_t c = 0; c < p.nct; ++c) s += x[c];
    static_cast<A*>(p.du_q)[p.i0 + t] = s;
  }
  for (int64_t j = 0; j < p.Bd; ++j) {
    double s = 0.0;
    for (int64_t r = 0; r < p.nrt; ++r) s += (double)static_cast<const A*>(p.dud_part)[r * p.Bd + j];
    const double v = p.first ? s : p.dud_acc[j] + s;
    p.dud_acc[j] = v;
    if (p.last) static_cast<A*>(p.du_d)[j] = (A)v;
  }
  if (p.last)
    for (int64_t k = 0; k < p.P; ++k) {
      double s = 0.0;
      for (int64_t h = 0; h < p.nhist; ++h) s += p.hist[h * p.P + k];
      static_cast<A*>(p.dtable)[k] = (A)s;
    }
}
}  // namespace

void multipos_block_tgrad_cpu(const MultiposTableGradParams& p) {
  if (p.adtype == DType::F64) tgrad<double>(p);
  else if (p.adtype == DType::F32) tgrad<float>(p);
  else throw std::runtime_error("multipos_block tgrad: accumulation dtype must be float32 or float64");
}

void multipos_block_fin_cpu(const MultiposFinParams& p) {
  if (p.adtype == DType::F64) fin<double>(p);
  else if (p.adtype == DType::F32) fin<float>(p);
  else throw std::runtime_error("multipos_block fin: accumulation dtype must be float32 or float64");
}

}  // namespace tk
