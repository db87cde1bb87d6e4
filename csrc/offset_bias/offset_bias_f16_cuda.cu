// The offset-bias CUDA kernels for float16 inputs (accumulating in float): one instantiation of
// offset_bias_kernels.cuh, called from offset_bias_cuda.cu.
#include "offset_bias/offset_bias_kernels.cuh"

namespace tk {

void offset_bias_launch_f16(const OffsetBiasParams& p, int device, uintptr_t stream, int which) {
  launch<__half, float>(p, device, stream, which);
}

}  // namespace tk
