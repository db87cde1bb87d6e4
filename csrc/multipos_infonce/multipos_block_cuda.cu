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
// in the kernels' domain (-inf for an empty sum, NaN kept): the statistics kernels v1 and v3.
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

// ---------------------------------------------------------------------------------------------------------
// Statistics pass v2 (TEMPOKERN_MPB_STATS=v2, opt-in until a GPU has measured it): the same outputs as
// mpb_fwd_kernel (row_part per (row, 1024-column tile), col_part per (row tile, column), hardest-negative
// partials), the same grid, but no per-row cross-thread reduction per element.
//
// A CTA owns TR rows x 1024 columns and walks them in stages of kRS = 8 rows:
//   staging:  the stage's 8 x 1024 scores are copied global -> registers -> shared memory in 16-byte units
//             (coalesced: 64 consecutive units per row for float32), the next stage's loads issued before
//             the current stage is computed (32 KB in flight per CTA for float32 scores);
//   rows:     warp w owns row w of the stage; lane l owns the 32 columns 4 l + 128 k + e (k < 8, e < 4), read
//             as 16-byte shared loads (conflict-free). The lane computes x = inv_temp s + bias and the positive
//             flag of its 32 elements, writes x back into the tile, and the warp reduces ONCE per row per
//             1024 columns (max, then sum of exp(x - max): the same formula as v1, so the same numbers);
//   columns:  thread t owns columns t + 256 k (k < 4) as in v1 and reads the 8 x values of each from the tile
//             (conflict-free), one online rescale per 8 rows.
// Per score (float32 scores, no bias): 0.25 global 16-byte loads + 0.25 shared stores (staging), 0.25 + 1
// shared loads, 0.25 shared stores (x written back), two exps (~8 instructions each with the rounding
// compensation), ~10 compares / max / adds: ~35 thread-instructions and 4 bytes of DRAM traffic, against
// v1's ~5 shuffles + 2 exps + ~20 others per score. Shared memory: 32 KB tile (float32 accumulation) + 9 KB
// column context (+ 4 KB u_d in table mode) per CTA.
constexpr int kRS = 8;                   // rows per stage: one warp each
constexpr int kTC = kThreads * KC;       // 1024 columns per CTA
static_assert(kRS == kWarps, "one warp per stage row");

struct __align__(16) Vec16 {
  unsigned int w[4];
};
template <typename A> struct __align__(16) Quad {
  A v[4];
};

// Two CTAs per SM for float32 accumulation (<= 128 registers: 32 hold the next stage's loads), so that one
// CTA's loads are in flight while the other computes; float64 (rare on a GPU): one.
template <typename ST, typename A, int BM, bool POS, bool HARD>
__global__ void __launch_bounds__(kThreads, sizeof(A) == 4 ? 2 : 1) mpb_fwd2_kernel(const MultiposBlockParams p, int vec) {
  extern __shared__ __align__(16) unsigned char mpb2_smem[];
  constexpr int E = 16 / sizeof(ST);        // score elements per 16-byte unit
  constexpr int UPR = kTC / E;              // units per stage row
  constexpr int UPT = kRS * UPR / kThreads; // units per thread per stage
  A* xs = reinterpret_cast<A*>(mpb2_smem);                       // [kRS][kTC]
  int32_t* clo = reinterpret_cast<int32_t*>(xs + kRS * kTC);     // [kTC]
  int32_t* chi = clo + kTC;                                      // [kTC]
  A* cud = reinterpret_cast<A*>(chi + kTC);                      // [kTC] (table mode)
  uint8_t* cnone = reinterpret_cast<uint8_t*>(cud + (BM == 1 ? kTC : 0));  // [kTC]
  __shared__ int32_t srow[3][kRS];  // the stage rows' lo, hi, row_none
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr bool hard = POS && HARD;
  const int64_t ct0 = (int64_t)blockIdx.x * kTC;  // first column of the tile
  const int ncol = (int)min((int64_t)kTC, p.C - ct0);
  const int64_t c0 = ct0 + tid;
  const int64_t r0 = (int64_t)blockIdx.y * p.TR;
  const int64_t r1 = min(r0 + p.TR, p.R);
  const A it = (A)p.inv_temp;
  const A half_span = (A)(0.5 * (double)(p.P - 1));
  const A* T = static_cast<const A*>(p.table);
  const ST* S = static_cast<const ST*>(p.S);

  // column context in shared memory (read by both phases; registers stay free for the staged loads)
#pragma unroll
  for (int k = 0; k < KC; ++k) {
    const Col<A> c = load_col<A, BM, POS>(p, c0 + k * kThreads);
    const int cc = tid + k * kThreads;
    clo[cc] = c.lo;
    chi[cc] = c.hi;
    cnone[cc] = c.none ? 1 : 0;
    if (BM == 1) cud[cc] = c.ud;
  }
  A cm[KC], cs[KC], cpm[KC], cps[KC];
#pragma unroll
  for (int k = 0; k < KC; ++k) {
    cm[k] = cpm[k] = ninf<A>();
    cs[k] = cps[k] = A(0);
  }
  const bool cols = POS && p.cols;

  // one stage's units into registers (zeros outside the block)
  auto load_stage = [&](int64_t rs, Vec16 (&u)[UPT]) {
    const int ns = (int)min((int64_t)kRS, r1 - rs);
#pragma unroll
    for (int m = 0; m < UPT; ++m) {
      const int unit = tid + m * kThreads;
      const int row = unit / UPR, col = (unit % UPR) * E;
      Vec16 v;
      v.w[0] = v.w[1] = v.w[2] = v.w[3] = 0u;
      if (row < ns && col < ncol) {
        const ST* src = S + (rs + row) * p.lds + ct0 + col;
        if (vec && col + E <= ncol) {
          v = *reinterpret_cast<const Vec16*>(src);
        } else {
          ST* dst = reinterpret_cast<ST*>(&v);
          for (int e = 0; e < E && col + e < ncol; ++e) dst[e] = src[e];
        }
      }
      u[m] = v;
    }
  };
  Vec16 u[UPT];
  if (r0 < r1) load_stage(r0, u);
  __syncthreads();  // column context in shared memory

  for (int64_t rs = r0; rs < r1; rs += kRS) {
    const int ns = (int)min((int64_t)kRS, r1 - rs);
    // registers -> tile (as the accumulation type)
#pragma unroll
    for (int m = 0; m < UPT; ++m) {
      const int unit = tid + m * kThreads;
      const int row = unit / UPR, col = (unit % UPR) * E;
      const ST* sv = reinterpret_cast<const ST*>(&u[m]);
#pragma unroll
      for (int e = 0; e < E; e += 4) {
        Quad<A> q;
#pragma unroll
        for (int f = 0; f < 4; ++f) q.v[f] = (e + f < E) ? cuda::to_acc(sv[e + f]) : A(0);
        if (E >= 4) {
          *reinterpret_cast<Quad<A>*>(xs + row * kTC + col + e) = q;
        } else {
          for (int f = 0; f < E; ++f) xs[row * kTC + col + f] = q.v[f];
        }
      }
    }
    __syncthreads();
    if (rs + kRS < r1) load_stage(rs + kRS, u);  // next stage in flight while this one is computed

    // rows: warp `warp` owns stage row `warp`
    if (warp < ns) {
      const int64_t r = rs + warp, i = p.i0 + r;
      const RowCtx<A> rc = load_row<A, BM, POS>(p, i);
      const A* drow = BM == 2 ? static_cast<const A*>(p.dense) + r * p.ldb + ct0 : nullptr;
      const int64_t dgc = i + p.diag_offset - ct0;  // the diagonal partner's column inside the tile
      if (lane == 0) {
        srow[0][warp] = rc.lo;
        srow[1][warp] = rc.hi;
        srow[2][warp] = rc.none ? 1 : 0;
      }
      unsigned pmask = 0u;
      A lm = ninf<A>(), lpm = ninf<A>();
      A bv = ninf<A>();
      int bj = INT_MAX;
      A* xrow = xs + warp * kTC;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int cc0 = 4 * lane + 128 * k;
        const Quad<A> sq = *reinterpret_cast<const Quad<A>*>(xrow + cc0);
        Quad<int32_t> jlo, jhi;  // the 4 columns' spans: two 16-byte shared loads
        if (POS) {
          jlo = *reinterpret_cast<const Quad<int32_t>*>(clo + cc0);
          jhi = *reinterpret_cast<const Quad<int32_t>*>(chi + cc0);
        }
        Quad<A> xq;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int cc = cc0 + e;
          A x = ninf<A>();
          bool pr = false;
          if (cc < ncol) {
            x = sq.v[e] * it;
            if (BM == 1) {
              A sl, tt;
              int64_t ix;
              x += table_bias<A>(T, p.P, half_span, cud[cc] - rc.uq, sl, ix, tt);
            }
            if (BM == 2) x += drow[cc];
            if (POS) {
              const bool ov = max(rc.lo, jlo.v[e]) <= min(rc.hi, jhi.v[e]);
              pr = ov || (rc.none && cc == dgc);
            }
            lm = max(lm, x);
            if (pr) {
              lpm = max(lpm, x);
              pmask |= 1u << (4 * k + e);
            }
            if (hard && !pr && (bj == INT_MAX || x > bv)) {  // columns increase with (k, e): lowest of ties
              bv = x;
              bj = (int)(ct0 + cc);
            }
          }
          xq.v[e] = x;
        }
        *reinterpret_cast<Quad<A>*>(xrow + cc0) = xq;  // x for the column phase
      }
      // second look at the lane's 32 x values: re-read from the tile (the lane's own writes; keeping them in
      // registers would cost 32 of the 128 and spill)
      const A wm = cuda::warp_max(lm);
      A ls = 0;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const Quad<A> xq = *reinterpret_cast<const Quad<A>*>(xrow + 4 * lane + 128 * k);
#pragma unroll
        for (int e = 0; e < 4; ++e)  // (a row of NaN keeps its NaN)
          if (4 * lane + 128 * k + e < ncol)
            ls += wm != ninf<A>() ? dexp(xq.v[e] - wm) : (xq.v[e] != xq.v[e] ? xq.v[e] : A(0));
      }
      const A ws = cuda::warp_sum(ls);
      A pm = ninf<A>(), ps = 0;
      if (POS && __ballot_sync(kFull, lpm != ninf<A>())) {
        pm = cuda::warp_max(lpm);
        A lps = 0;
        if (pmask) {
#pragma unroll
          for (int k = 0; k < 8; ++k)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (pmask & (1u << (4 * k + e))) lps += dexp(xrow[4 * lane + 128 * k + e] - pm);
        }
        ps = cuda::warp_sum(lps);
      }
      if constexpr (hard) {
        for (int o = 16; o > 0; o >>= 1) {
          const A ov = __shfl_xor_sync(kFull, bv, o);
          const int oj = __shfl_xor_sync(kFull, bj, o);
          hard_merge(bv, bj, ov, oj);
        }
      }
      if (lane == 0) {
        A* out = static_cast<A*>(p.row_part) + (r * p.nslots + p.slot0 + blockIdx.x) * 2;
        out[0] = ws > A(0) ? wm + dlog(ws) : (ws == ws ? ninf<A>() : ws);
        out[1] = ps > A(0) ? pm + dlog(ps) : (ps == ps ? ninf<A>() : ps);
        if constexpr (hard) {
          const int64_t o = r * p.nct + blockIdx.x;
          static_cast<A*>(p.hard_val)[o] = bv;
          p.hard_idx[o] = bj == INT_MAX ? -1 : (int64_t)bj;
        }
      }
    }
    __syncthreads();  // x of every stage row in the tile

    // columns: thread tid owns columns tid + 256 k, one online rescale per stage
    if (cols) {
      int32_t rlo[kRS], rhi[kRS];
      bool rnone[kRS];
#pragma unroll
      for (int b = 0; b < kRS; ++b) {
        rlo[b] = srow[0][b];
        rhi[b] = srow[1][b];
        rnone[b] = srow[2][b] != 0;
      }
#pragma unroll
      for (int k = 0; k < KC; ++k) {
        const int cc = tid + k * kThreads;
        if (cc >= ncol) continue;
        const int32_t jlo = clo[cc], jhi = chi[cc];
        const bool jnone = cnone[cc] != 0;
        const int64_t dgr = ct0 + cc - p.diag_offset - p.i0 - rs;  // the stage row whose diagonal this is
        A xb[kRS];
        bool pc[kRS];
        A bm = cm[k], bpm = cpm[k];
#pragma unroll
        for (int b = 0; b < kRS; ++b) {
          if (b >= ns) break;
          xb[b] = xs[b * kTC + cc];
          const bool ov = max(rlo[b], jlo) <= min(rhi[b], jhi);
          pc[b] = ov || (dgr == b && (rnone[b] || jnone));
          bm = max(bm, xb[b]);
          if (pc[b]) bpm = max(bpm, xb[b]);
        }
        if (bm != ninf<A>()) {
          A acc = cs[k] * dexp(cm[k] - bm);
#pragma unroll
          for (int b = 0; b < kRS; ++b)
            if (b < ns) acc += dexp(xb[b] - bm);
          cs[k] = acc;
          cm[k] = bm;
        } else {
#pragma unroll
          for (int b = 0; b < kRS; ++b)
            if (b < ns && xb[b] != xb[b]) cs[k] = xb[b];  // NaN stays NaN
        }
        if (bpm != ninf<A>()) {
          A acc = cps[k] * dexp(cpm[k] - bpm);
#pragma unroll
          for (int b = 0; b < kRS; ++b)
            if (b < ns && pc[b]) acc += dexp(xb[b] - bpm);
          cps[k] = acc;
          cpm[k] = bpm;
        }
      }
    }
    __syncthreads();  // the tile is free for the next stage
  }
  if (cols) {
#pragma unroll
    for (int k = 0; k < KC; ++k) {
      if (tid + k * kThreads >= ncol) continue;
      A* out = static_cast<A*>(p.col_part) + ((int64_t)blockIdx.y * p.C + c0 + k * kThreads) * 2;
      out[0] = cs[k] > A(0) ? cm[k] + dlog(cs[k]) : (cs[k] == cs[k] ? ninf<A>() : cs[k]);
      out[1] = cps[k] > A(0) ? cpm[k] + dlog(cps[k]) : (cps[k] == cps[k] ? ninf<A>() : cps[k]);
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

// ---------------------------------------------------------------------------------------------------------
// Statistics pass v3 (TEMPOKERN_MPB_STATS=v3, opt-in until a GPU has timed it; float accumulation: float64
// runs v1): v1's outputs, grid and per-row warp reductions, with the per-element work cut to the arithmetic.
// v1's SASS (sm_90) has ~2,300 instructions of which ~500 integer compares, branches and divergence barriers
// (per-element validity tests, int64 diagonal tests, packed bools), one 4-byte load per score, and it reads
// float32 scores at 0.83 TB/s on the H100 (latency- and issue-bound at 25% occupancy). Here:
//  - thread t owns the 4 consecutive columns c0 + 4t + e (e < 4): one 16-byte (float) / 8-byte (half) load per
//    row (scalar loads when a row is not aligned: vec = 0, or at the end of a partial tile);
//  - the next batch of RB rows is loaded while the current one is computed (double buffer);
//  - no per-element validity branch: a column past C gets x = -inf and spans that overlap nothing (compiled
//    out in full tiles: FULL); the diagonal test is one int32 compare against the row's diagonal column
//    within the thread (dk); all -inf / NaN handling once per row and per column batch (reference 0 when the
//    max is -inf), none per element; positives (rare) under warp-uniform ballots.
// Per score (float32, no bias, no positive in the warp's batch): 0.25 loads, 2 (x), 3 (span overlap), 2
// (flags), 2 (row max), 3 (row exp), 1 + 3 (column max, exp) + the per-batch rescale: ~17 instructions.
template <typename ST> struct __align__(16) Sc4 {
  ST v[4];
};
template <> struct __align__(8) Sc4<__half> {
  __half v[4];
};
template <> struct __align__(8) Sc4<__nv_bfloat16> {
  __nv_bfloat16 v[4];
};

// The 4 scores at p[0..3] (nv of them valid, the rest 0): one vector load when all 4 are valid and vec.
template <typename ST, bool FULL>
__device__ __forceinline__ void load4(const ST* p, bool vec, int nv, float (&x)[4]) {
  if ((FULL || nv >= 4) && vec) {
    const Sc4<ST> u = *reinterpret_cast<const Sc4<ST>*>(p);
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = cuda::to_acc(u.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = (FULL || e < nv) ? cuda::to_acc(p[e]) : 0.0f;
  }
}

// Rows row0 .. row0 + n - 1 (n <= RB) of the thread's 4 columns into x (load4 each), zeros in the rows past n:
// a batch of the v3 statistics and gradient kernels.
template <typename ST, bool FULL>
__device__ __forceinline__ void load_rows4(const ST* S0, int64_t lds, int64_t row0, int n, bool vec, int nv,
                                           float (&x)[RB][4]) {
#pragma unroll
  for (int b = 0; b < RB; ++b) {
    if (b < n) {
      load4<ST, FULL>(S0 + (row0 + b) * lds, vec, nv, x[b]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) x[b][e] = 0.0f;
    }
  }
}

template <typename ST, int BM, bool POS, bool HARD, bool FULL>
__global__ void __launch_bounds__(kThreads, 2) mpb_fwd3_kernel(const MultiposBlockParams p, int vec) {
  using A = float;
  __shared__ A wpart[kWarps][32][4];
  __shared__ A hpv[HARD ? kWarps : 1][32];
  __shared__ int hpj[HARD ? kWarps : 1][32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr bool hard = POS && HARD;
  if (!FULL && (int64_t)(blockIdx.x + 1) * kTC <= p.C) return;  // the partial launch runs the last tile only
  if (FULL && (int64_t)(blockIdx.x + 1) * kTC > p.C) return;
  const int64_t cj = (int64_t)blockIdx.x * kTC + 4 * tid;  // the thread's first column
  const int nv = FULL ? 4 : (int)max((int64_t)0, min((int64_t)4, p.C - cj));
  const int64_t r0 = (int64_t)blockIdx.y * p.TR;
  const int64_t r1 = min(r0 + p.TR, p.R);
  const Ct<A> ct = inv_temp_dom<A>(p.inv_temp);
  const A half_span = (A)(0.5 * (double)(p.P - 1));
  const A* T = static_cast<const A*>(p.table);
  const bool cols = POS && p.cols;
  int32_t clo[4], chi[4];
  bool cnone[4];
  A ud[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const bool ok = FULL || e < nv;
    clo[e] = INT_MAX;
    chi[e] = INT_MIN;
    cnone[e] = false;
    ud[e] = A(0);
    if (ok) {
      if (POS) {
        clo[e] = p.d_lo[cj + e];
        chi[e] = p.d_hi[cj + e];
        cnone[e] = p.col_none[cj + e] != 0;
      }
      if (BM == 1) ud[e] = static_cast<const A*>(p.u_d)[cj + e];
    }
  }
  A cm[4], cs[4], cpm[4], cps[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    cm[e] = cpm[e] = ninf<A>();
    cs[e] = cps[e] = A(0);
  }
  const ST* S0 = static_cast<const ST*>(p.S) + cj;
  A sv[RB][4];
  load_rows4<ST, FULL>(S0, p.lds, r0, (int)min((int64_t)RB, r1 - r0), vec, nv, sv);
  for (int64_t rb = r0; rb < r1; rb += 32) {
    const int nr = (int)min((int64_t)32, r1 - rb);
    for (int rr0 = 0; rr0 < nr; rr0 += RB) {
      const int nb = min(RB, nr - rr0);
      // the next batch in flight while this one is computed
      const int64_t rn = rb + rr0 + RB;
      const int nn = (int)max((int64_t)0, min((int64_t)RB, r1 - rn));
      A svn[RB][4];
      load_rows4<ST, FULL>(S0, p.lds, rn, nn, vec, nv, svn);
      A xb[RB][4];
      bool pcb[RB][4];
      bool anyc = false;
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        const int rr = rr0 + b;
        const int64_t r = rb + min(rr, nr - 1), i = p.i0 + r;
        const RowCtx<A> rc = load_row<A, BM, POS>(p, i);
        // the row's diagonal column relative to the thread's first column (-1: not among its 4)
        const int64_t rel = i + p.diag_offset - cj;
        const int dk = (rel >= 0 && rel < nv) ? (int)rel : -1;
        const A* drow = BM == 2 ? static_cast<const A*>(p.dense) + r * p.ldb + cj : nullptr;
        bool prb[4];
        A lm = ninf<A>(), lpm = ninf<A>();
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const A sc = sv[b][e];
          A x = fma(sc, ct.hi, sc * ct.lo);
          if (BM == 1) {
            A slope, t;
            int64_t idx;
            x += Lg<A>::scale(table_bias<A>(T, p.P, half_span, ud[e] - rc.uq, slope, idx, t));
          }
          if (BM == 2 && (FULL || e < nv)) x += Lg<A>::scale(drow[e]);
          const bool live = b < nb && (FULL || e < nv);
          x = live ? x : ninf<A>();
          bool pr = false, pc = false;
          if (POS) {
            const bool ov = max(rc.lo, clo[e]) <= min(rc.hi, chi[e]);
            const bool dg = dk == e;
            pr = live && (ov || (rc.none && dg));
            pc = live && (ov || (dg && (rc.none || cnone[e])));
          }
          xb[b][e] = x;
          prb[e] = pr;
          pcb[b][e] = pc;
          anyc = anyc || pc;
          lm = max(lm, x);
          lpm = max(lpm, pr ? x : ninf<A>());
        }
        const A wm = cuda::warp_max(lm);
        const A ref = wm == ninf<A>() ? A(0) : wm;  // all -inf (or NaN): exp(x - 0) gives 0 (or NaN)
        A ls = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) ls += Lg<A>::ex(xb[b][e] - ref);
        const A ws = cuda::warp_sum(ls);
        A pm = ninf<A>(), ps = 0;
        if (POS) warp_pos_stats<A>(lpm, xb[b], prb, pm, ps);
        if constexpr (hard) {
          const bool ok[4] = {b < nb && (FULL || 0 < nv), b < nb && (FULL || 1 < nv), b < nb && (FULL || 2 < nv),
                              b < nb && (FULL || 3 < nv)};
          A bv;
          int bj;
          warp_hardest<A>(xb[b], prb, ok, cj, 1, bv, bj);
          if (lane == 0 && b < nb) {
            hpv[warp][rr] = bv;
            hpj[warp][rr] = bj;
          }
        }
        if (lane == 0 && b < nb) {
          wpart[warp][rr][0] = wm;
          wpart[warp][rr][1] = ws;
          wpart[warp][rr][2] = pm;
          wpart[warp][rr][3] = ps;
        }
      }
      if (cols) {  // column statistics of the batch: one rescale per batch (rows past nb are -inf: add 0)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          A bm = cm[e];
#pragma unroll
          for (int b = 0; b < RB; ++b) bm = max(bm, xb[b][e]);
          const A ref = bm == ninf<A>() ? A(0) : bm;
          A acc = cs[e] * Lg<A>::ex(cm[e] - ref);
#pragma unroll
          for (int b = 0; b < RB; ++b) acc += Lg<A>::ex(xb[b][e] - ref);
          cs[e] = acc;
          cm[e] = bm;
        }
        if (__ballot_sync(kFull, anyc) != 0u) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            A bpm = cpm[e];
#pragma unroll
            for (int b = 0; b < RB; ++b)
              if (pcb[b][e]) bpm = max(bpm, xb[b][e]);
            if (bpm != ninf<A>()) {
              A acc = cps[e] * Lg<A>::ex(cpm[e] - bpm);
#pragma unroll
              for (int b = 0; b < RB; ++b)
                if (pcb[b][e]) acc += Lg<A>::ex(xb[b][e] - bpm);
              cps[e] = acc;
              cpm[e] = bpm;
            }
          }
        }
      }
#pragma unroll
      for (int b = 0; b < RB; ++b)
#pragma unroll
        for (int e = 0; e < 4; ++e) sv[b][e] = svn[b][e];
    }
    __syncthreads();
    flush_rows<A>(p, wpart, rb, nr);
    if constexpr (hard) flush_hard<A>(p, hpv, hpj, rb, nr);
    __syncthreads();
  }
  if (cols) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!(FULL || e < nv)) continue;
      write_col_part<A>(p, cj + e, cm[e], cs[e], cpm[e], cps[e]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Gradient pass v3 (TEMPOKERN_MPB_GRAD=v3, opt-in until a GPU has timed it; float accumulation, float64 runs
// v1): mpb_bwd_kernel's outputs and arithmetic (pair_grad, table_scatter: the same numbers) with the layout of
// the v3 statistics pass. Thread t owns the 4 consecutive columns c0 + 4t + e: one 16-byte (float) / 8-byte
// (half) load of S and one 16- / 8-byte store of dS per row (scalar where a row is not aligned or at the end
// of a partial tile); the next batch of RB rows is loaded while the current one is computed; a FULL
// instantiation without per-element validity tests (a partial last tile gets its own launch); the diagonal
// test is one int32 compare per row (dk). v1 (measured on the H100: 232 us at B = 8,192, 1.7 TB/s for 6 bytes
// per float32-score / bf16-dS pair) issues 4-byte loads and 2-byte stores, one per column per row, with
// per-element validity and int64 diagonal tests.
template <typename OT, bool FULL>
__device__ __forceinline__ void store4(OT* p, bool vec, int nv, const float (&g)[4]) {
  if ((FULL || nv >= 4) && vec) {
    Sc4<OT> u;
#pragma unroll
    for (int e = 0; e < 4; ++e) u.v[e] = cuda::from_acc<OT>(g[e]);
    *reinterpret_cast<Sc4<OT>*>(p) = u;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (FULL || e < nv) p[e] = cuda::from_acc<OT>(g[e]);
  }
}

// vec: bit 0 = S rows 16-byte aligned, bit 1 = dS rows 16-byte aligned.
template <typename ST, typename OT, int BM, bool POS, bool FULL>
__global__ void __launch_bounds__(kThreads, 2) mpb_bwd3_kernel(const MultiposBlockParams p, int hist_smem, int vec) {
  using A = float;
  extern __shared__ unsigned char mpb_smem[];
  A* hs = reinterpret_cast<A*>(mpb_smem);  // table mode: the CTA's histogram of dL/dtable (P values)
  __shared__ A rowacc[32];
  const int tid = threadIdx.x, lane = tid & 31;
  if (!FULL && (int64_t)(blockIdx.x + 1) * kTC <= p.C) return;  // the partial launch runs the last tile only
  if (FULL && (int64_t)(blockIdx.x + 1) * kTC > p.C) return;
  const bool vin = (vec & 1) != 0, vout = (vec & 2) != 0;
  const int64_t cj = (int64_t)blockIdx.x * kTC + 4 * tid;  // the thread's first column
  const int nv = FULL ? 4 : (int)max((int64_t)0, min((int64_t)4, p.C - cj));
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
  const int64_t hid = (int64_t)blockIdx.y * p.nct + blockIdx.x;  // the same slot in the full and partial launches
  double* hist_g = p.hist + (hist_smem ? 0 : hid * p.P);
  if (table && hist_smem) {
    for (int64_t k = tid; k < p.P; k += kThreads) hs[k] = A(0);
  }
  if (tid < 32) rowacc[tid] = A(0);
  __syncthreads();

  Col<A> c[4];
  Lv<A> ca[4], cp[4];
  A dud[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t j = cj + e;
    if (FULL || e < nv) {
      c[e] = load_col<A, BM, POS>(p, j);
      if (cols) {
        ca[e] = to_dom<A>(cl[j]);
        cp[e] = to_dom<A>(cl[p.C + j]);
      }
    }
    dud[e] = A(0);
  }
  const ST* S0 = static_cast<const ST*>(p.S) + cj;
  OT* O0 = static_cast<OT*>(p.dS) + cj;
  A sv[RB][4];
  load_rows4<ST, FULL>(S0, p.lds, r0, (int)min((int64_t)RB, r1 - r0), vin, nv, sv);
  for (int64_t rb = r0; rb < r1; rb += 32) {
    const int nr = (int)min((int64_t)32, r1 - rb);
    for (int rr0 = 0; rr0 < nr; rr0 += RB) {
      const int nb = min(RB, nr - rr0);
      // the next batch in flight while this one is computed
      const int64_t rn = rb + rr0 + RB;
      const int nn = (int)max((int64_t)0, min((int64_t)RB, r1 - rn));
      A svn[RB][4];
      load_rows4<ST, FULL>(S0, p.lds, rn, nn, vin, nv, svn);
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        if (b >= nb) break;  // uniform
        const int64_t r = rb + rr0 + b, i = p.i0 + r;
        const RowCtx<A> rc = load_row<A, BM, POS>(p, i);
        const int64_t rel = i + p.diag_offset - cj;  // the row's diagonal column within the thread's 4 (or not)
        const int dk = (rel >= 0 && rel < nv) ? (int)rel : -1;
        const A* drow = BM == 2 ? static_cast<const A*>(p.dense) + r * p.ldb : nullptr;
        Lv<A> la, lp;
        if (rows) {
          la = to_dom<A>(__ldg(rl + i));
          if (POS) lp = to_dom<A>(__ldg(rl + p.Bq + i));
        }
        A rsum = 0, go[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          go[e] = A(0);
          if (!(FULL || e < nv)) continue;
          const int64_t j = cj + e;
          const Elem<A> el = element<A, BM, POS>(p, sv[b][e], drow, j, dk == e, rc, c[e], ct, half_span, T);
          const A g = pair_grad<A>(el, rows, cols, gr, gc, la, lp, ca[e], cp[e]);
          go[e] = g * it;
          if (BM == 2) G[r * p.ldo + j] = g;
          if (table) table_scatter<A>(el, g, dud[e], rsum, hist_smem, hs, hist_g);
        }
        store4<OT, FULL>(O0 + r * p.ldo, vout, nv, go);
        if (table) {
          const A wsum = cuda::warp_sum(rsum);
          if (lane == 0) atomicAdd(rowacc + rr0 + b, wsum);
        }
      }
#pragma unroll
      for (int b = 0; b < RB; ++b)
#pragma unroll
        for (int e = 0; e < 4; ++e) sv[b][e] = svn[b][e];
    }
    if (table) flush_duq<A>(p, rowacc, rb, nr);
  }
  if (table) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (FULL || e < nv) static_cast<A*>(p.dud_part)[(int64_t)blockIdx.y * p.C + cj + e] = dud[e];
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

void multipos_block_fwd2_cuda(const MultiposBlockParams& p, int device, uintptr_t stream) {
  check(p);
  if (p.R == 0 || p.C == 0) return;
  cuda::set_device(device);
  const dim3 grid((unsigned)p.nct, (unsigned)p.nrt);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_fwd(p.sdtype, p.adtype, [&](auto s, auto a) {
    using ST = decltype(s);
    using A = decltype(a);
    // 16-byte loads when every stage row starts on a 16-byte boundary
    const int vec = (reinterpret_cast<uintptr_t>(p.S) % 16 == 0) && ((p.lds * (int64_t)sizeof(ST)) % 16 == 0);
    dispatch_mode(p, [&](auto bm, auto pos) {
      constexpr int BM = decltype(bm)::value;
      constexpr bool POS = decltype(pos)::value;
      const size_t smem = (size_t)kRS * kTC * sizeof(A) + 2 * kTC * sizeof(int32_t) + (BM == 1 ? kTC * sizeof(A) : 0) +
                          kTC;
      auto run = [&](auto kern) {
        TK_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        kern<<<grid, kThreads, smem, st>>>(p, vec);
      };
      if (POS && p.hard_idx != nullptr)
        run(mpb_fwd2_kernel<ST, A, BM, POS, true>);
      else
        run(mpb_fwd2_kernel<ST, A, BM, POS, false>);
    });
  });
  cuda::check_launch();
}

void multipos_block_fwd3_cuda(const MultiposBlockParams& p, int device, uintptr_t stream) {
  if (p.adtype == DType::F64) {  // v3 is written for float accumulation; float64 runs v1
    multipos_block_fwd_cuda(p, device, stream);
    return;
  }
  check(p);
  if (p.R == 0 || p.C == 0) return;
  cuda::set_device(device);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const int64_t nfull = p.C / kTC;          // full 1024-column tiles: the FULL kernel
  const bool partial = p.C % kTC != 0;      // the last tile: the guarded kernel, launched over that tile only
  dispatch_fwd(p.sdtype, p.adtype, [&](auto s, auto a) {
    using ST = decltype(s);
    if constexpr (std::is_same<ST, double>::value) {
      throw std::runtime_error("multipos_block: v3 statistics take float / half scores");
    } else {
      const int vec = (reinterpret_cast<uintptr_t>(p.S) % 16 == 0) && ((p.lds * (int64_t)sizeof(ST)) % 16 == 0);
      dispatch_mode(p, [&](auto bm, auto pos) {
        constexpr int BM = decltype(bm)::value;
        constexpr bool POS = decltype(pos)::value;
        auto go = [&](auto hardc) {
          constexpr bool H = decltype(hardc)::value;
          const dim3 gfull((unsigned)nfull, (unsigned)p.nrt), glast((unsigned)(nfull + 1), (unsigned)p.nrt);
          if (nfull > 0) {
            mpb_fwd3_kernel<ST, BM, POS, H, true><<<gfull, kThreads, 0, st>>>(p, vec);
          }
          if (partial) {  // the last, partial tile: blockIdx.x = nfull in a grid of nfull + 1 (the others return)
            mpb_fwd3_kernel<ST, BM, POS, H, false><<<glast, kThreads, 0, st>>>(p, vec);
          }
        };
        if constexpr (POS) {
          if (p.hard_idx != nullptr)
            go(std::true_type{});
          else
            go(std::false_type{});
        } else {
          go(std::false_type{});
        }
      });
    }
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

void multipos_block_bwd3_cuda(const MultiposBlockParams& p, int device, uintptr_t stream) {
  if (p.adtype == DType::F64) {  // v3 is written for float accumulation; float64 runs v1
    multipos_block_bwd_cuda(p, device, stream);
    return;
  }
  check(p);
  if (p.R == 0 || p.C == 0) return;
  cuda::set_device(device);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  int optin = 0;
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int64_t nfull = p.C / kTC;      // full 1024-column tiles: the FULL kernel
  const bool partial = p.C % kTC != 0;  // the last tile: the guarded kernel, launched over that tile only
  const size_t hbytes = p.bias_mode == 1 ? (size_t)p.P * sizeof(float) : 0;
  const int hist_smem = hbytes > 0 && hbytes + 1024 <= (size_t)optin;
  const size_t smem = hist_smem ? hbytes : 0;
  dispatch_fwd(p.sdtype, p.adtype, [&](auto s, auto a) {
    using ST = decltype(s);
    if constexpr (std::is_same<ST, double>::value) {
      throw std::runtime_error("multipos_block: v3 gradients take float / half scores");
    } else {
      auto launch = [&](auto o) {
        using OT = decltype(o);
        const int vin = (reinterpret_cast<uintptr_t>(p.S) % 16 == 0) && ((p.lds * (int64_t)sizeof(ST)) % 16 == 0);
        const int vout = (reinterpret_cast<uintptr_t>(p.dS) % 16 == 0) && ((p.ldo * (int64_t)sizeof(OT)) % 16 == 0);
        const int vec = vin | (vout << 1);
        dispatch_mode(p, [&](auto bm, auto pos) {
          constexpr int BM = decltype(bm)::value;
          constexpr bool POS = decltype(pos)::value;
          auto kfull = mpb_bwd3_kernel<ST, OT, BM, POS, true>;
          auto klast = mpb_bwd3_kernel<ST, OT, BM, POS, false>;
          if (smem > 48 * 1024) {
            TK_CUDA_CHECK(cudaFuncSetAttribute(kfull, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            TK_CUDA_CHECK(cudaFuncSetAttribute(klast, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
          }
          const dim3 gfull((unsigned)nfull, (unsigned)p.nrt), glast((unsigned)(nfull + 1), (unsigned)p.nrt);
          if (nfull > 0) {
            mpb_bwd3_kernel<ST, OT, BM, POS, true><<<gfull, kThreads, smem, st>>>(p, hist_smem, vec);
          }
          if (partial) {  // the last, partial tile: blockIdx.x = nfull in a grid of nfull + 1 (the others return)
            mpb_bwd3_kernel<ST, OT, BM, POS, false><<<glast, kThreads, smem, st>>>(p, hist_smem, vec);
          }
        });
      };
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
// The glue kernels (TEMPOKERN_MPB_GLUE=fused): prep (spans and fallback flags) and fin (statistics merge,
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
