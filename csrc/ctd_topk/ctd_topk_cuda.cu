// CUDA entry point of the fused CTD top-k for Q >= 5: select_block over a cuBLAS score block. The kernels:
// ctd_topk_kernels.cuh; the Q <= 4 passes: ctd_topk_serve_cuda.cu (serve) and ctd_topk_scan_cuda.cu (scan_rows,
// when the serve tile does not fit). One file per pass, so that a parallel build compiles them side by side.
#include "ctd_topk/ctd_topk_kernels.cuh"

namespace tk {

void ctd_topk_cuda_select(const CtdCudaParams& p, int device, uintptr_t stream) {
  cuda::set_device(device);
  check_common(p);
  if (!p.scores || p.s_stride < p.N) fail("ctd_topk (CUDA): bad score block");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const int64_t warps = p.Q * p.nslices;
  const int64_t blocks = (warps + SEL_WARPS - 1) / SEL_WARPS;
  if (blocks > INT_MAX) fail("ctd_topk (CUDA): too many (query, slice) pairs in one launch");
  if (p.dtype != DType::F64 && p.dtype != DType::F32) fail("ctd_topk (CUDA): the score block must be float32 or float64");
  with_mode(p.bias, [&](auto mode) {
    constexpr int M = decltype(mode)::value;
    if (p.dtype == DType::F64) {
      select_block<double, M><<<(unsigned)blocks, SEL_WARPS * 32, 0, st>>>(p);
    } else {
      select_block<float, M><<<(unsigned)blocks, SEL_WARPS * 32, 0, st>>>(p);
    }
  });
  cuda::check_launch();
}

}  // namespace tk
