// Python entry for the fused CTD top-k; validation happens in tempokern/_ops/ctd_topk.py.
#include <tuple>
#include <vector>
#include "common/bind_utils.h"
#include "common/registry.h"
#include "ctd_topk/ctd_topk.h"

namespace tk {

TK_BIND(ctd_topk) {
  // shapes: (Q, N, H, k, q_stride, g_stride); exact bias: (hidden, D, K, freqs, w1, b1, w2, b2, scale);
  // table: (table, P); exclude: (ptr, m); rerank candidates: (ptr, C); outputs (values, indices). CPU only:
  // on CUDA the Python driver runs ctd_topk_cuda_pass below.
  m.def("ctd_topk_launch",
        [](int device, uintptr_t stream, int dtype, std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t> shp,
           uintptr_t q, uintptr_t g, double temperature, int bias_mode, uintptr_t u_q, uintptr_t u_g,
           std::tuple<int64_t, int64_t, int64_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, double, double> ex,
           uintptr_t table, int64_t P, uintptr_t exclude, int64_t m_ex, uintptr_t cand, int64_t C, uintptr_t values,
           uintptr_t indices) {
          CtdTopkParams p;
          p.dtype = to_dtype(dtype);
          std::tie(p.Q, p.N, p.H, p.k, p.q_stride, p.g_stride) = shp;
          if (p.Q < 0 || p.N < 1 || p.H < 1 || p.k < 1 || (!cand && p.k > p.N)) fail("ctd_topk: bad sizes");
          if (bias_mode < 0 || bias_mode > 2) fail("ctd_topk: unknown bias mode");
          p.q = as_ptr(q);
          p.g = as_ptr(g);
          p.temperature = temperature;
          p.bias = static_cast<CtdBias>(bias_mode);
          p.u_q = as_ptr(u_q);
          p.u_g = as_ptr(u_g);
          uintptr_t fr, w1, b1, w2;
          std::tie(p.hidden, p.D, p.K, fr, w1, b1, w2, p.b2, p.scale) = ex;
          p.freqs = as_ptr(fr);
          p.w1 = as_ptr(w1);
          p.b1 = as_ptr(b1);
          p.w2 = as_ptr(w2);
          if (p.bias == CtdBias::Exact && (p.hidden < 1 || p.D < 1 || p.K < 1)) fail("ctd_topk: bad bias sizes");
          p.table = as_ptr<const float>(table);
          p.P = P;
          if (p.bias == CtdBias::Table && P < 2) fail("ctd_topk: a bias table needs at least 2 points");
          p.exclude = as_ptr<const int64_t>(exclude);
          p.m = m_ex;
          p.cand = as_ptr<const int64_t>(cand);
          p.C = C;
          if (device >= 0) fail("ctd_topk_launch runs the CPU kernel; CUDA goes through ctd_topk_cuda_pass");
          p.values = as_ptr(values);
          p.indices = as_ptr<int64_t>(indices);
          if (p.Q == 0) return;
          run_on(-1, [&] { ctd_topk_cpu(p); }, [] {});
        });

  // One CUDA pass (see ctd_topk.h). kind 0: select over a score block, 1: scan of the gallery.
  // ints: (dtype, Q, N, H, k, q_stride, g_stride, s_stride, col0, bias_mode, hidden, K, P, m, nslices,
  //        per_slice, cap); ptrs: (q, g, scores, u_q, u_g, freqs, amat, feats, b1, w2, bias_ends, table,
  //        exclude, thr_seed, ws_values, ws_indices); reals: (temperature, b2, scale, bias_ub).
  m.def("ctd_topk_cuda_pass", [](int device, uintptr_t stream, int kind, std::vector<int64_t> n,
                                 std::vector<uintptr_t> ptrs, std::vector<double> reals) {
    if (n.size() != 17 || ptrs.size() != 16 || reals.size() != 4) fail("ctd_topk_cuda_pass: wrong argument counts");
    if (device < 0) fail("ctd_topk_cuda_pass: needs a CUDA device (or the emulator)");
    if (n[9] < 0 || n[9] > 2) fail("ctd_topk: unknown bias mode");
    CtdCudaParams p;
    p.dtype = to_dtype((int)n[0]);
    p.Q = n[1]; p.N = n[2]; p.H = n[3]; p.k = n[4]; p.q_stride = n[5]; p.g_stride = n[6];
    p.s_stride = n[7]; p.col0 = n[8]; p.bias = static_cast<CtdBias>(n[9]); p.hidden = n[10]; p.K = n[11];
    p.P = n[12]; p.m = n[13]; p.nslices = n[14]; p.per_slice = n[15]; p.cap = n[16];
    p.q = as_ptr(ptrs[0]); p.g = as_ptr(ptrs[1]); p.scores = as_ptr(ptrs[2]); p.u_q = as_ptr(ptrs[3]);
    p.u_g = as_ptr(ptrs[4]); p.freqs = as_ptr(ptrs[5]); p.amat = as_ptr(ptrs[6]); p.feats = as_ptr(ptrs[7]);
    p.b1 = as_ptr(ptrs[8]); p.w2 = as_ptr(ptrs[9]); p.bias_ends = as_ptr(ptrs[10]);
    p.table = as_ptr<const float>(ptrs[11]); p.exclude = as_ptr<const int64_t>(ptrs[12]);
    p.thr_seed = as_ptr(ptrs[13]); p.ws_values = as_ptr(ptrs[14]); p.ws_indices = as_ptr<int64_t>(ptrs[15]);
    p.temperature = reals[0]; p.b2 = reals[1]; p.scale = reals[2]; p.bias_ub = reals[3];
    if (kind != 0 && kind != 1) fail("ctd_topk_cuda_pass: kind must be 0 (select) or 1 (scan)");
    run_on(device, [] {}, [&] {
      TK_CUDA_ONLY(if (kind == 0) ctd_topk_cuda_select(p, device, stream); else ctd_topk_cuda_scan(p, device, stream));
    });
  });

  // The serve path (Q <= 16, ctd_topk_cuda_serve): ints (dtype, Q, N, H, k, q_stride, g_stride, bias_mode,
  // hidden, D, K, P, m, nslices, per_slice, cap, lists_per_cta, groups); ptrs (q, g, u_q, u_g, w1, b1, w2,
  // freqs, table, exclude, b2_dev, scale_dev, aux, amat, ws_values, ws_indices, mid_values, mid_indices,
  // out_values, out_indices); reals (temperature, b2, scale).
  m.def("ctd_topk_cuda_serve", [](int device, uintptr_t stream, std::vector<int64_t> n, std::vector<uintptr_t> ptrs,
                                  std::vector<double> reals) {
    if (n.size() != 18 || ptrs.size() != 20 || reals.size() != 3) fail("ctd_topk_cuda_serve: wrong argument counts");
    if (device < 0) fail("ctd_topk_cuda_serve: needs a CUDA device (or the emulator)");
    if (n[7] < 0 || n[7] > 2) fail("ctd_topk: unknown bias mode");
    CtdCudaParams p;
    p.dtype = to_dtype((int)n[0]);
    p.Q = n[1]; p.N = n[2]; p.H = n[3]; p.k = n[4]; p.q_stride = n[5]; p.g_stride = n[6];
    p.bias = static_cast<CtdBias>(n[7]); p.hidden = n[8]; p.D = n[9]; p.K = n[10]; p.P = n[11]; p.m = n[12];
    p.nslices = n[13]; p.per_slice = n[14]; p.cap = n[15]; p.lists_per_cta = n[16]; p.groups = n[17];
    p.q = as_ptr(ptrs[0]); p.g = as_ptr(ptrs[1]); p.u_q = as_ptr(ptrs[2]); p.u_g = as_ptr(ptrs[3]);
    p.w1 = as_ptr(ptrs[4]); p.b1 = as_ptr(ptrs[5]); p.w2 = as_ptr(ptrs[6]); p.freqs = as_ptr(ptrs[7]);
    p.table = as_ptr<const float>(ptrs[8]); p.exclude = as_ptr<const int64_t>(ptrs[9]);
    p.b2_dev = as_ptr<const double>(ptrs[10]); p.scale_dev = as_ptr<const double>(ptrs[11]);
    p.aux = as_ptr<double>(ptrs[12]); p.amat_out = as_ptr(ptrs[13]);
    p.ws_values = as_ptr(ptrs[14]); p.ws_indices = as_ptr<int64_t>(ptrs[15]);
    p.mid_values = as_ptr(ptrs[16]); p.mid_indices = as_ptr<int64_t>(ptrs[17]);
    p.out_values = as_ptr(ptrs[18]); p.out_indices = as_ptr<int64_t>(ptrs[19]);
    p.temperature = reals[0]; p.b2 = reals[1]; p.scale = reals[2];
    run_on(device, [] {}, [&] { TK_CUDA_ONLY(ctd_topk_cuda_serve(p, device, stream)); });
  });
}

}  // namespace tk
