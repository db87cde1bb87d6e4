// Entry points of the offset-bias CUDA kernels (offset_bias.h): the dtype picks one instantiation of
// offset_bias_kernels.cuh (offset_bias_<dtype>_cuda.cu). What the kernels do: offset_bias_kernels.cuh and
// docs/offset_bias.md.
#include <cstdint>
#include "common/cuda_utils.cuh"
#include "offset_bias/offset_bias.h"

namespace tk {

// offset_bias_<dtype>_cuda.cu; which: 0 forward, 1 backward, 2 lookup (float32 table), 3 table-mode forward,
// 4 table-mode backward
void offset_bias_launch_f32(const OffsetBiasParams& p, int device, uintptr_t stream, int which);
void offset_bias_launch_f64(const OffsetBiasParams& p, int device, uintptr_t stream, int which);
void offset_bias_launch_f16(const OffsetBiasParams& p, int device, uintptr_t stream, int which);
void offset_bias_launch_bf16(const OffsetBiasParams& p, int device, uintptr_t stream, int which);

namespace {

void run(const OffsetBiasParams& p, int device, uintptr_t stream, int which) {
  cuda::set_device(device);
  switch (p.dtype) {
    case DType::F32: offset_bias_launch_f32(p, device, stream, which); break;
    case DType::F64: offset_bias_launch_f64(p, device, stream, which); break;
    case DType::F16: offset_bias_launch_f16(p, device, stream, which); break;
    case DType::BF16: offset_bias_launch_bf16(p, device, stream, which); break;
  }
}

}  // namespace

void offset_bias_fwd_cuda(const OffsetBiasParams& p, int device, uintptr_t stream) { run(p, device, stream, 0); }
void offset_bias_bwd_cuda(const OffsetBiasParams& p, int device, uintptr_t stream) { run(p, device, stream, 1); }
void offset_bias_lookup_cuda(const OffsetBiasParams& p, int device, uintptr_t stream) { run(p, device, stream, 2); }
void offset_bias_table_fwd_cuda(const OffsetBiasParams& p, int device, uintptr_t stream) { run(p, device, stream, 3); }
void offset_bias_table_bwd_cuda(const OffsetBiasParams& p, int device, uintptr_t stream) { run(p, device, stream, 4); }

}  // namespace tk
