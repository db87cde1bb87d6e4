"""The recency-filter rows of the English suite (tempokern/suite/methods/recency.py) on a small set shaped
like set C (facts name the metric only, meta["date"] the day; the observation is the latest version)."""
import datetime as dt
import json
from types import SimpleNamespace

import pytest

from tempokern.datasets import Query, Record, RetrievalDataset
from tempokern.eval import rank_documents
from tempokern.suite import SuiteContext, get_method
from tempokern.suite.methods import recency as rec_rows

D = dt.date


def versioned(days=6, versions=True):
    recs, qs = [], []
    for i in range(days):
        d = D(2014, 3, 1) + dt.timedelta(days=i)
        obs = 8.0 + i
        meta = lambda v, ver: {"date": d.isoformat(), "version": ver,   # noqa: E731
                               "facts": [{"head": "Seattle", "relation": "high temperature", "value": f"{v:.1f} °C"}]}
        if versions:
            for lag in (3, 2, 1):
                pub = d - dt.timedelta(days=lag)
                v = obs + lag
                recs.append(Record(f"fc{i}-{lag}", f"Forecast published {pub:%B} {pub.day}, 2014: Seattle high on "
                                   f"{d:%B} {d.day}, 2014 of {v:.1f} °C.", published=pub, meta=meta(v, 4 - lag)))
        recs.append(Record(f"obs{i}", f"Observed on {d:%B} {d.day}, 2014: Seattle high of {obs:.1f} °C.",
                           published=d, meta=meta(obs, 4)))
        qs.append(Query(f"q{i}", f"What is the latest forecast high temperature for Seattle on {d:%B} {d.day}, 2014?",
                        gold={f"obs{i}": 1}, split="test_date", meta={"answer": f"{obs:.1f} °C", "kind": "explicit"}))
    return SimpleNamespace(name="C" if versions else "B", dataset=RetrievalDataset("c", recs, qs), train_rows=[],
                           info={})


def ctx_for(synth, tmp_path, name):
    return SuiteContext(synth=synth, backbone_path=str(tmp_path / "no-backbone"), seed=0, quick=True,
                        work_dir=tmp_path / name, method_name=name, log=lambda m: None, progress_enabled=False)


def test_rows_are_registered():
    names = [f"{b}+recency-{v}" for b in rec_rows.BASES for v in rec_rows.VARIANTS
             if not (b == "re3" and v == "none")]   # re3 alone is the re3-film_margins row
    for n in names:
        m = get_method(n)
        assert m.family == "recency" and m.sets == ("B", "C")
        assert m.seeded == n.startswith("re3+")    # zero-shot / BM25 bases are deterministic


def test_fixed_run_hand_computed(tmp_path, monkeypatch):
    synth = versioned()
    # q0: two outdated forecasts of day 0 above its observation, then day 1's observation and an old forecast of day 1
    run = {"q0": {"fc0-3": 9.0, "fc0-1": 8.0, "obs0": 7.0, "obs1": 6.0, "fc1-2": 5.0, "obs5": 1.0},
           "q1": {"obs1": 9.0, "obs2": 8.0, "obs3": 7.0, "obs4": 6.0, "obs5": 5.0}}
    run.update({f"q{i}": {f"obs{i}": 1.0} for i in range(2, 6)})
    monkeypatch.setattr(rec_rows, "base_runs", lambda ctx, base: {"test_date": run})
    out = get_method("bm25+recency-metadata").run(ctx_for(synth, tmp_path, "m"))
    out.validate(["test_date"])
    r = out.runs["test_date"]
    assert r["q0"] == {"obs0": 7.0, "obs1": 6.0, "obs5": 1.0} and r["q1"] == run["q1"]
    m = out.info["metrics"]["test_date"]
    json.dumps(m, allow_nan=False)
    # evidence: q0 5 docs (3 outdated), q1 5 docs, q2..q5 1 doc each = 14 docs before, 11 after
    assert m["stale_rate_base@5"] == pytest.approx(3 / 14) and m["stale_rate@5"] == 0.0
    assert m["version_accuracy_base@5"] == pytest.approx(5 / 6) and m["version_accuracy@5"] == 1.0
    assert m["answer_proxy_base@5"] == pytest.approx(5 / 6) and m["answer_proxy@5"] == 1.0
    assert m["removed"] == 3 and m["queries_with_removals"] == 1 and m["filter_failures"] == 0
    assert m["evidence_docs_base@5"] == pytest.approx(14 / 6) and m["evidence_docs@5"] == pytest.approx(11 / 6)
    # the rule extractor: day 1's forecast does not answer q0 (another date): it stays
    out = get_method("bm25+recency-rule").run(ctx_for(synth, tmp_path, "r"))
    assert out.runs["test_date"]["q0"] == {"obs0": 7.0, "obs1": 6.0, "fc1-2": 5.0, "obs5": 1.0}
    assert out.info["metrics"]["test_date"]["removed"] == 2
    # none: the base run unchanged, before == after
    out = get_method("bm25+recency-none").run(ctx_for(synth, tmp_path, "n"))
    m = out.info["metrics"]["test_date"]
    assert out.runs["test_date"] == run and m["removed"] == 0 and m["stale_rate@5"] == m["stale_rate_base@5"]


def test_bm25_rows_end_to_end_and_neutral_without_versions(tmp_path):
    pytest.importorskip("bm25s")
    rec_rows._BASE_CACHE.clear()
    synth = versioned(days=12)
    outs = {v: get_method(f"bm25+recency-{v}").run(ctx_for(synth, tmp_path, v)) for v in rec_rows.VARIANTS}
    base = outs["none"].runs["test_date"]
    assert all(len(r) == len(synth.dataset.records) for r in base.values())        # depth+K >= gallery here
    for v, out in outs.items():
        m = out.info["metrics"]["test_date"]
        assert m["stale_rate@5"] <= m["stale_rate_base@5"] and m["filter_failures"] == 0
        for qid, r in out.runs["test_date"].items():    # only documents of the top 5 are dropped, order kept
            dropped = set(base[qid]) - set(r)
            top5 = rank_documents(base[qid], depth=5)           # the filter's top 5 (trec_eval tie order)
            assert dropped <= set(top5) and len(dropped) == len(set(base[qid])) - len(r)
    assert outs["metadata"].info["metrics"]["test_date"]["removed"] > 0
    neutral = versioned(days=12, versions=False)
    rec_rows._BASE_CACHE.clear()
    for v in rec_rows.VARIANTS:
        m = get_method(f"bm25+recency-{v}").run(ctx_for(neutral, tmp_path, "n" + v)).info["metrics"]["test_date"]
        assert m["removed"] == 0 and m["stale_rate@5"] == 0.0


def test_minilm_rows(tmp_path):
    pytest.importorskip("all_minilm_l6_v2")
    from tempokern.models import minilm_path
    path = minilm_path()
    rec_rows._BASE_CACHE.clear()
    synth = versioned(days=4)
    ctx = SuiteContext(synth=synth, backbone_path=path, seed=0, quick=True,
                       work_dir=tmp_path / "d", method_name="d", log=lambda m: None, progress_enabled=False)
    runs = rec_rows.base_runs(ctx, "minilm-zs")
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(path, device="cpu")
    g = st.encode([r.text for r in synth.dataset.records], normalize_embeddings=True)
    q = st.encode([x.text for x in synth.dataset.queries], normalize_embeddings=True)
    for i, qq in enumerate(synth.dataset.queries):          # same scores as sentence-transformers' encoder
        for j, r in enumerate(synth.dataset.records):
            assert runs["test_date"][qq.id][r.id] == pytest.approx(float(q[i] @ g[j]), abs=1e-4)
    out = get_method("minilm-zs+recency-metadata").run(ctx)
    m = out.info["metrics"]["test_date"]
    assert m["stale_rate@5"] <= m["stale_rate_base@5"] and m["evidence_tokens_base@5"] > m["evidence_docs_base@5"]


def test_on_synth_sets_b_and_c_no_false_removals(tmp_path):
    """On the real generated sets (quick size): every document the filter removes over a BM25 top 5 is an
    outdated version, the gold is never removed, and set B (no versions) loses nothing."""
    pytest.importorskip("bm25s")
    pytest.importorskip("vega_datasets")
    pytest.importorskip("holidays")
    from tempokern.datasets.synth import generate_synth
    from tempokern.eval.recency import apply_recency, make_filter, version_truth
    for name in ("C", "B"):
        s = generate_synth(name, seed=0, size="quick")
        rec_rows._BASE_CACHE.clear()
        ctx = ctx_for(s, tmp_path, "syn" + name)
        runs = rec_rows.base_runs(ctx, "bm25")
        truth = version_truth(s.dataset)
        gold = {q.id: set(q.gold) for q in s.dataset.queries}
        removed = 0
        for ext in ("metadata", "rule"):
            for split, run in runs.items():
                qt = {q.id: q.text for q in ctx.queries(split)}
                for qid, res in apply_recency(run, s.dataset, make_filter(ext), qt, k=5).items():
                    assert res.ok
                    for c in res.removed:
                        assert c.id in truth["outdated"], (ext, qt[qid], c.text)
                        # a time-less query's gold is every document of its metric, every version included:
                        # removing the outdated ones there is what Eq. 14 is for
                        assert split == "timeless" or c.id not in gold[qid], (ext, qt[qid], c.text)
                    removed += len(res.removed)
        assert (removed > 50) if name == "C" else (removed == 0 and not truth["outdated"])


def test_re3_base_is_the_trained_re3_row_of_the_seed(tmp_path, monkeypatch):
    """re3+recency-*: the filter runs over the re3-film_margins row's runs of the same seed (the paper's
    pipeline), computed once per seed."""
    from tempokern.suite import MethodOutput
    from tempokern.suite.methods import re3 as re3_rows
    synth = versioned()
    run = {"q0": {"fc0-3": 9.0, "fc0-1": 8.0, "obs0": 7.0, "obs1": 6.0, "fc1-2": 5.0, "obs5": 1.0}}
    run.update({f"q{i}": {f"obs{i}": 1.0} for i in range(1, 6)})
    calls = []

    def fake_run_re3(ctx, variant="film_margins"):
        calls.append((ctx.seed, variant))
        return MethodOutput(runs={"test_date": run})
    monkeypatch.setattr(re3_rows, "run_re3", fake_run_re3)
    rec_rows._BASE_CACHE.clear()
    ctx = ctx_for(synth, tmp_path, "re3m")
    ctx.eval_splits = ["test_date"]
    out = get_method("re3+recency-metadata").run(ctx)
    assert out.runs["test_date"]["q0"] == {"obs0": 7.0, "obs1": 6.0, "obs5": 1.0}   # the two old forecasts of day 0
    get_method("re3+recency-metadata-latest").run(ctx)
    assert calls == [(0, "film_margins")]          # cached per seed
    ctx1 = ctx_for(synth, tmp_path, "re3m1")
    ctx1.seed, ctx1.eval_splits = 1, ["test_date"]
    get_method("re3+recency-rule").run(ctx1)
    assert calls == [(0, "film_margins"), (1, "film_margins")]
