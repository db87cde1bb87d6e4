"""The English comparison suite (tempokern.suite): metrics against hand-computed values, bootstrap
intervals, resume / corrupt-unit detection, skipped methods, and the quick suite end to end on a tiny
hand-made set with a tiny backbone."""
import calendar as _pycal
import json
import math
from collections import namedtuple
from dataclasses import dataclass, field

import numpy as np
import pytest

from tempokern.calendar import Calendar
from tempokern.datasets import Query, Record, RetrievalDataset
from tempokern.suite import Budget, Method, MethodOutput, register, registered, unregister
from tempokern.suite.metrics import (bootstrap_ci, error_kind, paired_bootstrap_ci, spearman, split_metrics,
                                     strip_spans)
from tempokern.suite.runner import read_unit, run_suite, unit_path

TrainRow = namedtuple("TrainRow", "query_id query positive hard_negatives negative_kinds negative_queries")


@dataclass
class TinySynth:
    name: str
    dataset: RetrievalDataset
    calendar: Calendar
    train_rows: list
    info: dict = field(default_factory=dict)


ENTITIES = ("acme", "globex")
ATTRS = ("price", "volume")
MONTHS = [(2010, m) for m in range(1, 13)] + [(2011, m) for m in range(1, 4)]
QT = ["what was the {a} of {e} in {mon} {y}?", "{e} {a} {mon} {y}", "tell me {e}'s {a} for {mon} of {y}"]


def tiny_synth(name="B", seed=0, size="quick"):
    """A SynthSet-shaped monthly-facts set: 2 entities x 2 attributes x 15 months; splits: templates
    0-1 of 2010-01..10 train, template 2 test_template, 2010-11/12 test_date, 2011 test_year, timeless."""
    cal = Calendar.gregorian(2010, 2011, resolution="month")
    recs, qs, rows = [], [], []
    for e in ENTITIES:
        for a in ATTRS:
            for (y, m) in MONTHS:
                mon = _pycal.month_name[m]
                when = f"{mon} {y}"
                text = f"The {a} of {e} in {when} was {(y * 7 + m * 13 + len(e) * 3 + len(a)) % 97}."
                start = text.index(when)
                recs.append(Record(id=f"{e}-{a}-{y}-{m:02d}", text=text, interval=cal.interval((y, m)),
                                   meta={"entity": e, "attribute": a, "date": f"{y}-{m:02d}-01", "template": 0,
                                         "masked": False, "temporal_spans": [[start, start + len(when)]]}))
    ids = {r.id for r in recs}
    for r in recs:
        e, a, y, m = r.meta["entity"], r.meta["attribute"], *map(int, r.id.split("-")[2:])
        twin_m = m + 1 if (y, m + 1) in MONTHS else m - 1
        twin = f"{e}-{a}-{y}-{twin_m:02d}"
        assert twin in ids
        for t, tpl in enumerate(QT):
            if y == 2011:
                split = "test_year" if t == 0 else None
            elif m >= 11:
                split = "test_date" if t == 0 else None
            else:
                split = "train" if t < 2 else "test_template"
            if split is None:
                continue
            qid = f"q-{r.id}-{t}"
            text = tpl.format(a=a, e=e, mon=_pycal.month_name[m], y=y)
            qs.append(Query(id=qid, text=text, interval=r.interval, gold={r.id: 1}, split=split,
                            meta={"entity": e, "attribute": a, "date": r.meta["date"], "template": t,
                                  "kind": "explicit", "time_wrong_twin": twin}))
            if split == "train":
                rows.append(TrainRow(qid, text, r.id, [twin], ["time_wrong"], []))
    for e in ENTITIES:
        for a in ATTRS:
            gold = {r.id: 1 for r in recs if r.meta["entity"] == e and r.meta["attribute"] == a}
            qs.append(Query(id=f"q-{e}-{a}-timeless", text=f"what is the {a} of {e}?", gold=gold, split="timeless",
                            meta={"entity": e, "attribute": a, "kind": "timeless", "time_wrong_twin": None}))
    ds = RetrievalDataset(f"tiny-{name}", recs, qs, cal)
    return TinySynth(name, ds, cal, rows, {"seed": seed, "size": size})


@pytest.fixture(autouse=True)
def one_thread():
    """A 32-wide BERT gains nothing from a second thread, and on shared cores OpenMP's spinning makes
    each step of it 100x slower."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory):
    from tempokern.models import build_char_tokenizer, tiny_bert
    ds = tiny_synth().dataset
    tok = build_char_tokenizer([r.text for r in ds.records] + [q.text for q in ds.queries])
    model = tiny_bert(len(tok), hidden=32, layers=1, heads=2, intermediate=64, max_position=128, seed=0)
    path = tmp_path_factory.mktemp("bb")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# ---- metrics, by hand -----------------------------------------------------------------------------------

def _hand_dataset():
    cal = Calendar.gregorian(2010, 2010, resolution="month")
    R = lambda i, e, a, m: Record(id=i, text=i, interval=cal.interval((2010, m)), meta={"entity": e, "attribute": a})
    recs = [R("d1", "acme", "price", 3), R("d2", "acme", "price", 4), R("d3", "globex", "price", 3),
            R("d4", "globex", "price", 5), R("d5", "acme", "volume", 3)]
    Q = lambda i, e, a, gold, m=None, twin=None: Query(
        id=i, text=i, interval=cal.interval((2010, m)) if m else None, gold={g: 1 for g in gold}, split="t",
        meta={"entity": e, "attribute": a, "time_wrong_twin": twin})
    qs = [Q("q1", "acme", "price", ["d1"], 3, "d2"),          # top-1 = time-wrong twin
          Q("q2", "globex", "price", ["d3", "d4"]),             # timeless, top-1 entity-wrong
          Q("q3", "acme", "price", ["d1"], 3, "d2"),            # top-1 attribute-wrong, twin absent
          Q("q4", "acme", "volume", ["d5"], 3)]                 # correct, no twin
    run = {"q1": {"d2": 3.0, "d1": 2.0, "d3": 1.0},
           "q2": {"d1": 5.0, "d3": 4.0},
           "q3": {"d5": 9.0, "d4": 8.0, "d1": 7.0},
           "q4": {"d5": 1.0, "d1": 0.5}}
    return RetrievalDataset("hand", recs, qs, cal), run


def test_split_metrics_against_hand_computed_values():
    ds, run = _hand_dataset()
    m = split_metrics(run, ds, "t")
    assert m["qids"] == ["q1", "q2", "q3", "q4"]
    L3 = 1 / math.log2(3)
    np.testing.assert_allclose(m["R@1"], [0, 0, 0, 1])
    np.testing.assert_allclose(m["R@5"], [1, 1, 1, 1])
    np.testing.assert_allclose(m["MRR@10"], [1 / 2, 1 / 2, 1 / 3, 1])
    np.testing.assert_allclose(m["nDCG@10"], [L3, L3 / (1 + L3), 1 / math.log2(4), 1])
    np.testing.assert_allclose(m["recall@100"], [1, 0.5, 1, 1])
    # TEMPO with interval verdicts: q1's ranking d2 (Apr: 0), d1 (Mar: 1), d3 (Mar: 1)
    # q3's: d5 (Mar: 1), d4 (May: 0), d1 (Mar: 1); q4's: d5 (Mar: 1), d1 (Mar: 1)
    np.testing.assert_allclose(m["TP@10"][[0, 2, 3]], [(1 / 2 + 2 / 3) / 2, (1 + 2 / 3) / 2, 1.0])
    np.testing.assert_allclose(m["TR@10"][[0, 2, 3]], [2 / 3, 2 / 3, 1.0])
    assert math.isnan(m["TP@10"][1]) and math.isnan(m["TR@10"][1])    # timeless: no interval
    np.testing.assert_allclose(m["err_time"], [1, 0, 0, 0])
    np.testing.assert_allclose(m["err_entity"], [0, 1, 0, 0])
    np.testing.assert_allclose(m["err_attribute"], [0, 0, 1, 0])
    np.testing.assert_allclose(m["err_other"], [0, 0, 0, 0])
    assert m["time_swap"][0] == 0 and m["time_swap"][2] == 1          # twin ranked above gold / absent
    assert math.isnan(m["time_swap"][1]) and math.isnan(m["time_swap"][3])


def test_error_kinds_and_missing_meta():
    q = Query(id="q", text="", meta={"entity": "a", "attribute": "x"})
    mk = lambda **meta: Record(id="d", text="", meta=meta)
    assert error_kind(q, mk(entity="a", attribute="x")) == "time"
    assert error_kind(q, mk(entity="b", attribute="x")) == "entity"
    assert error_kind(q, mk(entity="a", attribute="y")) == "attribute"
    assert error_kind(q, mk(entity="b", attribute="y")) == "other"
    assert error_kind(q, mk()) == "other"


def test_bootstrap_interval_contains_the_mean_and_shrinks():
    rng = np.random.default_rng(0)
    small = (rng.random(40) < 0.4).astype(float)
    big = (rng.random(4000) < 0.4).astype(float)
    for x in (small, big):
        mean, lo, hi = bootstrap_ci(x, 1000, seed=1)
        assert mean == pytest.approx(x.mean())
        assert lo <= mean <= hi and lo < hi
    w_small = np.subtract(*bootstrap_ci(small)[2:0:-1])
    w_big = np.subtract(*bootstrap_ci(big)[2:0:-1])
    assert w_big < w_small / 4          # ~ 1/sqrt(n): 10x more queries -> ~3.2x narrower... at 100x, ~10x
    assert all(math.isnan(v) for v in bootstrap_ci([math.nan, math.nan]))
    # NaNs are left out
    assert bootstrap_ci([1.0, math.nan, 0.0])[0] == 0.5


def test_paired_bootstrap():
    rng = np.random.default_rng(2)
    b = rng.random(300)
    d, lo, hi = paired_bootstrap_ci(b + 0.1, b)
    assert d == pytest.approx(0.1) and lo == pytest.approx(0.1) and hi == pytest.approx(0.1)
    a = b + rng.normal(0, 0.05, 300)
    d, lo, hi = paired_bootstrap_ci(a, b)
    assert lo <= d <= hi and lo < 0 < hi or abs(d) > 0.005
    with pytest.raises(ValueError, match="same queries"):
        paired_bootstrap_ci([1.0, 2.0], [1.0])


def test_paired_difference_uses_the_seeds_row_and_baseline_share():
    from tempokern.suite.report import build_results
    qids = ["q0", "q1", "q2", "q3"]

    def unit(r1):
        return {"splits": {"dev": {"qids": qids, "R@1": r1, "nDCG@10": r1}}}
    units = {("minilm_ft", "T", 0): unit([1.0, 0.0, 1.0, 0.0]), ("minilm_ft", "T", 1): unit([0.0] * 4),
             ("tmrl", "T", 0): unit([1.0, 0.0, 1.0, 0.0]), ("bm25", "T", 0): unit([1.0, 0.0, 1.0, 0.0])}
    status = {"minilm_ft": {"seeded": True}, "tmrl": {"seeded": True}, "bm25": {"seeded": False}}
    res = build_results(units, status, {}, n_resamples=200)
    pr = res["paired"]["T"]["dev"]
    # a seeded row with seed 0 only is compared with the baseline's seed 0 (the same numbers: 0), not with the
    # baseline's mean over seeds 0 and 1 (which would give +0.25)
    assert pr["tmrl"]["R@1"]["delta"] == pytest.approx(0.0) and pr["tmrl"]["R@1"]["seeds"] == [0]
    # an unseeded row against every seed of the baseline
    assert pr["bm25"]["R@1"]["delta"] == pytest.approx(0.25) and pr["bm25"]["R@1"]["seeds"] == [0, 1]
    assert res["results"]["T"]["dev"]["minilm_ft"]["R@1"]["mean"] == pytest.approx(0.25)
    # no LoRA row: no second comparison
    assert res["paired_vs"] == {}


def test_every_row_is_also_paired_against_lora_fine_tuning():
    """The second baseline (TMRL's strong baseline, LoRA fine-tuning): every other row against `lora` on the
    seeds both have, in results.json (paired_vs) and in results.md."""
    from tempokern.suite.report import build_results, markdown
    qids = ["q0", "q1", "q2", "q3"]

    def unit(r1):
        return {"splits": {"dev": {"qids": qids, "R@1": r1, "nDCG@10": r1}}}
    units = {("minilm_ft", "T", 0): unit([1.0, 0.0, 0.0, 0.0]), ("lora", "T", 0): unit([1.0, 1.0, 0.0, 0.0]),
             ("lora", "T", 1): unit([1.0, 1.0, 1.0, 1.0]), ("tmrl", "T", 0): unit([1.0, 1.0, 1.0, 0.0])}
    status = {n: {"seeded": True, "family": "x", "sets": ["T"], "status": "done"} for n in ("minilm_ft", "lora", "tmrl")}
    res = build_results(units, status, {}, n_resamples=200)
    vs = res["paired_vs"]["lora"]["T"]["dev"]
    assert set(vs) == {"minilm_ft", "tmrl"}
    assert vs["tmrl"]["nDCG@10"]["delta"] == pytest.approx(0.25) and vs["tmrl"]["nDCG@10"]["seeds"] == [0]
    assert vs["minilm_ft"]["R@1"]["delta"] == pytest.approx(-0.25)
    assert res["paired"]["T"]["dev"]["lora"]["R@1"]["delta"] == pytest.approx(0.25)
    res["setup"] = {"budget": {"max_train_rows": 8, "epochs": 1, "batch_size": 4, "lr": 1e-4, "max_length": 16},
                    "quick": False, "date": "d", "machine": "m", "device": "cpu", "backbone": "b", "seeds": [0, 1],
                    "bootstrap_resamples": 200}
    md = markdown(res)
    assert "Paired against `minilm_ft`" in md and "Paired against `lora`" in md
    assert md.index("Paired against `lora`") > md.index("Paired against `minilm_ft`")


def test_spearman_and_strip_spans():
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(1.5 / math.sqrt(3))
    assert spearman([3, 2, 1], [1, 2, 3]) == pytest.approx(-1)
    assert strip_spans("Sales in March 2014 were 5.", [[9, 19]]) == "Sales in were 5."


# ---- runner: resume, corruption, skipped methods ------------------------------------------------------

CALLS = {"n": 0}


def _fake_run(ctx):
    """Deterministic: the gold document first for queries with an even index, last otherwise."""
    CALLS["n"] += 1
    runs = {}
    docs = [r.id for r in ctx.gallery()]
    for sp in ctx.eval_splits:
        runs[sp] = {}
        for i, q in enumerate(ctx.queries(sp)):
            s = {d: float(k) / len(docs) for k, d in enumerate(docs)}
            for g in q.gold:
                s[g] = 2.0 if (i + ctx.seed) % 2 == 0 else -1.0
            runs[sp][q.id] = s
    return MethodOutput(runs, info={"metrics": {sp: {"calls": float(CALLS["n"])} for sp in ctx.eval_splits}},
                        pair_sims=[0.0] * len(ctx.retention_pairs()))


@pytest.fixture
def fake_methods():
    added = [register(Method("fake_oracle", "test", ("B",), _fake_run)),
             register(Method("needy", "test", ("B",), _fake_run, needs=("no_such_module_xyz",)))]
    yield added
    for m in added:
        unregister(m.name)


def test_resume_skips_finished_units_and_recomputes_a_corrupt_one(tmp_path, tiny_backbone, fake_methods):
    kw = dict(quick=True, sets=["B"], methods=["fake_oracle", "needy"], seeds=[0, 1], synth_loader=tiny_synth,
              backbone_path=tiny_backbone, plots=False, progress=False, log=lambda m: None, n_resamples=200)
    CALLS["n"] = 0
    res = run_suite(tmp_path, **kw)
    assert CALLS["n"] == 2
    st = res["methods"]
    assert st["fake_oracle"]["status"] == "done"
    assert st["needy"]["status"] == "skipped" and "no_such_module_xyz" in st["needy"]["reason"]
    md = (tmp_path / "results.md").read_text()
    assert "`needy`" in md and "skipped" in md and "no_such_module_xyz" in md
    r1 = res["results"]["B"]["test_template"]["fake_oracle"]["R@1"]
    # seed 0: even-indexed queries right, seed 1: odd ones: each seed's R@1 ~ 1/2, mean of per-query averages 1/2
    assert r1["mean"] == pytest.approx(0.5) and len(r1["seeds"]) == 2
    n = r1["n"]
    assert sorted(r1["seeds"]) == pytest.approx(sorted([math.ceil(n / 2) / n, math.floor(n / 2) / n]))
    assert res["results"]["B"]["test_template"]["fake_oracle"]["extra"]["calls"] in (1.0, 1.5, 2.0)
    pq = res["per_query"]["B"]["test_template"]
    assert len(pq["qids"]) == n and len(pq["fake_oracle"]["0"]["R@1"]) == n
    # a rerun does nothing new
    res2 = run_suite(tmp_path, **kw)
    assert CALLS["n"] == 2
    assert res2["results"]["B"] == res["results"]["B"]
    # a corrupt unit (truncated file) and a tampered one (checksum mismatch) are recomputed
    p0, p1 = unit_path(tmp_path, "fake_oracle", "B", 0), unit_path(tmp_path, "fake_oracle", "B", 1)
    p0.write_text(p0.read_text()[:100])
    doc = json.loads(p1.read_text())
    doc["payload"]["splits"]["test_template"]["R@1"][0] = 0.25
    p1.write_text(json.dumps(doc))
    assert read_unit(p0) is None and read_unit(p1) is None
    res3 = run_suite(tmp_path, **kw)
    assert CALLS["n"] == 4
    assert read_unit(p0) is not None and read_unit(p1) is not None
    assert res3["results"]["B"]["test_template"]["fake_oracle"]["R@1"] == r1


def test_report_only_runs_nothing_and_reports_the_finished_units(tmp_path, tiny_backbone, fake_methods):
    kw = dict(quick=True, sets=["B"], synth_loader=tiny_synth, backbone_path=tiny_backbone, plots=False,
              progress=False, log=lambda m: None, n_resamples=200)
    CALLS["n"] = 0
    run_suite(tmp_path, methods=["fake_oracle"], seeds=[0], **kw)
    assert CALLS["n"] == 1
    register(Method("fake_later", "test", ("B",), _fake_run))
    try:
        res = run_suite(tmp_path, methods=["fake_oracle", "fake_later"], seeds=[0, 1], report_only=True, **kw)
    finally:
        unregister("fake_later")
    assert CALLS["n"] == 1, "report_only ran a method"
    assert not unit_path(tmp_path, "fake_oracle", "B", 1).exists() and not unit_path(tmp_path, "fake_later", "B", 0).exists()
    st = res["methods"]
    assert st["fake_oracle"]["status"] == "done" and st["fake_later"]["status"] == "pending"
    row = res["results"]["B"]["test_template"]
    assert row["fake_oracle"]["seeds_run"] == [0] and "fake_later" not in row
    assert res["setup"]["report_only"] is True
    assert "`fake_later`" in (tmp_path / "results.md").read_text()


def test_unknown_method_or_set_is_rejected(tmp_path, tiny_backbone):
    with pytest.raises(ValueError, match="unknown method"):
        run_suite(tmp_path, quick=True, methods=["nope"], synth_loader=tiny_synth, backbone_path=tiny_backbone)
    with pytest.raises(ValueError, match="unknown set"):
        run_suite(tmp_path, quick=True, sets=["Z"], synth_loader=tiny_synth, backbone_path=tiny_backbone)


def test_registry_validation():
    with pytest.raises(ValueError, match="sets"):
        Method("x", "f", ("Q",), _fake_run)
    with pytest.raises(ValueError, match="name"):
        Method("a b", "f", ("A",), _fake_run)
    with pytest.raises(TypeError, match="callable"):
        Method("x", "f", ("A",), 3)
    m = register(Method("dup_test", "f", ("A",), _fake_run))
    try:
        with pytest.raises(ValueError, match="already registered"):
            register(Method("dup_test", "f", ("A",), _fake_run))
    finally:
        unregister("dup_test")
    with pytest.raises(ValueError, match="lacks split"):
        MethodOutput({"test_date": {}}).validate(["test_date", "test_year"], "m")


# ---- the quick suite end to end (real rows, tiny backbone) ----------------------------------------------

MINE = ["bm25_ties_gold", "bm25_ties_last", "minilm_zeroshot", "minilm_ft", "ctd_baseline", "ctd_context",
        "ctd_bias", "ctd_full"]


def test_quick_suite_end_to_end(tmp_path, tiny_backbone):
    pytest.importorskip("bm25s")
    budget = Budget(max_train_rows=300, epochs=3, max_length=48, batch_size=16, lr=1e-3)
    res = run_suite(tmp_path, quick=True, sets=["B"], methods=MINE, synth_loader=tiny_synth,
                    backbone_path=tiny_backbone, budget=budget, progress=False, log=lambda m: None,
                    n_resamples=200, command="test")
    for name in MINE:
        assert res["methods"][name]["status"] == "done", (name, res["methods"][name])
    tab = res["results"]["B"]
    assert set(tab) == {"test_template", "test_date", "test_year", "timeless"}
    for sp, rows in tab.items():
        assert set(rows) == set(MINE)
        for name, row in rows.items():
            for k in ("R@1", "R@5", "MRR@10", "nDCG@10", "recall@100", "err_time"):
                assert 0.0 <= row[k]["mean"] <= 1.0
                lo, hi = row[k]["ci"]
                assert lo <= row[k]["mean"] + 1e-12 and row[k]["mean"] <= hi + 1e-12
            errs = sum(row[f"err_{k}"]["mean"] for k in ("time", "entity", "attribute", "other"))
            assert errs == pytest.approx(1 - row["R@1"]["mean"])
        # ties ordered gold-first can only help
        assert rows["bm25_ties_gold"]["R@1"]["mean"] >= rows["bm25_ties_last"]["R@1"]["mean"]
    # the zero-shot row keeps the geometry exactly; a trained row has a retention value
    assert tab["test_date"]["minilm_zeroshot"]["retention_spearman"]["mean"] == pytest.approx(1.0)
    assert -1 <= tab["test_date"]["minilm_ft"]["retention_spearman"]["mean"] < 1.0
    assert tab["test_date"]["bm25_ties_gold"]["retention_spearman"] is None
    # fine-tuning trained (loss fell) and the paired comparison is against it
    info = json.loads(unit_path(tmp_path, "minilm_ft", "B", 0).read_text())["payload"]["info"]
    assert info["steps"] >= 4 and info["loss_last_5"] < info["loss_first_5"]
    assert "minilm_ft" not in res["paired"]["B"]["test_date"]
    assert set(res["paired"]["B"]["test_date"]["ctd_full"]) == {"R@1", "MRR@10", "nDCG@10", "time_swap"}
    md = (tmp_path / "results.md").read_text()
    for name in MINE:
        assert f"`{name}`" in md
    assert "### test_year" in md and "Paired against `minilm_ft`" in md
    assert (tmp_path / "plot_setB.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["setup"]["command"] == "test" and saved["results"]["B"] == res["results"]["B"]
    # the English table generator (docs/benchmark-english.md) reads the same results (per-query arrays dropped on import)
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("make_english_table",
                                                  Path(__file__).parent.parent / "benchmarks" / "make_english_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.table(saved, "results.json")
    assert "**Set B, test_date**" in text and "| `minilm_ft` |" in text and "(baseline)" in text
    assert "| `ctd_full` |" in text and ("better" in text or "worse" in text or "no clear difference" in text)


def test_real_quick_set_b_with_bm25(tmp_path, tiny_backbone):
    """The suite on the real generator's quick set B (shared interface 4): every evaluated split of the
    set is scored, the error split and the time-swap are defined from the generator's meta."""
    pytest.importorskip("bm25s")
    synth = pytest.importorskip("tempokern.datasets.synth")
    res = run_suite(tmp_path, quick=True, sets=["B"], methods=["bm25_ties_gold", "bm25_ties_last"],
                    synth_loader=synth.load_synth, backbone_path=tiny_backbone, progress=False,
                    log=lambda m: None, n_resamples=100, plots=False)
    ds = synth.load_synth("B", seed=0, size="quick").dataset
    have = {q.split for q in ds.queries} - {"train", "val"}
    assert set(res["results"]["B"]) == have and "test_masked" in have
    for sp, rows in res["results"]["B"].items():
        g, l = rows["bm25_ties_gold"], rows["bm25_ties_last"]
        assert g["R@1"]["n"] == sum(q.split == sp for q in ds.queries)
        assert g["R@1"]["mean"] >= l["R@1"]["mean"]
        errs = sum(l[f"err_{k}"]["mean"] for k in ("time", "entity", "attribute", "other"))
        assert errs == pytest.approx(1 - l["R@1"]["mean"])
    assert res["results"]["B"]["test_date"]["bm25_ties_gold"]["time_swap"]["n"] > 0
    assert res["results"]["B"]["test_date"]["bm25_ties_gold"]["TP@10"]["n"] > 0


def test_a_unit_made_under_another_budget_is_recomputed(tmp_path, tiny_backbone, fake_methods):
    kw = dict(quick=True, sets=["B"], methods=["fake_oracle"], seeds=[0], synth_loader=tiny_synth,
              backbone_path=tiny_backbone, plots=False, progress=False, log=lambda m: None, n_resamples=50)
    CALLS["n"] = 0
    run_suite(tmp_path, **kw)
    run_suite(tmp_path, **kw)
    assert CALLS["n"] == 1
    run_suite(tmp_path, budget=Budget(max_train_rows=10, epochs=1, max_length=48), **kw)
    assert CALLS["n"] == 2


# ---- training diagnostics in results.json (does the offset bias move anything?) ---------------------------

def test_ctd_bias_diagnostics_against_the_reference_bias():
    """bias_diagnostics: ε and max |bias| over all pairs of the sampled gallery positions, against the float64
    reference op; fewer positions than the sample: every pair; more: sample^2 pairs."""
    import torch
    from types import SimpleNamespace as NS
    from tempokern.nn import OffsetBias
    from tempokern.reference import offset_bias as ref_bias
    from tempokern.suite.methods.ctd import bias_diagnostics
    torch.manual_seed(3)
    ob = OffsetBias(8, 16)
    with torch.no_grad():
        ob.scale.fill_(0.37)
    model = NS(offset_bias=ob, temperature=0.05)
    u = torch.rand(40)
    d = bias_diagnostics(model, u, seed=1)
    w = [p.detach().double() for p in (ob.mlp[0].weight, ob.mlp[0].bias, ob.mlp[2].weight, ob.mlp[2].bias)]
    ud = u.double()
    full = ref_bias(ud, ud, *w, torch.tensor(0.37, dtype=torch.float64))
    mlp = ref_bias(ud, ud, *w, torch.tensor(1.0, dtype=torch.float64))
    assert d["bias_scale"] == pytest.approx(0.37) and d["bias_pairs"] == 1600
    assert d["bias_max_abs"] == pytest.approx(float(full.abs().max()), rel=1e-5)
    assert d["bias_mlp_max_abs"] == pytest.approx(float(mlp.abs().max()), rel=1e-5)
    assert d["bias_max_abs_cosine_units"] == pytest.approx(0.05 * d["bias_max_abs"])
    assert d["bias_u_range"] == pytest.approx([float(u.min()), float(u.max())])
    ub = torch.rand(1000)
    big = bias_diagnostics(model, ub, sample=64, seed=0)
    allp = ref_bias(ub.double(), ub.double(), *w, torch.tensor(0.37, dtype=torch.float64))
    assert big["bias_pairs"] == 64 ** 2 and 0 < big["bias_max_abs"] <= float(allp.abs().max()) * (1 + 1e-5)
    assert big == bias_diagnostics(model, ub, sample=64, seed=0)         # seeded sample
    with torch.no_grad():
        ob.scale.zero_()
    z = bias_diagnostics(model, u)
    assert z["bias_scale"] == 0.0 and z["bias_max_abs"] == 0.0 and z["bias_mlp_max_abs"] > 0


def test_ctd_units_report_the_bias_in_results_json(tmp_path, tiny_backbone, monkeypatch):
    """ctd_bias / ctd_full units carry the bias diagnostics into results.json (methods.<name>.info), ctd_context
    does not; the diagnostics change no metric (the same units with them switched off score the same)."""
    budget = Budget(max_train_rows=40, epochs=1, max_length=48, batch_size=16, lr=1e-3)
    kw = dict(quick=True, sets=["B"], synth_loader=tiny_synth, backbone_path=tiny_backbone, budget=budget,
              progress=False, log=lambda m: None, n_resamples=50, plots=False)
    res = run_suite(tmp_path / "a", methods=["ctd_context", "ctd_bias"], **kw)
    saved = json.loads((tmp_path / "a" / "results.json").read_text())
    info = saved["methods"]["ctd_bias"]["info"]["B/seed0"]
    assert info["steps"] >= 1 and info["bias_pairs"] >= 1
    assert math.isfinite(info["bias_scale"]) and info["bias_scale"] != 0.0      # trained away from its init 0
    assert 0 <= info["bias_max_abs"] <= abs(info["bias_scale"]) * info["bias_mlp_max_abs"] * (1 + 1e-5)
    assert "bias_scale" not in saved["methods"]["ctd_context"]["info"]["B/seed0"]
    import tempokern.suite.methods.ctd as ctd_mod
    monkeypatch.setattr(ctd_mod, "bias_diagnostics", lambda *a, **k: {})
    res2 = run_suite(tmp_path / "b", methods=["ctd_bias"], **kw)
    assert "bias_scale" not in res2["methods"]["ctd_bias"]["info"]["B/seed0"]
    for sp, rows in res2["results"]["B"].items():
        assert rows["ctd_bias"] == res["results"]["B"][sp]["ctd_bias"]


def _english_table_module():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("make_english_table",
                                                  Path(__file__).parent.parent / "benchmarks" / "make_english_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_english_table_perturbed_sets_and_partial_seeds():
    """The English table generator: the perturbed sets get their headline split and a dependence table (B
    against B-2date / B-nopub on the same split, Δ = perturbed − B); a seeded row with fewer seeds than the
    run names its seeds, an unseeded row does not."""
    mod = _english_table_module()

    def cell(v, seeds):
        return {"mean": v, "ci": [v - 0.05, v + 0.05], "seeds": [v] * len(seeds), "n": 400}

    def row(ndcg, seeds):
        return {"R@1": cell(ndcg / 2, seeds), "nDCG@10": cell(ndcg, seeds), "seeds_run": list(seeds),
                "retention_spearman": None}

    full, part = [0, 1, 2], [0]
    res = {"setup": {"date": "2026-01-01 00:00:00 UTC", "machine": "m", "device": "cpu", "seeds": full,
                     "command": "tempokern benchmark --suite english --out /tmp/x"},
           "methods": {"bm25_ties_last": {"seeded": False, "status": "done"},
                       "minilm_ft": {"seeded": True, "status": "done"},
                       "re3-film": {"seeded": True, "status": "done"}},
           "results": {"B": {"test_date": {"bm25_ties_last": row(0.30, part), "minilm_ft": row(0.60, full),
                                           "re3-film": row(0.85, part)},
                             "test_masked": {"minilm_ft": row(0.50, full), "re3-film": row(0.56, part)}},
                       "B-2date": {"test_date": {"bm25_ties_last": row(0.28, part), "minilm_ft": row(0.58, full),
                                                 "re3-film": row(0.27, part)}},
                       "B-nopub": {"test_masked": {"minilm_ft": row(0.50, full), "re3-film": row(0.14, part)}}},
           "paired": {}}
    text = mod.table(res, "x.json")
    assert "--out RUN" in text and "/tmp/x" not in text
    assert "**Set B-2date, test_date**" in text and "**Set B-nopub, test_masked**" in text
    assert "| `re3-film` (seed 0) |" in text and "| `minilm_ft` |" in text and "| `bm25_ties_last` |" in text
    dep = text[text.index("**Set B against its perturbed copies**"):]
    assert "B test_date | B-2date test_date | Δ" in dep and "B test_masked | B-nopub test_masked | Δ" in dep
    re3 = next(line for line in dep.splitlines() if line.startswith("| `re3-film`"))
    assert re3.split(" | ")[1:4] == ["0.850", "0.270", "-0.580"] and re3.rstrip(" |").endswith("-0.420")
    # a row absent on a perturbed set gets n/a and no difference, not a made-up one
    bm = next(line for line in dep.splitlines() if line.startswith("| `bm25_ties_last`"))
    assert bm.split(" | ")[1:4] == ["0.300", "0.280", "-0.020"] and bm.rstrip(" |").endswith("n/a | n/a | —")


def test_committed_english_table_is_current():
    """docs/benchmark-english.md shows the table of the newest committed english-*.json (make_english_table.py
    --write), and every set of the committed run has each registered seeded row on every seed the run names."""
    import json
    mod = _english_table_module()
    src = mod.newest()
    res = json.loads(src.read_text())
    doc = mod.DOC.read_text()
    block = doc[doc.index(mod.START) + len(mod.START):doc.index(mod.END)]
    assert block.strip() == mod.table(res, src.relative_to(mod.ROOT)).strip()
    seeds = res["setup"]["seeds"]
    for s in ("A", "B", "C", "B-2date", "B-nopub"):
        for sp, rows in res["results"][s].items():
            for name, row in rows.items():
                if res["methods"][name].get("seeded", True):
                    assert row["seeds_run"] == seeds, (s, sp, name)


def test_fine_tuning_loss_summary_compares_disjoint_steps():
    """The log line of a fine-tuned row: never a step (or a window of steps) compared with itself."""
    from tempokern.suite.methods.baselines import loss_summary
    assert loss_summary([]) == "no training step"
    assert loss_summary([2.0]) == "loss 2.0000 (one step)"
    assert loss_summary([2.0, 1.0]) == "loss 2.0000 (step 1) -> 1.0000 (step 2)"
    assert loss_summary([4.0, 3.0, 2.0, 1.0, 0.0]) == "loss 3.5000 (mean of steps 1-2) -> 0.5000 (steps 4-5)"
    assert loss_summary(list(range(20, 0, -1))) == "loss 18.0000 (mean of steps 1-5) -> 3.0000 (steps 16-20)"


def test_progress_plan_k_of_n_and_ctrl_c_writes_results_and_says_how_to_resume(tmp_path, tiny_backbone,
                                                                               fake_methods):
    """The plan line (units, done earlier), `k/N` and the time left on every unit line; Ctrl-C inside a unit keeps
    the finished units, writes results.md from them, says how to resume and re-raises (exit 130 in the CLI)."""
    def interrupt_second(ctx):
        if ctx.seed == 1:
            raise KeyboardInterrupt
        return _fake_run(ctx)
    register(Method("fake_stops", "test", ("B",), interrupt_second))
    lines = []
    kw = dict(quick=True, sets=["B"], methods=["fake_oracle", "fake_stops"], seeds=[0, 1], synth_loader=tiny_synth,
              backbone_path=tiny_backbone, plots=False, progress=False, log=lines.append, n_resamples=50,
              command="tempokern benchmark --out RUN")
    try:
        with pytest.raises(KeyboardInterrupt):
            run_suite(tmp_path, **kw)
    finally:
        unregister("fake_stops")
    plan = [l for l in lines if "plan:" in l]
    assert len(plan) == 1 and "4 unit(s)" in plan[0] and "0 done earlier" in plan[0]
    assert "each unit line estimates the time left" in plan[0]    # no committed times for this suite
    units = [l for l in lines if " / set B / seed " in l]
    assert [l.split()[1] for l in units if "running" in l] == ["1/4", "2/4", "3/4", "4/4"]
    done = [l for l in units if "done in" in l]
    assert len(done) == 3 and "1/4" in done[0]
    assert "3 unit(s) left: about 0 s for the 1 of timed rows; 2 of rows not timed yet" in done[0]
    assert "1 unit(s) left, about" in done[2]          # both rows timed: one estimate for all
    assert "4/4 fake_stops / set B / seed 1: interrupted" in units[-1]
    assert "To resume, run the same command again: tempokern benchmark --out RUN" in lines[-1]
    assert "3 of 4 unit(s) finished" in lines[-1]
    md = (tmp_path / "results.md").read_text()
    assert "`fake_stops`" in md and "`fake_oracle`" in md
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["methods"]["fake_oracle"]["status"] == "done" and res["methods"]["fake_stops"]["status"] == "done"
    assert unit_path(tmp_path, "fake_stops", "B", 0).exists() and not unit_path(tmp_path, "fake_stops", "B", 1).exists()
    # the rerun's plan counts the finished units
    lines.clear()
    register(Method("fake_stops", "test", ("B",), _fake_run))
    try:
        run_suite(tmp_path, **kw)
    finally:
        unregister("fake_stops")
    assert "3 done earlier" in next(l for l in lines if "plan:" in l)
    assert sum("done earlier (" in l for l in lines) == 3 and sum("done in" in l for l in lines) == 1


def test_committed_unit_seconds_are_the_committed_runs():
    """tempokern/suite/unit_seconds.json (the first estimate of a TimeQA run on CPU) is the committed run's mean
    seconds per unit of each method."""
    from pathlib import Path
    import tempokern.suite.runner as runner
    root = Path(__file__).resolve().parents[1]
    per = {}
    for p in (root / "benchmarks/results/timeqa/units/timeqa").glob("*/seed*.json"):
        u = json.loads(p.read_text())["payload"]
        per.setdefault(u["method"], []).append(u["wall_seconds"])
    got = runner._committed_unit_seconds("timeqa", False, None)
    assert got == {m: round(sum(v) / len(v), 1) for m, v in per.items()}
    assert runner._committed_unit_seconds("timeqa", True, None) is None
    prog = runner._Progress([("a", "s", 0), ("a", "s", 1), ("b", "s", 0)], {"a": 100.0, "b": 10.0})
    assert prog.left() == (210.0, 3, 0)
    prog.record(("a", "s", 0), 50.0)                      # this machine is twice as fast on a: b scales with it
    assert prog.left()[0] == pytest.approx(50.0 + 5.0)
    assert prog.eta() == "2 unit(s) left, about 55 s"
    prog = runner._Progress([("a", "s", 0), ("b", "s", 0)], None)    # no committed times: only timed rows
    assert prog.left() == (0.0, 0, 2)
    prog.record(("a", "s", 0), 3000.0)
    assert prog.eta() == "1 unit(s) left; 1 of rows not timed yet"


@pytest.mark.parametrize("cols", [1, 3])
def test_plot_titles_fit_the_figure(cols):
    """The suite's plot title is wrapped to the figure's width (one column: it was cut off on both sides)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tempokern.suite.report import fit_suptitle
    fig, _ = plt.subplots(2, cols, figsize=(3.6 * cols + 1, 7))
    text = "Set timeqa: bars = mean over seeds, whiskers = 95% bootstrap interval over queries"
    t = fit_suptitle(fig, text)
    fig.tight_layout()
    fig.canvas.draw()
    box = t.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height
    assert " ".join(t.get_text().split()) == text          # the words all there, only the lines wrapped
    assert ("\n" in t.get_text()) == (cols == 1)
    plt.close(fig)


def test_full_fine_tuning_resumes_inside_a_unit_with_the_same_final_weights(tmp_path, tiny_backbone, monkeypatch):
    """minilm_ft saves its state every CHECKPOINT_EVERY steps; a unit interrupted after k steps, run again,
    resumes there and ends with the weights (and losses) of an uninterrupted run. A state with a flipped byte
    fails its checksum, naming the file, and the unit trains from the first step."""
    import torch
    import dataclasses
    import tempokern.suite.methods.baselines as bl
    from tempokern.suite.backbone import load_backbone
    from tempokern.suite.registry import SuiteContext
    monkeypatch.setattr(bl, "CHECKPOINT_EVERY", 2)
    budget = Budget(max_train_rows=None, epochs=2, max_length=32, batch_size=16, lr=1e-3)
    synth = tiny_synth()
    logs = []

    def ctx(work):
        return SuiteContext(synth=synth, backbone_path=tiny_backbone, seed=3, quick=True, work_dir=work,
                            budget=budget, log=logs.append, progress_enabled=False, method_name="minilm_ft")

    def train(work):
        model, tok = load_backbone(tiny_backbone, torch.device("cpu"))
        info = bl.finetune_infonce(ctx(work), model, tok)
        return info, {k: v.clone() for k, v in model.state_dict().items()}

    full_info, full_w = train(tmp_path / "a")
    assert full_info["steps"] == 10 and full_info["resumed_at_step"] is None
    assert not (tmp_path / "a" / bl.FINETUNE_STATE_DIR).exists()      # removed when training ends
    real, calls = bl.multipos_infonce, {"n": 0}

    def stop_at_step_6(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(bl, "multipos_infonce", stop_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "b")
    assert (tmp_path / "b" / bl.FINETUNE_STATE_DIR / "checksums.json").exists()
    monkeypatch.setattr(bl, "multipos_infonce", real)
    info, w = train(tmp_path / "b")
    assert info["resumed_at_step"] == 4 and info["steps"] == 10
    assert any("resuming fine-tuning at step 4 of 10" in l for l in logs)
    assert info["final_loss"] == full_info["final_loss"] and info["first_loss"] == full_info["first_loss"]
    # (the backbone's pooler, unused by mean pooling, is drawn afresh at each load: not a trained weight)
    trained = [k for k in w if not k.startswith("pooler.")]
    assert w.keys() == full_w.keys() and len(trained) > 10
    assert [k for k in trained if not torch.equal(w[k], full_w[k])] == []
    # a state saved under other settings is not used
    monkeypatch.setattr(bl, "multipos_infonce", stop_at_step_6)
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "c")
    monkeypatch.setattr(bl, "multipos_infonce", real)
    budget = dataclasses.replace(budget, lr=2e-3)
    info, _ = train(tmp_path / "c")
    assert info["resumed_at_step"] is None and any("other settings" in l for l in logs)
    # a damaged state (one byte flipped) is detected, named, and the unit trains from the first step
    budget = dataclasses.replace(budget, lr=1e-3)
    monkeypatch.setattr(bl, "multipos_infonce", stop_at_step_6)
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "d")
    monkeypatch.setattr(bl, "multipos_infonce", real)
    state = tmp_path / "d" / bl.FINETUNE_STATE_DIR / "trainer_state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    state.write_bytes(bytes(raw))
    logs.clear()
    info, w = train(tmp_path / "d")
    said = [l for l in logs if "cannot resume" in l]
    assert len(said) == 1 and f"{state} does not match its checksum" in said[0], logs
    assert "starts from the first step" in said[0]
    assert info["resumed_at_step"] is None and info["steps"] == 10
    assert not any("resuming fine-tuning" in l for l in logs)
    assert info["final_loss"] == full_info["final_loss"]
    assert [k for k in trained if not torch.equal(w[k], full_w[k])] == []
    assert not (tmp_path / "d" / bl.FINETUNE_STATE_DIR).exists()


def test_ctd_unit_interrupted_in_its_second_epoch_resumes_from_the_first(tmp_path, tiny_backbone, monkeypatch):
    """ctd_full keeps epoch checkpoints in the unit's work_dir: a unit stopped in its second epoch resumes from
    the end of the first and scores as an uninterrupted run."""
    from tempokern.training.trainer import CTDTrainer
    budget = Budget(max_train_rows=40, epochs=2, max_length=48, batch_size=16, lr=1e-3)
    kw = dict(quick=True, sets=["B"], methods=["ctd_full"], synth_loader=tiny_synth, backbone_path=tiny_backbone,
              budget=budget, progress=False, n_resamples=50, plots=False)
    full = run_suite(tmp_path / "a", log=lambda m: None, **kw)
    real, calls = CTDTrainer._loss, {"n": 0}
    per_epoch = full["methods"]["ctd_full"]["info"]["B/seed0"]["steps"] // 2

    def stop_in_epoch_2(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == per_epoch + 1:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(CTDTrainer, "_loss", stop_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        run_suite(tmp_path / "b", log=lambda m: None, **kw)
    monkeypatch.setattr(CTDTrainer, "_loss", real)
    lines = []
    res = run_suite(tmp_path / "b", log=lines.append, **kw)
    assert res["methods"]["ctd_full"]["info"]["B/seed0"]["resumed"] is True
    assert any("resumed from" in l and "at epoch 1" in l for l in lines)
    for sp, rows in res["results"]["B"].items():
        assert rows["ctd_full"] == full["results"]["B"][sp]["ctd_full"], sp
