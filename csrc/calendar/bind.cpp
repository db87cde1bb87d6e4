// Python entry for the soft-calendar ops; validation happens in tempokern/_ops/calendar.py.
#include <tuple>
#include <vector>
#include "calendar/calendar.h"
#include "common/bind_utils.h"
#include "common/registry.h"

namespace tk {
namespace {
// (logits, grad_logits, n, row_stride, weight, table, out_col) per level
using LevelArg = std::tuple<uintptr_t, uintptr_t, int64_t, int64_t, double, uintptr_t, int64_t>;

CalendarParams make_params(int dtype, int64_t B, double inv_tau, const std::vector<LevelArg>& levels,
                           uintptr_t out, uintptr_t grad_out, int64_t out_row_stride, int64_t dim,
                           bool accumulate, int64_t grad_col_stride, int64_t max_ctas) {
  if (levels.empty() || (int)levels.size() > kMaxCalendarLevels)
    fail("calendar kernels take 1.." + std::to_string(kMaxCalendarLevels) + " levels per launch");
  CalendarParams p;
  p.dtype = to_dtype(dtype);
  p.B = B;
  p.inv_tau = inv_tau;
  p.num_levels = (int)levels.size();
  for (int l = 0; l < p.num_levels; ++l) {
    auto& L = p.levels[l];
    L.logits = as_ptr(std::get<0>(levels[l]));
    L.grad_logits = as_ptr(std::get<1>(levels[l]));
    L.n = std::get<2>(levels[l]);
    L.row_stride = std::get<3>(levels[l]);
    L.weight = std::get<4>(levels[l]);
    L.table = as_ptr(std::get<5>(levels[l]));
    L.out_col = std::get<6>(levels[l]);
    if (L.n < 1) fail("calendar level with no classes");
  }
  p.out = as_ptr(out);
  p.grad_out = as_ptr(grad_out);
  p.out_row_stride = out_row_stride;
  p.dim = dim;
  p.accumulate = accumulate;
  p.grad_col_stride = grad_col_stride;
  p.max_ctas = max_ctas;
  return p;
}
}  // namespace

TK_BIND(calendar) {
  m.def("calendar_launch",
        [](const std::string& op, int device, uintptr_t stream, int dtype, int64_t B, double inv_tau,
           const std::vector<LevelArg>& levels, uintptr_t out, uintptr_t grad_out, int64_t out_row_stride,
           int64_t dim, bool accumulate, int64_t grad_col_stride, int64_t max_ctas) {
          const CalendarParams p = make_params(dtype, B, inv_tau, levels, out, grad_out, out_row_stride, dim,
                                               accumulate, grad_col_stride, max_ctas);
          if (op == "scalar_fwd")
            run_on(device, [&] { calendar_scalar_fwd_cpu(p); }, [&] { TK_CUDA_ONLY(calendar_scalar_fwd_cuda(p, device, stream)); });
          else if (op == "scalar_bwd")
            run_on(device, [&] { calendar_scalar_bwd_cpu(p); }, [&] { TK_CUDA_ONLY(calendar_scalar_bwd_cuda(p, device, stream)); });
          else if (op == "context_fwd")
            run_on(device, [&] { calendar_context_fwd_cpu(p); }, [&] { TK_CUDA_ONLY(calendar_context_fwd_cuda(p, device, stream)); });
          else if (op == "context_bwd")
            run_on(device, [&] { calendar_context_bwd_cpu(p); }, [&] { TK_CUDA_ONLY(calendar_context_bwd_cuda(p, device, stream)); });
          // *_v3: the candidate kernels (row tiles through a register prefetch pipeline, calendar_v3_cuda.cu;
          // opt-in, tempokern/_ops/dispatch.py); the CPU kernels are the same for both
          else if (op == "scalar_fwd_v3")
            run_on(device, [&] { calendar_scalar_fwd_cpu(p); }, [&] { TK_CUDA_ONLY(calendar_scalar_fwd_cuda_v3(p, device, stream)); });
          else if (op == "scalar_bwd_v3")
            run_on(device, [&] { calendar_scalar_bwd_cpu(p); }, [&] { TK_CUDA_ONLY(calendar_scalar_bwd_cuda_v3(p, device, stream)); });
          else if (op == "context_fwd_v3")
            run_on(device, [&] { calendar_context_fwd_cpu(p); }, [&] { TK_CUDA_ONLY(calendar_context_fwd_cuda_v3(p, device, stream)); });
          else if (op == "context_bwd_v3")
            run_on(device, [&] { calendar_context_bwd_cpu(p); }, [&] { TK_CUDA_ONLY(calendar_context_bwd_cuda_v3(p, device, stream)); });
          else
            fail("unknown calendar op '" + op + "'");
        },
        pybind11::arg("op"), pybind11::arg("device"), pybind11::arg("stream"), pybind11::arg("dtype"),
        pybind11::arg("B"), pybind11::arg("inv_tau"), pybind11::arg("levels"), pybind11::arg("out"),
        pybind11::arg("grad_out"), pybind11::arg("out_row_stride"), pybind11::arg("dim"), pybind11::arg("accumulate"),
        pybind11::arg("grad_col_stride") = 1, pybind11::arg("max_ctas") = 0);
}

}  // namespace tk
