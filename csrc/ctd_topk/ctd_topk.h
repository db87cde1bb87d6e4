// Params for the fused CTD top-k scorer. Torch-free.
//   s_ij = q_i . g_j / temperature + bias_ij,  exact top-k per query (score desc, lower index first).
#pragma once
#include <cstdint>
#include "common/types.h"

namespace tk {

enum class CtdBias : int { None = 0, Exact = 1, Table = 2 };

struct CtdTopkParams {
  DType dtype = DType::F32;       // embeddings' dtype; everything else is in the accumulation dtype A
  int64_t Q = 0, N = 0, H = 0, k = 0;
  const void* q = nullptr;        // (Q, H), unit column stride
  int64_t q_stride = 0;
  const void* g = nullptr;        // (N, H), unit column stride
  int64_t g_stride = 0;
  double temperature = 1.0;
  CtdBias bias = CtdBias::None;
  const void* u_q = nullptr;      // (Q,) in A
  const void* u_g = nullptr;      // (N,) in A
  // exact bias: scale * (w2 . relu(w1 . phi(delta) + b1) + b2), all contiguous in A
  int64_t hidden = 0, D = 0, K = 0;  // w1 (hidden, D); phi has K sin + K cos columns cut/padded to D
  const void* freqs = nullptr;    // (K,)
  const void* w1 = nullptr;
  const void* b1 = nullptr;       // (hidden,)
  const void* w2 = nullptr;       // (hidden,)
  double b2 = 0.0, scale = 0.0;
  // table bias: P float32 samples at delta = -1 + 2 i / (P - 1)
  const float* table = nullptr;
  int64_t P = 0;
  // exclude: (Q, m) int64, each row sorted ascending (-1 padding first)
  const int64_t* exclude = nullptr;
  int64_t m = 0;
  // rerank mode (CPU): query i scores only rows cand[i, 0..C), ascending, negatives skipped
  const int64_t* cand = nullptr;
  int64_t C = 0;
  // outputs: values (Q, k) in A, indices (Q, k) int64; missing slots are -inf / -1
  void* values = nullptr;
  int64_t* indices = nullptr;
  // CUDA only: workspace of nsplit partial lists per query, (Q, nsplit, k) values in A + int64 ids
  void* ws_values = nullptr;
  int64_t* ws_indices = nullptr;
  int64_t nsplit = 1, cap = 0;    // cap: candidates per (query, split), a power of two >= k + 32
  void* ws_bias = nullptr;        // (Q, 2K, hidden) per-query first-layer matrix in A (exact bias)
  const void* bias_ends = nullptr;  // (2,) in A: the exact bias at delta = +1 and -1 (CUDA)
};

void ctd_topk_cpu(const CtdTopkParams& p);
#ifdef TK_WITH_CUDA
void ctd_topk_cuda(const CtdTopkParams& p, int device, uintptr_t stream);
#endif

}  // namespace tk
