"""benchmarks/timeqa_heldout_summary.py: the held-out table from the rows' TREC runs and the test folder's qrels
(intervals over questions, paired differences to full fine-tuning), against metrics computed here by hand."""
import importlib.util
import json
from pathlib import Path

import pytest

from tempokern.eval import write_run

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("timeqa_heldout_summary",
                                                  ROOT / "benchmarks" / "timeqa_heldout_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _folder(tmp_path):
    out = tmp_path / "out"
    test = out / "test"
    (test / "qrels").mkdir(parents=True)
    docs = [f"d{i}" for i in range(6)]
    with open(test / "corpus.jsonl", "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"_id": d, "title": "p", "text": f"paragraph {i} about {1990 + i}"}) + "\n")
    with open(test / "queries.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"_id": f"q{i}", "text": f"question {i} in {1990 + i}"}) + "\n")
    (test / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n"
                                             + "".join(f"q{i}\td{i}\t1\n" for i in range(4)))
    return out, docs


def test_summary_reads_runs_and_pairs_against_ft(tmp_path):
    mod = _module()
    out, docs = _folder(tmp_path)
    # ft: gold first for q0, q1; second for q2; absent for q3.  tmrl: gold first everywhere
    ft = {"q0": {"d0": 0.9, "d1": 0.1}, "q1": {"d1": 0.8, "d0": 0.2}, "q2": {"d5": 0.9, "d2": 0.5},
          "q3": {"d5": 0.9, "d4": 0.5}}
    tmrl = {f"q{i}": {f"d{i}": 0.9, "d5": 0.1} for i in range(4)}
    lora = {f"q{i}": {"d5": 0.9, f"d{i}": 0.1} for i in range(4)}     # gold second everywhere
    write_run(ft, out / "run-ft.trec")
    write_run(tmrl, out / "run-tmrl.trec")
    write_run(lora, out / "run-lora.trec")
    for m in ("ft", "tmrl", "lora"):
        (out / f"eval-{m}.json").write_text(json.dumps({"rows": [{"name": "all", "R@1": -1.0, "queries": 4}]}))
    # a row evaluated without --run-out: its eval json's numbers, no interval, no paired difference
    (out / "eval-zero_shot.json").write_text(json.dumps({"rows": [{"dim": 384, "R@1": 0.25, "MRR@10": 0.5,
                                                                    "nDCG@10": 0.6, "queries": 4}]}))
    (out / "runs" / "tmrl").mkdir(parents=True)
    (out / "runs" / "tmrl" / "summary.json").write_text(json.dumps({"steps": 52}))
    (out / "runs" / "ft").mkdir()       # a CTD / TMRL run: the steps are the log's last step event
    (out / "runs" / "ft" / "log.jsonl").write_text("".join(json.dumps({"event": e, "step": i}) + "\n" for e, i in
                                                          (("step", 1), ("step", 2), ("eval", 9), ("step", 3))))
    s = mod.summarize(out, n_resamples=200)
    rows = s["rows"]
    assert list(rows) == ["zero_shot", "ft", "lora", "tmrl"]
    assert s["setup"]["test_queries"] == 4 and s["setup"]["test_documents"] == 6
    assert rows["ft"]["R@1"]["mean"] == pytest.approx(0.5)           # read from the run, not the eval json
    assert rows["ft"]["nDCG@10"]["mean"] == pytest.approx((1 + 1 + 1 / __import__("math").log2(3) + 0) / 4)
    assert rows["tmrl"]["R@1"]["mean"] == 1.0 and rows["tmrl"]["steps"] == 52 and rows["ft"]["steps"] == 3
    assert rows["zero_shot"]["steps"] is None
    lo, hi = rows["ft"]["R@1"]["ci"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0
    d = rows["tmrl"]["vs_ft"]["R@1"]
    assert d["delta"] == pytest.approx(0.5) and d["ci"][0] >= 0.0
    assert rows["zero_shot"]["R@1"] == {"mean": 0.25, "ci": None} and "vs_ft" not in rows["zero_shot"]
    # the second baseline: every row with a run is paired against lora too (lora: R@1 0, nDCG@10 1/log2(3))
    d = rows["tmrl"]["vs_lora"]["R@1"]
    assert d["delta"] == pytest.approx(1.0) and d["ci"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert rows["tmrl"]["vs_lora"]["nDCG@10"]["delta"] == pytest.approx(1 - 1 / __import__("math").log2(3))
    assert "vs_lora" in rows["ft"] and "vs_lora" not in rows["lora"] and "vs_lora" not in rows["zero_shot"]
    assert rows["lora"]["vs_ft"]["R@1"]["delta"] == pytest.approx(-0.5)
    assert s["per_query"]["qids"] == ["q0", "q1", "q2", "q3"] and set(s["per_query"]) == {"qids", "ft", "tmrl", "lora"}
    assert s["per_query"]["ft"]["R@1"] == [1.0, 1.0, 0.0, 0.0]
    md = mod.markdown(s)
    assert "| `ft` |" in md and "(baseline)" in md and "| `zero_shot` |" in md and "0.250 |" in md
    assert "Δ `lora` nDCG@10 |" in md
    tm = next(line for line in md.splitlines() if line.startswith("| `tmrl` |"))
    assert tm.count("|") == 9 and tm.endswith("+0.369 [+0.369, +0.369] * |")
    # the command line writes both files
    assert mod.main([str(out), "--bootstrap", "100"]) == 0
    assert json.loads((out / "summary.json").read_text())["rows"]["tmrl"]["R@1"]["mean"] == 1.0
    assert (out / "summary.md").read_text().startswith("TimeQA test pages: 4 questions")


def test_summary_needs_the_test_folder(tmp_path, capsys):
    assert _module().main([str(tmp_path)]) == 2
    assert "no test/qrels/test.tsv" in capsys.readouterr().err


def test_committed_heldout_table_is_current():
    """docs/benchmark-timeqa.md shows the committed summary.md (timeqa_heldout_summary.py OUT --commit writes both)."""
    md = ROOT / "benchmarks" / "results" / "timeqa-heldout" / "summary.md"
    doc = (ROOT / "docs" / "benchmark-timeqa.md").read_text()
    mod = _module()
    block = doc[doc.index(mod.BEGIN) + len(mod.BEGIN):doc.index(mod.END)]
    assert block.strip() == md.read_text().strip()
    s = json.loads((md.parent / "summary.json").read_text())
    assert mod.markdown(s) == md.read_text()
    assert set(s["rows"]) == {"zero_shot", "ft", "lora", "tmrl", "ctd", "re3"} and s["setup"]["test_queries"] == 145
    assert all("vs_ft" in r and "vs_lora" in r for m, r in s["rows"].items() if m not in ("ft", "lora"))
