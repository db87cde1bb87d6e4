// The tempokern._C module: no libtorch, only raw pointers and sizes from Python.
#include <omp.h>
#include <pybind11/pybind11.h>
#include "common/registry.h"
#ifdef TK_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace py = pybind11;

namespace tk {
std::vector<BindFn>& bind_registry() {
  static std::vector<BindFn> fns;
  return fns;
}
}  // namespace tk

PYBIND11_MODULE(_C, m) {
  m.doc() = "tempokern compiled kernels (torch-free; called through tempokern._ops)";
  py::register_exception_translator([](std::exception_ptr p) {
    try { if (p) std::rethrow_exception(p); }
    catch (const std::invalid_argument& e) { PyErr_SetString(PyExc_ValueError, e.what()); }
  });
#ifdef TK_WITH_CUDA
  m.attr("cuda_compiled") = true;
  m.attr("cuda_archs") = TK_CUDA_ARCHS;
#else
  m.attr("cuda_compiled") = false;
  m.attr("cuda_archs") = "";
#endif
  m.def("openmp_threads", []() { return omp_get_max_threads(); });
  m.def("set_openmp_threads", [](int n) { omp_set_num_threads(n); });
  // (ok, device_count, message): never throws, so import and build_info work without a driver.
  m.def("cuda_runtime_status", []() -> py::tuple {
#ifdef TK_WITH_CUDA
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) { cudaGetLastError(); return py::make_tuple(false, 0, std::string(cudaGetErrorString(e))); }
    return py::make_tuple(true, n, std::string("ok"));
#else
    return py::make_tuple(false, 0, std::string("built without CUDA kernels"));
#endif
  });
  for (auto f : tk::bind_registry()) f(m);
}
