#!/usr/bin/env bash
# In-place developer build: compiles tempokern._C into build/dev and copies it into
# tempokern/, so `python -m pytest` from the repo root uses this tree without pip.
# TEMPOKERN_CUDA=OFF (default here, fast) | ON | auto;  TEMPOKERN_CUDA_ARCHS=90 to compile one arch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
mode=${TEMPOKERN_CUDA:-OFF}
bdir=build/dev-$(echo "$mode" | tr 'A-Z' 'a-z')
cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTEMPOKERN_CUDA="$mode" -DTEMPOKERN_CUDA_ARCHS="${TEMPOKERN_CUDA_ARCHS:-auto}" \
  -Dpybind11_DIR="$($PY -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v $PY)" >/dev/null
cmake --build "$bdir" -j "${JOBS:-2}"
cp "$bdir"/_C*.so tempokern/
echo "built $(ls tempokern/_C*.so) (CUDA=$mode)"
