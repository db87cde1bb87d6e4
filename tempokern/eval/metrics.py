"""Standard retrieval metrics on ``run = {qid: {docid: score}}`` and ``qrels = {qid: {docid: rel}}``.

Definitions (ChunQiuTR's, see docs/eval.md), for a query with relevant set G (rel > 0) and ranking
d_1, d_2, ... (score descending; ties broken by doc id descending, as trec_eval does):

* ``R@k``    hit rate: 1 if any d_i in G for i <= k, else 0 (trec_eval ``success.k``);
* ``recall@k`` fraction: |{d_1..d_k} & G| / |G| (trec_eval ``recall.k``; TEMPO, TMRL);
* ``MRR@10`` 1 / (rank of the first d_i in G) if that rank <= 10, else 0;
* ``nDCG@10`` binary gains: sum_{i<=10, d_i in G} 1/log2(i+1) divided by
  sum_{i=1}^{min(|G|,10)} 1/log2(i+1);
* ``MRR`` (uncut, Re3) 1 / rank of the first relevant document in the whole ranking.

Every value is the mean over the evaluated queries: those in ``qrels`` with at least one relevant
document. A query absent from ``run`` scores 0 on everything (it is not skipped).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..datasets.base import is_relevant

__all__ = ["retrieval_metrics", "re3_metrics", "rank_documents", "per_query_metrics", "validate_run",
           "validate_qrels"]

Run = Mapping[str, Mapping[str, float]]
Qrels = Mapping[str, Mapping[str, float]]


def validate_run(run, name: str = "run") -> None:
    if not isinstance(run, Mapping):
        raise TypeError(f"{name} must be a dict {{qid: {{docid: score}}}}, got {type(run).__name__}")
    for qid, docs in run.items():
        if not isinstance(docs, Mapping):
            raise TypeError(f"{name}[{qid!r}] must be a dict {{docid: score}}, got {type(docs).__name__}")
        for d, s in docs.items():
            if isinstance(s, bool) or not isinstance(s, (int, float)) and not hasattr(s, "__float__"):
                raise TypeError(f"{name}[{qid!r}][{d!r}] must be a number, got {type(s).__name__}")
            if math.isnan(float(s)):
                raise ValueError(f"{name}[{qid!r}][{d!r}] is NaN")


def validate_qrels(qrels, name: str = "qrels") -> None:
    if not isinstance(qrels, Mapping):
        raise TypeError(f"{name} must be a dict {{qid: {{docid: relevance}}}}, got {type(qrels).__name__}")
    for qid, docs in qrels.items():
        if not isinstance(docs, Mapping):
            raise TypeError(f"{name}[{qid!r}] must be a dict {{docid: relevance}}, got {type(docs).__name__}")


def _check_ks(ks) -> Tuple[int, ...]:
    if isinstance(ks, int):
        ks = (ks,)
    out = []
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"ks must hold positive ints, got {k!r}")
        out.append(k)
    if not out:
        raise ValueError("ks must hold at least one cutoff")
    return tuple(out)


def rank_documents(scores: Mapping[str, float], depth: Optional[int] = None) -> List[str]:
    """Doc ids by score descending, ties by doc id descending (trec_eval's order)."""
    # two stable sorts: secondary key first
    ranked = sorted(scores, reverse=True)
    ranked.sort(key=lambda d: float(scores[d]), reverse=True)
    return ranked if depth is None else ranked[:depth]


def _dcg_discount(i: int) -> float:
    return 1.0 / math.log2(i + 1)


def per_query_metrics(ranked: Sequence[str], relevant: Iterable[str], ks: Sequence[int] = (1, 5, 10)
                      ) -> Dict[str, float]:
    """Metrics of one ranking against one relevant set (see module doc)."""
    rel = set(relevant)
    out: Dict[str, float] = {}
    first = next((i for i, d in enumerate(ranked, start=1) if d in rel), None)
    for k in ks:
        hits = sum(1 for d in ranked[:k] if d in rel)
        out[f"R@{k}"] = 1.0 if hits else 0.0
        out[f"recall@{k}"] = hits / len(rel) if rel else 0.0
    out["MRR@10"] = 1.0 / first if first is not None and first <= 10 else 0.0
    out["MRR"] = 1.0 / first if first is not None else 0.0
    dcg = sum(_dcg_discount(i) for i, d in enumerate(ranked[:10], start=1) if d in rel)
    idcg = sum(_dcg_discount(i) for i in range(1, min(len(rel), 10) + 1))
    out["nDCG@10"] = dcg / idcg if idcg > 0 else 0.0
    return out


def retrieval_metrics(run: Run, qrels: Qrels, ks: Sequence[int] = (1, 5, 10), *, per_query: bool = False
                      ) -> Dict[str, float]:
    """Mean ``R@k`` (hit rate), ``recall@k`` (fraction), ``MRR@10``, ``MRR`` and ``nDCG@10`` over the
    queries of ``qrels`` with a relevant document, plus ``num_queries``. With ``per_query=True``
    the result also holds ``"per_query": {qid: {metric: value}}``."""
    validate_run(run)
    validate_qrels(qrels)
    ks = _check_ks(ks)
    sums: Dict[str, float] = {}
    pq: Dict[str, Dict[str, float]] = {}
    for qid, judged in qrels.items():
        relevant = [d for d, r in judged.items() if is_relevant(float(r))]
        if not relevant:
            continue
        scores = run.get(qid, {})
        # the uncut MRR needs the whole ranking
        ranked = rank_documents(scores)
        m = per_query_metrics(ranked, relevant, ks)
        pq[qid] = m
        for name, v in m.items():
            sums[name] = sums.get(name, 0.0) + v
    n = len(pq)
    names = [f"R@{k}" for k in ks] + ["MRR@10", "nDCG@10"] + [f"recall@{k}" for k in ks] + ["MRR"]
    out: Dict[str, float] = {name: (sums.get(name, 0.0) / n if n else 0.0) for name in names}
    out["num_queries"] = n
    if per_query:
        out["per_query"] = pq  # type: ignore[assignment]
    return out


def re3_metrics(run: Run, qrels: Qrels, ks: Sequence[int] = (1, 5)) -> Dict[str, float]:
    """Re3 / Re2Bench-style metrics: ``R@k`` (hit of the gold document in the top k, which for
    Re2Bench's single gold document is also the recall) for each k, and uncut ``MRR``."""
    m = retrieval_metrics(run, qrels, ks)
    out = {f"R@{k}": m[f"R@{k}"] for k in _check_ks(ks)}
    out["MRR"] = m["MRR"]
    out["num_queries"] = m["num_queries"]
    return out
