"""Data files at the edges: dates outside the supported years (tempokern.limits), duplicate qrels rows, strict
JSON arrays (TimeQA, TMRL), exports into used folders, the per-text character cap, and the skip report of
the comparison suite."""
import datetime as dt
import gzip
import json
import os

import pytest

from tempokern.datasets import load_beir
from tempokern.datasets.base import DataFormatError
from tempokern.limits import MAX_TEXT_CHARS, YEAR_MAX, YEAR_MIN


def _beir(d, docs, queries=None, qrels=None, extra_qrels=None):
    (d / "qrels").mkdir(parents=True, exist_ok=True)
    (d / "corpus.jsonl").write_text("\n".join(json.dumps(x) for x in docs) + "\n")
    queries = queries or [{"_id": "q0", "text": "what happened?", "time": "2001"}]
    (d / "queries.jsonl").write_text("\n".join(json.dumps(x) for x in queries) + "\n")
    (d / "qrels" / "test.tsv").write_text(qrels or "q0\td0\t1\n")
    for name, text in (extra_qrels or {}).items():
        (d / "qrels" / name).write_text(text)
    return d


# ---- dates ---------------------------------------------------------------------------------------------

def test_year_range_is_one_constant():
    from tempokern import calendar
    assert (YEAR_MIN, YEAR_MAX) == (1, 9999) and calendar.YEAR_MIN is YEAR_MIN and calendar.YEAR_MAX is YEAR_MAX


@pytest.mark.parametrize("bad", ["-500", "0000", "10000", -500, 0, 10000, "0000-01-01"])
def test_dates_outside_the_range_are_file_line_errors(tmp_path, bad):
    docs = [{"_id": "d0", "text": "a", "time": "2001"}, {"_id": "d1", "text": "b", "time": bad},
            {"_id": "d2", "text": "c", "time": "2002-03-04"}]
    d = _beir(tmp_path / "b", docs)
    with pytest.raises(DataFormatError) as e:
        load_beir(str(d))
    assert e.value.line == 2 and e.value.path.endswith("corpus.jsonl")
    assert "outside the supported range 1..9999" in str(e.value)
    ds = load_beir(str(d), on_error="skip")
    assert [r.id for r in ds.records] == ["d0", "d2"]
    assert [(os.path.basename(p), ln) for p, ln, _ in ds.report.skipped] == [("corpus.jsonl", 2)]


def test_the_last_day_of_the_range_loads(tmp_path):
    docs = [{"_id": "d0", "text": "a", "time": "9999-12-31"}, {"_id": "d1", "text": "b", "time": "9999-01-02"}]
    ds = load_beir(str(_beir(tmp_path / "b", docs, [{"_id": "q0", "text": "x", "time": "9999-12-31"}])))
    cal = ds.calendar
    assert cal.key_at(ds.record("d0").interval.start) == (9999, 12, 31)
    assert cal.key_at(ds.queries[0].interval.end) == (9999, 12, 31)


def test_cli_reports_the_bad_date_row_and_skips_it(tmp_path):
    docs = [{"_id": f"d{i}", "text": f"doc {i}", "time": f"{2000 + i}"} for i in range(4)]
    docs.insert(2, {"_id": "bad", "text": "x", "time": "10000-01-01"})
    d = _beir(tmp_path / "b", docs, qrels="q0\td1\t1\n")
    from tempokern.cli import _dataset, build_parser
    args = build_parser().parse_args(["eval", "--model", "m", "--data", str(d), "--format", "beir"])
    with pytest.raises(DataFormatError, match=r"corpus.jsonl:3: .*year 10000"):
        _dataset(args)
    args.on_error = "skip"
    ds = _dataset(args)
    assert "bad" not in ds


def test_relative_dates_at_the_edge_of_the_calendar():
    from tempokern.text.time import find_times, parse_time
    last, first = dt.date(9999, 12, 31), dt.date(1, 1, 1)
    for text in ("tomorrow", "the day after tomorrow", "3 days later", "next year", "next month", "next Friday"):
        assert parse_time(text, ref=last) is None
        assert find_times(f"it ends {text}.", ref=last) == []
    for text in ("yesterday", "3 days ago", "last year", "last month", "last Friday"):
        assert parse_time(text, ref=first) is None
    assert parse_time("yesterday", ref=last).to_date() == dt.date(9999, 12, 30)
    assert parse_time("tomorrow", ref=dt.date(2020, 2, 28)).to_date() == dt.date(2020, 2, 29)


def test_gregorian_calendar_up_to_the_last_day():
    from tempokern.calendar import Calendar
    cal = Calendar.gregorian(9999, 9999)
    assert cal.num_units == 365 and cal.key_at(cal.num_units - 1) == (9999, 12, 31)
    with pytest.raises(ValueError, match="1 <= first_year <= last_year <= 9999"):
        Calendar.gregorian(9999, 10000)


# ---- qrels ---------------------------------------------------------------------------------------------

def test_duplicate_qrels_rows(tmp_path):
    docs = [{"_id": f"d{i}", "text": f"doc {i}", "time": "2001"} for i in range(3)]
    d = _beir(tmp_path / "b", docs, qrels="query-id\tcorpus-id\tscore\nq0\td0\t1\nq0\td1\t1\nq0\td0\t0\n")
    with pytest.raises(DataFormatError) as e:
        load_beir(str(d))
    assert e.value.line == 4 and e.value.path.endswith("test.tsv") and "judged at line 2" in str(e.value)
    ds = load_beir(str(d), on_error="skip")
    assert ds.queries[0].gold == {"d0": 1, "d1": 1}        # the first judgement kept, the duplicate reported
    assert [ln for _, ln, _ in ds.report.skipped] == [4]


# ---- strict JSON ---------------------------------------------------------------------------------------

def _page(i):
    return {"index": f"/wiki/P{i}#0", "link": f"/wiki/P{i}", "type": "easy",
            "paras": [f"Page {i}", f"In 200{i} the thing {i} was done by someone."],
            "questions": [[f"What happened in 200{i}?", [{"para": 1, "answer": "x"}]]]}


@pytest.mark.parametrize("tail,line", [("\n[" + json.dumps(_page(9)) + "]\n", 3), ("\ngarbage\n", 3), ("\n{}", 3)])
def test_timeqa_trailing_content_is_an_error(tmp_path, tail, line):
    from tempokern.datasets.timeqa import load_timeqa
    p = tmp_path / "t.json"
    p.write_text(json.dumps([_page(1), _page(2)]) + "\n" + tail)
    with pytest.raises(DataFormatError) as e:
        load_timeqa(str(p))
    assert e.value.path == str(p) and e.value.line == line and "after the JSON array" in str(e.value)
    p.write_text(json.dumps([_page(1), _page(2)]) + "\n \n")
    assert len(load_timeqa(str(p)).queries) == 2


def test_timeqa_invalid_utf8_names_the_file(tmp_path):
    from tempokern.datasets.timeqa import load_timeqa
    p = tmp_path / "t.json"
    p.write_bytes(b'[\n{"index": "\xff"}]')
    with pytest.raises(DataFormatError, match=r"t.json:2: not valid UTF-8"):
        load_timeqa(str(p))
    g = tmp_path / "t.json.gz"
    g.write_bytes(gzip.compress(b'[\n\n{"index": "\xfe"}]'))
    with pytest.raises(DataFormatError, match=r"t.json.gz:3: not valid UTF-8"):
        load_timeqa(str(g))


def test_tmrl_array_trailing_content_is_an_error(tmp_path):
    from tempokern.datasets.tmrl import load_temporal_contrastive
    row = {"query": "q", "positive_passages": [{"text": "p"}], "negative_passages": []}
    p = tmp_path / "r.json"
    p.write_text(json.dumps([row]) + "\n" + json.dumps([row]))
    with pytest.raises(DataFormatError) as e:
        load_temporal_contrastive(str(p))
    assert e.value.line == 2 and "after the JSON array" in str(e.value)


def test_timeqa_export_into_a_used_folder_leaves_no_stale_split(tmp_path):
    from tempokern.cli import main
    out = tmp_path / "beir"
    src = tmp_path / "t.json"
    src.write_text(json.dumps([_page(i) for i in range(1, 7)]))
    assert main(["data", "timeqa", "--out", str(out), "--negatives", "0"]) == 0
    assert {p.name for p in (out / "qrels").iterdir()} == {"train.tsv", "dev.tsv", "test.tsv"}
    (out / "notes.txt").write_text("mine")
    assert main(["data", "timeqa", "--out", str(out), "--negatives", "0", "--splits", "test"]) == 0
    assert {p.name for p in (out / "qrels").iterdir()} == {"test.tsv"}
    assert (out / "notes.txt").read_text() == "mine"      # not the export's: untouched
    ds = load_beir(str(out))
    assert {q.split for q in ds.queries} == {"test"}
    assert main(["data", "timeqa", "--out", str(out), "--negatives", "0", "--input", str(src)]) == 0
    assert not (out / "LICENSE").exists()                 # no licence next to --input: the old one is gone


# ---- the character cap ---------------------------------------------------------------------------------

def test_long_texts_are_truncated_once_per_load(tmp_path, capsys):
    from tempokern.cli import report_skipped
    long = "x " * (MAX_TEXT_CHARS // 2) + "On 3 May 2001 it rained. " * 10
    docs = [{"_id": "d0", "text": long}, {"_id": "d1", "text": long + "y"}, {"_id": "d2", "text": "In 2002 z."}]
    ds = load_beir(str(_beir(tmp_path / "b", docs, [{"_id": "q0", "text": "when? 2002"}], qrels="q0\td2\t1\n")))
    assert [len(r.text) for r in ds.records] == [MAX_TEXT_CHARS, MAX_TEXT_CHARS, 10]
    assert ds.report.truncated == 2
    assert ds.record("d0").interval is None          # the dates past the cap are not read
    report_skipped(ds.report)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"2 text(s) longer than {MAX_TEXT_CHARS} characters truncated" in err


def test_tagger_and_tokenizer_read_at_most_the_cap():
    from tempokern.text import temporal_spans, time_intervals
    from tempokern.text.time import find_times, parse_time
    text = "a " * MAX_TEXT_CHARS + "in March 2014"
    assert temporal_spans(text) == [] and time_intervals(text) == [] and find_times(text) == []
    assert parse_time(text) is None
    near = "a " * (MAX_TEXT_CHARS // 2 - 20) + "in March 2014" + " b" * MAX_TEXT_CHARS
    assert time_intervals(near) == [((2014, 3), (2014, 3))]

    from _ctd_helpers import small_dataset, tiny_model
    model = tiny_model(small_dataset())
    seen = []
    tok = model.tokenizer

    def spy(texts, **kw):
        seen.extend(len(t) for t in texts)
        return tok(texts, **kw)
    model.tokenizer = spy
    enc = model.tokenize(["q" * (5 * MAX_TEXT_CHARS), "short"])
    assert seen == [MAX_TEXT_CHARS, 5] and enc["input_ids"].shape[1] <= model.max_length


def test_zztj_long_texts_are_truncated(tmp_path):
    from tempokern.datasets import load_zztj
    tm = {"reign": "建元", "era_year": 1, "ad_year": 479, "lunar_month": 1, "lunar_month_label": "正月"}
    rows = [{"id": "r1", "description": "事" * (MAX_TEXT_CHARS + 7), "time_meta": tm},
            {"id": "r2", "description": "短事", "time_meta": dict(tm, lunar_month=2, lunar_month_label="二月")}]
    p = tmp_path / "z.jsonl"
    p.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    ds = load_zztj(str(p), no_event_records=False)
    assert ds.report.truncated == 1
    assert len(ds.record("r1").text) == MAX_TEXT_CHARS and ds.record("r2").text == "短事"
    assert f"1 text(s) longer than {MAX_TEXT_CHARS}" in ds.report.summary()


def test_chunqiutr_long_texts_are_truncated(tmp_path):
    from tempokern import Calendar
    from tempokern.datasets import load_chunqiutr
    key = "-".join(map(str, Calendar.chunqiu().split_keys("test")[0]))
    rp, qp = tmp_path / "records.jsonl", tmp_path / "queries.jsonl"
    rp.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in [
        {"id": "a", "text": "事" * (MAX_TEXT_CHARS + 3), "time": key, "type": "event"},
        {"id": "b", "text": "短", "time": key, "type": "event"}]) + "\n", encoding="utf-8")
    qp.write_text(json.dumps({"id": "q", "text": "何" * (MAX_TEXT_CHARS + 1), "target": key, "family": "point"},
                             ensure_ascii=False) + "\n", encoding="utf-8")
    ds = load_chunqiutr(str(rp), str(qp))
    assert ds.report.truncated == 2
    assert len(ds.record("a").text) == len(ds.queries[0].text) == MAX_TEXT_CHARS and ds.record("b").text == "短"


def test_tmrl_long_texts_are_truncated_with_their_spans(tmp_path):
    from tempokern.datasets.tmrl import load_temporal_contrastive, load_tevatron_jsonl
    pad = "x " * (MAX_TEXT_CHARS // 2)
    passage = "In 2001 " + pad + "in 2005"            # two spans, the second past the cap
    row = {"query_id": "p", "query": passage, "temporal": ["2001", "2005"],
           "positive_passages": [{"docid": "a", "text": "when in 2001?"}, {"docid": "b", "text": "what?"}],
           "negative_passages": [{"text": "y" * (MAX_TEXT_CHARS + 1)}]}
    p = tmp_path / "r.json"
    p.write_text(json.dumps([row]))
    d = load_temporal_contrastive(str(p))
    assert d.report.truncated == 2                    # each text once, not once per row that shares it
    assert [len(r.positive) for r in d.rows] == [MAX_TEXT_CHARS] * 2
    assert d.rows[0].positive_spans == [(3, 7)]       # the span past the cap is dropped with its text
    assert [len(t) for t in d.rows[0].negative_queries] == [MAX_TEXT_CHARS]
    assert d.rows[0].query == "when in 2001?"
    t = tmp_path / "t.jsonl"
    t.write_text(json.dumps({"query": "q" * (MAX_TEXT_CHARS + 2), "positive_passages": [{"text": "short"}],
                             "negative_passages": [{"text": "n" * (MAX_TEXT_CHARS + 2)}, {"text": "m"}]}) + "\n")
    d = load_tevatron_jsonl(str(t))
    assert d.report.truncated == 2
    r = d.rows[0]
    assert len(r.query) == len(r.hard_negatives[0]) == MAX_TEXT_CHARS and r.positive == "short"
    assert r.hard_negatives[1] == "m"


# ---- the suite's skip report ---------------------------------------------------------------------------

def test_benchmark_data_skip_is_reported(tmp_path):
    from tempokern.suite.realdata import beir_set
    docs = [{"_id": f"d{i}", "text": f"In {2000 + i} thing {i}.", "page": "p"} for i in range(6)]
    docs.insert(3, {"_id": "bad", "text": "x", "time": -500})
    queries = [{"_id": f"q{i}", "text": f"thing {i} in {2000 + i}?"} for i in range(4)]
    d = _beir(tmp_path / "b", docs, queries, qrels="q2\td2\t1\nq3\td3\t1\n",
              extra_qrels={"train.tsv": "q0\td0\t1\nq1\td1\t1\nq1\td1\t1\n"})
    with pytest.raises(DataFormatError):
        beir_set(str(d))
    rs = beir_set(str(d), on_error="skip")
    assert sorted((os.path.basename(p), ln) for p, ln, _ in rs.dataset.report.skipped) == \
        [("corpus.jsonl", 4), ("train.tsv", 3)]


def test_re2_long_texts_are_truncated(tmp_path):
    from tempokern.datasets import load_re2
    p = tmp_path / "r.jsonl"
    row = {"id": "q1", "query": "who? " + "x" * (MAX_TEXT_CHARS + 5),
           "positive": {"id": "d1", "text": "y" * (MAX_TEXT_CHARS + 9), "time": "2001"}, "negatives": []}
    p.write_text(json.dumps(row) + "\n")
    r = load_re2(str(p))
    assert r.dataset.report.truncated == 2
    assert len(r.dataset.records[0].text) == len(r.dataset.queries[0].text) == MAX_TEXT_CHARS
    assert r.triples[0].query == r.dataset.queries[0].text
