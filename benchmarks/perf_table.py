"""The performance tables of README.md and docs/performance.md, generated from the results files:
``benchmarks/results/gpu.csv`` (benchmarks/gpu_suite.py, tools/gpu_check.sh) and ``benchmarks/results/cpu_compare.csv``
(benchmarks/cpu_compare.py).

    python benchmarks/perf_table.py                                # print the README table
    python benchmarks/perf_table.py README.md docs/performance.md  # rewrite every marked block of those files

Blocks (between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``): ``perf-table`` (README: GPU and CPU side by side),
``perf-gpu``, ``perf-cpu``, ``perf-sweep``, ``perf-ab`` (docs/performance.md), ``calendar-scalar-gpu`` (one sentence with the
``calendar_scalar`` figure, docs/calendar.md) and ``calendar-kernels-gpu`` (``calendar_context``'s kernel times,
docs/calendar.md). Figures outside these blocks are not written into the docs by hand (tests/test_perf_tables.py).

Per row: tempokern's default path against the best of the providers the field compares with (eager torch,
``torch.compile``, ``torch.compile`` with inductor's auto-chunker, Inf-CL where it applies; on ``ctd_topk``
``torch.topk(q @ g.T)`` and faiss), time and peak memory side by side. "Faster" is decided per row: within 10% of
each other is "about even" (the run-to-run spread of these measurements). Every block names the device, date and
commit of its evidence; a figure whose sources changed since it was measured (its row's ``src_hash`` differs from
the current sources' hash, benchmarks/_sources.py; rows from before that column read ``unknown``) carries a dagger:
``tools/gpu_check.sh`` re-measures those on a GPU, ``benchmarks/cpu_compare.py`` on the CPU.

Which GPU impl is "tempokern": ``tempokern`` (the default at the commit measured) or ``tempokern:<path>`` with
<path> a current CUDA default of the op in tempokern/_ops/dispatch.py.
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _markers import render_between  # noqa: E402  (beside this script)
import _sources  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GPU_CSV = ROOT / "benchmarks" / "results" / "gpu.csv"
CPU_CSV = ROOT / "benchmarks" / "results" / "cpu_compare.csv"
BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"
STALE = "†"
EVEN = 1.1   # within 10%: about even

#: GPU rows: (label, op, case, B[, path])
GPU_CASES: Tuple[tuple, ...] = (
    ("CTD loss, no bias, B = 8,192", "multipos_infonce", "no bias", "B=8192"),
    ("CTD loss, no bias, B = 65,536", "multipos_infonce", "no bias", "B=65536"),
    ("CTD loss, no bias, B = 262,144", "multipos_infonce", "no bias", "B=262144"),
    ("CTD loss, one positive, B = 65,536", "multipos_infonce", "no bias, one positive", "B=65536"),
    ("CTD loss, table bias, B = 8,192", "multipos_infonce", "table bias (4097)", "B=8192"),
    ("CTD loss, table bias, B = 65,536", "multipos_infonce", "table bias (4097)", "B=65536"),
    ("CTD loss, exact bias, B = 8,192", "multipos_infonce", "exact bias", "B=8192"),
    ("Matryoshka, dims 64..768, B = 8,192", "matryoshka_infonce", "dims 64..768", "B=8192", "levels"),
    ("Matryoshka, dims 64..768, B = 65,536", "matryoshka_infonce", "dims 64..768", "B=65536", "levels"),
    ("Re3Loss, B = 8,192", "re3_loss", "Re3Loss (nce + hard + tw)", "B=8192"),
    ("ctd_topk, Q 1,024 x N 1M, k 10", "ctd_topk", "no bias", "Q=1024 N=1000000 k=10", "select"),
    ("calendar_context, 1M rows, dim 64", "calendar_context", "fwd+bwd float32 dim 64",
     "rows=1048576 levels=12x32x12"),
    ("calendar_scalar, 1M rows", "calendar_scalar", "fwd+bwd float32", "rows=1048576 levels=12x32x12"),
)
CASES = GPU_CASES   # the name the older table script exported
GPU_OTHERS = ("eager", "compile", "compile_autochunk", "inf_cl", "eager_chunked")
CPU_OTHERS = ("eager", "compile", "compile_autochunk", "inf_cl", "torch_topk", "faiss_flat")
NAMES = {"eager": "eager", "compile": "compile", "compile_autochunk": "compile + auto-chunk", "inf_cl": "Inf-CL",
         "eager_chunked": "eager, chunked", "torch_topk": "torch.topk(q @ g.T)", "faiss_flat": "faiss flat"}

#: CPU rows: (label, cpu_compare op, case, x)
CPU_CASES: Tuple[tuple, ...] = (
    ("CTD loss, no bias, B = 2,048", "multipos_infonce", "CTD loss, no bias", "2048"),
    ("CTD loss, table bias, B = 2,048", "multipos_infonce", "CTD loss, table bias (4097)", "2048"),
    ("CTD loss, exact bias, B = 2,048", "multipos_infonce", "CTD loss, exact bias (hidden 32)", "2048"),
    ("Matryoshka, dims 64..768, B = 2,048", "matryoshka_infonce", "Matryoshka, dims 64..768", "2048"),
    ("Re3Loss, B = 4,096, D 384", "re3_loss", "Re3Loss (nce + hard + tw), D 384", "4096"),
    ("ctd_topk, Q 256 x N 100,000, k 10", "ctd_topk", "ctd_topk, no bias, N 100,000, k 10", "256"),
    ("calendar_context, 65,536 rows, dim 64", "calendar_context", "calendar_context, dim 64", "65536"),
    ("calendar_scalar, 65,536 rows", "calendar_scalar", "calendar_scalar, levels 12x32x12", "65536"),
)
#: README rows: (label, GPU row label or None, CPU row label or None)
README_ROWS: Tuple[tuple, ...] = (
    ("CTD loss, no bias (B 8,192 / 2,048)", "CTD loss, no bias, B = 8,192", "CTD loss, no bias, B = 2,048"),
    ("CTD loss, no bias, B 65,536 (GPU)", "CTD loss, no bias, B = 65,536", None),
    ("CTD loss, table bias (B 8,192 / 2,048)", "CTD loss, table bias, B = 8,192", "CTD loss, table bias, B = 2,048"),
    ("CTD loss, exact bias (B 8,192 / 2,048)", "CTD loss, exact bias, B = 8,192", "CTD loss, exact bias, B = 2,048"),
    ("Matryoshka, dims 64..768 (B 8,192 / 2,048)", "Matryoshka, dims 64..768, B = 8,192",
     "Matryoshka, dims 64..768, B = 2,048"),
    ("Re3Loss (B 8,192 / 4,096)", "Re3Loss, B = 8,192", "Re3Loss, B = 4,096, D 384"),
    ("ctd_topk (Q 1,024 x N 1M / Q 256 x N 100k)", "ctd_topk, Q 1,024 x N 1M, k 10", "ctd_topk, Q 256 x N 100,000, k 10"),
    ("calendar_context (1M / 65,536 rows)", "calendar_context, 1M rows, dim 64", "calendar_context, 65,536 rows, dim 64"),
    ("calendar_scalar (1M / 65,536 rows)", "calendar_scalar, 1M rows", "calendar_scalar, 65,536 rows"),
)

#: dispatch.py's op names -> the suite's op names
_SUITE_OP = {"multipos_infonce / CTDLoss": "multipos_infonce", "matryoshka_infonce / TMRLLoss": "matryoshka_infonce"}


def default_paths() -> Dict[str, set]:
    """suite op -> the names of its current CUDA default paths (tempokern/_ops/dispatch.py)."""
    d = _sources._dispatch()
    out: Dict[str, set] = {}
    for p in d.DEFAULTS:
        if p.device == "cuda":
            out.setdefault(_SUITE_OP.get(p.op, p.op), set()).add(p.name)
    return out


def load(path: Path = GPU_CSV) -> List[dict]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


# ---- figures ---------------------------------------------------------------------------------------------------

class Fig:
    """One provider's figure on one row: time (p50, and p20 / p80 where known), peak memory, its evidence."""

    def __init__(self, ms=None, mb=None, status="", row=None, p20=None, p80=None, stale=False):
        self.ms, self.mb, self.status, self.row, self.p20, self.p80, self.stale = ms, mb, status, row, p20, p80, stale


def _f(v) -> Optional[float]:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if x != x else x


def _newest_gpu(rows: List[dict], op: str, case: str, B: str, impls) -> Fig:
    hit = [r for r in rows if r["op"] == op and r["case"] == case and r["B"] == B and r["impl"] in impls]
    timed = [r for r in hit if r["metric"] == "time_ms" and _f(r["value"]) is not None]
    st = [r for r in hit if r["metric"] == "status"]
    newest_t = max((r["date"] for r in timed), default="")
    newest_s = max((r["date"] for r in st if r["value"] != "ok"), default="")
    if newest_s > newest_t:   # the newest run of this column did not time it
        r = max((r for r in st if r["date"] == newest_s), key=lambda r: r["value"])
        v = r["value"]
        return Fig(status="out of memory" if "memory" in v else v.split(":")[0], row=r)
    if not timed:
        return Fig(status="—")
    same = sorted((r for r in timed if r["date"] == newest_t), key=lambda r: float(r["value"]))
    r = same[-1]   # one row, or the slowest of a run's columns that timed this path (the conservative figure)
    mb = next((_f(x["value"]) for x in hit if x["date"] == r["date"] and x["impl"] == r["impl"]
               and x["metric"] == "extra_peak_mb"), None)
    stale = _sources.is_stale(r.get("src_hash", ""), op, "cuda",
                              "tempokern" if r["impl"].startswith("tempokern") else r["impl"])
    return Fig(ms=float(r["value"]), mb=mb, row=r, stale=stale)


def gpu_figures(rows: List[dict], op: str, case: str, B: str, path: Sequence[str]) -> Dict[str, Fig]:
    paths = default_paths()
    names = list(path) or sorted(paths.get(op, ()))
    assert all(p in paths.get(op, ()) for p in path), (op, path, paths.get(op))
    mine = {"tempokern"} | {f"tempokern:{p}" for p in names}
    out = {"tempokern": _newest_gpu(rows, op, case, B, mine)}
    for o in GPU_OTHERS:
        out[o] = _newest_gpu(rows, op, case, B, {o})
    if out["tempokern"].ms is None and out["tempokern"].status == "—":
        # other columns timed, the default path not: it was never run as one step (a pair of kernels measured apart)
        others = any(f.ms is not None for k, f in out.items() if k != "tempokern")
        out["tempokern"].status = "not timed as a whole" if others else "not measured yet"
    return out


def cpu_figures(rows: List[dict], op: str, case: str, x: str) -> Dict[str, Fig]:
    hit = [r for r in rows if r["op"] == op and r["case"] == case and r["x_value"] == x]
    newest = max((r["date"] for r in hit), default="")
    out: Dict[str, Fig] = {}
    for prov in ("tempokern",) + CPU_OTHERS:
        rs = [r for r in hit if r["provider"] == prov and r["date"] == newest]
        # the process CPU time of the call where recorded (on a shared machine the time other jobs held the core is
        # not in it), else the wall time
        t = next((r for r in rs if r["metric"] == "cpu_time_ms"), None) or next(
            (r for r in rs if r["metric"] == "time_ms"), None)
        m = next((r for r in rs if r["metric"] == "extra_peak_mb"), None)
        s = next((r for r in rs if r["metric"] == "status"), None)
        if t is not None:
            out[prov] = Fig(ms=_f(t["p50"]), mb=_f(m["p50"]) if m else None, row=t, p20=_f(t["p20"]),
                            p80=_f(t["p80"]), stale=_sources.is_stale(t.get("src_hash", ""), op, "cpu", prov))
        elif s is not None:
            out[prov] = Fig(status=s["note"].split(";")[0], row=s)
    return out


def best_other(figs: Dict[str, Fig], others: Sequence[str]) -> Tuple[Optional[str], Optional[Fig]]:
    timed = [(f.ms, o) for o in others if (f := figs.get(o)) is not None and f.ms is not None]
    if not timed:
        return None, None
    o = min(timed)[1]
    return o, figs[o]


def verdict(t: Fig, o: Optional[Fig], oname: Optional[str], others_oom: bool) -> str:
    if t.ms is None:
        return "—"
    if o is None:
        return "tempokern (the others run out of memory)" if others_oom else "—"
    if max(t.ms, o.ms) <= EVEN * min(t.ms, o.ms):
        return "about even"
    return "tempokern" if t.ms < o.ms else NAMES.get(oname, oname)


def _ms(ms: float) -> str:
    if ms >= 1000:
        return f"{ms / 1e3:.2f} s"
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms"


def _mb(mb: Optional[float]) -> str:
    if mb is None:
        return ""
    return f"{mb / 1024:.2f} GB" if mb >= 1024 else f"{mb:.0f} MB" if mb >= 1 else "< 1 MB"


def cell(f: Optional[Fig], name: str = "") -> str:
    if f is None:
        return "—"
    if f.ms is None:
        st = f.status or "—"
        if st.startswith("error:") and " / " in st:   # the exception's own message, not the wrapper's first line
            st = "error: " + st.split(" / ")[1]
        return st if len(st) <= 60 else st[:57].rstrip() + "..."
    s = _ms(f.ms) + (f", {_mb(f.mb)}" if f.mb is not None else "") + (STALE if f.stale else "")
    return s + (f" ({name})" if name else "")


def _short(commit: str) -> str:
    c = commit or "unknown"
    return c[:7] + ("+dirty" if c.endswith("+dirty") else "") if c != "unknown" else c


def evidence(figs: List[Fig]) -> str:
    """'<device>, <date>, commit <c>' of the rows behind the figures (each distinct run once)."""
    runs = sorted({(f.row["device"], f.row["date"][:10], _short(f.row.get("commit", ""))) for f in figs
                   if f is not None and f.row is not None and f.ms is not None})
    return "; ".join(f"{d}, {dt}, commit {c}" for d, dt, c in runs) or "no measurement yet"


# ---- tables ----------------------------------------------------------------------------------------------------

def _gpu_row(rows, label, op, case, B, *path):
    figs = gpu_figures(rows, op, case, B, path)
    t = figs["tempokern"]
    oname, o = best_other(figs, GPU_OTHERS)
    oom = any(figs[x].status == "out of memory" for x in GPU_OTHERS)
    return figs, t, oname, o, oom


def gpu_table(rows: List[dict]) -> str:
    out = ["| case | tempokern (default path) | eager | `torch.compile` | compile + auto-chunk | Inf-CL | faster "
           "| tempokern's evidence: date, commit, sources |", "|---|---|---|---|---|---|---|---|"]
    used: List[Fig] = []
    for label, op, case, B, *path in GPU_CASES:
        figs, t, oname, o, oom = _gpu_row(rows, label, op, case, B, *path)
        used += [f for f in figs.values()]
        eager = figs["eager"] if figs["eager"].ms is not None or not figs["eager_chunked"].ms else figs["eager_chunked"]
        ev = "—"
        if t.row is not None and t.ms is not None:
            h = t.row.get("src_hash") or _sources.UNKNOWN
            ev = (f"{t.row['date'][:10]}, {_short(t.row.get('commit', ''))}, "
                  + ("unknown (before src_hash)" if h == _sources.UNKNOWN else
                     f"{h}, changed since" if t.stale else f"{h}, current"))
        out.append(f"| {label} | {cell(t)} | {cell(eager)} | {cell(figs['compile'])} | "
                   f"{cell(figs['compile_autochunk'])} | {cell(figs['inf_cl'])} | {verdict(t, o, oname, oom)} | {ev} |")
    head = (f"fwd+bwd per step, time and peak memory above the inputs (`benchmarks/results/gpu.csv`, newest run per "
            f"column; generated by `benchmarks/perf_table.py`). Evidence: {evidence(used)}. {STALE}: measured on "
            "sources that changed since, or before rows named their sources (`tools/gpu_check.sh` re-measures "
            "them). A dash: not measured in any run.")
    return head + "\n\n" + "\n".join(out)


def cpu_table(rows: List[dict]) -> str:
    out = ["| case | tempokern | eager | `torch.compile` | compile + auto-chunk | other | best other / tempokern "
           "(p20-p80 range) | faster |", "|---|---|---|---|---|---|---|---|"]
    used: List[Fig] = []
    for label, op, case, x in CPU_CASES:
        figs = cpu_figures(rows, op, case, x)
        used += list(figs.values())
        t = figs.get("tempokern", Fig(status="—"))
        oname, o = best_other(figs, CPU_OTHERS)
        extra = [cell(figs[k], NAMES[k]) for k in ("torch_topk", "faiss_flat") if k in figs]
        if "inf_cl" in figs and figs["inf_cl"].ms is None:
            extra.append("Inf-CL: GPU only")
        ratio = "—"
        if t.ms and o is not None and o.ms:
            lo = (o.p20 or o.ms) / (t.p80 or t.ms)
            hi = (o.p80 or o.ms) / (t.p20 or t.ms)
            ratio = f"{o.ms / t.ms:.2f}x ({lo:.2f}-{hi:.2f})"
        out.append(f"| {label} | {cell(t)} | {cell(figs.get('eager'))} | {cell(figs.get('compile'))} | "
                   f"{cell(figs.get('compile_autochunk'))} | {'; '.join(extra) or '—'} | {ratio} | "
                   f"{verdict(t, o, oname, False)} |")
    head = (f"fwd+bwd per step (ctd_topk: one search), float32, one thread, p50 of interleaved rounds of the call's "
            f"process CPU time (wall time in rows measured before that metric), peak RSS above the call's start (`benchmarks/results/cpu_compare.csv`, `benchmarks/cpu_compare.py`; generated by "
            f"`benchmarks/perf_table.py`). Evidence: {evidence(used)}. {STALE}: sources changed since.")
    return head + "\n\n" + "\n".join(out)


def _readme_cell(t: Optional[Fig], oname, o: Optional[Fig], oom: bool) -> Tuple[str, str]:
    if t is None:
        return "—", "—"
    v = verdict(t, o, oname, oom)
    tc = cell(t)
    oc = cell(o, NAMES.get(oname, oname)) if o is not None else ("out of memory" if oom else "—")
    if v == "tempokern" or v.startswith("tempokern"):
        tc = f"**{tc}**"
    elif v not in ("about even", "—"):
        oc = f"**{oc}**"
    elif v == "about even":
        tc += " ≈"
    return tc, oc


def table(rows: List[dict], cpu_rows: Optional[List[dict]] = None) -> str:
    """The README table: GPU and CPU side by side, tempokern against the best other provider of each row."""
    cpu_rows = load(CPU_CSV) if cpu_rows is None else cpu_rows
    gpu = {c[0]: c for c in GPU_CASES}
    cpu = {c[0]: c for c in CPU_CASES}
    out = ["| case (GPU / CPU size) | GPU: tempokern | GPU: best other | CPU: tempokern | CPU: best other |",
           "|---|---|---|---|---|"]
    used_g: List[Fig] = []
    used_c: List[Fig] = []
    for label, g, c in README_ROWS:
        cells = []
        if g:
            figs, t, oname, o, oom = _gpu_row(rows, *gpu[g])
            used_g += [t, o] if o else [t]
            cells += list(_readme_cell(t, oname, o, oom))
        else:
            cells += ["—", "—"]
        if c:
            _, op, case, x = cpu[c]
            figs = cpu_figures(cpu_rows, op, case, x)
            t = figs.get("tempokern")
            oname, o = best_other(figs, CPU_OTHERS)
            used_c += [f for f in (t, o) if f is not None]
            cells += list(_readme_cell(t, oname, o, False))
        else:
            cells += ["—", "—"]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    head = (f"fwd+bwd per step, time and peak memory above the inputs; best other: the fastest of eager torch, "
            f"`torch.compile`, `torch.compile` with inductor's auto-chunker and Inf-CL where it applies; bold: faster "
            f"by more than 10%, ≈: within 10%. GPU: {evidence(used_g)}, bf16, H 768. CPU: {evidence(used_c)}, float32, "
            f"H 768, one thread, process CPU time. {STALE}: sources changed since. Generated by `benchmarks/perf_table.py` from "
            "`benchmarks/results/`; all rows and the batch-size sweep: `docs/performance.md`.")
    return head + "\n\n" + "\n".join(out)


def sweep_table(rows: List[dict]) -> str:
    cases = [("CTD loss, no bias", "multipos_infonce"), ("CTD loss, table bias (4097)", "multipos_infonce"),
             ("Matryoshka, dims 64..768", "matryoshka_infonce")]
    provs = ("tempokern", "eager", "compile", "compile_autochunk")
    out = ["| case | B | " + " | ".join(NAMES.get(p, p) for p in provs) + " |", "|---|---|" + "---|" * len(provs)]
    used: List[Fig] = []
    for case, op in cases:
        xs = sorted({int(r["x_value"]) for r in rows if r["case"] == case and r["metric"] == "time_ms"
                     and r["provider"] == "tempokern"})
        for x in xs:
            figs = cpu_figures(rows, op, case, str(x))
            used += list(figs.values())
            out.append(f"| {case} | {x:,} | " + " | ".join(cell(figs.get(p)) for p in provs) + " |")
    head = (f"CPU, float32, H 768, one thread; process CPU time (wall time in rows measured before that metric) "
            f"and peak RSS above the call's start per B "
            f"(`benchmarks/results/cpu_compare.csv`; generated by `benchmarks/perf_table.py`, the plot by "
            f"`benchmarks/plot_sweep.py`). Evidence: {evidence(used)}.")
    return head + "\n\n" + "\n".join(out)


def calendar_scalar_sentence(rows: List[dict]) -> str:
    figs = gpu_figures(rows, "calendar_scalar", "fwd+bwd float32", "rows=1048576 levels=12x32x12", ())
    t = figs["tempokern"]
    if t.ms is None:
        return "`calendar_scalar` (1M rows, float32, fwd+bwd) has no GPU measurement yet."
    return (f"`calendar_scalar`, 1M rows, float32, fwd+bwd on {t.row['device']}: {cell(t)} for the default (v1), "
            f"eager {cell(figs['eager'])}, `torch.compile` {cell(figs['compile'])} (`benchmarks/results/gpu.csv`, "
            f"{t.row['date'][:10]}, commit {_short(t.row.get('commit', ''))}; generated by "
            f"`benchmarks/perf_table.py`{'; ' + STALE + ': sources changed since' if t.stale else ''}).")


#: calendar_context's kernel timings (metric kernel_ms): (label, case, [(impl, name)])
_CALENDAR_KERNELS = (
    ("forward", "fwd kernel float32 dim 64", (("tempokern:v2", "v2 (the default)"), ("deleted:v1", "thread-per-row v1"))),
    ("backward", "bwd kernel float32 dim 64", (("tempokern:v1", "v1 (the default)"),
                                               ("deleted:v2", "warp-cooperative v2"))),
)


def calendar_kernels_sentence(rows: List[dict]) -> str:
    """calendar_context's per-kernel times at 1M rows (the rows that chose its default kernels), one sentence."""
    parts, used = [], []
    for label, case, impls in _CALENDAR_KERNELS:
        figs = []
        for impl, name in impls:
            hit = [r for r in rows if r["op"] == "calendar_context" and r["case"] == case and r["impl"] == impl
                   and r["metric"] == "kernel_ms" and _f(r["value"]) is not None]
            if hit:
                r = max(hit, key=lambda r: r["date"])
                used.append(r)
                stale = _sources.is_stale(r.get("src_hash", ""), "calendar_context", "cuda", "tempokern")
                figs.append(f"{name} {_ms(float(r['value']))}{STALE if stale else ''}")
        if figs:
            parts.append(f"{label} " + " against ".join(figs))
    if not parts:
        return "`calendar_context`'s kernels (1M rows, dim 64) have no kernel timing yet."
    runs = sorted({(r["device"], r["date"][:10], _short(r.get("commit", ""))) for r in used})
    ev = "; ".join(f"{d}, {dt}, commit {c}" for d, dt, c in runs)
    return (f"`calendar_context` kernel times, 1M rows, levels 12x32x12, float32, dim 64: {'; '.join(parts)} "
            f"(`benchmarks/results/gpu.csv`, metric `kernel_ms`; {ev}; generated by `benchmarks/perf_table.py`"
            f"{'; ' + STALE + ': sources changed since, or measured before rows named their sources' if STALE in ''.join(parts) else ''}).")


AB_CSV = ROOT / "benchmarks" / "results" / "ab_offset_bias.csv"
_AB_CASES = {"ctd_exact": "CTD loss with the exact bias, B = 2,048, H 768, hidden 32 (fwd+bwd)",
             "offset_bias": "offset_bias alone, 2,048 x 2,048, hidden 32 (fwd+bwd)"}


def ab_table(rows: List[dict]) -> str:
    """benchmarks/ab_commits.py's rounds: per case and thread count the new/old ratio of each round (wall time, and
    process CPU time where recorded), its median and range, and what that says."""
    import statistics
    groups: Dict[tuple, Dict[int, Dict[str, dict]]] = {}
    commits: Dict[str, set] = {"old": set(), "new": set()}
    last: Dict[tuple, dict] = {}
    for r in rows:   # a round is two consecutive rows of one case and thread count with the same round number
        key = (r["case"], r["threads"])
        g = groups.setdefault(key, {})
        prev = last.get(key)
        if prev is not None and prev["round"] == r["round"] and prev["tree"] != r["tree"]:
            g[len(g)] = {prev["tree"]: prev, r["tree"]: r}
            last.pop(key)
        else:
            last[key] = r
        commits[r["tree"]].add(r["commit"])
    out = ["| case | threads | rounds | new / old, wall (median, range) | new / old, process CPU time | verdict |",
           "|---|---|---|---|---|---|"]
    for (case, th), rounds in sorted(groups.items()):
        pairs = [v for v in rounds.values() if "old" in v and "new" in v]
        if not pairs:
            continue
        w = [float(v["new"]["ms"]) / float(v["old"]["ms"]) for v in pairs]
        c = [float(v["new"]["cpu_ms"]) / float(v["old"]["cpu_ms"]) for v in pairs
             if v["new"].get("cpu_ms") and v["old"].get("cpu_ms")]
        fig = c or w
        med = statistics.median(fig)
        if min(fig) > 1.0 and med > 1.05:
            v = "new slower"
        elif max(fig) < 1.0 and med < 0.95:
            v = "new faster"
        else:
            v = "no difference beyond the spread"
        cc = f"{statistics.median(c):.3f} ({min(c):.3f}-{max(c):.3f})" if c else "not recorded"
        out.append(f"| {_AB_CASES.get(case, case)} | {th} | {len(pairs)} | {statistics.median(w):.3f} "
                   f"({min(w):.3f}-{max(w):.3f}) | {cc} | {v} |")
    if len(out) == 2:
        return "No A/B rounds recorded."
    dates = sorted({r["date"][:10] for r in rows})
    head = (f"`python benchmarks/ab_commits.py OLD_TREE NEW_TREE --case CASE` (`benchmarks/results/ab_offset_bias.csv`; "
            f"generated by `benchmarks/perf_table.py`): old = commit {', '.join(sorted(commits['old']))}, new = commit "
            f"{', '.join(sorted(commits['new']))}, each built with `tools/dev_build.sh` (CPU) in its own checkout; "
            f"per round one fresh process per build, alternating which runs first, float32, the fastest of the "
            f"process's steps; {', '.join(dates)}, on a shared 2-core machine (the CPU-time ratio decides where "
            f"recorded: it does not count the time other jobs held the core). The verdict: slower or faster when "
            f"every round agrees and the median is more than 5% off.")
    return head + "\n\n" + "\n".join(out)


def blocks(gpu_rows: Optional[List[dict]] = None, cpu_rows: Optional[List[dict]] = None) -> Dict[str, str]:
    g = load(GPU_CSV) if gpu_rows is None else gpu_rows
    c = load(CPU_CSV) if cpu_rows is None else cpu_rows
    return {"perf-table": table(g, c), "perf-gpu": gpu_table(g), "perf-cpu": cpu_table(c),
            "perf-sweep": sweep_table(c), "calendar-scalar-gpu": calendar_scalar_sentence(g),
            "calendar-kernels-gpu": calendar_kernels_sentence(g),
            "perf-ab": ab_table(load(AB_CSV))}


def render_into(text: str, tbl: str) -> str:
    """The README block (kept for the README test)."""
    return render_between(text, tbl, BEGIN, END)


def render_all(text: str, made: Dict[str, str]) -> str:
    """``text`` with every block it has markers for rewritten; a ValueError when it has none."""
    found = False
    for name, tbl in made.items():
        b, e = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if b in text and e in text:
            text = render_between(text, tbl, b, e)
            found = True
    if not found:
        raise ValueError(f"no performance block markers ({', '.join(made)}) found")
    return text


#: the files whose blocks are generated here
FILES = ("README.md", "docs/performance.md", "docs/calendar.md")


def main(argv: List[str]) -> int:
    made = blocks()
    if not argv:
        print(made["perf-table"])
        return 0
    for p in argv:
        path = Path(p)
        text = path.read_text(encoding="utf-8")
        new = render_all(text, made)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"updated {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
