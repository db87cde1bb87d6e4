import json
import os

import pytest
from conftest import shared_data

from tempokern.calendar import LEAP_MONTH
from tempokern.datasets import DataFormatError, load_zztj, load_zztj_sample, zztj_time_text

SHARED_ZZTJ = shared_data("zztj/qiji-part.jsonl")


@pytest.fixture(scope="module")
def zz():
    return load_zztj_sample()


def test_zztj_sample_counts(zz):
    ev = [r for r in zz.records if r.type == "event"]
    ne = [r for r in zz.records if r.type == "no_event"]
    assert len(ev) == 266                       # 268 rows minus 2 span headers
    assert len(zz.queries) == 92                # one per month key, as in the ChunQiuTR pilot
    assert zz.report.rows_read == 268 and zz.report.num_skipped == 0
    assert any("span-header" in n for n in zz.report.notes)
    cal = zz.calendar
    assert cal.meta["era_years"] == {"建元": 4, "永明": 7}
    assert sorted(map(tuple, cal.meta["leap_months"])) == [("建元", 2, 9), ("永明", 1, 4), ("永明", 4, 1),
                                                          ("永明", 6, 10)]
    assert cal.num_units == 11 * 12 + 4
    assert len(ne) == cal.num_units - 92 == zz.report.synthesized
    # every month has exactly one kind of record: events or a synthesized no_event
    months = {}
    for r in zz.records:
        months.setdefault(r.interval.start, set()).add(r.type)
    assert len(months) == cal.num_units and all(len(t) == 1 for t in months.values())


def test_zztj_queries_and_gold(zz):
    cal = zz.calendar
    for q in zz.queries:
        assert q.family == "point" and not q.pure_no_event
        assert zztj_time_text(q.meta["key"]) in q.text
        gold_months = {zz.record(d).interval.start for d in q.gold}
        assert gold_months == {q.interval.start}
        # gold = all event records of the month
        assert set(q.gold) == {r.id for r in zz.records if r.interval == q.interval and r.type == "event"}
    q = next(q for q in zz.queries if q.meta["key"] == ("建元", 2, LEAP_MONTH))
    assert "建元二年闰月" in q.text and set(q.gold) == {"qi_0066", "qi_0067"}
    assert cal.rank(("建元", 2, LEAP_MONTH)) == cal.rank(("建元", 2, 9)) + 1
    assert cal.ad_year(("永明", 1, 1)) == 483
    assert sum(len(q.gold) for q in zz.queries) == 266


def test_zztj_matches_shared_file(zz):
    if not os.path.exists(SHARED_ZZTJ):
        pytest.skip("shared data not present")
    d = load_zztj(SHARED_ZZTJ)
    assert [r.id for r in d.records] == [r.id for r in zz.records]


def test_zztj_options(zz):
    d = load_zztj_sample(no_event_records=False)
    assert all(r.type == "event" for r in d.records)
    d = load_zztj_sample(no_event_queries=True, templates=["{time}何事？"])
    assert len(d.queries) == zz.calendar.num_units
    pure = [q for q in d.queries if q.pure_no_event]
    assert len(pure) == zz.calendar.num_units - 92
    assert all(d.record(next(iter(q.gold))).type == "no_event" for q in pure)
    assert d.queries[0].text == "建元元年正月何事？"
    with pytest.raises(ValueError, match="time"):
        load_zztj_sample(templates=["no placeholder"])


def _write(tmp_path, rows):
    p = tmp_path / "z.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows) + "\n",
                 encoding="utf-8")
    return str(p)


def _row(i, month=1, year=1, reign="建元", **kw):
    tm = {"reign": reign, "era_year": year, "ad_year": 478 + year, "lunar_month": month,
          "lunar_month_label": "正月"}
    tm.update(kw)
    return {"id": f"r{i}", "description": f"事{i}", "time_meta": tm}


def test_zztj_malformed_rows_raise_with_file_and_line(tmp_path):
    p = _write(tmp_path, [_row(1), "{not json", _row(3)])
    with pytest.raises(DataFormatError, match=r"z\.jsonl:2: invalid JSON"):
        load_zztj(p)
    p = _write(tmp_path, [_row(1), _row(2, month=13)])
    with pytest.raises(DataFormatError, match=r":2: .*lunar_month"):
        load_zztj(p)
    p = _write(tmp_path, [_row(1), _row(1)])
    with pytest.raises(DataFormatError, match=r":2: duplicate record id"):
        load_zztj(p)
    p = _write(tmp_path, [_row(1, month=None, lunar_month_label="闰月")])
    with pytest.raises(DataFormatError, match=r":1: .*cannot place"):
        load_zztj(p)


def test_zztj_skip_mode_counts(tmp_path):
    p = _write(tmp_path, [_row(1), "[1, 2]", _row(3, year=0), "", _row(4, month=2)])
    d = load_zztj(p, on_error="skip")
    assert [r.id for r in d.records if r.type == "event"] == ["r1", "r4"]
    assert d.report.num_skipped == 2
    assert [line for _, line, _ in d.report.skipped] == [2, 3]
    assert "2 skipped" in d.report.summary()
    with pytest.raises(ValueError, match="on_error"):
        load_zztj(p, on_error="ignore")


# ---- ChunQiuTR format -------------------------------------------------------------------------

from tempokern import Calendar  # noqa: E402
from tempokern.datasets import load_beir, load_chunqiutr, load_chunqiutr_release  # noqa: E402


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    return str(path)


def _cq_files(tmp_path, extra_records=(), extra_queries=()):
    recs = [
        {"id": "e1", "text": "元年春王正月", "time": "1-1-1", "type": "event"},
        {"id": "e2", "text": "三月公及邾儀父盟于蔑", "time": [1, 1, 3], "type": "event"},
        {"id": "n1", "text": "二月無事", "time": "1-1-2", "type": "no_event"},
        {"id": "c1", "text": "注：三月盟", "time": "1-1-3", "type": "neg_comment"},
        {"id": "t1", "text": "二年春公會戎于潛", "time": "1-2-1", "type": "event"},
        {"id": "v1", "text": "十一年冬十有一月壬辰公薨", "time": "Yin-11-11", "type": "event"},
    ] + list(extra_records)
    qs = [
        {"id": "p1", "text": "隱公元年三月何事", "target": "1-1-3", "family": "point"},
        {"id": "p2", "text": "隱公元年二月", "target": "1-1-2", "family": "point", "pure_no_event": True},
        {"id": "w1", "text": "隱公元年正月至三月", "target": ["1-1-1", "1-1-3"], "family": "window"},
        {"id": "w2", "text": "隱公元年至二年", "target": [[1, 1], [1, 2]], "family": "window"},
        {"id": "g1", "text": "隱公二年", "target": [1, 2], "family": "gap", "gold": ["t1"]},
        {"id": "v", "text": "隱公十一年十一月", "target": "1-11-11", "family": "point"},
    ] + list(extra_queries)
    return _jsonl(tmp_path / "records.jsonl", recs), _jsonl(tmp_path / "queries.jsonl", qs)


def test_chunqiutr_format(tmp_path):
    rp, qp = _cq_files(tmp_path)
    d = load_chunqiutr(rp, qp)
    cal = d.calendar
    assert cal.name == "chunqiu" and len(d.records) == 6 and len(d.queries) == 6
    q = {x.id: x for x in d.queries}
    assert set(q["p1"].gold) == {"e2"}                   # neg_comment never gold
    assert q["p2"].pure_no_event and set(q["p2"].gold) == {"n1"}
    assert set(q["w1"].gold) == {"e1", "e2", "n1"} and not q["w1"].pure_no_event
    assert q["w1"].interval == cal.interval((1, 1, 1), (1, 1, 3))
    assert len(q["w2"].interval) == 24
    assert set(q["g1"].gold) == {"t1"} and q["g1"].family == "gap"
    # splits by month key: year 1 of Yin is train, year 2 test, year 11 val; w2 straddles
    assert q["p1"].split == "train" and q["g1"].split == "test" and q["v"].split == "val"
    assert q["w2"].split == "mixed"
    assert d.record("v1").key == (1, 11, 11)
    assert [r.id for r in d.gallery(neg=False, ne=False)] == ["e1", "e2", "t1", "v1"]
    assert d.split("val").queries == [q["v"]] and len(d.split("val").records) == 6
    assert d.queries_in("val") == [q["v"]] and d.queries_in("dev") == []   # an empty split is a list here...
    with pytest.raises(ValueError, match="no queries in split 'dev'"):
        d.split("dev")                                                        # ...and an error as a dataset


@pytest.mark.parametrize("bad_rec, msg", [
    ({"id": "x", "text": "t", "time": "1-1-13", "type": "event"}, "not a label of level 'month'"),
    ({"id": "x", "text": "t", "time": "4-5-1", "type": "event"}, "padding slot"),
    ({"id": "x", "text": "t", "time": "1-1-1", "type": "rumour"}, "type must be one of"),
    ({"id": "x", "text": "", "time": "1-1-1"}, "text"),
    ({"id": "e1", "text": "t", "time": "1-1-1"}, "duplicate record id"),
    ({"id": "x", "text": "t"}, "missing field 'time'"),
])
def test_chunqiutr_bad_records(tmp_path, bad_rec, msg):
    rp, qp = _cq_files(tmp_path, extra_records=[bad_rec])
    with pytest.raises(DataFormatError, match=r"records\.jsonl:7: .*" + msg):
        load_chunqiutr(rp, qp)
    d = load_chunqiutr(rp, qp, on_error="skip")
    assert d.report.num_skipped == 1 and d.report.skipped[0][1] == 7 and len(d.records) == 6


@pytest.mark.parametrize("bad_q, msg", [
    ({"id": "z", "text": "t", "target": "1-1-1", "family": "span"}, "family must be one of"),
    ({"id": "z", "text": "t", "target": "1-1-2", "pure_no_event": False}, "contradicts"),
    ({"id": "z", "text": "t", "target": "1-1-4"}, "no gold record"),
    ({"id": "z", "text": "t", "target": "1-1-1", "gold": ["nope"]}, "not in the records"),
    ({"id": "z", "text": "t", "target": ["1-1-3", "1-1-1"]}, "before its start"),
    ({"id": "p1", "text": "t", "target": "1-1-1"}, "duplicate query id"),
])
def test_chunqiutr_bad_queries(tmp_path, bad_q, msg):
    rp, qp = _cq_files(tmp_path, extra_queries=[bad_q])
    with pytest.raises(DataFormatError, match=r"queries\.jsonl:7: .*" + msg):
        load_chunqiutr(rp, qp)
    d = load_chunqiutr(rp, qp, on_error="skip")
    assert d.report.num_skipped == 1 and len(d.queries) == 6


def test_chunqiutr_release_format(tmp_path):
    meta = {"time_mapping": {
        "a": {"sort_key": [1, 1, 1], "versions": [{"春秋": [{"sid": 1, "text": "元年春王正月"}],
                                                  "春秋左氏傳": [{"sid": 2, "text": "元年春不書即位"}],
                                                  "neg_sample": [{"source": "杜注", "parsed_comment": [
                                                      {"sid": 3, "text": "注文"}]}]}]},
        "b": {"sort_key": [1, 1, 2], "no_event": True, "versions": [{"春秋": [{"sid": 4, "text": "二月"}]}],
              "neg_samples": [{"parsed_comment": [{"sid": 5, "text": "疏"}]}]},
        "c": {"sort_key": [1, 2, 1], "versions": [{"春秋": [{"sid": 6, "text": "二年春"}]}]},
    }}
    mp = tmp_path / "meta.json"
    mp.write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
    qp = _jsonl(tmp_path / "q.jsonl", [
        {"qid": "q1", "query": "元年正月", "type": "point", "sort_key": [1, 1, 1], "pos_sids": [1, 2]},
        {"qid": "q2", "query": "元年二月", "type": "point", "sort_key": [1, 1, 2], "pos_sids": [4]},
        {"qid": "q3", "query": "元年至二年", "type": "window", "target_sort_keys": [[1, 2, 1], [1, 1, 1]],
         "pos_sids": [1, 2, 6, 99]},
        {"qid": "q4", "query": "nothing", "type": "point", "sort_key": [1, 1, 3], "pos_sids": [99]},
    ])
    d = load_chunqiutr_release(str(mp), qp)
    types = {r.id: r.type for r in d.records}
    assert types == {"1": "event", "2": "event", "3": "neg_comment", "4": "no_event", "5": "neg_comment",
                     "6": "event"}
    q = {x.id: x for x in d.queries}
    assert set(q) == {"q1", "q2", "q3"} and any("no pos_sids" in n for n in d.report.notes)
    assert q["q2"].pure_no_event and not q["q1"].pure_no_event
    assert set(q["q3"].gold) == {"1", "2", "6"} and q["q3"].split == "mixed"
    assert q["q3"].interval == d.calendar.interval((1, 1, 1), (1, 2, 1))
    # malformed: a month outside the calendar, a bad sort key in a query
    meta["time_mapping"]["d"] = {"sort_key": [1, 1, 13], "versions": []}
    mp.write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"meta\.json:0: time_mapping\['d'\]: bad time key"):
        load_chunqiutr_release(str(mp), qp)
    d = load_chunqiutr_release(str(mp), qp, on_error="skip")
    assert d.report.num_skipped == 1 and len(d.records) == 6
    qp2 = _jsonl(tmp_path / "q2.jsonl", [{"qid": "x", "query": "t", "type": "window", "target_sort_keys": ["1-1-1"],
                                          "pos_sids": [1]}])
    del meta["time_mapping"]["d"]
    mp.write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"q2\.jsonl:1: .*sort keys"):
        load_chunqiutr_release(str(mp), qp2)


# ---- BEIR-style ---------------------------------------------------------------------------------

def _beir(tmp_path, qrels_lines=None, extra_docs=()):
    (tmp_path / "qrels").mkdir(exist_ok=True)
    _jsonl(tmp_path / "corpus.jsonl", [
        {"_id": "d1", "title": "A", "text": "election results 2019", "date": "2019-05-03"},
        {"_id": "d2", "text": "census of 2010", "time": "2010"},
        {"_id": "d3", "text": "undated essay"},
        {"_id": "d4", "text": "the decade", "start": "2010-01", "end": "2019-12"},
    ] + list(extra_docs))
    _jsonl(tmp_path / "queries.jsonl", [
        {"_id": "q1", "text": "what happened in May 2019", "time": "2019-05", "family": "point"},
        {"_id": "q2", "text": "an untimed question"},
        {"_id": "q3", "text": "unjudged"},
    ])
    lines = qrels_lines or ["query-id\tcorpus-id\tscore", "q1\td1\t2", "q1\td4\t1", "q2\td3\t1"]
    (tmp_path / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(tmp_path)


def test_beir_loader(tmp_path):
    d = load_beir(_beir(tmp_path))
    cal = d.calendar
    assert cal.name == "gregorian" and cal.levels[0].labels[0] == 2010 and cal.levels[0].labels[-1] == 2019
    assert [q.id for q in d.queries] == ["q1", "q2"]              # q3 has no qrels
    q1 = d.queries[0]
    assert q1.gold == {"d1": 2, "d4": 1} and q1.split == "test" and q1.family == "point"
    assert len(q1.interval) == 31 and cal.key_at(q1.interval.start) == (2019, 5, 1)
    assert d.record("d2").interval == cal.span("2010") and d.record("d3").interval is None
    assert d.record("d4").interval.overlaps(q1.interval) and not d.record("d2").interval.overlaps(q1.interval)
    assert d.record("d1").title == "A"
    # explicit calendar: month resolution
    m = load_beir(str(tmp_path), calendar=Calendar.gregorian(2000, 2020, resolution="month"))
    assert len(m.queries[0].interval) == 1


def test_beir_errors(tmp_path):
    folder = _beir(tmp_path, qrels_lines=["q1\td1\t1", "q1\td1", "q2\td9\t1"])
    with pytest.raises(DataFormatError, match=r"test\.tsv:2: expected 3"):
        load_beir(folder)
    d = load_beir(folder, on_error="skip")
    assert d.report.num_skipped == 2                              # bad line + unknown document
    assert [q.id for q in d.queries] == ["q1"] and d.queries[0].gold == {"d1": 1}
    assert any("'q2' left out" in n for n in d.report.notes)
    folder = _beir(tmp_path, extra_docs=[{"_id": "d5", "text": "x", "date": "2019-02-30"}])
    with pytest.raises(DataFormatError, match=r"corpus\.jsonl:5: document 'd5'"):
        load_beir(folder)
    with pytest.raises(ValueError, match="folder"):
        load_beir()


def test_zztj_reign_aligned_splits(zz):
    cal = zz.calendar.with_splits({("永明", 6): "val", ("永明", 7): "test"})
    d = zz.with_calendar(cal)
    assert d.splits() == ["test", "train", "val"]
    val = d.split("val")
    assert val.queries and all(q.meta["key"][:2] == ("永明", 6) for q in val.queries)
    assert len(d.split("train").queries) + len(val.queries) + len(d.split("test").queries) == 92
    tr = d.records_in_split("train")
    assert tr and all(r.key[:2] not in (("永明", 6), ("永明", 7)) for r in tr)
    assert zz.queries[0].split is None                      # the original is untouched
    with pytest.raises(ValueError, match="same units"):
        zz.with_calendar(Calendar.chunqiu())


# ---- Zizhi Tongjian records without a month ----------------------------------------------------

def test_zztj_records_without_a_month_are_read_as_the_reference_keys_them(tmp_path):
    """Fails on a030c41 (`lunar_month must be 1..12 ... got 0 / '无月'`): rows dated to a year only are
    common in the annals (about half the records of the Jin annals demo in the ChunQiuTR release). They are
    read as year-long records, grouped by (reign, year, label) as the reference's extract_month_key does
    (label, else the season), each group one query; the emperor is kept."""
    emp = "晋世祖武皇帝"
    rows = [
        _row(1, reign="泰始", month=3, lunar_month_label="三月", emperor=emp),
        _row(2, reign="泰始", month=0, lunar_month_label="无月", emperor=emp),
        _row(3, reign="泰始", month=0, lunar_month_label="无月", emperor=emp),
        _row(4, reign="泰始", year=2, month=None, lunar_month_label="是岁", emperor=emp),
        _row(5, reign="泰始", year=2, month=None, lunar_month_label="—"),
        _row(6, reign="泰始", year=2, month=5, lunar_month_label="五月"),
        _row(7, reign="泰始", year=2, month=0, lunar_month_label="闰月"),          # intercalary, lunar_month 0
        _row(8, reign="泰始", year=3, month=None, lunar_month_label="", season="冬"),
    ]
    d = load_zztj(_write(tmp_path, rows))
    cal = d.calendar
    rec = {r.id: r for r in d.records}
    year1 = cal.span(("泰始", 1))
    assert len(year1) == 12
    for i in ("r2", "r3"):
        assert rec[i].interval == year1 and rec[i].key == ("泰始", 1) and rec[i].type == "event"
        assert rec[i].meta["month_label"] == "无月" and rec[i].meta["emperor"] == emp
    assert rec["r4"].interval == cal.span(("泰始", 2)) and rec["r4"].meta["month_label"] == "是岁"
    assert "emperor" not in rec["r5"].meta and rec["r5"].meta["month_label"] == "—"
    assert rec["r8"].meta["month_label"] == "冬" and rec["r8"].interval == cal.span(("泰始", 3))
    assert rec["r7"].key == ("泰始", 2, "闰") and cal.rank(rec["r7"].key) == cal.rank(("泰始", 2, 5)) + 1
    # the month groups: one query per month with records, one per (reign, year, label) group
    by = {q.id: q for q in d.queries}
    assert set(by["q:泰始-1-无月"].gold) == {"r2", "r3"} and by["q:泰始-1-无月"].family == "year"
    assert "泰始元年无月" in by["q:泰始-1-无月"].text
    assert set(by["q:泰始-2-是岁"].gold) == {"r4"} and set(by["q:泰始-2-—"].gold) == {"r5"}
    assert set(by["q:泰始-3-冬"].gold) == {"r8"}
    month_q = [q for q in d.queries if q.family == "point"]
    assert {tuple(q.gold) for q in month_q} == {("r1",), ("r6",), ("r7",)}
    # year-dated records do not fill months: 泰始元年's other months still get their no_event record
    assert sum(r.type == "no_event" and r.key[:2] == ("泰始", 1) for r in d.records) == 11
    assert "dated to a year" in d.report.summary()
    # in the gallery and gold of evaluation
    assert {"r2", "r4", "r8"} <= {r.id for r in d.gallery()}


def test_zztj_rows_without_month_or_label_still_fail_with_file_and_line(tmp_path):
    p = _write(tmp_path, [_row(1), _row(2, month=None, lunar_month_label="")])
    with pytest.raises(DataFormatError, match=r"z\.jsonl:2: .*lunar_month"):
        load_zztj(p)
    p = _write(tmp_path, [_row(1), _row(2, month=0, lunar_month_label="无月", era_year=None)])
    with pytest.raises(DataFormatError, match=r"z\.jsonl:2: .*era_year"):
        load_zztj(p)
    p = _write(tmp_path, [_row(1), _row(2, month=-1, lunar_month_label="无月")])
    with pytest.raises(DataFormatError, match=r"z\.jsonl:2: .*lunar_month"):
        load_zztj(p)


def test_year_dated_records_have_no_month_target():
    """The calendar heads get the reign and year of a year-dated record, no month target (-1: skipped)."""
    import tempfile
    from tempokern.training.data import record_labels
    rows = [_row(i, reign="泰始", year=1 + i % 2, month=1 + i % 12, lunar_month_label="x") for i in range(12)]
    rows += [_row(20 + i, reign="泰始", year=1 + i % 2, month=0, lunar_month_label="无月") for i in range(4)]
    import pathlib
    with tempfile.TemporaryDirectory() as t:
        d = load_zztj(_write(pathlib.Path(t), rows))
    rec = {r.id: r for r in d.records}
    assert record_labels(d, rec["r20"]) == [0.0, 0.0, -1] and record_labels(d, rec["r21"]) == [0.0, 1.0, -1]
    assert record_labels(d, rec["r1"]) == [0.0, 1.0, 1.0]


# ---- publication dates (Record.published, Re³'s d_pub) ---------------------------------------------------

def test_beir_published_dates(tmp_path):
    import datetime as dt
    folder = _beir(tmp_path, extra_docs=[
        {"_id": "p1", "text": "forecast", "published": "2014-03-03"},
        {"_id": "p2", "text": "observed", "pub_date": "2014-03-05T18:30:00Z", "date": "2014-03-05"},
        {"_id": "p3", "text": "edited", "published": "2014-03-06 09:00:00+02:00"}])
    d = load_beir(folder)
    assert d.record("p1").published == dt.date(2014, 3, 3) and type(d.record("p1").published) is dt.date
    assert d.record("p2").published == dt.date(2014, 3, 5) and d.record("p2").interval is not None
    assert d.record("p3").published == dt.date(2014, 3, 6)
    assert d.record("d1").published is None                       # no field: unknown


@pytest.mark.parametrize("bad", ["2014-13-01", "March 3, 2014", "2014", 20140303, "2014-02-30T00:00:00"])
def test_beir_bad_published_names_file_and_line(tmp_path, bad):
    folder = _beir(tmp_path, extra_docs=[{"_id": "p1", "text": "x", "published": bad}])
    with pytest.raises(DataFormatError, match=r"corpus\.jsonl:5: document 'p1': publication date"):
        load_beir(folder)
    d = load_beir(folder, on_error="skip")
    assert "p1" not in d and d.report.num_skipped == 1
