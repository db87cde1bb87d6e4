// CUDA kernels for the soft-calendar ops: one thread per batch row, rows staged through shared memory.
//
// Design (memory-bound ops; see docs in tempokern/_ops/calendar.py):
// - A CTA owns a tile of R rows (R = its thread count: 128 for float/half/bf16, 64 for double) and walks
//   tiles with a grid-stride loop; the grid is min(tiles, max_ctas), max_ctas = 64 x the SM count (Python).
// - Every global access is a flat tile copy: consecutive threads touch consecutive columns of a row, then
//   the next row (logits tiles, the gradient tile, the output tile), so loads and stores are coalesced
//   whatever the level size n or the dim. Tiles are at most kCW = 32 columns wide (longer levels and
//   wider outputs go in chunks), stored with a leading dimension of 33 so thread r's row is bank-
//   conflict free.
// - Thread r then works on its own row from shared memory: softmax statistics online over the chunks
//   (running max and rescaled sums), the expectation (scalar) or the mixture sum_c p_c T[c, :] (context,
//   32 register accumulators, table rows read as 16-byte vectors that every lane of a warp shares: one
//   broadcast load each). No warp shuffles, no per-row reductions across threads.
// - Backward recomputes probabilities (nothing saved but the logits): scalar d logit_c = g w p_c (c - e)/tau,
//   context dp_c = <g, T[c]> (the gradient tile in shared memory, the transposed table broadcast), then
//   d logit_c = p_c (dp_c - sum_k p_k dp_k) / tau, written into the logits tile and stored flat.
//   Levels of more than 32 classes take a second pass (dot first, then the gradients).
// Tables come from Python zero-padded: forward (n, roundup(dim, 32)), backward (dim, roundup(n, 32)),
// in the accumulation dtype, 16-byte aligned rows.
#include "calendar/calendar.h"
#include "common/cuda_utils.cuh"

namespace tk {
namespace {
using namespace tk::cuda;

constexpr int kCW = 32;       // columns per staged tile chunk (classes, output or gradient columns)
constexpr int kLd = kCW + 1;  // shared leading dimension: thread r's row is conflict-free

template <typename A> struct Rows { static constexpr int value = sizeof(A) == 8 ? 64 : 128; };

template <typename A> struct alignas(4 * sizeof(A)) Vec4 { A v[4]; };

__host__ __device__ inline int64_t round32(int64_t x) { return (x + kCW - 1) / kCW * kCW; }
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// dst[r * kLd + c] = scale * src[r * rs + c * cs] for r < rows, c < cw: consecutive threads read
// consecutive columns of a row, then the next row (coalesced when cs == 1). Each thread issues kU loads
// before it stores any (memory-level parallelism: up to kU loads in flight per thread).
constexpr int kU = 8;
template <int NT, typename S, typename A>
__device__ __forceinline__ void load_tile(A* dst, const S* src, int64_t rs, int64_t cs, int rows, int cw, A scale) {
  const int total = rows * cw, dr = NT / cw, dc = NT % cw;
  int r = (int)threadIdx.x / cw, c = (int)threadIdx.x % cw;
  for (int i0 = threadIdx.x; i0 < total; i0 += NT * kU) {
    A v[kU];
    int off[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      off[u] = r * kLd + c;
      v[u] = (i0 + u * NT < total) ? to_acc(src[r * rs + c * cs]) * scale : A(0);
      r += dr;
      c += dc;
      if (c >= cw) { c -= cw; ++r; }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (i0 + u * NT < total) dst[off[u]] = v[u];
  }
}

// dst[r * rs + c] = src[r * kLd + c] for r < rows, c < cw (coalesced the same way).
template <int NT, typename S, typename A>
__device__ __forceinline__ void store_tile(S* dst, int64_t rs, const A* src, int rows, int cw) {
  const int total = rows * cw, dr = NT / cw, dc = NT % cw;
  int r = (int)threadIdx.x / cw, c = (int)threadIdx.x % cw;
  for (int i = threadIdx.x; i < total; i += NT) {
    dst[r * rs + c] = from_acc<S>(src[r * kLd + c]);
    r += dr;
    c += dc;
    if (c >= cw) { c -= cw; ++r; }
  }
}

// Online softmax statistics of one chunk x[0, cw) (already scaled by 1/tau, classes c0 + c):
// running max m, sum s = sum exp(x - m) and (WithE) e = sum (c0 + c) exp(x - m).
template <bool WithE, typename A>
__device__ __forceinline__ void chunk_stats(const A* x, int cw, int64_t c0, A& m, A& s, A& e) {
  A mc = m;
  for (int c = 0; c < cw; ++c) mc = max(mc, x[c]);
  // m == mc also covers a row that is -inf so far (exp(-inf - -inf) would be NaN)
  const A scale = (m == mc) ? A(1) : exp(m - mc);
  s *= scale;
  if (WithE) e *= scale;
  for (int c = 0; c < cw; ++c) {
    // -inf adds 0 even while the running max is -inf (exp(-inf - -inf) would be NaN); NaN still propagates
    const A ex = x[c] == -INFINITY ? A(0) : exp(x[c] - mc);
    s += ex;
    if (WithE) e += (A)(c0 + c) * ex;
  }
  m = mc;
}

// Stats over all chunks of a level; leaves the last chunk in xs. Block-uniform (barriers inside).
template <int R, bool WithE, typename S, typename A>
__device__ __forceinline__ void level_stats(A* xs, const S* x, int64_t rs, int64_t n, int rows, A inv_tau,
                                            bool active, A& m, A& s, A& e) {
  m = -INFINITY;
  s = 0;
  e = 0;
  for (int64_t c0 = 0; c0 < n; c0 += kCW) {
    const int cw = (int)min64(n - c0, kCW);
    __syncthreads();
    load_tile<R>(xs, x + c0, rs, 1, rows, cw, inv_tau);
    __syncthreads();
    if (active) chunk_stats<WithE>(xs + threadIdx.x * kLd, cw, c0, m, s, e);
  }
}

template <typename S, typename A, bool Bwd>
__global__ void __launch_bounds__(Rows<A>::value) scalar_kernel(CalendarParams p) {
  constexpr int R = Rows<A>::value;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* xs = reinterpret_cast<A*>(smem_raw);
  const int t = threadIdx.x;
  A* out = static_cast<A*>(p.out);
  const A* grad_out = static_cast<const A*>(p.grad_out);
  const A inv_tau = (A)p.inv_tau;
  const int64_t ntiles = (p.B + R - 1) / R;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int64_t b0 = tile * R;
    const int rows = (int)min64(p.B - b0, R);
    const bool active = t < rows;
    A u = 0;
    const A g = (Bwd && active) ? grad_out[b0 + t] : A(0);
    for (int l = 0; l < p.num_levels; ++l) {
      const auto& L = p.levels[l];
      const S* x = static_cast<const S*>(L.logits) + b0 * L.row_stride;
      A m, s, e;
      level_stats<R, true>(xs, x, L.row_stride, L.n, rows, inv_tau, active, m, s, e);
      e = e / s;
      if (!Bwd) {
        u += (A)L.weight * e;
        continue;
      }
      // d logit_c = g w p_c (c - e) / tau, p_c = exp(x_c - m) / s
      const A k = g * (A)L.weight * inv_tau / s;
      S* gl = static_cast<S*>(L.grad_logits) + b0 * L.n;
      for (int64_t c0 = 0; c0 < L.n; c0 += kCW) {
        const int cw = (int)min64(L.n - c0, kCW);
        if (L.n > kCW) {  // one chunk: level_stats left it in xs
          __syncthreads();
          load_tile<R>(xs, x + c0, L.row_stride, 1, rows, cw, inv_tau);
          __syncthreads();
        }
        if (active) {
          A* xr = xs + t * kLd;
          for (int c = 0; c < cw; ++c) xr[c] = k * exp(xr[c] - m) * ((A)(c0 + c) - e);
        }
        __syncthreads();
        store_tile<R>(gl + c0, L.n, xs, rows, cw);
      }
    }
    if (!Bwd && active) out[b0 + t] = p.accumulate ? out[b0 + t] + u : u;
  }
}

// acc[q] += w * T[q], q < 32, T 16-byte aligned; groups of four beyond `width` are skipped.
template <typename A>
__device__ __forceinline__ void axpy32(A (&acc)[kCW], A w, const A* T, int width) {
#pragma unroll
  for (int q4 = 0; q4 < kCW / 4; ++q4) {
    if (4 * q4 < width) {
      const Vec4<A> v = *reinterpret_cast<const Vec4<A>*>(T + 4 * q4);
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[4 * q4 + i] += w * v.v[i];
    }
  }
}

// acc[c] = <g_row, TT[:, c0 + c]> for c < 32 (classes beyond cw come out 0: the table is zero-padded).
// Block-uniform: stages the gradient tile in chunks of 32 columns.
template <int R, typename S, typename A>
__device__ __forceinline__ void grad_dot_table(A (&acc)[kCW], A* gs, const S* go, int64_t grs, int64_t gcs,
                                               const A* tabT, int64_t D, int64_t Np, int64_t c0, int cw,
                                               int rows, bool active) {
#pragma unroll
  for (int q = 0; q < kCW; ++q) acc[q] = 0;
  for (int64_t j0 = 0; j0 < D; j0 += kCW) {
    const int jw = (int)min64(D - j0, kCW);
    __syncthreads();
    load_tile<R>(gs, go + j0 * gcs, grs, gcs, rows, jw, A(1));
    __syncthreads();
    if (active) {
      const A* gr = gs + threadIdx.x * kLd;
      for (int j = 0; j < jw; ++j) axpy32(acc, gr[j], tabT + (j0 + j) * Np + c0, cw);
    }
  }
}

template <typename S, typename A>
__global__ void __launch_bounds__(Rows<A>::value) context_bwd_kernel(CalendarParams p) {
  constexpr int R = Rows<A>::value;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* xs = reinterpret_cast<A*>(smem_raw);  // logits chunk -> probabilities -> gradients
  A* gs = xs + R * kLd;                    // incoming gradient tile
  const int t = threadIdx.x;
  const A inv_tau = (A)p.inv_tau;
  const int64_t D = p.dim, gcs = p.grad_col_stride, grs = p.out_row_stride;
  const int64_t ntiles = (p.B + R - 1) / R;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int64_t b0 = tile * R;
    const int rows = (int)min64(p.B - b0, R);
    const bool active = t < rows;
    for (int l = 0; l < p.num_levels; ++l) {
      const auto& L = p.levels[l];
      const S* x = static_cast<const S*>(L.logits) + b0 * L.row_stride;
      const S* go = static_cast<const S*>(p.grad_out) + b0 * grs + L.out_col * gcs;
      const A* tabT = static_cast<const A*>(L.table);  // (D, Np)
      const int64_t Np = round32(L.n);
      S* gl = static_cast<S*>(L.grad_logits) + b0 * L.n;
      A m, s, e;
      level_stats<R, false>(xs, x, L.row_stride, L.n, rows, inv_tau, active, m, s, e);
      const A inv_s = A(1) / s;
      A* xr = xs + t * kLd;
      A acc[kCW];
      if (L.n <= kCW) {  // one chunk, already in xs: probabilities in place, one pass
        const int cw = (int)L.n;
        if (active)
          for (int c = 0; c < cw; ++c) xr[c] = exp(xr[c] - m) * inv_s;
        grad_dot_table<R>(acc, gs, go, grs, gcs, tabT, D, Np, 0, cw, rows, active);
        if (active) {
          A dot = 0;
#pragma unroll
          for (int q = 0; q < kCW; ++q)
            if (q < cw) dot += xr[q] * acc[q];
#pragma unroll
          for (int q = 0; q < kCW; ++q)
            if (q < cw) xr[q] = xr[q] * (acc[q] - dot) * inv_tau;
        }
        __syncthreads();
        store_tile<R>(gl, L.n, xs, rows, cw);
        continue;
      }
      // Several chunks: dot = sum_c p_c dp_c first, then the gradients (dp recomputed).
      A dot = 0;
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t c0 = 0; c0 < L.n; c0 += kCW) {
          const int cw = (int)min64(L.n - c0, kCW);
          __syncthreads();
          load_tile<R>(xs, x + c0, L.row_stride, 1, rows, cw, inv_tau);
          __syncthreads();
          grad_dot_table<R>(acc, gs, go, grs, gcs, tabT, D, Np, c0, cw, rows, active);
          if (active) {
#pragma unroll
            for (int q = 0; q < kCW; ++q) {
              if (q < cw) {
                const A pq = exp(xr[q] - m) * inv_s;
                if (pass == 0) dot += pq * acc[q];
                else xr[q] = pq * (acc[q] - dot) * inv_tau;
              }
            }
          }
          if (pass == 1) {
            __syncthreads();
            store_tile<R>(gl + c0, L.n, xs, rows, cw);
          }
        }
      }
    }
  }
}

template <typename Fn>
void launch_tiles(const CalendarParams& p, int device, uintptr_t stream, int tiles_of_2, Fn&& launch) {
  if (p.B == 0) return;
  set_device(device);
  dispatch_device_float(p.dtype, [&](auto t) {
    using S = decltype(t);
    using A = decltype(to_acc(S{}));
    constexpr int R = Rows<A>::value;
    const int64_t ntiles = (p.B + R - 1) / R;
    const int64_t cap = p.max_ctas > 0 ? p.max_ctas : ntiles;
    const unsigned grid = (unsigned)std::min<int64_t>(std::min<int64_t>(ntiles, cap), 1 << 30);
    const size_t smem = (size_t)tiles_of_2 * R * kLd * sizeof(A);  // <= 33,792 B: under the 48 KB default
    launch(S{}, A{}, dim3(grid), dim3(R), smem, reinterpret_cast<cudaStream_t>(stream));
  });
  check_launch();
}


// ---- the forward of calendar_context: warp-cooperative rows ---------------------------------------------------
//
// A warp owns a group of R rows (GroupRows: 8, 4 in double) and walks groups grid-stride (CTAs of kW2 warps, no
// __syncthreads anywhere: warps share nothing, each has its own small shared tile guarded by __syncwarp). Counts
// per row and registers: docs/calendar.md. Per level:
// - Statistics with lane = class (chunks of 32 classes): the R rows' logits of a chunk are loaded together
//   (R independent loads per lane in flight; the next level's first chunk is issued before this level's
//   arithmetic), per-lane online max / sum, then warp butterflies (max, then rescaled sums).
// - Probabilities written once per row into the warp's tile P[R][32]; lanes then own output columns
//   (j0 + 32 k + lane, k < kCPL), every table value T[c, col] is loaded once per group and reused for the R rows
//   from a register, probabilities read as 4-wide broadcasts; output stored straight from registers, one
//   128-byte coalesced store per row and 32 columns.
// The thread-per-row kernels above run the scalar op both ways and the context backward: each measured faster
// on the H100 than its warp-cooperative twin (docs/calendar.md).
namespace v2 {
constexpr int kW2 = 8;    // warps per CTA
constexpr int kCPL = 2;   // output columns per lane per column block (64 columns)
constexpr int kJB = 32 * kCPL;
// Resident CTAs per SM the register allocation must allow (ptxas caps registers at 65,536 / (256 x this)):
// 2 -> 128 registers; see docs/calendar.md for the ptxas report.
constexpr int kMinCtasContext = 2;
// Rows per warp group: every table value is reused for R rows (8; 4 in float64, twice the registers per value).
template <typename A> struct GroupRows {
  static constexpr int value = sizeof(A) == 8 ? 4 : 8;
};

// xv[r] = logits[r][c0 + lane] / tau (or -inf outside the level / the batch): R loads issued together.
template <int R, typename S, typename A>
__device__ __forceinline__ void load_chunk(A (&xv)[R], const S* x, int64_t rs, int64_t n, int rows, int64_t c0,
                                           A inv_tau) {
  const int lane = threadIdx.x & 31;
  const bool in = c0 + lane < n;
  S raw[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (in && r < rows) raw[r] = x[r * rs + c0 + lane];
#pragma unroll
  for (int r = 0; r < R; ++r) xv[r] = (in && r < rows) ? to_acc(raw[r]) * inv_tau : A(-INFINITY);
}

// Per-lane online update of (m, s[, e]) with one chunk's values (classes c0 + lane).
template <bool WithE, int R, typename A>
__device__ __forceinline__ void lane_update(const A (&xv)[R], int64_t c, A (&m)[R], A (&s)[R], A (&e)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const A mc = max(m[r], xv[r]);
    const A scale = (m[r] == mc) ? A(1) : exp(m[r] - mc);  // m == mc covers -inf so far
    const A ex = xv[r] == -INFINITY ? A(0) : exp(xv[r] - mc);
    s[r] = s[r] * scale + ex;
    if (WithE) e[r] = e[r] * scale + (A)c * ex;
    m[r] = mc;
  }
}

// All-reduce of R values per lane (R a power of two <= 32) across the warp: v[r] = op over the lanes of v[r], the
// same bits in every lane. Transposed butterfly: at offsets 16, 8, ... each lane keeps half of its values and
// trades the other half (R - 1 shuffles in all), then plain butterflies on one value, then R broadcasts back:
// 9 + 8 = 17 shuffles for 8 rows instead of 8 x 5 = 40.
template <int R, typename A, typename Op>
__device__ __forceinline__ void warp_allreduce(A (&v)[R], Op op) {
  const int lane = threadIdx.x & 31;
  A w[R];
#pragma unroll
  for (int r = 0; r < R; ++r) w[r] = v[r];
  int o = 16;
#pragma unroll
  for (int h = R / 2; h >= 1; h /= 2, o >>= 1) {
    const bool up = lane & o;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const A send = up ? w[i] : w[i + h], keep = up ? w[i + h] : w[i];
      w[i] = op(keep, __shfl_xor_sync(0xffffffffu, send, o));
    }
  }
  for (; o > 0; o >>= 1) w[0] = op(w[0], __shfl_xor_sync(0xffffffffu, w[0], o));
  // lane l now holds row sum_k (bit 4 - k of l) * R / 2^(k+1); row r is read from lane sum_k (r & R/2^(k+1) ? 16/2^k)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    int src = 0;
#pragma unroll
    for (int h = R / 2, b = 16; h >= 1; h /= 2, b >>= 1)
      if (r & h) src |= b;
    v[r] = __shfl_sync(0xffffffffu, w[0], src);
  }
}
template <typename A> struct MaxOp { __device__ __forceinline__ A operator()(A a, A b) const { return max(a, b); } };
template <typename A> struct SumOp { __device__ __forceinline__ A operator()(A a, A b) const { return a + b; } };

// Merges the lanes' (m, s[, e]): every lane ends with the row totals.
template <bool WithE, int R, typename A>
__device__ __forceinline__ void warp_merge(A (&m)[R], A (&s)[R], A (&e)[R]) {
  A mm[R];
#pragma unroll
  for (int r = 0; r < R; ++r) mm[r] = m[r];
  warp_allreduce(mm, MaxOp<A>());
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const A scale = (m[r] == mm[r]) ? A(1) : exp(m[r] - mm[r]);  // m == mm covers a lane or row of -inf
    s[r] *= scale;
    if (WithE) e[r] *= scale;
    m[r] = mm[r];
  }
  warp_allreduce(s, SumOp<A>());
  if (WithE) warp_allreduce(e, SumOp<A>());
}

// Statistics of a level's R rows; xv holds chunk 0 on entry (and on exit when n <= 32).
template <bool WithE, int R, typename S, typename A>
__device__ __forceinline__ void level_stats(A (&xv)[R], const S* x, int64_t rs, int64_t n, int rows, A inv_tau,
                                            A (&m)[R], A (&s)[R], A (&e)[R]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < R; ++r) {  // first chunk: m = x, s = exp(x - x) = 1 + (x - x) (0 for -inf, NaN for +inf), no exp
    m[r] = xv[r];
    s[r] = xv[r] == -INFINITY ? A(0) : A(1) + (xv[r] - xv[r]);
    e[r] = (A)lane * s[r];
  }
  for (int64_t c0 = 32; c0 < n; c0 += 32) {
    A xc[R];
    load_chunk(xc, x, rs, n, rows, c0, inv_tau);
    lane_update<WithE>(xc, c0 + lane, m, s, e);
  }
  warp_merge<WithE>(m, s, e);
}

template <int R, typename A>
__device__ __forceinline__ void group_range(int64_t B, int64_t& first, int64_t& step, int64_t& ngroups) {
  ngroups = (B + R - 1) / R;
  first = (int64_t)blockIdx.x * kW2 + (threadIdx.x >> 5);
  step = (int64_t)gridDim.x * kW2;
}

template <typename S, typename A>
__global__ void __launch_bounds__(kW2 * 32, kMinCtasContext) context_fwd_kernel(CalendarParams p) {
  constexpr int R = GroupRows<A>::value;
  __shared__ __align__(32) A Psh[kW2][R][32];
  const int lane = threadIdx.x & 31;
  A (*P)[32] = Psh[threadIdx.x >> 5];
  const A inv_tau = (A)p.inv_tau;
  const int64_t D = p.dim, Dp = round32(D);
  int64_t g0, gstep, ngroups;
  group_range<R, A>(p.B, g0, gstep, ngroups);
  for (int64_t grp = g0; grp < ngroups; grp += gstep) {
    const int64_t b0 = grp * R;
    const int rows = (int)min64(p.B - b0, R);
    A xa[R];
    {
      const auto& L = p.levels[0];
      load_chunk(xa, static_cast<const S*>(L.logits) + b0 * L.row_stride, L.row_stride, L.n, rows, 0, inv_tau);
    }
    for (int l = 0; l < p.num_levels; ++l) {
      const auto& L = p.levels[l];
      const S* x = static_cast<const S*>(L.logits) + b0 * L.row_stride;
      const A* __restrict__ tab = static_cast<const A*>(L.table);  // (n, Dp)
      A xb[R];
      if (l + 1 < p.num_levels) {
        const auto& N = p.levels[l + 1];
        load_chunk(xb, static_cast<const S*>(N.logits) + b0 * N.row_stride, N.row_stride, N.n, rows, 0, inv_tau);
      }
      A m[R], s[R], e[R];
      level_stats<false>(xa, x, L.row_stride, L.n, rows, inv_tau, m, s, e);
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] = A(1) / s[r];
      const bool one = L.n <= 32;
      S* o = static_cast<S*>(p.out) + b0 * p.out_row_stride + L.out_col;
      for (int64_t j0 = 0; j0 < D; j0 += kJB) {
        A acc[R][kCPL];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int k = 0; k < kCPL; ++k) acc[r][k] = 0;
        for (int64_t c0 = 0; c0 < L.n; c0 += 32) {
          const int cw = (int)min64(L.n - c0, 32);
          if (!one || j0 == 0) {  // probabilities of this chunk into the warp's tile (once per level when n <= 32)
            if (!one && c0 > 0) load_chunk(xa, x, L.row_stride, L.n, rows, c0, inv_tau);
            if (!one && c0 == 0 && j0 > 0) load_chunk(xa, x, L.row_stride, L.n, rows, 0, inv_tau);
            __syncwarp();
#pragma unroll
            for (int r = 0; r < R; ++r) P[r][lane] = lane < cw ? exp(xa[r] - m[r]) * s[r] : A(0);
            __syncwarp();
          }
          const A* t0 = tab + c0 * Dp + j0 + lane;
          for (int c4 = 0; c4 < cw; c4 += 4) {
            A t[4][kCPL];  // 4 classes x this lane's columns, loaded once for the R rows
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int k = 0; k < kCPL; ++k)
                t[i][k] = (c4 + i < cw && j0 + 32 * k < Dp) ? t0[(c4 + i) * Dp + 32 * k] : A(0);
#pragma unroll
            for (int r = 0; r < R; ++r) {
              const Vec4<A> pv = *reinterpret_cast<const Vec4<A>*>(&P[r][c4]);  // zero beyond cw
#pragma unroll
              for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int k = 0; k < kCPL; ++k) acc[r][k] += pv.v[i] * t[i][k];
            }
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int k = 0; k < kCPL; ++k) {
            const int64_t col = j0 + 32 * k + lane;
            if (r < rows && col < D) o[r * p.out_row_stride + col] = from_acc<S>(acc[r][k]);
          }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) xa[r] = xb[r];
    }
  }
}

template <typename Fn>
void launch_groups(const CalendarParams& p, int device, uintptr_t stream, Fn&& launch) {
  if (p.B == 0) return;
  set_device(device);
  dispatch_device_float(p.dtype, [&](auto t) {
    using S = decltype(t);
    using A = decltype(to_acc(S{}));
    constexpr int R = GroupRows<A>::value;
    const int64_t ctas = ((p.B + R - 1) / R + kW2 - 1) / kW2;
    const int64_t cap = p.max_ctas > 0 ? p.max_ctas : ctas;
    const unsigned grid = (unsigned)std::min<int64_t>(std::min<int64_t>(ctas, cap), 1 << 30);
    launch(S{}, A{}, dim3(grid), dim3(kW2 * 32), reinterpret_cast<cudaStream_t>(stream));
  });
  check_launch();
}
}  // namespace v2

}  // namespace

void calendar_scalar_fwd_cuda(const CalendarParams& p, int device, uintptr_t stream) {
  launch_tiles(p, device, stream, 1, [&](auto s, auto a, dim3 g, dim3 b, size_t sm, cudaStream_t st) {
    scalar_kernel<decltype(s), decltype(a), false><<<g, b, sm, st>>>(p);
  });
}
void calendar_scalar_bwd_cuda(const CalendarParams& p, int device, uintptr_t stream) {
  launch_tiles(p, device, stream, 1, [&](auto s, auto a, dim3 g, dim3 b, size_t sm, cudaStream_t st) {
    scalar_kernel<decltype(s), decltype(a), true><<<g, b, sm, st>>>(p);
  });
}
void calendar_context_fwd_cuda(const CalendarParams& p, int device, uintptr_t stream) {
  v2::launch_groups(p, device, stream, [&](auto s, auto a, dim3 g, dim3 b, cudaStream_t st) {
    v2::context_fwd_kernel<decltype(s), decltype(a)><<<g, b, 0, st>>>(p);
  });
}
void calendar_context_bwd_cuda(const CalendarParams& p, int device, uintptr_t stream) {
  launch_tiles(p, device, stream, 2, [&](auto s, auto a, dim3 g, dim3 b, size_t sm, cudaStream_t st) {
    context_bwd_kernel<decltype(s), decltype(a)><<<g, b, sm, st>>>(p);
  });
}

}  // namespace tk
