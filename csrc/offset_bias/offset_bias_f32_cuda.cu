// The offset-bias CUDA kernels for float32 inputs (accumulating in float): one instantiation of
// offset_bias_kernels.cuh, called from offset_bias_cuda.cu.
#include "offset_bias/offset_bias_kernels.cuh"

namespace tk {

void offset_bias_launch_f32(const OffsetBiasParams& p, int device, uintptr_t stream, int which) {
  launch<float, float>(p, device, stream, which);
}

}  // namespace tk
