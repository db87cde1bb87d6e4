import json
import os

import pytest

from tempokern.calendar import LEAP_MONTH
from tempokern.datasets import DataFormatError, load_zztj, load_zztj_sample, zztj_time_text

SHARED_ZZTJ = "/work/shared/data/zztj/qiji-part.jsonl"


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
