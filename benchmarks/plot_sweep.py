"""The CPU batch-size sweep as a log-log plot: time and peak memory per provider against B, one column per loss,
from benchmarks/results/cpu_compare.csv (the newest run of each point).

    python benchmarks/plot_sweep.py [OUT.png]     # default docs/img/cpu_sweep.png
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import perf_table  # noqa: E402

CASES = (("CTD loss, no bias", "multipos_infonce"), ("CTD loss, table bias (4097)", "multipos_infonce"),
         ("Matryoshka, dims 64..768", "matryoshka_infonce"))
PROVIDERS = ("tempokern", "eager", "compile", "compile_autochunk")


def series(rows, case, op):
    """{provider: [(B, ms, mb)]} of the sweep rows of one case."""
    xs = sorted({int(r["x_value"]) for r in rows if r["case"] == case and r["metric"] == "time_ms"})
    out = {p: [] for p in PROVIDERS}
    for x in xs:
        figs = perf_table.cpu_figures(rows, op, case, str(x))
        for p in PROVIDERS:
            f = figs.get(p)
            if f is not None and f.ms is not None:
                out[p].append((x, f.ms, f.mb))
    return out


def main(argv):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(argv[0]) if argv else perf_table.ROOT / "docs" / "img" / "cpu_sweep.png"
    rows = perf_table.load(perf_table.CPU_CSV)
    fig, axes = plt.subplots(2, len(CASES), figsize=(4.2 * len(CASES), 7), squeeze=False)
    for j, (case, op) in enumerate(CASES):
        s = series(rows, case, op)
        for p, pts in s.items():
            if not pts:
                continue
            b = [x for x, _, _ in pts]
            axes[0][j].loglog(b, [ms for _, ms, _ in pts], "o-", label=perf_table.NAMES.get(p, p), base=2)
            mem = [(x, mb) for x, _, mb in pts if mb is not None and mb > 0]
            if mem:
                axes[1][j].loglog([x for x, _ in mem], [mb for _, mb in mem], "o-", base=2)
        axes[0][j].set_title(case, fontsize=10)
        axes[0][j].set_ylabel("ms per fwd+bwd (process CPU time)")
        axes[1][j].set_ylabel("peak RSS above start, MB")
        axes[1][j].set_xlabel("B")
    axes[0][0].legend(fontsize=8)
    dev = sorted({r["device"] for r in rows})
    fig.suptitle(f"CPU sweep, float32, H 768, one thread ({'; '.join(dev)})", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
