"""tempokern.rerank.TimePrior: the match functions on hand-made cases (open intervals, queries without an
interval, undated documents, the first date), the timekde prior against tempokern.baselines.timekde, the fit
picking the weight that maximises nDCG@10 on a constructed run, reranking that only shifts scores, and errors
naming the argument."""
import math

import numpy as np
import pytest

from tempokern.datasets import Query, Record
from tempokern.rerank import TimePrior, month_span, query_span, record_spans
from tempokern.rerank.time_prior import GRID_MULTIPLIERS, match_any_inside, match_first_date, span_in


def rec(rid, *times, text="x"):
    return Record(rid, text, meta={"times": [list(t) for t in times]})


def q(qid, times, gold=None, text="q"):
    return Query(qid, text, gold=gold or {}, meta={"times": [list(t) for t in times]})


def test_month_spans_and_relations():
    assert month_span("1995", "1995") == (1995 * 12, 1995 * 12 + 11)
    assert month_span("1995-03", "1997") == (1995 * 12 + 2, 1997 * 12 + 11)
    assert month_span(None, "2004") == (-math.inf, 2004 * 12 + 11)
    assert month_span((2001, 5, 3), None) == (2001 * 12 + 4, math.inf)
    with pytest.raises(ValueError, match="before it starts"):
        month_span("2001", "1999")
    year95 = month_span("1995", "1995")
    # a whole year lies inside a range of years, not inside one of its months; it overlaps both
    assert span_in(year95, month_span("1994", "1996"))
    assert not span_in(year95, month_span("1995-03", "1995-03"))
    assert span_in(year95, month_span("1995-03", "1995-03"), "overlap")
    assert not span_in(year95, month_span("1996", "1997"), "overlap")
    with pytest.raises(ValueError, match="relation"):
        span_in(year95, year95, "near")


def test_match_functions_on_hand_made_cases():
    d = [month_span("1980", "1980"), month_span("1995-05", "1995-05"), month_span("2001", "2003")]
    qi = month_span("1994", "1996")
    assert match_any_inside(qi, d) == 1.0          # the second expression lies inside
    assert match_first_date(qi, d) == 0.0          # the first (1980) does not
    assert match_first_date(month_span("1980", "1990"), d) == 1.0
    # a range expression inside / only overlapping
    assert match_any_inside(month_span("2000", "2005"), d) == 1.0
    assert match_any_inside(month_span("2002", "2005"), d) == 0.0
    assert match_any_inside(month_span("2002", "2005"), d, "overlap") == 1.0
    # open intervals: "after 2000" holds 2001-2003; "before 1981" holds 1980
    assert match_any_inside(month_span("2000", None), d) == 1.0
    assert match_first_date(month_span(None, "1981"), d) == 1.0
    assert match_any_inside(month_span(None, "1979"), d) == 0.0
    # a query without an interval and an undated document never match
    assert match_any_inside(None, d) == 0.0 and match_first_date(None, d) == 0.0
    assert match_any_inside(qi, []) == 0.0 and match_first_date(qi, []) == 0.0


def test_granularity_compares_whole_years_or_months():
    from tempokern.rerank.time_prior import coarsen
    assert coarsen(month_span("1995-03", "1996-02")) == month_span("1995", "1996")
    assert coarsen(month_span(None, "1996-02")) == month_span(None, "1996")
    assert coarsen(month_span("1995-03", "1996-02"), "month") == month_span("1995-03", "1996-02")
    assert coarsen(None) is None
    with pytest.raises(ValueError, match="granularity"):
        coarsen(month_span("1995", "1995"), "day")
    docs = [rec("y", ("1995", "1995")), rec("m", ("1996-03", "1996-03"))]
    queries = {"march": ("1995-03", "1995-03"), "range": ("1995", "1996-02")}
    run = {"march": {"y": 0.0, "m": 0.0}, "range": {"y": 0.0, "m": 0.0}}
    by_year = TimePrior("any_inside", c=1.0).rerank(run, queries, docs)
    by_month = TimePrior("any_inside", c=1.0, granularity="month").rerank(run, queries, docs)
    # "1995" lies in "March 1995" by year, not by month; "March 1996" lies in "1995 .. February 1996" by year only
    assert by_year == {"march": {"y": 1.0, "m": 0.0}, "range": {"y": 1.0, "m": 1.0}}
    assert by_month == {"march": {"y": 0.0, "m": 0.0}, "range": {"y": 1.0, "m": 0.0}}
    with pytest.raises(ValueError, match="granularity"):
        TimePrior(granularity="week")


def test_record_and_query_spans_read_times_or_tag_the_text():
    r = rec("a", ("1990", "1990"), ("2001-02", "2001-03"))
    assert record_spans(r) == [month_span("1990", "1990"), month_span("2001-02", "2001-03")]
    # no meta["times"]: the project's tagger on the text, in text order
    r2 = Record("b", "He moved in 2004 and retired from 1990 to 1995.")
    cache = {}
    assert record_spans(r2, cache=cache) == [month_span("2004", "2004"), month_span("1990", "1995")]
    assert "b" in cache
    assert record_spans(Record("c", "no date here")) == []
    # a BEIR row's time fields
    assert record_spans(Record("d", "x", meta={"start": "2001-02-03", "end": "2002"})) == [month_span("2001-02", "2002")]
    assert record_spans(Record("e", "x", meta={"date": "1999"})) == [month_span("1999", "1999")]
    assert query_span(q("q", [("1990", "1990"), ("1995", "1996")])) == month_span("1990", "1996")
    assert query_span(Query("q2", "Who was the coach from 1990 to 1995?")) == month_span("1990", "1995")
    assert query_span(Query("q3", "Who was the coach?")) is None
    assert query_span((None, "2004")) == (-math.inf, 2004 * 12 + 11)
    assert query_span(None) is None and query_span((None, None)) is None
    with pytest.raises(ValueError, match="date prefix"):
        record_spans(rec("bad", ("19x5", "1995")))
    with pytest.raises(ValueError, match="queries"):
        query_span(("1990",))


def _toy():
    """Two queries; each run ranks a time-wrong paragraph above the gold one (the only dated match)."""
    docs = [rec("g1", ("1995", "1995")), rec("w1", ("1980", "1980")), rec("u1"),
            rec("g2", ("2004", "2004"), ("1970", "1970")), rec("w2", ("1970", "1970"), ("2004", "2004")),
            rec("x2", ("1971", "1971"))]
    queries = [q("a", [("1994", "1996")], {"g1": 1}), q("b", [("2003", "2005")], {"g2": 1})]
    run = {"a": {"w1": 0.9, "u1": 0.85, "g1": 0.8}, "b": {"w2": 0.9, "x2": 0.88, "g2": 0.7}}
    return run, queries, docs


def test_rerank_keeps_documents_and_only_shifts_matching_scores():
    run, queries, docs = _toy()
    tp = TimePrior("any_inside", c=0.5)
    out = tp.rerank(run, queries, docs)
    assert {k: set(v) for k, v in out.items()} == {k: set(v) for k, v in run.items()}
    assert out["a"] == pytest.approx({"w1": 0.9, "u1": 0.85, "g1": 1.3})
    # any_inside: both g2 and w2 hold 2004; first_date: only g2's first expression is 2004
    assert out["b"] == pytest.approx({"w2": 1.4, "x2": 0.88, "g2": 1.2})
    first = TimePrior("first_date", c=0.5).rerank(run, queries, docs)
    assert first["b"] == pytest.approx({"w2": 0.9, "x2": 0.88, "g2": 1.2})
    # the input run is not modified; c=0 gives the run back
    assert run["a"]["g1"] == 0.8
    assert TimePrior("any_inside").rerank(run, queries, docs, c=0.0) == run


def test_fit_picks_the_c_that_maximises_ndcg_on_the_given_run():
    from tempokern.eval.metrics import per_query_metrics, rank_documents
    run, queries, docs = _toy()
    grid = [0.0, 0.05, 0.12, 0.3]
    tp = TimePrior("first_date", grid=grid).fit(run, queries, docs)
    # the objective by hand: mean nDCG@10 of the reranked run at each c
    want = []
    for c in grid:
        rr = TimePrior("first_date", c=c).rerank(run, queries, docs)
        want.append(np.mean([per_query_metrics(rank_documents(rr[x.id]), set(x.gold))["nDCG@10"] for x in queries]))
    assert tp.fit_report["objective"] == pytest.approx(want)
    # g1 needs c > 0.1 and g2 c > 0.2: 0.3 is the only grid value that puts both on top
    assert tp.c == 0.3 and tp.fit_report["objective_best"] == pytest.approx(1.0)
    assert tp.fit_report["objective_c0"] == pytest.approx(want[0]) and want[0] < 1.0
    # ties go to the smallest c: with any_inside, g2 never beats w2 (both match): c = 0.3 and 0.5 both put g1
    # first and g2 second
    tp2 = TimePrior("any_inside", grid=[0.5, 0.3, 0.0]).fit(run, queries, docs)
    assert tp2.c == 0.3 and tp2.fit_report["objective"][0] == tp2.fit_report["objective"][1]
    # the default grid is relative to the run's score scale (median of top-1 minus last per query)
    tp3 = TimePrior("first_date").fit(run, queries, docs)
    scale = sorted([0.9 - 0.8, 0.9 - 0.7])[1]
    assert tp3.fit_report["grid"] == pytest.approx([m * scale for m in GRID_MULTIPLIERS])
    assert tp3.fit_report["objective_best"] == pytest.approx(1.0)
    # the fitted c applies to another run (the API takes the run you pass: fit never sees it)
    assert tp.rerank({"a": {"w1": 0.2, "g1": 0.0}}, queries, docs)["a"]["g1"] == pytest.approx(0.3)


def test_timekde_matches_the_chunqiutr_prior():
    from tempokern.baselines.timekde import time_kde_prior
    docs = [rec(f"d{i}", (str(y), str(y))) for i, y in enumerate([1990, 1990, 1991, 1995, 2010])] + [rec("u")]
    queries = {"a": (None, None)}
    run = {"a": {f"d{i}": s for i, s in enumerate([0.9, 0.8, 0.7, 0.6, 0.5])} | {"u": 0.4}}
    tp = TimePrior("timekde", kde_topk=3, kde_sigma=1.0)
    m = tp.match_scores(run, queries, docs)["a"]
    years = np.asarray([0, 0, 1, 5, 20, -1])          # bins: years since 1990; -1 untimed
    p = time_kde_prior(np.asarray([0.9, 0.8, 0.7, 0.6, 0.5, 0.4]) + 1.0, years, 21, topk=3, sigma=1.0)
    for i in range(5):
        assert m[f"d{i}"] == pytest.approx(math.log(p[i] + 1e-8) - math.log(1 / 21))
    assert m["u"] == 0.0
    # the density comes from the top 3 (1990, 1990, 1991): 1990 scores highest; 1995 and 2010 lie beyond the
    # kernel's 3 sigma and get the floor
    assert m["d0"] > m["d2"] > m["d3"] and m["d3"] == m["d4"] == pytest.approx(math.log(1e-8) - math.log(1 / 21))


def test_bad_input_names_the_argument():
    run, queries, docs = _toy()
    with pytest.raises(ValueError, match="match"):
        TimePrior("nearest")
    with pytest.raises(ValueError, match="relation"):
        TimePrior(relation="near")
    with pytest.raises(ValueError, match="grid"):
        TimePrior(grid=[])
    with pytest.raises(ValueError, match="kde_topk"):
        TimePrior("timekde", kde_topk=0)
    with pytest.raises(ValueError, match="c must"):
        TimePrior(c=float("nan"))
    with pytest.raises(ValueError, match="c is not set"):
        TimePrior().rerank(run, queries, docs)
    with pytest.raises(TypeError, match="run must be"):
        TimePrior(c=1.0).rerank([("a", "g1")], queries, docs)
    with pytest.raises(ValueError, match=r"run\['a'\]\['g1'\]"):
        TimePrior(c=1.0).rerank({"a": {"g1": float("inf")}}, queries, docs)
    with pytest.raises(KeyError, match="queries"):
        TimePrior(c=1.0).rerank({"zz": {"g1": 1.0}}, queries, docs)
    with pytest.raises(KeyError, match="docs"):
        TimePrior(c=1.0).rerank({"a": {"nope": 1.0}}, queries, docs)
    with pytest.raises(ValueError, match="gold"):
        TimePrior().fit(run, [q("a", [("1994", "1996")]), q("b", [])], docs)
    with pytest.raises(TypeError, match="docs"):
        TimePrior(c=1.0).rerank(run, queries, 42)
