// CUDA passes of the blocked multi-positive InfoNCE (see multipos_block.h for the math).
//
// Layout, both kernels: a CUDA block of 256 threads owns TR rows x 1024 columns of the score block; thread t
// owns columns c0 + t + 256 k (k < 4) and walks the rows 4 at a time, so every load instruction reads 256
// consecutive elements (coalesced), 16 loads per thread in flight, and every row of dS is written the same way. Column statistics (and dL/du_d) stay in the thread's
// registers; row statistics (and dL/du_q) are reduced per warp with shuffles and combined across the 8 warps
// in shared memory every 32 rows. The grid (nct x nrt) is sized by the driver to at least 4x the SM count.
// Bytes per element: forward reads S once (4 B for float32 scores); backward reads S and writes dS once.
#include <cuda_runtime.h>
#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include "common/cuda_math.cuh"
#include "common/cuda_utils.cuh"
#include "multipos_infonce/multipos_block.h"

namespace tk {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// dexp (common/cuda_math.cuh): exp through the SFU's exp2 with the rounding of x * log2(e) compensated: t = fl(x * L), the residual
// lo = x * L - t (one fma, plus x times the part of log2(e) that L misses), exp(x) = 2^t * (1 + lo ln 2).
// About as accurate as expf (a plain ex2(x * L) loses |x| * 2^-24 relative, 4x torch's error at |x| ~ 10).
using cuda::dexp;
using cuda::dlog;
using cuda::ex2f;

template <typename A> __device__ __forceinline__ A ninf() { return -std::numeric_limits<A>::infinity(); }

// The log domain of the default statistics kernel (mpb_fwd_kernel) and of the gradient kernel: base 2 for
// float accumulation, natural for float64 (unchanged). Float: x2 = log2(e) x with log2(e) inv_temp split in
// hi + lo (computed in double) so that x2 = fma(s, hi, s lo) is rounded once, as torch's x = s * inv_temp is;
// every exp is then one SFU ex2 of the difference of two such values (no rounding compensation: ~2
// instructions instead of dexp's ~9), and every log-sum-exp leaves the kernels in natural units,
// (m2 + log2 s) ln 2. The gradient kernel's row / column log-sum-exps come in natural units and enter as
// hi + lo in base 2 (Lv), so that x2 - lse2 carries no extra rounding either.
template <typename A> struct Lg;
template <> struct Lg<float> {
  static constexpr double Kd = 1.4426950408889634074;
  static constexpr float K = 1.4426950408889634f, K_lo = 1.925963033500518e-08f;
  static constexpr float INV = 0.6931471805599453f, INV_lo = -1.904654323148236e-09f;  // ln 2 = INV + INV_lo
  static __device__ __forceinline__ float ex(float x) { return ex2f(x); }
  static __device__ __forceinline__ float lg(float x) { return log2f(x); }
  static __device__ __forceinline__ float scale(float v) { return fmaf(v, K, v * K_lo); }  // log2(e) v
};
template <> struct Lg<double> {
  static constexpr double Kd = 1.0;
  static constexpr double K = 1.0, K_lo = 0.0, INV = 1.0, INV_lo = 0.0;
  static __device__ __forceinline__ double ex(double x) { return exp(x); }
  static __device__ __forceinline__ double lg(double x) { return log(x); }
  static __device__ __forceinline__ double scale(double v) { return v; }
};
// (m + l) ln 2 in natural units with one rounding at the end (m: a running max, l = log2 of its sum), so that
// to_dom() in the gradient kernel gives back m + l as closely as the natural domain's stored m + log(s).
template <typename A> __device__ __forceinline__ A from_dom(A m, A l) {
  if (!(m - m == A(0))) return (m + l) * Lg<A>::INV;  // +-inf / NaN as they are
  return fma(m, Lg<A>::INV, fma(l, Lg<A>::INV, (m + l) * Lg<A>::INV_lo));
}
// A natural-unit value (a log-sum-exp) in the kernels' domain as hi + lo: x2 - v2 = (x2 - hi) - lo.
template <typename A> struct Lv {
  A hi = 0, lo = 0;
};
template <typename A> __device__ __forceinline__ Lv<A> to_dom(A v) {
  Lv<A> r;
  r.hi = v * Lg<A>::K;
  r.lo = (v == v && v - v == A(0)) ? fma(v, Lg<A>::K, -r.hi) + v * Lg<A>::K_lo : A(0);  // finite v only
  return r;
}
template <typename A> __device__ __forceinline__ A ex_minus(A x2, const Lv<A>& v) {
  return Lg<A>::ex((x2 - v.hi) - v.lo);
}
// log2(e) inv_temp as hi + lo (float), inv_temp itself (double).
template <typename A> struct Ct {
  A hi, lo;
};
template <typename A> __device__ __forceinline__ Ct<A> inv_temp_dom(double inv_temp) {
  const double c = inv_temp * Lg<A>::Kd;
  Ct<A> r;
  r.hi = (A)c;
  r.lo = (A)(c - (double)r.hi);
  return r;
}

// (m, s) <- (m, s) + exp(x) online, m the running max (s = 0 when empty).
template <typename A> __device__ __forceinline__ void online_add(A& m, A& s, A x) {
  if (x > m) {
    s = s * dexp(m - x) + A(1);
    m = x;
  } else {
    s += dexp(x - m);
  }
}

using cuda::table_bias;

// Column context (thread-owned columns) and row context (broadcast loads). BM: bias mode (0 none, 1 table,
// 2 dense), POS: positives (false for an extra-negative block); both compile-time, so unused loads vanish.
template <typename A> struct Col {
  int32_t lo = 0, hi = -1;
  bool none = false, valid = false;
  A ud = 0;
};

template <typename A, int BM, bool POS>
__device__ __forceinline__ Col<A> load_col(const MultiposBlockParams& p, int64_t j) {
  Col<A> c;
  c.valid = j < p.C;
  if (c.valid) {
    if (POS) {
      c.lo = p.d_lo[j];
      c.hi = p.d_hi[j];
      c.none = p.col_none[j] != 0;
    }
    if (BM == 1) c.ud = static_cast<const A*>(p.u_d)[j];
  }
  return c;
}

template <typename A> struct RowCtx {
  int32_t lo = 0, hi = -1;
  bool none = false;
  A uq = 0;
};

template <typename A, int BM, bool POS>
__device__ __forceinline__ RowCtx<A> load_row(const MultiposBlockParams& p, int64_t i) {
  RowCtx<A> r;
  if (POS) {
    r.lo = __ldg(p.q_lo + i);
    r.hi = __ldg(p.q_hi + i);
    r.none = __ldg(p.row_none + i) != 0;
  }
  if (BM == 1) r.uq = __ldg(static_cast<const A*>(p.u_q) + i);
  return r;
}

// x = inv_temp * s + bias and the two positive flags of one pair (bin / weight / slope for the table).
// dg: whether this pair is the row's diagonal partner (j == i + diag_offset).
template <typename A> struct Elem {
  A x, slope, t;
  int64_t idx;
  bool pr, pc;
};

// x is in the kernels' domain (Lg): log2(e) (inv_temp s + bias) for float, inv_temp s + bias for float64.
template <typename A, int BM, bool POS>
__device__ __forceinline__ Elem<A> element(const MultiposBlockParams& p, A s, const A* dense_row, int64_t j, bool dg,
                                           const RowCtx<A>& rc, const Col<A>& c, Ct<A> ct, A half_span, const A* T) {
  Elem<A> e;
  e.x = fma(s, ct.hi, s * ct.lo);
  e.slope = A(0);
  e.t = A(0);
  e.idx = 0;
  if (BM == 1) e.x += Lg<A>::scale(table_bias<A>(T, p.P, half_span, c.ud - rc.uq, e.slope, e.idx, e.t));
  if (BM == 2) e.x += Lg<A>::scale(dense_row[j]);
  e.pr = e.pc = false;
  if (POS) {
    const bool ov = max(rc.lo, c.lo) <= min(rc.hi, c.hi);
    e.pr = ov || (rc.none && dg);
    e.pc = ov || (dg && (rc.none || c.none));
  }
  return e;
}

// Combine the 8 warps' (max, sum) partials of up to 32 rows and write (lse_all, lse_pos) per row.
template <typename A>
__device__ __forceinline__ void flush_rows(const MultiposBlockParams& p, A (*wpart)[32][4], int64_t rb, int nr) {
  const int tid = threadIdx.x;
  if (tid < nr) {
    A lse[2];
    for (int k = 0; k < 2; ++k) {
      A m = ninf<A>();
      for (int w = 0; w < kWarps; ++w) m = max(m, wpart[w][tid][2 * k]);
      A s = 0;
      if (m != ninf<A>())
        for (int w = 0; w < kWarps; ++w) {
          const A ws = wpart[w][tid][2 * k + 1];
          if (ws != A(0)) s += ws * Lg<A>::ex(wpart[w][tid][2 * k] - m);
        }
      lse[k] = s > A(0) ? from_dom<A>(m, Lg<A>::lg(s)) : (s == s ? ninf<A>() : s);  // natural units
    }
    A* out = static_cast<A*>(p.row_part) + ((rb + tid) * p.nslots + p.slot0 + blockIdx.x) * 2;
    out[0] = lse[0];
    out[1] = lse[1];
  }
}

// Column j's (lse_all, lse_pos) partial of this row tile, in natural units, from the running (max, sum) pairs
// in the kernels' domain (-inf for an empty sum, NaN kept).
template <typename A>
__device__ __forceinline__ void write_col_part(const MultiposBlockParams& p, int64_t j, A cm, A cs, A cpm, A cps) {
  A* out = static_cast<A*>(p.col_part) + ((int64_t)blockIdx.y * p.C + j) * 2;
  out[0] = cs > A(0) ? from_dom<A>(cm, Lg<A>::lg(cs)) : (cs == cs ? ninf<A>() : cs);
  out[1] = cps > A(0) ? from_dom<A>(cpm, Lg<A>::lg(cps)) : (cps == cps ? ninf<A>() : cps);
}

// Hardest negative: (v, j) beats (bv, bj) if larger, or equal with a lower column (j = INT_MAX: none).
template <typename A> __device__ __forceinline__ void hard_merge(A& bv, int& bj, A v, int j) {
  if (v > bv || (v == bv && j < bj)) {
    bv = v;
    bj = j;
  }
}

// The row's positive statistics over the warp (lane: its max over positives lpm and its 4 values with their
// positive flags): (pm, ps) = (max, sum of exp(x - max)) in the kernels' domain; (-inf, 0) when the warp holds
// no positive of the row (one warp-uniform ballot, so the common case costs one vote).
template <typename A>
__device__ __forceinline__ void warp_pos_stats(A lpm, const A (&x)[4], const bool (&pr)[4], A& pm, A& ps) {
  pm = ninf<A>();
  ps = A(0);
  if (__ballot_sync(kFull, lpm != ninf<A>()) != 0u) {
    pm = cuda::warp_max(lpm);
    A lps = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (pr[k]) lps += Lg<A>::ex(x[k] - pm);
    ps = cuda::warp_sum(lps);
  }
}

// The row's hardest negative over the warp: each lane's best among its 4 values (ok and not positive; column
// j0 + k * stride, increasing with k, so strict > keeps the lowest among a lane's ties), merged by hard_merge.
template <typename A>
__device__ __forceinline__ void warp_hardest(const A (&x)[4], const bool (&pr)[4], const bool (&ok)[4], int64_t j0,
                                             int stride, A& bv, int& bj) {
  bv = ninf<A>();
  bj = INT_MAX;
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (ok[k] && !pr[k] && (bj == INT_MAX || x[k] > bv)) {
      bv = x[k];
      bj = (int)(j0 + (int64_t)k * stride);
    }
  for (int o = 16; o > 0; o >>= 1) {
    const A ov = __shfl_xor_sync(kFull, bv, o);
    const int oj = __shfl_xor_sync(kFull, bj, o);
    hard_merge(bv, bj, ov, oj);
  }
}

// Combine the 8 warps' (max, column) of the row's negatives and write this column tile's partial.
template <typename A>
__device__ __forceinline__ void flush_hard(const MultiposBlockParams& p, A (*hv)[32], int (*hj)[32], int64_t rb,
                                           int nr) {
  const int tid = threadIdx.x;
  if (tid < nr) {
    A v = hv[0][tid];
    int j = hj[0][tid];
    for (int w = 1; w < kWarps; ++w) hard_merge(v, j, hv[w][tid], hj[w][tid]);
    const int64_t o = (rb + tid) * p.nct + blockIdx.x;
    static_cast<A*>(p.hard_val)[o] = v;
    p.hard_idx[o] = j == INT_MAX ? -1 : (int64_t)j;
  }
}

// Each thread owns KC columns (j = c0 + tid + 256 k) and walks the block's rows RB at a time, all KC x RB
// loads of a batch issued before any is used (bytes in flight hide the memory latency).
constexpr int KC = 4;
static_assert(KC == 4, "warp_pos_stats / warp_hardest take a thread's 4 values");
constexpr int RB = 4;

// The batch's scores: rows b < nb of the batch starting at Sb, the thread's KC columns (0 elsewhere).
template <typename ST, typename A>
__device__ __forceinline__ void load_batch(const ST* Sb, int64_t lds, int nb, const Col<A> (&c)[KC],
                                           A (&sv)[RB][KC]) {
#pragma unroll
  for (int b = 0; b < RB; ++b)
#pragma unroll
    for (int k = 0; k < KC; ++k) sv[b][k] = (b < nb && c[k].valid) ? cuda::to_acc(Sb[b * lds + k * kThreads]) : A(0);
}

// HARD (compile-time, positive blocks only): also the per (row, column tile) hardest negative partials, so
// that the default statistics pass compiles exactly as before (no extra registers or shared memory).
template <typename ST, typename A, int BM, bool POS, bool HARD>
__global__ void __launch_bounds__(kThreads) mpb_fwd_kernel(const MultiposBlockParams p) {
  __shared__ A wpart[kWarps][32][4];
  __shared__ A hpv[HARD ? kWarps : 1][32];    // hardest negative per (warp, row): value
  __shared__ int hpj[HARD ? kWarps : 1][32];  // and column (INT_MAX: none)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr bool hard = POS && HARD;
  const int64_t c0 = (int64_t)blockIdx.x * kThreads * KC + tid;
  const int64_t r0 = (int64_t)blockIdx.y * p.TR;
  const int64_t r1 = min(r0 + p.TR, p.R);
  const Ct<A> ct = inv_temp_dom<A>(p.inv_temp);
  const A half_span = (A)(0.5 * (double)(p.P - 1));
  const A* T = static_cast<const A*>(p.table);
  Col<A> c[KC];
#pragma unroll
  for (int k = 0; k < KC; ++k) c[k] = load_col<A, BM, POS>(p, c0 + k * kThreads);
  A cm[KC], cs[KC], cpm[KC], cps[KC];
#pragma unroll
  for (int k = 0; k < KC; ++k) {
    cm[k] = ninf<A>();
    cpm[k] = ninf<A>();
    cs[k] = cps[k] = A(0);
  }
  const bool cols = POS && p.cols;
  // j - (i + diag_offset) for k = 0 at row r0: the diagonal test is one compare of a running counter
  const int64_t dbase = c0 - (p.i0 + r0 + p.diag_offset);

  for (int64_t rb = r0; rb < r1; rb += 32) {
    const int nr = (int)min((int64_t)32, r1 - rb);
    for (int rr0 = 0; rr0 < nr; rr0 += RB) {
      const ST* Sb = static_cast<const ST*>(p.S) + (rb + rr0) * p.lds + c0;
      A sv[RB][KC];
      load_batch<ST, A>(Sb, p.lds, nr - rr0, c, sv);
      A xb[RB][KC];
      bool pcb[RB][KC];
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        const int rr = rr0 + b;
        if (rr >= nr) break;  // uniform
        const int64_t r = rb + rr, i = p.i0 + r;
        const RowCtx<A> rc = load_row<A, BM, POS>(p, i);
        const A* drow = BM == 2 ? static_cast<const A*>(p.dense) + r * p.ldb : nullptr;
        const int64_t dd = dbase - (r - r0);
        A lm = ninf<A>(), lpm = ninf<A>();
        bool pr[KC];
#pragma unroll
        for (int k = 0; k < KC; ++k) {
          if (c[k].valid) {
            const Elem<A> e = element<A, BM, POS>(p, sv[b][k], drow, c0 + k * kThreads, dd + k * kThreads == 0, rc,
                                                  c[k], ct, half_span, T);
            xb[b][k] = e.x;
            pr[k] = e.pr;
            pcb[b][k] = e.pc;
          } else {
            xb[b][k] = ninf<A>();
            pr[k] = pcb[b][k] = false;
          }
          lm = max(lm, xb[b][k]);
          if (pr[k]) lpm = max(lpm, xb[b][k]);
        }
        const A wm = cuda::warp_max(lm);
        A ls = 0;
#pragma unroll
        for (int k = 0; k < KC; ++k)  // (a row of NaN keeps its NaN)
          if (c[k].valid) ls += wm != ninf<A>() ? Lg<A>::ex(xb[b][k] - wm) : (xb[b][k] != xb[b][k] ? xb[b][k] : A(0));
        const A ws = cuda::warp_sum(ls);
        A pm = ninf<A>(), ps = 0;
        if (POS) warp_pos_stats<A>(lpm, xb[b], pr, pm, ps);
        if constexpr (hard) {
          const bool ok[4] = {c[0].valid, c[1].valid, c[2].valid, c[3].valid};
          A bv;
          int bj;
          warp_hardest<A>(xb[b], pr, ok, c0, kThreads, bv, bj);
          if (lane == 0) {
            hpv[warp][rr] = bv;
            hpj[warp][rr] = bj;
          }
        }
        if (lane == 0) {
          wpart[warp][rr][0] = wm;
          wpart[warp][rr][1] = ws;
          wpart[warp][rr][2] = pm;
          wpart[warp][rr][3] = ps;
        }
      }
      if (cols) {  // column statistics of the batch: one rescale per batch, not per element
        const int nb = min(RB, nr - rr0);
#pragma unroll
        for (int k = 0; k < KC; ++k) {
          if (!c[k].valid) continue;
          A bm = cm[k], bpm = cpm[k];
#pragma unroll
          for (int b = 0; b < RB; ++b) {
            if (b >= nb) break;
            bm = max(bm, xb[b][k]);
            if (pcb[b][k]) bpm = max(bpm, xb[b][k]);
          }
          if (bm != ninf<A>()) {
            A acc = cs[k] * Lg<A>::ex(cm[k] - bm);
#pragma unroll
            for (int b = 0; b < RB; ++b)
              if (b < nb) acc += Lg<A>::ex(xb[b][k] - bm);
            cs[k] = acc;
            cm[k] = bm;
          } else {
#pragma unroll
            for (int b = 0; b < RB; ++b)
              if (b < nb && xb[b][k] != xb[b][k]) cs[k] = xb[b][k];  // NaN stays NaN
          }
          if (bpm != ninf<A>()) {
            A acc = cps[k] * Lg<A>::ex(cpm[k] - bpm);
#pragma unroll
            for (int b = 0; b < RB; ++b)
              if (b < nb && pcb[b][k]) acc += Lg<A>::ex(xb[b][k] - bpm);
            cps[k] = acc;
            cpm[k] = bpm;
          }
        }
      }
    }
    __syncthreads();
    flush_rows<A>(p, wpart, rb, nr);
    if constexpr (hard) flush_hard<A>(p, hpv, hpj, rb, nr);
    __syncthreads();
  }
  if (cols) {
#pragma unroll
    for (int k = 0; k < KC; ++k) {
      if (!c[k].valid) continue;
      write_col_part<A>(p, c0 + k * kThreads, cm[k], cs[k], cpm[k], cps[k]);
    }
  }
}

// dL/dx of one pair in units of dS * T: gr (row softmax - the row's positive softmax) + gc (the same over the
// column), the log-sum-exps given in the kernels' domain (to_dom), so that x2 - lse2 carries no extra rounding.
template <typename A>
__device__ __forceinline__ A pair_grad(const Elem<A>& e, bool rows, bool cols, A gr, A gc, const Lv<A>& la,
                                       const Lv<A>& lp, const Lv<A>& ca, const Lv<A>& cp) {
  A g = 0;
  if (rows) g = gr * (ex_minus(e.x, la) - (e.pr ? ex_minus(e.x, lp) : A(0)));
  if (cols) g += gc * (ex_minus(e.x, ca) - (e.pc ? ex_minus(e.x, cp) : A(0)));
  return g;
}

// Table mode, one pair: dL/ddelta into the column's (dud) and the row's (rsum) sums, dL/dtable into the two
// bins of the interpolation (the CTA's shared histogram, or its slot of the global one).
template <typename A>
__device__ __forceinline__ void table_scatter(const Elem<A>& e, A g, A& dud, A& rsum, int hist_smem, A* hs,
                                              double* hist_g) {
  const A dD = g * e.slope;
  dud += dD;
  rsum += dD;
  if (hist_smem) {
    atomicAdd(hs + e.idx, g - g * e.t);
    atomicAdd(hs + e.idx + 1, g * e.t);
  } else {
    atomicAdd(hist_g + e.idx, (double)(g - g * e.t));
    atomicAdd(hist_g + e.idx + 1, (double)(g * e.t));
  }
}

// Table mode, every 32 rows: the rows' dL/du_q partials of this column tile (-sum over the CTA's columns).
template <typename A>
__device__ __forceinline__ void flush_duq(const MultiposBlockParams& p, A* rowacc, int64_t rb, int nr) {
  __syncthreads();
  if ((int)threadIdx.x < nr) {
    static_cast<A*>(p.duq_part)[(rb + threadIdx.x) * p.nct + blockIdx.x] = -rowacc[threadIdx.x];
    rowacc[threadIdx.x] = A(0);
  }
  __syncthreads();
}

// Table mode, at the end: the shared histogram into the CTA's slot hid of the global one.
template <typename A>
__device__ __forceinline__ void flush_hist(const MultiposBlockParams& p, const A* hs, int64_t hid) {
  __syncthreads();
  double* h = p.hist + hid * p.P;
  for (int64_t k = threadIdx.x; k < p.P; k += kThreads) h[k] += (double)hs[k];
}

template <typename ST, typename OT, typename A, int BM, bool POS>
__global__ void __launch_bounds__(kThreads) mpb_bwd_kernel(const MultiposBlockParams p, int hist_smem) {
  extern __shared__ unsigned char mpb_smem[];
  A* hs = reinterpret_cast<A*>(mpb_smem);  // table mode: the block's histogram of dL/dtable (P values)
  __shared__ A rowacc[32];
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t c0 = (int64_t)blockIdx.x * kThreads * KC + tid;
  const int64_t r0 = (int64_t)blockIdx.y * p.TR;
  const int64_t r1 = min(r0 + p.TR, p.R);
  A* G = static_cast<A*>(p.G);
  const A it = (A)p.inv_temp, gr = (A)p.gr, gc = (A)p.gc;
  const Ct<A> ct = inv_temp_dom<A>(p.inv_temp);
  const bool rows = p.gr != 0.0, cols = POS && p.cols && p.gc != 0.0;
  constexpr bool table = BM == 1;
  const A half_span = (A)(0.5 * (double)(p.P - 1));
  const A* T = static_cast<const A*>(p.table);
  const A* rl = static_cast<const A*>(p.row_lse);
  const A* cl = static_cast<const A*>(p.col_lse);
  const int64_t hid = (int64_t)blockIdx.y * gridDim.x + blockIdx.x;
  double* hist_g = p.hist + (hist_smem ? 0 : hid * p.P);
  if (table && hist_smem) {
    for (int64_t k = tid; k < p.P; k += kThreads) hs[k] = A(0);
  }
  if (tid < 32) rowacc[tid] = A(0);
  __syncthreads();

  Col<A> c[KC];
  Lv<A> ca[KC], cp[KC];
  A dud[KC];
#pragma unroll
  for (int k = 0; k < KC; ++k) {
    const int64_t j = c0 + k * kThreads;
    c[k] = load_col<A, BM, POS>(p, j);
    dud[k] = A(0);
    if (c[k].valid && cols) {
      ca[k] = to_dom<A>(cl[j]);
      cp[k] = to_dom<A>(cl[p.C + j]);
    }
  }
  const int64_t dbase = c0 - (p.i0 + r0 + p.diag_offset);

  for (int64_t rb = r0; rb < r1; rb += 32) {
    const int nr = (int)min((int64_t)32, r1 - rb);
    for (int rr0 = 0; rr0 < nr; rr0 += RB) {
      const ST* Sb = static_cast<const ST*>(p.S) + (rb + rr0) * p.lds + c0;
      OT* Ob = static_cast<OT*>(p.dS) + (rb + rr0) * p.ldo + c0;
      A sv[RB][KC];
      load_batch<ST, A>(Sb, p.lds, nr - rr0, c, sv);
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        const int rr = rr0 + b;
        if (rr >= nr) break;  // uniform
        const int64_t r = rb + rr, i = p.i0 + r;
        const RowCtx<A> rc = load_row<A, BM, POS>(p, i);
        const A* drow = BM == 2 ? static_cast<const A*>(p.dense) + r * p.ldb : nullptr;
        const int64_t dd = dbase - (r - r0);
        Lv<A> la, lp;
        if (rows) {
          la = to_dom<A>(__ldg(rl + i));
          if (POS) lp = to_dom<A>(__ldg(rl + p.Bq + i));
        }
        A rsum = 0;
#pragma unroll
        for (int k = 0; k < KC; ++k) {
          if (!c[k].valid) continue;
          const int64_t j = c0 + k * kThreads;
          const Elem<A> e = element<A, BM, POS>(p, sv[b][k], drow, j, dd + k * kThreads == 0, rc, c[k], ct,
                                                half_span, T);
          const A g = pair_grad<A>(e, rows, cols, gr, gc, la, lp, ca[k], cp[k]);
          Ob[b * p.ldo + k * kThreads] = cuda::from_acc<OT>(g * it);
          if (BM == 2) G[r * p.ldo + j] = g;
          if (table) table_scatter<A>(e, g, dud[k], rsum, hist_smem, hs, hist_g);
        }
        if (table) {
          const A wsum = cuda::warp_sum(rsum);
          if (lane == 0) atomicAdd(rowacc + rr, wsum);
        }
      }
    }
    if (table) flush_duq<A>(p, rowacc, rb, nr);
  }
  if (table) {
#pragma unroll
    for (int k = 0; k < KC; ++k)
      if (c[k].valid) static_cast<A*>(p.dud_part)[(int64_t)blockIdx.y * p.C + c0 + k * kThreads] = dud[k];
    if (hist_smem) flush_hist<A>(p, hs, hid);
  }
}

// Calls f(BM, POS) as compile-time constants for the combinations the driver launches.
template <typename F> void dispatch_mode(const MultiposBlockParams& p, F&& f) {
  if (!p.pos) {
    if (p.bias_mode != 0) throw std::runtime_error("multipos_block: an extra-negative block takes no bias");
    f(std::integral_constant<int, 0>{}, std::false_type{});
    return;
  }
  switch (p.bias_mode) {
    case 0: f(std::integral_constant<int, 0>{}, std::true_type{}); break;
    case 1: f(std::integral_constant<int, 1>{}, std::true_type{}); break;
    default: f(std::integral_constant<int, 2>{}, std::true_type{}); break;
  }
}

template <typename F> void dispatch_fwd(DType sd, DType ad, F&& f) {
  if (ad == DType::F64) {
    if (sd != DType::F64) throw std::runtime_error("multipos_block: float64 accumulation needs float64 scores");
    f(double{}, double{});
    return;
  }
  switch (sd) {
    case DType::F32: f(float{}, float{}); break;
    case DType::F16: f(__half{}, float{}); break;
    case DType::BF16: f(__nv_bfloat16{}, float{}); break;
    default: throw std::runtime_error("multipos_block: float64 scores need float64 accumulation");
  }
}

void check(const MultiposBlockParams& p) {
  if (p.R < 0 || p.C < 0 || p.TR < 1 || p.nct != (p.C + kThreads * KC - 1) / (kThreads * KC) || p.nrt != (p.R + p.TR - 1) / p.TR)
    throw std::runtime_error("multipos_block: inconsistent tiling");
  if (p.nrt > 65535) throw std::runtime_error("multipos_block: too many row tiles (raise TR)");
  if (p.bias_mode == 1 && p.P < 2) throw std::runtime_error("multipos_block: the table needs >= 2 points");
}

}  // namespace

void multipos_block_fwd_cuda(const MultiposBlockParams& p, int device, uintptr_t stream) {
  check(p);
  if (p.R == 0 || p.C == 0) return;
  cuda::set_device(device);
  const dim3 grid((unsigned)p.nct, (unsigned)p.nrt);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_fwd(p.sdtype, p.adtype, [&](auto s, auto a) {
    using ST = decltype(s);
    using A = decltype(a);
    dispatch_mode(p, [&](auto bm, auto pos) {
      constexpr int BM = decltype(bm)::value;
      constexpr bool POS = decltype(pos)::value;
      if (POS && p.hard_idx != nullptr)
        mpb_fwd_kernel<ST, A, BM, POS, true><<<grid, kThreads, 0, st>>>(p);
      else
        mpb_fwd_kernel<ST, A, BM, POS, false><<<grid, kThreads, 0, st>>>(p);
    });
  });
  cuda::check_launch();
}

void multipos_block_bwd_cuda(const MultiposBlockParams& p, int device, uintptr_t stream) {
  check(p);
  if (p.R == 0 || p.C == 0) return;
  cuda::set_device(device);
  const dim3 grid((unsigned)p.nct, (unsigned)p.nrt);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  int optin = 0;
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  dispatch_fwd(p.sdtype, p.adtype, [&](auto s, auto a) {
    using ST = decltype(s);
    using A = decltype(a);
    const size_t hbytes = p.bias_mode == 1 ? (size_t)p.P * sizeof(A) : 0;
    // the histogram lives in shared memory when it fits next to the static arrays, else in global memory
    const int hist_smem = hbytes > 0 && hbytes + 1024 <= (size_t)optin;
    const size_t smem = hist_smem ? hbytes : 0;
    auto launch = [&](auto o) {
      using OT = decltype(o);
      dispatch_mode(p, [&](auto bm, auto pos) {
        constexpr int BM = decltype(bm)::value;
        constexpr bool POS = decltype(pos)::value;
        auto kern = mpb_bwd_kernel<ST, OT, A, BM, POS>;
        if (smem > 48 * 1024)
          TK_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        mpb_bwd_kernel<ST, OT, A, BM, POS><<<grid, kThreads, smem, st>>>(p, hist_smem);
      });
    };
    if constexpr (sizeof(A) == 8) {
      launch(double{});
    } else {
      switch (p.odtype) {
        case DType::F32: launch(float{}); break;
        case DType::F16: launch(__half{}); break;
        case DType::BF16: launch(__nv_bfloat16{}); break;
        default: throw std::runtime_error("multipos_block: float64 dS needs float64 accumulation");
      }
    }
  });
  cuda::check_launch();
}

// ---------------------------------------------------------------------------------------------------------
// The glue kernels: prep (spans and fallback flags) and fin (statistics merge,
// hardest negative, loss). They replace ~50 torch ops per step (sort x4, searchsorted x4, the logsumexp
// merges, the loss assembly); see multipos_block.h for what they compute.
namespace {

constexpr int kPrepThreads = 256;
constexpr int kFinThreads = 256;

// Prep: thread t owns row t (t < Bq) or column t - Bq. Every CTA first reduces the min and max of all
// 2 (Bq + Bd) bounds (O(Bq + Bd) L2-resident loads per CTA, so that one launch suffices), then the thread
// looks for one overlapping partner, starting at its diagonal partner (j = i + diag_offset, where the spans
// of a query and its document usually overlap) and stopping at the first overlap: O(1) per row when the
// diagonal overlaps, O(Bd) for a row without any (the fallback rows).
__global__ void __launch_bounds__(kPrepThreads) mpb_prep_kernel(const MultiposPrepParams p) {
  __shared__ long long smin[kPrepThreads], smax[kPrepThreads];
  const int tid = threadIdx.x;
  long long mn = LLONG_MAX, mx = LLONG_MIN;
  const int64_t* arr[4] = {p.q_lo, p.q_hi, p.d_lo, p.d_hi};
  const int64_t len[4] = {p.Bq, p.Bq, p.Bd, p.Bd};
#pragma unroll
  for (int a = 0; a < 4; ++a)
    for (int64_t k = tid; k < len[a]; k += kPrepThreads) {
      const long long v = (long long)__ldg(arr[a] + k);
      mn = v < mn ? v : mn;
      mx = v > mx ? v : mx;
    }
  smin[tid] = mn;
  smax[tid] = mx;
  __syncthreads();
  for (int h = kPrepThreads / 2; h > 0; h >>= 1) {
    if (tid < h) {
      smin[tid] = smin[tid + h] < smin[tid] ? smin[tid + h] : smin[tid];
      smax[tid] = smax[tid + h] > smax[tid] ? smax[tid + h] : smax[tid];
    }
    __syncthreads();
  }
  mn = smin[0];
  mx = smax[0];
  // max - min as unsigned: exact for any int64 pair with max >= min
  const bool fits = (unsigned long long)mx - (unsigned long long)mn < 2147483647ull;
  auto conv = [&](long long v) -> int32_t {
    if (fits) return (int32_t)(v - mn);
    long long c = 0;  // rank: bounds smaller than v (the rare path: a range past int32)
    for (int a = 0; a < 4; ++a)
      for (int64_t k = 0; k < len[a]; ++k) c += (long long)__ldg(arr[a] + k) < v;
    return (int32_t)c;
  };
  const int64_t t = (int64_t)blockIdx.x * kPrepThreads + tid;
  if (t == 0 && p.counter) *p.counter = 0u;
  for (int64_t k = t; k < p.nzero; k += (int64_t)gridDim.x * kPrepThreads) p.zero[k] = 0.0;
  if (t < p.Bq) {
    const int64_t i = t;
    const long long lo = p.q_lo[i], hi = p.q_hi[i];
    bool found = false;
    if (p.Bd > 0) {
      int64_t j = (i + p.diag_offset) % p.Bd;
      if (j < 0) j += p.Bd;
      for (int64_t n = 0; n < p.Bd && !found; ++n) {
        const long long dl = __ldg(p.d_lo + j), dh = __ldg(p.d_hi + j);
        found = (lo > dl ? lo : dl) <= (hi < dh ? hi : dh);
        if (++j == p.Bd) j = 0;
      }
    }
    p.row_none[i] = found ? 0 : 1;
    p.spans32[i] = conv(lo);
    p.spans32[p.Bq + i] = conv(hi);
  } else if (t < p.Bq + p.Bd) {
    const int64_t j = t - p.Bq;
    const long long lo = p.d_lo[j], hi = p.d_hi[j];
    bool found = false;
    if (p.Bq > 0) {
      int64_t i = (j - p.diag_offset) % p.Bq;
      if (i < 0) i += p.Bq;
      for (int64_t n = 0; n < p.Bq && !found; ++n) {
        const long long ql = __ldg(p.q_lo + i), qh = __ldg(p.q_hi + i);
        found = (lo > ql ? lo : ql) <= (hi < qh ? hi : qh);
        if (++i == p.Bq) i = 0;
      }
    }
    p.col_none[j] = found ? 0 : 1;
    p.spans32[2 * p.Bq + j] = conv(lo);
    p.spans32[2 * p.Bq + p.Bd + j] = conv(hi);
  }
}

template <typename A> __device__ __forceinline__ bool is_nan(A x) { return x != x; }
// the libm functions (not the SFU approximations of the passes): the glue's few numbers follow torch's
__device__ __forceinline__ float fexp(float x) { return expf(x); }
__device__ __forceinline__ double fexp(double x) { return exp(x); }
__device__ __forceinline__ float flog(float x) { return logf(x); }
__device__ __forceinline__ double flog(double x) { return log(x); }
__device__ __forceinline__ float flog1p(float x) { return log1pf(x); }
__device__ __forceinline__ double flog1p(double x) { return log1p(x); }
__device__ __forceinline__ float fabs_(float x) { return fabsf(x); }
__device__ __forceinline__ double fabs_(double x) { return fabs(x); }

// torch.logsumexp over n values at stride `st`: amax (NaN propagates), a +-inf maximum taken as 0, then
// log(sum(exp(x - m))) + m.
template <typename A> __device__ __forceinline__ A lse_n(const A* x, int64_t n, int64_t st) {
  A m = ninf<A>();
  for (int64_t k = 0; k < n; ++k) {
    const A v = x[k * st];
    if (is_nan(v) || v > m) m = v;
    if (is_nan(m)) break;
  }
  if (m == std::numeric_limits<A>::infinity() || m == ninf<A>()) m = A(0);
  A s = 0;
  for (int64_t k = 0; k < n; ++k) s += fexp(x[k * st] - m);
  return flog(s) + m;
}

// torch.logaddexp
template <typename A> __device__ __forceinline__ A logaddexp_(A a, A b) {
  if (a == b && (a == std::numeric_limits<A>::infinity() || a == ninf<A>())) return a;
  const A m = a > b ? a : b;  // (std::max)
  return m + flog1p(fexp(-fabs_(a - b)));
}

template <typename A> __global__ void __launch_bounds__(kFinThreads) mpb_fin_kernel(const MultiposFinParams p) {
  __shared__ double red[2][kFinThreads];
  __shared__ bool last_cta;
  const int tid = threadIdx.x;
  const int64_t t = (int64_t)blockIdx.x * kFinThreads + tid;
  const A* rp = static_cast<const A*>(p.row_part);
  const A* cp = static_cast<const A*>(p.col_part);
  A* rl = static_cast<A*>(p.row_lse);
  A* cl = static_cast<A*>(p.col_lse);
  if (t < p.R) {
    const int64_t i = p.i0 + t;
    rl[i] = lse_n<A>(rp + t * p.nslots * 2, p.nslots, 2);
    rl[p.Bq + i] = lse_n<A>(rp + t * p.nslots * 2 + 1, p.nslots, 2);
    if (p.hardest) {
      const A* hv = static_cast<const A*>(p.hard_val) + t * p.nct;
      const int64_t* hi = p.hard_idx + t * p.nct;
      int64_t out;
      if (p.nct == 1) {
        out = hi[0];
      } else {  // merge_hardest: the max (NaN propagates), the lowest column among tiles equal to it
        A best = hv[0];
        for (int64_t c = 1; c < p.nct && !is_nan(best); ++c)
          if (is_nan(hv[c]) || hv[c] > best) best = hv[c];
        out = LLONG_MAX;
        for (int64_t c = 0; c < p.nct; ++c)
          if (hv[c] == best && hi[c] >= 0 && hi[c] < out) out = hi[c];
        if (out == LLONG_MAX) out = -1;
      }
      p.hardest[i] = out;
    }
  } else if (p.cols && t < p.R + p.Bd) {
    const int64_t j = t - p.R;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const A v = lse_n<A>(cp + j * 2 + k, p.nrt, p.Bd * 2);
      cl[k * p.Bd + j] = p.first ? v : logaddexp_<A>(cl[k * p.Bd + j], v);
    }
  }
  if (!p.last) return;  // uniform: every thread of every CTA
  __threadfence();      // this CTA's statistics visible to the last CTA
  __syncthreads();
  if (tid == 0) last_cta = atomicAdd(p.counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last_cta) return;
  const volatile A* vrl = rl;
  const volatile A* vcl = cl;
  // 8 loads in flight per thread before their first use (volatile loads issue in order, stall at use)
  constexpr int U = 8;
  auto mean_diff = [&](const volatile A* x, int64_t n) {
    double s = 0.0;
    for (int64_t b = tid; b < n; b += (int64_t)U * kFinThreads) {
      A a[U], c[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k = b + (int64_t)u * kFinThreads;
        a[u] = k < n ? x[k] : A(0);
        c[u] = k < n ? x[n + k] : A(0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (b + (int64_t)u * kFinThreads < n) s += (double)(A)(a[u] - c[u]);
    }
    return s;
  };
  const double sr = p.row_weight != 0.0 ? mean_diff(vrl, p.Bq) : 0.0;
  const double sc = p.cols ? mean_diff(vcl, p.Bd) : 0.0;
  red[0][tid] = sr;
  red[1][tid] = sc;
  __syncthreads();
  for (int h = kFinThreads / 2; h > 0; h >>= 1) {
    if (tid < h) {
      red[0][tid] += red[0][tid + h];
      red[1][tid] += red[1][tid + h];
    }
    __syncthreads();
  }
  if (tid == 0) {
    double tot = 0.0;
    bool any = false;
    if (p.row_weight != 0.0) {
      tot = red[0][0] / (double)p.Bq * p.row_weight;
      any = true;
    }
    if (p.cols) {
      const double tc = red[1][0] / (double)p.Bd * p.col_weight;
      tot = any ? tot + tc : tc;
    }
    *static_cast<A*>(p.loss) = (A)tot;
    *p.counter = 0u;  // ready for the next step
  }
}

template <typename A> __global__ void __launch_bounds__(kFinThreads) mpb_tgrad_kernel(const MultiposTableGradParams p) {
  const int64_t t = (int64_t)blockIdx.x * kFinThreads + threadIdx.x;
  if (t < p.R) {
    const A* x = static_cast<const A*>(p.duq_part) + t * p.nct;
    A s = 0;
    for (int64_t c = 0; c < p.nct; ++c) s += x[c];
    static_cast<A*>(p.du_q)[p.i0 + t] = s;
  } else if (t < p.R + p.Bd) {
    const int64_t j = t - p.R;
    const A* x = static_cast<const A*>(p.dud_part) + j;
    double s = 0.0;
    for (int64_t r = 0; r < p.nrt; ++r) s += (double)x[r * p.Bd];
    const double v = p.first ? s : p.dud_acc[j] + s;
    p.dud_acc[j] = v;
    if (p.last) static_cast<A*>(p.du_d)[j] = (A)v;
  } else if (p.last && t < p.R + p.Bd + p.P) {
    const int64_t k = t - p.R - p.Bd;
    double s = 0.0;
    for (int64_t h = 0; h < p.nhist; ++h) s += p.hist[h * p.P + k];
    static_cast<A*>(p.dtable)[k] = (A)s;
  }
}

}  // namespace

void multipos_block_tgrad_cuda(const MultiposTableGradParams& p, int device, uintptr_t stream) {
  const int64_t n = p.R + p.Bd + (p.last ? p.P : 0);
  if (n == 0) return;
  cuda::set_device(device);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const unsigned grid = (unsigned)((n + kFinThreads - 1) / kFinThreads);
  if (p.adtype == DType::F64) {
    mpb_tgrad_kernel<double><<<grid, kFinThreads, 0, st>>>(p);
  } else if (p.adtype == DType::F32) {
    mpb_tgrad_kernel<float><<<grid, kFinThreads, 0, st>>>(p);
  } else {
    throw std::runtime_error("multipos_block tgrad: accumulation dtype must be float32 or float64");
  }
  cuda::check_launch();
}

void multipos_block_prep_cuda(const MultiposPrepParams& p, int device, uintptr_t stream) {
  const int64_t n = p.Bq + p.Bd;
  if (n == 0) return;
  cuda::set_device(device);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const unsigned grid = (unsigned)((n + kPrepThreads - 1) / kPrepThreads);
  mpb_prep_kernel<<<grid, kPrepThreads, 0, st>>>(p);
  cuda::check_launch();
}

void multipos_block_fin_cuda(const MultiposFinParams& p, int device, uintptr_t stream) {
  const int64_t n = p.R + (p.cols ? p.Bd : 0);
  if (n == 0 && !p.last) return;
  if (p.last && !p.counter) throw std::runtime_error("multipos_block fin: the last launch needs the counter");
  cuda::set_device(device);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const unsigned grid = (unsigned)std::max<int64_t>(1, (n + kFinThreads - 1) / kFinThreads);
  if (p.adtype == DType::F64) {
    mpb_fin_kernel<double><<<grid, kFinThreads, 0, st>>>(p);
  } else if (p.adtype == DType::F32) {
    mpb_fin_kernel<float><<<grid, kFinThreads, 0, st>>>(p);
  } else {
    throw std::runtime_error("multipos_block fin: accumulation dtype must be float32 or float64");
  }
  cuda::check_launch();
}

}  // namespace tk
