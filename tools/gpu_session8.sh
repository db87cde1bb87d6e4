#!/usr/bin/env bash
# One device call of the fourth GPU session (2026-11-23). PHASE=a: build for sm_90 (the .so xz-compressed to
# $OUT, to be carried as .devbuild/_C312.so.xz while csrc/ is unchanged), every CUDA test, tools/gpu_probe8.py;
# b: the suite's multipos / matryoshka / offset_bias cases without torch.compile + memcheck / racecheck (small);
# c: the full suite (torch.compile included).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TEMPOKERN_TEST_EMU=0
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/device.txt"
build() {
  TEMPOKERN_CUDA=ON TEMPOKERN_CUDA_ARCHS=90 JOBS=16 PYTHON=python3 tools/dev_build.sh > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build done $(el)"
}
carried() {
  ls tempokern/_C*312*.so >/dev/null 2>&1 || xz -dc .devbuild/_C312.so.xz > tempokern/_C.cpython-312-x86_64-linux-gnu.so
}
sanitizers() {  # memcheck and racecheck on tools/gpu_sanitize_case.py (small sizes), timeout $1 s each
  for tool in memcheck racecheck; do
    SAN_SMALL=1 timeout "$1" compute-sanitizer --tool $tool --error-exitcode 9 python3 \
      tools/gpu_sanitize_case.py > "$OUT/sanitizer-$tool.log" 2>&1
    echo "$tool rc $? $(el)"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|Error|ok$" "$OUT/sanitizer-$tool.log" | tail -4
  done
}
case "${PHASE:-a}" in
a)
  build; xz -T16 -1 -c tempokern/_C*312*.so > "$OUT/_C312.so.xz"
  timeout ${TEST_TIMEOUT:-220} python3 -m pytest -q -m cuda -p no:cacheprovider -rf tests > "$OUT/pytest-cuda.log" 2>&1
  echo "tests rc $? $(el)"; grep -E "passed|failed|FAILED" "$OUT/pytest-cuda.log" | tail -25
  timeout ${PROBE_TIMEOUT:-150} python3 tools/gpu_probe8.py > "$OUT/probe.log" 2>&1; echo "probe rc $? $(el)"
  grep -E "^(loss|matryoshka)" "$OUT/probe.log" ;;
b)
  carried
  timeout ${SUITE_TIMEOUT:-330} python3 benchmarks/gpu_suite.py --out "$OUT" --no-compile --budget-s ${SUITE_BUDGET:-300} \
    --only "${SUITE_ONLY:-multipos_infonce|matryoshka|offset_bias}" > "$OUT/suite.log" 2>&1
  echo "suite rc $? $(el)"; tail -${TAIL:-60} "$OUT/suite.log"
  sanitizers ${SAN_TIMEOUT:-120} ;;
p)
  carried
  timeout ${PROBE_TIMEOUT:-200} python3 tools/gpu_probe8.py > "$OUT/probe.log" 2>&1; echo "probe rc $? $(el)"
  grep -E "^(loss|matryoshka)" "$OUT/probe.log"; tail -3 "$OUT/probe.log" ;;
d)
  build; xz -T16 -1 -c tempokern/_C*312*.so > "$OUT/_C312.so.xz"
  timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q -m cuda -p no:cacheprovider -rf tests > "$OUT/pytest-cuda.log" 2>&1
  echo "tests rc $? $(el)"; grep -E "passed|failed|FAILED" "$OUT/pytest-cuda.log" | tail -12
  timeout ${SUITE_TIMEOUT:-130} python3 benchmarks/gpu_suite.py --out "$OUT" --no-compile --budget-s ${SUITE_BUDGET:-110} \
    --only "${SUITE_ONLY:-offset_bias/exact|multipos_infonce/exact}" > "$OUT/suite.log" 2>&1
  echo "suite rc $? $(el)"; grep -E "^\| (exact|loss, exact)" "$OUT/suite.log" | cut -c1-160
  sanitizers ${SAN_TIMEOUT:-90} ;;
s)
  carried
  sanitizers ${SAN_TIMEOUT:-150} ;;
c)
  carried
  timeout ${SUITE_TIMEOUT:-540} python3 benchmarks/gpu_suite.py --out "$OUT" --budget-s ${SUITE_BUDGET:-470} ${SUITE_ARGS:-} \
    > "$OUT/suite.log" 2>&1
  echo "suite rc $? $(el)"; tail -${TAIL:-90} "$OUT/suite.log" ;;
esac
echo "done $(el)"
