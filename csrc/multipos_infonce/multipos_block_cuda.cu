// CUDA passes of the blocked multi-positive InfoNCE (see multipos_block.h for the math).
//
// Layout, both kernels: a CUDA block of 256 threads owns TR rows x 1024 columns of the score block; thread t
// owns columns c0 + t + 256 k (k < 4) and walks the rows 4 at a time, so every load instruction reads 256
// consecutive elements (coalesced), 16 loads per thread in flight, and every row of dS is written the same way. Column statistics (and dL/du_d) stay in the thread's
// registers; row statistics (and dL/du_q) are reduced per warp with shuffles and combined across the 8 warps
// in shared memory every 32 rows. The grid (nct x nrt) is sized by the driver to at least 4x the SM count.
// Bytes per element: forward reads S once (4 B for float32 scores); backward reads S and writes dS once.
#include <cuda_runtime.h>
#include <climits>
#include <cmath>
#include <limits>
#include <type_traits>
#include "common/cuda_utils.cuh"
#include "multipos_infonce/multipos_block.h"

namespace tk {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// exp through the SFU's exp2 with the rounding of x * log2(e) compensated: t = fl(x * L), the residual
// lo = x * L - t (one fma, plus x times the part of log2(e) that L misses), exp(x) = 2^t * (1 + lo ln 2).
// About as accurate as expf (a plain ex2(x * L) loses |x| * 2^-24 relative, 4x torch's error at |x| ~ 10).
__device__ __forceinline__ float ex2f(float t) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(t));
  return y;
#else
  return exp2f(t);
#endif
}
__device__ __forceinline__ float dexp(float x) {
  constexpr float L = 1.4426950408889634f, L_lo = 1.925963033500518e-08f, LN2 = 0.6931471805599453f;
  const float t = x * L;
  const float lo = fmaf(x, L, -t) + x * L_lo;
  const float y = ex2f(t);
  return fabsf(x) < 1e30f ? fmaf(y, lo * LN2, y) : y;  // +-inf (and NaN): the plain 2^t
}
__device__ __forceinline__ double dexp(double x) { return exp(x); }
__device__ __forceinline__ float dlog(float x) { return logf(x); }
__device__ __forceinline__ float dfloor(float x) { return floorf(x); }
__device__ __forceinline__ double dfloor(double x) { return ::floor(x); }
__device__ __forceinline__ double dlog(double x) { return log(x); }

template <typename A> __device__ __forceinline__ A ninf() { return -std::numeric_limits<A>::infinity(); }

// (m, s) <- (m, s) + exp(x) online, m the running max (s = 0 when empty).
template <typename A> __device__ __forceinline__ void online_add(A& m, A& s, A x) {
  if (x > m) {
    s = s * dexp(m - x) + A(1);
    m = x;
  } else {
    s += dexp(x - m);
  }
}

// Linear interpolation of the table at delta (clamped to [-1, 1]); slope = d bias / d delta (0 where the
// clamp bites), idx / t = the left bin and the weight of the right one. Same arithmetic as
// tempokern.reference.offset_bias_lookup.
template <typename A>
__device__ __forceinline__ A table_bias(const A* T, int64_t P, A half_span, A delta, A& slope, int64_t& idx, A& t) {
  const bool in = delta >= A(-1) && delta <= A(1);
  const A dc = delta < A(-1) ? A(-1) : (delta > A(1) ? A(1) : delta);
  const A x = (dc + A(1)) * half_span;
  A f = dfloor(x);
  if (!(f >= A(0))) f = A(0);  // also NaN
  if (f > A(P - 2)) f = A(P - 2);
  idx = (int64_t)f;
  t = x - f;
  const A v0 = __ldg(T + idx), v1 = __ldg(T + idx + 1);
  slope = in ? (v1 - v0) * half_span : A(0);
  return v0 + t * (v1 - v0);
}

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

template <typename A, int BM, bool POS>
__device__ __forceinline__ Elem<A> element(const MultiposBlockParams& p, A s, const A* dense_row, int64_t j, bool dg,
                                           const RowCtx<A>& rc, const Col<A>& c, A it, A half_span, const A* T) {
  Elem<A> e;
  e.x = s * it;
  e.slope = A(0);
  e.t = A(0);
  e.idx = 0;
  if (BM == 1) e.x += table_bias<A>(T, p.P, half_span, c.ud - rc.uq, e.slope, e.idx, e.t);
  if (BM == 2) e.x += dense_row[j];
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
          if (ws != A(0)) s += ws * dexp(wpart[w][tid][2 * k] - m);
        }
      lse[k] = s > A(0) ? m + dlog(s) : (s == s ? ninf<A>() : s);
    }
    A* out = static_cast<A*>(p.row_part) + ((rb + tid) * p.nslots + p.slot0 + blockIdx.x) * 2;
    out[0] = lse[0];
    out[1] = lse[1];
  }
}

// Hardest negative: (v, j) beats (bv, bj) if larger, or equal with a lower column (j = INT_MAX: none).
template <typename A> __device__ __forceinline__ void hard_merge(A& bv, int& bj, A v, int j) {
  if (v > bv || (v == bv && j < bj)) {
    bv = v;
    bj = j;
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
  const A it = (A)p.inv_temp;
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
                                                  c[k], it, half_span, T);
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
          if (c[k].valid) ls += wm != ninf<A>() ? dexp(xb[b][k] - wm) : (xb[b][k] != xb[b][k] ? xb[b][k] : A(0));
        const A ws = cuda::warp_sum(ls);
        A pm = ninf<A>(), ps = 0;
        if (POS && __ballot_sync(kFull, lpm != ninf<A>())) {
          pm = cuda::warp_max(lpm);
          A lps = 0;
#pragma unroll
          for (int k = 0; k < KC; ++k)
            if (pr[k]) lps += dexp(xb[b][k] - pm);
          ps = cuda::warp_sum(lps);
        }
        if constexpr (hard) {  // columns increase with k: strict > keeps the lowest one among a thread's ties
          A bv = ninf<A>();
          int bj = INT_MAX;
#pragma unroll
          for (int k = 0; k < KC; ++k)
            if (c[k].valid && !pr[k] && (bj == INT_MAX || xb[b][k] > bv)) {
              bv = xb[b][k];
              bj = (int)(c0 + k * kThreads);
            }
          for (int o = 16; o > 0; o >>= 1) {
            const A ov = __shfl_xor_sync(kFull, bv, o);
            const int oj = __shfl_xor_sync(kFull, bj, o);
            hard_merge(bv, bj, ov, oj);
          }
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
            A acc = cs[k] * dexp(cm[k] - bm);
#pragma unroll
            for (int b = 0; b < RB; ++b)
              if (b < nb) acc += dexp(xb[b][k] - bm);
            cs[k] = acc;
            cm[k] = bm;
          } else {
#pragma unroll
            for (int b = 0; b < RB; ++b)
              if (b < nb && xb[b][k] != xb[b][k]) cs[k] = xb[b][k];  // NaN stays NaN
          }
          if (bpm != ninf<A>()) {
            A acc = cps[k] * dexp(cpm[k] - bpm);
#pragma unroll
            for (int b = 0; b < RB; ++b)
              if (b < nb && pcb[b][k]) acc += dexp(xb[b][k] - bpm);
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
      A* out = static_cast<A*>(p.col_part) + ((int64_t)blockIdx.y * p.C + c0 + k * kThreads) * 2;
      out[0] = cs[k] > A(0) ? cm[k] + dlog(cs[k]) : (cs[k] == cs[k] ? ninf<A>() : cs[k]);
      out[1] = cps[k] > A(0) ? cpm[k] + dlog(cps[k]) : (cps[k] == cps[k] ? ninf<A>() : cps[k]);
    }
  }
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
  A ca[KC], cp[KC], dud[KC];
#pragma unroll
  for (int k = 0; k < KC; ++k) {
    const int64_t j = c0 + k * kThreads;
    c[k] = load_col<A, BM, POS>(p, j);
    ca[k] = cp[k] = dud[k] = A(0);
    if (c[k].valid && cols) {
      ca[k] = cl[j];
      cp[k] = cl[p.C + j];
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
        A la = 0, lp = 0;
        if (rows) {
          la = __ldg(rl + i);
          if (POS) lp = __ldg(rl + p.Bq + i);
        }
        A rsum = 0;
#pragma unroll
        for (int k = 0; k < KC; ++k) {
          if (!c[k].valid) continue;
          const int64_t j = c0 + k * kThreads;
          const Elem<A> e = element<A, BM, POS>(p, sv[b][k], drow, j, dd + k * kThreads == 0, rc, c[k], it,
                                                half_span, T);
          A g = 0;
          if (rows) g = gr * (dexp(e.x - la) - (e.pr ? dexp(e.x - lp) : A(0)));
          if (cols) g += gc * (dexp(e.x - ca[k]) - (e.pc ? dexp(e.x - cp[k]) : A(0)));
          Ob[b * p.ldo + k * kThreads] = cuda::from_acc<OT>(g * it);
          if (BM == 2) G[r * p.ldo + j] = g;
          if (table) {
            const A dD = g * e.slope;
            dud[k] += dD;
            rsum += dD;
            if (hist_smem) {
              atomicAdd(hs + e.idx, g - g * e.t);
              atomicAdd(hs + e.idx + 1, g * e.t);
            } else {
              atomicAdd(hist_g + e.idx, (double)(g - g * e.t));
              atomicAdd(hist_g + e.idx + 1, (double)(g * e.t));
            }
          }
        }
        if (table) {
          const A wsum = cuda::warp_sum(rsum);
          if (lane == 0) atomicAdd(rowacc + rr, wsum);
        }
      }
    }
    if (table) {
      __syncthreads();
      if (tid < nr) {
        static_cast<A*>(p.duq_part)[(rb + tid) * p.nct + blockIdx.x] = -rowacc[tid];
        rowacc[tid] = A(0);
      }
      __syncthreads();
    }
  }
  if (table) {
#pragma unroll
    for (int k = 0; k < KC; ++k)
      if (c[k].valid) static_cast<A*>(p.dud_part)[(int64_t)blockIdx.y * p.C + c0 + k * kThreads] = dud[k];
    if (hist_smem) {
      __syncthreads();
      double* h = p.hist + hid * p.P;
      for (int64_t k = tid; k < p.P; k += kThreads) h[k] += (double)hs[k];
    }
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

}  // namespace tk
