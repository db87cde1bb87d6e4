// Device math shared by the Matryoshka and multipos kernels: exp through the SFU's exp2 with the rounding of
// x * log2(e) compensated, log, floor, -inf, the log-sum-exp of a (max, sum) and the table bias's interpolation.
#pragma once
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>
#include <limits>

namespace tk {
namespace cuda {

__device__ __forceinline__ float ex2f(float t) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(t));
  return y;
#else
  return exp2f(t);
#endif
}
// exp(x) about as accurate as expf: the formula of multipos_block_cuda.cu's dexp (a plain ex2(x * log2 e) loses
// |x| 2^-24 to the rounding of the product).
__device__ __forceinline__ float dexp(float x) {
  constexpr float L = 1.4426950408889634f, L_lo = 1.925963033500518e-08f, LN2 = 0.6931471805599453f;
  const float t = x * L;
  const float lo = fmaf(x, L, -t) + x * L_lo;
  const float y = ex2f(t);
  return fabsf(x) < 1e30f ? fmaf(y, lo * LN2, y) : y;
}
__device__ __forceinline__ double dexp(double x) { return exp(x); }
__device__ __forceinline__ float dlog(float x) { return logf(x); }
__device__ __forceinline__ double dlog(double x) { return log(x); }
template <typename A> __device__ __forceinline__ A ninf() { return -std::numeric_limits<A>::infinity(); }
template <typename A> __device__ __forceinline__ A lse_of(A m, A s) {
  return s > A(0) ? m + dlog(s) : (s == s ? ninf<A>() : s);  // empty: -inf; NaN stays NaN
}

__device__ __forceinline__ float dfloor(float x) { return floorf(x); }
__device__ __forceinline__ double dfloor(double x) { return ::floor(x); }

// Linear interpolation of the table at delta (clamped to [-1, 1]); slope = d bias / d delta (0 where the
// clamp bites), idx / t = the left bin and the weight of the right one. Same arithmetic as
// tempokern.reference.offset_bias_lookup (the multipos kernels and the tensor-core Matryoshka kernels).
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

}  // namespace cuda
}  // namespace tk
