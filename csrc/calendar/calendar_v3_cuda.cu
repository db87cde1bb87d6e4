// calendar_context on CUDA, v3: row tiles through a register prefetch pipeline, the per-level mixtures as small
// register-blocked products from shared memory (the default for float32 / float16 / bfloat16 when every level has
// <= 32 classes and dim is a multiple of 4, <= 128; docs/calendar.md, "v3").
//
// Why (counts in docs/calendar.md): v1 / v2 issue their loads one row group at a time and then compute, so an SM
// holds few bytes in flight (the measured kernels ran at ~40 % of the copy bandwidth, 0.88 + 1.15 ms against a
// 0.77 ms floor for fwd + bwd at 1M rows). Here a CTA (256 threads, 2 per SM) walks 64-row tiles grid-stride and
// issues the NEXT tile's loads (forward: the logits of its <= 3 levels; backward: one level's logits and upstream
// gradient columns) before it computes the current one, so every SM keeps 2 x 14-25 KB of reads in flight.
//
// Thread t owns row r = t / 4 of the tile and classes q, q + 4, ... (q = t % 4) of each level: it loads them, and
// the row's softmax statistics are 4 lanes' partial max / sum merged by 2 shuffles (xor 1, 2).
//   forward, per tile: p = softmax(x / tau) per level into P^T[class][row] (shared), then per level
//     out[r, j] = sum_c p[r, c] T[c, j] with a 4 rows x 4 columns micro-tile per thread (two 16-byte shared loads
//     per 16 FMA), stored straight from the registers (16-byte stores, 256 contiguous bytes per row and warp).
//   backward, per (tile, level): the upstream gradient columns into G[row][j] (shared), dp[r, c] = <g_r, T[c]>
//     with a RR rows x 2 classes micro-tile (RR = 4 for levels of more than 16 classes, else 2) into dP^T, then
//     d logit_c = p_c (dp_c - sum_k p_k dp_k) / tau by the row's 4 lanes (p recomputed from the logits kept in
//     registers), stored to the contiguous (B, n) gradient.
// The Fourier tables of the launch's levels are copied once per CTA into shared memory (rows of dim + 4 floats).
// Launches take 1-3 levels (Python feeds longer hierarchies in chunks).
#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <string>
#include "calendar/calendar.h"
#include "common/cuda_utils.cuh"

namespace tk {
namespace {
using namespace tk::cuda;

namespace v3 {

constexpr int kThreads = 256;
constexpr int kTR = 64;        // rows per tile: 4 threads per row
constexpr int kLdP = kTR + 4;  // row stride (floats) of the transposed tiles P^T and dP^T (16-byte rows)
constexpr int kMaxN = 32;      // classes per level
constexpr int kPerLane = kMaxN / 4;
constexpr int kMaxG = 8;       // backward: 16-byte gradient vectors per thread (dim <= 128)
constexpr int kMinCtas = 2;    // resident CTAs per SM the register allocation must allow (<= 128 registers)

struct __align__(16) F4 {
  float v[4];
};
template <typename S> struct alignas(4 * sizeof(S)) V4 {
  S v[4];
};

__host__ __device__ __forceinline__ int ldt_of(int D) { return D + 4; }

[[noreturn]] inline void fail_v3(const char* what) {
  throw std::invalid_argument(std::string("tempokern: the v3 calendar_context kernels ") + what);
}

// The launch's Fourier tables (CUDA forward layout (n, roundup(dim, 32)), float) into Ts[class][dim + 4].
template <int NL>
__device__ __forceinline__ void stage_tables(float* Ts, const CalendarParams& p) {
  const int D = (int)p.dim, ldt = ldt_of(D), Dp = (D + 31) / 32 * 32;
  int c0 = 0;
#pragma unroll
  for (int l = 0; l < NL; ++l) {
    const int n = (int)p.levels[l].n;
    const float* tab = static_cast<const float*>(p.levels[l].table);
    for (int e = threadIdx.x; e < n * D; e += kThreads) {
      const int c = e / D, j = e % D;
      Ts[(c0 + c) * ldt + j] = tab[c * Dp + j];
    }
    c0 += n;
  }
}

// x[k] = logits[row][q + 4 k] of one level (0 outside the level or the batch).
template <typename S>
__device__ __forceinline__ void load_logits(S (&x)[kPerLane], const CalendarLevel& L, int64_t row, bool in, int q) {
  const S* src = static_cast<const S*>(L.logits) + row * L.row_stride;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) x[k] = (in && q + 4 * k < L.n) ? src[q + 4 * k] : S(0.0f);
}

// The row's exponentials over its 4 lanes' classes, in place: z[k] = exp(z_k - m) (0 outside the level), m the
// row's max; returns the row's sum. The max is fmaxf's, which skips NaN; a NaN logit still makes the sum NaN, as
// torch.softmax gives a NaN row.
__device__ __forceinline__ float row_exp(float (&z)[kPerLane], int n, int q) {
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k)
    if (q + 4 * k < n) m = max(m, z[k]);
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    z[k] = (q + 4 * k < n) ? exp(z[k] - m) : 0.0f;
    s += z[k];
  }
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  return s;
}

// The row's softmax: e[k] = exp(x_k / tau - m) and 1 / sum.
template <typename S>
__device__ __forceinline__ float row_softmax(const S (&x)[kPerLane], int n, int q, float inv_tau,
                                             float (&e)[kPerLane]) {
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) e[k] = to_acc(x[k]) * inv_tau;
  return 1.0f / row_exp(e, n, q);
}

template <typename S, int NL>
__global__ void __launch_bounds__(kThreads, kMinCtas) context_fwd_kernel(CalendarParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* Ts = reinterpret_cast<float*>(smem_raw);
  const int D = (int)p.dim, ldt = ldt_of(D);
  int NT = 0;
#pragma unroll
  for (int l = 0; l < NL; ++l) NT += (int)p.levels[l].n;
  float* PT = Ts + NT * ldt;  // [NT][kLdP]
  stage_tables<NL>(Ts, p);
  const int r = threadIdx.x >> 2, q = threadIdx.x & 3;
  const float inv_tau = (float)p.inv_tau;
  const int64_t ntiles = (p.B + kTR - 1) / kTR;
  const int ncg = D / 4, nitems = (kTR / 4) * ncg;
  S x[NL][kPerLane];
  int64_t tile = blockIdx.x;
  if (tile < ntiles) {
#pragma unroll
    for (int l = 0; l < NL; ++l) load_logits(x[l], p.levels[l], tile * kTR + r, tile * kTR + r < p.B, q);
  }
  for (; tile < ntiles; tile += gridDim.x) {
    const int64_t b0 = tile * kTR;
    float e[NL][kPerLane];
    float inv_s[NL];
#pragma unroll
    for (int l = 0; l < NL; ++l) inv_s[l] = row_softmax(x[l], (int)p.levels[l].n, q, inv_tau, e[l]);
    __syncthreads();  // the previous tile's products are done with P^T (and, the first time, Ts is written)
    int c0 = 0;
#pragma unroll
    for (int l = 0; l < NL; ++l) {
      const int n = (int)p.levels[l].n;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k)
        if (q + 4 * k < n) PT[(c0 + q + 4 * k) * kLdP + r] = e[l][k] * inv_s[l];
      c0 += n;
    }
    __syncthreads();
    const int64_t next = tile + gridDim.x;  // the next tile's logits in flight during the products
    if (next < ntiles) {
#pragma unroll
      for (int l = 0; l < NL; ++l) load_logits(x[l], p.levels[l], next * kTR + r, next * kTR + r < p.B, q);
    }
    c0 = 0;
#pragma unroll
    for (int l = 0; l < NL; ++l) {
      const int n = (int)p.levels[l].n;
      for (int it = threadIdx.x; it < nitems; it += kThreads) {
        const int cg = it % ncg, rg = it / ncg;
        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
        const float* pp = PT + c0 * kLdP + 4 * rg;
        const float* tt = Ts + c0 * ldt + 4 * cg;
        for (int c = 0; c < n; ++c) {
          const F4 pv = *reinterpret_cast<const F4*>(pp + c * kLdP);
          const F4 tv = *reinterpret_cast<const F4*>(tt + c * ldt);
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] += pv.v[i] * tv.v[j];
        }
        S* o = static_cast<S*>(p.out) + p.levels[l].out_col + 4 * cg;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t row = b0 + 4 * rg + i;
          if (row < p.B) {
            V4<S> v;
#pragma unroll
            for (int j = 0; j < 4; ++j) v.v[j] = from_acc<S>(acc[i][j]);
            *reinterpret_cast<V4<S>*>(o + row * p.out_row_stride) = v;
          }
        }
      }
      c0 += n;
    }
  }
}

// g[k] = grad_out[row][out_col + 4 q + 16 k .. + 4] (0 outside dim or the batch).
template <typename S>
__device__ __forceinline__ void load_grad(V4<S> (&g)[kMaxG], const CalendarParams& p, const CalendarLevel& L,
                                          int64_t row, bool in, int q) {
  const S* src = static_cast<const S*>(p.grad_out) + row * p.out_row_stride + L.out_col;
#pragma unroll
  for (int k = 0; k < kMaxG; ++k) {
    const int j = 4 * q + 16 * k;
    if (in && j < p.dim) {
      g[k] = *reinterpret_cast<const V4<S>*>(src + j);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) g[k].v[i] = S(0.0f);
    }
  }
}

// dP^T[c][r] = <G[r], T[c]> for the tile's rows and the level's classes: RR rows x 2 classes per item
// (classes cg and cg + ncg), j in steps of 4 (16-byte shared loads).
template <int RR>
__device__ __forceinline__ void grad_products(float* DP, const float* Gs, const float* Tl, int n, int D) {
  const int ldg = D + 4, ldt = ldt_of(D);
  const int ncg = (n + 1) / 2, nitems = (kTR / RR) * ncg;
  for (int it = threadIdx.x; it < nitems; it += kThreads) {
    const int cg = it % ncg, rg = it / ncg;
    const int ca = cg, cb = cg + ncg < n ? cg + ncg : cg;
    float acc[RR][2];
#pragma unroll
    for (int i = 0; i < RR; ++i) acc[i][0] = acc[i][1] = 0.0f;
    for (int j = 0; j < D; j += 4) {
      const F4 ta = *reinterpret_cast<const F4*>(Tl + ca * ldt + j);
      const F4 tb = *reinterpret_cast<const F4*>(Tl + cb * ldt + j);
#pragma unroll
      for (int i = 0; i < RR; ++i) {
        const F4 g = *reinterpret_cast<const F4*>(Gs + (RR * rg + i) * ldg + j);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          acc[i][0] += g.v[u] * ta.v[u];
          acc[i][1] += g.v[u] * tb.v[u];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < RR; ++i) {
      DP[ca * kLdP + RR * rg + i] = acc[i][0];
      if (cb != ca) DP[cb * kLdP + RR * rg + i] = acc[i][1];
    }
  }
}

template <typename S, int NL>
__global__ void __launch_bounds__(kThreads, kMinCtas) context_bwd_kernel(CalendarParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* Ts = reinterpret_cast<float*>(smem_raw);
  const int D = (int)p.dim, ldt = ldt_of(D), ldg = D + 4;
  int NT = 0;
#pragma unroll
  for (int l = 0; l < NL; ++l) NT += (int)p.levels[l].n;
  float* Gs = Ts + NT * ldt;    // [kTR][D + 4]
  float* DP = Gs + kTR * ldg;   // [kMaxN][kLdP]
  stage_tables<NL>(Ts, p);
  const int r = threadIdx.x >> 2, q = threadIdx.x & 3;
  const float inv_tau = (float)p.inv_tau;
  const int64_t ntiles = (p.B + kTR - 1) / kTR;
  S x[kPerLane];
  V4<S> g[kMaxG];
  int64_t tile = blockIdx.x;
  if (tile < ntiles) {
    const bool in = tile * kTR + r < p.B;
    load_logits(x, p.levels[0], tile * kTR + r, in, q);
    load_grad(g, p, p.levels[0], tile * kTR + r, in, q);
  }
  for (; tile < ntiles; tile += gridDim.x) {
    const int64_t b0 = tile * kTR;
    const bool in = b0 + r < p.B;
    int c0 = 0;
#pragma unroll
    for (int l = 0; l < NL; ++l) {
      const CalendarLevel& L = p.levels[l];
      const int n = (int)L.n;
      float e[kPerLane];
      const float inv_s = row_softmax(x, n, q, inv_tau, e);
      // No barrier here: the previous unit's last one already follows its reads of G, and its dP^T reads end
      // before this unit's second barrier, which every thread passes before the products rewrite dP^T.
#pragma unroll
      for (int k = 0; k < kMaxG; ++k) {
        const int j = 4 * q + 16 * k;
        if (j < D) {
          F4 v;
#pragma unroll
          for (int i = 0; i < 4; ++i) v.v[i] = to_acc(g[k].v[i]);
          *reinterpret_cast<F4*>(Gs + r * ldg + j) = v;
        }
      }
      __syncthreads();  // G written (and, the first time, Ts)
      // the next unit's logits and gradient columns in flight during this one's products
      const int64_t nt = l + 1 < NL ? tile : tile + gridDim.x;
      if (nt < ntiles) {
        const CalendarLevel& N = p.levels[l + 1 < NL ? l + 1 : 0];
        const bool nin = nt * kTR + r < p.B;
        load_logits(x, N, nt * kTR + r, nin, q);
        load_grad(g, p, N, nt * kTR + r, nin, q);
      }
      if (n > 16)
        grad_products<4>(DP, Gs, Ts + c0 * ldt, n, D);
      else
        grad_products<2>(DP, Gs, Ts + c0 * ldt, n, D);
      __syncthreads();  // dP^T written; G free for the next unit
      float dp[kPerLane];
      float dot = 0.0f;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        e[k] *= inv_s;  // p
        dp[k] = (q + 4 * k < n) ? DP[(q + 4 * k) * kLdP + r] : 0.0f;
        dot += e[k] * dp[k];
      }
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);
      dot += __shfl_xor_sync(0xffffffffu, dot, 2);
      if (in) {
        S* gl = static_cast<S*>(L.grad_logits) + (b0 + r) * (int64_t)n;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k)
          if (q + 4 * k < n) gl[q + 4 * k] = from_acc<S>(e[k] * (dp[k] - dot) * inv_tau);
      }
      c0 += n;
    }
  }
}

// calendar_scalar: a warp owns 8 rows (4 lanes per row, classes q + 4 k), walks row groups grid-stride and issues
// the next group's logits (and, backward, its upstream gradient) before the current group's arithmetic; no shared
// memory, no barriers. Per level: m, s = sum exp(x - m), t = sum c exp(x - m) over the row's 4 lanes (2 shuffles
// each); E = t / s; forward u = sum_l w_l E_l (lane 0 of the row writes it, added to out with accumulate);
// backward d logit_c = g w / s exp(x_c - m) (c - E) / tau, the arithmetic of the v1 kernel.
constexpr int kMinCtasScalar = 3;  // forward <= 85 registers; backward 2 per SM (<= 128: no spills at 3 levels)

template <typename S, int NL, bool BWD>
__global__ void __launch_bounds__(kThreads, BWD ? kMinCtasScalar - 1 : kMinCtasScalar) scalar_kernel(CalendarParams p) {
  const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;
  const int64_t nwarps = (int64_t)gridDim.x * (kThreads / 32);
  const int64_t ngroups = (p.B + 7) / 8;
  const float inv_tau = (float)p.inv_tau;
  float* out = static_cast<float*>(p.out);
  const float* gout = static_cast<const float*>(p.grad_out);
  S x[NL][kPerLane];
  float gv = 0.0f;
  int64_t grp = (int64_t)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
  if (grp < ngroups) {
    const int64_t row = grp * 8 + r;
#pragma unroll
    for (int l = 0; l < NL; ++l) load_logits(x[l], p.levels[l], row, row < p.B, q);
    if (BWD && row < p.B) gv = gout[row];
  }
  for (; grp < ngroups; grp += nwarps) {
    const int64_t row = grp * 8 + r;
    const bool in = row < p.B;
    float xs[NL][kPerLane];  // this group's logits / tau: the registers x receive the next group's
#pragma unroll
    for (int l = 0; l < NL; ++l)
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) xs[l][k] = to_acc(x[l][k]) * inv_tau;
    const float g = gv;
    const int64_t next = grp + nwarps;
    if (next < ngroups) {
      const int64_t nrow = next * 8 + r;
#pragma unroll
      for (int l = 0; l < NL; ++l) load_logits(x[l], p.levels[l], nrow, nrow < p.B, q);
      if (BWD) gv = nrow < p.B ? gout[nrow] : 0.0f;
    }
    float u = 0.0f;
#pragma unroll
    for (int l = 0; l < NL; ++l) {
      const CalendarLevel& L = p.levels[l];
      const int n = (int)L.n;
      const float sum = row_exp(xs[l], n, q);
      float t = 0.0f;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) t += (float)(q + 4 * k) * xs[l][k];
      t += __shfl_xor_sync(0xffffffffu, t, 1);
      t += __shfl_xor_sync(0xffffffffu, t, 2);
      const float E = t / sum;
      if (!BWD) {
        u += (float)L.weight * E;
      } else if (in) {
        const float kf = g * (float)L.weight * inv_tau / sum;
        S* gl = static_cast<S*>(L.grad_logits) + row * (int64_t)n;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k)
          if (q + 4 * k < n) gl[q + 4 * k] = from_acc<S>(kf * xs[l][k] * ((float)(q + 4 * k) - E));
      }
    }
    if (!BWD && in && q == 0) out[row] = p.accumulate ? out[row] + u : u;
  }
}

size_t smem_bytes(const CalendarParams& p, bool bwd) {
  size_t nt = 0;
  for (int l = 0; l < p.num_levels; ++l) nt += (size_t)p.levels[l].n;
  const size_t D = (size_t)p.dim;
  return 4 * (nt * (D + 4) + (bwd ? kTR * (D + 4) + (size_t)kMaxN * kLdP : nt * kLdP));
}

void check(const CalendarParams& p, bool bwd, bool scalar = false) {
  if (p.dtype == DType::F64) fail_v3("takes float32, float16 or bfloat16 (float64 runs v1 / v2)");
  if (p.num_levels < 1 || p.num_levels > 3) fail_v3("takes 1-3 levels per launch");
  for (int l = 0; l < p.num_levels; ++l)
    if (p.levels[l].n < 1 || p.levels[l].n > kMaxN) fail_v3("takes levels of 1-32 classes");
  if (scalar) return;
  if (p.dim < 4 || p.dim % 4 || p.dim > 4 * 4 * kMaxG) fail_v3("takes dim a multiple of 4, <= 128");
  if (p.out_row_stride % 4) fail_v3("needs an output / gradient row stride that is a multiple of 4");
  if (bwd && p.grad_col_stride != 1) fail_v3("needs a gradient of unit column stride");
}

template <typename S, int NL>
void launch(const CalendarParams& p, bool bwd, unsigned grid, cudaStream_t st) {
  const size_t smem = smem_bytes(p, bwd);
  if (bwd) {
    if (smem > 48 * 1024)
      TK_CUDA_CHECK(cudaFuncSetAttribute(context_bwd_kernel<S, NL>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    context_bwd_kernel<S, NL><<<grid, kThreads, smem, st>>>(p);
  } else {
    if (smem > 48 * 1024)
      TK_CUDA_CHECK(cudaFuncSetAttribute(context_fwd_kernel<S, NL>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    context_fwd_kernel<S, NL><<<grid, kThreads, smem, st>>>(p);
  }
}

void run(const CalendarParams& p, int device, uintptr_t stream, bool bwd) {
  check(p, bwd);
  if (p.B == 0) return;
  set_device(device);
  const int64_t ntiles = (p.B + kTR - 1) / kTR;
  const int64_t cap = p.max_ctas > 0 ? p.max_ctas : ntiles;
  const unsigned grid = (unsigned)std::min<int64_t>(std::min<int64_t>(ntiles, cap), 1 << 30);
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  auto by_levels = [&](auto s) {
    using S = decltype(s);
    if (p.num_levels == 1) launch<S, 1>(p, bwd, grid, st);
    else if (p.num_levels == 2) launch<S, 2>(p, bwd, grid, st);
    else launch<S, 3>(p, bwd, grid, st);
  };
  if (p.dtype == DType::F32) by_levels(float{});
  else if (p.dtype == DType::F16) by_levels(__half{});
  else by_levels(__nv_bfloat16{});
  check_launch();
}
void run_scalar(const CalendarParams& p, int device, uintptr_t stream, bool bwd) {
  check(p, bwd, true);
  if (p.B == 0) return;
  set_device(device);
  const int64_t ctas = ((p.B + 7) / 8 + kThreads / 32 - 1) / (kThreads / 32);
  const int64_t cap = p.max_ctas > 0 ? p.max_ctas : ctas;
  const unsigned grid = (unsigned)std::min<int64_t>(std::min<int64_t>(ctas, cap), 1 << 30);
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  auto go = [&](auto s, auto nl) {
    using S = decltype(s);
    constexpr int NL = decltype(nl)::value;
    if (bwd)
      scalar_kernel<S, NL, true><<<grid, kThreads, 0, st>>>(p);
    else
      scalar_kernel<S, NL, false><<<grid, kThreads, 0, st>>>(p);
  };
  auto by_levels = [&](auto s) {
    if (p.num_levels == 1) go(s, std::integral_constant<int, 1>{});
    else if (p.num_levels == 2) go(s, std::integral_constant<int, 2>{});
    else go(s, std::integral_constant<int, 3>{});
  };
  if (p.dtype == DType::F32) by_levels(float{});
  else if (p.dtype == DType::F16) by_levels(__half{});
  else by_levels(__nv_bfloat16{});
  check_launch();
}
}  // namespace v3
}  // namespace

void calendar_scalar_fwd_cuda_v3(const CalendarParams& p, int device, uintptr_t stream) { v3::run_scalar(p, device, stream, false); }
void calendar_scalar_bwd_cuda_v3(const CalendarParams& p, int device, uintptr_t stream) { v3::run_scalar(p, device, stream, true); }
void calendar_context_fwd_cuda_v3(const CalendarParams& p, int device, uintptr_t stream) { v3::run(p, device, stream, false); }
void calendar_context_bwd_cuda_v3(const CalendarParams& p, int device, uintptr_t stream) { v3::run(p, device, stream, true); }
}  // namespace tk
