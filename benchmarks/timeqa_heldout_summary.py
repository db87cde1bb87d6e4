"""The table of `benchmarks/timeqa_heldout.sh OUT`: every row's metrics on the held-out test pages, with 95%
bootstrap intervals over questions and paired differences to full fine-tuning (`ft`), read from the rows' TREC
runs (`tempokern eval --run-out`) and the test folder's qrels; every row is also paired against LoRA
fine-tuning (`lora`, TMRL's strong baseline).

    python benchmarks/timeqa_heldout_summary.py OUT            # writes OUT/summary.json and OUT/summary.md
    python benchmarks/timeqa_heldout_summary.py OUT --commit   # also copies both to benchmarks/results/timeqa-heldout/
                                                               # and rewrites the table in docs/benchmark-timeqa.md

A row without a run file (an evaluation from before --run-out) keeps the numbers of its eval-<row>.json and gets
no interval. The paired interval resamples the same questions for both rows (tempokern.suite.metrics).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path

#: the rows of timeqa_heldout.sh, in table order, with what they are
ROWS = {"zero_shot": "all-MiniLM-L6-v2 as shipped", "ft": "full fine-tuning (CTD trainer, semantic baseline)",
        "lora": "LoRA fine-tuning (full-dim InfoNCE)", "tmrl": "TMRL (LoRA)", "ctd": "full CTD",
        "re3": "Re³ (frozen backbone + time modules)"}
BASELINE = "ft"
#: the second baseline every row is also paired against (every metric in summary.json; nDCG@10 in the table)
SECOND = "lora"
METRICS = ("R@1", "MRR@10", "nDCG@10")
#: where --commit puts the summary (relative to the repository), and the document part it rewrites
COMMITTED = Path("benchmarks") / "results" / "timeqa-heldout"
DOC = Path("docs") / "benchmark-timeqa.md"
BEGIN, END = "<!-- heldout-table:begin -->", "<!-- heldout-table:end -->"


def _eval_row(doc: dict) -> dict:
    """The headline row of an eval-<row>.json: CTD's "all", TMRL's largest dim, Re³'s test split."""
    rows = doc["rows"]
    r = rows["test"] if isinstance(rows, dict) else next((x for x in rows if x.get("name") == "all"), rows[-1])
    return {m: r[m] for m in METRICS if m in r} | {"queries": r.get("queries", r.get("num_queries"))}


def _steps(run_dir: Path):
    """Optimiser steps of a row's training run: its summary.json (Re³), else the last step event of its
    log.jsonl (CTD, TMRL); None when it trained nothing."""
    p = run_dir / "summary.json"
    try:
        if p.is_file():
            return json.loads(p.read_text()).get("steps")
        log = run_dir / "log.jsonl"
        if log.is_file():
            steps = [json.loads(line).get("step") for line in log.read_text().splitlines()
                     if line.strip() and '"event": "step"' in line]
            return max((s for s in steps if isinstance(s, int)), default=None)
    except (OSError, ValueError):
        return None
    return None


def summarize(out, n_resamples: int = 1000) -> dict:
    from tempokern.datasets.beir import load_beir
    from tempokern.eval import read_run, retrieval_metrics
    from tempokern.suite.metrics import bootstrap_ci, paired_bootstrap_ci
    out = Path(out)
    test = load_beir(str(out / "test"), split="test")
    qrels = {q.id: {d: r for d, r in q.gold.items() if r > 0} for q in test.queries if q.split == "test"}
    qrels = {q: g for q, g in qrels.items() if g}
    qids = sorted(qrels)
    names = [m for m in ROWS if (out / f"eval-{m}.json").is_file()]
    names += sorted(p.stem[5:] for p in out.glob("eval-*.json") if p.stem[5:] not in ROWS)
    rows, per_query = {}, {}
    for m in names:
        row = {"what": ROWS.get(m, m), "steps": _steps(out / "runs" / m), "source": f"eval-{m}.json"}
        run_file = out / f"run-{m}.trec"
        if run_file.is_file():
            res = retrieval_metrics(read_run(run_file), qrels, per_query=True)
            per_query[m] = {k: [res["per_query"][q][k] for q in qids] for k in METRICS}
            for k in METRICS:
                mean, lo, hi = bootstrap_ci(per_query[m][k], n_resamples)
                row[k] = {"mean": mean, "ci": [lo, hi]}
            row["queries"] = len(qids)
            row["source"] = run_file.name
        else:
            ev = _eval_row(json.loads((out / f"eval-{m}.json").read_text()))
            row.update({k: {"mean": ev[k], "ci": None} for k in METRICS if k in ev}, queries=ev.get("queries"))
        rows[m] = row
    for base in (BASELINE, SECOND):
        if base not in per_query:
            continue
        for m, vals in per_query.items():
            if m != base:
                rows[m]["vs_" + base] = {}
                for k in METRICS:
                    d, lo, hi = paired_bootstrap_ci(vals[k], per_query[base][k], n_resamples)
                    rows[m]["vs_" + base][k] = {"delta": d, "ci": [lo, hi]}
    import torch
    return {"setup": {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                      "machine": f"{platform.machine()} x{os.cpu_count()}, torch {torch.__version__}",
                      "test_queries": len(qids), "test_documents": len(test.records),
                      "bootstrap_resamples": n_resamples, "baseline": BASELINE, "second_baseline": SECOND},
            "rows": rows,
            # the per-question values the intervals come from (rows with a run file), so any of them can be redone
            "per_query": {"qids": qids, **per_query}}


def _cell(c) -> str:
    if not c or c.get("mean") is None:
        return "n/a"
    return f"{c['mean']:.3f}" + (f" [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}]" if c.get("ci") else "")


def _delta(c) -> str:
    if not c:
        return "—"
    lo, hi = c["ci"]
    star = " *" if lo > 0 or hi < 0 else ""
    return f"{c['delta']:+.3f} [{lo:+.3f}, {hi:+.3f}]{star}"


def markdown(s: dict) -> str:
    st = s["setup"]
    b2 = st.get("second_baseline")
    lines = [f"TimeQA test pages: {st['test_queries']} questions ranked over {st['test_documents']} paragraphs; one "
             f"seed; {st['date']}, {st['machine']}. Mean [95% bootstrap interval over questions]; Δ = paired "
             f"difference to `{st['baseline']}`" + (f" (Δ `{b2}`: to `{b2}`)" if b2 else "")
             + " (* where the interval excludes 0).", "",
             "| row | what | steps | R@1 | nDCG@10 | Δ R@1 | Δ nDCG@10 |" + (f" Δ `{b2}` nDCG@10 |" if b2 else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if b2 else "")]
    for m, r in s["rows"].items():
        def vs(base, k):   # the row's paired difference to `base` on metric k
            return "(baseline)" if m == base else _delta((r.get("vs_" + base) or {}).get(k))
        line = (f"| `{m}` | {r['what']} | {r['steps'] if r['steps'] is not None else '—'} | {_cell(r.get('R@1'))} | "
                f"{_cell(r.get('nDCG@10'))} | {vs(st['baseline'], 'R@1')} | {vs(st['baseline'], 'nDCG@10')} |")
        lines.append(line + (f" {vs(b2, 'nDCG@10')} |" if b2 else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the folder timeqa_heldout.sh wrote")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default 1000)")
    ap.add_argument("--commit", action="store_true", help="also copy the summary to benchmarks/results/timeqa-heldout/ "
                                                          "and rewrite the table in docs/benchmark-timeqa.md")
    a = ap.parse_args(argv)
    if not (Path(a.out) / "test" / "qrels" / "test.tsv").is_file():
        print(f"{a.out}: no test/qrels/test.tsv (run benchmarks/timeqa_heldout.sh {a.out} first)", file=sys.stderr)
        return 2
    s = summarize(a.out, a.bootstrap)
    from tempokern._util import atomic_write
    atomic_write(Path(a.out) / "summary.json", json.dumps(s, indent=1) + "\n")
    md = markdown(s)
    atomic_write(Path(a.out) / "summary.md", md)
    print(md)
    if a.commit:   # run as a file (not from stdin): the repository is the one this script sits in
        here = Path(__file__).resolve().parent
        sys.path.insert(0, str(here))
        from _markers import render_between   # the marker rewrite of the other table scripts
        root = here.parent
        doc = root / DOC
        try:
            text = render_between(doc.read_text(encoding="utf-8"), md.rstrip("\n"), BEGIN, END)
        except ValueError as e:
            print(f"--commit: {doc}: {e}", file=sys.stderr)
            return 2
        (root / COMMITTED).mkdir(parents=True, exist_ok=True)
        atomic_write(root / COMMITTED / "summary.json", json.dumps(s, indent=1) + "\n")
        atomic_write(root / COMMITTED / "summary.md", md)
        atomic_write(doc, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
