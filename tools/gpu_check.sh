#!/usr/bin/env bash
# The GPU check: build, CUDA tests, compute-sanitizer, the decision cases of the suite, and the decision per
# candidate of tempokern/_ops/dispatch.py. One H100, at most 8 minutes including the build. docs/gpu-check.md.
#
#   bash tools/gpu_check.sh OUT          # on the GPU machine; logs under OUT, rows appended to benchmarks/results/gpu.csv
#   bash tools/gpu_check.sh --dry [OUT]  # no GPU: the suite's decision cases on the CUDA emulator, tiny sizes,
#                                        # into OUT/gpu.csv, and the decision on them (< 3 minutes)
#
# OUT defaults to $OUT, else a new temporary folder. Nothing but benchmarks/results/gpu.csv is written in the
# checkout. The exit status is 0 when every step ran and passed, 1 otherwise; the decision is printed either way.
set -u

DRY=0
if [ "${1:-}" = "--dry" ]; then DRY=1; shift; fi
OUTDIR="${1:-${OUT:-}}"
[ -n "$OUTDIR" ] || OUTDIR="$(mktemp -d)"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
STATUS="$OUTDIR/status"
: > "$STATUS"
START=$SECONDS
LIMIT="${GPU_CHECK_LIMIT_S:-470}"   # the whole check, build included: 8 minutes less a margin
FAILED=0

log() { echo "[gpu_check $((SECONDS - START))s] $*"; }
left() { echo $((LIMIT - (SECONDS - START))); }
# cap CAP RESERVE: a step's timeout: CAP seconds, or what is left of the limit less RESERVE (at least 10)
cap() { local l=$(( $(left) - $2 )); [ "$l" -lt "$1" ] && echo $(( l > 10 ? l : 10 )) || echo "$1"; }
record() {   # record NAME EXIT_STATUS
  echo "$1=$2" >> "$STATUS"
  if [ "$2" = "0" ]; then log "$1 passed"; else log "$1 FAILED (exit $2; log: $OUTDIR/$1.log)"; FAILED=1; fi
}

if [ "$DRY" = "1" ]; then
  log "dry run: no build, no CUDA tests, no compute-sanitizer; the suite on the CUDA emulator; output in $OUTDIR"
  for step in tests memcheck racecheck synccheck; do echo "$step=skipped (dry run)" >> "$STATUS"; done
  # the in-place developer build where there is one (tools/dev_build.sh), else the installed package
  PP="${PYTHONPATH:-}"
  if ls "$ROOT"/tempokern/_C*.so > /dev/null 2>&1; then PP="$ROOT${PP:+:$PP}"; fi
  # every column of the GPU run, the compile ones through the aot_eager backend (no inductor: its C++ compilation
  # would take minutes on a CPU; the columns' plumbing is what the dry run checks)
  PYTHONPATH="$PP" "$PY" benchmarks/gpu_suite.py --device emu --decision \
    --csv "$OUTDIR/gpu.csv" --md "$OUTDIR/gpu_suite.md" --repeats 1 --measure-s 0 --compile-backend aot_eager \
    > "$OUTDIR/suite.log" 2>&1
  rc=$?
  record suite $rc
  [ $rc -eq 0 ] || tail -20 "$OUTDIR/suite.log"
  # what a GPU run would measure: the decision cases, then every case whose default's sources changed since its
  # newest row of benchmarks/results/gpu.csv
  PYTHONPATH="$PP" "$PY" benchmarks/gpu_suite.py --decision --stale --plan > "$OUTDIR/plan.txt" 2>&1
  rc=$?
  record plan $rc
  cat "$OUTDIR/plan.txt"
  "$PY" tools/gpu_decide.py --csv "$OUTDIR/gpu.csv" --status "$STATUS" | tee "$OUTDIR/decision.txt"
  exit $FAILED
fi

# the commit the rows name: git's, else TEMPOKERN_GIT_COMMIT (a copy of the checkout without .git)
if [ -z "${TEMPOKERN_GIT_COMMIT:-}" ] && ! git rev-parse HEAD > /dev/null 2>&1; then
  log "no git repository here and TEMPOKERN_GIT_COMMIT unset: the rows name commit 'unknown'"
fi

# (a) build for the visible GPU's architecture only
ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader > "$OUTDIR/device.txt" 2>&1
log "device $(cat "$OUTDIR/device.txt"); building for sm_$ARCH"
TEMPOKERN_CUDA=ON TEMPOKERN_CUDA_ARCHS="$ARCH" timeout "$(cap 240 200)" \
  "$PY" -m pip install --no-build-isolation --no-deps . > "$OUTDIR/build.log" 2>&1
rc=$?
record build $rc
if [ $rc -ne 0 ]; then
  tail -30 "$OUTDIR/build.log"
  "$PY" tools/gpu_decide.py --csv benchmarks/results/gpu.csv --status "$STATUS" | tee "$OUTDIR/decision.txt"
  exit 1
fi
# from here on the installed tempokern, not the source tree (PYTHONSAFEPATH: the working folder is not on sys.path)
export PYTHONSAFEPATH=1
"$PY" -c "import tempokern, json; print(json.dumps(tempokern.build_info()))" > "$OUTDIR/build_info.json" 2>&1

# Inf-CL for the one-positive case's inf_cl column: already installed, or from a wheel named by INF_CL_WHEEL (the GPU
# machine may have no network); without it the column is a status row saying it is not installed
if ! "$PY" -c "import inf_cl" > /dev/null 2>&1 && [ -n "${INF_CL_WHEEL:-}" ]; then
  "$PY" -m pip install --no-deps "$INF_CL_WHEEL" > "$OUTDIR/inf_cl.log" 2>&1 || log "Inf-CL wheel did not install (inf_cl.log)"
fi

# (b) the CUDA tests
timeout "$(cap 150 200)" "$PY" -m pytest -m cuda tests -q -x -p no:cacheprovider > "$OUTDIR/tests.log" 2>&1
record tests $?
tail -3 "$OUTDIR/tests.log"

# (c) compute-sanitizer on small calls of every default and candidate kernel
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
if [ -z "$SAN" ]; then
  log "compute-sanitizer not found"
  for step in memcheck racecheck synccheck; do echo "$step=127" >> "$STATUS"; done
  FAILED=1
else
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(cap 90 150)" "$SAN" --tool memcheck --error-exitcode 99 \
    "$PY" tools/gpu_sanitize_case.py > "$OUTDIR/memcheck.log" 2>&1
  record memcheck $?
  SAN_SMALL=1 timeout "$(cap 75 130)" "$SAN" --tool racecheck --racecheck-report hazard --error-exitcode 99 \
    "$PY" tools/gpu_sanitize_case.py > "$OUTDIR/racecheck.log" 2>&1
  record racecheck $?
  SAN_SMALL=1 timeout "$(cap 60 110)" "$SAN" --tool synccheck --error-exitcode 99 \
    "$PY" tools/gpu_sanitize_case.py > "$OUTDIR/synccheck.log" 2>&1
  record synccheck $?
fi

# (d) the decision cases (default vs candidates vs eager, torch.compile, torch.compile with the auto-chunker, Inf-CL
# where it applies), then every case whose default path's sources changed since its newest row (src_hash),
# appended to benchmarks/results/gpu.csv; the budget cuts the stale cases and the compile columns first
BUDGET=$(( $(left) - 40 ))
[ "$BUDGET" -gt 30 ] || BUDGET=30
log "suite: decision cases, budget ${BUDGET}s"
"$PY" benchmarks/gpu_suite.py --decision --stale --plan > "$OUTDIR/plan.txt" 2>&1
cat "$OUTDIR/plan.txt"
timeout $((BUDGET + 30)) "$PY" benchmarks/gpu_suite.py --decision --stale --budget-s "$BUDGET" \
  --md "$OUTDIR/gpu_suite.md" > "$OUTDIR/suite.log" 2>&1
rc=$?
record suite $rc
[ $rc -eq 0 ] || tail -20 "$OUTDIR/suite.log"
cp benchmarks/results/gpu.csv "$OUTDIR/gpu.csv"

# (e) the decision per candidate
"$PY" tools/gpu_decide.py --csv benchmarks/results/gpu.csv --status "$STATUS" | tee "$OUTDIR/decision.txt"
log "done in $((SECONDS - START))s; logs in $OUTDIR"
exit $FAILED
