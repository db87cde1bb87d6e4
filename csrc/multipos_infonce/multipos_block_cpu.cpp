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

}  // namespace tk
