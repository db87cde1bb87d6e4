// CUDA emulator shim: see tools/cuda_emu/README.md.
#pragma once
#include "emu_core.h"
#include "emu_wmma.h"
