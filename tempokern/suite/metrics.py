"""Per-query metrics of the English suite, computed from a run and the dataset (never by the methods).

For each query of a split, from its ranking (score descending, ties by doc id descending as
:func:`tempokern.eval.rank_documents`) and its gold set G:

* ``R@1``, ``R@5``, ``R@10`` (hit rate), ``MRR@10``, ``nDCG@10`` (binary gains), ``recall@100``
  (|top-100 ∩ G| / |G|) — :func:`tempokern.eval.metrics.per_query_metrics`;
* ``TP@10``, ``TR@10`` — TEMPO's temporal precision / relevance with the exact verdicts of
  :func:`tempokern.eval.interval_verdicts` (a document is temporally relevant iff its interval
  overlaps the query's); NaN (left out of the mean) for queries without an interval;
* the **top-1 error split** ``err_time`` / ``err_entity`` / ``err_attribute`` / ``err_other``: 1 for
  the one category of a wrong top-1 document, from the records' and the query's ``meta``:
  time-wrong = same entity and attribute as the query (another date, or another version of the same
  date); entity-wrong = other entity, same attribute; attribute-wrong = same entity, other attribute;
  other = both differ (or the meta is missing). All four are 0 when the top-1 is gold; their means
  are fractions of all queries, so they add up to 1 - R@1;
* ``time_swap``: 1 iff the best-ranked gold document is ranked above the query's
  ``meta["time_wrong_twin"]`` (a document absent from the run ranks below every present one; neither
  present counts 0); NaN for queries without a twin.

Aggregation: :func:`bootstrap_ci` (percentile bootstrap over queries, 1,000 resamples) and
:func:`paired_bootstrap_ci` (the same resampled queries for both methods; the interval of the mean
difference).
"""
from __future__ import annotations

import math
import warnings
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..eval.metrics import per_query_metrics, rank_documents
from ..eval.temporal import interval_verdicts, temporal_query_metrics

__all__ = ["METRICS", "ERROR_KINDS", "split_metrics", "error_kind", "bootstrap_ci", "paired_bootstrap_ci",
           "spearman", "strip_spans", "summarize"]

#: per-query metric names, in table order
METRICS = ("R@1", "R@5", "R@10", "MRR@10", "nDCG@10", "recall@100", "TP@10", "TR@10", "time_swap",
           "err_time", "err_entity", "err_attribute", "err_other")
ERROR_KINDS = ("time", "entity", "attribute", "other")


def error_kind(query, doc) -> str:
    """Category of a wrong top-1 document ``doc`` for ``query`` (see the module doc)."""
    qm, dm = query.meta or {}, doc.meta or {}
    qe, qa, de, da = qm.get("entity"), qm.get("attribute"), dm.get("entity"), dm.get("attribute")
    if qe is None or de is None:
        return "other"
    same_e = qe == de
    same_a = qa == da
    if same_e and same_a:
        return "time"
    if same_e:
        return "attribute"
    if same_a:
        return "entity"
    return "other"


def split_metrics(run: Mapping[str, Mapping[str, float]], dataset, split: str) -> Dict[str, object]:
    """``{"qids": [...], metric: np.ndarray (one value per query, NaN where undefined)}`` for the
    queries of ``split`` with at least one gold document (a query absent from the run has an empty
    ranking)."""
    queries = [q for q in dataset.queries if q.split == split and q.relevant_ids()]
    q_int = {q.id: q.interval for q in queries}
    d_int = {r.id: r.interval for r in dataset.records}
    verdict = interval_verdicts(q_int, d_int)
    cols: Dict[str, List[float]] = {m: [] for m in METRICS}
    for q in queries:
        gold = set(q.relevant_ids())
        ranked = rank_documents(run.get(q.id, {}))
        m = per_query_metrics(ranked, gold, ks=(1, 5, 10, 100))
        for name in ("R@1", "R@5", "R@10", "MRR@10", "nDCG@10", "recall@100"):
            cols[name].append(m[name])
        if q.interval is not None:
            t = temporal_query_metrics([verdict(q.id, d) for d in ranked[:10]], 10)
            cols["TP@10"].append(t["TP@10"])
            cols["TR@10"].append(t["TR@10"])
        else:
            cols["TP@10"].append(math.nan)
            cols["TR@10"].append(math.nan)
        kind = None
        if ranked and ranked[0] not in gold:
            top = ranked[0]
            kind = error_kind(q, dataset.record(top)) if top in dataset else "other"
        elif not ranked:
            kind = "other"
        for k in ERROR_KINDS:
            cols[f"err_{k}"].append(1.0 if kind == k else 0.0)
        twin = (q.meta or {}).get("time_wrong_twin")
        if twin is None:
            cols["time_swap"].append(math.nan)
        else:
            pos = {d: i for i, d in enumerate(ranked)}
            g = min((pos[d] for d in gold if d in pos), default=math.inf)
            t = pos.get(twin, math.inf)
            cols["time_swap"].append(1.0 if g < t else 0.0)
    out: Dict[str, object] = {"qids": [q.id for q in queries]}
    for name, vals in cols.items():
        out[name] = np.asarray(vals, dtype=np.float64)
    return out


def _valid(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x[~np.isnan(x)]


def bootstrap_ci(values, n_resamples: int = 1000, *, seed: int = 0, level: float = 0.95
                 ) -> Tuple[float, float, float]:
    """(mean, low, high): the percentile bootstrap interval of the mean over queries (NaN values
    left out). (nan, nan, nan) when there is no value."""
    x = _valid(values)
    if x.size == 0:
        return (math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_resamples, x.size))
    means = x[idx].mean(axis=1)
    a = (1 - level) / 2
    return (float(x.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a)))


def paired_bootstrap_ci(a, b, n_resamples: int = 1000, *, seed: int = 0, level: float = 0.95
                        ) -> Tuple[float, float, float]:
    """(mean(a - b), low, high) over queries where both are defined; the same resampled queries for
    both (a paired bootstrap)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same queries: shapes {a.shape} and {b.shape}")
    return bootstrap_ci(a - b, n_resamples, seed=seed, level=level)


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x), dtype=np.float64)
    sx = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sx[j + 1] == sx[i]:
            j += 1
        r[order[i:j + 1]] = (i + j) / 2.0 + 1.0   # average rank of a tie group
        i = j + 1
    return r


def spearman(a, b) -> float:
    """Spearman's rank correlation (Pearson of average ranks)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.size < 2:
        raise ValueError(f"spearman needs two equal-length vectors of >= 2 values, got {a.shape} and {b.shape}")
    ra, rb = _ranks(a), _ranks(b)
    ra -= ra.mean()
    rb -= rb.mean()
    den = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den > 0 else math.nan


def strip_spans(text: str, spans) -> str:
    """``text`` without its temporal spans (``[[start, end], ...]``), whitespace collapsed."""
    keep, pos = [], 0
    for s in sorted((int(s[0]), int(s[1])) for s in (spans or ())):
        if s[0] > pos:
            keep.append(text[pos:s[0]])
        pos = max(pos, s[1])
    keep.append(text[pos:])
    return " ".join("".join(keep).split())


def summarize(per_seed: Sequence[Mapping[str, np.ndarray]], *, n_resamples: int = 1000, seed: int = 0
              ) -> Dict[str, Dict[str, object]]:
    """Metrics of one (method, set, split) over seeds: per-query values are averaged over the seeds
    first, then ``mean`` and the bootstrap ``ci`` over queries; ``seeds`` lists each seed's mean."""
    out: Dict[str, Dict[str, object]] = {}
    for name in METRICS:
        arrs = [np.asarray(p[name], dtype=np.float64) for p in per_seed if name in p]
        if not arrs:
            continue
        stacked = np.vstack(arrs)
        with warnings.catch_warnings():   # a query undefined in every seed stays NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            avg = np.nanmean(stacked, axis=0) if stacked.size else stacked
        mean, lo, hi = bootstrap_ci(avg, n_resamples, seed=seed)
        out[name] = {"mean": mean, "ci": [lo, hi],
                     "seeds": [float(np.nanmean(a)) if np.any(~np.isnan(a)) else math.nan for a in arrs],
                     "n": int((~np.isnan(avg)).sum())}
    return out
