"""The real-data suite's extra splits and time-prior rows (tempokern.suite.prior): each split ranked over its
own gallery (the fit split's training pages, the whole corpus), `+prior` rows derived from each unit's
fitted prior (c fitted on the fit split only), the prior baseline column of the paired tables, units made
before the fit split recomputed (or, with report_only, reported with their `+prior` rows unavailable), the
whole-corpus split switched off, and the rows on a BEIR folder with BM25. Tiny hand-made data; no MiniLM."""
import json
from dataclasses import replace

import pytest

from tempokern.calendar import Calendar
from tempokern.datasets import Query, Record, RetrievalDataset
from tempokern.suite import Budget, Method, MethodOutput, register
from tempokern.suite.prior import derive_prior_rows, prior_baseline
from tempokern.suite.realdata import RealSet, timeqa_set
from tempokern.suite.registry import SuiteContext
from tempokern.suite.runner import run_suite, unit_path

from test_suite_realdata import folder, one_thread, tiny_backbone, write_folder  # noqa: F401  (fixtures)

YEARS = (1990, 1994, 1998, 2002)


def tiny_realset(pages=8, corpus=True):
    """Pages p0..p7, four dated paragraphs each (plus an undated title); a question per dated paragraph
    ("in <year>"). Pages 0-3 train (fit split: pages 0, 1), 4-5 dev (the gallery), 6-7 test: only in the
    whole-corpus split's records."""
    cal = Calendar.gregorian(1990, 2005, resolution="month")
    recs, qs = [], []
    for p in range(pages):
        split = "train" if p < 4 else "dev" if p < 6 else "test"
        recs.append(Record(f"p{p}:0", f"Person {p}", meta={"page": f"p{p}", "entity": f"p{p}", "times": []}))
        for k, y in enumerate(YEARS):
            y = y + p % 2
            recs.append(Record(f"p{p}:{k + 1}", f"Person {p} played for team {k} in {y}.",
                               interval=cal.interval((y,)), meta={"page": f"p{p}", "entity": f"p{p}",
                                                                  "times": [[str(y), str(y)]]}))
            qs.append(Query(f"p{p}#q{k}", f"Which team did person {p} play for in {y}?", interval=cal.interval((y,)),
                            gold={f"p{p}:{k + 1}": 1}, split=split,
                            meta={"page": f"p{p}", "entity": f"p{p}", "times": [[str(y), str(y)]]}))
    inset = [r for r in recs if int(r.meta["page"][1:]) < 6]
    ds = RetrievalDataset("tiny-real", inset, [q for q in qs if q.split != "test"], cal)
    extra = {"fit": {"queries": "train", "query_ids": [q.id for q in qs if q.meta["page"] in ("p0", "p1")],
                     "gallery_ids": [r.id for r in recs if r.meta["page"] in ("p0", "p1")]}}
    if corpus:
        extra["dev@corpus"] = {"queries": "dev", "query_ids": None, "gallery_ids": [r.id for r in recs]}
    return RealSet("timeqa", ds, cal, [], {"checksum": "tiny"}, ["dev"],
                   [r.id for r in inset if r.meta["page"] in ("p4", "p5")], extra_splits=extra,
                   extra_records=[r for r in recs if int(r.meta["page"][1:]) >= 6])


def test_context_serves_each_split_over_its_own_gallery():
    s = tiny_realset()
    ctx = SuiteContext(synth=s, backbone_path="", seed=0, quick=True, work_dir="/tmp/tk-prior-ctx",
                       budget=Budget.real(True))
    assert ctx.eval_splits == ["dev", "fit", "dev@corpus"] and ctx.table_splits == ["dev", "dev@corpus"]
    assert {r.meta["page"] for r in ctx.gallery("dev")} == {"p4", "p5"} == {r.meta["page"] for r in ctx.gallery()}
    assert {r.meta["page"] for r in ctx.gallery("fit")} == {"p0", "p1"}
    assert len(ctx.gallery("dev@corpus")) == 8 * 5
    # the extra splits' queries carry the split's name; the fit split holds only the fit pages' questions
    assert {q.split for q in ctx.queries("fit")} == {"fit"} and len(ctx.queries("fit")) == 8
    assert [q.id for q in ctx.queries("dev@corpus")] == [q.id for q in ctx.queries("dev")]
    assert ctx.eval_dataset("fit").queries_in("fit") and len(ctx.eval_dataset("fit").records) == 10
    # every record once; each split's rows in its gallery's order
    allg = ctx.all_gallery()
    assert len(allg) == len({r.id for r in allg}) == 40
    for sp in (None, "dev", "fit", "dev@corpus"):
        assert [allg[i].id for i in ctx.gallery_index(sp)] == [r.id for r in ctx.gallery(sp)]


CALLS = {"n": 0, "galleries": []}


def _time_blind_run(ctx):
    """A retriever that finds the page but not the time: the question's page's paragraphs score 0.5 - 0.01 k
    (the gold one last among them), other pages 0.1. Each split over its own gallery."""
    CALLS["n"] += 1
    runs = {}
    for sp in ctx.eval_splits:
        gal = ctx.gallery(sp)
        CALLS["galleries"].append((sp, len(gal)))
        runs[sp] = {}
        for q in ctx.queries(sp):
            g = next(iter(q.gold))
            row = {}
            for k, r in enumerate(gal):
                same = r.meta["page"] == q.meta["page"]
                row[r.id] = (0.5 - 0.01 * (k % 5) if same else 0.1) if r.id != g else 0.4
            runs[sp][q.id] = row
    return MethodOutput(runs, info={"train_seconds": 0.0}, pair_sims=[0.0] * len(ctx.retention_pairs()))


@pytest.fixture
def blind_method():
    """A stand-in for the zero-shot row (an untrained base, so its prior row is the baseline column)."""
    from tempokern.suite import get_method, load_methods
    load_methods()
    real = get_method("minilm_zeroshot")
    m = register(Method("minilm_zeroshot", "dense", ("timeqa",), _time_blind_run, seeded=False), replace=True)
    yield m
    register(real, replace=True)          # the real row back for the other tests


def _kw(tiny_backbone, loader=tiny_realset):
    return dict(suite="timeqa", quick=True, methods=["minilm_zeroshot"], seeds=[0], synth_loader=lambda *a, **k: loader(),
                backbone_path=tiny_backbone, plots=False, progress=False, log=lambda m: None, n_resamples=100,
                corpus=True)


def test_prior_rows_are_fitted_on_the_fit_split_and_paired(tmp_path, tiny_backbone, blind_method):
    CALLS.update(n=0, galleries=[])
    res = run_suite(tmp_path, **_kw(tiny_backbone))
    assert CALLS["n"] == 1
    assert dict(CALLS["galleries"]) == {"dev": 10, "fit": 10, "dev@corpus": 40}
    table = res["results"]["timeqa"]
    assert set(table) == {"dev", "dev@corpus"}       # the fit split is never a table
    for sp in ("dev", "dev@corpus"):
        base, prior = table[sp]["minilm_zeroshot"], table[sp]["minilm_zeroshot+prior"]
        assert base["R@1"]["mean"] == 0.0            # the gold paragraph is never first
        assert prior["R@1"]["mean"] == 1.0           # its year is the question's: the prior puts it first
    st = res["methods"]["minilm_zeroshot+prior"]
    assert st["status"] == "done" and st["family"] == "prior" and "match" in st["description"]
    summ = res["prior"]["timeqa"]["minilm_zeroshot"]["seeds"]["0"]
    assert summ["fit_queries"] == 8 and summ["fit_gallery"] == 10
    for m in ("any_inside", "first_date", "timekde"):
        assert m in summ["matches"]
    c = summ["matches"]["any_inside"]["c"]
    assert c > 0.1 and summ["matches"]["any_inside"]["fit"]["nDCG@10"] == pytest.approx(1.0)
    assert summ["matches"]["any_inside"]["fit"]["nDCG@10_c0"] < 1.0
    assert st["info"]["timeqa/seed0"]["c"] == summ["matches"][summ["chosen"]]["c"]
    # the untrained prior row is a baseline column: every row is paired against it
    assert res["prior_baseline"]["timeqa"] == "minilm_zeroshot+prior"
    d = res["paired_vs"]["minilm_zeroshot+prior"]["timeqa"]["dev"]["minilm_zeroshot"]["R@1"]["delta"]
    assert d == pytest.approx(-1.0)
    md = (tmp_path / "results.md").read_text()
    assert "### dev@corpus" in md and "### Time prior" in md and "Paired against `minilm_zeroshot+prior`" in md


def test_units_without_the_prior_are_recomputed_or_reported_unavailable(tmp_path, tiny_backbone, blind_method):
    CALLS.update(n=0, galleries=[])
    run_suite(tmp_path, **_kw(tiny_backbone))
    p = unit_path(tmp_path, "minilm_zeroshot", "timeqa", 0)
    # a unit made before the fit split: no prior, no whole-corpus split (its checksum made consistent)
    from tempokern.suite.runner import write_unit
    doc = json.loads(p.read_text())
    old = doc["payload"]
    old.pop("prior")
    old["splits"].pop("dev@corpus")
    write_unit(p, old)
    res = run_suite(tmp_path, **{**_kw(tiny_backbone), "report_only": True})
    assert CALLS["n"] == 1, "report_only ran a method"
    st = res["methods"]["minilm_zeroshot+prior"]
    assert st["status"] == "unavailable" and "before the fit split" in st["reason"]
    assert set(res["results"]["timeqa"]) == {"dev"}
    md = (tmp_path / "results.md").read_text()
    assert "`minilm_zeroshot+prior`" in md and "unavailable" in md
    # a run recomputes it
    res = run_suite(tmp_path, **_kw(tiny_backbone))
    assert CALLS["n"] == 2 and res["methods"]["minilm_zeroshot+prior"]["status"] == "done"
    assert "dev@corpus" in json.loads(p.read_text())["payload"]["splits"]
    # and then reuses it
    run_suite(tmp_path, **_kw(tiny_backbone))
    assert CALLS["n"] == 2
    # a prior fitted under other settings (here: another relation) is recomputed too
    doc = json.loads(p.read_text())["payload"]
    doc["prior"]["definition"]["relation"] = "overlap"
    write_unit(p, doc)
    run_suite(tmp_path, **_kw(tiny_backbone))
    assert CALLS["n"] == 3 and json.loads(p.read_text())["payload"]["prior"]["definition"]["relation"] == "inside"


def test_corpus_split_can_be_switched_off(tmp_path, tiny_backbone, blind_method):
    CALLS.update(n=0, galleries=[])
    res = run_suite(tmp_path, **{**_kw(tiny_backbone), "corpus": False})
    assert dict(CALLS["galleries"]) == {"dev": 10, "fit": 10}
    assert set(res["results"]["timeqa"]) == {"dev"} and "minilm_zeroshot+prior" in res["results"]["timeqa"]["dev"]


def test_derive_prior_rows_without_units_and_baseline_rule():
    units = {("bm25_ties_last", "timeqa", 0): {"splits": {}, "prior": {"chosen": "any_inside", "matches": {
        "any_inside": {"c": 1.0, "fit": {"nDCG@10": 0.4}, "splits": {}}}}},
             ("minilm_zeroshot", "timeqa", 0): {"splits": {}, "prior": {"chosen": "timekde", "matches": {
                 "timekde": {"c": 0.1, "fit": {"nDCG@10": 0.5}, "splits": {}}}}},
             ("minilm_ft", "timeqa", 0): {"splits": {}, "prior": {"chosen": "timekde", "matches": {
                 "timekde": {"c": 0.1, "fit": {"nDCG@10": 0.9}, "splits": {}}}}}}
    # the trained row's fit split is its own training questions: never the baseline, whatever its fit value
    assert prior_baseline(units, "timeqa") == "minilm_zeroshot+prior"
    status = {n: {"family": "x", "sets": ["timeqa", "B"], "seeded": n == "minilm_ft"} for n in
              ("bm25_ties_last", "minilm_zeroshot", "minilm_ft", "ctd_full")}
    units[("ctd_full", "B", 0)] = {"splits": {}}          # a set without a fit split: no prior row
    derived, st, summ = derive_prior_rows(units, status, ["timeqa"])
    assert set(st) == {"bm25_ties_last+prior", "minilm_zeroshot+prior", "minilm_ft+prior"}   # ctd_full: none here
    assert st["minilm_ft+prior"]["seeded"] and st["minilm_ft+prior"]["sets"] == ["timeqa"]
    assert derived[("minilm_ft+prior", "timeqa", 0)]["info"] == {"match": "timekde", "c": 0.1}


def test_prior_rows_on_a_beir_folder_with_bm25(tmp_path, folder, tiny_backbone):  # noqa: F811
    pytest.importorskip("bm25s")
    res = run_suite(tmp_path, suite="data", data_dir=str(folder), quick=True, methods=["bm25_ties_last"],
                    backbone_path=tiny_backbone, progress=False, log=lambda m: None, n_resamples=50, plots=False)
    for sp in ("dev", "test"):
        assert set(res["results"]["data"][sp]) == {"bm25_ties_last", "bm25_ties_last+prior"}
    summ = res["prior"]["data"]["bm25_ties_last"]["seeds"]["0"]
    # the fit split: the 20 training questions over the whole corpus (36 paragraphs)
    assert summ["fit_queries"] == 20 and summ["fit_gallery"] == 36
    assert res["setup"]["set_info"]["data"]["extra_splits"]["fit"]["gallery"] == 36


def test_timeqa_set_fit_and_corpus_splits():
    s = timeqa_set("quick")
    ds = s.dataset
    fit = s.extra_splits["fit"]
    train_pages = {q.meta["page"] for q in ds.queries if q.split == "train"}
    fit_pages = {ds.record(i).meta["page"] for i in fit["gallery_ids"]}
    # as many training pages as held-out pages, their paragraphs and their training questions only
    assert fit_pages <= train_pages and len(fit_pages) == s.info["eval_pages"]
    assert set(fit["gallery_ids"]) == {r.id for r in ds.records if r.meta["page"] in fit_pages}
    fq = [q for q in ds.queries if q.id in set(fit["query_ids"])]
    assert fq and all(q.split == "train" and q.meta["page"] in fit_pages for q in fq)
    assert not set(fit["gallery_ids"]) & set(s.gallery_ids)
    # the whole corpus: every packaged paragraph, the set's records plus the other pages' (with their entity)
    from tempokern.datasets.timeqa import load_timeqa
    full = load_timeqa()
    corpus = s.extra_splits["dev@corpus"]
    assert corpus["queries"] == "dev" and corpus["gallery_ids"] == [r.id for r in full.records]
    assert {r.id for r in ds.records} | {r.id for r in s.extra_records} == set(corpus["gallery_ids"])
    assert all(r.meta["entity"] == r.meta["page"] for r in s.extra_records)
    # the splits do not change the set's checksum (units made before them keep their settings)
    off = timeqa_set("quick", corpus=False)
    assert "dev@corpus" not in off.extra_splits and off.info["checksum"] == s.info["checksum"]
