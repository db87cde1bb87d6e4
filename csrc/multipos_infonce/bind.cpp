// Python entry for the fused multi-positive InfoNCE; validation happens in tempokern/_ops/multipos_infonce.py.
#include <map>
#include <string>
#include "common/bind_utils.h"
#include "common/registry.h"
#include "multipos_infonce/multipos_infonce.h"

namespace tk {
namespace {
using Ptrs = PtrMap;
constexpr auto get = ptr_of;
constexpr auto get_mut = mut_ptr_of;

// sizes: Bq, Bd, N, H, ldq, ldd, ldn, hidden, K2, diag_offset[, unused[, ncell]]; scalars: inv_temp, row_weight, col_weight
MultiposParams make_params(int dtype, const std::vector<int64_t>& sz, const std::vector<double>& sc, const Ptrs& m) {
  if (sz.size() < 10 || sz.size() > 12 || sc.size() != 3)
    fail("multipos_infonce_launch: expected 10 to 12 sizes and 3 scalars");
  MultiposParams p;
  p.dtype = to_dtype(dtype);
  p.Bq = sz[0]; p.Bd = sz[1]; p.N = sz[2]; p.H = sz[3];
  p.ldq = sz[4]; p.ldd = sz[5]; p.ldn = sz[6]; p.hidden = sz[7]; p.K2 = sz[8]; p.diag_offset = sz[9];
  p.ncell = sz.size() == 12 ? sz[11] : 0;
  p.inv_temp = sc[0]; p.row_weight = sc[1]; p.col_weight = sc[2];
  p.q = get(m, "q"); p.d = get(m, "d"); p.neg = get(m, "neg");
  p.q_lo = static_cast<const int64_t*>(get(m, "q_lo")); p.q_hi = static_cast<const int64_t*>(get(m, "q_hi"));
  p.d_lo = static_cast<const int64_t*>(get(m, "d_lo")); p.d_hi = static_cast<const int64_t*>(get(m, "d_hi"));
  p.A = get(m, "A"); p.Ct = get(m, "Ct"); p.b1 = get(m, "b1"); p.w2 = get(m, "w2"); p.b2 = get(m, "b2");
  p.scale = get(m, "scale"); p.zc = get(m, "zc"); p.u_q = get(m, "u_q"); p.u_d = get(m, "u_d");
  p.has_bias = p.A != nullptr;
  p.z_lo = static_cast<const double*>(get(m, "z_lo")); p.z_hi = static_cast<const double*>(get(m, "z_hi"));
  p.diag_col = static_cast<const int64_t*>(get(m, "diag_col"));
  p.diag_row = static_cast<const int64_t*>(get(m, "diag_row"));
  p.row_none = static_cast<const uint8_t*>(get(m, "row_none"));
  p.loss = get_mut(m, "loss"); p.row_stats = get_mut(m, "row_stats"); p.col_stats = get_mut(m, "col_stats");
  p.hardest = static_cast<int64_t*>(get_mut(m, "hardest"));
  p.col_map = static_cast<const int64_t*>(get(m, "col_map"));
  p.grad_loss = get(m, "grad_loss");
  p.dq = get_mut(m, "dq"); p.dd = get_mut(m, "dd"); p.dneg = get_mut(m, "dneg"); p.dA = get_mut(m, "dA");
  p.dCt = get_mut(m, "dCt"); p.db1 = get_mut(m, "db1"); p.dw2 = get_mut(m, "dw2"); p.db2 = get_mut(m, "db2");
  p.dscale = get_mut(m, "dscale"); p.dzc = get_mut(m, "dzc");
  if (p.Bq < 0 || p.Bd < 0 || p.N < 0 || p.H < 1) fail("multipos_infonce_launch: bad sizes");
  if (!p.q || !p.d || !p.q_lo || !p.q_hi || !p.d_lo || !p.d_hi || !p.row_stats) fail("multipos_infonce_launch: missing pointer");
  if (p.N > 0 && !p.neg) fail("multipos_infonce_launch: N > 0 without extra negatives");
  if (p.col_weight != 0.0 && !p.col_stats) fail("multipos_infonce_launch: column loss without col_stats");
  if (p.has_bias && (!p.Ct || !p.b1 || !p.w2 || !p.b2 || !p.scale || !p.zc || !p.u_q || !p.u_d || p.hidden < 1 || p.K2 < 1))
    fail("multipos_infonce_launch: incomplete bias");
  if (p.z_lo || p.z_hi) {
    if (!p.z_lo || !p.z_hi || p.ncell < 1 || !p.has_bias) fail("multipos_infonce_launch: bad unit bounds");
  }
  if (!p.diag_col != !p.diag_row) fail("multipos_infonce_launch: diag_col and diag_row go together");
  return p;
}
}  // namespace

TK_BIND(multipos_infonce) {
  m.def("multipos_infonce_launch",
        [](const std::string& op, int device, uintptr_t, int dtype, const std::vector<int64_t>& sizes,
           const std::vector<double>& scalars, const Ptrs& ptrs, uintptr_t, int64_t) {
          const MultiposParams p = make_params(dtype, sizes, scalars, ptrs);
          if (op == "fwd") {
            if (!p.loss) fail("multipos_infonce_launch: forward needs loss");
            if (device >= 0) fail("multipos_infonce_launch is the CPU kernel; CUDA runs multipos_block_launch");
            run_on(device, [&] { multipos_infonce_fwd_cpu(p); }, [] {});
          } else if (op == "bwd") {
            if (!p.grad_loss || !p.dq || !p.dd || (p.N > 0 && !p.dneg)) fail("multipos_infonce_launch: backward needs grads");
            if (p.has_bias && (!p.dA || !p.dCt || !p.db1 || !p.dw2 || !p.db2 || !p.dscale || !p.dzc))
              fail("multipos_infonce_launch: backward needs bias grads");
            if (device >= 0) fail("multipos_infonce_launch is the CPU kernel; CUDA runs multipos_block_launch");
            run_on(device, [&] { multipos_infonce_bwd_cpu(p); }, [] {});
          } else {
            fail("unknown multipos_infonce op '" + op + "'");
          }
        });
}

}  // namespace tk
