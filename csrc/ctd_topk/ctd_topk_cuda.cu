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
    out += w2[c] * (h > A(0) ? h : A(0));
  }
  return out;
}

template <typename A>
__device__ __forceinline__ A exact_bias(const CtdCudaParams& p, int64_t i, A uqv, A ugv, const A* feat) {
  const A d = ugv - uqv;
  const A* ends = static_cast<const A*>(p.bias_ends);
  if (d > A(1)) return ends[0];
  if (d < A(-1)) return ends[1];
  const A out = p.K == 16 ? exact_mlp<A, 32>(p, i, ugv, feat) : exact_mlp<A, 0>(p, i, ugv, feat);  // D = 32, 33
  return (A)(p.scale * ((double)out + p.b2));
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

void check_common(const CtdCudaParams& p) {
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

void ctd_topk_cuda_select(const CtdCudaParams& p, int device, uintptr_t stream) {
  cuda::set_device(device);
  check_common(p);
  if (!p.scores || p.s_stride < p.N) fail("ctd_topk (CUDA): bad score block");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const int64_t warps = p.Q * p.nslices;
  const int64_t blocks = (warps + SEL_WARPS - 1) / SEL_WARPS;
  if (blocks > INT_MAX) fail("ctd_topk (CUDA): too many (query, slice) pairs in one launch");
  if (p.dtype != DType::F64 && p.dtype != DType::F32) fail("ctd_topk (CUDA): the score block must be float32 or float64");
  with_mode(p.bias, [&](auto mode) {
    constexpr int M = decltype(mode)::value;
    if (p.dtype == DType::F64) {
      select_block<double, M><<<(unsigned)blocks, SEL_WARPS * 32, 0, st>>>(p);
    } else {
      select_block<float, M><<<(unsigned)blocks, SEL_WARPS * 32, 0, st>>>(p);
    }
  });
  cuda::check_launch();
}

void ctd_topk_cuda_scan(const CtdCudaParams& p, int device, uintptr_t stream) {
  cuda::set_device(device);
  check_common(p);
  if (p.Q > 4 || !p.q || !p.g || p.H < 1) fail("ctd_topk (CUDA): the scan pass takes 1 to 4 queries");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const int64_t blocks = (p.nslices + SCAN_WARPS - 1) / SCAN_WARPS;
  if (blocks > INT_MAX) fail("ctd_topk (CUDA): too many slices");
  cuda::dispatch_device_float(p.dtype, [&](auto t) {
    using S = decltype(t);
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
  });
}

}  // namespace tk
