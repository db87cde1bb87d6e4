// Device helpers shared by CUDA kernels: error checks, dtype loads/stores, warp reductions.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <stdexcept>
#include <string>
#include "common/types.h"

#define TK_CUDA_CHECK(expr)                                                              \
  do {                                                                                   \
    cudaError_t _e = (expr);                                                             \
    if (_e != cudaSuccess)                                                               \
      throw std::runtime_error(std::string("tempokern CUDA error: ") + cudaGetErrorString(_e) + \
                               " at " __FILE__ ":" + std::to_string(__LINE__));          \
  } while (0)

namespace tk {
namespace cuda {

// Our cudart is static and keeps its own current device, so every launch sets it.
inline void set_device(int device) { TK_CUDA_CHECK(cudaSetDevice(device)); }
inline void check_launch() { TK_CUDA_CHECK(cudaGetLastError()); }

template <typename T> struct Storage { using type = T; };
template <> struct Storage<half_t> { using type = __half; };
template <> struct Storage<bf16_t> { using type = __nv_bfloat16; };

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <typename T> __device__ __forceinline__ T from_acc(double v) { return (T)v; }

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename A> __device__ __forceinline__ A warp_max(A v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Calls f(S{}) with the CUDA storage type (__half, __nv_bfloat16, float, double).
template <typename F> inline void dispatch_device_float(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    case DType::F16: f(__half{}); break;
    case DType::BF16: f(__nv_bfloat16{}); break;
  }
}

}  // namespace cuda
}  // namespace tk
