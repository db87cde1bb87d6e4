"""results.json, results.md and plots of the English suite, from the saved units."""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from .metrics import METRICS, paired_bootstrap_ci, summarize
from .._util import atomic_write, fsync_path

__all__ = ["build_results", "write_report", "markdown", "PAIRED_BASELINE", "SECOND_BASELINES", "PAIRED_METRICS",
           "TABLE_METRICS"]

#: the row every method is compared with (paired bootstrap over queries)
PAIRED_BASELINE = "minilm_ft"
#: further baselines every row is compared with where the run has them (``res["paired_vs"][baseline]``): LoRA
#: fine-tuning, TMRL's strong baseline (the same LoRA parameterisation without the temporal terms)
SECOND_BASELINES = ("lora",)
PAIRED_METRICS = ("R@1", "MRR@10", "nDCG@10", "time_swap")
TABLE_METRICS = ("R@1", "R@5", "MRR@10", "nDCG@10", "recall@100", "TP@10", "TR@10", "time_swap")
ERR_METRICS = ("err_time", "err_entity", "err_attribute", "err_other")
SPLIT_TEXT = {
    "test_template": "held-out query/document phrasings (templates never seen in training)",
    "test_date": "unseen dates within the training years",
    "test_year": "an unseen year",
    "test_masked": "documents with masked / relative dates resolved through the publication date",
    "timeless": "queries without a time (semantic retention: every document of the entity/attribute is relevant)",
    "dev": "held-out pages (never trained on), each query ranked over the held-out pages' paragraphs",
    "test": "the second held-out pages, each query ranked over their paragraphs",
    "dev@corpus": "the dev questions ranked over the whole corpus (every packaged TimeQA paragraph, every page of "
                  "every split)",
    "test@corpus": "the test questions ranked over the whole corpus (every packaged TimeQA paragraph)",
}


def _arr(vals) -> np.ndarray:
    return np.asarray([math.nan if v is None else v for v in vals], dtype=np.float64)


def _nanmean(x) -> Optional[float]:
    x = np.asarray(x, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else None


def build_results(units: Dict[Tuple[str, str, int], dict], status: Dict[str, dict], setup: dict, *,
                  n_resamples: int = 1000) -> dict:
    """Aggregate the units: per (set, split, method) each metric's mean over seeds, each seed's mean
    and the 95% bootstrap interval over queries (per-query values averaged over seeds first); the
    paired interval of (method - minilm_ft) on the same queries (``paired``) and of (method - each of
    SECOND_BASELINES) where the run has it (``paired_vs[baseline]``); per-dim metrics; the retention
    Spearman; extra per-method metrics; and the per-query arrays (so any interval can be recomputed)."""
    from .prior import prior_baseline
    res: dict = {"setup": setup, "methods": status, "results": {}, "paired": {}, "paired_vs": {}, "dims": {},
                 "per_query": {}}
    sets = sorted({k[1] for k in units})
    for s in sets:
        names = [m for m in status if any(k[0] == m and k[1] == s for k in units)]
        splits = sorted({sp for k, u in units.items() if k[1] == s for sp in u["splits"]})
        res["results"][s], res["paired"][s], res["dims"][s], res["per_query"][s] = {}, {}, {}, {}
        for sp in splits:
            table, pq, per_seed = {}, {"qids": None}, {}
            for name in names:
                seeds = sorted(k[2] for k in units if k[0] == name and k[1] == s and sp in units[k]["splits"])
                if not seeds:
                    continue
                arrs = []
                for seed in seeds:
                    u = units[(name, s, seed)]["splits"][sp]
                    if pq["qids"] is None:
                        pq["qids"] = u["qids"]
                    elif u["qids"] != pq["qids"]:
                        raise ValueError(f"{name} set {s} split {sp}: the queries differ from the other methods'")
                    arrs.append({m: _arr(u[m]) for m in METRICS if m in u})
                row = summarize(arrs, n_resamples=n_resamples)
                row["seeds_run"] = seeds
                ret = [units[(name, s, seed)].get("retention_spearman") for seed in seeds]
                ret = [r for r in ret if r is not None]
                row["retention_spearman"] = {"mean": float(np.mean(ret)), "seeds": ret} if ret else None
                extra = [units[(name, s, seed)].get("extra_metrics", {}).get(sp) for seed in seeds]
                extra = [e for e in extra if e]
                if extra:
                    row["extra"] = {k: float(np.mean([e[k] for e in extra if k in e])) for k in extra[0]}
                table[name] = row
                per_seed[name] = dict(zip(seeds, arrs))
                pq[name] = {str(seed): {m: a[m].tolist() for m in a} for seed, a in zip(seeds, arrs)}
                # per-dim curves
                dims = sorted({int(d) for seed in seeds for d in (units[(name, s, seed)].get("dims") or {})})
                if dims:
                    dd = {}
                    for d in dims:
                        darrs = [{m: _arr(units[(name, s, seed)]["dims"][str(d)][sp][m]) for m in METRICS
                                  if m in units[(name, s, seed)]["dims"][str(d)][sp]}
                                 for seed in seeds if str(d) in (units[(name, s, seed)].get("dims") or {})]
                        dd[str(d)] = summarize(darrs, n_resamples=n_resamples)
                    res["dims"][s].setdefault(sp, {})[name] = dd
            res["results"][s][sp] = table
            res["per_query"][s][sp] = pq
            if PAIRED_BASELINE in per_seed:
                res["paired"][s][sp] = _paired(per_seed, status, PAIRED_BASELINE, n_resamples)
            pb = prior_baseline(units, s)
            if pb is not None:
                res.setdefault("prior_baseline", {})[s] = pb
            for bl in SECOND_BASELINES + ((pb,) if pb is not None else ()):
                if bl in per_seed:
                    res["paired_vs"].setdefault(bl, {}).setdefault(s, {})[sp] = _paired(per_seed, status, bl,
                                                                                         n_resamples)
    return _clean(res)


def _paired(per_seed: dict, status: dict, baseline: str, n_resamples: int) -> dict:
    """``{row: {metric: {"delta", "ci", "seeds"}}}``: the paired bootstrap of (row - baseline) for every other row."""
    pr = {}
    for name in per_seed:
        if name == baseline:
            continue
        a, base, common = _paired_means(per_seed[name], per_seed[baseline], (status.get(name) or {}).get("seeded", True),
                                        (status.get(baseline) or {}).get("seeded", True))
        pr[name] = {}
        for m in PAIRED_METRICS:
            if m in a and m in base:
                d, lo, hi = paired_bootstrap_ci(a[m], base[m], n_resamples)
                pr[name][m] = {"delta": d, "ci": [lo, hi], "seeds": common}
    return pr


def _seed_mean(arrs: list) -> dict:
    with warnings.catch_warnings():   # a query undefined in every seed stays NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        return {m: np.nanmean(np.vstack([a[m] for a in arrs]), axis=0) if len(arrs) > 1 else arrs[0][m]
                for m in arrs[0]}


def _paired_means(row: dict, base: dict, seeded: bool, base_seeded: bool = True):
    """Per-query means of a row and of the baseline for their paired difference: a seeded row against a
    seeded baseline on the seeds both have (a run stopped part-way compares like with like), an unseeded row
    (BM25, zero-shot) against every seed of the baseline and any row against every seed of an unseeded
    baseline (the zero-shot prior row). Returns (row means, baseline means, the baseline's seeds)."""
    common = sorted(set(row) & set(base)) if seeded and base_seeded else []
    if common:
        return _seed_mean([row[k] for k in common]), _seed_mean([base[k] for k in common]), common
    return _seed_mean(list(row.values())), _seed_mean(list(base.values())), sorted(base)


def _clean(x):
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        x = x.item()
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x


def _f(v, nd=3) -> str:
    return "n/a" if v is None else f"{v:.{nd}f}"


def _ci(cell) -> str:
    if not cell or cell.get("mean") is None:
        return "n/a"
    lo, hi = cell["ci"]
    return f"{cell['mean']:.3f} [{_f(lo)}, {_f(hi)}]"


def _wall(status: dict, name: str, s: str) -> Optional[float]:
    w = [v for k, v in (status.get(name, {}).get("wall_seconds") or {}).items() if k.startswith(f"{s}/") and v]
    return float(np.mean(w)) if w else None


def _steps(status: dict, name: str, s: str) -> str:
    """The training steps of a row's units on set ``s`` (one number when every seed took the same)."""
    v = sorted({i.get("steps") for k, i in (status.get(name, {}).get("info") or {}).items()
                if k.startswith(f"{s}/") and isinstance(i, dict) and i.get("steps") is not None})
    if not v and name.endswith("+prior") and name[:-len("+prior")] in status:   # a prior row: its base's steps
        return _steps(status, name[:-len("+prior")], s)
    return "0" if not v and name in ZERO_STEP else "/".join(str(x) for x in v) if v else "n/a"


#: rows that train nothing
ZERO_STEP = ("bm25_ties_gold", "bm25_ties_last", "minilm_zeroshot")


def markdown(res: dict) -> str:
    st = res["setup"]
    b = st["budget"]
    what = f"--data {st['data_dir']}" if st.get("data_dir") else f"--suite {st.get('suite', 'english')}"
    hn = b.get("hard_negatives")
    lines = [f"# tempokern benchmark {what}{' --quick' if st['quick'] else ''}", "",
             f"Date {st['date']}; machine: {st['machine']}; device {st['device']}; total {st.get('seconds', '?')} s; "
             f"1-minute load average {st.get('load_average_1min')}.",
             f"Command: `{st.get('command') or 'n/a'}`.", "",
             f"Backbone `{st['backbone']}` for every dense row. Seeds {st['seeds']} (methods that ignore the seed "
             f"run once). Training budget shared by every trained row: at most "
             f"{b['max_train_rows'] or 'all'} training rows, {b['epochs']} epoch(s), batch {b['batch_size']}, "
             f"lr {b['lr']}, max_length {b['max_length']} tokens"
             + (f", {hn} hard negative(s) per row (the same for every trained row)" if hn is not None else "")
             + ". The `steps` column gives each row's optimiser steps (the Re³ rows train only their time modules, "
               "on cached frozen-backbone vectors, so their steps are cheap and not comparable).",
             "Intervals: 95% percentile bootstrap over queries (per-query values averaged over seeds first), "
             f"{st['bootstrap_resamples']} resamples; Δ columns: paired bootstrap of (row - `{PAIRED_BASELINE}`) "
             "on the same queries, both averaged over the seeds they share.", ""]
    for s, info in st.get("set_info", {}).items():
        gal = info.get("gallery", info["records"])
        lines.append(f"Set {s}: {info['records']} documents ({gal} in the ranked gallery), queries per split "
                     f"{info['queries']}, {info['train_rows']} training rows available.")
    lines.append("")
    for s, splits in res["results"].items():
        lines.append(f"## Set {s}")
        lines.append("")
        for sp, table in splits.items():
            if not table:
                continue
            n = next(iter(table.values()))["R@1"]["n"]
            lines += [f"### {sp} ({n} queries): {SPLIT_TEXT.get(sp, '')}", ""]
            hdr = ["method"] + list(TABLE_METRICS) + ["top-1 wrong: time / entity / attribute / other",
                                                        "retention ρ", "steps", "s / unit"]
            lines.append("| " + " | ".join(hdr) + " |")
            lines.append("|" + "---|" * len(hdr))
            for name, row in table.items():
                cells = [f"`{name}`"]
                for m in TABLE_METRICS:
                    c = row.get(m)
                    cells.append(_ci(c) if m in ("R@1", "MRR@10", "nDCG@10") else _f(c["mean"] if c else None))
                cells.append(" / ".join(_f(row[m]["mean"], 2) if row.get(m) else "n/a" for m in ERR_METRICS))
                r = row.get("retention_spearman")
                cells.append(_f(r["mean"]) if r else "n/a")
                cells.append(_steps(res["methods"], name, s))
                w = _wall(res["methods"], name, s)
                cells.append(f"{w:.0f}" if w is not None else "n/a")
                lines.append("| " + " | ".join(cells) + " |")
            for bl, pr in [(PAIRED_BASELINE, res["paired"].get(s, {}).get(sp))] + [
                    (b2, res.get("paired_vs", {}).get(b2, {}).get(s, {}).get(sp)) for b2 in res.get("paired_vs", {})]:
                if not pr:
                    continue
                lines += ["", f"Paired against `{bl}` (Δ mean [95% interval]; an interval excluding 0 "
                          "is a difference the queries support):", ""]
                lines.append("| method | " + " | ".join(f"Δ {m}" for m in PAIRED_METRICS) + " |")
                lines.append("|---|" + "---|" * len(PAIRED_METRICS))
                for name, row in pr.items():
                    cells = []
                    for m in PAIRED_METRICS:
                        c = row.get(m)
                        if not c or c["delta"] is None:
                            cells.append("n/a")
                            continue
                        lo, hi = c["ci"]
                        mark = " *" if lo is not None and hi is not None and (lo > 0 or hi < 0) else ""
                        cells.append(f"{c['delta']:+.3f} [{_f(lo)}, {_f(hi)}]{mark}")
                    lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
            extras = {name: row["extra"] for name, row in table.items() if row.get("extra")}
            if extras:
                lines += ["", "Extra metrics reported by the methods:", ""]
                for name, e in extras.items():
                    lines.append(f"- `{name}`: " + ", ".join(f"{k} {_f(v)}" for k, v in e.items()))
            lines.append("")
        extra = (st.get("set_info", {}).get(s) or {}).get("extra_splits") or {}
        for csp in (x for x in extra if x.endswith("@corpus")):
            base = csp[:-len("@corpus")]
            lacking = [n for n in (splits.get(base) or {}) if n not in (splits.get(csp) or {})]
            if lacking:
                lines += [f"Not in the `{csp}` table (units made before the whole-corpus split, or a run without "
                          f"it): {', '.join(f'`{n}`' for n in lacking)}.", ""]
        lines += _prior_lines(res, s, splits)
        dims = res["dims"].get(s, {})
        for sp, per in dims.items():
            lines += [f"Per-dim nDCG@10 on {sp}:", ""]
            for name, dd in per.items():
                lines.append(f"- `{name}`: " + ", ".join(f"{d}: {_ci(v.get('nDCG@10'))}" for d, v in dd.items()))
            lines.append("")
    lines += ["## Rows", ""]
    for name, m in res["methods"].items():
        w = [v for v in (m.get("wall_seconds") or {}).values() if v]
        line = f"- `{name}` ({m['family']}; sets {', '.join(m['sets'])}): {m.get('description') or ''} — **{m['status']}**"
        if m.get("reason"):
            line += f": {m['reason']}"
        if w:
            line += f"; wall time {sum(w):.0f} s over {len(w)} unit(s)"
        lines.append(line)
        for k, e in (m.get("errors") or {}).items():
            lines.append(f"  - failed on {k}: {e}")
    if st.get("import_errors"):
        lines += ["", "Method modules that failed to import (their rows are missing):", ""]
        lines += [f"- `{k}`: {v}" for k, v in st["import_errors"].items()]
    lines += ["", "Metrics (docs/benchmark-english.md): R@k hit rate, MRR@10, nDCG@10 (binary), recall@100; TP@10 / "
              "TR@10 TEMPO temporal precision / relevance with exact interval verdicts; time_swap = share of queries "
              "whose gold outranks its time-wrong twin; top-1 wrong = share of queries whose top document is wrong "
              "by time only / entity / attribute / other (TimeQA: time = a paragraph of the query's own page, entity "
              "= another page); retention ρ = Spearman between the zero-shot and the "
              "row's cosine similarities on random pairs of time-stripped documents (1 = unchanged geometry)."]
    return "\n".join(lines) + "\n"


def fit_suptitle(fig, text: str, fontsize: float = 9):
    """``fig.suptitle(text)`` wrapped onto as many lines as it takes to fit the figure's width (a one-column
    figure is narrower than the title's one line)."""
    import textwrap
    width = len(text)
    t = fig.suptitle(text, fontsize=fontsize)
    renderer = fig.canvas.get_renderer()
    while width > 10 and t.get_window_extent(renderer).width > 0.96 * fig.bbox.width:
        width = int(width * 0.85)
        t.set_text(textwrap.fill(text, width))
    return t


def _prior_lines(res: dict, s: str, splits: dict) -> List[str]:
    """The time-prior table of set ``s``: per base row and match, the fitted c and nDCG@10 on the fit split
    (c = 0 and fitted) and on each table split."""
    summ = (res.get("prior") or {}).get(s) or {}
    if not summ:
        return []
    tsplits = [sp for sp in splits if splits[sp]]
    pb = (res.get("prior_baseline") or {}).get(s)
    lines = [f"### Time prior (`+prior` rows)", "",
             "Each row's run reranked by `tempokern.rerank.TimePrior`: score + c · match. c is fitted per unit on "
             "the fit split (training questions over a training gallery shaped like the evaluation gallery; a "
             "trained row saw those questions, so its c is conservative), never on the evaluation questions; the "
             "`+prior` row takes the match with the best fit-split nDCG@10. Values: means over the row's seeds "
             "(c: each seed's)." + (f" Prior baseline of the paired tables: `{pb}` (the untrained base whose prior "
                                    "is best on the fit split)." if pb else ""), ""]
    hdr = ["row", "match", "c", "fit nDCG@10 (c = 0 → fitted)"] + [f"{sp} nDCG@10" for sp in tsplits] + \
          [f"{sp} R@1" for sp in tsplits]
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|" + "---|" * len(hdr))
    for name, e in summ.items():
        seeds = e["seeds"]
        chosen = {v["chosen"] for v in seeds.values()}
        matches = list(next(iter(seeds.values()))["matches"])
        for m in matches:
            cs = [v["matches"][m]["c"] for v in seeds.values() if m in v["matches"]]
            f0 = [v["matches"][m]["fit"].get("nDCG@10_c0") for v in seeds.values() if m in v["matches"]]
            f1 = [v["matches"][m]["fit"].get("nDCG@10") for v in seeds.values() if m in v["matches"]]
            cells = [f"`{name}`", m + (" (chosen)" if m in chosen else ""), ", ".join(f"{c:.3g}" for c in cs),
                     f"{_f(_nanmean([x for x in f0 if x is not None]))} → {_f(_nanmean([x for x in f1 if x is not None]))}"]
            for key in ("nDCG@10", "R@1"):
                for sp in tsplits:
                    vals = [v["matches"][m]["means"].get(sp, {}).get(key) for v in seeds.values() if m in v["matches"]]
                    vals = [x for x in vals if x is not None]
                    cells.append(_f(_nanmean(vals)) if vals else "n/a")
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _plot(res: dict, out: Path) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []

    def save(fig, path):
        tmp = path.with_name(path.name + ".tmp.png")
        fig.savefig(tmp, dpi=100)
        fsync_path(tmp)
        os.replace(tmp, path)
        plt.close(fig)
        files.append(str(path))

    for s, splits in res["results"].items():
        sps = [sp for sp in splits if splits[sp]]
        if not sps:
            continue
        fig, axes = plt.subplots(2, len(sps), figsize=(3.6 * len(sps) + 1, 7), squeeze=False)
        for j, sp in enumerate(sps):
            table = splits[sp]
            names = list(table)
            for i, (metric, src) in enumerate((("nDCG@10", "abs"), ("nDCG@10", "paired"))):
                ax = axes[i][j]
                if src == "abs":
                    vals = [table[n].get(metric, {}).get("mean") or 0.0 for n in names]
                    cis = [table[n].get(metric, {}).get("ci") or [None, None] for n in names]
                    title = f"{sp}: {metric}"
                    plot_names = names
                else:
                    pr = res["paired"].get(s, {}).get(sp, {})
                    plot_names = [n for n in names if n in pr and pr[n].get(metric)]
                    vals = [pr[n][metric]["delta"] or 0.0 for n in plot_names]
                    cis = [pr[n][metric]["ci"] for n in plot_names]
                    title = f"{sp}: Δ {metric} vs {PAIRED_BASELINE}"
                    ax.axhline(0, color="k", lw=0.6)
                lo = [max(0.0, v - (c[0] if c[0] is not None else v)) for v, c in zip(vals, cis)]
                hi = [max(0.0, (c[1] if c[1] is not None else v) - v) for v, c in zip(vals, cis)]
                ax.bar(range(len(plot_names)), vals, yerr=[lo, hi], capsize=2, color="tab:blue" if src == "abs"
                       else "tab:orange")
                ax.set_xticks(range(len(plot_names)))
                ax.set_xticklabels(plot_names, rotation=60, ha="right", fontsize=7)
                ax.set_title(title, fontsize=8)
        fit_suptitle(fig, f"Set {s}: bars = mean over seeds, whiskers = 95% bootstrap interval over queries")
        fig.tight_layout()
        save(fig, out / f"plot_set{s}.png")
    for s, per_split in res["dims"].items():
        if not per_split:
            continue
        fig, axes = plt.subplots(1, len(per_split), figsize=(4 * len(per_split), 3.4), squeeze=False)
        for j, (sp, per) in enumerate(per_split.items()):
            ax = axes[0][j]
            for name, dd in per.items():
                ds = sorted(dd, key=int)
                m = [dd[d].get("nDCG@10", {}).get("mean") for d in ds]
                lo = [dd[d].get("nDCG@10", {}).get("ci", [None, None])[0] for d in ds]
                hi = [dd[d].get("nDCG@10", {}).get("ci", [None, None])[1] for d in ds]
                x = [int(d) for d in ds]
                ax.plot(x, m, marker="o", label=name)
                if all(v is not None for v in lo + hi):
                    ax.fill_between(x, lo, hi, alpha=0.2)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("dim")
            ax.set_title(f"set {s} {sp}: nDCG@10 per dim", fontsize=8)
            ax.legend(fontsize=7)
        fig.tight_layout()
        save(fig, out / f"plot_dims_set{s}.png")
    return files


def write_report(res: dict, out, *, plots: bool = True) -> dict:
    out = Path(out)
    files = {"json": str(out / "results.json"), "markdown": str(out / "results.md")}
    files["plots"] = _plot(res, out) if plots else []
    res["files"] = files
    atomic_write(out / "results.json", json.dumps(res, indent=1, allow_nan=False))
    atomic_write(out / "results.md", markdown(res))
    return files
