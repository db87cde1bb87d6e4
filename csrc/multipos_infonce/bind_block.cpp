// Python entry for the fused passes of the blocked multi-positive InfoNCE
// (tempokern/_ops/multipos_blocked.py validates, allocates and drives them).
#include <map>
#include <string>
#include "common/bind_utils.h"
#include "common/registry.h"
#include "multipos_infonce/multipos_block.h"

namespace tk {
namespace {
using Ptrs = PtrMap;
constexpr auto get = ptr_of;
constexpr auto get_mut = mut_ptr_of;

// dtypes: sdtype, odtype, adtype. sizes: R, C, i0, lds, pos, cols, diag_offset, bias_mode, P, ldb, TR, nct,
// nrt, nslots, slot0, Bq, ldo, nhist. scalars: inv_temp, gr, gc.
MultiposBlockParams make(const std::vector<int>& dt, const std::vector<int64_t>& sz, const std::vector<double>& sc,
                         const Ptrs& m) {
  if (dt.size() != 3 || sz.size() != 18 || sc.size() != 3) fail("multipos_block_launch: expected 3 dtypes, 18 sizes, 3 scalars");
  MultiposBlockParams p;
  p.sdtype = to_dtype(dt[0]);
  p.odtype = to_dtype(dt[1]);
  p.adtype = to_dtype(dt[2]);
  p.R = sz[0]; p.C = sz[1]; p.i0 = sz[2]; p.lds = sz[3]; p.pos = sz[4] != 0; p.cols = sz[5] != 0;
  p.diag_offset = sz[6]; p.bias_mode = (int)sz[7]; p.P = sz[8]; p.ldb = sz[9]; p.TR = sz[10]; p.nct = sz[11];
  p.nrt = sz[12]; p.nslots = sz[13]; p.slot0 = sz[14]; p.Bq = sz[15]; p.ldo = sz[16]; p.nhist = sz[17];
  p.inv_temp = sc[0]; p.gr = sc[1]; p.gc = sc[2];
  p.S = get(m, "S");
  p.q_lo = static_cast<const int32_t*>(get(m, "q_lo")); p.q_hi = static_cast<const int32_t*>(get(m, "q_hi"));
  p.d_lo = static_cast<const int32_t*>(get(m, "d_lo")); p.d_hi = static_cast<const int32_t*>(get(m, "d_hi"));
  p.row_none = static_cast<const uint8_t*>(get(m, "row_none"));
  p.col_none = static_cast<const uint8_t*>(get(m, "col_none"));
  p.u_q = get(m, "u_q"); p.u_d = get(m, "u_d"); p.table = get(m, "table"); p.dense = get(m, "dense");
  p.row_part = get_mut(m, "row_part"); p.col_part = get_mut(m, "col_part");
  p.hard_val = get_mut(m, "hard_val"); p.hard_idx = static_cast<int64_t*>(get_mut(m, "hard_idx"));
  p.row_lse = get(m, "row_lse"); p.col_lse = get(m, "col_lse");
  p.dS = get_mut(m, "dS"); p.G = get_mut(m, "G"); p.duq_part = get_mut(m, "duq_part");
  p.dud_part = get_mut(m, "dud_part"); p.hist = static_cast<double*>(get_mut(m, "hist"));
  if (p.R < 0 || p.C < 0 || p.TR < 1 || p.nslots < 1 || p.slot0 < 0) fail("multipos_block_launch: bad sizes");
  if (!p.S) fail("multipos_block_launch: missing S");
  if (p.pos && (!p.q_lo || !p.q_hi || !p.d_lo || !p.d_hi || !p.row_none || !p.col_none))
    fail("multipos_block_launch: positives need spans and fallback flags");
  if (p.bias_mode == 1 && (!p.u_q || !p.u_d || !p.table || p.P < 2)) fail("multipos_block_launch: incomplete table bias");
  if (p.bias_mode == 2 && !p.dense) fail("multipos_block_launch: dense bias without its block");
  if (p.bias_mode < 0 || p.bias_mode > 2) fail("multipos_block_launch: bad bias mode");
  if (!p.hard_val != !p.hard_idx) fail("multipos_block_launch: hard_val and hard_idx go together");
  if (p.hard_idx && !p.pos) fail("multipos_block_launch: the hardest negative needs a block with positives");
  return p;
}
}  // namespace

TK_BIND(multipos_block) {
  m.def("multipos_block_launch",
        [](const std::string& op, int device, uintptr_t stream, const std::vector<int>& dtypes,
           const std::vector<int64_t>& sizes, const std::vector<double>& scalars, const Ptrs& ptrs) {
          const MultiposBlockParams p = make(dtypes, sizes, scalars, ptrs);
          if (op == "fwd") {
            if (!p.row_part || (p.cols && !p.col_part)) fail("multipos_block_launch: forward needs its partial outputs");
            run_on(device, [&] { multipos_block_fwd_cpu(p); }, [&] { TK_CUDA_ONLY(multipos_block_fwd_cuda(p, device, stream)); });
          } else if (op == "bwd") {
            if (!p.dS || (p.gr != 0.0 && !p.row_lse) || (p.cols && p.gc != 0.0 && !p.col_lse))
              fail("multipos_block_launch: backward needs dS and the statistics");
            if (p.bias_mode == 1 && (!p.duq_part || !p.dud_part || !p.hist || p.nhist < 1))
              fail("multipos_block_launch: table backward needs its partial outputs");
            if (p.bias_mode == 2 && !p.G) fail("multipos_block_launch: dense backward needs G");
            run_on(device, [&] { multipos_block_bwd_cpu(p); }, [&] { TK_CUDA_ONLY(multipos_block_bwd_cuda(p, device, stream)); });
          } else {
            fail("unknown multipos_block op '" + op + "'");
          }
        });
  // sizes: Bq, Bd, diag_offset[, nzero]. ptrs: q_lo, q_hi, d_lo, d_hi (int64), spans32, row_none, col_none,
  // counter[, zero].
  m.def("multipos_block_prep",
        [](int device, uintptr_t stream, const std::vector<int64_t>& sz, const Ptrs& m) {
          if (sz.size() != 3 && sz.size() != 4) fail("multipos_block_prep: expected 3 or 4 sizes");
          MultiposPrepParams p;
          p.Bq = sz[0]; p.Bd = sz[1]; p.diag_offset = sz[2]; p.nzero = sz.size() == 4 ? sz[3] : 0;
          p.zero = static_cast<double*>(get_mut(m, "zero"));
          if (p.nzero < 0 || (p.nzero && !p.zero)) fail("multipos_block_prep: bad zero region");
          p.q_lo = static_cast<const int64_t*>(get(m, "q_lo")); p.q_hi = static_cast<const int64_t*>(get(m, "q_hi"));
          p.d_lo = static_cast<const int64_t*>(get(m, "d_lo")); p.d_hi = static_cast<const int64_t*>(get(m, "d_hi"));
          p.spans32 = static_cast<int32_t*>(get_mut(m, "spans32"));
          p.row_none = static_cast<uint8_t*>(get_mut(m, "row_none"));
          p.col_none = static_cast<uint8_t*>(get_mut(m, "col_none"));
          p.counter = static_cast<unsigned*>(get_mut(m, "counter"));
          if (p.Bq < 0 || p.Bd < 0) fail("multipos_block_prep: bad sizes");
          if ((p.Bq && (!p.q_lo || !p.q_hi || !p.row_none)) || (p.Bd && (!p.d_lo || !p.d_hi || !p.col_none)) ||
              (p.Bq + p.Bd && !p.spans32))
            fail("multipos_block_prep: missing spans or outputs");
          run_on(device, [&] { multipos_block_prep_cpu(p); },
                 [&] { TK_CUDA_ONLY(multipos_block_prep_cuda(p, device, stream)); });
        });
  // adtype; sizes: Bq, Bd, i0, R, nslots, nrt, nct, cols, first, last; scalars: row_weight, col_weight.
  // ptrs: row_part, col_part, row_lse, col_lse, hard_val, hard_idx, hardest, loss, counter.
  m.def("multipos_block_fin",
        [](int device, uintptr_t stream, int adtype, const std::vector<int64_t>& sz, const std::vector<double>& sc,
           const Ptrs& m) {
          if (sz.size() != 10 || sc.size() != 2) fail("multipos_block_fin: expected 10 sizes, 2 scalars");
          MultiposFinParams p;
          p.adtype = to_dtype(adtype);
          p.Bq = sz[0]; p.Bd = sz[1]; p.i0 = sz[2]; p.R = sz[3]; p.nslots = sz[4]; p.nrt = sz[5]; p.nct = sz[6];
          p.cols = sz[7] != 0; p.first = sz[8] != 0; p.last = sz[9] != 0;
          p.row_weight = sc[0]; p.col_weight = sc[1];
          p.row_part = get(m, "row_part"); p.col_part = get(m, "col_part");
          p.row_lse = get_mut(m, "row_lse"); p.col_lse = get_mut(m, "col_lse");
          p.hard_val = get(m, "hard_val"); p.hard_idx = static_cast<const int64_t*>(get(m, "hard_idx"));
          p.hardest = static_cast<int64_t*>(get_mut(m, "hardest"));
          p.loss = get_mut(m, "loss"); p.counter = static_cast<unsigned*>(get_mut(m, "counter"));
          if (p.R < 0 || p.Bq < 0 || p.Bd < 0 || p.i0 < 0 || p.i0 + p.R > p.Bq || p.nslots < 1 || p.nrt < 1 ||
              p.nct < 1)
            fail("multipos_block_fin: bad sizes");
          if ((p.R && (!p.row_part || !p.row_lse)) || (p.cols && p.Bd && (!p.col_part || !p.col_lse)))
            fail("multipos_block_fin: missing statistics");
          if (p.hardest && (!p.hard_val || !p.hard_idx)) fail("multipos_block_fin: hardest needs its partials");
          if (p.last && (!p.loss || !p.counter)) fail("multipos_block_fin: the last launch needs loss and counter");
          run_on(device, [&] { multipos_block_fin_cpu(p); },
                 [&] { TK_CUDA_ONLY(multipos_block_fin_cuda(p, device, stream)); });
        });
  // adtype; sizes: Bq, Bd, i0, R, nct, nrt, P, nhist, first, last. ptrs: duq_part, dud_part, hist, dud_acc,
  // du_q, du_d, dtable.
  m.def("multipos_block_tgrad",
        [](int device, uintptr_t stream, int adtype, const std::vector<int64_t>& sz, const Ptrs& m) {
          if (sz.size() != 10) fail("multipos_block_tgrad: expected 10 sizes");
          MultiposTableGradParams p;
          p.adtype = to_dtype(adtype);
          p.Bq = sz[0]; p.Bd = sz[1]; p.i0 = sz[2]; p.R = sz[3]; p.nct = sz[4]; p.nrt = sz[5]; p.P = sz[6];
          p.nhist = sz[7]; p.first = sz[8] != 0; p.last = sz[9] != 0;
          p.duq_part = get(m, "duq_part"); p.dud_part = get(m, "dud_part");
          p.hist = static_cast<const double*>(get(m, "hist")); p.dud_acc = static_cast<double*>(get_mut(m, "dud_acc"));
          p.du_q = get_mut(m, "du_q"); p.du_d = get_mut(m, "du_d"); p.dtable = get_mut(m, "dtable");
          if (p.R < 0 || p.i0 < 0 || p.i0 + p.R > p.Bq || p.Bd < 0 || p.nct < 1 || p.nrt < 1 || p.P < 0 || p.nhist < 1)
            fail("multipos_block_tgrad: bad sizes");
          if ((p.R && (!p.duq_part || !p.du_q)) || (p.Bd && (!p.dud_part || !p.dud_acc || (p.last && !p.du_d))) ||
              (p.last && p.P && (!p.hist || !p.dtable)))
            fail("multipos_block_tgrad: missing buffers");
          run_on(device, [&] { multipos_block_tgrad_cpu(p); },
                 [&] { TK_CUDA_ONLY(multipos_block_tgrad_cuda(p, device, stream)); });
        });
}

}  // namespace tk
