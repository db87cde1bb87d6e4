// CUDA fused CTD top-k. Never run on a GPU yet: compiled, and tested on the CPU emulator (tools/cuda_emu).
// Kernel 1: a block owns 64 queries and one slice of the gallery; per 64-row gallery tile it
//   computes the 64 x 64 score tile in shared memory (fp16/bf16: tensor cores via wmma; fp32/fp64:
//   SIMT FMA; fp32 accumulation, fp64 for fp64),
//   adds the bias, and each warp updates 8 queries' candidate buffers in the workspace
//   (ballot-append, bitonic prune to the k best when full). At the end each buffer is sorted.
// Kernel 2: per query, merge the nsplit sorted partial lists (bitonic sort in shared memory).
// Memory: workspace (Q, nsplit, cap) with nsplit * k <= 2048; never Q x N.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <mma.h>
#include "common/cuda_utils.cuh"
#include "ctd_topk/ctd_topk.h"
#include "offset_bias/bias_math.h"

namespace tk {
namespace {

constexpr int BQ = 64, BN = 64, BK = 32, LD = 65, NT = 256;
constexpr int LDS = 68;  // score tile row stride: a multiple of 4 floats, as wmma::store_matrix_sync needs
constexpr int LDH = 40;  // fp16/bf16 tile row stride (elements): a multiple of 8, 32-byte aligned 16-row blocks

// fp16/bf16 score tiles run on tensor cores (wmma 16x16x16, fp32 accumulation)
template <typename S> struct TensorCore { static constexpr bool value = false; };
template <> struct TensorCore<__half> { static constexpr bool value = true; };
template <> struct TensorCore<__nv_bfloat16> { static constexpr bool value = true; };

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
__device__ void warp_bitonic(A* v, int64_t* ix, int n) {
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
__device__ void warp_fill(A* v, int64_t* ix, int from, int n) {
  for (int t = from + (threadIdx.x & 31); t < n; t += 32) { v[t] = neg_inf<A>(); ix[t] = LLONG_MAX; }
  __syncwarp();
}

// amat[i][kk][c]: the first layer folded with query i's angles (see ctd_topk_cpu.cpp).
template <typename A>
__global__ void build_amat(CtdTopkParams p) {
  const int64_t total = p.Q * p.K * p.hidden;
  const A* w1 = static_cast<const A*>(p.w1);
  const A* uq = static_cast<const A*>(p.u_q);
  const A* fr = static_cast<const A*>(p.freqs);
  A* am = static_cast<A*>(p.ws_bias);
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = e % p.hidden, kk = (e / p.hidden) % p.K, i = e / (p.hidden * p.K);
    const double a = (double)fr[kk] * (double)uq[i];
    const A sq = (A)sin(a), cq = (A)cos(a);
    const A ws = kk < p.D ? w1[c * p.D + kk] : A(0);
    const A wc = p.K + kk < p.D ? w1[c * p.D + p.K + kk] : A(0);
    A* m = am + i * 2 * p.K * p.hidden;
    m[kk * p.hidden + c] = ws * cq + wc * sq;
    m[(p.K + kk) * p.hidden + c] = wc * cq - ws * sq;
  }
}

template <typename S, typename A>
__global__ void __launch_bounds__(NT) score_partial(CtdTopkParams p, int64_t cap, int64_t per_split) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  A* Qs = reinterpret_cast<A*>(smem_raw);      // BK x LD
  A* Gs = Qs + BK * LD;                        // BK x LD
  A* Ss = Gs + BK * LD;                        // BQ x LDS
  A* ugs = Ss + BQ * LDS;                       // BN
  A* red = ugs + BN;                           // 4 x BN
  A* Fs = red + 4 * BN;                        // K2 x BN
  A* As = Fs + 2 * p.K * BN;                   // K2 x hidden

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t q0 = (int64_t)blockIdx.x * BQ;
  const int64_t split = blockIdx.y;
  const int64_t lo = split * per_split, hi = min(p.N, lo + per_split);
  const S* q = static_cast<const S*>(p.q);
  const S* g = static_cast<const S*>(p.g);
  const A* ug = static_cast<const A*>(p.u_g);
  const A* uq = static_cast<const A*>(p.u_q);
  const A temp = (A)p.temperature;
  const int K2 = (int)(2 * p.K), hid = (int)p.hidden;
  A* wsv = static_cast<A*>(p.ws_values);
  int64_t* wsi = p.ws_indices;

  // this warp's 8 queries: running count and threshold (uniform across the warp)
  int cnt[BQ / 8];
  A thr[BQ / 8];
#pragma unroll
  for (int r = 0; r < BQ / 8; ++r) { cnt[r] = 0; thr[r] = neg_inf<A>(); }

  const int ty = tid / 16, tx = tid % 16;
  for (int64_t n0 = lo; n0 < hi; n0 += BN) {
    if constexpr (TensorCore<S>::value) {
      using namespace nvcuda;
      S* Qh = reinterpret_cast<S*>(Qs);  // BQ x LDH, h innermost (aliases the fp32 tiles)
      S* Gh = reinterpret_cast<S*>(Gs);  // BN x LDH
      const S zero = cuda::from_acc<S>(0.f);
      const int wr = warp / 2, wc = (warp % 2) * 2;  // this warp's 16 x 32 piece of the 64 x 64 tile
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c0, c1;
      wmma::fill_fragment(c0, 0.f);
      wmma::fill_fragment(c1, 0.f);
      for (int64_t h0 = 0; h0 < p.H; h0 += BK) {
        for (int e = tid; e < BQ * BK; e += NT) {
          const int row = e / BK, col = e % BK;
          const int64_t qi = q0 + row, h = h0 + col, gj = n0 + row;
          Qh[row * LDH + col] = (qi < p.Q && h < p.H) ? q[qi * p.q_stride + h] : zero;
          Gh[row * LDH + col] = (gj < hi && h < p.H) ? g[gj * p.g_stride + h] : zero;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::row_major> fa;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::col_major> fb0, fb1;  // (k, n) = g[n][k]
          wmma::load_matrix_sync(fa, Qh + wr * 16 * LDH + kk, LDH);
          wmma::load_matrix_sync(fb0, Gh + wc * 16 * LDH + kk, LDH);
          wmma::load_matrix_sync(fb1, Gh + (wc + 1) * 16 * LDH + kk, LDH);
          wmma::mma_sync(c0, fa, fb0, c0);
          wmma::mma_sync(c1, fa, fb1, c1);
        }
        __syncthreads();
      }
      for (int t = 0; t < c0.num_elements; ++t) { c0.x[t] = c0.x[t] / (float)temp; c1.x[t] = c1.x[t] / (float)temp; }
      wmma::store_matrix_sync(reinterpret_cast<float*>(Ss) + wr * 16 * LDS + wc * 16, c0, LDS, wmma::mem_row_major);
      wmma::store_matrix_sync(reinterpret_cast<float*>(Ss) + wr * 16 * LDS + (wc + 1) * 16, c1, LDS,
                              wmma::mem_row_major);
    } else {
      A acc[4][4];
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b] = A(0);
      for (int64_t h0 = 0; h0 < p.H; h0 += BK) {
        for (int e = tid; e < BQ * BK; e += NT) {
          const int row = e / BK, col = e % BK;
          const int64_t qi = q0 + row, h = h0 + col, gj = n0 + row;
          Qs[col * LD + row] = (qi < p.Q && h < p.H) ? (A)cuda::to_acc(q[qi * p.q_stride + h]) : A(0);
          Gs[col * LD + row] = (gj < hi && h < p.H) ? (A)cuda::to_acc(g[gj * p.g_stride + h]) : A(0);
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < BK; ++kk) {
          A qa[4], gb[4];
#pragma unroll
          for (int a = 0; a < 4; ++a) qa[a] = Qs[kk * LD + ty + 16 * a];
#pragma unroll
          for (int b = 0; b < 4; ++b) gb[b] = Gs[kk * LD + tx + 16 * b];
#pragma unroll
          for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) acc[a][b] += qa[a] * gb[b];
        }
        __syncthreads();
      }
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) Ss[(ty + 16 * a) * LDS + tx + 16 * b] = acc[a][b] / temp;
    }
    if (p.bias != CtdBias::None && tid < BN) ugs[tid] = (n0 + tid < hi) ? ug[n0 + tid] : A(0);
    __syncthreads();

    if (p.bias == CtdBias::Table) {
      for (int e = tid; e < BQ * BN; e += NT) {
        const int r = e / BN, j = e % BN;
        if (q0 + r >= p.Q) continue;
        Ss[r * LDS + j] += bias::bias_table_lookup<A>(p.table, p.P, ugs[j] - uq[q0 + r]);
      }
      __syncthreads();
    } else if (p.bias == CtdBias::Exact) {
      const A* fr = static_cast<const A*>(p.freqs);
      for (int e = tid; e < (int)p.K * BN; e += NT) {
        const int kk = e / BN, j = e % BN;
        const double a = (double)fr[kk] * (double)ugs[j];
        Fs[kk * BN + j] = (A)sin(a);
        Fs[(p.K + kk) * BN + j] = (A)cos(a);
      }
      const A* b1 = static_cast<const A*>(p.b1);
      const A* w2 = static_cast<const A*>(p.w2);
      const A* ends = static_cast<const A*>(p.bias_ends);  // bias at delta = +1, -1
      const int j = tid % BN, grp = tid / BN;              // 4 groups split the hidden units
      for (int r = 0; r < BQ && q0 + r < p.Q; ++r) {
        const A* am = static_cast<const A*>(p.ws_bias) + (q0 + r) * K2 * hid;
        for (int e = tid; e < K2 * hid; e += NT) As[e] = am[e];
        __syncthreads();
        A part = A(0);
        for (int c = grp; c < hid; c += 4) {
          A h = b1[c];
          for (int kk = 0; kk < K2; ++kk) h += As[kk * hid + c] * Fs[kk * BN + j];
          part += w2[c] * (h > A(0) ? h : A(0));
        }
        red[grp * BN + j] = part;
        __syncthreads();
        if (grp == 0) {
          const A d = ugs[j] - uq[q0 + r];
          const A b = d > A(1) ? ends[0]
                    : (d < A(-1) ? ends[1]
                                 : (A)(p.scale * ((double)(red[j] + red[BN + j] + red[2 * BN + j] + red[3 * BN + j]) + p.b2)));
          Ss[r * LDS + j] += b;
        }
        // next iteration's As write is after this barrier
        __syncthreads();
      }
    }

    // candidates: warp w updates queries w*8 .. w*8+7
#pragma unroll
    for (int rr = 0; rr < BQ / 8; ++rr) {
      const int r = warp * (BQ / 8) + rr;
      const int64_t i = q0 + r;
      if (i >= p.Q) continue;  // warp-uniform
      A* bv = wsv + (i * p.nsplit + split) * cap;
      int64_t* bi = wsi + (i * p.nsplit + split) * cap;
      const int64_t* ex = p.exclude ? p.exclude + i * p.m : nullptr;
      for (int half = 0; half < BN / 32; ++half) {
        const int j = half * 32 + lane;
        const int64_t idx = n0 + j;
        const A s = Ss[r * LDS + j];
        bool take = idx < hi && s > thr[rr];
        if (take && ex) take = !in_sorted(ex, p.m, idx);
        const unsigned mask = __ballot_sync(0xffffffffu, take);
        if (!mask) continue;
        const int add = __popc(mask);
        if (cnt[rr] + add > cap) {
          warp_fill(bv, bi, cnt[rr], (int)cap);
          warp_bitonic(bv, bi, (int)cap);
          cnt[rr] = (int)p.k;
          thr[rr] = bv[p.k - 1];
          take = take && s > thr[rr];
          const unsigned m2 = __ballot_sync(0xffffffffu, take);
          if (!m2) continue;
          const int pos = cnt[rr] + __popc(m2 & ((1u << lane) - 1u));
          if (take) { bv[pos] = s; bi[pos] = idx; }
          cnt[rr] += __popc(m2);
        } else {
          const int pos = cnt[rr] + __popc(mask & ((1u << lane) - 1u));
          if (take) { bv[pos] = s; bi[pos] = idx; }
          cnt[rr] += add;
        }
        __syncwarp();
      }
    }
    __syncthreads();
  }
  // sort each buffer so its first k entries are this split's list
#pragma unroll
  for (int rr = 0; rr < BQ / 8; ++rr) {
    const int64_t i = q0 + warp * (BQ / 8) + rr;
    if (i >= p.Q) continue;
    A* bv = wsv + (i * p.nsplit + split) * cap;
    int64_t* bi = wsi + (i * p.nsplit + split) * cap;
    warp_fill(bv, bi, cnt[rr], (int)cap);
    warp_bitonic(bv, bi, (int)cap);
  }
}

template <typename A>
__global__ void __launch_bounds__(NT) merge_splits(CtdTopkParams p, int64_t cap, int M) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  int64_t* ix = reinterpret_cast<int64_t*>(smem_raw);
  A* v = reinterpret_cast<A*>(ix + M);
  const int64_t i = blockIdx.x;
  const A* wsv = static_cast<const A*>(p.ws_values) + i * p.nsplit * cap;
  const int64_t* wsi = p.ws_indices + i * p.nsplit * cap;
  for (int t = threadIdx.x; t < M; t += blockDim.x) {
    const int64_t sp = t / p.k, j = t % p.k;
    if (sp < p.nsplit) { v[t] = wsv[sp * cap + j]; ix[t] = wsi[sp * cap + j]; }
    else { v[t] = neg_inf<A>(); ix[t] = LLONG_MAX; }
  }
  __syncthreads();
  for (int size = 2; size <= M; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < M / 2; t += blockDim.x) {
        const int lo = 2 * t - (t & (stride - 1));
        const int hi = lo + stride;
        const bool up = (lo & size) == 0;
        A a = v[lo], b = v[hi];
        int64_t ia = ix[lo], ib = ix[hi];
        if (better(b, ib, a, ia) == up) { v[lo] = b; v[hi] = a; ix[lo] = ib; ix[hi] = ia; }
      }
      __syncthreads();
    }
  }
  A* out = static_cast<A*>(p.values) + i * p.k;
  int64_t* oi = p.indices + i * p.k;
  for (int t = threadIdx.x; t < p.k; t += blockDim.x) {
    const bool missing = v[t] == neg_inf<A>();
    out[t] = v[t];
    oi[t] = missing ? -1 : ix[t];
  }
}

template <typename S> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

template <typename S>
void launch(const CtdTopkParams& p, cudaStream_t st) {
  using A = typename AccOf<S>::type;
  const int64_t cap = p.cap;
  const int64_t tiles = (p.N + BN - 1) / BN;
  const int64_t per_split = (tiles + p.nsplit - 1) / p.nsplit * BN;
  if (p.bias == CtdBias::Exact) {
    const int64_t total = p.Q * p.K * p.hidden;
    const int blocks = (int)std::min<int64_t>((total + 255) / 256, 65535);
    build_amat<A><<<blocks, 256, 0, st>>>(p);
    cuda::check_launch();
  }
  const int64_t K2 = p.bias == CtdBias::Exact ? 2 * p.K : 0;
  const int64_t hid = p.bias == CtdBias::Exact ? p.hidden : 0;
  const size_t smem = sizeof(A) * (size_t)(2 * BK * LD + BQ * LDS + BN + 4 * BN + K2 * BN + K2 * hid);
  auto k1 = score_partial<S, A>;
  TK_CUDA_CHECK(cudaFuncSetAttribute(k1, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)((p.Q + BQ - 1) / BQ), (unsigned)p.nsplit);
  k1<<<grid, NT, smem, st>>>(p, cap, per_split);
  cuda::check_launch();
  int M = 1;
  while (M < p.nsplit * p.k) M <<= 1;
  const size_t smem2 = (size_t)M * (sizeof(A) + sizeof(int64_t));
  auto k2 = merge_splits<A>;
  TK_CUDA_CHECK(cudaFuncSetAttribute(k2, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem2));
  k2<<<(unsigned)p.Q, NT, smem2, st>>>(p, cap, M);
  cuda::check_launch();
}

}  // namespace

void ctd_topk_cuda(const CtdTopkParams& p, int device, uintptr_t stream) {
  cuda::set_device(device);
  if (p.nsplit < 1 || p.nsplit > 65535 || p.cap < p.k + 32 || (p.cap & (p.cap - 1)) != 0 || p.nsplit * p.k > 2048)
    fail("ctd_topk (CUDA): bad workspace geometry");
  if (p.bias == CtdBias::Exact && (2 * p.K > 64 || 2 * p.K * p.hidden > 4096 || !p.ws_bias || !p.bias_ends))
    fail("ctd_topk (CUDA): bias MLP too large for the fused kernel");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  cuda::dispatch_device_float(p.dtype, [&](auto t) { launch<decltype(t)>(p, st); });
}

}  // namespace tk
