// CUDA passes of the blocked multi-positive InfoNCE (see multipos_block.h for the math).
//
// Layout, both kernels: a CUDA block of 256 threads owns TR rows x 256 columns of the score block; thread t
// owns column c0 + t and walks the rows, so every row of S is read as 256 consecutive elements (coalesced)
// and every row of dS is written the same way. Column statistics (and dL/du_d) stay in the thread's
// registers; row statistics (and dL/du_q) are reduced per warp with shuffles and combined across the 8 warps
// in shared memory every 32 rows. The grid (nct x nrt) is sized by the driver to at least 4x the SM count.
// Bytes per element: forward reads S once (4 B for float32 scores); backward reads S and writes dS once.
#include <cuda_runtime.h>
#include <cmath>
#include <limits>
#include "common/cuda_utils.cuh"
#include "multipos_infonce/multipos_block.h"

namespace tk {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float dexp(float x) { return expf(x); }
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

// Per-element context shared by both passes.
template <typename A> struct Col {
  int64_t lo = 0, hi = -1;
  bool none = false;
  A ud = 0;
};

template <typename A>
__device__ __forceinline__ Col<A> load_col(const MultiposBlockParams& p, int64_t j, bool jv) {
  Col<A> c;
  if (jv && p.pos) {
    c.lo = p.d_lo[j];
    c.hi = p.d_hi[j];
    c.none = p.col_none[j] != 0;
  }
  if (jv && p.bias_mode == 1) c.ud = static_cast<const A*>(p.u_d)[j];
  return c;
}

template <typename A> struct RowCtx {
  int64_t lo = 0, hi = -1;
  bool none = false;
  A uq = 0;
};

template <typename A>
__device__ __forceinline__ RowCtx<A> load_row(const MultiposBlockParams& p, int64_t i) {
  RowCtx<A> r;
  if (p.pos) {
    r.lo = p.q_lo[i];
    r.hi = p.q_hi[i];
    r.none = p.row_none[i] != 0;
  }
  if (p.bias_mode == 1) r.uq = static_cast<const A*>(p.u_q)[i];
  return r;
}

// Combine the 8 warps' (max, sum) partials of 32 rows and write (lse_all, lse_pos) per row.
template <typename A>
__device__ __forceinline__ void flush_rows(const MultiposBlockParams& p, A (*wpart)[32][4], int64_t rb, int64_t r1) {
  const int tid = threadIdx.x;
  if (tid < 32 && rb + tid < r1) {
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

template <typename ST, typename A>
__global__ void __launch_bounds__(kThreads) mpb_fwd_kernel(const MultiposBlockParams p) {
  __shared__ A wpart[kWarps][32][4];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t j = (int64_t)blockIdx.x * kThreads + tid;
  const bool jv = j < p.C;
  const int64_t r0 = (int64_t)blockIdx.y * p.TR;
  const int64_t r1 = min(r0 + p.TR, p.R);
  const ST* S = static_cast<const ST*>(p.S);
  const A it = (A)p.inv_temp;
  const A half_span = (A)(0.5 * (double)(p.P - 1));
  const A* T = static_cast<const A*>(p.table);
  const A* dense = static_cast<const A*>(p.dense);
  const Col<A> c = load_col<A>(p, j, jv);
  A cm = ninf<A>(), cs = 0, cpm = ninf<A>(), cps = 0;

  for (int64_t rb = r0; rb < r1; rb += 32) {
    const int nr = (int)min((int64_t)32, r1 - rb);
    for (int rr = 0; rr < nr; ++rr) {
      const int64_t r = rb + rr, i = p.i0 + r;
      const RowCtx<A> rc = load_row<A>(p, i);
      A x = ninf<A>();
      bool pr = false, pc = false;
      if (jv) {
        x = cuda::to_acc(S[r * p.lds + j]) * it;
        if (p.bias_mode == 1) {
          A slope, t;
          int64_t idx;
          x += table_bias<A>(T, p.P, half_span, c.ud - rc.uq, slope, idx, t);
        } else if (p.bias_mode == 2) {
          x += dense[r * p.ldb + j];
        }
        if (p.pos) {
          const bool ov = max(rc.lo, c.lo) <= min(rc.hi, c.hi);
          const bool dg = j == i + p.diag_offset;
          pr = ov || (rc.none && dg);
          pc = ov || (dg && (rc.none || c.none));
        }
      }
      // row partial of this warp's 32 columns
      const A wm = cuda::warp_max(x);
      const A ws = cuda::warp_sum(jv && wm != ninf<A>() ? dexp(x - wm) : A(0));
      A pm = ninf<A>(), ps = 0;
      if (__ballot_sync(kFull, pr)) {
        pm = cuda::warp_max(pr ? x : ninf<A>());
        ps = cuda::warp_sum(pr ? dexp(x - pm) : A(0));
      }
      if (lane == 0) {
        wpart[warp][rr][0] = wm;
        wpart[warp][rr][1] = ws;
        wpart[warp][rr][2] = pm;
        wpart[warp][rr][3] = ps;
      }
      if (jv && p.cols) {
        online_add(cm, cs, x);
        if (pc) online_add(cpm, cps, x);
      }
    }
    __syncthreads();
    flush_rows<A>(p, wpart, rb, rb + nr);
    __syncthreads();
  }
  if (jv && p.cols) {
    A* out = static_cast<A*>(p.col_part) + ((int64_t)blockIdx.y * p.C + j) * 2;
    out[0] = cs > A(0) ? cm + dlog(cs) : (cs == cs ? ninf<A>() : cs);
    out[1] = cps > A(0) ? cpm + dlog(cps) : (cps == cps ? ninf<A>() : cps);
  }
}

template <typename ST, typename OT, typename A>
__global__ void __launch_bounds__(kThreads) mpb_bwd_kernel(const MultiposBlockParams p, int hist_smem) {
  extern __shared__ unsigned char mpb_smem[];
  A* hs = reinterpret_cast<A*>(mpb_smem);  // table mode: the block's histogram of dL/dtable (P values)
  __shared__ A rowacc[32];
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t j = (int64_t)blockIdx.x * kThreads + tid;
  const bool jv = j < p.C;
  const int64_t r0 = (int64_t)blockIdx.y * p.TR;
  const int64_t r1 = min(r0 + p.TR, p.R);
  const ST* S = static_cast<const ST*>(p.S);
  OT* dS = static_cast<OT*>(p.dS);
  A* G = static_cast<A*>(p.G);
  const A it = (A)p.inv_temp, gr = (A)p.gr, gc = (A)p.gc;
  const bool rows = p.gr != 0.0, cols = p.cols && p.gc != 0.0;
  const bool table = p.bias_mode == 1;
  const A half_span = (A)(0.5 * (double)(p.P - 1));
  const A* T = static_cast<const A*>(p.table);
  const A* dense = static_cast<const A*>(p.dense);
  const A* rl = static_cast<const A*>(p.row_lse);
  const A* cl = static_cast<const A*>(p.col_lse);
  const int64_t hid = (int64_t)blockIdx.y * gridDim.x + blockIdx.x;
  double* hist_g = p.hist + (hist_smem ? 0 : hid * p.P);
  if (table && hist_smem) {
    for (int64_t k = tid; k < p.P; k += kThreads) hs[k] = A(0);
  }
  if (tid < 32) rowacc[tid] = A(0);
  __syncthreads();

  const Col<A> c = load_col<A>(p, j, jv);
  A ca = 0, cp = 0;
  if (jv && cols) {
    ca = cl[j];
    cp = cl[p.C + j];
  }
  A dud = 0;

  for (int64_t rb = r0; rb < r1; rb += 32) {
    const int nr = (int)min((int64_t)32, r1 - rb);
    for (int rr = 0; rr < nr; ++rr) {
      const int64_t r = rb + rr, i = p.i0 + r;
      const RowCtx<A> rc = load_row<A>(p, i);
      A dD = 0;
      if (jv) {
        A x = cuda::to_acc(S[r * p.lds + j]) * it;
        A slope = 0, t = 0;
        int64_t idx = 0;
        if (table) x += table_bias<A>(T, p.P, half_span, c.ud - rc.uq, slope, idx, t);
        else if (p.bias_mode == 2) x += dense[r * p.ldb + j];
        bool pr = false, pc = false;
        if (p.pos) {
          const bool ov = max(rc.lo, c.lo) <= min(rc.hi, c.hi);
          const bool dg = j == i + p.diag_offset;
          pr = ov || (rc.none && dg);
          pc = ov || (dg && (rc.none || c.none));
        }
        A g = 0;
        if (rows) {
          const A la = rl[i], lp = rl[p.Bq + i];
          g = gr * (dexp(x - la) - (pr ? dexp(x - lp) : A(0)));
        }
        if (cols) g += gc * (dexp(x - ca) - (pc ? dexp(x - cp) : A(0)));
        dS[r * p.ldo + j] = cuda::from_acc<OT>(g * it);
        if (p.bias_mode == 2) G[r * p.ldo + j] = g;
        if (table) {
          dD = g * slope;
          dud += dD;
          if (hist_smem) {
            atomicAdd(hs + idx, g - g * t);
            atomicAdd(hs + idx + 1, g * t);
          } else {
            atomicAdd(hist_g + idx, (double)(g - g * t));
            atomicAdd(hist_g + idx + 1, (double)(g * t));
          }
        }
      }
      if (table) {
        const A wsum = cuda::warp_sum(dD);
        if (lane == 0) atomicAdd(rowacc + rr, wsum);
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
    if (jv) static_cast<A*>(p.dud_part)[(int64_t)blockIdx.y * p.C + j] = dud;
    if (hist_smem) {
      __syncthreads();
      double* h = p.hist + hid * p.P;
      for (int64_t k = tid; k < p.P; k += kThreads) h[k] += (double)hs[k];
    }
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
  if (p.R < 0 || p.C < 0 || p.TR < 1 || p.nct != (p.C + kThreads - 1) / kThreads || p.nrt != (p.R + p.TR - 1) / p.TR)
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
    mpb_fwd_kernel<ST, A><<<grid, kThreads, 0, st>>>(p);
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
      auto kern = mpb_bwd_kernel<ST, OT, A>;
      if (smem > 48 * 1024)
        TK_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      mpb_bwd_kernel<ST, OT, A><<<grid, kThreads, smem, st>>>(p, hist_smem);
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
