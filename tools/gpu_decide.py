#!/usr/bin/env python
"""The decision per candidate of tempokern/_ops/dispatch.py after a GPU check (tools/gpu_check.sh).

    python tools/gpu_decide.py [--csv benchmarks/results/gpu.csv] [--status STATUS_FILE]

Reads the rows of the newest run in the CSV (the rows that share the last row's date, device and commit) and,
per candidate, compares its time_ms (impl "tempokern:<name>") with the default's (impl "tempokern") on every
case of that run where both were timed. Prints one line per candidate:

    mpb_tc: WINS on all 4 cases -> make it the default and delete the blocked path
    mpb_tc: LOSES on all 4 cases -> delete it
    mpb_tc: MIXED (wins on 1 of 4 cases: ...) -> ...

followed by the times, and whether the CUDA tests and the compute-sanitizer runs passed, read from the status
file (lines "name=exit status", written by gpu_check.sh). A candidate whose tests or sanitizer runs failed is
never made the default, whatever its times, nor is one whose largest err_vs_torch (its error over eager
torch's in the same dtype) is above 2. Exit status 0 (the decision is the output, not the status).
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent


def _load_dispatch():
    """tempokern/_ops/dispatch.py of this checkout, loaded by path (the tempokern package is not imported: on the
    GPU machine the source tree has no compiled module)."""
    spec = importlib.util.spec_from_file_location("tempokern_dispatch_table", REPO / "tempokern/_ops/dispatch.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


dispatch = _load_dispatch()

CHECKS = ("tests", "memcheck", "racecheck", "synccheck")


def newest_run(rows: List[dict]) -> List[dict]:
    """The rows of the last run in the file: the same date, device and commit as the last row."""
    if not rows:
        return []
    key = (rows[-1]["date"], rows[-1]["device"], rows[-1]["commit"])
    return [r for r in rows if (r["date"], r["device"], r["commit"]) == key]


def times(rows: List[dict]) -> Dict[Tuple[str, str, str], Dict[str, float]]:
    """{(op, case, B): {impl: time_ms}} of the timed rows."""
    out: Dict[Tuple[str, str, str], Dict[str, float]] = {}
    for r in rows:
        if r["metric"] != "time_ms" or r["value"] in ("", None):
            continue
        try:
            v = float(r["value"])
        except ValueError:
            continue
        out.setdefault((r["op"], r["case"], r["B"]), {})[r["impl"]] = v
    return out


def worst_err(rows: List[dict], impl: str) -> Optional[float]:
    """The largest err_vs_torch (abs error over eager torch's in the same dtype) of column `impl` in the run."""
    vals = []
    for r in rows:
        if r["impl"] == impl and r["metric"] == "err_vs_torch" and r["value"] not in ("", None):
            try:
                vals.append(float(r["value"]))
            except ValueError:
                pass
    return max(vals) if vals else None


def read_status(path: Optional[str]) -> Dict[str, str]:
    status: Dict[str, str] = {}
    if path and Path(path).exists():
        for line in Path(path).read_text().splitlines():
            if "=" in line:
                k, v = line.split("=", 1)
                status[k.strip()] = v.strip()
    return status


def checks_line(status: Dict[str, str]) -> Tuple[str, bool]:
    parts, ok = [], True
    for name in CHECKS:
        v = status.get(name)
        if v is None:
            parts.append(f"{name} not run")
            ok = False
        elif v == "0":
            parts.append(f"{name} passed")
        elif v.startswith("skipped"):
            parts.append(f"{name} {v}")
            ok = False
        elif v == "124":
            parts.append(f"{name} TIMED OUT")
            ok = False
        else:
            parts.append(f"{name} FAILED (exit {v})")
            ok = False
    return ", ".join(parts), ok


def decide(rows: List[dict], status: Dict[str, str]) -> List[str]:
    run = newest_run(rows)
    t = times(run)
    checks, checks_ok = checks_line(status)
    lines = []
    if run:
        lines.append(f"run: {run[-1]['date']} on {run[-1]['device']}, commit {run[-1]['commit']}")
    else:
        lines.append("run: no rows")
    for c in dispatch.CANDIDATES:
        impl = f"tempokern:{c.name}"
        cases = [(k, m["tempokern"], m[impl]) for k, m in t.items() if "tempokern" in m and impl in m]
        wins = [x for x in cases if x[2] < x[1]]
        detail = "; ".join(f"{op} {case} {b}: {cand:.3f} vs {default:.3f} ms"
                           for (op, case, b), default, cand in cases)
        n = len(cases)
        err = worst_err(run, impl)
        accurate = err is None or err <= 2.0
        if n == 0:
            verdict = "NOT MEASURED (no case with both the default and the candidate timed) -> run the check again"
        elif len(wins) == n:
            if not checks_ok:
                verdict = f"WINS on all {n} cases but its checks did not all pass -> fix it before it can be the default"
            elif not accurate:
                verdict = (f"WINS on all {n} cases but its error is {err:.2f}x eager torch's (the 2x rule) -> fix it "
                           "before it can be the default")
            else:
                verdict = f"WINS on all {n} cases -> make it the default and delete the {c.against} path"
        elif not wins:
            verdict = f"LOSES on all {n} cases -> delete it"
        else:
            won = ", ".join(f"{op} {case} {b}" for (op, case, b), _, _ in wins)
            verdict = (f"MIXED (wins on {len(wins)} of {n} cases: {won}) -> delete it, or narrow what it takes to the "
                       "cases it wins and measure again")
        lines.append(f"{c.name}: {verdict}")
        if detail:
            lines.append(f"    {detail}")
        lines.append(f"    checks: {checks}")
        if err is not None:
            lines.append(f"    accuracy: largest err_vs_torch {err:.2f} (<= 2: the 2x rule)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", default=str(REPO / dispatch.GPU_CSV))
    p.add_argument("--status", default=None, help="file of 'name=exit status' lines (tests, memcheck, racecheck, "
                   "synccheck)")
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    for line in decide(rows, read_status(args.status)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
