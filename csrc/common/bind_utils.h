// Helpers for bind.cpp files: pointers arrive from Python as integers,
// device < 0 means CPU, and kernels run with the GIL released.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <cstdint>
#include <map>
#include <string>
#include "common/types.h"

namespace tk {

template <typename T = void>
inline T* as_ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// Pointers passed from Python as a {name: address} dict; absent names are null.
using PtrMap = std::map<std::string, uintptr_t>;
inline const void* ptr_of(const PtrMap& m, const char* k) {
  auto it = m.find(k);
  return it == m.end() ? nullptr : as_ptr(it->second);
}
inline void* mut_ptr_of(const PtrMap& m, const char* k) { return const_cast<void*>(ptr_of(m, k)); }

// Runs cpu() for device < 0, else cuda(); fails clearly when CUDA was not compiled in.
template <typename CpuFn, typename CudaFn>
inline void run_on(int device, CpuFn&& cpu, CudaFn&& cuda) {
  pybind11::gil_scoped_release nogil;
  if (device < 0) { cpu(); return; }
#ifdef TK_WITH_CUDA
  cuda();
#else
  (void)cuda;
  throw std::runtime_error("tempokern was built without CUDA kernels; reinstall with nvcc on PATH (TEMPOKERN_CUDA=ON)");
#endif
}

}  // namespace tk

#ifdef TK_WITH_CUDA
#define TK_CUDA_ONLY(...) __VA_ARGS__
#else
#define TK_CUDA_ONLY(...)
#endif
