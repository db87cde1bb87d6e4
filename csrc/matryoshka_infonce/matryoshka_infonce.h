// Params for the single-pass fused Matryoshka InfoNCE (spec tmrl-re3.md §2.3 K1). Torch-free.
//
// Levels l = 0..K-1 with nested prefixes seg[0] = 0 < seg[1] < ... < seg[K] <= H; segment S_l =
// [seg[l], seg[l+1]). Raw prefix products G_l(i,j) = q_i[0:seg[l+1]] . d_j[0:seg[l+1]] are accumulated
// segment by segment; level-l logits z_l(i,j) = inv_temp * G_l(i,j) * rho[l][i] * kap[l][j]
// (rho/kap = inverse prefix norms built by the wrapper, ones for normalize=False); extra negatives
// e_l(i,k) = inv_temp * Gn_l(i,k) * rho[l][i] * kneg[l][k] join the row denominators only.
// Per level the multipos_infonce loss (span-overlap positives, diagonal fallback at j = i + diag_offset,
// ChunQiuTR column positives): level_l = row_weight * mean_i row_l + col_weight * mean_j col_l, and
// loss = sum_{coef_l != 0} coef_l * level_l.
// Backward (coef_l = dL/dlevel_l): h_l = g_l * rho * kap * inv_temp, suffix sums H_l = sum_{k >= l} h_k,
// dq[:, S_l] += H_l d[:, S_l], dd[:, S_l] += H_l^T q[:, S_l]; drho[l][i] = sum_j g_l z_l / rho[l][i] (and
// the same for kap / kneg over rows). Nothing of size Bq x Bd or Bq x N is allocated.
#pragma once
#include <cstdint>
#include <vector>
#include "common/types.h"

namespace tk {

struct MatryoshkaParams {
  DType dtype = DType::F32;  // F32 or F64 (the wrapper upcasts halves)
  int64_t Bq = 0, Bd = 0, N = 0, H = 0, K = 0;
  std::vector<int64_t> seg;      // K + 1 prefix bounds
  std::vector<double> coef;      // K: forward: level weights of the loss; backward: dL/dlevel_l
  const void* q = nullptr;       // (Bq, H) row stride ldq, unit column stride
  const void* d = nullptr;       // (Bd, H)
  const void* neg = nullptr;     // (N, H) or null
  int64_t ldq = 0, ldd = 0, ldn = 0;
  const void* rho = nullptr;     // (K, Bq) contiguous
  const void* kap = nullptr;     // (K, Bd)
  const void* kneg = nullptr;    // (K, N)
  const int64_t *q_lo = nullptr, *q_hi = nullptr, *d_lo = nullptr, *d_hi = nullptr;
  const uint8_t* row_none = nullptr;  // optional (Bq,): rows overlapping no document anywhere
  double inv_temp = 1.0, row_weight = 1.0, col_weight = 0.0;
  int64_t diag_offset = 0;
  // forward outputs (accumulation dtype)
  void* loss = nullptr;       // scalar
  void* levels = nullptr;     // (K,)
  void* row_stats = nullptr;  // (K, 3, Bq): lse_all, lse_pos, used-diagonal flag
  void* col_stats = nullptr;  // (K, 3, Bd) when col_weight != 0
  // backward outputs (zero-filled by the wrapper)
  void *dq = nullptr, *dd = nullptr, *dneg = nullptr, *drho = nullptr, *dkap = nullptr, *dkneg = nullptr;
};

void matryoshka_infonce_fwd_cpu(const MatryoshkaParams& p);
void matryoshka_infonce_bwd_cpu(const MatryoshkaParams& p);

}  // namespace tk
