// CUDA passes of the blocked Matryoshka InfoNCE, one level per launch (see matryoshka_block.h for the math).
//
// Layout (that of multipos_block_cuda.cu's v1 statistics and gradient kernels): a CUDA block of 256 threads
// owns TR rows x 1024 columns of the level's snapshot block G; thread t owns columns c0 + t + 256 k (k < 4)
// and walks the rows 4 at a time, so every load reads 256 consecutive elements (coalesced) and 16 loads per
// thread are in flight. Column state (statistics, dL/dkap, the column scale and spans) stays in registers; row
// statistics (and dL/drho) are reduced per warp with shuffles and combined across the 8 warps in shared memory
// every 32 rows. Bytes per element and level: forward reads G once; backward reads G, reads H (levels below the
// top one) and writes H once (and Ho with half operands, Gb with a bias).
#include <cuda_runtime.h>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include "common/cuda_math.cuh"
#include "common/cuda_utils.cuh"
#include "matryoshka_infonce/matryoshka_block.h"

namespace tk {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int KC = 4;  // columns per thread
constexpr int RB = 4;  // rows per load batch
constexpr int kTile = kThreads * KC;
constexpr unsigned kFull = 0xffffffffu;

using cuda::dexp;
using cuda::dlog;
using cuda::lse_of;
using cuda::ninf;

// The thread's KC columns: validity, spans, fallback flag and the column scale inv_temp * kap_j.
template <typename A, bool POS> struct Cols {
  bool valid[KC];
  int32_t lo[KC], hi[KC];
  bool none[KC];
  A ks[KC];
  __device__ __forceinline__ void load(const MrlBlockParams& p, int64_t c0, A it) {
    const A* kap = static_cast<const A*>(p.kap);
#pragma unroll
    for (int k = 0; k < KC; ++k) {
      const int64_t j = c0 + k * kThreads;
      valid[k] = j < p.C;
      lo[k] = 0;
      hi[k] = -1;
      none[k] = false;
      ks[k] = A(0);
      if (valid[k]) {
        ks[k] = it * kap[j];
        if (POS) {
          lo[k] = p.d_lo[j];
          hi[k] = p.d_hi[j];
          none[k] = p.col_none[j] != 0;
        }
      }
    }
  }
};

template <typename GT, typename A>
__device__ __forceinline__ void load_batch(const GT* Gb, int64_t ldg, int nb, const bool (&valid)[KC],
                                           A (&sv)[RB][KC]) {
#pragma unroll
  for (int b = 0; b < RB; ++b)
#pragma unroll
    for (int k = 0; k < KC; ++k) sv[b][k] = (b < nb && valid[k]) ? (A)cuda::to_acc(Gb[b * ldg + k * kThreads]) : A(0);
}

// Combine the 8 warps' (max, sum) partials of up to 32 rows and write (lse_all, lse_pos) per row.
template <typename A>
__device__ __forceinline__ void flush_rows(const MrlBlockParams& p, A (*wpart)[32][4], int64_t rb, int nr) {
  const int tid = threadIdx.x;
  if (tid < nr) {
    A lse[2];
    for (int k = 0; k < 2; ++k) {
      A m = ninf<A>();
      for (int w = 0; w < kWarps; ++w) m = max(m, wpart[w][tid][2 * k]);
      A s = 0;
      for (int w = 0; w < kWarps; ++w) {
        const A ws = wpart[w][tid][2 * k + 1];
        if (ws != A(0)) s += m != ninf<A>() ? ws * dexp(wpart[w][tid][2 * k] - m) : ws;  // (NaN stays NaN)
      }
      lse[k] = lse_of(m, s);
    }
    A* out = static_cast<A*>(p.row_part) + ((rb + tid) * p.nslots + p.slot0 + blockIdx.x) * 2;
    out[0] = lse[0];
    out[1] = lse[1];
  }
}

template <typename A, bool BIAS, bool POS>
__global__ void __launch_bounds__(kThreads) mrl_fwd_kernel(const MrlBlockParams p) {
  __shared__ A wpart[kWarps][32][4];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c0 = (int64_t)blockIdx.x * kTile + tid;
  const int64_t r0 = (int64_t)blockIdx.y * p.TR;
  const int64_t r1 = min(r0 + p.TR, p.R);
  const A it = (A)p.inv_temp;
  const A* rho = static_cast<const A*>(p.rho);
  Cols<A, POS> c;
  c.load(p, c0, it);
  A cm[KC], cs[KC], cpm[KC], cps[KC];
#pragma unroll
  for (int k = 0; k < KC; ++k) {
    cm[k] = cpm[k] = ninf<A>();
    cs[k] = cps[k] = A(0);
  }
  const bool cols = POS && p.cols;
  const int64_t dbase = c0 - (p.i0 + r0 + p.diag_offset);  // j - (i + off) at k = 0, row r0

  for (int64_t rb = r0; rb < r1; rb += 32) {
    const int nr = (int)min((int64_t)32, r1 - rb);
    for (int rr0 = 0; rr0 < nr; rr0 += RB) {
      A sv[RB][KC];
      load_batch<A, A>(static_cast<const A*>(p.G) + (rb + rr0) * p.ldg + c0, p.ldg, nr - rr0, c.valid, sv);
      A xb[RB][KC];
      bool pcb[RB][KC];
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        const int rr = rr0 + b;
        if (rr >= nr) break;  // uniform
        const int64_t r = rb + rr, i = p.i0 + r;
        const A rs = __ldg(rho + i);
        int32_t rlo = 0, rhi = -1;
        bool rnone = false, rfb = false;
        if (POS) {
          rlo = __ldg(p.q_lo + i);
          rhi = __ldg(p.q_hi + i);
          rnone = __ldg(p.row_none + i) != 0;
          rfb = p.row_fb ? __ldg(p.row_fb + i) != 0 : rnone;
        }
        const A* drow = BIAS ? static_cast<const A*>(p.dense) + r * p.ldb + c0 : nullptr;
        const int64_t dd = dbase - (r - r0);
        A lm = ninf<A>(), lpm = ninf<A>();
        bool pr[KC];
#pragma unroll
        for (int k = 0; k < KC; ++k) {
          pr[k] = pcb[b][k] = false;
          xb[b][k] = ninf<A>();
          if (c.valid[k]) {
            A x = sv[b][k] * rs * c.ks[k];
            if (BIAS) x += drow[k * kThreads];
            xb[b][k] = x;
            if (POS) {
              const bool ov = max(rlo, c.lo[k]) <= min(rhi, c.hi[k]);
              const bool dg = dd + k * kThreads == 0;
              pr[k] = ov || (rnone && dg);
              pcb[b][k] = ov || (dg && (rfb || c.none[k]));
            }
          }
          lm = max(lm, xb[b][k]);
          if (pr[k]) lpm = max(lpm, xb[b][k]);
        }
        const A wm = cuda::warp_max(lm);
        A ls = 0;
#pragma unroll
        for (int k = 0; k < KC; ++k)
          if (c.valid[k]) ls += wm != ninf<A>() ? dexp(xb[b][k] - wm) : (xb[b][k] != xb[b][k] ? xb[b][k] : A(0));
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
        if (lane == 0) {
          wpart[warp][rr][0] = wm;
          wpart[warp][rr][1] = ws;
          wpart[warp][rr][2] = pm;
          wpart[warp][rr][3] = ps;
        }
      }
      if (cols) {  // one rescale per batch of RB rows
        const int nb = min(RB, nr - rr0);
#pragma unroll
        for (int k = 0; k < KC; ++k) {
          if (!c.valid[k]) continue;
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
    __syncthreads();
  }
  if (cols) {
#pragma unroll
    for (int k = 0; k < KC; ++k) {
      if (!c.valid[k]) continue;
      A* out = static_cast<A*>(p.col_part) + ((int64_t)blockIdx.y * p.C + c0 + k * kThreads) * 2;
      out[0] = lse_of(cm[k], cs[k]);
      out[1] = lse_of(cpm[k], cps[k]);
    }
  }
}

template <typename OT, typename A, bool BIAS, bool POS, bool HO>
__global__ void __launch_bounds__(kThreads) mrl_bwd_kernel(const MrlBlockParams p) {
  __shared__ A rowacc[32];
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t c0 = (int64_t)blockIdx.x * kTile + tid;
  const int64_t r0 = (int64_t)blockIdx.y * p.TR;
  const int64_t r1 = min(r0 + p.TR, p.R);
  const A it = (A)p.inv_temp, gr = (A)p.gr, gc = (A)p.gc;
  const bool rows = p.gr != 0.0, cols = POS && p.cols && p.gc != 0.0, accum = p.accumulate;
  const A* rho = static_cast<const A*>(p.rho);
  const A* rl = static_cast<const A*>(p.row_lse);
  const A* cl = static_cast<const A*>(p.col_lse);
  A* Gb = static_cast<A*>(p.Gb);
  if (tid < 32) rowacc[tid] = A(0);
  __syncthreads();
  Cols<A, POS> c;
  c.load(p, c0, it);
  A ca[KC], cp[KC], dk[KC];
#pragma unroll
  for (int k = 0; k < KC; ++k) {
    ca[k] = cp[k] = dk[k] = A(0);
    if (c.valid[k] && cols) {
      ca[k] = cl[c0 + k * kThreads];
      cp[k] = cl[p.C + c0 + k * kThreads];
    }
  }
  const int64_t dbase = c0 - (p.i0 + r0 + p.diag_offset);

  for (int64_t rb = r0; rb < r1; rb += 32) {
    const int nr = (int)min((int64_t)32, r1 - rb);
    for (int rr0 = 0; rr0 < nr; rr0 += RB) {
      A sv[RB][KC], hv[RB][KC];
      load_batch<A, A>(static_cast<const A*>(p.G) + (rb + rr0) * p.ldg + c0, p.ldg, nr - rr0, c.valid, sv);
      if (accum) load_batch<A, A>(static_cast<const A*>(p.H) + (rb + rr0) * p.ldh + c0, p.ldh, nr - rr0, c.valid, hv);
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        const int rr = rr0 + b;
        if (rr >= nr) break;  // uniform
        const int64_t r = rb + rr, i = p.i0 + r;
        const A rs = __ldg(rho + i);
        int32_t rlo = 0, rhi = -1;
        bool rnone = false, rfb = false;
        if (POS) {
          rlo = __ldg(p.q_lo + i);
          rhi = __ldg(p.q_hi + i);
          rnone = __ldg(p.row_none + i) != 0;
          rfb = p.row_fb ? __ldg(p.row_fb + i) != 0 : rnone;
        }
        const A* drow = BIAS ? static_cast<const A*>(p.dense) + r * p.ldb + c0 : nullptr;
        A* hrow = static_cast<A*>(p.H) + r * p.ldh + c0;
        OT* horow = HO ? static_cast<OT*>(p.Ho) + r * p.ldh + c0 : nullptr;
        A* gbrow = BIAS ? Gb + r * p.ldh + c0 : nullptr;
        const int64_t dd = dbase - (r - r0);
        A la = 0, lp = 0;
        if (rows) {
          la = __ldg(rl + i);
          if (POS) lp = __ldg(rl + p.Bq + i);
        }
        A rsum = 0;
#pragma unroll
        for (int k = 0; k < KC; ++k) {
          if (!c.valid[k]) continue;
          const A gs = sv[b][k];
          A x = gs * rs * c.ks[k];
          if (BIAS) x += drow[k * kThreads];
          bool pr = false, pc = false;
          if (POS) {
            const bool ov = max(rlo, c.lo[k]) <= min(rhi, c.hi[k]);
            const bool dg = dd + k * kThreads == 0;
            pr = ov || (rnone && dg);
            pc = ov || (dg && (rfb || c.none[k]));
          }
          A g = 0;
          if (rows) g = gr * (dexp(x - la) - (pr ? dexp(x - lp) : A(0)));
          if (cols) g += gc * (dexp(x - ca[k]) - (pc ? dexp(x - cp[k]) : A(0)));
          const A t = g * gs;  // dz/drho_i = inv_temp kap_j G_ij, dz/dkap_j = inv_temp rho_i G_ij
          rsum += t * c.ks[k];
          dk[k] += t * rs;
          const A h = g * rs * c.ks[k];
          const A hn = accum ? hv[b][k] + h : h;
          hrow[k * kThreads] = hn;
          if (HO) horow[k * kThreads] = cuda::from_acc<OT>(hn);
          if (BIAS) gbrow[k * kThreads] = accum ? gbrow[k * kThreads] + g : g;
        }
        const A wsum = cuda::warp_sum(rsum);
        if (lane == 0) atomicAdd(rowacc + rr, wsum);
      }
    }
    __syncthreads();
    if (tid < nr) {
      static_cast<A*>(p.drho_part)[(rb + tid) * p.nct + blockIdx.x] = rowacc[tid];
      rowacc[tid] = A(0);
    }
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < KC; ++k)
    if (c.valid[k]) static_cast<A*>(p.dkap_part)[(int64_t)blockIdx.y * p.C + c0 + k * kThreads] = dk[k] * it;
}


// Every level in one launch ("bwd_all"): the thread walks its rows one at a time and, per row, the levels from
// the top down, so the suffix sum H = sum_{k >= l} h_k of its 4 elements stays in registers: per element and
// level one read of G_l and one write (H_l over G_l in place, or Ho_l in the half operand dtype), no H read /
// write pass per level; Gb (bias) written once. Column coefficients dL/dkap_l accumulate in shared memory
// (thread-owned columns: no atomics); the levels' column scales and statistics are read through the L1 cache
// (__ldg, reused by every row of the tile); dL/drho_l is reduced per warp and combined in shared memory every
// 32 rows.
template <typename OT, typename A, bool BIAS, bool POS, bool HO>
__global__ void __launch_bounds__(kThreads) mrl_bwd_all_kernel(const MrlBlockParams p) {
  extern __shared__ __align__(16) unsigned char mrl_all_smem[];
  const int K = (int)p.K;
  const bool cols = POS && p.cols;
  A* sdk = reinterpret_cast<A*>(mrl_all_smem);  // [K][kTile] dL/dkap partial sums
  __shared__ A rowacc[kMrlMaxLevels][32];
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t c0 = (int64_t)blockIdx.x * kTile + tid;
  const int64_t r0 = (int64_t)blockIdx.y * p.TR;
  const int64_t r1 = min(r0 + p.TR, p.R);
  const A it = (A)p.inv_temp;
  const A* rho = static_cast<const A*>(p.rho);
  const A* kap = static_cast<const A*>(p.kap);
  const A* rl = static_cast<const A*>(p.row_lse);
  const A* cl = static_cast<const A*>(p.col_lse);
  const A* coef = static_cast<const A*>(p.coef);
  bool valid[KC], cnone[KC];
  int32_t clo[KC], chi[KC];
#pragma unroll
  for (int k = 0; k < KC; ++k) {
    const int64_t j = c0 + k * kThreads;
    valid[k] = j < p.C;
    clo[k] = 0;
    chi[k] = -1;
    cnone[k] = false;
    if (POS && valid[k]) {
      clo[k] = p.d_lo[j];
      chi[k] = p.d_hi[j];
      cnone[k] = p.col_none[j] != 0;
    }
  }
  for (int l = 0; l < K; ++l) {
#pragma unroll
    for (int k = 0; k < KC; ++k) sdk[l * kTile + tid + k * kThreads] = A(0);
  }
  for (int idx = tid; idx < K * 32; idx += kThreads) rowacc[idx / 32][idx % 32] = A(0);
  __syncthreads();
  const int64_t dbase = c0 - (p.i0 + r0 + p.diag_offset);

  for (int64_t rb = r0; rb < r1; rb += 32) {
    const int nr = (int)min((int64_t)32, r1 - rb);
    for (int rr = 0; rr < nr; ++rr) {
      const int64_t r = rb + rr, i = p.i0 + r;
      int32_t rlo = 0, rhi = -1;
      bool rnone = false, rfb = false;
      if (POS) {
        rlo = __ldg(p.q_lo + i);
        rhi = __ldg(p.q_hi + i);
        rnone = __ldg(p.row_none + i) != 0;
        rfb = p.row_fb ? __ldg(p.row_fb + i) != 0 : rnone;
      }
      const int64_t dd = dbase - (r - r0);
      bool pr[KC], pc[KC];
      A bv[KC], hacc[KC], gsum[KC];
#pragma unroll
      for (int k = 0; k < KC; ++k) {
        pr[k] = pc[k] = false;
        if (POS) {
          const bool ov = max(rlo, clo[k]) <= min(rhi, chi[k]);
          const bool dg = dd + k * kThreads == 0;
          pr[k] = ov || (rnone && dg);
          pc[k] = ov || (dg && (rfb || cnone[k]));
        }
        bv[k] = (BIAS && valid[k]) ? static_cast<const A*>(p.dense)[r * p.ldb + c0 + k * kThreads] : A(0);
        hacc[k] = gsum[k] = A(0);
      }
      for (int l = K - 1; l >= 0; --l) {
        const A gr = coef[2 * l], gc = cols ? coef[2 * l + 1] : A(0);
        const bool rows = gr != A(0), colt = gc != A(0);
        const A rs = __ldg(rho + l * p.ldr + i);
        A la = 0, lp = 0;
        if (rows) {
          la = __ldg(rl + l * 3 * p.Bq + i);
          if (POS) lp = __ldg(rl + l * 3 * p.Bq + p.Bq + i);
        }
        A* grow = static_cast<A*>(const_cast<void*>(p.G)) + l * p.lsg + r * p.ldg + c0;
        A gv[KC];
#pragma unroll
        for (int k = 0; k < KC; ++k) gv[k] = valid[k] ? grow[k * kThreads] : A(0);
        A rsum = 0;
#pragma unroll
        for (int k = 0; k < KC; ++k) {
          if (!valid[k]) continue;
          const int cc = tid + k * kThreads;
          const A ks = it * __ldg(kap + l * p.ldk + c0 + k * kThreads);
          const A x = gv[k] * rs * ks + bv[k];
          A g = 0;
          if (rows) g = gr * (dexp(x - la) - (pr[k] ? dexp(x - lp) : A(0)));
          if (colt) {
            const A* cll = cl + l * 3 * p.C + c0 + k * kThreads;
            const A ca = __ldg(cll), cp = __ldg(cll + p.C);
            g += gc * (dexp(x - ca) - (pc[k] ? dexp(x - cp) : A(0)));
          }
          const A t = g * gv[k];
          rsum += t * ks;
          sdk[l * kTile + cc] += t * rs;
          hacc[k] += g * rs * ks;
          gsum[k] += g;
          if (HO)
            static_cast<OT*>(p.Ho)[l * p.lsh + r * p.ldh + c0 + k * kThreads] = cuda::from_acc<OT>(hacc[k]);
          else
            grow[k * kThreads] = hacc[k];  // H_l over G_l (the same thread read it above)
        }
        const A wsum = cuda::warp_sum(rsum);
        if (lane == 0) atomicAdd(&rowacc[l][rr], wsum);
      }
      if (BIAS) {
#pragma unroll
        for (int k = 0; k < KC; ++k)
          if (valid[k]) static_cast<A*>(p.Gb)[r * p.ldh + c0 + k * kThreads] = gsum[k];
      }
    }
    __syncthreads();
    for (int idx = tid; idx < K * nr; idx += kThreads) {
      const int l = idx / nr, rr = idx % nr;
      static_cast<A*>(p.drho_part)[((int64_t)l * p.R + rb + rr) * p.nct + blockIdx.x] = rowacc[l][rr];
      rowacc[l][rr] = A(0);
    }
    __syncthreads();
  }
  for (int l = 0; l < K; ++l) {
#pragma unroll
    for (int k = 0; k < KC; ++k)
      if (valid[k])
        static_cast<A*>(p.dkap_part)[((int64_t)l * p.nrt + blockIdx.y) * p.C + c0 + k * kThreads] =
            sdk[l * kTile + tid + k * kThreads] * it;
  }
}

template <typename F> void dispatch_mode(const MrlBlockParams& p, F&& f) {
  if (!p.pos) {
    if (p.dense) throw std::runtime_error("mrl_block: an extra-negative block takes no bias");
    f(std::false_type{}, std::false_type{});
  } else if (p.dense) {
    f(std::true_type{}, std::true_type{});
  } else {
    f(std::false_type{}, std::true_type{});
  }
}

void check(const MrlBlockParams& p) {
  if (p.R < 0 || p.C < 0 || p.TR < 1 || p.nct != (p.C + kTile - 1) / kTile || p.nrt != (p.R + p.TR - 1) / p.TR)
    throw std::runtime_error("mrl_block: inconsistent tiling");
  if (p.nrt > 65535) throw std::runtime_error("mrl_block: too many row tiles (raise TR)");
  if (p.gdtype != p.adtype) throw std::runtime_error("mrl_block: the snapshots must be in the accumulation dtype");
  if (p.adtype != DType::F32 && p.adtype != DType::F64) throw std::runtime_error("mrl_block: bad accumulation dtype");
}

}  // namespace

void mrl_block_fwd_cuda(const MrlBlockParams& p, int device, uintptr_t stream) {
  check(p);
  if (p.R == 0 || p.C == 0) return;
  cuda::set_device(device);
  const dim3 grid((unsigned)p.nct, (unsigned)p.nrt);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  auto run = [&](auto a) {
    using A = decltype(a);
    dispatch_mode(p, [&](auto bias, auto pos) {
      mrl_fwd_kernel<A, decltype(bias)::value, decltype(pos)::value><<<grid, kThreads, 0, st>>>(p);
    });
  };
  if (p.adtype == DType::F64) run(double{}); else run(float{});
  cuda::check_launch();
}

void mrl_block_bwd_cuda(const MrlBlockParams& p, int device, uintptr_t stream) {
  check(p);
  if (p.R == 0 || p.C == 0) return;
  cuda::set_device(device);
  const dim3 grid((unsigned)p.nct, (unsigned)p.nrt);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  auto launch = [&](auto o, auto a, auto ho) {
    using OT = decltype(o);
    using A = decltype(a);
    dispatch_mode(p, [&](auto bias, auto pos) {
      constexpr bool B_ = decltype(bias)::value, P_ = decltype(pos)::value, H_ = decltype(ho)::value;
      mrl_bwd_kernel<OT, A, B_, P_, H_><<<grid, kThreads, 0, st>>>(p);
    });
  };
  if (p.adtype == DType::F64) {
    if (p.Ho) throw std::runtime_error("mrl_block: float64 accumulation takes no half-precision Ho");
    launch(double{}, double{}, std::false_type{});
  } else if (!p.Ho) {
    launch(float{}, float{}, std::false_type{});
  } else {
    switch (p.odtype) {
      case DType::F16: launch(__half{}, float{}, std::true_type{}); break;
      case DType::BF16: launch(__nv_bfloat16{}, float{}, std::true_type{}); break;
      default: throw std::runtime_error("mrl_block: Ho must be float16 or bfloat16");
    }
  }
  cuda::check_launch();
}


void mrl_block_bwd_all_cuda(const MrlBlockParams& p, int device, uintptr_t stream) {
  check(p);
  if (p.K < 1 || p.K > kMrlMaxLevels) throw std::runtime_error("mrl_block: bwd_all takes 1..32 levels");
  if (p.R == 0 || p.C == 0) return;
  cuda::set_device(device);
  const dim3 grid((unsigned)p.nct, (unsigned)p.nrt);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  int optin = 0;
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t asz = p.adtype == DType::F64 ? 8 : 4;
  const size_t smem = (size_t)p.K * kTile * asz;
  if (smem + (size_t)kMrlMaxLevels * 32 * asz > (size_t)optin)
    throw std::runtime_error("mrl_block: too many levels for one bwd_all launch's shared memory");
  auto launch = [&](auto o, auto a, auto ho) {
    using OT = decltype(o);
    using A = decltype(a);
    dispatch_mode(p, [&](auto bias, auto pos) {
      constexpr bool B_ = decltype(bias)::value, P_ = decltype(pos)::value, H_ = decltype(ho)::value;
      auto kern = mrl_bwd_all_kernel<OT, A, B_, P_, H_>;
      TK_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      kern<<<grid, kThreads, smem, st>>>(p);
    });
  };
  if (p.adtype == DType::F64) {
    if (p.Ho) throw std::runtime_error("mrl_block: float64 accumulation takes no half-precision Ho");
    launch(double{}, double{}, std::false_type{});
  } else if (!p.Ho) {
    launch(float{}, float{}, std::false_type{});
  } else {
    switch (p.odtype) {
      case DType::F16: launch(__half{}, float{}, std::true_type{}); break;
      case DType::BF16: launch(__nv_bfloat16{}, float{}, std::true_type{}); break;
      default: throw std::runtime_error("mrl_block: Ho must be float16 or bfloat16");
    }
  }
  cuda::check_launch();
}

}  // namespace tk
