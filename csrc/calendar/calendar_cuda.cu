// CUDA kernels for the soft-calendar ops: one warp per batch row, softmax
// statistics by warp reduction, probabilities recomputed instead of stored.
#include "calendar/calendar.h"
#include "common/cuda_utils.cuh"

namespace tk {
namespace {
using namespace tk::cuda;

constexpr int kWarps = 4;

// Row max and sum of exp(x*inv_tau - max) for one level, computed by a whole warp.
template <typename S, typename A>
__device__ __forceinline__ void row_stats(const S* x, int64_t n, A inv_tau, A& m, A& s) {
  const int lane = threadIdx.x & 31;
  A mx = -INFINITY;
  for (int64_t c = lane; c < n; c += 32) mx = max(mx, to_acc(x[c]) * inv_tau);
  mx = warp_max(mx);
  A sm = 0;
  for (int64_t c = lane; c < n; c += 32) sm += exp(to_acc(x[c]) * inv_tau - mx);
  m = mx;
  s = warp_sum(sm);
}

template <typename S, typename A>
__global__ void scalar_fwd_kernel(CalendarParams p) {
  const int64_t b = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (b >= p.B) return;
  const int lane = threadIdx.x & 31;
  const A inv_tau = (A)p.inv_tau;
  A u = 0;
  for (int l = 0; l < p.num_levels; ++l) {
    const auto& L = p.levels[l];
    const S* x = static_cast<const S*>(L.logits) + b * L.row_stride;
    A m, s;
    row_stats(x, L.n, inv_tau, m, s);
    A e = 0;
    for (int64_t c = lane; c < L.n; c += 32) e += (A)c * exp(to_acc(x[c]) * inv_tau - m);
    e = warp_sum(e) / s;
    u += (A)L.weight * e;
  }
  if (lane == 0) {
    A* out = static_cast<A*>(p.out);
    out[b] = p.accumulate ? out[b] + u : u;
  }
}

template <typename S, typename A>
__global__ void scalar_bwd_kernel(CalendarParams p) {
  const int64_t b = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (b >= p.B) return;
  const int lane = threadIdx.x & 31;
  const A inv_tau = (A)p.inv_tau;
  const A g = static_cast<const A*>(p.grad_out)[b];
  for (int l = 0; l < p.num_levels; ++l) {
    const auto& L = p.levels[l];
    const S* x = static_cast<const S*>(L.logits) + b * L.row_stride;
    A m, s;
    row_stats(x, L.n, inv_tau, m, s);
    A e = 0;
    for (int64_t c = lane; c < L.n; c += 32) e += (A)c * exp(to_acc(x[c]) * inv_tau - m);
    e = warp_sum(e) / s;
    const A k = g * (A)L.weight * inv_tau / s;
    S* gl = static_cast<S*>(L.grad_logits) + b * L.n;
    for (int64_t c = lane; c < L.n; c += 32)
      gl[c] = from_acc<S>(k * exp(to_acc(x[c]) * inv_tau - m) * ((A)c - e));
  }
}

// out[j] = sum_c p_c T[c, j]: lanes own columns, probabilities are broadcast by shuffle.
template <typename S, typename A>
__global__ void context_fwd_kernel(CalendarParams p) {
  const int64_t b = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (b >= p.B) return;
  const int lane = threadIdx.x & 31;
  const A inv_tau = (A)p.inv_tau;
  const int64_t D = p.dim;
  for (int l = 0; l < p.num_levels; ++l) {
    const auto& L = p.levels[l];
    const S* x = static_cast<const S*>(L.logits) + b * L.row_stride;
    const A* tab = static_cast<const A*>(L.table);
    A m, s;
    row_stats(x, L.n, inv_tau, m, s);
    const A inv_s = A(1) / s;
    S* o = static_cast<S*>(p.out) + b * p.out_row_stride + L.out_col;
    for (int64_t j0 = 0; j0 < D; j0 += 32) {
      const int64_t j = j0 + lane;
      A acc = 0;
      for (int64_t c0 = 0; c0 < L.n; c0 += 32) {
        const int64_t c = c0 + lane;
        const A pc = c < L.n ? exp(to_acc(x[c]) * inv_tau - m) * inv_s : A(0);
        const int kmax = (L.n - c0) < 32 ? (int)(L.n - c0) : 32;
        for (int k = 0; k < kmax; ++k) {
          const A pk = __shfl_sync(0xffffffffu, pc, k);
          if (j < D) acc += pk * tab[(c0 + k) * D + j];
        }
      }
      if (j < D) o[j] = from_acc<S>(acc);
    }
  }
}

template <typename S, typename A>
__global__ void context_bwd_kernel(CalendarParams p) {
  const int64_t b = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (b >= p.B) return;
  const int lane = threadIdx.x & 31;
  const A inv_tau = (A)p.inv_tau;
  const int64_t D = p.dim;
  for (int l = 0; l < p.num_levels; ++l) {
    const auto& L = p.levels[l];
    const S* x = static_cast<const S*>(L.logits) + b * L.row_stride;
    const S* go = static_cast<const S*>(p.grad_out) + b * p.out_row_stride + L.out_col * p.grad_col_stride;
    const int64_t gcs = p.grad_col_stride;
    const A* tab = static_cast<const A*>(L.table);
    A m, s;
    row_stats(x, L.n, inv_tau, m, s);
    const A inv_s = A(1) / s;
    // Pass 1: dot = sum_c p_c <g, T[c]>.  Pass 2: grad_c = p_c (<g, T[c]> - dot) / tau.
    A dot = 0;
    for (int64_t c = lane; c < L.n; c += 32) {
      A gp = 0;
      for (int64_t j = 0; j < D; ++j) gp += to_acc(go[j * gcs]) * tab[c * D + j];
      dot += exp(to_acc(x[c]) * inv_tau - m) * inv_s * gp;
    }
    dot = warp_sum(dot);
    S* gl = static_cast<S*>(L.grad_logits) + b * L.n;
    for (int64_t c = lane; c < L.n; c += 32) {
      A gp = 0;
      for (int64_t j = 0; j < D; ++j) gp += to_acc(go[j * gcs]) * tab[c * D + j];
      gl[c] = from_acc<S>(exp(to_acc(x[c]) * inv_tau - m) * inv_s * (gp - dot) * inv_tau);
    }
  }
}

template <typename Fn>
void launch_rows(const CalendarParams& p, int device, uintptr_t stream, Fn&& launch) {
  if (p.B == 0) return;
  set_device(device);
  const dim3 grid((unsigned)((p.B + kWarps - 1) / kWarps)), block(32 * kWarps);
  dispatch_device_float(p.dtype, [&](auto t) {
    using S = decltype(t);
    using A = decltype(to_acc(S{}));
    launch(S{}, A{}, grid, block, reinterpret_cast<cudaStream_t>(stream));
  });
  check_launch();
}

}  // namespace

#define TK_CALENDAR_LAUNCH(fn, kernel)                                                  \
  void fn(const CalendarParams& p, int device, uintptr_t stream) {                      \
    launch_rows(p, device, stream, [&](auto s, auto a, dim3 g, dim3 b, cudaStream_t st) { \
      kernel<decltype(s), decltype(a)><<<g, b, 0, st>>>(p);                             \
    });                                                                                 \
  }

TK_CALENDAR_LAUNCH(calendar_scalar_fwd_cuda, scalar_fwd_kernel)
TK_CALENDAR_LAUNCH(calendar_scalar_bwd_cuda, scalar_bwd_kernel)
TK_CALENDAR_LAUNCH(calendar_context_fwd_cuda, context_fwd_kernel)
TK_CALENDAR_LAUNCH(calendar_context_bwd_cuda, context_bwd_kernel)

}  // namespace tk
