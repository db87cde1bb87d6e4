#!/usr/bin/env bash
# One device call: build, CUDA tests (stop at the first failure), memcheck on small calls, the GPU suite.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TEMPOKERN_TEST_EMU=0
t0=$(date +%s)
TEMPOKERN_CUDA=ON TEMPOKERN_CUDA_ARCHS=90 JOBS=16 PYTHON=python3 tools/dev_build.sh > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 100 python3 -m pytest -q -x -m cuda -p no:cacheprovider tests/test_multipos_blocked.py tests/test_offset_bias.py \
  tests/test_calendar_ops.py tests/test_ctd_topk.py tests/test_multipos_infonce.py 2>&1 | tee "$OUT/pytest-cuda.log" | tail -6
echo "tests $(( $(date +%s) - t0 )) s"
timeout 70 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/gpu_sanitize_case.py > "$OUT/memcheck.log" 2>&1
echo "memcheck rc $?: $(grep 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
timeout ${SUITE_TIMEOUT:-330} python3 benchmarks/gpu_suite.py --out "$OUT" --budget-s ${SUITE_BUDGET:-280} > "$OUT/suite.log" 2>&1
echo "suite rc $? $(( $(date +%s) - t0 )) s"; tail -60 "$OUT/suite.log"
