"""Real temporal data: TimeQA (packaged), bring-your-own BEIR folders for every method, the loaders'
handling of malformed input (file:line errors, --on-error skip reports), Zizhi Tongjian rows whose year is
in the reign string, and the text-time reader behind them."""
import gzip
import json
import os
import pathlib

import pytest

from conftest import shared_data
from tempokern.cli import main
from tempokern.datasets import DataFormatError, load_beir, load_zztj
from tempokern.datasets.timeqa import (TIMEQA_SPLITS, export_beir, load_timeqa, timeqa_hard_negatives,
                                       timeqa_page_split)
from tempokern.text import hull, time_intervals

TINY = ["--tiny-hidden", "16", "--tiny-layers", "1", "--max-length", "24", "--no-progress", "--epochs", "1",
        "--batch-size", "4"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEMPOKERN_CACHE", str(tmp_path / "cache"))


# ---- text times -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("Who owned the house from 1811 to 1827?", [((1811,), (1827,))]),
    ("He joined in May 2004 , left in June 2005 and played 2007-2009 .",
     [((2004, 5), (2004, 5)), ((2005, 6), (2005, 6)), ((2007,), (2009,))]),
    ("during 1916-1920 , while in 1963 ,", [((1916,), (1920,)), ((1963,), (1963,))]),
    ("between May 2004 and June 2005", [((2004, 5), (2005, 6))]),
    ("May–June 2019 and 1990-95", [((2019, 5), (2019, 6)), ((1990,), (1995,))]),
    ("in the 1990s", [((1990,), (1999,))]),
    ("in the 1st century , a 2nd-century-BC tomb", [((1, ), (100,))]),
    ("no date here, only 42 cats", []),
])
def test_time_intervals_reads_every_expression(text, want):
    assert time_intervals(text) == want


def test_hull_spans_every_interval():
    assert hull([((2004, 5), (2005, 6)), ((2007,), (2009,)), ((1999,), (1999,))]) == ((1999,), (2009,))
    assert hull([]) is None


# ---- TimeQA -----------------------------------------------------------------------------------------------

def _pages(n=None):
    from importlib import resources
    raw = resources.files("tempokern.data").joinpath("timeqa_human_annotated_train.json.gz").read_bytes()
    pages = json.loads(gzip.decompress(raw).decode("utf-8"))
    return pages if n is None else pages[:n]


@pytest.fixture(scope="module")
def small_timeqa(tmp_path_factory):
    p = tmp_path_factory.mktemp("tq") / "small.json"
    p.write_text(json.dumps(_pages(8), indent=1), encoding="utf-8")
    return str(p)


def test_packaged_timeqa_ships_with_its_licence():
    from tempokern._resources import TIMEQA, TIMEQA_LICENSE, read_bytes
    pages = json.loads(gzip.decompress(read_bytes(TIMEQA)).decode("utf-8"))     # sha256 checked
    assert len(pages) == 320 and sum(len(p["questions"]) for p in pages) == 1171
    assert "BSD 3-Clause" in read_bytes(TIMEQA_LICENSE).decode("utf-8")
    src = shared_data("timeqa/human_annotated_train.json")
    if os.path.exists(src):
        assert json.loads(pathlib.Path(src).read_text(encoding="utf-8")) == pages


def test_packaged_timeqa_goes_into_the_wheel():
    # the wheel takes every file of tempokern/ that .gitignore does not exclude (scikit-build-core,
    # wheel.packages = ["tempokern"]); the data and its licence must be tracked and not ignored
    import shutil
    import subprocess
    root = pathlib.Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    for name in ("timeqa_human_annotated_train.json.gz", "LICENSE-TimeQA"):
        rel = f"tempokern/data/{name}"
        assert subprocess.run(["git", "check-ignore", "-q", rel], cwd=root).returncode == 1, rel
        assert subprocess.run(["git", "ls-files", "--error-unmatch", rel], cwd=root,
                              capture_output=True).returncode == 0, rel
    assert 'wheel.packages = ["tempokern"]' in (root / "pyproject.toml").read_text()


def test_timeqa_loader(small_timeqa):
    ds = load_timeqa(small_timeqa)
    pages = _pages(8)
    links = {p["link"] for p in pages}
    assert len(ds.records) == sum(len(p["paras"]) for p in {p["link"]: p for p in pages}.values())
    assert len(ds.queries) == sum(len(p["questions"]) for p in pages)
    q = ds.queries[0]
    assert q.id == "Newton_D._Baker_House#P466:q0" and q.gold == {"Newton_D._Baker_House:18": 1}
    assert q.meta["times"] == [["1811", "1827"]] and q.family == "range"
    cal = ds.calendar
    assert cal.names == ("year", "month")
    assert cal.key_at(q.interval.start) == (1811, 1) and cal.key_at(q.interval.end) == (1827, 12)
    r = ds.record("Newton_D._Baker_House:1")       # several dates: every one kept, the interval is their hull
    assert len(r.meta["times"]) >= 3 and r.meta["times"][0] == ["1794", "1794"]
    assert cal.key_at(r.interval.start) == (1794, 1)
    # splits by page: a page's questions share one split, fixed by the link alone
    for q in ds.queries:
        link = "/wiki/" + q.meta["page"]
        assert link in links and q.split == timeqa_page_split(link)
    assert {s for s, _ in TIMEQA_SPLITS} == {"train", "dev", "test"}


def test_timeqa_split_is_deterministic_and_disjoint_on_the_packaged_pages():
    pages = _pages()
    split = {p["link"]: timeqa_page_split(p["link"]) for p in pages}
    assert split == {p["link"]: timeqa_page_split(p["link"]) for p in reversed(pages)}
    counts = {s: sum(v == s for v in split.values()) for s, _ in TIMEQA_SPLITS}
    assert all(counts[s] > 0.05 * len(split) for s in counts)       # every split holds pages
    assert split["/wiki/Newton_D._Baker_House"] == "dev"              # pinned: the hash decides, not the order


def test_timeqa_hard_negatives(small_timeqa):
    ds = load_timeqa(small_timeqa)
    negs = timeqa_hard_negatives(ds, 3)
    assert negs == timeqa_hard_negatives(ds, 3)                      # deterministic
    for q in ds.queries:
        page = negs["page"][q.id]
        assert page and len(page) <= 3
        assert all(d.startswith(q.meta["page"] + ":") and d not in q.gold for d in page)
        assert all(ds.record(d).interval is not None for d in page[:1])   # dated confounders first
        assert all(d not in q.gold for d in negs["bm25"][q.id])


def test_timeqa_malformed_pages(tmp_path):
    pages = _pages(3)
    pages[1]["questions"][0][1][0]["para"] = 999
    p = tmp_path / "bad.json"
    text = json.dumps(pages, indent=1)
    p.write_text(text, encoding="utf-8")
    line = text[:text.index('"index": "' + pages[1]["index"])].count("\n")   # the item's opening brace
    with pytest.raises(DataFormatError, match=rf"bad\.json:{line}: item 1 .*answer paragraph 999"):
        load_timeqa(str(p))
    ds = load_timeqa(str(p), on_error="skip")
    assert ds.report.num_skipped == 1 and ds.report.skipped[0][1] == line
    assert not any(q.meta["page"] == pages[1]["link"][6:] for q in ds.queries)
    p.write_text(text[:len(text) // 2], encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.json:\d+: invalid JSON"):
        load_timeqa(str(p))


def test_timeqa_exports_a_beir_folder_that_loads_back(small_timeqa, tmp_path, capsys):
    out = tmp_path / "beir"
    assert main(["data", "timeqa", "--input", small_timeqa, "--out", str(out), "--negatives", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["queries"] > 0
    ds, back = load_timeqa(small_timeqa), load_beir(str(out))
    assert [r.id for r in back.records] == [r.id for r in ds.records]
    assert {q.id: (q.gold, q.split) for q in back.queries} == {q.id: (q.gold, q.split) for q in ds.queries}
    assert back.calendar.names == ("year", "month")
    assert all(back.record(r.id).interval == r.interval for r in ds.records)
    q = back.queries[0]
    assert len(q.meta["neg_page"]) <= 2 and q.meta["page"] == "Newton_D._Baker_House"


def test_timeqa_export_by_split_keeps_pages_apart(small_timeqa, tmp_path, capsys):
    """`data timeqa --splits`: a training folder and a held-out folder with no paragraph in common, each loading
    back with only its own questions."""
    ds = load_timeqa(small_timeqa)
    have = sorted({q.split for q in ds.queries})
    assert len(have) >= 2, have
    held = have[-1]
    rest = [s for s in have if s != held]
    assert main(["data", "timeqa", "--input", small_timeqa, "--out", str(tmp_path / "a"), "--negatives", "1",
                 "--splits", ",".join(rest)]) == 0
    assert main(["data", "timeqa", "--input", small_timeqa, "--out", str(tmp_path / "b"), "--negatives", "1",
                 "--splits", held]) == 0
    a, b = load_beir(str(tmp_path / "a")), load_beir(str(tmp_path / "b"))
    assert not ({r.id for r in a.records} & {r.id for r in b.records})
    assert {q.split for q in a.queries} == set(rest) and {q.split for q in b.queries} == {held}
    assert {q.id for q in a.queries} | {q.id for q in b.queries} == {q.id for q in ds.queries}
    assert all(d in {r.id for r in b.records} for q in b.queries for d in q.gold)
    assert not (tmp_path / "b" / "qrels" / "train.tsv").exists() or held == "train"
    capsys.readouterr()
    assert main(["data", "timeqa", "--out", str(tmp_path / "c"), "--splits", "train,val"]) == 2
    assert "--splits must be some of train, dev, test" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


# ---- BEIR folders -----------------------------------------------------------------------------------------

def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


PAGES = {
    "ajax": ["Ajax is a football club .", "From 2001 to 2003 Smith played for Ajax .",
             "In 2004 he joined Ajax again and stayed until 2006 .", "Smith coached Ajax in 2010 ."],
    "oslo": ["Oslo is a city .", "Hansen was mayor of Oslo from 1990 to 1994 .",
             "Berg was mayor of Oslo between 1995 and 1999 .", "In 2003 Lie became mayor of Oslo ."],
    "yale": ["Yale is a university .", "Cole taught at Yale in 1970 .", "Moore taught at Yale from 1980 to 1985 .",
             "Diaz taught at Yale from 1990 to 1992 ."],
}
QUESTIONS = [
    ("ajax", "Who played for Ajax from 2001 to 2003?", 1, "train"),
    ("ajax", "Who played for Ajax from 2004 to 2006?", 2, "train"),
    ("ajax", "Who coached Ajax in 2010?", 3, "train"),
    ("oslo", "Who was mayor of Oslo from 1990 to 1994?", 1, "train"),
    ("oslo", "Who was mayor of Oslo from 1995 to 1999?", 2, "train"),
    ("oslo", "Who was mayor of Oslo in 2003?", 3, "train"),
    ("yale", "Who taught at Yale from 1980 to 1985?", 2, "dev"),
    ("yale", "Who taught at Yale in 1970?", 1, "dev"),
]


def tiny_beir(folder, splits=("train", "dev")):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "qrels").mkdir(exist_ok=True)
    _jsonl(folder / "corpus.jsonl", [{"_id": f"{p}:{i}", "title": p, "text": t, "page": p}
                                     for p, paras in PAGES.items() for i, t in enumerate(paras)])
    _jsonl(folder / "queries.jsonl", [{"_id": f"q{k}", "text": t, "page": p}
                                      for k, (p, t, _, _) in enumerate(QUESTIONS)])
    for s in splits:
        lines = ["query-id\tcorpus-id\tscore"] + [f"q{k}\t{p}:{i}\t1" for k, (p, _, i, sp) in enumerate(QUESTIONS)
                                                  if sp == s]
        (folder / "qrels" / f"{s}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def test_beir_training_folder_needs_no_test_qrels(tmp_path):
    ds = load_beir(str(tiny_beir(tmp_path / "b")))
    assert {q.split for q in ds.queries} == {"train", "dev"} and len(ds.queries) == 8
    r = ds.record("ajax:2")                           # no time field: every date of the text, the hull
    assert r.meta["times"] == [["2004", "2004"], ["2006", "2006"]] or r.meta["times"] == [["2004", "2006"]]
    cal = ds.calendar
    assert cal.names == ("year", "month")             # text times only: a year/month calendar
    assert cal.key_at(r.interval.start) == (2004, 1) and cal.key_at(r.interval.end) == (2006, 12)
    assert ds.record("ajax:0").interval is None
    q = next(q for q in ds.queries if q.id == "q0")
    assert q.interval.overlaps(ds.record("ajax:1").interval) and not q.interval.overlaps(r.interval)
    with pytest.raises(FileNotFoundError, match=r"qrels/test\.tsv does not exist.*train"):
        load_beir(str(tmp_path / "b"), split="test")


def test_beir_malformed_rows_name_file_and_line(tmp_path, capsys):
    b = tiny_beir(tmp_path / "b")
    with open(b / "corpus.jsonl", "a", encoding="utf-8") as f:
        f.write('{"_id": "x1", "text": "broken"\n{"_id": "x2"}\n')
    with open(b / "qrels" / "train.tsv", "a", encoding="utf-8") as f:
        f.write("q0\tnowhere:1\t1\nq7\tyale:1\t1\n")
    with pytest.raises(DataFormatError, match=r"corpus\.jsonl:13: invalid JSON"):
        load_beir(str(b))
    ds = load_beir(str(b), on_error="skip")
    where = [(os.path.basename(p), ln) for p, ln, _ in ds.report.skipped]
    assert ("corpus.jsonl", 13) in where and ("corpus.jsonl", 14) in where
    assert ("train.tsv", 8) in where                  # unknown document
    assert ("train.tsv", 9) in where                  # q7 is judged in dev.tsv too
    assert len(ds.queries) == 8
    # the command line: raise names file:line and exits non-zero; skip prints every skipped row
    assert main(["eval", "--model", str(tmp_path / "nomodel"), "--format", "beir", "--data", str(b)]) != 0
    assert main(["train", "--method", "re3", "--format", "beir", "--data", str(b), "--out", str(tmp_path / "r"),
                 *TINY]) == 1
    assert "corpus.jsonl:13: invalid JSON" in capsys.readouterr().err
    assert main(["train", "--method", "re3", "--format", "beir", "--data", str(b), "--out", str(tmp_path / "r"),
                 "--on-error", "skip", "--max-steps", "1", *TINY]) == 0
    err = capsys.readouterr().err
    assert "skipped 4 malformed row(s)" in err and "corpus.jsonl:14:" in err and "train.tsv:9:" in err


@pytest.mark.parametrize("method", ["ctd", "tmrl", "re3"])
def test_every_method_trains_and_evaluates_on_a_beir_folder(method, tmp_path, capsys):
    b = str(tiny_beir(tmp_path / "b"))
    out = tmp_path / "run"
    assert main(["train", "--method", method, "--format", "beir", "--data", b, "--out", str(out), "--max-steps", "2",
                 *TINY]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] >= 1
    model = out / ("model" if method == "re3" else "best")
    args = ["eval", "--model", str(model), "--format", "beir", "--data", b, "--split", "dev", "--no-progress",
            "--out", str(tmp_path / "eval.json"), "--run-out", str(tmp_path / "runs" / "dev.trec")]
    if method == "re3":
        args += ["--method", "re3"]
    assert main(args) == 0
    res = json.loads((tmp_path / "eval.json").read_text())
    rows = res["rows"]
    n = rows["dev"]["num_queries"] if method == "re3" else rows[0]["queries"]
    assert n == 2
    # --run-out: the ranking the table is computed from, as a TREC run (TMRL: the largest dim); scored again
    # from the file it gives the table's numbers
    from tempokern.eval import read_run, retrieval_metrics
    run = read_run(tmp_path / "runs" / "dev.trec")
    dev = [q for q in load_beir(b).queries if q.split == "dev"]
    assert set(run) == {q.id for q in dev} and all(0 < len(docs) <= 100 for docs in run.values())
    got = retrieval_metrics(run, {q.id: q.gold for q in dev})
    row = rows["dev"] if method == "re3" else rows[0] if method == "ctd" else rows[-1]
    assert method != "tmrl" or row["dim"] == max(r["dim"] for r in rows)
    keys = ("R@1", "MRR") if method == "re3" else ("R@1", "MRR@10", "nDCG@10")
    assert {k: got[k] for k in keys} == pytest.approx({k: row[k] for k in keys})


def test_tmrl_rows_from_a_beir_folder_mine_what_the_data_lacks(tmp_path):
    from tempokern.datasets.tmrl import rows_from_dataset
    ds = load_beir(str(tiny_beir(tmp_path / "b")))
    data = rows_from_dataset(ds, "train", hard_negatives=2, negative_queries=2)
    assert len(data.rows) == 6
    r = data.rows[0]
    assert r.query == QUESTIONS[0][1] and r.positive == PAGES["ajax"][1]
    assert r.hard_negatives and all(h in PAGES["ajax"] and h != r.positive for h in r.hard_negatives)
    # negative queries: the same page's other questions (same entity, other time)
    assert set(r.negative_queries) <= {t for p, t, _, s in QUESTIONS if p == "ajax"} - {r.query}
    assert r.negative_queries


def test_tmrl_tevatron_rows_without_negative_queries_train(tmp_path, capsys):
    rows = [{"query_id": f"q{k}", "query": t, "positive_passages": [{"text": PAGES[p][i]}],
             "negative_passages": [{"text": PAGES[p][0]}]} for k, (p, t, i, _) in enumerate(QUESTIONS)]
    f = tmp_path / "tev.jsonl"
    _jsonl(f, rows)
    assert main(["train", "--method", "tmrl", "--format", "tevatron", "--data", str(f), "--out", str(tmp_path / "t"),
                 "--max-steps", "2", *TINY]) == 0
    assert "no negative queries; mining" in capsys.readouterr().err


# ---- Zizhi Tongjian: the year in the reign string ----------------------------------------------------------

def test_zztj_reads_null_era_year_from_the_reign_string(tmp_path):
    src = shared_data("zztj/qiji-part.jsonl")
    if not os.path.exists(src):
        pytest.skip("shared data not present")
    from tempokern.datasets.zztj import parse_reign, zztj_time_text
    assert parse_reign("咸宁四年, 十月") == ("咸宁", 4, "十月")
    assert parse_reign("永明十一年，闰月") == ("永明", 11, "闰月") and parse_reign("永明") is None
    rows = [json.loads(l) for l in open(src, encoding="utf-8") if l.strip()]
    base = load_zztj(src)
    out, n = [], 0
    for o in rows:
        tm = dict(o["time_meta"])
        if "reign" in tm and isinstance(tm.get("lunar_month"), int) and 1 <= tm["lunar_month"] <= 12:
            # "建元元年, 二月": era title, year and month in one string, era_year and month null
            key = (tm["reign"], tm["era_year"], tm["lunar_month"])
            tm["reign"] = zztj_time_text(key).replace("年", "年, ", 1)
            tm["era_year"] = tm["lunar_month"] = None
            tm.pop("lunar_month_label", None)
            n += 1
        out.append(dict(o, time_meta=tm))
    p = tmp_path / "zz.jsonl"
    p.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in out), encoding="utf-8")
    d = load_zztj(str(p))
    assert n > 200
    assert [(r.id, r.key, r.interval) for r in d.records] == [(r.id, r.key, r.interval) for r in base.records]
    assert [(q.id, q.gold) for q in d.queries] == [(q.id, q.gold) for q in base.queries]
    # a reign string contradicting era_year is an error naming the line
    bad = [dict(o, time_meta=dict(o["time_meta"])) for o in out[:6]]
    bad[4]["time_meta"]["era_year"] = 7
    p.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in bad), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"zz\.jsonl:5: .*contradicts the reign string"):
        load_zztj(str(p))
    assert load_zztj(str(p), on_error="skip").report.num_skipped == 1


def test_ctd_on_a_folder_without_any_time_says_what_it_needs(tmp_path, capsys):
    b = tiny_beir(tmp_path / "b")
    rows = [json.loads(l) for l in (b / "corpus.jsonl").read_text().splitlines()]
    import re
    undated = lambda t: re.sub(r"[0-9]", "", t)   # noqa: E731
    _jsonl(b / "corpus.jsonl", [dict(r, text=undated(r["text"])) for r in rows])
    qs = [json.loads(l) for l in (b / "queries.jsonl").read_text().splitlines()]
    _jsonl(b / "queries.jsonl", [dict(q, text=undated(q["text"])) for q in qs])
    assert load_beir(str(b)).calendar is None
    assert main(["train", "--method", "ctd", "--format", "beir", "--data", str(b), "--out", str(tmp_path / "c"),
                 *TINY]) == 1   # a data problem found after reading: exit 1, one line
    err = capsys.readouterr().err
    assert "--method ctd needs times" in err and "Traceback" not in err
    assert not (tmp_path / "c").exists()
