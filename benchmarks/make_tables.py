"""Markdown tables from benchmarks/results/*.csv: the latest run of each (device, op, size),
fused vs reference side by side. `python benchmarks/make_tables.py [file.csv ...]`."""
from __future__ import annotations

import csv
import sys
from collections import OrderedDict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(paths):
    rows = []
    for p in paths:
        with open(p, newline="") as f:
            rows.extend(csv.DictReader(f))
    return rows


def table(rows) -> str:
    latest: "OrderedDict[tuple, dict]" = OrderedDict()
    for r in rows:  # later rows win: each cell shows the newest measurement
        latest[(r["device"], r["op"], r["size"], r["provider"])] = r
    groups: "OrderedDict[tuple, dict]" = OrderedDict()
    for (dev, op, size, prov), r in latest.items():
        groups.setdefault((dev, op, size), {})[prov] = r
    providers = []
    for g in groups.values():
        for p in g:
            if p not in providers:
                providers.append(p)
    head = "| device | date | op | size | " + " | ".join(f"{p} ms" for p in providers)
    head += " | speed-up vs reference | extra peak MB (" + ", ".join(providers) + ") | note |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (dev, op, size), g in groups.items():
        ms = [g[p]["ms"] if p in g else "" for p in providers]
        ref = float(g["reference"]["ms"]) if "reference" in g else None
        sp = []
        for p in providers:
            if p != "reference" and p in g and ref:
                sp.append(f"{p}: {ref / float(g[p]['ms']):.1f}x")
        mb = ", ".join(g[p].get("extra_peak_mb") or "-" if p in g else "-" for p in providers)
        date = max(r["date"] for r in g.values())
        notes = "; ".join(sorted({r["note"] for r in g.values() if r.get("note")}))
        lines.append(f"| {dev} | {date} | {op} | {size} | " + " | ".join(ms) + f" | {'; '.join(sp)} | {mb} | {notes} |")
    return "\n".join(lines)


if __name__ == "__main__":
    # the per-op CPU files (gpu.csv, the GPU suite's long-format rows, has its own tables: gpu_suite.py --md)
    # (cpu_compare.csv and ab_offset_bias.csv have their own tables too: benchmarks/perf_table.py)
    paths = [Path(a) for a in sys.argv[1:]] or sorted(
        p for p in RESULTS.glob("*.csv") if p.name not in ("gpu.csv", "cpu_compare.csv", "ab_offset_bias.csv"))
    for p in paths:  # one table per file: each op's benchmark names its own providers
        print(f"#### {p.name}\n\n{table(load([p]))}\n")
