#!/usr/bin/env python
"""A/B of two builds of tempokern on the CPU: each round runs one fresh process per tree, alternating which goes
first, and each process times the same steps on the same inputs; the ratio of the two trees' times per round is
the figure (load that shifts between rounds falls on both alike). Each process reports its fastest step's wall time
and that step's process CPU time (what stays meaningful when other jobs share the cores, with one thread).

    python benchmarks/ab_commits.py OLD_TREE NEW_TREE [--case ctd_exact|offset_bias] [--rounds 6] [--threads 2]

A tree is a checkout with its in-place build (tools/dev_build.sh: tempokern/_C*.so); e.g. an older commit in a
``git worktree``. Prints per round the two times and their ratio, then the median and range of the ratios, and with
``--csv`` appends them to a CSV (one row per tree and round).
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import sys, time, json
sys.path.insert(0, TREE)
import torch
torch.set_num_threads(THREADS)
import tempokern
assert tempokern.__file__.startswith(TREE), tempokern.__file__
B, H, HID, D = 2048, 768, 32, 32
g = torch.Generator().manual_seed(0)
q = torch.nn.functional.normalize(torch.randn(B, H, generator=g), dim=1).requires_grad_()
d = torch.nn.functional.normalize(torch.randn(B, H, generator=g), dim=1).requires_grad_()
qs = torch.randint(0, 2000, (B,), generator=g); ds = torch.randint(0, 2000, (B,), generator=g)
spans = ((qs, qs + torch.randint(0, 30, (B,), generator=g)), (ds, ds + torch.randint(0, 30, (B,), generator=g)))
bias = (torch.rand(B, generator=g).requires_grad_(), torch.rand(B, generator=g).requires_grad_(),
        (0.3 * torch.randn(HID, D, generator=g)).requires_grad_(), torch.randn(HID, generator=g).requires_grad_(),
        (0.2 * torch.randn(1, HID, generator=g)).requires_grad_(), torch.zeros(1).requires_grad_(),
        torch.tensor(0.5).requires_grad_())
if CASE == "ctd_exact":
    leaves = [q, d, *bias]
    f = lambda: torch.autograd.grad(tempokern.multipos_infonce(q, d, *spans, temperature=0.05, bias=bias), leaves)
else:
    gout = torch.randn(B, B, generator=g)
    f = lambda: torch.autograd.grad(tempokern.offset_bias(*bias), list(bias), gout)
f()
ts, cs = [], []
for _ in range(STEPS):
    t, c = time.perf_counter(), time.process_time()
    f()
    ts.append((time.perf_counter() - t) * 1e3)
    cs.append((time.process_time() - c) * 1e3)
print("RESULT " + json.dumps({"min": min(ts), "all": ts, "cpu_min": min(cs)}))
"""


def run(tree: str, case: str, threads: int, steps: int) -> dict:
    code = (CHILD.replace("TREE", repr(os.path.abspath(tree))).replace("THREADS", str(threads))
            .replace("CASE", repr(case)).replace("STEPS", str(steps)))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONSAFEPATH="1")
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


def git_commit(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--case", default="ctd_exact", choices=["ctd_exact", "offset_bias"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per process (the minimum is its time)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args(argv)
    trees = {"old": a.old, "new": a.new}
    commits = {k: git_commit(v) for k, v in trees.items()}
    ratios, cratios, rows = [], [], []
    for r in range(a.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        res = {k: run(trees[k], a.case, a.threads, a.steps) for k in order}
        ratio = res["new"]["min"] / res["old"]["min"]
        cratio = res["new"]["cpu_min"] / res["old"]["cpu_min"]
        ratios.append(ratio)
        cratios.append(cratio)
        load = os.getloadavg()[0]
        print(f"round {r}: old ({commits['old']}) {res['old']['min']:.1f} ms (cpu {res['old']['cpu_min']:.1f}), new "
              f"({commits['new']}) {res['new']['min']:.1f} ms (cpu {res['new']['cpu_min']:.1f}), new/old wall "
              f"{ratio:.3f}, cpu {cratio:.3f} (load {load:.1f})", flush=True)
        for k in order:
            rows.append({"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "case": a.case,
                         "tree": k, "commit": commits[k], "round": r, "ms": f"{res[k]['min']:.2f}",
                         "cpu_ms": f"{res[k]['cpu_min']:.2f}",
                         "threads": a.threads, "load": f"{load:.1f}"})
    print(f"{a.case}: new/old wall median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}; "
          f"process CPU time median {statistics.median(cratios):.3f}, range {min(cratios):.3f}-{max(cratios):.3f} "
          f"over {len(ratios)} rounds")
    if a.csv:   # earlier rows keep their values; a column they lack stays empty
        old = []
        if os.path.exists(a.csv):
            with open(a.csv, newline="") as f:
                old = list(csv.DictReader(f))
        fields = list(dict.fromkeys([k for r in old for k in r] + list(rows[0])))
        tmp = a.csv + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, restval="")
            w.writeheader()
            w.writerows(old + rows)
        os.replace(tmp, a.csv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
