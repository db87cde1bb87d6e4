// The fused CTD top-k's scan pass for float16 inputs: one instantiation of launch_scan (ctd_topk_kernels.cuh),
// called from ctd_topk_scan_cuda.cu.
#include "ctd_topk/ctd_topk_kernels.cuh"

namespace tk {

void ctd_topk_scan_f16(const CtdCudaParams& p, uintptr_t stream, int64_t blocks) {
  launch_scan<__half>(p, reinterpret_cast<cudaStream_t>(stream), blocks);
}

}  // namespace tk
