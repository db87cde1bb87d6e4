// A CPU emulator of the parts of the CUDA programming model tempokern's kernels use, so that the
// shipped .cu files run (slowly, exactly as written) on a machine without a GPU.
//
// Every CUDA thread of a block is a fiber; a fiber runs until it reaches a barrier (__syncthreads, a
// warp collective such as __shfl_xor_sync, __ballot_sync, __syncwarp or a wmma operation), and the
// scheduler releases a barrier once every thread it names has arrived. Divergent barriers (some
// threads at __syncthreads, others at a shuffle or gone) are reported as errors instead of hanging.
// Shared memory is per block; dynamic shared memory starts filled with 0xFF bytes (NaN) so reading it
// before writing shows up. wmma fragments hold the whole tile in every lane (see emu_wmma.h).
// See tools/cuda_emu/README.md for what it checks and what it cannot.
#pragma once
#include <math.h>

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One block runs at a time on one OS thread, so per-OS-thread statics are per-block shared memory.
#define __shared__ static thread_local
#define __constant__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

// ---- runtime API -----------------------------------------------------------------------------
typedef struct emu_stream_st* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorLaunchFailure = 719, cudaErrorInvalidConfiguration = 9 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

namespace emu {

struct Thread;
struct Block;
extern thread_local Thread* t_cur;
extern thread_local Block* t_blk;

struct Thread {
  uint3 tid;
  int linear, lane;
};
struct Block {
  uint3 bid, bdim, gdim;
  unsigned char* dyn_smem;
};

enum WarpOp { OP_SYNC = 1, OP_SHFL_IDX, OP_SHFL_XOR, OP_SHFL_DOWN, OP_SHFL_UP, OP_BALLOT, OP_WMMA };

void sync_block();
uint64_t warp_op(int op, unsigned mask, uint64_t value, int arg, int width);
[[noreturn]] void device_error(const std::string& what);  // a fault inside a kernel

void set_last_error(cudaError_t e, const std::string& msg);
void set_func_smem(const void* fn, int bytes);
void launch(const char* name, dim3 grid, dim3 block, size_t smem, const void* fn, const std::function<void()>& body);
// `extern __shared__ T name[];` is rewritten by the build into `T* const name = (T*)::emu::dyn_smem();`.
inline unsigned char* dyn_smem() { return t_blk->dyn_smem; }

template <typename T>
inline uint64_t to_bits(const T& v) {
  static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes here");
  uint64_t r = 0;
  std::memcpy(&r, &v, sizeof(T));
  return r;
}
template <typename T>
inline T from_bits(uint64_t r) {
  T v;
  std::memcpy(&v, &r, sizeof(T));
  return v;
}

// `k<<<grid, block, smem, stream>>>(args)` is rewritten by the build into Launch(grid, block, smem, stream).run(k, args).
struct Launch {
  dim3 grid, block;
  size_t smem;
  Launch(dim3 g, dim3 b, size_t s = 0, cudaStream_t = nullptr) : grid(g), block(b), smem(s) {}
  template <typename... P, typename... Args>
  void run(const char* name, void (*k)(P...), Args&&... args) {
    // Arguments are converted to the kernel's parameter types once, as a launch copies them.
    auto body = [k, tup = std::tuple<std::decay_t<P>...>(std::forward<Args>(args)...)]() {
      std::apply(k, tup);
    };
    launch(name, grid, block, smem, reinterpret_cast<const void*>(k), std::function<void()>(body));
  }
};

}  // namespace emu

#define threadIdx (::emu::t_cur->tid)
#define blockIdx (::emu::t_blk->bid)
#define blockDim (::emu::t_blk->bdim)
#define gridDim (::emu::t_blk->gdim)
#define warpSize 32

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDevice(int* d);
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int device);
cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t s = nullptr);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, int kind, cudaStream_t s = nullptr);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaDeviceSynchronize();
template <typename F>
inline cudaError_t cudaFuncSetAttribute(F* fn, cudaFuncAttribute a, int value) {
  if (a == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    int optin = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
    if (value < 0 || value > optin) return cudaErrorInvalidValue;
    emu::set_func_smem(reinterpret_cast<const void*>(fn), value);
  }
  return cudaSuccess;
}

// ---- block and warp primitives -----------------------------------------------------------------
inline void __syncthreads() { emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::warp_op(emu::OP_SYNC, mask, 0, 0, 32); }
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return emu::from_bits<T>(emu::warp_op(emu::OP_SHFL_IDX, mask, emu::to_bits(v), src, width));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return emu::from_bits<T>(emu::warp_op(emu::OP_SHFL_XOR, mask, emu::to_bits(v), lane_mask, width));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return emu::from_bits<T>(emu::warp_op(emu::OP_SHFL_DOWN, mask, emu::to_bits(v), (int)delta, width));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return emu::from_bits<T>(emu::warp_op(emu::OP_SHFL_UP, mask, emu::to_bits(v), (int)delta, width));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return (unsigned)emu::warp_op(emu::OP_BALLOT, mask, pred != 0, 0, 32);
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline void __threadfence() {}
inline void __threadfence_block() {}
template <typename T>
inline T __ldg(const T* p) { return *p; }

// One block runs at a time, and fibers switch only at barriers, so read-modify-write is atomic here.
template <typename T>
inline T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <typename T>
inline T atomicMax(T* p, T v) {
  const T old = *p;
  if (v > old) *p = v;
  return old;
}
template <typename T>
inline T atomicCAS(T* p, T cmp, T v) {
  const T old = *p;
  if (old == cmp) *p = v;
  return old;
}

// ---- math: CUDA's device overloads in the global namespace -------------------------------------
inline float max(float a, float b) { return fmaxf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline float min(float a, float b) { return fminf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline int __float_as_int(float f) { return emu::from_bits<int>(emu::to_bits(f)); }
inline float __int_as_float(int i) { return emu::from_bits<float>(emu::to_bits(i)); }
inline unsigned __float_as_uint(float f) { return emu::from_bits<unsigned>(emu::to_bits(f)); }
inline float __uint_as_float(unsigned i) { return emu::from_bits<float>(emu::to_bits(i)); }
inline long long __double_as_longlong(double d) { return emu::from_bits<long long>(emu::to_bits(d)); }
inline double __longlong_as_double(long long i) { return emu::from_bits<double>(emu::to_bits(i)); }

// ---- half and bfloat16 -------------------------------------------------------------------------
namespace emu {
inline uint16_t f2h(float f) {
  _Float16 h = (_Float16)f;  // round to nearest even, as __float2half_rn
  uint16_t r;
  std::memcpy(&r, &h, 2);
  return r;
}
inline float h2f(uint16_t r) {
  _Float16 h;
  std::memcpy(&h, &r, 2);
  return (float)h;
}
inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
inline float bf2f(uint16_t r) {
  uint32_t u = (uint32_t)r << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace emu

struct __half {
  uint16_t __x;
  __half() = default;
  template <typename T, typename = std::enable_if_t<std::is_arithmetic<T>::value>>
  __half(T v) : __x(emu::f2h((float)v)) {}
  operator float() const { return emu::h2f(__x); }
};
struct __nv_bfloat16 {
  uint16_t __x;
  __nv_bfloat16() = default;
  template <typename T, typename = std::enable_if_t<std::is_arithmetic<T>::value>>
  __nv_bfloat16(T v) : __x(emu::f2bf((float)v)) {}
  operator float() const { return emu::bf2f(__x); }
};
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;
inline float __half2float(__half h) { return emu::h2f(h.__x); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half((float)d); }
inline float __bfloat162float(__nv_bfloat16 h) { return emu::bf2f(h.__x); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16((float)d); }
