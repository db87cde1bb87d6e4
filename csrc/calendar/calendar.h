// Params for the soft-calendar ops (calendar_scalar, calendar_context). Torch-free.
#pragma once
#include <cstdint>
#include "common/types.h"

namespace tk {

constexpr int kMaxCalendarLevels = 8;  // Python feeds longer hierarchies in chunks.

struct CalendarLevel {
  const void* logits = nullptr;  // (B, n), unit column stride, dtype = params.dtype
  void* grad_logits = nullptr;   // (B, n) contiguous, backward only
  int64_t n = 0;
  int64_t row_stride = 0;
  double weight = 0.0;           // calendar_scalar: prod(n_k, k > l) / (prod(n) - 1)
  // calendar_context, Fourier table in the accumulation dtype: CPU (n, dim); CUDA forward (n, roundup(dim, 32)),
  // CUDA backward its transpose (dim, roundup(n, 32)), zero-padded, rows 32-byte aligned.
  const void* table = nullptr;
  int64_t out_col = 0;           // calendar_context: first output column of this level
};

struct CalendarParams {
  DType dtype = DType::F32;
  int64_t B = 0;
  int num_levels = 0;
  CalendarLevel levels[kMaxCalendarLevels];
  double inv_tau = 1.0;
  // calendar_scalar: out/grad_out are (B,) in the accumulation dtype (f32, or f64 for f64 input).
  // calendar_context: out/grad_out are (B, *) in dtype with row stride out_row_stride.
  void* out = nullptr;
  const void* grad_out = nullptr;
  int64_t out_row_stride = 0;
  int64_t grad_col_stride = 1;  // calendar_context backward: grad_out may be a broadcast (stride 0)
  int64_t dim = 0;
  bool accumulate = false;  // calendar_scalar: add to out instead of overwriting
  int64_t max_ctas = 0;     // CUDA: grid size cap (grid-stride over row tiles); 0 = one CTA per tile
};

void calendar_scalar_fwd_cpu(const CalendarParams& p);
void calendar_scalar_bwd_cpu(const CalendarParams& p);
void calendar_context_fwd_cpu(const CalendarParams& p);
void calendar_context_bwd_cpu(const CalendarParams& p);
#ifdef TK_WITH_CUDA
void calendar_scalar_fwd_cuda(const CalendarParams& p, int device, uintptr_t stream);
void calendar_scalar_bwd_cuda(const CalendarParams& p, int device, uintptr_t stream);
void calendar_context_fwd_cuda(const CalendarParams& p, int device, uintptr_t stream);
void calendar_context_bwd_cuda(const CalendarParams& p, int device, uintptr_t stream);
// The measured defaults above: scalar both ways and the context backward thread-per-row, the context forward
// warp-cooperative (calendar_cuda.cu). The candidate v3 kernels (calendar_v3_cuda.cu, opt-in): float32 / float16 /
// bfloat16, 1-3 levels of <= 32 classes (context: dim a multiple of 4, <= 128)
void calendar_scalar_fwd_cuda_v3(const CalendarParams& p, int device, uintptr_t stream);
void calendar_scalar_bwd_cuda_v3(const CalendarParams& p, int device, uintptr_t stream);
void calendar_context_fwd_cuda_v3(const CalendarParams& p, int device, uintptr_t stream);
void calendar_context_bwd_cuda_v3(const CalendarParams& p, int device, uintptr_t stream);
#endif

}  // namespace tk
