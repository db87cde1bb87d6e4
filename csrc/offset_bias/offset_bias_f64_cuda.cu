// The offset-bias CUDA kernels for float64 inputs (accumulating in double): one instantiation of
// offset_bias_kernels.cuh, called from offset_bias_cuda.cu.
#include "offset_bias/offset_bias_kernels.cuh"

namespace tk {

void offset_bias_launch_f64(const OffsetBiasParams& p, int device, uintptr_t stream, int which) {
  launch<double, double>(p, device, stream, which);
}

}  // namespace tk
