// Python entry for the fused Matryoshka InfoNCE; validation happens in tempokern/_ops/matryoshka_infonce.py.
#include <string>
#include "common/bind_utils.h"
#include "common/registry.h"
#include "matryoshka_infonce/matryoshka_infonce.h"

namespace tk {
namespace {
// sizes: Bq, Bd, N, H, ldq, ldd, ldn, K, diag_offset, seg[0..K]; scalars: inv_temp, row_weight, col_weight, coef[0..K)
MatryoshkaParams make_params(int dtype, const std::vector<int64_t>& sz, const std::vector<double>& sc,
                             const PtrMap& m) {
  if (sz.size() < 9) fail("matryoshka_infonce_launch: expected at least 9 sizes");
  MatryoshkaParams p;
  p.dtype = to_dtype(dtype);
  p.Bq = sz[0]; p.Bd = sz[1]; p.N = sz[2]; p.H = sz[3]; p.ldq = sz[4]; p.ldd = sz[5]; p.ldn = sz[6];
  p.K = sz[7]; p.diag_offset = sz[8];
  if (p.K < 1 || (int64_t)sz.size() != 9 + p.K + 1 || (int64_t)sc.size() != 3 + p.K)
    fail("matryoshka_infonce_launch: sizes/scalars do not match K");
  p.seg.assign(sz.begin() + 9, sz.end());
  if (p.seg[0] != 0 || p.seg[p.K] > p.H) fail("matryoshka_infonce_launch: bad segment bounds");
  for (int64_t l = 0; l < p.K; ++l)
    if (p.seg[l + 1] <= p.seg[l]) fail("matryoshka_infonce_launch: segment bounds must increase");
  p.inv_temp = sc[0]; p.row_weight = sc[1]; p.col_weight = sc[2];
  p.coef.assign(sc.begin() + 3, sc.end());
  p.q = ptr_of(m, "q"); p.d = ptr_of(m, "d"); p.neg = ptr_of(m, "neg");
  p.rho = ptr_of(m, "rho"); p.kap = ptr_of(m, "kap"); p.kneg = ptr_of(m, "kneg");
  p.q_lo = static_cast<const int64_t*>(ptr_of(m, "q_lo")); p.q_hi = static_cast<const int64_t*>(ptr_of(m, "q_hi"));
  p.d_lo = static_cast<const int64_t*>(ptr_of(m, "d_lo")); p.d_hi = static_cast<const int64_t*>(ptr_of(m, "d_hi"));
  p.row_none = static_cast<const uint8_t*>(ptr_of(m, "row_none"));
  p.loss = mut_ptr_of(m, "loss"); p.levels = mut_ptr_of(m, "levels");
  p.row_stats = mut_ptr_of(m, "row_stats"); p.col_stats = mut_ptr_of(m, "col_stats");
  p.dq = mut_ptr_of(m, "dq"); p.dd = mut_ptr_of(m, "dd"); p.dneg = mut_ptr_of(m, "dneg");
  p.drho = mut_ptr_of(m, "drho"); p.dkap = mut_ptr_of(m, "dkap"); p.dkneg = mut_ptr_of(m, "dkneg");
  if (p.Bq < 0 || p.Bd < 0 || p.N < 0 || p.H < 1) fail("matryoshka_infonce_launch: bad sizes");
  if (!p.q || !p.d || !p.rho || !p.kap || !p.q_lo || !p.q_hi || !p.d_lo || !p.d_hi || !p.row_stats)
    fail("matryoshka_infonce_launch: missing pointer");
  if (p.N > 0 && (!p.neg || !p.kneg)) fail("matryoshka_infonce_launch: N > 0 without extra negatives");
  if (p.col_weight != 0.0 && !p.col_stats) fail("matryoshka_infonce_launch: column loss without col_stats");
  return p;
}
}  // namespace

TK_BIND(matryoshka_infonce) {
  m.def("matryoshka_infonce_launch",
        [](const std::string& op, int device, uintptr_t, int dtype, const std::vector<int64_t>& sizes,
           const std::vector<double>& scalars, const PtrMap& ptrs) {
          const MatryoshkaParams p = make_params(dtype, sizes, scalars, ptrs);
          if (device >= 0) fail("matryoshka_infonce_launch is the CPU kernel; CUDA runs the blocked path");
          if (op == "fwd") {
            if (!p.loss || !p.levels) fail("matryoshka_infonce_launch: forward needs loss and levels");
            run_on(device, [&] { matryoshka_infonce_fwd_cpu(p); }, [] {});
          } else if (op == "bwd") {
            if (!p.dq || !p.dd || !p.drho || !p.dkap || (p.N > 0 && (!p.dneg || !p.dkneg)))
              fail("matryoshka_infonce_launch: backward needs grads");
            run_on(device, [&] { matryoshka_infonce_bwd_cpu(p); }, [] {});
          } else {
            fail("unknown matryoshka_infonce op '" + op + "'");
          }
        });
}

}  // namespace tk
