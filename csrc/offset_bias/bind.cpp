// Python entry for the offset-bias ops; validation happens in tempokern/_ops/offset_bias.py.
#include <string>
#include "common/bind_utils.h"
#include "common/registry.h"
#include "offset_bias/offset_bias.h"

namespace tk {

TK_BIND(offset_bias) {
  m.def("offset_bias_launch",
        [](const std::string& op, int device, uintptr_t stream, int dtype, int64_t Bq, int64_t Bd, int64_t D,
           int64_t hidden, uintptr_t u_q, uintptr_t u_d, uintptr_t freqs, uintptr_t w1, int64_t ld_w1, uintptr_t b1,
           uintptr_t w2, uintptr_t b2, uintptr_t scale, uintptr_t out, int64_t ld_out, uintptr_t grad_out,
           int64_t ld_grad, int64_t ld_grad_col, uintptr_t grad_uq, uintptr_t grad_ud, uintptr_t partials, int64_t nparts,
           uintptr_t table, int64_t points, int64_t n_linear, uintptr_t n_active) {
          OffsetBiasParams p;
          p.dtype = to_dtype(dtype);
          p.acc_double = p.dtype == DType::F64;
          if (Bq < 0 || Bd < 0) fail("offset_bias: negative batch size");
          p.Bq = Bq; p.Bd = Bd; p.D = D; p.hidden = hidden;
          p.u_q = as_ptr(u_q); p.u_d = as_ptr(u_d); p.freqs = as_ptr(freqs);
          p.w1 = as_ptr(w1); p.ld_w1 = ld_w1; p.b1 = as_ptr(b1); p.w2 = as_ptr(w2); p.b2 = as_ptr(b2);
          p.scale = as_ptr(scale);
          p.out = as_ptr(out); p.ld_out = ld_out; p.grad_out = as_ptr(grad_out); p.ld_grad = ld_grad; p.ld_grad_col = ld_grad_col;
          p.grad_uq = as_ptr(grad_uq); p.grad_ud = as_ptr(grad_ud); p.partials = as_ptr(partials); p.nparts = nparts;
          p.table = as_ptr<const float>(table); p.points = points;
          if (n_linear < 0 || n_linear > hidden) fail("offset_bias: n_linear must be in [0, hidden]");
          p.n_linear = n_linear;
          p.n_active = as_ptr<const int32_t>(n_active);
          if (p.n_active && device < 0) fail("offset_bias: n_active is a CUDA-path argument");
          if (op == "lookup") {
            if (points < 2) fail("offset_bias lookup: the table needs at least 2 points");
            run_on(device, [&] { offset_bias_lookup_cpu(p); }, [&] { TK_CUDA_ONLY(offset_bias_lookup_cuda(p, device, stream)); });
            return;
          }
          if (op == "tfwd" || op == "tbwd") {  // training table mode: `table` holds `points` values in A
            if (points < 2) fail("offset_bias table mode: the table needs at least 2 points");
            p.table = nullptr;
            p.table_a = as_ptr(table);
            if (op == "tfwd")
              run_on(device, [&] { offset_bias_table_fwd_cpu(p); },
                     [&] { TK_CUDA_ONLY(offset_bias_table_fwd_cuda(p, device, stream)); });
            else {
              if (nparts < 1) fail("offset_bias table backward needs at least one partial-sum slot");
              run_on(device, [&] { offset_bias_table_bwd_cpu(p); },
                     [&] { TK_CUDA_ONLY(offset_bias_table_bwd_cuda(p, device, stream)); });
            }
            return;
          }
          if (D < 1 || hidden < 1) fail("offset_bias: D and hidden must be >= 1");
          if (op == "fwd")
            run_on(device, [&] { offset_bias_fwd_cpu(p); }, [&] { TK_CUDA_ONLY(offset_bias_fwd_cuda(p, device, stream)); });
          else if (op == "bwd") {
            if (nparts < 1) fail("offset_bias backward needs at least one partial-sum slot");
            run_on(device, [&] { offset_bias_bwd_cpu(p); }, [&] { TK_CUDA_ONLY(offset_bias_bwd_cuda(p, device, stream)); });
          } else
            fail("unknown offset_bias op '" + op + "'");
        });
}

}  // namespace tk
