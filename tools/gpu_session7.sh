#!/usr/bin/env bash
# One device call of the third GPU session (2026-11-23): PHASE=a builds for sm_90 (the .so is copied to $OUT so
# a later call can carry it), runs every CUDA test and the GPU suite without torch.compile; PHASE=b runs
# compute-sanitizer memcheck and racecheck on tools/gpu_sanitize_case.py (every op, the session-6 paths too);
# PHASE=c builds unless tempokern/_C*312*.so is there and runs the full suite (torch.compile included).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TEMPOKERN_TEST_EMU=0
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/device.txt"
build() {
  TEMPOKERN_CUDA=ON TEMPOKERN_CUDA_ARCHS=90 JOBS=16 PYTHON=python3 tools/dev_build.sh > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  cp tempokern/_C*.so "$OUT/"; echo "build done $(el)"
}
# the .so of phase d carried as .devbuild/_C312.so.xz (while csrc/ is unchanged): no build
carried() {
  ls tempokern/_C*312*.so >/dev/null 2>&1 || xz -dc .devbuild/_C312.so.xz > tempokern/_C.cpython-312-x86_64-linux-gnu.so
}
case "${PHASE:-a}" in
a)
  build
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m cuda -p no:cacheprovider -rf tests > "$OUT/pytest-cuda.log" 2>&1
  echo "tests rc $? $(el)"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest-cuda.log" | tail -25
  timeout ${SUITE_TIMEOUT:-360} python3 benchmarks/gpu_suite.py --out "$OUT" --no-compile --budget-s ${SUITE_BUDGET:-300} \
    > "$OUT/suite.log" 2>&1
  echo "suite rc $? $(el)"; tail -${TAIL:-90} "$OUT/suite.log" ;;
b)
  ls tempokern/_C*312*.so >/dev/null 2>&1 || build
  for tool in memcheck racecheck; do
    timeout ${SAN_TIMEOUT:-200} compute-sanitizer --tool $tool --error-exitcode 9 python3 tools/gpu_sanitize_case.py \
      > "$OUT/sanitizer-$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc $? $(el)"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|ok$" "$OUT/sanitizer-$tool.log" | tail -6
  done ;;
c)
  ls tempokern/_C*312*.so >/dev/null 2>&1 || build
  timeout ${SUITE_TIMEOUT:-500} python3 benchmarks/gpu_suite.py --out "$OUT" --budget-s ${SUITE_BUDGET:-420} ${SUITE_ARGS:-} \
    > "$OUT/suite.log" 2>&1
  echo "suite rc $? $(el)"; tail -${TAIL:-90} "$OUT/suite.log" ;;
d)
  build; xz -T16 -1 -c tempokern/_C*.so > "$OUT/_C312.so.xz"; ls -la "$OUT/_C312.so.xz"
  timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_multipos_hardest.py \
    tests/test_calendar_v2.py tests/test_matryoshka_infonce.py tests/test_multipos_stats_v2.py \
    tests/test_matryoshka_cuda_fused.py > "$OUT/pytest-cuda-fixed.log" 2>&1
  echo "tests rc $? $(el)"; tail -3 "$OUT/pytest-cuda-fixed.log"
  timeout 220 python3 tools/gpu_probe7.py > "$OUT/probe.log" 2>&1; echo "probe rc $? $(el)"
  TEMPOKERN_MPB_STATS=v2 timeout 100 ncu --kernel-name regex:mpb_fwd --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats \
    python3 tools/ncu_case.py 16384 > "$OUT/ncu-fwd2.txt" 2>&1; echo "ncu rc $? $(el)"
  SAN_SMALL=1 timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tools/gpu_sanitize_case.py \
    > "$OUT/sanitizer-racecheck.log" 2>&1
  echo "racecheck rc $? $(el)"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|Error|ok$" "$OUT/sanitizer-racecheck.log" | tail -5
  grep -E "^(topk|calendar|loss|matryoshka)" "$OUT/probe.log" ;;
e)
  carried
  timeout ${SUITE_TIMEOUT:-430} python3 benchmarks/gpu_suite.py --out "$OUT" --budget-s ${SUITE_BUDGET:-390} \
    > "$OUT/suite.log" 2>&1; echo "suite rc $? $(el)"
  timeout 70 python3 -m pytest -q -m cuda -p no:cacheprovider -rf tests > "$OUT/pytest-cuda.log" 2>&1
  echo "tests rc $? $(el)"; grep -E "passed|failed|FAILED" "$OUT/pytest-cuda.log" | tail -8
  timeout 80 python3 tools/gpu_probe7.py calendar profile mrl > "$OUT/probe.log" 2>&1; echo "probe rc $? $(el)"
  grep -E "^(calendar|loss|matryoshka)" "$OUT/probe.log"; tail -${TAIL:-75} "$OUT/suite.log" ;;
f)
  carried
  timeout 150 python3 tools/gpu_hostprof.py > "$OUT/hostprof.log" 2>&1; echo "hostprof rc $? $(el)"
  grep -E "host issue|one torch" "$OUT/hostprof.log" ;;
g)
  carried
  timeout 90 python3 -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_cuda_no_sync.py tests/test_offset_bias.py \
    tests/test_multipos_infonce.py tests/test_ctd_topk.py tests/test_ctd_topk_serve.py tests/test_multipos_blocked.py \
    tests/test_ctd_loss.py > "$OUT/pytest-cuda-g.log" 2>&1
  echo "tests rc $? $(el)"; grep -E "passed|failed|FAILED|^E  " "$OUT/pytest-cuda-g.log" | tail -12
  timeout 45 python3 tools/gpu_hostprof.py > "$OUT/hostprof.log" 2>&1; echo "hostprof rc $? $(el)"
  grep -E "host issue" "$OUT/hostprof.log"
  timeout 250 python3 benchmarks/gpu_suite.py --out "$OUT" --budget-s 210 --only "${SUITE_ONLY:-multipos_infonce|Q=1 N}" \
    > "$OUT/suite.log" 2>&1; echo "suite rc $? $(el)"; tail -${TAIL:-40} "$OUT/suite.log" ;;
h)
  carried
  timeout 300 python3 benchmarks/gpu_suite.py --out "$OUT" --budget-s 250 > "$OUT/suite.log" 2>&1
  echo "suite rc $? $(el)"
  timeout 40 python3 tools/gpu_hostprof.py > "$OUT/hostprof.log" 2>&1; echo "hostprof rc $? $(el)"
  grep -E "host issue" "$OUT/hostprof.log"; tail -${TAIL:-16} "$OUT/suite.log" ;;
esac
echo "done $(el)"
