// Fused passes of the blocked Matryoshka InfoNCE on CUDA. Torch-free.
//
// The Python driver (tempokern/_ops/matryoshka_blocked.py, fused path) splits the rows into blocks of R rows
// and has torch (cuBLAS on CUDA) accumulate the segment products of a block into the level snapshots
// G_l = q[i0:i0+R, :m_l] . X[:, :m_l]^T (R x C, X = d or the extra negatives). One launch handles ONE level
// (a snapshot block with the level's row / column scales rho_l, kap_l), the same tiling as the multi-positive
// blocked kernels (multipos_block.h): CUDA blocks of TR rows x 1024 columns, 256 threads, grid nct x nrt.
//
//   forward ("fwd"): z_ij = inv_temp * rho_l[i] * kap_l[j] * G_ij + bias_ij; per (row, column tile) the
//     log-sum-exp of z over all columns and over the row's positives, per (row tile, column) the same over
//     the column's positives (merged by the driver with torch.logsumexp, as multipos).
//   backward ("bwd"), launched for the levels from the top one down: with the level's final statistics
//       g_ij = gr * (exp(z - La_i) - [pos_r] exp(z - Lp_i)) + gc * (exp(z - Ca_j) - [pos_c] exp(z - Cp_j))
//     (gr, gc: the level's row / column coefficient = level weight * term weight / count), the kernel writes
//       H_ij  (+)= inv_temp * rho_i * kap_j * g_ij   (dL/dG_l, suffix-summed over the levels in place:
//                                                    H = sum_{k >= l} h_k = dL/dP_l for segment l's products;
//                                                    with half operands also Ho = H rounded to their dtype)
//       Gb_ij (+)= g_ij                              (bias only: the per-pair bias gradient, summed over levels)
//       drho_part[i, tile] = sum_j g_ij inv_temp kap_j G_ij,  dkap_part[rtile, j] = sum_i g_ij inv_temp rho_i G_ij
//     and the driver runs dq[:, S_l] = H X[:, S_l], dX[:, S_l] += H^T q[:, S_l] with torch.
//
// Positives are those of multipos_block.h (span overlap, diagonal fallback at j == i + diag_offset for rows /
// columns without an overlap); a block of extra negatives (pos = false, cols = false) enters the row
// denominators only. The bias, when present, is a dense (R x C) block in the accumulation dtype (the exact
// MLP or the table interpolation, evaluated by tempokern's offset_bias ops once per row block for all levels).
#pragma once
#include <cstdint>
#include "common/types.h"

namespace tk {

struct MrlBlockParams {
  DType gdtype = DType::F32;  // snapshot block G (the accumulation dtype: F32 or F64)
  DType odtype = DType::F32;  // Ho (the operand dtype of the gradient products; = adtype without Ho)
  DType adtype = DType::F32;  // accumulation: F32, or F64 for float64 inputs (scales, stats, bias, Gb, partials)
  int64_t R = 0, C = 0;       // block rows, columns
  int64_t i0 = 0;             // global index of the block's first row
  const void* G = nullptr;
  int64_t ldg = 0;
  bool pos = true;   // positives (false: extra-negative block)
  bool cols = true;  // column statistics / column loss term
  const int32_t *q_lo = nullptr, *q_hi = nullptr;  // (Bq,) global, int32 (shifted or ranked by the driver)
  const int32_t *d_lo = nullptr, *d_hi = nullptr;  // (C,)
  const uint8_t* row_none = nullptr;               // (Bq,) 1: the row has no overlapping column
  const uint8_t* col_none = nullptr;               // (C,)
  const uint8_t* row_fb = nullptr;  // optional (Bq,): the rows' flag for the column fallback (default row_none;
                                    // the caller's own flag when it knows more columns than this call's)
  int64_t diag_offset = 0;
  double inv_temp = 1.0;
  const void* rho = nullptr;  // (Bq,) global: this level's inverse prefix norms of the rows
  const void* kap = nullptr;  // (C,): of the columns
  const void* dense = nullptr;  // optional (R x C) bias block, row stride ldb (positive blocks only)
  int64_t ldb = 0;

  int64_t TR = 32, nct = 1, nrt = 1;  // tiling: TR rows x 1024 columns per CUDA block

  // forward outputs (accumulation dtype)
  void* row_part = nullptr;  // (R, nslots, 2): (lse_all, lse_pos) of slot (slot0 + column tile)
  int64_t nslots = 1, slot0 = 0;
  void* col_part = nullptr;  // (nrt, C, 2)

  // backward
  const void* row_lse = nullptr;  // (2, Bq) global with row stride Bq: lse_all, lse_pos of this level
  const void* col_lse = nullptr;  // (2, C) with row stride C
  int64_t Bq = 0;
  double gr = 0.0, gc = 0.0;
  void* H = nullptr;  // (R, C) accumulation dtype, row stride ldh: the running suffix sum
  int64_t ldh = 0;
  bool accumulate = false;  // H += h (and Gb += g) instead of =
  void* Ho = nullptr;       // optional (R, C) odtype, row stride ldh: H rounded once to the operand dtype of the
                            // half-precision gradient products (fp16 / bf16 operands, float32 output)
  void* Gb = nullptr;       // optional (R, C) accumulation dtype, row stride ldh
  void* drho_part = nullptr;  // (R, nct)
  void* dkap_part = nullptr;  // (nrt, C)

  // "bwd_all": every level in one launch (levels 0..K-1, K <= kMrlMaxLevels). G is then (K, R, C) with level
  // stride lsg (the K snapshots), rho (K, Bq) and kap (K, C) with level strides ldr / ldk, row_lse / col_lse
  // the (K, 3, Bq) / (K, 3, C) statistics, coef (K, 2) the levels' (gr, gc) in the accumulation dtype. The
  // suffix sum stays in registers: H_l is written over G_l in place (H == G) or, with Ho, only as Ho_l (level
  // stride lsh); Gb once (the sum over the levels); drho_part (K, R, nct), dkap_part (K, nrt, C).
  int64_t K = 1, lsg = 0, lsh = 0, ldr = 0, ldk = 0;
  const void* coef = nullptr;
};

constexpr int kMrlMaxLevels = 32;

#ifdef TK_WITH_CUDA
void mrl_block_fwd_cuda(const MrlBlockParams& p, int device, uintptr_t stream);
void mrl_block_bwd_cuda(const MrlBlockParams& p, int device, uintptr_t stream);
void mrl_block_bwd_all_cuda(const MrlBlockParams& p, int device, uintptr_t stream);
#endif

}  // namespace tk
