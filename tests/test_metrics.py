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
