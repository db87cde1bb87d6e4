// CUDA passes of the fused CTD top-k (driver: tempokern/_ops/ctd_topk.py; layouts: ctd_topk.h).
//
// select_block: the big products are cuBLAS's (the driver writes a Q x chunk score block with
//   torch.mm); this kernel is the one pass over that block: one warp per (query, slice of the block's
//   columns) reads its scores coalesced (8 x 128-byte loads in flight per warp), multiplies by 1/T (as
//   torch scales by a scalar on CUDA), adds the bias only where score + bias_ub can still beat the warp's
//   running k-th value (exact pruning), and appends the survivors with a ballot to its candidate buffer
//   in the workspace, bitonic-pruned to the k best when full. Per element: 4 (8) bytes read; the buffer
//   is touched only by candidates.
// scan_rows: Q <= 4 (serving). One warp per slice of gallery rows; the warp reads each row once with
//   16-byte loads (coalesced: the lanes cover consecutive 16-byte pieces of the row), multiplies with
//   the queries staged in shared memory, reduces with shuffles, and lane r keeps row r of each round of
//   32 rows; then the same bias + selection step as select_block. Bytes: N * H * sizeof(S) once.
// The driver merges the buffers' first k entries (stable sort: ties to the lower index).
// This header holds the kernels; the entry points are one file per pass (ctd_topk_cuda.cu: select,
// ctd_topk_scan_cuda.cu: scan, ctd_topk_serve_cuda.cu: serve), so that a parallel build compiles them side by side.
#pragma once
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstring>
#include "common/cuda_utils.cuh"
#include "ctd_topk/ctd_topk.h"
#include "offset_bias/bias_math.h"

namespace tk {
namespace {

constexpr int SEL_WARPS = 4;   // warps per CTA of select_block
constexpr int SCAN_WARPS = 8;  // warps per CTA of scan_rows
constexpr int SEL_UNROLL = 8;  // scores in flight per lane
constexpr int MAX_K2 = 64;     // 2K features of the exact bias (checked by the launcher)

struct alignas(16) Vec16 { unsigned int x, y, z, w; };

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -INFINITY; }
template <> __device__ __forceinline__ double neg_inf<double>() { return -(double)INFINITY; }

template <typename A>
__device__ __forceinline__ bool better(A sa, int64_t ia, A sb, int64_t ib) {
  return sa > sb || (sa == sb && ia < ib);
}

__device__ __forceinline__ bool in_sorted(const int64_t* row, int64_t m, int64_t x) {
  int64_t lo = 0, hi = m;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (row[mid] < x) lo = mid + 1; else hi = mid;
  }
  return lo < m && row[lo] == x;
}

// One warp sorts n (power of two) entries in global memory, best first.
template <typename A>
__device__ __noinline__ void warp_bitonic(A* v, int64_t* ix, int n) {
  const int lane = threadIdx.x & 31;
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = lane; t < n / 2; t += 32) {
        const int lo = 2 * t - (t & (stride - 1));
        const int hi = lo + stride;
        const bool up = (lo & size) == 0;  // this run sorts best-first
        A a = v[lo], b = v[hi];
        int64_t ia = ix[lo], ib = ix[hi];
        if (better(b, ib, a, ia) == up) { v[lo] = b; v[hi] = a; ix[lo] = ib; ix[hi] = ia; }
      }
      __syncwarp();
    }
  }
}

template <typename A>
__device__ __noinline__ void warp_fill(A* v, int64_t* ix, int from, int n) {
  for (int t = from + (threadIdx.x & 31); t < n; t += 32) { v[t] = neg_inf<A>(); ix[t] = LLONG_MAX; }
  __syncwarp();
}

// Warp-uniform call: lanes with `take` append (s, idx) to the buffer (bv, bi) of `cap` entries holding
// `cnt`; when it would overflow, it is sorted and cut to the k best and thr becomes the k-th value
// (a new entry must beat it strictly: its index is higher than every buffered one's).
template <typename A>
__device__ __forceinline__ void offer(A s, int64_t idx, bool take, A* bv, int64_t* bi, int& cnt, A& thr,
                                      int k, int cap) {
  const int lane = threadIdx.x & 31;
  take = take && s > thr;  // thr may have risen since the caller's test
  unsigned mask = __ballot_sync(0xffffffffu, take);
  if (!mask) return;
  if (cnt + __popc(mask) > cap) {
    warp_fill(bv, bi, cnt, cap);
    warp_bitonic(bv, bi, cap);
    cnt = k;
    thr = bv[k - 1];
    take = take && s > thr;
    mask = __ballot_sync(0xffffffffu, take);
    if (!mask) return;
  }
  const int pos = cnt + __popc(mask & ((1u << lane) - 1u));
  if (take) { bv[pos] = s; bi[pos] = idx; }
  cnt += __popc(mask);
  __syncwarp();
}

// The MLP of the exact bias for query i (row of amat) and a gallery row at ugv; feat: the row's 2K
// features or null (computed here in double). KC: 2K as a compile-time constant (the features and the
// first-layer rows then live in registers, loops unrolled), or 0 for any 2K <= MAX_K2.
template <typename A, int KC>
__device__ __forceinline__ A exact_mlp(const CtdCudaParams& p, int64_t i, A ugv, const A* feat) {
  constexpr int CAP = KC > 0 ? KC : MAX_K2;
  const int K2 = KC > 0 ? KC : (int)(2 * p.K), K = K2 / 2, hid = (int)p.hidden;
  A f[CAP];
  if (feat) {
#pragma unroll
    for (int kk = 0; kk < CAP; ++kk)
      if (kk < K2) f[kk] = feat[kk];
  } else {
    const A* fr = static_cast<const A*>(p.freqs);
#pragma unroll
    for (int kk = 0; kk < CAP / 2; ++kk) {
      if (kk < K) {
        const double a = (double)fr[kk] * (double)ugv;
        f[kk] = (A)sin(a);
        f[K + kk] = (A)cos(a);
      }
    }
  }
  const A* am = static_cast<const A*>(p.amat) + i * hid * K2;
  const A* b1 = static_cast<const A*>(p.b1);
  const A* w2 = static_cast<const A*>(p.w2);
  A out = A(0);
  for (int c = 0; c < hid; ++c) {
    const A* w = am + c * K2;  // the same address in every lane of the warp (one query): a broadcast
    A h0 = b1[c], h1 = A(0);   // two chains
#pragma unroll
    for (int kk = 0; kk < CAP; kk += 2) {
      if (kk < K2) h0 += w[kk] * f[kk];
      if (kk + 1 < K2) h1 += w[kk + 1] * f[kk + 1];
    }
    const A h = h0 + h1;
    out += w2[c] * (h <= A(0) ? A(0) : h);  // relu as torch's: NaN stays NaN
  }
  return out;
}

// end_hi / end_lo: the bias at delta = +1 / -1; b2, scale: the MLP's output bias and scale.
template <typename A>
__device__ __forceinline__ A exact_bias_with(const CtdCudaParams& p, int64_t i, A uqv, A ugv, const A* feat,
                                             A end_hi, A end_lo, double b2, double scale) {
  const A d = ugv - uqv;
  if (d > A(1)) return end_hi;
  if (d < A(-1)) return end_lo;
  const A out = p.K == 16 ? exact_mlp<A, 32>(p, i, ugv, feat) : exact_mlp<A, 0>(p, i, ugv, feat);  // D = 32, 33
  return (A)(scale * ((double)out + b2));
}

template <typename A>
__device__ __forceinline__ A exact_bias(const CtdCudaParams& p, int64_t i, A uqv, A ugv, const A* feat) {
  const A* ends = static_cast<const A*>(p.bias_ends);
  return exact_bias_with<A>(p, i, uqv, ugv, feat, ends[0], ends[1], p.b2, p.scale);
}

// MODE: the bias kind as a template argument, so the no-bias and table kernels carry none of the exact
// MLP's registers.
template <typename A, int MODE>
__device__ __forceinline__ void add_bias(const CtdCudaParams& p, int64_t i, A uqv, int64_t jloc, A& s, bool& take,
                                         A thr) {
  if constexpr (MODE == (int)CtdBias::None) return;
  if (!take) return;
  if (s + (A)p.bias_ub < thr) { take = false; return; }  // s + bias <= s + bias_ub < thr
  const A ugv = static_cast<const A*>(p.u_g)[jloc];
  if constexpr (MODE == (int)CtdBias::Table) {
    s += bias::bias_table_lookup<A>(p.table, p.P, ugv - uqv);
  } else {
    const A* feat = p.feats ? static_cast<const A*>(p.feats) + jloc * 2 * p.K : nullptr;
    s += exact_bias<A>(p, i, uqv, ugv, feat);
  }
}

template <typename A, int MODE>
__global__ void __launch_bounds__(SEL_WARPS * 32, MODE == (int)CtdBias::Exact ? 4 : 8) select_block(CtdCudaParams p) {
  __shared__ A stash[SEL_WARPS * SEL_UNROLL * 32];  // candidates' scores, per lane (rare path)
  const int lane = threadIdx.x & 31;
  const int64_t w = (int64_t)blockIdx.x * SEL_WARPS + (threadIdx.x >> 5);
  const int64_t i = w / p.nslices, sl = w % p.nslices;
  if (i >= p.Q) return;  // warp-uniform; this kernel has no block barrier
  const int64_t lo = sl * p.per_slice, hi = min(p.N, lo + p.per_slice);
  const A* row = static_cast<const A*>(p.scores) + i * p.s_stride;
  A* bv = static_cast<A*>(p.ws_values) + w * p.cap;  // w == i * nslices + sl
  int64_t* bi = p.ws_indices + w * p.cap;
  const A inv_t = A(1) / (A)p.temperature;  // s = dot * (1 / T), as torch scales by a scalar on CUDA
  A thr = p.thr_seed ? static_cast<const A*>(p.thr_seed)[i] : neg_inf<A>();
  int cnt = 0;
  const A uqv = p.bias != CtdBias::None ? static_cast<const A*>(p.u_q)[i] : A(0);
  const int64_t* ex = p.exclude ? p.exclude + i * p.m : nullptr;
  for (int64_t j0 = lo; j0 < hi; j0 += 32 * SEL_UNROLL) {
    A s[SEL_UNROLL];
#pragma unroll
    for (int u = 0; u < SEL_UNROLL; ++u) {
      const int64_t j = j0 + u * 32 + lane;
      s[u] = j < hi ? row[j] : A(0);
    }
    unsigned tm = 0;  // bit u: element u of this lane may enter (for a bias: s + bias_ub >= thr)
    const A ub = MODE == (int)CtdBias::None ? A(0) : (A)p.bias_ub;
#pragma unroll
    for (int u = 0; u < SEL_UNROLL; ++u) {
      const int64_t j = j0 + u * 32 + lane;
      s[u] *= inv_t;
      const bool may = MODE == (int)CtdBias::None ? s[u] > thr : !(s[u] + ub < thr);
      if (j < hi && may) tm |= 1u << u;
    }
    if (!__ballot_sync(0xffffffffu, tm != 0)) continue;  // the common case once thr has risen
    // rare path, one copy of the code (the bias MLP included): each lane stashes its own scores
    A* st = stash + (threadIdx.x >> 5) * SEL_UNROLL * 32 + lane;
#pragma unroll
    for (int u = 0; u < SEL_UNROLL; ++u) st[u * 32] = s[u];
#pragma unroll 1
    for (int u = 0; u < SEL_UNROLL; ++u) {
      const int64_t j = j0 + u * 32 + lane;
      bool take = (tm >> u) & 1u;
      A sv = st[u * 32];
      add_bias<A, MODE>(p, i, uqv, j, sv, take, thr);
      take = take && sv > thr;
      if (take && ex) take = !in_sorted(ex, p.m, p.col0 + j);
      offer<A>(sv, p.col0 + j, take, bv, bi, cnt, thr, (int)p.k, (int)p.cap);
    }
  }
  warp_fill(bv, bi, cnt, (int)p.cap);
  warp_bitonic(bv, bi, (int)p.cap);
}

template <typename S, typename A, int QM, int MODE>
__global__ void __launch_bounds__(SCAN_WARPS * 32) scan_rows(CtdCudaParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* qs = reinterpret_cast<A*>(smem_raw);  // (Q, H)
  const int Q = (int)p.Q;
  const int64_t H = p.H;
  const S* q = static_cast<const S*>(p.q);
  for (int64_t e = threadIdx.x; e < Q * H; e += blockDim.x)
    qs[e] = (A)cuda::to_acc(q[(e / H) * p.q_stride + e % H]);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t w = (int64_t)blockIdx.x * SCAN_WARPS + (threadIdx.x >> 5);
  if (w >= p.nslices) return;  // after the only block barrier; warp-uniform
  const int64_t lo = w * p.per_slice, hi = min(p.N, lo + p.per_slice);
  const S* g = static_cast<const S*>(p.g);
  constexpr int VW = 16 / (int)sizeof(S);
  const bool vec = (reinterpret_cast<uintptr_t>(g) % 16 == 0) && ((p.g_stride * (int64_t)sizeof(S)) % 16 == 0);
  const int64_t npieces = vec ? H / VW : 0;
  const int64_t tail0 = npieces * VW;  // [tail0, H): scalar loads
  const A inv_t = A(1) / (A)p.temperature;
  const A* uq = static_cast<const A*>(p.u_q);
  int cnt[QM];
  A thr[QM];
#pragma unroll
  for (int r = 0; r < QM; ++r) { cnt[r] = 0; thr[r] = neg_inf<A>(); }
  for (int64_t base = lo; base < hi; base += 32) {
    const int rows = (int)min((int64_t)32, hi - base);
    A mine[QM];
#pragma unroll
    for (int r = 0; r < QM; ++r) mine[r] = A(0);
    for (int rr = 0; rr < rows; ++rr) {
      const S* gr = g + (base + rr) * p.g_stride;
      A acc[QM];
#pragma unroll
      for (int r = 0; r < QM; ++r) acc[r] = A(0);
#pragma unroll 4
      for (int64_t pc = lane; pc < npieces; pc += 32) {
        const Vec16 raw = *reinterpret_cast<const Vec16*>(gr + pc * VW);  // one 16-byte load
        S e[VW];
        memcpy(e, &raw, sizeof(raw));  // not a pointer cast: that would break strict aliasing
#pragma unroll
        for (int t = 0; t < VW; ++t) {
          const A gv = (A)cuda::to_acc(e[t]);
#pragma unroll
          for (int r = 0; r < QM; ++r)
            if (r < Q) acc[r] += qs[r * H + pc * VW + t] * gv;
        }
      }
      for (int64_t h = tail0 + lane; h < H; h += 32) {
        const A gv = (A)cuda::to_acc(gr[h]);
#pragma unroll
        for (int r = 0; r < QM; ++r)
          if (r < Q) acc[r] += qs[r * H + h] * gv;
      }
#pragma unroll
      for (int r = 0; r < QM; ++r) {
        if (r < Q) {  // Q is uniform: every lane takes part in the shuffles
          const A t = cuda::warp_sum(acc[r]);
          if (lane == rr) mine[r] = t;
        }
      }
    }
    const int64_t j = base + lane;
    const bool valid = lane < rows;
#pragma unroll
    for (int r = 0; r < QM; ++r) {
      if (r >= Q) break;
      A* bv = static_cast<A*>(p.ws_values) + ((int64_t)r * p.nslices + w) * p.cap;
      int64_t* bi = p.ws_indices + ((int64_t)r * p.nslices + w) * p.cap;
      A s = mine[r] * inv_t;
      bool take = valid;
      add_bias<A, MODE>(p, r, MODE != (int)CtdBias::None ? uq[r] : A(0), j, s, take, thr[r]);
      take = take && s > thr[r];
      if (take && p.exclude) take = !in_sorted(p.exclude + r * p.m, p.m, j);
      offer<A>(s, j, take, bv, bi, cnt[r], thr[r], (int)p.k, (int)p.cap);
    }
  }
#pragma unroll
  for (int r = 0; r < QM; ++r) {
    if (r >= Q) break;
    A* bv = static_cast<A*>(p.ws_values) + ((int64_t)r * p.nslices + w) * p.cap;
    int64_t* bi = p.ws_indices + ((int64_t)r * p.nslices + w) * p.cap;
    warp_fill(bv, bi, cnt[r], (int)p.cap);
    warp_bitonic(bv, bi, (int)p.cap);
  }
}

// ---- serving path (Q <= 16): prep + serve_scan + merge_lists (ctd_topk_cuda_serve) -----------------------
// serve_scan: one warp per slice of gallery rows (2 CTAs of 8 warps per SM at 1M rows). A step takes R rows
//   (4, or 2 for QM = 16): every lane loads its 16-byte pieces of the R rows (R x 16 B in flight per piece,
//   two pieces unrolled), multiplies them with the queries staged in shared memory in the embeddings' dtype
//   (one 16-byte shared load per query and piece, reused for the R rows), then one butterfly reduce-scatter
//   per row gives the Q dot products in Q - 1 + 5 - log2(QM) shuffles (instead of 5 Q); they go to a
//   per-warp (32 x QM) score tile, and after 32 rows lane r owns row r's Q scores: bias (exact: the row's
//   2K features once, in double, only when some query needs them; the MLP with the query's folded first
//   layer from the prep kernel), exact pruning with the bound computed in the kernel's prologue, exclude,
//   and the warp's candidate buffer (offer) as in scan_rows. Bytes: N x H x sizeof(S) once + u_g.
// serve_prep (exact bias only, one tiny launch): the 1025 bound samples, the per-unit Lipschitz /
//   magnitude terms and the per-query first layer (Q, hidden, 2K): what _bias_setup / _amat compute with
//   torch, without a host sync (b2 and scale may be device scalars).
// merge_lists: per query, CTAs of 256 threads merge groups of sorted lists (the first k of each) into one
//   top-k: a shared buffer of M = pow2(k + 256) entries takes every entry better than the running k-th,
//   bitonic-sorted when full; two launches (groups of lists, then the groups) write (values, indices).
constexpr int SRV_WARPS = 8;
constexpr int MRG_THREADS = 256;
constexpr int BOUND_S = 1025;  // samples of the exact bias's bound (as _bias_setup in ctd_topk.py)
constexpr int PREP_THREADS = 128;

template <typename A>
__global__ void __launch_bounds__(PREP_THREADS) serve_prep(CtdCudaParams p) {
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  const int hid = (int)p.hidden, K = (int)p.K, K2 = 2 * K, D = (int)p.D;
  const A* w1 = static_cast<const A*>(p.w1);
  const A* b1 = static_cast<const A*>(p.b1);
  const A* w2 = static_cast<const A*>(p.w2);
  const A* fr = static_cast<const A*>(p.freqs);
  const double b2 = p.b2_dev ? *p.b2_dev : p.b2, scale = p.scale_dev ? *p.scale_dev : p.scale;
  auto w1p = [&](int c, int kk) -> double { return kk < D ? (double)w1[(int64_t)c * D + kk] : 0.0; };
  if (tid < BOUND_S) {
    const double delta = -1.0 + 2.0 * (double)tid / (double)(BOUND_S - 1);  // exact: +-1 at the ends
    double ph[MAX_K2];
    for (int kk = 0; kk < K; ++kk) {
      const double a = delta * (double)fr[kk];
      ph[kk] = sin(a);
      ph[K + kk] = cos(a);
    }
    double out = 0.0;
    for (int c = 0; c < hid; ++c) {
      double h = 0.0;
      for (int kk = 0; kk < K2; ++kk) h += ph[kk] * w1p(c, kk);
      h += (double)b1[c];
      out += (h > 0.0 ? h : 0.0) * (double)w2[c];
    }
    p.aux[tid] = scale * (out + b2);
  }
  for (int64_t c = tid; c < hid; c += nth) {
    double l = 0.0, m = fabs((double)b1[c]);
    for (int kk = 0; kk < K2; ++kk) {
      const double a = fabs(w1p((int)c, kk));
      l += a * (double)fr[kk % K];
      m += a;
    }
    p.aux[BOUND_S + c] = fabs((double)w2[c]) * l;
    p.aux[BOUND_S + hid + c] = fabs((double)w2[c]) * m;
  }
  A* am = static_cast<A*>(p.amat_out);
  const A* uq = static_cast<const A*>(p.u_q);
  for (int64_t e = tid; e < p.Q * hid * K; e += nth) {
    const int64_t i = e / ((int64_t)hid * K);
    const int c = (int)((e / K) % hid), kk = (int)(e % K);
    const double a = (double)uq[i] * (double)fr[kk];
    const double sq = sin(a), cq = cos(a), ws = w1p(c, kk), wc = w1p(c, K + kk);
    A* row = am + (i * hid + c) * K2;
    row[kk] = (A)(ws * cq + wc * sq);
    row[K + kk] = (A)(wc * cq - ws * sq);
  }
}

__device__ __forceinline__ double warp_max_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-uniform: the pruning bound of the bias (exact: from the prep kernel's samples, the same formula as
// _bias_setup; table: from the table's values), and the exact bias's ends bias(+1), bias(-1).
template <typename A, int MODE>
__device__ double serve_bound(const CtdCudaParams& p, double b2, double scale, A& end_hi, A& end_lo) {
  __shared__ double red[3][SRV_WARPS];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  double mx = -(double)INFINITY, s1 = 0.0, s2 = 0.0;
  if constexpr (MODE == (int)CtdBias::Exact) {
    for (int t = threadIdx.x; t < BOUND_S; t += blockDim.x) mx = fmax(mx, p.aux[t]);
    for (int64_t c = threadIdx.x; c < p.hidden; c += blockDim.x) {
      s1 += p.aux[BOUND_S + c];
      s2 += p.aux[BOUND_S + p.hidden + c];
    }
  } else {
    for (int64_t t = threadIdx.x; t < p.P; t += blockDim.x) {
      const double v = (double)p.table[t];
      mx = fmax(mx, v);
      s1 = fmax(s1, fabs(v));
    }
  }
  mx = warp_max_d(mx);
  s1 = MODE == (int)CtdBias::Exact ? cuda::warp_sum(s1) : warp_max_d(s1);
  s2 = cuda::warp_sum(s2);
  if (lane == 0) { red[0][wib] = mx; red[1][wib] = s1; red[2][wib] = s2; }
  __syncthreads();
  mx = red[0][0]; s1 = red[1][0]; s2 = red[2][0];
  for (int i = 1; i < SRV_WARPS; ++i) {
    mx = fmax(mx, red[0][i]);
    s1 = MODE == (int)CtdBias::Exact ? s1 + red[1][i] : fmax(s1, red[1][i]);
    s2 += red[2][i];
  }
  double ub;
  if constexpr (MODE == (int)CtdBias::Exact) {
    const double eps = sizeof(A) == 8 ? 2.220446049250313e-16 : 1.1920928955078125e-07;
    const double margin = fabs(scale) * (s1 / (BOUND_S - 1) + s2 * 64.0 * eps * (double)(2 * p.K + 8)) +
                          8.0 * eps * (fabs(mx) + fabs(scale) * fabs(b2));
    ub = mx + margin;
    ub = ub + 4 * eps * fabs(ub) + 4 * eps;
    end_hi = (A)p.aux[BOUND_S - 1];
    end_lo = (A)p.aux[0];
  } else {
    const double e32 = 1.1920928955078125e-07;
    ub = mx + 8.0 * e32 * s1;
    if (isfinite(ub)) ub = ub + 4 * e32 * fabs(ub) + 4 * e32;
  }
  return isfinite(ub) ? ub : (double)INFINITY;
}

// After the call lane l holds the warp's sum of v[l & (QM - 1)] (v is overwritten).
template <typename A, int QM>
__device__ __forceinline__ A reduce_scatter(A (&v)[QM], int lane) {
#pragma unroll
  for (int wd = QM / 2; wd >= 1; wd >>= 1) {
    const bool up = (lane & wd) != 0;
#pragma unroll
    for (int j = 0; j < wd; ++j) {
      const A send = up ? v[j] : v[j + wd];
      const A keep = up ? v[j + wd] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, wd);
    }
  }
  A t = v[0];
#pragma unroll
  for (int o = QM; o < 32; o <<= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

// The exact bias of query r and a gallery row at ugv (one copy of the MLP per kernel, not one per unrolled
// query): the row's features f (2K, computed here in double on the first call for the row: have_f) are
// shared by the queries.
template <typename A>
__device__ __noinline__ A serve_exact_bias(const CtdCudaParams& p, int r, A uqv, A ugv, A* f, bool& have_f,
                                           A end_hi, A end_lo, double b2, double scale) {
  const A d = ugv - uqv;
  if (d > A(1)) return end_hi;
  if (d < A(-1)) return end_lo;
  if (!have_f) {
    const A* fr = static_cast<const A*>(p.freqs);
    const int K = (int)p.K;
    for (int kk = 0; kk < K; ++kk) {
      const double a = (double)fr[kk] * (double)ugv;
      f[kk] = (A)sin(a);
      f[K + kk] = (A)cos(a);
    }
    have_f = true;
  }
  const A out = p.K == 16 ? exact_mlp<A, 32>(p, r, ugv, f) : exact_mlp<A, 0>(p, r, ugv, f);  // D = 32, 33
  return (A)(scale * ((double)out + b2));
}

template <typename S> __host__ __device__ constexpr int vec_width() { return 16 / (int)sizeof(S); }

template <typename S, typename A, int QM, int MODE>
__global__ void __launch_bounds__(SRV_WARPS * 32) serve_scan(CtdCudaParams p) {
  constexpr int VW = vec_width<S>();
  constexpr int R = QM >= 8 ? 2 : 4;  // rows per step
  constexpr int TS = QM + 1;          // score tile row stride (odd: conflict-free column reads)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int Q = (int)p.Q;
  const int64_t H = p.H, Hs = (H + VW - 1) / VW * VW;
  S* qs = reinterpret_cast<S*>(smem_raw);  // (Q, Hs) in S
  A* tiles = reinterpret_cast<A*>(smem_raw + (size_t)QM * Hs * sizeof(S));
  const S* q = static_cast<const S*>(p.q);
  for (int64_t e = threadIdx.x; e < (int64_t)Q * H; e += blockDim.x) qs[(e / H) * Hs + e % H] = q[(e / H) * p.q_stride + e % H];
  double b2 = p.b2, scale = p.scale, ubd = 0.0;
  A end_hi = A(0), end_lo = A(0);
  if constexpr (MODE == (int)CtdBias::Exact) {
    if (p.b2_dev) b2 = *p.b2_dev;
    if (p.scale_dev) scale = *p.scale_dev;
  }
  if constexpr (MODE != (int)CtdBias::None) ubd = serve_bound<A, MODE>(p, b2, scale, end_hi, end_lo);
  __syncthreads();
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int64_t w = (int64_t)blockIdx.x * SRV_WARPS + wib;
  if (w >= p.nslices) return;  // after the block barriers; warp-uniform
  A* tile = tiles + wib * 32 * TS;
  const int64_t lo = w * p.per_slice, hi = min(p.N, lo + p.per_slice);
  const S* g = static_cast<const S*>(p.g);
  const bool vec = (reinterpret_cast<uintptr_t>(g) % 16 == 0) && ((p.g_stride * (int64_t)sizeof(S)) % 16 == 0);
  const int64_t npieces = vec ? H / VW : 0;
  const int64_t tail0 = npieces * VW;
  const A inv_t = A(1) / (A)p.temperature;
  const A ub = (A)ubd;
  const A* uq = static_cast<const A*>(p.u_q);
  const A* ug = static_cast<const A*>(p.u_g);
  const int k = (int)p.k, cap = (int)p.cap;
  int cnt[QM];
  A thr[QM], uqv[QM];
#pragma unroll
  for (int r = 0; r < QM; ++r) {
    cnt[r] = 0;
    thr[r] = neg_inf<A>();
    uqv[r] = (MODE != (int)CtdBias::None && r < Q) ? uq[r] : A(0);
  }
  for (int64_t base = lo; base < hi; base += 32) {
    const int rows = (int)min((int64_t)32, hi - base);
    for (int r0 = 0; r0 < rows; r0 += R) {
      A acc[R][QM];
      const S* gr[R];
      bool ok[R];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        ok[rr] = r0 + rr < rows;
        gr[rr] = g + (base + (ok[rr] ? r0 + rr : 0)) * p.g_stride;
#pragma unroll
        for (int r = 0; r < QM; ++r) acc[rr][r] = A(0);
      }
#pragma unroll 2
      for (int64_t pc = lane; pc < npieces; pc += 32) {
        Vec16 raw[R];
#pragma unroll
        for (int rr = 0; rr < R; ++rr)
          raw[rr] = ok[rr] ? *reinterpret_cast<const Vec16*>(gr[rr] + pc * VW) : Vec16{0u, 0u, 0u, 0u};
        A gv[R][VW];
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
          S e[VW];
          memcpy(e, &raw[rr], sizeof(Vec16));  // not a pointer cast: strict aliasing
#pragma unroll
          for (int t = 0; t < VW; ++t) gv[rr][t] = (A)cuda::to_acc(e[t]);
        }
#pragma unroll
        for (int r = 0; r < QM; ++r) {
          if (r < Q) {
            const Vec16 qr = *reinterpret_cast<const Vec16*>(qs + r * Hs + pc * VW);
            S qe[VW];
            memcpy(qe, &qr, sizeof(Vec16));
#pragma unroll
            for (int t = 0; t < VW; ++t) {
              const A qv = (A)cuda::to_acc(qe[t]);
#pragma unroll
              for (int rr = 0; rr < R; ++rr) acc[rr][r] += qv * gv[rr][t];
            }
          }
        }
      }
      for (int64_t h = tail0 + lane; h < H; h += 32) {
        A gv[R];
#pragma unroll
        for (int rr = 0; rr < R; ++rr) gv[rr] = ok[rr] ? (A)cuda::to_acc(gr[rr][h]) : A(0);
#pragma unroll
        for (int r = 0; r < QM; ++r) {
          if (r < Q) {
            const A qv = (A)cuda::to_acc(qs[r * Hs + h]);
#pragma unroll
            for (int rr = 0; rr < R; ++rr) acc[rr][r] += qv * gv[rr];
          }
        }
      }
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        const A v = reduce_scatter<A, QM>(acc[rr], lane);
        if (lane < QM) tile[(r0 + rr) * TS + lane] = v;
      }
    }
    __syncwarp();
    const int64_t j = base + lane;
    const bool valid = lane < rows;
    const A ugv = (MODE != (int)CtdBias::None && valid) ? ug[j] : A(0);
    A f[MODE == (int)CtdBias::Exact ? MAX_K2 : 1];
    bool have_f = false;
#pragma unroll
    for (int r = 0; r < QM; ++r) {
      if (r >= Q) break;  // Q is uniform
      A* bv = static_cast<A*>(p.ws_values) + ((int64_t)r * p.nslices + w) * p.cap;
      int64_t* bi = p.ws_indices + ((int64_t)r * p.nslices + w) * p.cap;
      A s = valid ? tile[lane * TS + r] * inv_t : A(0);
      bool take = valid;
      if constexpr (MODE != (int)CtdBias::None) {
        if (take && s + ub < thr[r]) take = false;  // s + bias <= s + ub < thr: cannot enter
        if (take) {
          if constexpr (MODE == (int)CtdBias::Table) {
            s += bias::bias_table_lookup<A>(p.table, p.P, ugv - uqv[r]);
          } else {
            s += serve_exact_bias<A>(p, r, uqv[r], ugv, f, have_f, end_hi, end_lo, b2, scale);
          }
        }
      }
      take = take && s > thr[r];
      if (take && p.exclude) take = !in_sorted(p.exclude + r * p.m, p.m, j);
      offer<A>(s, j, take, bv, bi, cnt[r], thr[r], k, cap);
    }
    __syncwarp();  // the tile is rewritten by the next 32 rows
  }
#pragma unroll
  for (int r = 0; r < QM; ++r) {
    if (r >= Q) break;
    A* bv = static_cast<A*>(p.ws_values) + ((int64_t)r * p.nslices + w) * p.cap;
    int64_t* bi = p.ws_indices + ((int64_t)r * p.nslices + w) * p.cap;
    warp_fill(bv, bi, cnt[r], cap);
    warp_bitonic(bv, bi, cap);
  }
}

struct MergeArgs {
  const void* in_v = nullptr;
  const int64_t* in_i = nullptr;
  int64_t nl = 0, stride = 0, k = 0, lpc = 0, M = 0;
  void* out_v = nullptr;
  int64_t* out_i = nullptr;
  bool final_ = false;
};

// Block-uniform: sorts the buffer (cnt entries, the rest filled with missing entries) best first; the
// k-th entry becomes the threshold and the buffer keeps the k best.
template <typename A>
__device__ void block_prune(A* bv, int64_t* bi, int M, int k, int* cnt_s, A* tv_s, int64_t* ti_s) {
  const int c = *cnt_s;
  for (int t = c + (int)threadIdx.x; t < M; t += blockDim.x) { bv[t] = neg_inf<A>(); bi[t] = LLONG_MAX; }
  __syncthreads();
  for (int size = 2; size <= M; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < M / 2; t += blockDim.x) {
        const int lo = 2 * t - (t & (stride - 1));
        const int hi = lo + stride;
        const bool up = (lo & size) == 0;
        const A a = bv[lo], b = bv[hi];
        const int64_t ia = bi[lo], ib = bi[hi];
        if (better(b, ib, a, ia) == up) { bv[lo] = b; bv[hi] = a; bi[lo] = ib; bi[hi] = ia; }
      }
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) { *cnt_s = k; *tv_s = bv[k - 1]; *ti_s = bi[k - 1]; }
  __syncthreads();
}

template <typename A>
__global__ void __launch_bounds__(MRG_THREADS) merge_lists(MergeArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ int cnt_s;
  __shared__ A tv_s;
  __shared__ int64_t ti_s;
  const int M = (int)a.M, k = (int)a.k;
  A* bv = reinterpret_cast<A*>(smem_raw);
  int64_t* bi = reinterpret_cast<int64_t*>(smem_raw + (size_t)M * sizeof(A));
  const int64_t qi = blockIdx.y;
  const int64_t l0 = (int64_t)blockIdx.x * a.lpc, l1 = min(a.nl, l0 + a.lpc);
  const A* iv = static_cast<const A*>(a.in_v) + qi * a.nl * a.stride;
  const int64_t* ii = a.in_i + qi * a.nl * a.stride;
  if (threadIdx.x == 0) { cnt_s = 0; tv_s = neg_inf<A>(); ti_s = LLONG_MAX; }
  __syncthreads();
  for (int64_t base = l0 * k; base < l1 * k; base += MRG_THREADS) {
    const bool full = cnt_s + MRG_THREADS > M;
    __syncthreads();  // every thread has read cnt_s before any appends
    if (full) block_prune<A>(bv, bi, M, k, &cnt_s, &tv_s, &ti_s);
    const int64_t e = base + threadIdx.x;
    if (e < l1 * k) {
      const int64_t off = (e / k) * a.stride + e % k;
      const A v = iv[off];
      const int64_t ix = ii[off];
      if (better(v, ix, tv_s, ti_s)) {
        const int pos = atomicAdd(&cnt_s, 1);
        bv[pos] = v;
        bi[pos] = ix;
      }
    }
    __syncthreads();
  }
  block_prune<A>(bv, bi, M, k, &cnt_s, &tv_s, &ti_s);
  A* ov = static_cast<A*>(a.out_v) + (qi * gridDim.x + blockIdx.x) * k;
  int64_t* oi = a.out_i + (qi * gridDim.x + blockIdx.x) * k;
  for (int t = threadIdx.x; t < k; t += blockDim.x) {
    const A v = bv[t];
    ov[t] = v;
    oi[t] = (a.final_ && v == neg_inf<A>()) ? -1 : bi[t];
  }
}

template <typename S> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

template <int M> struct ModeTag { static constexpr int value = M; };

template <typename F> void with_mode(CtdBias b, F&& f) {
  switch (b) {
    case CtdBias::None: f(ModeTag<(int)CtdBias::None>{}); break;
    case CtdBias::Exact: f(ModeTag<(int)CtdBias::Exact>{}); break;
    case CtdBias::Table: f(ModeTag<(int)CtdBias::Table>{}); break;
  }
}

// The scan pass for one input dtype (ctd_topk_scan_<dtype>_cuda.cu instantiate it; ctd_topk_scan_cuda.cu checks).
template <typename S>
void launch_scan(const CtdCudaParams& p, cudaStream_t st, int64_t blocks) {
  using A = typename AccOf<S>::type;
  const size_t smem = sizeof(A) * (size_t)(p.Q * p.H);
  if (smem > 48 * 1024) fail("ctd_topk (CUDA): Q * H too large for the scan pass (48 KB of shared memory)");
  with_mode(p.bias, [&](auto mode) {
    constexpr int M = decltype(mode)::value;
    if (p.Q == 1) {
      scan_rows<S, A, 1, M><<<(unsigned)blocks, SCAN_WARPS * 32, smem, st>>>(p);
    } else {
      scan_rows<S, A, 4, M><<<(unsigned)blocks, SCAN_WARPS * 32, smem, st>>>(p);
    }
  });
  cuda::check_launch();
}

// The checks select and scan share.
inline void check_common(const CtdCudaParams& p) {
  if (p.Q < 1 || p.N < 1 || p.k < 1 || p.nslices < 1 || p.per_slice < 1 || p.cap < p.k + 32 || p.cap > (1 << 20) ||
      (p.cap & (p.cap - 1)) != 0 || !p.ws_values || !p.ws_indices)
    fail("ctd_topk (CUDA): bad workspace geometry");
  if (p.nslices * p.per_slice < p.N || (p.nslices - 1) * p.per_slice >= p.N)
    fail("ctd_topk (CUDA): slices must cover the columns, none empty");
  if (p.bias == CtdBias::Exact && (p.K < 1 || 2 * p.K > MAX_K2 || p.hidden < 1 || !p.amat || !p.bias_ends ||
                                   (!p.feats && !p.freqs)))
    fail("ctd_topk (CUDA): bad exact-bias arguments (2K <= 64)");
  if (p.bias == CtdBias::Table && (p.P < 2 || !p.table)) fail("ctd_topk (CUDA): bad bias table");
}

}  // namespace
}  // namespace tk
