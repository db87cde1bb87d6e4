// Python entry for the fused CTD top-k; validation happens in tempokern/_ops/ctd_topk.py.
#include <tuple>
#include "common/bind_utils.h"
#include "common/registry.h"
#include "ctd_topk/ctd_topk.h"

namespace tk {

TK_BIND(ctd_topk) {
  // shapes: (Q, N, H, k, q_stride, g_stride); exact bias: (hidden, D, K, freqs, w1, b1, w2, b2, scale);
  // table: (table, P); exclude: (ptr, m); rerank candidates: (ptr, C); outputs (values, indices); CUDA workspaces (ws_v, ws_i, nsplit, cap, ws_bias, bias_ends)
  m.def("ctd_topk_launch",
        [](int device, uintptr_t stream, int dtype, std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t> shp,
           uintptr_t q, uintptr_t g, double temperature, int bias_mode, uintptr_t u_q, uintptr_t u_g,
           std::tuple<int64_t, int64_t, int64_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, double, double> ex,
           uintptr_t table, int64_t P, uintptr_t exclude, int64_t m_ex, uintptr_t cand, int64_t C, uintptr_t values, uintptr_t indices,
           uintptr_t ws_values, uintptr_t ws_indices, int64_t nsplit, int64_t cap, uintptr_t ws_bias,
           uintptr_t bias_ends) {
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
          if (p.cand && device >= 0) fail("ctd_topk: candidate rerank runs on CPU only");
          p.values = as_ptr(values);
          p.indices = as_ptr<int64_t>(indices);
          p.ws_values = as_ptr(ws_values);
          p.ws_indices = as_ptr<int64_t>(ws_indices);
          p.nsplit = nsplit;
          p.cap = cap;
          p.bias_ends = as_ptr(bias_ends);
          p.ws_bias = as_ptr(ws_bias);
          if (p.Q == 0) return;
          run_on(device, [&] { ctd_topk_cpu(p); }, [&] { TK_CUDA_ONLY(ctd_topk_cuda(p, device, stream)); });
        });
}

}  // namespace tk
