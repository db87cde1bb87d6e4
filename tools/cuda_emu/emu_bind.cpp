// Emulator-only functions of the emulated _C module (registered like any op's bind.cpp).
#include <pybind11/stl.h>
#include <cstdint>
#include <string>
#include "common/registry.h"

namespace emu {
unsigned long long launch_count();
void set_seed(unsigned long long seed);
void set_warp_serial(bool on);
}
void emu_selftest(const std::string& name, float* out, int arg);

TK_BIND(cuda_emu) {
  m.attr("cuda_emulated") = true;
  m.def("emu_launch_count", &emu::launch_count, "kernel launches run by the CUDA emulator so far");
  m.def("emu_set_seed", &emu::set_seed,
        "0: threads reach each barrier in index order; else a seeded random order (races then change results)");
  m.def("emu_set_warp_serial", &emu::set_warp_serial,
        "true: between two __syncthreads each warp runs alone to the next one, the last warp first (seed 0) or in a "
        "seeded order (races between warps at different barrier positions then change results)");
  m.def("emu_selftest", [](const std::string& name, uintptr_t out, int arg) {
    pybind11::gil_scoped_release nogil;
    emu_selftest(name, reinterpret_cast<float*>(out), arg);
  });
}
