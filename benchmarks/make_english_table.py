"""The English comparison table of docs/benchmark-english.md, generated from a committed suite result.

    # after `tempokern benchmark --suite english --out RUN` (the full run, 3 seeds):
    python benchmarks/make_english_table.py --import RUN/results.json     # -> benchmarks/results/english-<date>.json
    python benchmarks/make_english_table.py --write                       # newest english-*.json -> the doc's table

--import keeps everything of results.json except the per-query arrays (they stay in the run's own
folder; the committed file holds the means, per-seed means and intervals, the paired intervals
against minilm_ft, the per-dim curves and the setup: command, machine, date). --write replaces the
text between `<!-- english-table:start -->` and `<!-- english-table:end -->` in docs/benchmark-english.md; without
--write the table is printed."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- english-table:start -->", "<!-- english-table:end -->"
DOC = ROOT / "docs" / "benchmark-english.md"
BASELINE = "minilm_ft"
#: the split each set's headline row is read on (the others are in the run's results.md)
HEADLINE = {"A": ["test_date", "test_year"], "B": ["test_date", "test_masked"], "C": ["test_date", "test_year"],
            "B-2date": ["test_date"], "B-nopub": ["test_masked"]}
#: the dependence table: (perturbed set, split) read against set B on the same split (same queries, same gold):
#: a second date matters on test_date (an explicit date in the document), the publication date on test_masked
#: (relative dates, resolved against it); every other split is in the run's own results.md
PERTURBED = (("B-2date", "test_date"), ("B-nopub", "test_masked"))


def _f(v, nd=3):
    return "n/a" if v is None else f"{v:.{nd}f}"


def _ci(cell):
    if not cell or cell.get("mean") is None:
        return "n/a"
    lo, hi = cell["ci"]
    return f"{cell['mean']:.3f} [{_f(lo, 2)}, {_f(hi, 2)}]"


def _delta(cell):
    if not cell or cell.get("delta") is None:
        return "—"
    lo, hi = cell["ci"]
    verdict = "better" if lo is not None and lo > 0 else ("worse" if hi is not None and hi < 0 else "no clear difference")
    return f"{cell['delta']:+.3f} [{_f(lo, 2)}, {_f(hi, 2)}] {verdict}"


def _name(name: str, row: dict, seeds, seeded: bool = True) -> str:
    """The row's name, with the seeds it has when a run is partial (a seeded row with fewer than the run's
    seeds; an unseeded row runs once and stands for every seed)."""
    have = row.get("seeds_run")
    if not seeded or have is None or not seeds or len(have) >= len(seeds):
        return f"`{name}`"
    return f"`{name}` (seed{'s' if len(have) > 1 else ''} {', '.join(map(str, have))})"


def dependence(res: dict) -> list:
    """Lines of the dependence table: each row's nDCG@10 on set B and on its perturbed copies, split by split
    (the same queries and gold; only the gallery's text or publication dates differ). Δ is the difference of
    the seed means (not paired: the per-query arrays are not in the committed file)."""
    results = res["results"]
    base = results.get("B") or {}
    cols = [(s, sp) for s, sp in PERTURBED if sp in (results.get(s) or {}) and sp in base]
    if not cols:
        return []
    names = [n for n in (base.get(cols[0][1]) or {}) if any(n in results[s][sp] for s, sp in cols)]
    head = " | ".join(f"B {sp} | {s} {sp} | Δ" for s, sp in cols)
    lines = ["**Set B against its perturbed copies** (nDCG@10, mean over seeds; `B-2date`: 70% of the documents "
             "open with a sentence naming another year; `B-nopub`: no publication dates. Δ = perturbed − B)", "",
             f"| method | {head} |", "|---|" + "---|---|---|" * len(cols)]
    for n in names:
        cells = []
        for s, sp in cols:
            b = ((base.get(sp) or {}).get(n) or {}).get("nDCG@10") or {}
            p = ((results[s].get(sp) or {}).get(n) or {}).get("nDCG@10") or {}
            bm, pm = b.get("mean"), p.get("mean")
            cells += [_f(bm), _f(pm), "—" if bm is None or pm is None else f"{pm - bm:+.3f}"]
        lines.append(f"| `{n}` | " + " | ".join(cells) + " |")
    return lines + [""]


def table(res: dict, source: str) -> str:
    st = res["setup"]
    # the run's own output folder is a path on the machine that ran it: shown as RUN
    command = re.sub(r"(--out)[ =]\S+", r"\1 RUN", st.get("command") or "tempokern benchmark --suite english")
    lines = [f"From `{source}`: `{command}`, {st['date']}, "
             f"{st['machine']}, device {st['device']}, seeds {st['seeds']}, {st.get('seconds', '?')} s in all. "
             f"Mean over seeds [95% bootstrap interval over queries]; Δ = paired difference to `{BASELINE}` "
             "(\"better\"/\"worse\" only where the interval excludes 0); time-wrong = share of queries whose top "
             "document is the right fact at the wrong time; ρ = similarity-preservation Spearman (1 = geometry "
             "unchanged).", ""]
    if st.get("note"):
        lines[-1:-1] = ["", f"**Note:** {st['note']}"]
    seeds = st.get("seeds")
    seeded = {n: m.get("seeded", True) for n, m in res.get("methods", {}).items()}
    for s, splits in res["results"].items():
        for sp in HEADLINE.get(s, list(splits)[:1]):
            rows = splits.get(sp)
            if not rows:
                continue
            n = next(iter(rows.values()))["R@1"]["n"]
            lines += [f"**Set {s}, {sp}** ({n} queries)", "",
                      "| method | R@1 | nDCG@10 | time-swap acc. | top-1 time-wrong | Δ nDCG@10 vs fine-tuned | ρ |",
                      "|---|---|---|---|---|---|---|"]
            paired = res.get("paired", {}).get(s, {}).get(sp, {})
            for name, row in rows.items():
                ret = row.get("retention_spearman")
                lines.append(f"| {_name(name, row, seeds, seeded.get(name, True))} | {_ci(row.get('R@1'))} | {_ci(row.get('nDCG@10'))} | "
                             f"{_f((row.get('time_swap') or {}).get('mean'))} | "
                             f"{_f((row.get('err_time') or {}).get('mean'))} | "
                             f"{'(baseline)' if name == BASELINE else _delta(paired.get(name, {}).get('nDCG@10'))} | "
                             f"{_f(ret['mean']) if ret else 'n/a'} |")
            lines.append("")
    lines += dependence(res)
    skipped = [f"`{n}` ({m['status']}: {m.get('reason') or '; '.join((m.get('errors') or {}).values())})"
               for n, m in res["methods"].items() if m["status"] != "done"]
    if skipped:
        lines += ["Rows not in the table: " + ", ".join(skipped) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def do_import(path: Path, note: str = None, tag: str = None) -> Path:
    res = json.loads(path.read_text())
    res.pop("per_query", None)
    if note:
        res["setup"]["note"] = note
    date = res["setup"]["date"].split()[0]
    out = RESULTS / f"english-{date}{'-' + tag if tag else ''}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    return out


def newest() -> Path:
    files = sorted(RESULTS.glob("english-*.json"))
    if not files:
        sys.exit("no benchmarks/results/english-*.json: run the suite and --import its results.json first")
    return files[-1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--import", dest="imp", help="a suite run's results.json to commit (trimmed)")
    ap.add_argument("--note", help="with --import: a sentence on what the run is (e.g. partial)")
    ap.add_argument("--tag", help="with --import: a name suffix (english-<date>-<tag>.json)")
    ap.add_argument("--source", help="the english-*.json to read (default: the newest)")
    ap.add_argument("--write", action="store_true", help="replace the table in docs/benchmark-english.md")
    a = ap.parse_args(argv)
    if a.imp:
        src_written = do_import(Path(a.imp), a.note, a.tag)
        print(f"wrote {src_written}")
        if not a.source:
            a.source = str(src_written)
    src = Path(a.source) if a.source else newest()
    text = table(json.loads(src.read_text()), src.relative_to(ROOT) if src.is_relative_to(ROOT) else src)
    if not a.write:
        print(text)
        return
    body = DOC.read_text()
    if START not in body or END not in body:
        sys.exit(f"{DOC.relative_to(ROOT)} has no {START} ... {END} block")
    body = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: f"{START}\n{text}{END}", body, flags=re.S)
    DOC.write_text(body)
    print(f"{DOC.relative_to(ROOT)} table updated from {src}")


if __name__ == "__main__":
    main()
