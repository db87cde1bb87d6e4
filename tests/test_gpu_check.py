"""tools/gpu_check.sh (its --dry mode: the suite's decision cases on the CUDA emulator, then the decision),
tools/gpu_decide.py, and the evidence of the dispatch table: every GPU default names rows that exist in
benchmarks/results/gpu.csv."""
from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tempokern._ops import dispatch

ROOT = Path(__file__).resolve().parent.parent
GPU_CSV = ROOT / dispatch.GPU_CSV
FIELDS = ["date", "device", "commit", "src_hash", "op", "case", "B", "impl", "metric", "value", "note"]


@pytest.fixture(scope="module")
def decide():
    spec = importlib.util.spec_from_file_location("gpu_decide", ROOT / "tools" / "gpu_decide.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpu_rows():
    with open(GPU_CSV, newline="") as f:
        return list(csv.DictReader(f))


def test_gpu_csv_format():
    with open(GPU_CSV, newline="") as f:
        assert next(csv.reader(f)) == FIELDS
    rows = gpu_rows()
    assert rows and all(r["date"] and r["device"] and r["commit"] and r["op"] and r["impl"] for r in rows)
    keys = [tuple(r[k] for k in FIELDS[:9]) for r in rows]
    assert len(keys) == len(set(keys)), "two rows for one (date, device, commit, op, case, B, impl, metric)"


def evidence_rows(evidence: str) -> dict:
    """{field: value} of an evidence string 'benchmarks/results/gpu.csv: op=...; case=...; B=...; impl=...
    [; metric=...] (comment)'."""
    body = evidence.split(": ", 1)[1]
    body = re.split(r" \(", body, maxsplit=1)[0]
    out = {}
    for part in body.split("; "):
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def test_every_gpu_default_names_rows_of_gpu_csv():
    rows = gpu_rows()
    cuda = [p for p in dispatch.DEFAULTS if p.device == "cuda"]
    assert cuda
    for p in cuda:
        assert p.evidence.startswith(dispatch.GPU_CSV + ": "), p
        want = evidence_rows(p.evidence)
        assert {"op", "case", "B", "impl"} <= set(want), (p.name, want)
        want.setdefault("metric", "time_ms")
        assert p.op.split(" / ")[0] == want["op"], (p.op, want)
        hits = [r for r in rows if all(r[k] == v for k, v in want.items())]
        assert hits, f"{p.op} {p.name}: no row of {dispatch.GPU_CSV} has {want}"
        assert all(float(r["value"]) > 0 for r in hits)


def row(date, impl, op, case, ms, B="B=8"):
    return {"date": date, "device": "GPU", "commit": "abc", "op": op, "case": case, "B": B, "impl": impl,
            "metric": "time_ms", "value": str(ms), "note": ""}


def test_decide_wins_loses_mixed_and_the_checks(decide):
    names = [c.name for c in dispatch.CANDIDATES]
    assert names == ["mpb_tc", "mrl_tc", "calendar_v3"]   # the rows below name these
    old = [row("d0", "tempokern", "matryoshka_infonce", "m", 1.0), row("d0", "tempokern:mrl_tc", "matryoshka_infonce",
                                                                           "m", 9.0)]
    new = [row("d1", "tempokern", "multipos_infonce", "a", 2.0), row("d1", "tempokern:mpb_tc", "multipos_infonce", "a", 1.0),
           row("d1", "tempokern", "multipos_infonce", "b", 2.0), row("d1", "tempokern:mpb_tc", "multipos_infonce", "b", 1.5),
           row("d1", "tempokern", "matryoshka_infonce", "m", 1.0),
           row("d1", "tempokern:mrl_tc", "matryoshka_infonce", "m", 3.0),
           row("d1", "tempokern", "calendar_context", "c", 1.0),
           row("d1", "tempokern:calendar_v3", "calendar_context", "c", 0.5),
           row("d1", "tempokern", "calendar_scalar", "s", 1.0),
           row("d1", "tempokern:calendar_v3", "calendar_scalar", "s", 2.0)]
    ok = {"tests": "0", "memcheck": "0", "racecheck": "0", "synccheck": "0"}
    out = "\n".join(decide.decide(old + new, ok))
    assert "mpb_tc: WINS on all 2 cases -> make it the default and delete the blocked path" in out
    assert "mrl_tc: LOSES on all 1 cases -> delete it" in out   # the newest run only: d0's rows are left out
    assert "calendar_v3: MIXED (wins on 1 of 2 cases" in out
    assert out.count("tests passed, memcheck passed, racecheck passed, synccheck passed") == 3
    out = "\n".join(decide.decide(old + new, dict(ok, racecheck="1")))
    assert "mpb_tc: WINS on all 2 cases but its checks did not all pass" in out and "racecheck FAILED (exit 1)" in out
    err = dict(row("d1", "tempokern:mpb_tc", "multipos_infonce", "a", 0), metric="err_vs_torch", value="3.0")
    out = "\n".join(decide.decide(old + [err] + new, ok))   # above the 2x rule: not a default either
    assert "mpb_tc: WINS on all 2 cases but its error is 3.00x eager torch's" in out
    out = "\n".join(decide.decide(new[:4], {}))
    assert "mrl_tc: NOT MEASURED" in out and "tests not run" in out


def test_gpu_check_dry_names_every_candidate(tmp_path):
    """The check's --dry mode runs the suite's decision cases on the CUDA emulator and prints a decision for every
    candidate of the dispatch table (so the script cannot rot between GPU runs)."""
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    p = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry", str(tmp_path / "out")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for c in dispatch.CANDIDATES:
        assert re.search(rf"^{c.name}: (WINS|LOSES|MIXED)", p.stdout, re.M), (c.name, p.stdout)
    assert "tests skipped (dry run)" in p.stdout
    rows = list(csv.DictReader(open(tmp_path / "out" / "gpu.csv", newline="")))
    impls = {r["impl"] for r in rows}
    assert {"tempokern", "eager"} | {f"tempokern:{c.name}" for c in dispatch.CANDIDATES} <= impls
    assert all(r["value"] == "ok" for r in rows if r["metric"] == "status" and r["impl"].startswith("tempokern"))
    # the providers of the GPU run: torch.compile with the auto-chunker on every compiled case, Inf-CL on the
    # one-positive case (a status row where it cannot run), every row with the hash of its sources
    auto = [r for r in rows if r["impl"] == "compile_autochunk" and r["metric"] == "status"]
    assert auto and all(r["value"] == "ok" for r in auto)
    inf = [r for r in rows if r["impl"] == "inf_cl" and r["metric"] == "status"]
    assert inf and {r["case"] for r in inf} == {"no bias, one positive"}
    assert all(r["value"] == "ok" or r["value"].startswith("unsupported: Inf-CL") for r in inf)
    assert all(r["src_hash"] for r in rows if not r["op"].startswith("_"))
    plan = (tmp_path / "out" / "plan.txt").read_text()
    assert "decision" in plan and "columns tempokern" in plan
    assert (tmp_path / "out" / "decision.txt").exists()
