// Params for the fused multi-positive interval-overlap InfoNCE. Torch-free.
//
// Scores s_ij = inv_temp * q_i . d_j + bias_ij  (i < Bq, j < Bd), extra negatives e_ik = inv_temp * q_i . n_k.
// Row loss_i = lse_all(s_i., e_i.) - lse_{j in P_i} s_ij, column loss_j = lse_i s_ij - lse_{i in P'_j} s_ij,
// P = closed-interval overlap of spans; a row (column) with no positive uses its diagonal
// j = i + diag_offset (i = j - diag_offset). loss = row_weight * mean_i row_loss + col_weight * mean_j col_loss.
//
// Bias (optional) in angle-difference form, prepared by the Python wrapper from offset_bias's weights:
//   z_ijn = b1_n + A_i[n, :] . Ct[:, j]   when |u_d[j] - u_q[i]| <= 1,   else zc[0, n] (> 1) / zc[1, n] (< -1)
//   bias_ij = scale * (sum_n w2_n relu(z_ijn) + b2)
// A (Bq, hidden, K2) and Ct (K2, Bd) hold the per-row/per-column sin/cos features; the wrapper
// differentiates A, Ct and zc back to w1, b1, u_q, u_d with torch, the kernels return their gradients.
//
// Nothing of size Bq x Bd, Bq x N or Bq x Bd x hidden is ever allocated: forward keeps running
// max/sum per row and column; backward recomputes score tiles from the saved per-row/column stats.
#pragma once
#include <cstdint>
#include "common/types.h"

namespace tk {

struct MultiposParams {
  DType dtype = DType::F32;  // F32 or F64 (the wrapper upcasts halves); CUDA runs multipos_block.h
  int64_t Bq = 0, Bd = 0, N = 0, H = 0;
  const void* q = nullptr;    // (Bq, H), row stride ldq, unit column stride
  const void* d = nullptr;    // (Bd, H)
  const void* neg = nullptr;  // (N, H) or null
  int64_t ldq = 0, ldd = 0, ldn = 0;
  const int64_t* q_lo = nullptr;  // (Bq,) int64 span bounds, lo <= hi
  const int64_t* q_hi = nullptr;
  const int64_t* d_lo = nullptr;  // (Bd,)
  const int64_t* d_hi = nullptr;
  double inv_temp = 1.0, row_weight = 1.0, col_weight = 0.0;
  int64_t diag_offset = 0;
  // CPU, optional: explicit diagonal partners (-1: none), replacing diag_offset when rows/columns were
  // permuted by the wrapper (it sorts them by u so that tiles span narrow delta ranges).
  const int64_t* diag_col = nullptr;  // (Bq,) row i's fallback column
  const int64_t* diag_row = nullptr;  // (Bd,) column j's fallback row
  // optional (Bq,) 1 where row i has no overlapping document at all (the caller may see more documents than
  // this call's Bd: CTDLoss's gathered column pass); null: decided from this call's columns
  const uint8_t* row_none = nullptr;

  // ---- bias, all in the accumulation dtype (float32, float64 for float64) ----
  bool has_bias = false;
  int64_t hidden = 0, K2 = 0;
  const void* A = nullptr;    // (Bq, hidden, K2) contiguous
  const void* Ct = nullptr;   // (K2, Bd) contiguous
  const void* b1 = nullptr;   // (hidden,)
  const void* w2 = nullptr;   // (hidden,)
  const void* b2 = nullptr;   // scalar
  const void* scale = nullptr;  // scalar
  const void* zc = nullptr;   // (2, hidden): pre-activations at delta = +1 and -1 (b1 included)
  const void* u_q = nullptr;  // (Bq,) only to decide where the clamp bites
  const void* u_d = nullptr;  // (Bd,)
  // CPU: per-interval bounds of z_n(delta) = w1_n . phi(delta) + b1_n over ncell equal cells of [-1, 1]
  // (hidden x ncell, float64, the float32 rounding margin folded in). A tile whose pairs' deltas all lie
  // in cells where lo > 0 (hi < 0) has unit n always on (off): its on units are summed into one linear
  // unit and its off units skipped, exactly. Null: every unit stays a ReLU unit.
  const double* z_lo = nullptr;
  const double* z_hi = nullptr;
  int64_t ncell = 0;

  // ---- forward outputs (accumulation dtype) ----
  void* loss = nullptr;       // scalar
  void* row_stats = nullptr;  // (3, Bq): lse_all, lse_pos, used-diagonal flag (0/1)
  void* col_stats = nullptr;  // (3, Bd): same for columns (only when col_weight != 0)
  // optional: per row the hardest in-batch negative (Re3's s-_i), a by-product of the forward's tiles: the
  // column j < Bd (never an extra negative) that is not a positive of the row (overlap, or the diagonal
  // fallback when the row overlaps nothing) with the largest s_ij (bias included), the lowest caller index
  // among exact ties; -1 when the row has no negative. Written as col_map[j] (the caller's index of column
  // j: the wrapper permutes columns when a bias is given), or j when col_map is null.
  int64_t* hardest = nullptr;        // (Bq,)
  const int64_t* col_map = nullptr;  // (Bd,)

  // ---- backward (accumulation dtype; all outputs zero-filled by the wrapper) ----
  const void* grad_loss = nullptr;  // scalar
  void* dq = nullptr;    // (Bq, H) contiguous
  void* dd = nullptr;    // (Bd, H) contiguous
  void* dneg = nullptr;  // (N, H) contiguous
  void* dA = nullptr;    // (Bq, hidden, K2)
  void* dCt = nullptr;   // (K2, Bd)
  void* db1 = nullptr;   // (hidden,)
  void* dw2 = nullptr;   // (hidden,)
  void* db2 = nullptr;   // scalar
  void* dscale = nullptr;  // scalar
  void* dzc = nullptr;   // (2, hidden)
};

void multipos_infonce_fwd_cpu(const MultiposParams& p);
void multipos_infonce_bwd_cpu(const MultiposParams& p);

}  // namespace tk
