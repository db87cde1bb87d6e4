// Fused passes of the blocked multi-positive InfoNCE. Torch-free.
//
// The Python driver (tempokern/_ops/multipos_blocked.py) splits the rows into blocks of R rows, has torch
// (cuBLAS on CUDA) compute the score block S = q[i0:i0+R] . d^T (R x C), and calls these kernels for
// everything around the products, one pass over S each:
//
//   forward ("fwd"): x_ij = inv_temp * S_ij + bias_ij; per (row, column tile) the log-sum-exp of x over all
//     columns and over the row's positives, per (row tile, column) the same over the column's positives;
//     the driver merges the partials with torch.logsumexp (O(R * C / 1024 + C * R / TR) numbers).
//   backward ("bwd"): with the final row and column statistics, dL/dx_ij =
//       gr * (exp(x - La_i) - [pos_r] exp(x - Lp_i)) + gc * (exp(x - Ca_j) - [pos_c] exp(x - Cp_j)),
//     written once as dS = inv_temp * dL/dx in the dtype of the next product (dq = dS d, dd += dS^T q);
//     the bias gradient: dense mode writes dL/dx (G); table mode scatters it into the table's bins and
//     sums dL/ddelta into per-row / per-column partials.
//
// Positives (ChunQiuTR's retrieval_utils.contrastive_loss_inbatch): ov = the closed intervals overlap;
//   row:    pos_r = ov || (row_none_i && j == i + off)
//   column: pos_c = ov || (j == i + off && (row_none_i || col_none_j))
// (the row-fallback mask transposed, then the diagonal for columns still without a positive).
// A block of extra negatives (pos = false, cols = false) enters the row denominators only.
#pragma once
#include <cstdint>
#include "common/types.h"

namespace tk {

struct MultiposBlockParams {
  DType sdtype = DType::F32;  // score block S
  DType odtype = DType::F32;  // dS (the operand dtype of the next products)
  DType adtype = DType::F32;  // accumulation: F32, or F64 for float64 inputs (stats, u, table, dense, G)
  int64_t R = 0, C = 0;       // block rows, columns
  int64_t i0 = 0;             // global index of the block's first row
  const void* S = nullptr;
  int64_t lds = 0;
  bool pos = true;   // positives (false: extra-negative block)
  bool cols = true;  // column statistics / column loss term
  // span bounds, int32: the driver shifts them by their minimum (or replaces them by their ranks when the
  // range exceeds int32), which keeps every comparison
  const int32_t *q_lo = nullptr, *q_hi = nullptr;  // (Bq,) global
  const int32_t *d_lo = nullptr, *d_hi = nullptr;  // (C,)
  const uint8_t* row_none = nullptr;               // (Bq,) 1: the row has no overlapping column
  const uint8_t* col_none = nullptr;               // (C,)
  int64_t diag_offset = 0;
  double inv_temp = 1.0;

  int bias_mode = 0;  // 0 none, 1 table (u_q, u_d, table of P points), 2 dense (R x C block, row stride ldb)
  const void* u_q = nullptr;  // (Bq,) global, accumulation dtype
  const void* u_d = nullptr;  // (C,)
  const void* table = nullptr;
  int64_t P = 0;
  const void* dense = nullptr;
  int64_t ldb = 0;

  // tiling (chosen by the driver): TR rows x 1024 columns per CUDA block; nct = ceil(C / 1024) column tiles,
  // nrt = ceil(R / TR) row tiles. CPU: one row per task, nrt row chunks.
  int64_t TR = 32, nct = 1, nrt = 1;

  // forward outputs (accumulation dtype)
  void* row_part = nullptr;  // (R, nslots, 2): (lse_all, lse_pos) of slot (slot0 + column tile)
  int64_t nslots = 1, slot0 = 0;
  void* col_part = nullptr;  // (nrt, C, 2)
  // optional (positive blocks only): per (row, column tile) the largest x over the row's negatives (columns
  // with pos_r false) and its column, the lowest among exact ties; (-inf, -1) when the tile has none. The
  // driver merges the nct partials per row (max, then the lowest column among equal maxima).
  void* hard_val = nullptr;      // (R, nct) accumulation dtype
  int64_t* hard_idx = nullptr;   // (R, nct)

  // backward
  const void* row_lse = nullptr;  // (2, Bq) global: lse_all, lse_pos
  const void* col_lse = nullptr;  // (2, C)
  int64_t Bq = 0;
  double gr = 0.0, gc = 0.0;      // d loss / d (row, column) term: weight * grad / count
  void* dS = nullptr;             // (R, C) odtype, row stride ldo
  int64_t ldo = 0;
  void* G = nullptr;              // dense mode: (R, C) accumulation dtype, row stride ldo
  void* duq_part = nullptr;       // table mode: (R, nct) accumulation dtype (dL/du_q of the row, per column tile)
  void* dud_part = nullptr;       // table mode: (nrt, C)
  double* hist = nullptr;         // table mode: (nhist, P) float64, accumulated into (+=)
  int64_t nhist = 0;              // rows of hist: the CUDA grid size (nct * nrt), CPU: nrt
};

// ---- the glue around the passes: prep, finalize, table gradient ----
//
// prep (one launch per step, before the passes): from the int64 span bounds, the int32 bounds the passes
// compare (shifted by the minimum of all bounds when max - min < 2^31 - 1, else each bound's rank = the count
// of bounds smaller than it: both keep every comparison) and the fallback flags row_none / col_none (1 where
// the row (column) overlaps no column (row); ov = max(lo) <= min(hi), as in the passes). It also zeroes the
// finalize's block counter.
struct MultiposPrepParams {
  int64_t Bq = 0, Bd = 0, diag_offset = 0;
  const int64_t *q_lo = nullptr, *q_hi = nullptr, *d_lo = nullptr, *d_hi = nullptr;
  int32_t* spans32 = nullptr;  // (2 Bq + 2 Bd): q_lo, q_hi, d_lo, d_hi
  uint8_t* row_none = nullptr;  // (Bq,)
  uint8_t* col_none = nullptr;  // (Bd,)
  unsigned* counter = nullptr;  // optional: set to 0
  double* zero = nullptr;       // optional: nzero float64 set to 0 (the table-gradient histogram)
  int64_t nzero = 0;
};

// finalize (one launch per row block, after its forward passes): the block's row statistics from the
// per-(row, slot) partials (row_lse[:, i0:i0+R] = logsumexp over slots), the column statistics merged into
// col_lse (first block: written, later ones: logaddexp), the hardest negative per row from its per-tile
// partials; the last launch (last = true) also writes the loss: row_weight * mean_i(La_i - Lp_i) +
// col_weight * mean_j(Ca_j - Cp_j) (sums in float64, each difference in the accumulation dtype), summed by
// the grid's last CTA (a block counter, reset to 0 by that CTA). torch.logsumexp / torch.logaddexp semantics.
struct MultiposFinParams {
  DType adtype = DType::F32;
  int64_t Bq = 0, Bd = 0, i0 = 0, R = 0, nslots = 1, nrt = 1, nct = 1;
  bool cols = true, first = true, last = true;
  const void* row_part = nullptr;  // (R, nslots, 2)
  const void* col_part = nullptr;  // (nrt, Bd, 2)
  void* row_lse = nullptr;         // (2, Bq)
  void* col_lse = nullptr;         // (2, Bd)
  const void* hard_val = nullptr;  // optional (R, nct) with hard_idx, written into hardest[i0 : i0 + R]
  const int64_t* hard_idx = nullptr;
  int64_t* hardest = nullptr;
  double row_weight = 0.0, col_weight = 0.0;
  void* loss = nullptr;           // () accumulation dtype (last launch)
  unsigned* counter = nullptr;    // CUDA: the last-CTA counter, 0 before the launch
};

// table-bias gradient glue (one launch per row block, after its gradient pass): du_q[i0 + t] = sum over the
// nct column tiles of duq_part[t, :]; dud_acc (float64, Bd) = (first ? 0 : dud_acc) + sum over the nrt row
// tiles of dud_part[:, j] (in float64); on the last launch du_d = dud_acc and dtable[k] = sum over the nhist
// rows of hist[:, k], both in the accumulation dtype (in one launch).
struct MultiposTableGradParams {
  DType adtype = DType::F32;
  int64_t Bq = 0, Bd = 0, i0 = 0, R = 0, nct = 1, nrt = 1, P = 0, nhist = 1;
  bool first = true, last = true;
  const void* duq_part = nullptr;  // (R, nct)
  const void* dud_part = nullptr;  // (nrt, Bd)
  const double* hist = nullptr;    // (nhist, P)
  double* dud_acc = nullptr;       // (Bd,)
  void* du_q = nullptr;            // (Bq,)
  void* du_d = nullptr;            // (Bd,)
  void* dtable = nullptr;          // (P,)
};

void multipos_block_prep_cpu(const MultiposPrepParams& p);
void multipos_block_tgrad_cpu(const MultiposTableGradParams& p);
void multipos_block_fin_cpu(const MultiposFinParams& p);
#ifdef TK_WITH_CUDA
void multipos_block_prep_cuda(const MultiposPrepParams& p, int device, uintptr_t stream);
void multipos_block_fin_cuda(const MultiposFinParams& p, int device, uintptr_t stream);
void multipos_block_tgrad_cuda(const MultiposTableGradParams& p, int device, uintptr_t stream);
#endif

void multipos_block_fwd_cpu(const MultiposBlockParams& p);
void multipos_block_bwd_cpu(const MultiposBlockParams& p);
#ifdef TK_WITH_CUDA
void multipos_block_fwd_cuda(const MultiposBlockParams& p, int device, uintptr_t stream);
void multipos_block_bwd_cuda(const MultiposBlockParams& p, int device, uintptr_t stream);
#endif

}  // namespace tk
