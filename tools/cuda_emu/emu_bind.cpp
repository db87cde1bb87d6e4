// Emulator-only functions of the emulated _C module (registered like any op's bind.cpp).
#include "common/registry.h"

namespace emu {
unsigned long long launch_count();
}

TK_BIND(cuda_emu) {
  m.attr("cuda_emulated") = true;
  m.def("emu_launch_count", &emu::launch_count, "kernel launches run by the CUDA emulator so far");
}
