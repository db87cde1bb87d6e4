// Params for the fused relative-offset bias (offset_bias, its backward, and the table lookup). Torch-free.
// Only out / grad_out (Bq x Bd) are in the user dtype; every other array is in the accumulation type A
// (float32, or float64 for float64 calls), which Python casts to since they are O(B) or O(hidden * D).
#pragma once
#include <cstdint>
#include "common/types.h"

namespace tk {

struct OffsetBiasParams {
  DType dtype = DType::F32;   // storage of out / grad_out
  bool acc_double = false;    // A = double (float64 calls) else float
  int64_t Bq = 0, Bd = 0, D = 0, hidden = 0;
  int64_t n_linear = 0;         // units [0, n_linear) have no ReLU (merged always-active units, see Python)
  // CUDA: units [0, *n_active) are evaluated, the rest are skipped (Python orders the units so that those it
  // proved always off or merged into the linear unit come last; the count stays on the device: no host sync).
  // nullptr: all hidden units.
  const int32_t* n_active = nullptr;
  const void* u_q = nullptr;    // (Bq,) A
  const void* u_d = nullptr;    // (Bd,) A
  const void* freqs = nullptr;  // (K,)  A, reference.bias_frequencies(D)
  const void* w1 = nullptr;     // (hidden, D) A, row stride ld_w1
  int64_t ld_w1 = 0;
  const void* b1 = nullptr;     // (hidden,) A
  const void* w2 = nullptr;     // (hidden,) A
  const void* b2 = nullptr;     // (1,) A
  const void* scale = nullptr;  // (1,) A
  void* out = nullptr;          // (Bq, Bd) dtype, row stride ld_out
  int64_t ld_out = 0;
  const void* grad_out = nullptr;  // (Bq, Bd) dtype, strides (ld_grad, ld_grad_col) (backward; may be 0
  int64_t ld_grad = 0;             // for a broadcast gradient, so no contiguous copy is ever made)
  int64_t ld_grad_col = 1;
  // Backward outputs (A): d u_q, d u_d, and per-part partial sums laid out as nparts rows of
  // [R (hidden x (D + 1)) | S1 | S0] (see bias_math.h); Python sums the parts and forms the weight grads.
  void* grad_uq = nullptr;
  void* grad_ud = nullptr;
  void* partials = nullptr;
  int64_t nparts = 0;
  // Table lookup: float32 values (points,), see bias_math.h for the format.
  const float* table = nullptr;
  int64_t points = 0;
  // Training table mode ("tfwd" / "tbwd"): values (points,) in A, the exact MLP at the grid points.
  // tbwd writes: grad_uq as (rparts, Bq) and grad_ud as (cparts, Bd) partial sums in A (Python sums the
  // rows in float64; CPU: rparts = cparts = 1, CUDA: one row per column / row tile), and dL/dvalues as
  // nparts slots of `points` doubles in `partials` (Python sums the slots).
  const void* table_a = nullptr;
};

// Tiles of the CUDA table backward: kTableTileRows query rows x kTableTileCols documents per tile (one
// document per thread). Python sizes the partial buffers from these (tempokern/_ops/offset_bias.py).
constexpr int kTableTileRows = 64;
constexpr int kTableTileCols = 256;

#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t offset_bias_part_size(const OffsetBiasParams& p) { return p.hidden * (p.D + 1) + 2; }

void offset_bias_fwd_cpu(const OffsetBiasParams& p);
void offset_bias_bwd_cpu(const OffsetBiasParams& p);
void offset_bias_lookup_cpu(const OffsetBiasParams& p);
void offset_bias_table_fwd_cpu(const OffsetBiasParams& p);
void offset_bias_table_bwd_cpu(const OffsetBiasParams& p);
#ifdef TK_WITH_CUDA
void offset_bias_fwd_cuda(const OffsetBiasParams& p, int device, uintptr_t stream);
void offset_bias_bwd_cuda(const OffsetBiasParams& p, int device, uintptr_t stream);
void offset_bias_lookup_cuda(const OffsetBiasParams& p, int device, uintptr_t stream);
void offset_bias_table_fwd_cuda(const OffsetBiasParams& p, int device, uintptr_t stream);
void offset_bias_table_bwd_cuda(const OffsetBiasParams& p, int device, uintptr_t stream);
#endif

}  // namespace tk
