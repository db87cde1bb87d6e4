import math
import random

import pytest

from tempokern.eval import re3_metrics, retrieval_metrics
from tempokern.eval.metrics import rank_documents

pytrec_eval = pytest.importorskip("pytrec_eval")


def _random_case(seed, n_q=40, n_docs=60):
    rng = random.Random(seed)
    run, qrels = {}, {}
    for q in range(n_q):
        qid = f"q{q}"
        docs = [f"d{i}" for i in range(n_docs)]
        depth = rng.randint(1, n_docs)
        scores = rng.sample(range(10 * n_docs), depth)          # distinct: tie-free
        run[qid] = {d: s / 7.0 for d, s in zip(rng.sample(docs, depth), scores)}
        n_rel = rng.randint(1, 15)
        qrels[qid] = {d: 1 for d in rng.sample(docs, n_rel)}
        for d in rng.sample(docs, 5):                            # judged non-relevant rows
            qrels[qid].setdefault(d, 0)
    return run, qrels


def _cut(run, k):
    return {q: {d: s for d, s in docs.items() if d in set(rank_documents(docs, k))} for q, docs in run.items()}


@pytest.mark.parametrize("seed", range(5))
def test_against_trec_eval(seed):
    run, qrels = _random_case(seed)
    ks = (1, 3, 5, 10, 20)
    ours = retrieval_metrics(run, qrels, ks=ks, per_query=True)
    measures = {f"success.{','.join(map(str, ks))}", f"recall.{','.join(map(str, ks))}", "ndcg_cut.10",
                "recip_rank"}
    ev = pytrec_eval.RelevanceEvaluator(qrels, measures)
    full = ev.evaluate(run)
    cut10 = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(_cut(run, 10))
    for qid, m in ours["per_query"].items():
        for k in ks:
            assert m[f"R@{k}"] == pytest.approx(full[qid][f"success_{k}"], abs=1e-12)
            assert m[f"recall@{k}"] == pytest.approx(full[qid][f"recall_{k}"], abs=1e-12)
        assert m["nDCG@10"] == pytest.approx(full[qid]["ndcg_cut_10"], abs=1e-12)
        assert m["MRR@10"] == pytest.approx(cut10[qid]["recip_rank"], abs=1e-12)
        assert m["MRR"] == pytest.approx(full[qid]["recip_rank"], abs=1e-12)
    n = len(full)
    assert ours["num_queries"] == n
    assert ours["nDCG@10"] == pytest.approx(sum(v["ndcg_cut_10"] for v in full.values()) / n, abs=1e-12)
    assert ours["R@5"] == pytest.approx(sum(v["success_5"] for v in full.values()) / n, abs=1e-12)


def test_hand_computed():
    run = {"a": {"x": 3.0, "y": 2.0, "z": 1.0, "w": 0.5}, "b": {"x": 1.0}}
    qrels = {"a": {"y": 1, "w": 1, "x": 0}, "b": {"q": 1}}
    m = retrieval_metrics(run, qrels, ks=(1, 2, 4))
    # query a: ranks y=2, w=4; query b: no hit
    assert m["R@1"] == 0.0 and m["R@2"] == 0.5 and m["R@4"] == 0.5
    assert m["recall@2"] == pytest.approx(0.25) and m["recall@4"] == pytest.approx(0.5)
    assert m["MRR@10"] == pytest.approx(0.25)
    ndcg_a = (1 / math.log2(3) + 1 / math.log2(5)) / (1 + 1 / math.log2(3))
    assert m["nDCG@10"] == pytest.approx(ndcg_a / 2)
    assert m["num_queries"] == 2


def test_mrr_cut_at_10_and_missing_queries():
    run = {"a": {f"d{i}": 100 - i for i in range(20)}}
    qrels = {"a": {"d12": 1}, "b": {"d1": 1}, "c": {"d1": 0}}
    m = retrieval_metrics(run, qrels, ks=(10, 20))
    assert m["num_queries"] == 2           # c has no relevant document; b is missing from the run
    assert m["MRR@10"] == 0.0
    assert m["MRR"] == pytest.approx(1 / 13 / 2)
    assert m["R@20"] == 0.5 and m["R@10"] == 0.0


def test_ties_follow_trec_eval_order():
    run = {"a": {"d1": 1.0, "d2": 1.0, "d3": 1.0}}
    assert rank_documents(run["a"]) == ["d3", "d2", "d1"]
    qrels = {"a": {"d1": 1}}
    ours = retrieval_metrics(run, qrels)
    te = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(run)
    assert ours["MRR"] == pytest.approx(te["a"]["recip_rank"])


def test_re3_metrics():
    run = {"a": {"x": 5, "y": 4, "z": 3, "u": 2, "v": 1, "w": 0}, "b": {"x": 1, "y": 2}}
    qrels = {"a": {"w": 1}, "b": {"y": 1}}
    m = re3_metrics(run, qrels)
    assert m["R@1"] == 0.5 and m["R@5"] == 0.5
    assert m["MRR"] == pytest.approx((1 / 6 + 1) / 2)


def test_bad_input():
    with pytest.raises(TypeError, match="run"):
        retrieval_metrics([("q", "d", 1.0)], {})
    with pytest.raises(TypeError, match=r"run\['q'\]"):
        retrieval_metrics({"q": ["d"]}, {})
    with pytest.raises(ValueError, match="NaN"):
        retrieval_metrics({"q": {"d": float("nan")}}, {"q": {"d": 1}})
    with pytest.raises(ValueError, match="ks"):
        retrieval_metrics({}, {}, ks=(0,))
    with pytest.raises(TypeError, match="qrels"):
        retrieval_metrics({}, [1])


# ---- TEMPO temporal metrics ---------------------------------------------------------------------

from tempokern.calendar import Interval  # noqa: E402
from tempokern.eval import interval_periods, interval_verdicts, temporal_metrics  # noqa: E402


def _run(order):
    return {d: float(len(order) - i) for i, d in enumerate(order)}


def test_temporal_precision_and_relevance_by_hand():
    run = {"a": _run(["d1", "d2", "d3", "d4", "d5"]), "b": _run(["x", "y"]), "c": {}}
    verdicts = {"a": {"d1": 0, "d2": 1, "d3": 0, "d4": 1, "d5": 1}, "b": {"x": 0, "y": 0}}
    m = temporal_metrics(run, verdicts, ks=(3, 5), per_query=True)
    pa = m["per_query"]["a"]
    assert pa["TP@5"] == pytest.approx((1 / 2 + 2 / 4 + 3 / 5) / 3)
    assert pa["TR@5"] == pytest.approx(3 / 5)
    assert pa["TP@3"] == pytest.approx(1 / 2) and pa["TR@3"] == pytest.approx(1 / 3)
    assert m["per_query"]["b"]["TP@5"] == 0.0 and m["per_query"]["b"]["TR@5"] == 0.0
    # n = min(k, retrieved): b retrieved 2, its TR@5 has denominator 2 (checked with a hit below)
    m2 = temporal_metrics({"b": _run(["x", "y"])}, {"b": {"x": 1}}, ks=(5,))
    assert m2["TR@5"] == pytest.approx(1 / 2)
    assert m["num_queries"] == 3 and m["TR@5"] == pytest.approx((3 / 5 + 0 + 0) / 3)
    assert "TC@5" not in m and m["verdicts_missing"] == 0


def test_temporal_coverage_and_ndcg_fc():
    run = {"a": _run(["d1", "d2", "d3"]), "b": _run(["e1", "e2"])}
    verdicts = lambda q, d: d in ("d1", "d3", "e2")  # noqa: E731
    periods = {"a": {"required": ["p1", "p2"], "covered": {"d1": ["p1"], "d3": ["p2", "p9"]}},
               "b": {"required": ["p1", "p2"], "covered": {"e2": ["p1"]}}}
    qrels = {"a": {"d1": 1, "d3": 2, "zz": 1}, "b": {"e2": 1}}
    m = temporal_metrics(run, verdicts, ks=(2, 3), periods=periods, qrels=qrels, per_query=True)
    assert m["per_query"]["a"]["TC@2"] == 0.5 and m["per_query"]["a"]["TC@3"] == 1.0
    assert m["per_query"]["b"]["TC@3"] == 0.5
    # NDCG|FC@3 averages only over fully covered queries (a): graded gains 1, 0, 2 vs ideal 2, 1, 1
    import math
    dcg = 1 + 2 / math.log2(4)
    idcg = 2 + 1 / math.log2(3) + 1 / math.log2(4)
    assert m["NDCG|FC@3"] == pytest.approx(dcg / idcg) and m["num_full_coverage@3"] == 1
    assert m["num_full_coverage@2"] == 0 and m["NDCG|FC@2"] == 0.0


def test_interval_verdicts_and_periods():
    q = {"a": Interval(10, 20)}
    docs = {"x": Interval(0, 9), "y": Interval(20, 30), "z": Interval(12, 12), "u": None}
    v = interval_verdicts(q, docs)
    assert [v("a", d) for d in "xyzu"] == [0, 1, 1, 0]
    per = interval_periods({"a": [Interval(0, 5), Interval(25, 40)]}, docs)
    run = {"a": _run(["z", "x", "y"])}
    m = temporal_metrics(run, v, ks=(1, 2, 3), periods=per)
    assert m["TC@1"] == 0.0 and m["TC@2"] == 0.5 and m["TC@3"] == 1.0
    assert m["TP@3"] == pytest.approx((1 + 2 / 3) / 2)


def test_temporal_bad_input_and_missing_verdicts():
    with pytest.raises(TypeError, match="verdicts"):
        temporal_metrics({"a": {"d": 1.0}}, [1, 0])
    with pytest.raises(ValueError, match="required"):
        temporal_metrics({"a": {"d": 1.0}}, {"a": {"d": 1}}, periods={"a": {"need": []}})
    m = temporal_metrics({"a": _run(["d1", "d2"])}, {"a": {"d1": 1}})
    assert m["verdicts_missing"] == 1 and m["TR@10"] == 0.5
