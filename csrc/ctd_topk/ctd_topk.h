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
};

void ctd_topk_cpu(const CtdTopkParams& p);

// CUDA passes of the fused top-k; the driver (chunking, cuBLAS score blocks, merges) is the Python
// wrapper tempokern/_ops/ctd_topk.py. Both kernels keep one candidate buffer per (query, slice) in the
// workspace ws (Q, nslices, cap), cap a power of two >= k + 32, sorted at the end (best first, ties by
// lower gallery index) so that its first k entries are the slice's top-k; missing entries are
// (-inf, INT64_MAX).
//   select: scores (Q, N) in A (a block of q @ g[col0 : col0 + N].T written by cuBLAS, row stride
//           s_stride); one warp per (query, slice of per_slice columns); adds the bias, prunes with
//           bias_ub, and selects. Global indices are col0 + column.
//   scan:   Q <= 4 queries; one warp per slice of per_slice gallery rows computes the dot products
//           itself (16-byte loads of g when aligned), adds the bias and selects: one pass over g.
struct CtdCudaParams {
  DType dtype = DType::F32;       // scan: the embeddings' dtype; select: the scores' (F32 or F64)
  int64_t Q = 0, N = 0, H = 0, k = 0;
  const void* q = nullptr;        // scan: (Q, H), row stride q_stride
  int64_t q_stride = 0;
  const void* g = nullptr;        // scan: (N, H), row stride g_stride
  int64_t g_stride = 0;
  const void* scores = nullptr;   // select: (Q, N) in A
  int64_t s_stride = 0, col0 = 0;
  double temperature = 1.0;
  CtdBias bias = CtdBias::None;
  const void* u_q = nullptr;      // (Q,) in A
  const void* u_g = nullptr;      // (N,) in A (select: the block's columns)
  // exact bias: amat (Q, hidden, 2K) in A, the first layer folded with each query's angles, times the
  // gallery row's features [sin(f u_g), cos(f u_g)] (feats (N, 2K) in A, or computed per pair in
  // double from freqs (K,) when feats is null); pairs with |u_g - u_q| > 1 take bias_ends (+1, -1).
  int64_t hidden = 0, K = 0;
  const void* freqs = nullptr;
  const void* amat = nullptr;
  const void* feats = nullptr;
  const void* b1 = nullptr;       // (hidden,) in A
  const void* w2 = nullptr;       // (hidden,) in A
  const void* bias_ends = nullptr;
  double b2 = 0.0, scale = 0.0;
  double bias_ub = 0.0;           // >= every bias value the kernel can compute (exact pruning)
  const float* table = nullptr;   // table bias: P float32 samples
  int64_t P = 0;
  const int64_t* exclude = nullptr;  // (Q, m) int64 global row indices, rows sorted ascending
  int64_t m = 0;
  const void* thr_seed = nullptr;    // select: (Q,) in A, a lower bound of each query's k-th score so far, or null
  void* ws_values = nullptr;
  int64_t* ws_indices = nullptr;
  int64_t nslices = 1, per_slice = 0, cap = 0;
  // serve pass only (ctd_topk_cuda_serve, Q <= 16; see ctd_topk_cuda.cu):
  const void* w1 = nullptr;          // exact bias: (hidden, D) in A; freqs (K,) in A; b1, w2 as above
  int64_t D = 0;
  const double* b2_dev = nullptr;    // device b2 / scale (one double each), or null: b2 / scale above
  const double* scale_dev = nullptr;
  double* aux = nullptr;             // exact: (1025 + 2 hidden) doubles written by the prep kernel
  void* amat_out = nullptr;          // exact: (Q, hidden, 2K) in A written by the prep kernel (amat = amat_out)
  int64_t lists_per_cta = 0, groups = 1;  // merge: lists per CTA of the first merge stage, its CTAs per query
  void* mid_values = nullptr;        // (Q, groups, k) when groups > 1
  int64_t* mid_indices = nullptr;
  void* out_values = nullptr;        // (Q, k) in A; out_indices (Q, k) int64, -1 for a missing slot
  int64_t* out_indices = nullptr;
};

#ifdef TK_WITH_CUDA
void ctd_topk_cuda_select(const CtdCudaParams& p, int device, uintptr_t stream);
void ctd_topk_cuda_scan(const CtdCudaParams& p, int device, uintptr_t stream);
// Q <= 16 (serving): [prep (exact bias: bound samples + per-query first layer)], one scan of the gallery
// (per-warp top-k lists), two merge launches (per-query top-k in out_values / out_indices). No host sync.
void ctd_topk_cuda_serve(const CtdCudaParams& p, int device, uintptr_t stream);
#endif

}  // namespace tk
