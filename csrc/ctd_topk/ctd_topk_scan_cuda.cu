// CUDA entry point of the fused CTD top-k's scan pass (1 to 4 queries whose serve tile does not fit its shared
// memory: scan_rows); the kernels: ctd_topk_kernels.cuh; one instantiation per dtype in
// ctd_topk_scan_<dtype>_cuda.cu.
#include "ctd_topk/ctd_topk_kernels.cuh"

namespace tk {

void ctd_topk_scan_f32(const CtdCudaParams& p, uintptr_t stream, int64_t blocks);
void ctd_topk_scan_f64(const CtdCudaParams& p, uintptr_t stream, int64_t blocks);
void ctd_topk_scan_f16(const CtdCudaParams& p, uintptr_t stream, int64_t blocks);
void ctd_topk_scan_bf16(const CtdCudaParams& p, uintptr_t stream, int64_t blocks);

void ctd_topk_cuda_scan(const CtdCudaParams& p, int device, uintptr_t stream) {
  cuda::set_device(device);
  check_common(p);
  if (p.Q > 4 || !p.q || !p.g || p.H < 1) fail("ctd_topk (CUDA): the scan pass takes 1 to 4 queries");
  const int64_t blocks = (p.nslices + SCAN_WARPS - 1) / SCAN_WARPS;
  if (blocks > INT_MAX) fail("ctd_topk (CUDA): too many slices");
  switch (p.dtype) {
    case DType::F32: ctd_topk_scan_f32(p, stream, blocks); break;
    case DType::F64: ctd_topk_scan_f64(p, stream, blocks); break;
    case DType::F16: ctd_topk_scan_f16(p, stream, blocks); break;
    case DType::BF16: ctd_topk_scan_bf16(p, stream, blocks); break;
  }
}

}  // namespace tk
