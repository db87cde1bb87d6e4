// Tensor-core fused passes of the blocked Matryoshka InfoNCE on CUDA ("tc", the default CUDA execution for
// bfloat16 embeddings without a bias or extra negatives). Torch-free.
//
// The per-level kernels of matryoshka_block.h read each level's (R x C) score block from memory, which cuBLAS
// wrote: K score blocks per pass, ~5 x the bytes of one level for dims 64..768. Here the score tiles never
// leave the chip. A CUDA block owns 64 rows x (a range of 64-column tiles); per tile it accumulates the prefix
// products q[:, :m_l] d[:, :m_l]^T on the tensor cores (wmma, bf16 operands, float32 accumulation),
// one feature chunk of <= 32 at a time through double-buffered shared memory, and at each level boundary
// stores the accumulators (the raw level score G_l of the tile, float32) to shared memory:
//
//   forward ("fwd"): z = inv_temp rho_l[i] kap_l[j] G_l; the row log-sum-exps over all columns and over the
//     row's positives (online, per row and split of the columns: row_part), per (row block, column) the same
//     over the column's positives (col_part, when cols): merged by the driver with torch.logsumexp.
//   backward ("bwd"): after the top level the tile holds G_0..G_{K-1}; per element, from the top level down,
//       g_l = gr_l (exp(z - La_i) - [pos_r] exp(z - Lp_i)) + gc_l (exp(z - Ca_j) - [pos_c] exp(z - Cp_j))
//       H_l = sum_{k >= l} inv_temp rho_k kap_k g_k   -> Ho_l (operand dtype, the only per-pair output)
//     and dL/drho_l, dL/dkap_l partials (drho_part per split, dkap_part per row block). The driver then runs
//     dq[:, S_l] += Ho_l d[:, S_l] and dd[:, S_l] += Ho_l^T q[:, S_l] through cuBLAS (one product's flops).
//
// Positives and fallbacks are those of matryoshka_block.h. Requirements (checked by the driver and here): the
// level boundaries seg[1..K] multiples of 16 and increasing, K <= kMrlTcMaxLevels, q / d rows 16-byte aligned
// (leading dimension a multiple of 8). Shared memory: mrl_tc_smem_bytes (the backward keeps K float32 tiles).
#pragma once
#include <cstddef>
#include <cstdint>
#include "common/types.h"

namespace tk {

constexpr int kMrlTcMaxLevels = 8;
constexpr int kMrlTcTile = 64;  // columns of a tile; rows: MrlTcParams::tile_rows (64 or 128)

struct MrlTcParams {
  DType dtype = DType::BF16;  // q, d and Ho: BF16 (the kernels' only instantiation)
  int64_t R = 0, C = 0;       // rows of this launch (global rows i0 .. i0 + R), columns
  int64_t i0 = 0, Bq = 0;
  const void* q = nullptr;  // (Bq, ldq): the rows' embeddings
  int64_t ldq = 0;
  const void* d = nullptr;  // (C, ldd)
  int64_t ldd = 0;
  int K = 1;
  int seg[kMrlTcMaxLevels + 1] = {0};  // level l covers features seg[l] .. seg[l + 1] (seg[0] = 0)
  double inv_temp = 1.0;
  const float* rho = nullptr;  // (K, Bq) level stride ldr
  const float* kap = nullptr;  // (K, C) level stride ldk
  int64_t ldr = 0, ldk = 0;
  const int32_t *q_lo = nullptr, *q_hi = nullptr, *d_lo = nullptr, *d_hi = nullptr;
  const uint8_t *row_none = nullptr, *col_none = nullptr, *row_fb = nullptr;
  int64_t diag_offset = 0;
  bool cols = false;  // column term (forward: col_part; backward: gc)
  int64_t nsplit = 1, tiles_per_split = 1;  // grid (nsplit, nrb); split s: column tiles [s tps, (s + 1) tps)
  // Rows per CUDA block (and tile): 64 (4 warps of 32 x 32) or 128 (4 warps of 64 x 32: 1.5x the tensor-core work
  // per shared-memory operand byte and 0.75x the L2 operand bytes per pair; K <= 2 by shared memory). nrb =
  // ceil(R / tile_rows) row blocks.
  int tile_rows = 64;
  // Columns per tile: 64, or 128 with tile_rows 128 (4 warps of 64 x 64: 2x the mma work per shared-memory operand
  // byte of the 64 x 64 tile, half its L2 operand bytes per pair).
  int tile_cols = 64;

  float* row_part = nullptr;  // fwd (K, R, nsplit, 2)
  float* col_part = nullptr;  // fwd (K, nrb, C, 2)

  const float* row_lse = nullptr;  // bwd (K, 3, Bq): lse_all, lse_pos, -
  const float* col_lse = nullptr;  // bwd (K, 3, C)
  const float* coef = nullptr;     // bwd (K, 2): (gr, gc) per level
  void* Ho = nullptr;              // bwd (K, R, C) operand dtype, level stride lsh, row stride C
  int64_t lsh = 0;
  float* drho_part = nullptr;  // bwd (K, R, nsplit)
  float* dkap_part = nullptr;  // bwd (K, nrb, C)

  // Table bias (optional: table != nullptr): bias_ij = lerp of the P table values at
  // x = (clamp(u_d[j] - u_q[i], -1, 1) + 1) (P - 1) / 2 (tempokern.reference.offset_bias_lookup), added to every
  // level's logits. Backward: with g = sum over the levels of dL/dz, dL/dtable into the two bins (a shared-memory
  // histogram per CUDA block, written to its slot of hist, (nsplit x nrb, P); or with hist_smem false atomics
  // into one (P,) float64 array), dL/du_d = g slope summed per (row block, column) into dud_part (nrb, C) and
  // dL/du_q = -g slope per (row, split) into duq_part (R, nsplit).
  const float* u_q = nullptr;  // (Bq,) global rows
  const float* u_d = nullptr;  // (C,)
  const float* table = nullptr;
  int64_t P = 0;
  double* hist = nullptr;
  bool hist_smem = true;
  float* duq_part = nullptr;
  float* dud_part = nullptr;
};

// Dynamic shared memory of one CUDA block (tile_rows TR = 64 or 128): two stages of both operands' TR x 32 and
// 64 x 32 chunks (rows padded to 40), the float32 score tiles (TR x 68; forward one, backward K, the top level's
// over the operand stages when it fits there, i.e. for TR = 64), per-thread level state (forward: running
// (max, sum) pairs of all and positives; backward: dL/drho sums), the rows' and columns' per-level vectors (scale,
// two statistics) and spans / fallback flags. TR = 64, K = 5: forward 55.6 KB (4 CTAs per H100 SM by shared
// memory), backward 99.1 KB (2 per SM); TR = 128, K = 1: forward 67 KB, backward 67 KB (3 per SM).
// operand stages: 2 x (rows + columns) x (chunk + 8) bf16, chunk 32 (16 for 128-row tiles)
inline size_t mrl_tc_ops_bytes(int tile_rows, int tile_cols) {
  return (size_t)2 * (tile_rows + tile_cols) * (tile_rows == 128 ? 24 : 40) * 2;
}
inline size_t mrl_tc_score_bytes(int tile_rows, int tile_cols) { return (size_t)tile_rows * (tile_cols + 4) * 4; }
inline bool mrl_tc_overlay(int tile_rows, int tile_cols) {
  return mrl_tc_score_bytes(tile_rows, tile_cols) <= mrl_tc_ops_bytes(tile_rows, tile_cols);
}
// The table bias adds u_q / u_d of the tile and, backward, the g slope tile, the rows' dL/du_q sums and the
// histogram when it is kept in shared memory (hist_points floats; 0 for the global one).
inline size_t mrl_tc_smem_bytes(int K, bool backward, bool table = false, int64_t hist_points = 0,
                                int tile_rows = kMrlTcTile, int tile_cols = kMrlTcTile) {
  const size_t k = (size_t)K, tr = (size_t)tile_rows, tc = (size_t)tile_cols;
  const size_t score = mrl_tc_score_bytes(tile_rows, tile_cols);
  const size_t tiles = backward ? (mrl_tc_overlay(tile_rows, tile_cols) ? k - 1 : k) : 1;
  size_t b = mrl_tc_ops_bytes(tile_rows, tile_cols) + tiles * score + k * 128 * (backward ? 4 : 16) +
             3 * k * (tr + tc) * 4 + 2 * (tr + tc) * 4 + (tr + tc);
  if (table) b += (tr + tc) * 4 + (backward ? score + 128 * 4 + (size_t)hist_points * 4 : 0);
  return b;
}

#ifdef TK_WITH_CUDA
void mrl_tc_fwd_cuda(const MrlTcParams& p, int device, uintptr_t stream);
void mrl_tc_bwd_cuda(const MrlTcParams& p, int device, uintptr_t stream);
int mrl_tc_max_levels_cuda(int device);  // the most levels whose backward fits the device's shared memory
int mrl_tc_smem_optin_cuda(int device);  // the device's opt-in shared memory per block
bool mrl_tc_supported_cuda(int device);  // compute capability >= 8.0 (bf16 wmma); older GPUs take other paths
#endif

}  // namespace tk
