// CUDA kernels for the relative-offset bias. A warp covers 32 documents of one query row; a thread keeps its
// document's angle features in registers for all the rows it visits, and phi(delta) comes from the
// angle-difference identities (bias_math.h) with the row features in shared memory, falling back to a
// direct sin/cos per pair where the clamp bites. w1 lives in shared memory as [sin weights | cos weights]
// rows padded to multiples of 4 and is read with 128-bit loads (4 FMAs per load instruction, not 1).
// Backward reduces R = sum M phi per batch with a register-tiled product from shared memory into float64
// block totals; d u_q / d u_d go to per-block partial rows (no global atomics). Grids come from the SM
// count (>= 2 x SMs blocks when the batch allows). Nothing of size Bq*Bd*D or Bq*Bd*hidden is allocated.
// This header holds the kernels and the launch template `launch<S, A>`; offset_bias_<dtype>_cuda.cu instantiate
// it once per dtype (separate files, so that a parallel build compiles them side by side) and offset_bias_cuda.cu
// holds the entry points (offset_bias.h). Included by those files only.
#pragma once
#include <algorithm>
#include <string>
#include <type_traits>
#include "common/cuda_utils.cuh"
#include "offset_bias/bias_math.h"
#include "offset_bias/offset_bias.h"

namespace tk {
namespace {
using namespace tk::cuda;
using namespace tk::bias;

constexpr int kCols = 32;  // documents per block (one per lane); the block's warps take different rows

// Four values loaded with one 128-bit shared-memory load (two for double): the weight rows and the
// backward's batch rows are 16-byte aligned and padded to multiples of 4, so every read of them is vector.
template <typename A> struct alignas(16) Vec4 { A v[4]; };

template <typename A>
struct SmemLayout {
  int K, KP;       // frequencies, and K rounded up to a multiple of 4
  int64_t hidden, D;
  int rows;        // query rows per iteration = blockDim / 32
  int ldb;         // batch row stride (backward): blockDim + 4 (multiple of 4: vector reads)
  int hE, dE;      // hidden and D rounded up to even (the reduction's 2 x 2 tiles)
  bool rd_smem;    // backward: the block's float64 R totals live in shared memory (else in its global slot)
  // [W (hidden x 2KP): sin weights | cos weights] [b1 (hidden)] [w2 (hidden)] [freqs (KP)]
  // [row feats (rows x 2KP)] | backward: [M (hE x ldb)] [phi (dE x ldb)] [R totals, double (hidden x (D+1))]
  __host__ __device__ static size_t up4(size_t x) { return (x + 3) & ~size_t(3); }
  __host__ __device__ size_t w() const { return 0; }
  __host__ __device__ size_t b1() const { return w() + hidden * 2 * KP; }
  __host__ __device__ size_t w2() const { return b1() + hidden; }
  __host__ __device__ size_t f() const { return w2() + hidden; }
  __host__ __device__ size_t rf() const { return up4(f() + KP); }
  __host__ __device__ size_t M() const { return rf() + (size_t)rows * 2 * KP; }
  __host__ __device__ size_t phi() const { return M() + (size_t)hE * ldb; }
  __host__ __device__ size_t rd_bytes_offset() const { return ((phi() + (size_t)dE * ldb) * sizeof(A) + 15) & ~size_t(15); }
  __host__ __device__ size_t fwd_bytes() const { return M() * sizeof(A); }
  __host__ __device__ size_t bwd_bytes() const {
    return rd_bytes_offset() + (rd_smem ? (size_t)hidden * (D + 1) * sizeof(double) : 0);
  }
};

template <typename A>
__device__ void load_weights(const OffsetBiasParams& p, const SmemLayout<A>& L, A* sm) {
  const A* w1 = static_cast<const A*>(p.w1);
  const int K = L.K, KP = L.KP;
  const int64_t nW = p.hidden * 2 * KP;
  for (int64_t e = threadIdx.x; e < nW; e += blockDim.x) {
    const int64_t n = e / (2 * KP);
    const int m = (int)(e % (2 * KP));
    // sin weight k at column k, cos weight k at KP + k; zero past K and past D
    const int feat = m < KP ? (m < K ? m : -1) : (m - KP < K ? K + m - KP : -1);
    sm[L.w() + e] = feat >= 0 && feat < p.D ? w1[n * p.ld_w1 + feat] : A(0);
  }
  for (int64_t n = threadIdx.x; n < p.hidden; n += blockDim.x) {
    sm[L.b1() + n] = static_cast<const A*>(p.b1)[n];
    sm[L.w2() + n] = static_cast<const A*>(p.w2)[n];
  }
  for (int k = threadIdx.x; k < KP; k += blockDim.x) sm[L.f() + k] = k < K ? static_cast<const A*>(p.freqs)[k] : A(0);
}

// s[k] = sin(f_k delta), c[k] = cos(f_k delta) for the pair (0 for k >= K); fast (angle difference) when allowed.
template <typename A, int KMAX>
__device__ __forceinline__ void pair_angles(A diff, bool fast, const A (&ds)[KMAX], const A (&dc)[KMAX],
                                            const A* rs, const A* rc, const A* f, int K, A (&s)[KMAX],
                                            A (&c)[KMAX]) {
  if (fast) {
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      if (k < K) {  // rs/rc hold 2 KP values: reading past K would leave the warp's slot (found by memcheck)
        s[k] = ds[k] * rc[k] - dc[k] * rs[k];
        c[k] = dc[k] * rc[k] + ds[k] * rs[k];
      } else {
        s[k] = c[k] = A(0);
      }
    }
  } else {
    const A delta = bias_clamp(diff);
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      if (k < K) bias_sincos(f[k] * delta, &s[k], &c[k]);
      else s[k] = c[k] = A(0);
    }
  }
}

// W row (2KP: sin weights then cos weights) dotted with [s, c]: vector loads, KP / 4 of each half.
template <typename A, int KMAX>
__device__ __forceinline__ A wdot(const A* W, int KP, const A (&s)[KMAX], const A (&c)[KMAX]) {
  const Vec4<A>* ws = reinterpret_cast<const Vec4<A>*>(W);
  const Vec4<A>* wc = reinterpret_cast<const Vec4<A>*>(W + KP);
  A h0 = 0, h1 = 0;
#pragma unroll
  for (int q = 0; q < KMAX / 4; ++q)
    if (4 * q < KP) {
      const Vec4<A> a = ws[q], b = wc[q];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        h0 += a.v[e] * s[4 * q + e];
        h1 += b.v[e] * c[4 * q + e];
      }
    }
  return h0 + h1;
}

// The merged always-on units (hidden-unit merging: slots 0 and 1 hold the float64 merged
// weights as hi + lo, w2 = 1) evaluated as one linear unit, centred: Python folds the cos weights' value at
// delta = 0 into the bias (b = b_lin + sum_k w_cos_k, hi + lo), and the unit sums w_sin_k s_k + w_cos_k (c_k - 1)
// before adding it. The uncentred float32 sum carried the large, nearly constant cos part of every pair (cos ~ 1
// for the low frequencies) in its partial sums: a rounding error correlated across pairs, which d/d scale (a
// sum of G y over B^2 pairs whose G rows sum to 0) does not average out (the float32 2x-rule draw that kept
// merging opt-in). 4 x K multiply-adds per pair, about one ordinary unit.
constexpr int64_t kLinearSlots = 2;
template <typename A, int KMAX>
__device__ __forceinline__ A linear_units(const A* sm, const SmemLayout<A>& L, int KP, const A (&s)[KMAX],
                                          const A (&c)[KMAX]) {
  const A* wh = sm + L.w();
  const A* wl = wh + 2 * KP;
  A acc = 0;
#pragma unroll
  for (int q = 0; q < KMAX; ++q)
    if (q < KP) {  // padding: s = c = 0 with zero weights, so (c - 1) adds nothing there
      const A cm1 = c[q] - A(1);
      acc = fma(wl[q], s[q], acc);
      acc = fma(wl[KP + q], cm1, acc);
      acc = fma(wh[q], s[q], acc);
      acc = fma(wh[KP + q], cm1, acc);
    }
  return sm[L.b1()] + (sm[L.b1() + 1] + acc);
}

// Per-thread setup shared by forward and backward: the document's angle features (0 for k >= K).
template <typename A, int KMAX>
__device__ __forceinline__ bool column_setup(const OffsetBiasParams& p, const A* f, int K, int64_t j, A& ud,
                                             A (&ds)[KMAX], A (&dc)[KMAX]) {
  ud = j < p.Bd ? static_cast<const A*>(p.u_d)[j] : A(0);
  const bool ok = ud >= A(-kBiasFastRange) && ud <= A(kBiasFastRange);
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    if (k < K) bias_sincos(f[k] * ud, &ds[k], &dc[k]);
    else ds[k] = dc[k] = A(0);
  }
  return ok;
}

// The warp's row features into shared memory (lanes split the K frequencies): sin at [0, K), cos at [KP, KP + K).
template <typename A>
__device__ __forceinline__ void row_features(A uq, const A* f, int K, int KP, A* rf) {
  const int lane = threadIdx.x & 31;
  for (int k = lane; k < K; k += 32) bias_sincos(f[k] * uq, &rf[k], &rf[KP + k]);
  __syncwarp();
}

// Units evaluated: [0, *n_active) when Python passed a device count (its always-off / merged units last), else all.
__device__ __forceinline__ int64_t active_units(const OffsetBiasParams& p) {
  return p.n_active ? min((int64_t)max(*p.n_active, 0), p.hidden) : p.hidden;
}

template <typename S, typename A, int KMAX>
__global__ void fwd_kernel(OffsetBiasParams p, SmemLayout<A> L) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* sm = reinterpret_cast<A*>(smem_raw);
  load_weights(p, L, sm);
  const int K = L.K, KP = L.KP, lane = threadIdx.x & 31, ty = threadIdx.x >> 5;
  A* rf = sm + L.rf() + ty * 2 * KP;
  for (int k = lane; k < 2 * KP; k += 32) rf[k] = A(0);  // padding stays 0
  __syncthreads();
  const A* f = sm + L.f();
  const int64_t j = (int64_t)blockIdx.x * kCols + lane;
  A ud, ds[KMAX], dc[KMAX], s[KMAX], c[KMAX];
  const bool col_ok = column_setup<A, KMAX>(p, f, K, j, ud, ds, dc);
  const A b2 = *static_cast<const A*>(p.b2), scale = *static_cast<const A*>(p.scale);
  const int64_t nact = active_units(p);
  for (int64_t i0 = (int64_t)blockIdx.y * L.rows; i0 < p.Bq; i0 += (int64_t)gridDim.y * L.rows) {
    const int64_t i = i0 + ty;
    if (i >= p.Bq) break;  // warp-uniform
    const A uq = static_cast<const A*>(p.u_q)[i];
    row_features(uq, f, K, KP, rf);
    const A diff = ud - uq;
    const bool fast = col_ok && bias_passes(diff) && uq >= A(-kBiasFastRange) && uq <= A(kBiasFastRange);
    pair_angles<A, KMAX>(diff, fast, ds, dc, rf, rf + KP, f, K, s, c);
    const bool lin = p.n_linear == kLinearSlots;  // the merged units as one centred linear unit
    A y = lin ? linear_units<A, KMAX>(sm, L, KP, s, c) : A(0);
    for (int64_t n = lin ? kLinearSlots : 0; n < nact; ++n) {
      const A h = sm[L.b1() + n] + wdot<A, KMAX>(sm + L.w() + n * 2 * KP, KP, s, c);
      if (n < p.n_linear || !(h <= A(0))) y += sm[L.w2() + n] * h;  // NaN passes, as torch's relu
    }
    if (j < p.Bd) static_cast<S*>(p.out)[i * p.ld_out + j] = from_acc<S>(scale * (y + b2));
    __syncwarp();  // rf is rewritten for the next row
  }
}

// Backward. Per batch (one row per warp, 32 documents): each thread evaluates its pair (h, M = G scale [h > 0]
// into shared memory, phi too), then ddelta = sum_n w2 M h' with h' from the same weights and f-scaled
// features. The batch's R (hidden x (D + 1)) = M . [phi, 1]^T is a small product over the batch's pairs:
// 2 x 2 output tiles per thread, vector reads along the pairs, summed per batch in A and then into the block's
// float64 totals (shared memory, or the block's own global slot when they do not fit), written once.
// d u_q: warp sums, one value per (column block, row) -> p.grad_uq (gx x Bq, A); d u_d: per-thread float64
// sums over the block's rows, then the warps in a fixed order -> p.grad_ud (gy x Bd, double); s1, s0 the same
// into the block's slot. No global atomics; Python sums the partial rows in float64.
template <typename S, typename A, int KMAX>
// float, K <= 16 (D <= 33, the CTD default): at most 128 registers (ptxas sm_90: 56 bytes of spill, outside
// the pair loop or not, unmeasured), so two 256-thread blocks share an SM instead of one at 168 registers.
__global__ void __launch_bounds__(256, (KMAX <= 16 && sizeof(A) == 4) ? 2 : 1) bwd_kernel(OffsetBiasParams p, SmemLayout<A> L) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* sm = reinterpret_cast<A*>(smem_raw);
  load_weights(p, L, sm);
  const int K = L.K, KP = L.KP, lane = threadIdx.x & 31, ty = threadIdx.x >> 5, t = threadIdx.x;
  const int nt = blockDim.x, nwarps = nt >> 5;
  const int64_t D = p.D, D1 = p.D + 1, P = bias_num_features(p.D);
  const int64_t psz = offset_bias_part_size(p);
  double* part = static_cast<double*>(p.partials) + ((int64_t)blockIdx.y * gridDim.x + blockIdx.x) * psz;
  double* racc = L.rd_smem ? reinterpret_cast<double*>(smem_raw + L.rd_bytes_offset()) : part;
  A* rf = sm + L.rf() + ty * 2 * KP;
  A* sM = sm + L.M();
  A* sP = sm + L.phi();
  for (int k = lane; k < 2 * KP; k += 32) rf[k] = A(0);
  // constant rows: phi rows past the features and the padding row are 0
  for (int64_t e = t; e < (int64_t)(L.dE - P) * L.ldb; e += nt) sP[P * L.ldb + e] = A(0);
  // M rows of the units not evaluated (past nact) stay 0 for the batch reduction
  const int64_t nact = active_units(p);
  for (int64_t e = t; e < (int64_t)(L.hE - nact) * L.ldb; e += nt) sM[nact * L.ldb + e] = A(0);
  for (int64_t e = t; L.rd_smem && e < p.hidden * D1; e += nt) racc[e] = 0.0;
  __syncthreads();
  const A* f = sm + L.f();
  const int64_t j = (int64_t)blockIdx.x * kCols + lane;
  A ud, ds[KMAX], dc[KMAX], s[KMAX], c[KMAX];
  const bool col_ok = column_setup<A, KMAX>(p, f, K, j, ud, ds, dc);
  const A scale = *static_cast<const A*>(p.scale);
  double gd_acc = 0, s1 = 0, s0 = 0;
  const S* G = static_cast<const S*>(p.grad_out);
  A* rowpart = static_cast<A*>(p.grad_uq) + (int64_t)blockIdx.x * p.Bq;
  // the reduction's 2 x 2 tiles of R: (n0, n0 + 1) x (m0, m0 + 1)
  const int ntm = L.dE / 2, ntasks = (int)((nact + 1) / 2) * ntm;  // tiles of the evaluated units' rows
  for (int64_t i0 = (int64_t)blockIdx.y * L.rows; i0 < p.Bq; i0 += (int64_t)gridDim.y * L.rows) {
    const int64_t i = i0 + ty;
    const bool row_ok = i < p.Bq;  // warp-uniform; the block stays together for the batch reduction
    const bool valid = row_ok && j < p.Bd;
    const A uq = row_ok ? static_cast<const A*>(p.u_q)[i] : A(0);
    row_features(uq, f, K, KP, rf);
    const A diff = ud - uq;
    const bool fast = col_ok && bias_passes(diff) && uq >= A(-kBiasFastRange) && uq <= A(kBiasFastRange);
    pair_angles<A, KMAX>(diff, fast, ds, dc, rf, rf + KP, f, K, s, c);
    const A g = valid ? to_acc(G[i * p.ld_grad + j * p.ld_grad_col]) : A(0);
    const A gs = g * scale;
#pragma unroll
    for (int k = 0; k < KMAX; ++k)
      if (k < K) {
        if (k < D) sP[k * L.ldb + t] = s[k];
        if (K + k < D) sP[(K + k) * L.ldb + t] = c[k];
      }
    const bool lin = p.n_linear == kLinearSlots;  // the merged units as one centred linear unit
    if (lin) sM[t] = sM[L.ldb + t] = gs;
    A y = lin ? linear_units<A, KMAX>(sm, L, KP, s, c) : A(0);
    for (int64_t n = lin ? kLinearSlots : 0; n < nact; ++n) {
      const A h = sm[L.b1() + n] + wdot<A, KMAX>(sm + L.w() + n * 2 * KP, KP, s, c);
      const bool on = n < p.n_linear || !(h <= A(0));  // NaN passes (torch's relu gradient)
      if (on) y += sm[L.w2() + n] * h;
      sM[n * L.ldb + t] = on ? gs : A(0);
    }
    // h' = sum_k f_k (W_sin[k] c_k - W_cos[k] s_k): the same weight rows against (f c, -f s)
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const A fk = k < K ? f[k] : A(0);
      const A sk = s[k];
      s[k] = fk * c[k];
      c[k] = -fk * sk;
    }
    A dd = 0;
    if (gs != A(0))
      for (int64_t n = 0; n < nact; ++n)
        if (sM[n * L.ldb + t] != A(0)) dd += sm[L.w2() + n] * wdot<A, KMAX>(sm + L.w() + n * 2 * KP, KP, s, c);
    dd *= gs;
    s1 += (double)(g * y);
    s0 += (double)g;
    if (!bias_passes(diff) || !valid) dd = A(0);
    gd_acc += (double)dd;
    const A row_sum = warp_sum(dd);
    if (row_ok && lane == 0) rowpart[i] = -row_sum;
    __syncthreads();
    // R[n, m] += sum over this batch's pairs of M[n] phi[m]; R[n, D] += sum of M[n] (tasks with m0 = 0)
    for (int task = t; task < ntasks; task += nt) {
      const int n0 = 2 * (task / ntm), m0 = 2 * (task % ntm);
      const A* m0r = sM + (int64_t)n0 * L.ldb;
      const A* m1r = m0r + L.ldb;
      const A* p0r = sP + (int64_t)m0 * L.ldb;
      const A* p1r = p0r + L.ldb;
      A a00 = 0, a01 = 0, a10 = 0, a11 = 0, e0 = 0, e1 = 0;
      const bool esum = m0 == 0;  // these tasks also give R[:, D] = sum M (so the tiles need not cover it)
      for (int q = 0; q < nt; q += 4) {
        const Vec4<A> x0 = *reinterpret_cast<const Vec4<A>*>(m0r + q), x1 = *reinterpret_cast<const Vec4<A>*>(m1r + q);
        const Vec4<A> y0 = *reinterpret_cast<const Vec4<A>*>(p0r + q), y1 = *reinterpret_cast<const Vec4<A>*>(p1r + q);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          a00 += x0.v[e] * y0.v[e];
          a01 += x0.v[e] * y1.v[e];
          a10 += x1.v[e] * y0.v[e];
          a11 += x1.v[e] * y1.v[e];
          if (esum) {
            e0 += x0.v[e];
            e1 += x1.v[e];
          }
        }
      }
      if (n0 < nact) {
        if (m0 < D) racc[n0 * D1 + m0] += (double)a00;
        if (m0 + 1 < D) racc[n0 * D1 + m0 + 1] += (double)a01;
        if (esum) racc[n0 * D1 + D] += (double)e0;
      }
      if (n0 + 1 < nact) {
        if (m0 < D) racc[(n0 + 1) * D1 + m0] += (double)a10;
        if (m0 + 1 < D) racc[(n0 + 1) * D1 + m0 + 1] += (double)a11;
        if (esum) racc[(n0 + 1) * D1 + D] += (double)e1;
      }
    }
    __syncthreads();
  }
  // block totals: d u_d per column (warps in a fixed order), s1 / s0, R (from shared memory)
  // the batch buffers (M and phi, >= 4 x (32 + 4) values) are free now: nwarps x 34 doubles
  double* red = reinterpret_cast<double*>(sM);
  const double s1w = warp_sum(s1), s0w = warp_sum(s0);
  red[ty * 32 + lane] = gd_acc;
  if (lane == 0) {
    red[nwarps * 32 + ty] = s1w;
    red[nwarps * 33 + ty] = s0w;
  }
  __syncthreads();
  if (ty == 0) {
    double gsum = 0;
    for (int w = 0; w < nwarps; ++w) gsum += red[w * 32 + lane];
    if (j < p.Bd) static_cast<double*>(p.grad_ud)[(int64_t)blockIdx.y * p.Bd + j] = gsum;
    if (lane == 0) {
      double a = 0, b = 0;
      for (int w = 0; w < nwarps; ++w) {
        a += red[nwarps * 32 + w];
        b += red[nwarps * 33 + w];
      }
      part[psz - 2] = a;
      part[psz - 1] = b;
    }
  }
  if (L.rd_smem)
    for (int64_t e = t; e < p.hidden * D1; e += nt) part[e] = racc[e];
}

template <typename S, typename A, typename V>
__global__ void lookup_kernel(OffsetBiasParams p, const V* table) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.Bd) return;
  const A ud = static_cast<const A*>(p.u_d)[j];
  for (int64_t i = blockIdx.y; i < p.Bq; i += gridDim.y) {
    const A uq = static_cast<const A*>(p.u_q)[i];
    static_cast<S*>(p.out)[i * p.ld_out + j] = from_acc<S>(bias_table_lookup<A>(table, p.points, ud - uq));
  }
}

// ---- training table mode: backward ---------------------------------------------------------------------
// One CTA of kTableTileCols threads per tile of kTableTileRows x kTableTileCols pairs (thread = document),
// grid-striding over tiles; grid = nparts CTAs (Python: min(tiles, 2 x SMs)), each owning one float64
// slot of `points` bins in p.partials. Per tile: the bins its pairs can touch follow from the tile's u ranges
// (the bin is monotone in u_d - u_q); they are covered by windows of kHistBins bins, each a float64
// shared-memory histogram. A thread walks its column down the tile's rows and sums consecutive pairs that
// fall in the same bin in registers (A; clamped pairs and clustered positions make long runs), then adds
// each run to the histogram (shared atomics, float64: a tile can pile 16k pairs into one bin); each window
// is added once per bin into the CTA's float64 slot (no global atomics: the slot is the CTA's own).
// d u_d: per-thread register sums over the tile's rows -> colpart[row tile][j]; d u_q: warp sums per row,
// then the 8 warps in a fixed order -> rowpart[column tile][i]. Python sums both partial arrays in float64.
constexpr int kHistBins = 5120;  // 40 KB of double: N = 4097 fits one window

template <typename A>
__device__ __forceinline__ A block_reduce_minmax(A v, bool want_max, A* scratch) {
  // scratch: >= 32 values; every thread of the block calls this (block-uniform)
  for (int o = 16; o > 0; o >>= 1) {
    const A w = __shfl_xor_sync(0xffffffffu, v, o);
    v = want_max ? (w > v ? w : v) : (w < v ? w : v);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  A r = scratch[0];
  for (int w = 1; w < nw; ++w) r = want_max ? (scratch[w] > r ? scratch[w] : r) : (scratch[w] < r ? scratch[w] : r);
  return r;
}

template <typename A>
__device__ __forceinline__ int64_t table_bin(A diff, A half, int64_t P) {
  const A x = (bias_clamp(diff) + A(1)) * half;
  int64_t i0 = (int64_t)bias_floor(x);
  return i0 < 0 ? 0 : (i0 > P - 2 ? P - 2 : i0);
}

// Adds a run (bin b: a0, bin b + 1: a1) to the window [w0, w0 + kHistBins) of the histogram.
template <typename A>
__device__ __forceinline__ void table_flush_run(double* hist, int64_t b, int64_t w0, A a0, A a1) {
  if (b < 0) return;
  const int64_t k = b - w0;
  if (k >= 0 && k < kHistBins) atomicAdd(&hist[k], (double)a0);
  if (k + 1 >= 0 && k + 1 < kHistBins) atomicAdd(&hist[k + 1], (double)a1);
}

template <typename S, typename A>
__global__ void __launch_bounds__(kTableTileCols) table_bwd_kernel(OffsetBiasParams p, int64_t n_ct, int64_t ntiles) {
  constexpr int TR = kTableTileRows, NW = kTableTileCols / 32;
  __shared__ double hist[kHistBins];
  __shared__ A rowacc[NW][TR];
  __shared__ A suq[TR];
  __shared__ A scratch[32];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t P = p.points;
  const A half = A(0.5) * A(P - 1);
  const A* v = static_cast<const A*>(p.table_a);
  const A* uqp = static_cast<const A*>(p.u_q);
  const S* G = static_cast<const S*>(p.grad_out);
  A* rowpart = static_cast<A*>(p.grad_uq);
  A* colpart = static_cast<A*>(p.grad_ud);
  double* slot = static_cast<double*>(p.partials) + (int64_t)blockIdx.x * P;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int64_t rt = tile / n_ct, ct = tile % n_ct;
    const int64_t i0 = rt * TR, j = ct * kTableTileCols + t;
    const int nrows = (int)(p.Bq - i0 < TR ? p.Bq - i0 : TR);
    const bool jv = j < p.Bd;
    const A ud = jv ? static_cast<const A*>(p.u_d)[j] : A(0);
    if (t < nrows) suq[t] = uqp[i0 + t];
    __syncthreads();
    // the tile's bin range [blo, bhi + 1]; a NaN anywhere makes it the whole table
    const A uq_mine = t < nrows ? suq[t] : suq[0];
    const A udmin = block_reduce_minmax<A>(jv ? ud : A(INFINITY), false, scratch);
    const A udmax = block_reduce_minmax<A>(jv ? ud : A(-INFINITY), true, scratch);
    const A uqmin = block_reduce_minmax<A>(uq_mine, false, scratch);
    const A uqmax = block_reduce_minmax<A>(uq_mine, true, scratch);
    const A dlo = udmin - uqmax, dhi = udmax - uqmin;
    int64_t blo = 0, bhi = P - 2;
    if (dlo == dlo && dhi == dhi) {
      blo = table_bin(dlo, half, P);
      bhi = table_bin(dhi, half, P);
    }
    A colsum = 0;
    bool first = true;
    for (int64_t w0 = blo; w0 <= bhi + 1; w0 += kHistBins) {
      for (int b = t; b < kHistBins; b += blockDim.x) hist[b] = 0.0;
      __syncthreads();
      int64_t rb = -1;  // the current run: bin rb gets ra0, bin rb + 1 gets ra1
      A ra0 = 0, ra1 = 0;
      for (int r = 0; r < nrows; ++r) {  // block-uniform bound
        A dd = 0;
        if (jv) {
          const A diff = ud - suq[r];
          const A g = to_acc(G[(i0 + r) * p.ld_grad + j * p.ld_grad_col]);
          const A x = (bias_clamp(diff) + A(1)) * half;
          if (x == x) {
            int64_t b = (int64_t)bias_floor(x);
            b = b < 0 ? 0 : (b > P - 2 ? P - 2 : b);
            const A tt = x - A(b);
            if (b != rb) {
              table_flush_run(hist, rb, w0, ra0, ra1);
              rb = b;
              ra0 = ra1 = A(0);
            }
            ra0 += g * (A(1) - tt);
            ra1 += g * tt;
            if (first && bias_passes(diff)) dd = g * ((v[b + 1] - v[b]) * half);
          } else {
            dd = x;  // NaN position: NaN gradients for u, nothing binned
          }
        }
        if (first) {
          colsum += dd;
          const A rs = warp_sum(dd);
          if (lane == 0) rowacc[warp][r] = rs;
        }
      }
      table_flush_run(hist, rb, w0, ra0, ra1);
      __syncthreads();
      const int64_t nb = P - w0 < kHistBins ? P - w0 : kHistBins;
      for (int64_t b = t; b < nb; b += blockDim.x)
        if (hist[b] != 0.0) slot[w0 + b] += hist[b];
      if (first && t < nrows) {
        A s = 0;
        for (int w = 0; w < NW; ++w) s += rowacc[w][t];
        rowpart[ct * p.Bq + i0 + t] = -s;
      }
      first = false;
      __syncthreads();
    }
    if (jv) colpart[rt * p.Bd + j] = colsum;
  }
}

template <typename A>
SmemLayout<A> make_layout(const OffsetBiasParams& p, int threads, bool rd_smem) {
  SmemLayout<A> L;
  L.K = bias_num_freqs(p.D);
  L.KP = (L.K + 3) / 4 * 4;
  L.hidden = p.hidden;
  L.D = p.D;
  L.rows = threads / 32;
  L.ldb = threads + 4;
  L.hE = (int)((p.hidden + 1) / 2 * 2);
  L.dE = (int)((p.D + 1) / 2 * 2);
  L.rd_smem = rd_smem;
  return L;
}

int max_smem(int device) {
  int v = 0;
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return v;
}

// Calls f(std::integral_constant<int, KMAX>) for the smallest register budget holding K frequencies.
template <typename F> void dispatch_kmax(int K, int64_t D, F&& f) {
  // Two budgets only, to keep compile time down: D <= 33 (the CTD default D = 32) and D <= 129.
  // (K <= 16 and K <= 64 also bound KP, K rounded up to a multiple of 4.)
  if (K <= 16) f(std::integral_constant<int, 16>{});
  else if (K <= 64) f(std::integral_constant<int, 64>{});
  else fail("offset_bias CUDA kernels support D <= 129 (K <= 64 frequencies); got D = " + std::to_string(D));
}

template <typename S, typename A>
void launch(const OffsetBiasParams& p, int device, uintptr_t stream, int which) {
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const int64_t gx = (p.Bd + kCols - 1) / kCols;
  if (which == 2 || which == 3) {  // lookup (float32 BiasTable) / table-mode forward (table in A)
    if (p.Bq == 0 || p.Bd == 0) return;
    const dim3 grid((unsigned)((p.Bd + 127) / 128), (unsigned)std::min<int64_t>(p.Bq, 65535));
    if (which == 2)
      lookup_kernel<S, A, float><<<grid, 128, 0, st>>>(p, p.table);
    else
      lookup_kernel<S, A, A><<<grid, 128, 0, st>>>(p, static_cast<const A*>(p.table_a));
    check_launch();
    return;
  }
  if (which == 4) {  // table-mode backward; partial layouts in offset_bias.h
    TK_CUDA_CHECK(cudaMemsetAsync(p.partials, 0, sizeof(double) * p.points * p.nparts, st));
    if (p.Bq == 0 || p.Bd == 0) return;
    const int64_t n_ct = (p.Bd + kTableTileCols - 1) / kTableTileCols;
    const int64_t n_rt = (p.Bq + kTableTileRows - 1) / kTableTileRows;
    const int64_t ntiles = n_ct * n_rt;
    const int64_t grid = std::min<int64_t>(std::min<int64_t>(p.nparts, ntiles), 1 << 30);
    table_bwd_kernel<S, A><<<(unsigned)grid, kTableTileCols, 0, st>>>(p, n_ct, ntiles);
    check_launch();
    return;
  }
  const int limit = max_smem(device);
  // grid: gx column blocks x gy row groups, gy = nparts / gx from Python (>= 2 x SMs blocks when the batch
  // allows, tempokern/_ops/offset_bias.py::_num_parts); each block walks its rows in steps of gy * rows.
  if (which == 0) {
    if (p.Bq == 0 || p.Bd == 0) return;
    const int threads = 256;
    const SmemLayout<A> L = make_layout<A>(p, threads, false);
    const size_t bytes = L.fwd_bytes();
    if (bytes > (size_t)limit) fail("offset_bias: hidden x D too large for the CUDA kernel's shared memory");
    const int64_t gy = std::max<int64_t>(1, std::min<int64_t>({(p.Bq + L.rows - 1) / L.rows, p.nparts / gx, 65535}));
    dispatch_kmax(L.K, p.D, [&](auto km) {
      constexpr int KM = decltype(km)::value;
      auto kern = fwd_kernel<S, A, KM>;
      TK_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
      kern<<<dim3((unsigned)gx, (unsigned)gy), threads, bytes, st>>>(p, L);
    });
    check_launch();
    return;
  }
  // backward: zero the partial outputs (layouts in the kernel's comment), then one float64 slot per block
  if (p.nparts < gx) fail("offset_bias CUDA backward: nparts must be >= ceil(Bd / 32)");
  const int64_t psz = offset_bias_part_size(p), gy_max = p.nparts / gx;
  TK_CUDA_CHECK(cudaMemsetAsync(p.partials, 0, sizeof(double) * psz * p.nparts, st));
  TK_CUDA_CHECK(cudaMemsetAsync(p.grad_uq, 0, sizeof(A) * gx * p.Bq, st));
  TK_CUDA_CHECK(cudaMemsetAsync(p.grad_ud, 0, sizeof(double) * gy_max * p.Bd, st));
  if (p.Bq == 0 || p.Bd == 0) return;
  int threads = 256;
  SmemLayout<A> L = make_layout<A>(p, threads, true);
  if (L.bwd_bytes() > (size_t)limit) L = make_layout<A>(p, threads, false);
  while (L.bwd_bytes() > (size_t)limit && threads > 32) {
    threads /= 2;
    L = make_layout<A>(p, threads, false);
  }
  if (L.bwd_bytes() > (size_t)limit) fail("offset_bias: hidden x D too large for the CUDA backward's shared memory");
  const int64_t gy = std::max<int64_t>(1, std::min<int64_t>({(p.Bq + L.rows - 1) / L.rows, gy_max, 65535}));
  dispatch_kmax(L.K, p.D, [&](auto km) {
    constexpr int KM = decltype(km)::value;
    auto kern = bwd_kernel<S, A, KM>;
    TK_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L.bwd_bytes()));
    kern<<<dim3((unsigned)gx, (unsigned)gy), threads, L.bwd_bytes(), st>>>(p, L);
  });
  check_launch();
}

}  // namespace
}  // namespace tk
