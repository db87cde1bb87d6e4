"""Re²-style jsonl loader (design notes §3.4 "Data")."""
import datetime as dt
import json

import pytest

from tempokern.datasets import NEGATIVE_KINDS, DataFormatError, Re2Triple, RetrievalDataset, load_re2

F = lambda v: [{"head": "Seattle", "relation": "high on 2014-03-05", "value": v}]   # noqa: E731

ROWS = [
    {"id": "q1", "query": "High in Seattle on March 5, 2014?", "query_time": "2014-03-05", "answer": "12.8 °C",
     "split": "train",
     "positive": {"id": "obs-0305", "text": "On March 5, 2014 Seattle had a high of 12.8 °C.", "time": "2014-03-05",
                  "published": "2014-03-05", "facts": F("12.8 °C"), "source": "vega"},
     "negatives": [
         {"id": "fc-0305-v1", "text": "Forecast for March 5, 2014: high of 12.3 °C.", "time": "2014-03-05",
          "published": "2014-03-03T06:00:00", "facts": F("12.3 °C"), "kind": "outdated"},
         {"id": "obs-0306", "text": "On March 6, 2014 Seattle had a high of 10 °C.", "time": "2014-03-06",
          "published": "2014-03-06", "kind": "time_wrong"},
         {"id": "pdx-0305", "text": "On March 5, 2014 Portland had a high of 11 °C.", "time": "2014-03-05",
          "kind": "entity_wrong"}]},
    {"query": "Latest forecast for Seattle?", "answer": 10,
     "positive": {"id": "obs-0306", "text": "On March 6, 2014 Seattle had a high of 10 °C.", "time": "2014-03-06",
                  "published": "2014-03-06"},
     "negatives": [{"id": "obs-0305", "text": "On March 5, 2014 Seattle had a high of 12.8 °C.",
                    "published": "2014-03-05", "kind": "outdated", "time": "2014-03-05"}]},
]


def write(tmp_path, rows, name="re2.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows) + "\n",
                 encoding="utf-8")
    return str(p)


def test_load_re2(tmp_path):
    ds, triples = load_re2(write(tmp_path, ROWS))
    assert isinstance(ds, RetrievalDataset) and ds.name == "re2"
    assert [r.id for r in ds.records] == ["obs-0305", "fc-0305-v1", "obs-0306", "pdx-0305"]   # shared by id
    assert ds.record("fc-0305-v1").published == dt.date(2014, 3, 3)
    assert ds.record("pdx-0305").published is None
    assert ds.record("obs-0305").meta["facts"] == F("12.8 °C") and ds.record("obs-0305").meta["source"] == "vega"
    assert "kind" not in ds.record("fc-0305-v1").meta
    cal = ds.calendar
    assert cal.key_at(ds.record("obs-0306").interval.start) == (2014, 3, 6)
    q1, q2 = ds.queries
    assert q1.id == "q1" and q1.gold == {"obs-0305": 1} and q1.split == "train"
    assert q1.meta["answer"] == "12.8 °C" and q1.meta["query_time"] == "2014-03-05"
    assert cal.key_at(q1.interval.start) == (2014, 3, 5)
    assert q2.id == "q2" and q2.split == "test" and q2.interval is None and q2.meta["answer"] == 10
    assert triples[0] == Re2Triple("q1", q1.text, "obs-0305", ["fc-0305-v1", "obs-0306", "pdx-0305"],
                                   ["outdated", "time_wrong", "entity_wrong"], "2014-03-05")
    assert triples[1].positive == "obs-0306" and triples[1].hard_negatives == ["obs-0305"]
    assert set(t for tr in triples for t in tr.negative_kinds) <= set(NEGATIVE_KINDS)
    assert ds.report.records == 4 and ds.report.queries == 2 and ds.report.num_skipped == 0


@pytest.mark.parametrize("row, msg", [
    ({"query": "x"}, "missing 'positive'"),
    ({"positive": {"id": "a", "text": "t"}}, "missing string field 'query'"),
    ({"query": "x", "positive": {"text": "t"}}, "without a string 'id'"),
    ({"query": "x", "positive": {"id": "a"}}, "missing string field 'text'"),
    ({"query": "x", "positive": {"id": "a", "text": "t", "published": "5 May 2014"}}, "publication date"),
    ({"query": "x", "positive": {"id": "a", "text": "t", "time": "2014-02-30"}}, "day is out of range"),
    ({"query": "x", "positive": {"id": "a", "text": "t"}, "negatives": [{"id": "b", "text": "u"}]}, "'kind' must be"),
    ({"query": "x", "positive": {"id": "a", "text": "t"}, "negatives": [{"id": "b", "text": "u", "kind": "stale"}]},
     "'kind' must be"),
    ({"query": "x", "positive": {"id": "a", "text": "t"}, "negatives": [{"id": "a", "text": "t", "kind": "outdated"}]},
     "also a negative"),
    ({"query": "x", "positive": {"id": "a", "text": "t", "facts": [{"head": "h"}]}}, "facts\\[0\\]"),
    ({"query": "x", "positive": {"id": "a", "text": "t"}, "negatives": {"id": "b"}}, "'negatives' must be a list"),
    ({"query": "x", "positive": {"id": "a", "text": "t"}, "answer": {"v": 1}}, "'answer'"),
    ({"query": "x", "query_time": "soon", "positive": {"id": "a", "text": "t"}}, "not a date"),
    ({"id": "q1", "query": "dup", "positive": {"id": "z", "text": "t"}}, "duplicate query id 'q1'"),
    ({"query": "x", "positive": {"id": "obs-0305", "text": "another text"}}, "differs from its first occurrence on line 1"),
])
def test_bad_rows_name_file_and_line(tmp_path, row, msg):
    path = write(tmp_path, [ROWS[0], row])
    with pytest.raises(DataFormatError, match=r"re2\.jsonl:2: .*" + msg):
        load_re2(path)
    ds, triples = load_re2(path, on_error="skip")
    assert ds.report.num_skipped == 1 and [q.id for q in ds.queries] == ["q1"] and len(triples) == 1


def test_invalid_json_and_missing_file(tmp_path):
    path = write(tmp_path, [ROWS[0], "{not json", "[1, 2]"])
    with pytest.raises(DataFormatError, match=r"re2\.jsonl:2: invalid JSON"):
        load_re2(path)
    ds, _ = load_re2(path, on_error="skip")
    assert ds.report.num_skipped == 2
    with pytest.raises(FileNotFoundError):
        load_re2(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="on_error"):
        load_re2(path, on_error="ignore")


def test_time_off_the_given_calendar(tmp_path):
    from tempokern import Calendar
    path = write(tmp_path, ROWS)
    with pytest.raises(DataFormatError, match=r"re2\.jsonl:1: document 'obs-0305': time .* not on calendar"):
        load_re2(path, calendar=Calendar.gregorian(2000, 2005))
    ds, triples = load_re2(path, calendar=Calendar.gregorian(2014, 2014, resolution="month"))
    assert len(ds.queries[0].interval) == 1 and len(triples) == 2
