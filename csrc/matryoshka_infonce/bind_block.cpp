// Python entry for the fused CUDA passes of the blocked Matryoshka InfoNCE
// (tempokern/_ops/matryoshka_blocked.py validates, allocates and drives them, one level per launch).
#include <map>
#include <string>
#include "common/bind_utils.h"
#include "common/registry.h"
#include "matryoshka_infonce/matryoshka_block.h"
#include "matryoshka_infonce/matryoshka_tc.h"

namespace tk {
namespace {

// dtypes: gdtype, odtype, adtype. sizes: R, C, i0, ldg, pos, cols, diag_offset, ldb, TR, nct, nrt, nslots,
// slot0, Bq, ldh, accumulate, K, lsg, lsh, ldr, ldk. scalars: inv_temp, gr, gc.
MrlBlockParams make(const std::vector<int>& dt, const std::vector<int64_t>& sz, const std::vector<double>& sc,
                    const PtrMap& m) {
  if (dt.size() != 3 || sz.size() != 21 || sc.size() != 3) fail("mrl_block_launch: expected 3 dtypes, 21 sizes, 3 scalars");
  MrlBlockParams p;
  p.gdtype = to_dtype(dt[0]);
  p.odtype = to_dtype(dt[1]);
  p.adtype = to_dtype(dt[2]);
  p.R = sz[0]; p.C = sz[1]; p.i0 = sz[2]; p.ldg = sz[3]; p.pos = sz[4] != 0; p.cols = sz[5] != 0;
  p.diag_offset = sz[6]; p.ldb = sz[7]; p.TR = sz[8]; p.nct = sz[9]; p.nrt = sz[10]; p.nslots = sz[11];
  p.slot0 = sz[12]; p.Bq = sz[13]; p.ldh = sz[14]; p.accumulate = sz[15] != 0;
  p.K = sz[16]; p.lsg = sz[17]; p.lsh = sz[18]; p.ldr = sz[19]; p.ldk = sz[20];
  p.inv_temp = sc[0]; p.gr = sc[1]; p.gc = sc[2];
  p.G = ptr_of(m, "G");
  p.q_lo = static_cast<const int32_t*>(ptr_of(m, "q_lo")); p.q_hi = static_cast<const int32_t*>(ptr_of(m, "q_hi"));
  p.d_lo = static_cast<const int32_t*>(ptr_of(m, "d_lo")); p.d_hi = static_cast<const int32_t*>(ptr_of(m, "d_hi"));
  p.row_none = static_cast<const uint8_t*>(ptr_of(m, "row_none"));
  p.col_none = static_cast<const uint8_t*>(ptr_of(m, "col_none"));
  p.row_fb = static_cast<const uint8_t*>(ptr_of(m, "row_fb"));
  p.rho = ptr_of(m, "rho"); p.kap = ptr_of(m, "kap"); p.dense = ptr_of(m, "dense");
  p.row_part = mut_ptr_of(m, "row_part"); p.col_part = mut_ptr_of(m, "col_part");
  p.row_lse = ptr_of(m, "row_lse"); p.col_lse = ptr_of(m, "col_lse");
  p.H = mut_ptr_of(m, "H"); p.Ho = mut_ptr_of(m, "Ho"); p.Gb = mut_ptr_of(m, "Gb");
  p.drho_part = mut_ptr_of(m, "drho_part"); p.dkap_part = mut_ptr_of(m, "dkap_part");
  p.coef = ptr_of(m, "coef");
  if (p.R < 0 || p.C < 0 || p.TR < 1 || p.nslots < 1 || p.slot0 < 0) fail("mrl_block_launch: bad sizes");
  if (!p.G || !p.rho || !p.kap) fail("mrl_block_launch: missing G, rho or kap");
  if (p.pos && (!p.q_lo || !p.q_hi || !p.d_lo || !p.d_hi || !p.row_none || !p.col_none))
    fail("mrl_block_launch: positives need spans and fallback flags");
  if (p.dense && !p.pos) fail("mrl_block_launch: an extra-negative block takes no bias");
  return p;
}

// sizes: R, C, i0, Bq, ldq, ldd, ldr, ldk, diag_offset, cols, nsplit, tiles_per_split, lsh, and with a table
// bias P, hist_smem. seg: 0, m_1 .. m_K.
MrlTcParams make_tc(int dtype, const std::vector<int64_t>& sz, const std::vector<int>& seg, double inv_temp,
                    const PtrMap& m) {
  if (sz.size() != 15 && sz.size() != 17) fail("mrl_tc_launch: expected 15 or 17 sizes");
  if (seg.size() < 2 || seg.size() > (size_t)kMrlTcMaxLevels + 1) fail("mrl_tc_launch: 1..8 levels");
  MrlTcParams p;
  p.dtype = to_dtype(dtype);
  p.R = sz[0]; p.C = sz[1]; p.i0 = sz[2]; p.Bq = sz[3]; p.ldq = sz[4]; p.ldd = sz[5]; p.ldr = sz[6]; p.ldk = sz[7];
  p.diag_offset = sz[8]; p.cols = sz[9] != 0; p.nsplit = sz[10]; p.tiles_per_split = sz[11]; p.lsh = sz[12];
  p.tile_rows = (int)sz[13];
  p.tile_cols = (int)sz[14];
  if (sz.size() == 17) { p.P = sz[15]; p.hist_smem = sz[16] != 0; }
  p.K = (int)seg.size() - 1;
  for (size_t l = 0; l < seg.size(); ++l) p.seg[l] = seg[l];
  p.inv_temp = inv_temp;
  p.q = ptr_of(m, "q"); p.d = ptr_of(m, "d");
  p.rho = static_cast<const float*>(ptr_of(m, "rho")); p.kap = static_cast<const float*>(ptr_of(m, "kap"));
  p.q_lo = static_cast<const int32_t*>(ptr_of(m, "q_lo")); p.q_hi = static_cast<const int32_t*>(ptr_of(m, "q_hi"));
  p.d_lo = static_cast<const int32_t*>(ptr_of(m, "d_lo")); p.d_hi = static_cast<const int32_t*>(ptr_of(m, "d_hi"));
  p.row_none = static_cast<const uint8_t*>(ptr_of(m, "row_none"));
  p.col_none = static_cast<const uint8_t*>(ptr_of(m, "col_none"));
  p.row_fb = static_cast<const uint8_t*>(ptr_of(m, "row_fb"));
  p.row_part = static_cast<float*>(mut_ptr_of(m, "row_part")); p.col_part = static_cast<float*>(mut_ptr_of(m, "col_part"));
  p.row_lse = static_cast<const float*>(ptr_of(m, "row_lse")); p.col_lse = static_cast<const float*>(ptr_of(m, "col_lse"));
  p.coef = static_cast<const float*>(ptr_of(m, "coef")); p.Ho = mut_ptr_of(m, "Ho");
  p.drho_part = static_cast<float*>(mut_ptr_of(m, "drho_part"));
  p.dkap_part = static_cast<float*>(mut_ptr_of(m, "dkap_part"));
  p.u_q = static_cast<const float*>(ptr_of(m, "u_q")); p.u_d = static_cast<const float*>(ptr_of(m, "u_d"));
  p.table = static_cast<const float*>(ptr_of(m, "table"));
  p.hist = static_cast<double*>(mut_ptr_of(m, "hist"));
  p.duq_part = static_cast<float*>(mut_ptr_of(m, "duq_part"));
  p.dud_part = static_cast<float*>(mut_ptr_of(m, "dud_part"));
  return p;
}
}  // namespace

TK_BIND(mrl_block) {
  m.def("mrl_block_launch",
        [](const std::string& op, int device, uintptr_t stream, const std::vector<int>& dtypes,
           const std::vector<int64_t>& sizes, const std::vector<double>& scalars, const PtrMap& ptrs) {
          const MrlBlockParams p = make(dtypes, sizes, scalars, ptrs);
          const auto cpu = [&] { fail("mrl_block_launch: the fused Matryoshka passes run on CUDA (or the CUDA emulator)"); };
          if (op == "fwd") {
            if (!p.row_part || (p.pos && p.cols && !p.col_part)) fail("mrl_block_launch: forward needs its partial outputs");
            run_on(device, cpu, [&] { TK_CUDA_ONLY(mrl_block_fwd_cuda(p, device, stream)); });
          } else if (op == "bwd") {
            if (!p.H || !p.drho_part || !p.dkap_part || (p.gr != 0.0 && !p.row_lse) ||
                (p.pos && p.cols && p.gc != 0.0 && !p.col_lse))
              fail("mrl_block_launch: backward needs H, its partial outputs and the statistics");
            if (p.dense && !p.Gb) fail("mrl_block_launch: backward with a bias needs Gb");
            run_on(device, cpu, [&] { TK_CUDA_ONLY(mrl_block_bwd_cuda(p, device, stream)); });
          } else if (op == "bwd_all") {
            if (!p.drho_part || !p.dkap_part || !p.coef || !p.row_lse || (p.pos && p.cols && !p.col_lse))
              fail("mrl_block_launch: bwd_all needs coef, its partial outputs and the statistics");
            if (p.K < 1 || p.K > kMrlMaxLevels) fail("mrl_block_launch: bwd_all takes 1..32 levels");
            if (p.H != p.G && !p.Ho) fail("mrl_block_launch: bwd_all writes H over G (H == G) or Ho");
            if (p.dense && !p.Gb) fail("mrl_block_launch: bwd_all with a bias needs Gb");
            run_on(device, cpu, [&] { TK_CUDA_ONLY(mrl_block_bwd_all_cuda(p, device, stream)); });
          } else {
            fail("unknown mrl_block op '" + op + "'");
          }
        });
  // The tensor-core passes (matryoshka_tc.h): op "fwd" or "bwd"; the kernel checks the rest.
  m.def("mrl_tc_launch",
        [](const std::string& op, int device, uintptr_t stream, int dtype, const std::vector<int64_t>& sizes,
           const std::vector<int>& seg, double inv_temp, const PtrMap& ptrs) {
          const MrlTcParams p = make_tc(dtype, sizes, seg, inv_temp, ptrs);
          const auto cpu = [&] { fail("mrl_tc_launch: the tensor-core Matryoshka passes run on CUDA (or the CUDA emulator)"); };
          if (op == "fwd") {
            run_on(device, cpu, [&] { TK_CUDA_ONLY(mrl_tc_fwd_cuda(p, device, stream)); });
          } else if (op == "bwd") {
            run_on(device, cpu, [&] { TK_CUDA_ONLY(mrl_tc_bwd_cuda(p, device, stream)); });
          } else {
            fail("unknown mrl_tc op '" + op + "'");
          }
        });
  m.def("mrl_tc_smem_bytes", [](int K, bool backward, bool table, int64_t hist_points, int tile_rows, int tile_cols) {
    if (tile_rows != 64 && tile_rows != 128) fail("mrl_tc_smem_bytes: tile_rows must be 64 or 128");
    if (tile_cols != 64 && tile_cols != 128) fail("mrl_tc_smem_bytes: tile_cols must be 64 or 128");
    return mrl_tc_smem_bytes(K, backward, table, hist_points, tile_rows, tile_cols);
  }, pybind11::arg("K"), pybind11::arg("backward"), pybind11::arg("table"), pybind11::arg("hist_points"),
     pybind11::arg("tile_rows") = 64, pybind11::arg("tile_cols") = 64);
  m.def("mrl_tc_smem_optin", [](int device) {
    int optin = 0;
    run_on(device, [&] { optin = 0; }, [&] { TK_CUDA_ONLY(optin = mrl_tc_smem_optin_cuda(device)); });
    return optin;
  });
  m.def("mrl_tc_supported", [](int device) {
    bool ok = false;
    run_on(device, [&] { ok = false; }, [&] { TK_CUDA_ONLY(ok = mrl_tc_supported_cuda(device)); });
    return ok;
  }, "whether the device runs the bf16 tensor-core kernels (compute capability 8.0 or newer)");
  m.def("mrl_tc_max_levels", [](int device) {
    int K = 0;
    run_on(device, [&] { K = 0; }, [&] { TK_CUDA_ONLY(K = mrl_tc_max_levels_cuda(device)); });
    return K;
  });
}

}  // namespace tk
