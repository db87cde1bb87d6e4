// Kernels with deliberate bugs (and their fixed twins), so tests can check that the emulator reports
// what a GPU would get wrong instead of quietly computing something.
#include <cuda_runtime.h>
#include <mma.h>
#include <stdexcept>
#include <string>

namespace {

__global__ void race(float* out, int fixed) {
  extern __shared__ float s[];  // dynamic: the emulator fills it with NaN bytes at every block start
  const int t = threadIdx.x;
  s[t] = (float)t;
  if (fixed) __syncthreads();
  out[t] = s[(t + 1) % 64];  // unfixed: whether the neighbour has written yet depends on thread order
}

__global__ void shfl_after_exit(float* out, int) {
  const int t = threadIdx.x;
  if (t == 31) return;
  out[t] = __shfl_xor_sync(0xffffffffu, (float)t, 1);
}

__global__ void shfl_vs_syncthreads(float* out, int) {
  const int t = threadIdx.x;
  float v = (float)t;
  if (t != 5) v = __shfl_xor_sync(0xffffffffu, v, 1);
  __syncthreads();
  out[t] = v;
}

__global__ void warp_sum(float* out, int) {
  float v = (float)threadIdx.x;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const unsigned b = __ballot_sync(0xffffffffu, threadIdx.x % 3 == 0);
  out[threadIdx.x] = v + (float)__popc(b) * 1000.f;
}

__global__ void wmma_misaligned(float* out, int offset) {
  using namespace nvcuda;
  __shared__ __align__(32) __half a[16 * 16 + 16];
  for (int i = threadIdx.x; i < 16 * 16 + 16; i += 32) a[i] = __float2half(1.f);
  __syncwarp();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
  wmma::fill_fragment(c, 0.f);
  wmma::load_matrix_sync(fa, a + offset, 16);
  wmma::load_matrix_sync(fb, a, 16);
  wmma::mma_sync(c, fa, fb, c);
  wmma::store_matrix_sync(out, c, 16, wmma::mem_row_major);
}

__global__ void big_smem(float* out, int) {
  extern __shared__ float dyn[];
  dyn[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = dyn[(threadIdx.x + 1) % 32];
}

}  // namespace

// Runs one self-test kernel on host memory `out` (at least 256 floats); throws what the emulator reports.
void emu_selftest(const std::string& name, float* out, int arg) {
  cudaStream_t st = nullptr;
  if (name == "race") {
    race<<<1, 64, 64 * sizeof(float), st>>>(out, arg);
  } else if (name == "shfl_after_exit") {
    shfl_after_exit<<<1, 32, 0, st>>>(out, arg);
  } else if (name == "shfl_vs_syncthreads") {
    shfl_vs_syncthreads<<<1, 32, 0, st>>>(out, arg);
  } else if (name == "warp_sum") {
    warp_sum<<<1, 32, 0, st>>>(out, arg);
  } else if (name == "wmma_misaligned") {
    wmma_misaligned<<<1, 32, 0, st>>>(out, arg);
  } else if (name == "big_smem") {
    if (arg) {
      cudaError_t e = cudaFuncSetAttribute(big_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024);
      if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
    }
    big_smem<<<1, 32, 100 * 1024, st>>>(out, arg);
  } else {
    throw std::invalid_argument("unknown self-test " + name);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
}
