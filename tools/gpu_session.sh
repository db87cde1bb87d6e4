#!/usr/bin/env bash
# What the lead runs on a lent GPU machine (device tool): build in place for sm_90, the CUDA tests of every
# kernel file, compute-sanitizer memcheck and racecheck on small calls. Output under $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TEMPOKERN_TEST_EMU=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
t0=$(date +%s)
if ! ls tempokern/_C*cpython-312*.so >/dev/null 2>&1 || [ "${REBUILD:-1}" = 1 ]; then
  TEMPOKERN_CUDA=ON TEMPOKERN_CUDA_ARCHS=90 JOBS=16 PYTHON=python3 tools/dev_build.sh > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
fi
echo "build $(( $(date +%s) - t0 )) s"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_multipos_blocked.py \
  tests/test_multipos_infonce.py tests/test_offset_bias.py tests/test_calendar_ops.py tests/test_ctd_topk.py \
  tests/test_ctd_loss.py tests/test_training_ctd.py 2>&1 | tee "$OUT/pytest-cuda.log" | tail -25
echo "tests done $(( $(date +%s) - t0 )) s"
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 tools/gpu_sanitize_case.py \
    > "$OUT/sanitizer-$tool.log" 2>&1; echo "compute-sanitizer $tool: rc $? ($(grep -c 'ERROR SUMMARY: 0' "$OUT/sanitizer-$tool.log") clean summaries)"
  tail -3 "$OUT/sanitizer-$tool.log"
done
echo "session done $(( $(date +%s) - t0 )) s"
