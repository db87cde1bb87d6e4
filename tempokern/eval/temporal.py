"""TEMPO's temporal metrics.

For a query, let ``v_1..v_n`` be the temporal-relevance verdicts (0/1) of its top
``n = min(k, #retrieved)`` documents:

* ``TP@k`` Temporal Precision = (1/|R|) sum_{r in R} (#{i <= r : v_i = 1}) / r, with R the ranks
  where v_r = 1; 0 when R is empty;
* ``TR@k`` Temporal Relevance = (sum_i v_i) / n (0 when nothing was retrieved);
* ``TC@k`` Temporal Coverage = |required periods covered by at least one of the top k| / |required|;
* ``NDCG|FC@k`` = nDCG@k (graded gains as in trec_eval, from ``qrels``; from the verdicts when no
  qrels are given) averaged over the queries whose ``TC@k`` is 1.

Verdicts come from supplied judgments (``{qid: {docid: 0/1}}``, e.g. what an LLM judge produced)
or from a function ``f(qid, docid) -> bool``; :func:`interval_verdicts` builds the exact one for
time-keyed corpora (a document is temporally relevant iff its interval overlaps the query's).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Union

from ..calendar import Interval
from .metrics import _check_ks, rank_documents, validate_qrels, validate_run

__all__ = ["temporal_metrics", "interval_verdicts", "interval_periods", "temporal_query_metrics"]

Verdicts = Union[Mapping[str, Mapping[str, Any]], Callable[[str, str], Any]]


def interval_verdicts(query_intervals: Mapping[str, Optional[Interval]],
                      doc_intervals: Mapping[str, Optional[Interval]]) -> Callable[[str, str], int]:
    """Exact verdicts for time-keyed corpora: 1 iff the document's interval overlaps the query's
    (0 when either is untimed)."""
    def verdict(qid: str, docid: str) -> int:
        qi, di = query_intervals.get(qid), doc_intervals.get(docid)
        return int(qi is not None and di is not None and qi.overlaps(di))
    return verdict


def interval_periods(query_periods: Mapping[str, Sequence[Interval]],
                     doc_intervals: Mapping[str, Optional[Interval]]) -> Dict[str, Dict[str, Any]]:
    """Coverage data from intervals: each query's required periods are intervals; a document covers
    period j iff its interval overlaps it. Returns the ``periods`` argument of
    :func:`temporal_metrics` (``{qid: {"required": [...], "covered": callable}}``)."""
    out = {}
    for qid, per in query_periods.items():
        per = list(per)

        def covered(docid, per=per):
            di = doc_intervals.get(docid)
            return [j for j, p in enumerate(per) if di is not None and di.overlaps(p)]
        out[qid] = {"required": list(range(len(per))), "covered": covered}
    return out


def _ndcg(ranked: Sequence[str], gains: Mapping[str, float], k: int) -> float:
    dcg = sum(float(gains.get(d, 0)) / math.log2(i + 1) for i, d in enumerate(ranked[:k], start=1)
              if float(gains.get(d, 0)) > 0)
    ideal = sorted((float(g) for g in gains.values() if float(g) > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 1) for i, g in enumerate(ideal, start=1))
    return dcg / idcg if idcg > 0 else 0.0


def temporal_query_metrics(v: Sequence[int], k: int) -> Dict[str, float]:
    """TP@k and TR@k of one query from the verdicts of its ranking (see module doc)."""
    top = [1 if x else 0 for x in v[:k]]
    n = len(top)
    hits, tp_sum = 0, 0.0
    for r, x in enumerate(top, start=1):
        if x:
            hits += 1
            tp_sum += hits / r
    return {f"TP@{k}": tp_sum / hits if hits else 0.0, f"TR@{k}": hits / n if n else 0.0}


def temporal_metrics(run: Mapping[str, Mapping[str, float]], verdicts: Verdicts, ks: Sequence[int] = (10,),
                     periods: Optional[Mapping[str, Mapping[str, Any]]] = None, *,
                     qrels: Optional[Mapping[str, Mapping[str, float]]] = None,
                     queries: Optional[Iterable[str]] = None, per_query: bool = False) -> Dict[str, Any]:
    """Mean TEMPO metrics over queries.

    ``run``: ``{qid: {docid: score}}``. ``verdicts``: ``{qid: {docid: 0/1}}`` (a missing pair counts
    0 and is tallied in ``verdicts_missing``) or ``f(qid, docid)``. ``periods`` (optional):
    ``{qid: {"required": [period ids], "covered": {docid: [period ids]} or f(docid)}}``; with it
    ``TC@k`` (over the queries that have periods) and ``NDCG|FC@k`` are reported. ``qrels`` give the
    gains of NDCG|FC (default: the verdicts). ``queries``: the qids to average over (default: the
    run's). A query of ``queries`` missing from the run has an empty ranking (scores 0)."""
    validate_run(run)
    if qrels is not None:
        validate_qrels(qrels)
    ks = _check_ks(ks)
    if not callable(verdicts) and not isinstance(verdicts, Mapping):
        raise TypeError("verdicts must be a dict {qid: {docid: 0/1}} or a function (qid, docid) -> 0/1, "
                        f"got {type(verdicts).__name__}")
    if periods is not None and not isinstance(periods, Mapping):
        raise TypeError(f"periods must be a dict {{qid: {{'required': [...], 'covered': ...}}}}, got "
                        f"{type(periods).__name__}")
    qids = list(run) if queries is None else list(queries)
    kmax = max(ks)
    sums: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    pq: Dict[str, Dict[str, float]] = {}
    missing = 0

    def _gains(qid, ranked, v):
        if qrels is not None:
            return qrels.get(qid, {})
        if not callable(verdicts):
            return {d: 1 for d, x in verdicts.get(qid, {}).items() if x}
        # a verdict function only tells about what was retrieved: the ideal ranking is built from that
        return {d: x for d, x in zip(ranked, v) if x}

    def add(name, val):
        sums[name] = sums.get(name, 0.0) + val
        counts[name] = counts.get(name, 0) + 1

    for qid in qids:
        ranked = rank_documents(run.get(qid, {}), kmax)
        if callable(verdicts):
            v = [1 if verdicts(qid, d) else 0 for d in ranked]
        else:
            qv = verdicts.get(qid, {})
            v = []
            for d in ranked:
                if d not in qv:
                    missing += 1
                v.append(1 if qv.get(d, 0) else 0)
        m: Dict[str, float] = {}
        for k in ks:
            m.update(temporal_query_metrics(v, k))
        if periods is not None and qid in periods:
            spec = periods[qid]
            if not isinstance(spec, Mapping) or "required" not in spec or "covered" not in spec:
                raise ValueError(f"periods[{qid!r}] must be a dict with 'required' and 'covered'")
            required = set(spec["required"])
            cov = spec["covered"]
            for k in ks:
                got = set()
                for d in ranked[:k]:
                    got.update(cov(d) if callable(cov) else cov.get(d, ()))
                tc = len(got & required) / len(required) if required else 1.0
                m[f"TC@{k}"] = tc
                if tc == 1.0:
                    m[f"NDCG|FC@{k}"] = _ndcg(ranked, _gains(qid, ranked, v), k)
        for name, val in m.items():
            add(name, val)
        pq[qid] = m
    out: Dict[str, Any] = {}
    for k in ks:
        for name in (f"TP@{k}", f"TR@{k}"):
            out[name] = sums.get(name, 0.0) / counts[name] if counts.get(name) else 0.0
        if periods is not None:
            n_tc = counts.get(f"TC@{k}", 0)
            out[f"TC@{k}"] = sums.get(f"TC@{k}", 0.0) / n_tc if n_tc else 0.0
            n_fc = counts.get(f"NDCG|FC@{k}", 0)
            out[f"NDCG|FC@{k}"] = sums.get(f"NDCG|FC@{k}", 0.0) / n_fc if n_fc else 0.0
            out[f"num_full_coverage@{k}"] = n_fc
    out["num_queries"] = len(qids)
    out["verdicts_missing"] = missing
    if per_query:
        out["per_query"] = pq
    return out
