// Device math shared by the Matryoshka kernels (matryoshka_block_cuda.cu, matryoshka_tc_cuda.cu): exp through
// the SFU's exp2 with the rounding of x * log2(e) compensated, log, -inf and the log-sum-exp of a (max, sum).
#pragma once
#include <cuda_runtime.h>
#include <cmath>
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

}  // namespace cuda
}  // namespace tk
