"""Recency-filter evaluation (design notes §3.6, "Filter"): apply a :class:`tempokern.rerank.RecencyFilter`
to the top-k of a run, and measure what is passed on to a generator before and after.

Metrics of one evidence list per query (the top-k passed to the generator, in order):

* ``stale_rate``: outdated versions among all evidence documents, pooled over queries
  (Σ outdated / Σ documents; 0 when nothing is passed on);
* ``version_accuracy``: share of queries whose first evidence document is a latest version of the
  query's fact (queries with a known latest version only);
* ``answer_proxy``: share of queries whose first evidence document states the gold value (``values_equal``,
  default :func:`tempokern.rerank.default_equal`) — the extractive proxy for the paper's answer accuracy,
  exact on template data; never call it "Acc";
* ``evidence_docs`` / ``evidence_tokens``: mean documents / tokens passed on per query (``tokenizer``: a
  Hugging Face tokenizer, counted without special tokens, or any ``text -> sequence|int``; default:
  whitespace words);
* under :func:`compare_evidence`: ``removed`` (total), ``removed_per_query``, ``queries_with_removals``,
  ``evidence_tokens_change`` (relative; the paper's anchor is −58.2%, Table 6).
"""
from __future__ import annotations

import datetime as _dt
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .metrics import rank_documents, re3_metrics, validate_run
from ..rerank.recency import Candidate, MetadataExtractor, RecencyFilter, RuleExtractor, default_equal, fact_key

__all__ = ["apply_recency", "filtered_run", "evidence_lists", "recency_metrics", "compare_evidence",
           "version_truth", "count_tokens", "recency_report", "make_filter", "EXTRACTORS"]

#: extractor names accepted by :func:`make_filter` (and the CLI's ``--recency``)
EXTRACTORS = ("none", "rule", "metadata")


def make_filter(extractor: str, *, policy: str = "conflict", mode: str = "filter", recency_weight: float = 1.0,
                aliases=None):
    """A :class:`RecencyFilter` by name: ``"rule"`` (:class:`RuleExtractor`, ``aliases`` added to its table)
    or ``"metadata"`` (:class:`MetadataExtractor`); ``"none"`` gives None."""
    if extractor not in EXTRACTORS:
        raise ValueError(f"unknown recency extractor {extractor!r}: expected one of {', '.join(EXTRACTORS)}")
    if extractor == "none":
        return None
    ex = RuleExtractor(aliases) if extractor == "rule" else MetadataExtractor()
    return RecencyFilter(ex, policy=policy, mode=mode, recency_weight=recency_weight)


def _records_by_id(records) -> Mapping[str, Any]:
    if hasattr(records, "records") and hasattr(records, "record"):   # a RetrievalDataset
        return {r.id: r for r in records.records}
    if isinstance(records, Mapping):
        return records
    return {r.id: r for r in records}


def apply_recency(run: Mapping[str, Mapping[str, float]], records, rfilter, queries: Mapping[str, str], *,
                  k: int = 5) -> Dict[str, Any]:
    """``{qid: FilterResult}``: ``rfilter`` applied to the top ``k`` of each query of ``run`` (ranked by
    :func:`rank_documents`); ``records``: a RetrievalDataset, ``{id: Record}`` or a list of records;
    ``queries``: ``{qid: text}``."""
    validate_run(run)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    by_id = _records_by_id(records)
    out = {}
    for qid, scores in run.items():
        if qid not in queries:
            raise KeyError(f"run names query {qid!r}, which is not in queries")
        top = rank_documents(scores, depth=k)
        missing = [d for d in top if d not in by_id]
        if missing:
            raise KeyError(f"run of query {qid!r} names documents not in records: {missing[:5]}")
        cands = [Candidate.from_record(by_id[d], float(scores[d])) for d in top]
        out[qid] = rfilter(queries[qid], cands)
    return out


def filtered_run(run: Mapping[str, Mapping[str, float]], results: Mapping[str, Any]) -> Dict[str, Dict[str, float]]:
    """The run after filtering: removed documents are dropped (the rest keeps its scores and so its order);
    in rerank mode the filtered top-k carry their new scores. Queries without a result are unchanged."""
    out = {}
    for qid, scores in run.items():
        s = dict(scores)
        res = results.get(qid)
        if res is not None:
            for c in res.removed:
                s.pop(c.id, None)
            for c in res.kept:
                if c.id in s:
                    s[c.id] = float(c.score)
        out[qid] = s
    return out


def evidence_lists(results: Mapping[str, Any]) -> Tuple[Dict[str, List[str]], Dict[str, List[str]]]:
    """``(before, after)``: each query's candidate ids as given to the filter, and the survivors in order."""
    before, after = {}, {}
    for qid, res in results.items():
        before[qid] = list(res.votes)                # the candidates in their original order
        after[qid] = [c.id for c in res.kept]
    return before, after


def count_tokens(text: str, tokenizer=None) -> int:
    """Tokens of ``text``: a Hugging Face tokenizer (``encode(text, add_special_tokens=False)``), any
    callable returning a sequence or an int, or whitespace words when None."""
    if tokenizer is None:
        return len(str(text).split())
    enc = getattr(tokenizer, "encode", None)
    if enc is not None:
        try:
            return len(enc(text, add_special_tokens=False))
        except TypeError:
            return len(enc(text))
    r = tokenizer(text)
    return int(r) if isinstance(r, int) else len(r)


def recency_metrics(evidence: Mapping[str, Sequence[str]], *, outdated: Collection[str] = (),
                    latest: Optional[Mapping[str, Collection[str]]] = None,
                    gold_value: Optional[Mapping[str, Optional[str]]] = None,
                    doc_value: Optional[Callable[[str, str], Optional[str]]] = None,
                    texts: Optional[Mapping[str, str]] = None, tokenizer=None,
                    values_equal: Optional[Callable[[str, str], bool]] = None) -> Dict[str, float]:
    """Metrics of ``evidence = {qid: [doc ids passed on, in order]}`` (see the module docstring).
    ``outdated``: ids of outdated versions; ``latest``: ``{qid: ids of the latest version(s)}``;
    ``gold_value``: ``{qid: value}`` with ``doc_value(qid, doc_id) -> value or None``; ``texts``: ``{id:
    text}`` for token counts. Metrics whose inputs are not given are left out."""
    eq = values_equal or default_equal
    out: Dict[str, float] = {"queries": float(len(evidence))}
    n = max(len(evidence), 1)
    total = sum(len(v) for v in evidence.values())
    out["evidence_docs"] = total / n
    od = set(outdated)
    out["stale_rate"] = (sum(1 for v in evidence.values() for d in v if d in od) / total) if total else 0.0
    if latest is not None:
        qs = [q for q in evidence if latest.get(q)]
        out["version_accuracy"] = (sum(1 for q in qs if evidence[q] and evidence[q][0] in set(latest[q]))
                                   / len(qs)) if qs else float("nan")
        out["version_queries"] = float(len(qs))
    if gold_value is not None and doc_value is not None:
        qs = [q for q in evidence if gold_value.get(q) is not None]
        hit = 0
        for q in qs:
            if evidence[q]:
                v = doc_value(q, evidence[q][0])
                hit += int(v is not None and eq(v, gold_value[q]))
        out["answer_proxy"] = hit / len(qs) if qs else float("nan")
    if texts is not None:
        out["evidence_tokens"] = sum(count_tokens(texts[d], tokenizer) for v in evidence.values() for d in v) / n
    return out


def compare_evidence(before: Mapping[str, Sequence[str]], after: Mapping[str, Sequence[str]], **kw) -> Dict[str, Any]:
    """``{"before": metrics, "after": metrics, "removed", "removed_per_query", "queries_with_removals",
    "evidence_tokens_change"}`` (keywords as :func:`recency_metrics`)."""
    if set(before) != set(after):
        raise ValueError("before and after must name the same queries")
    b, a = recency_metrics(before, **kw), recency_metrics(after, **kw)
    removed = {q: len(set(before[q]) - set(after[q])) for q in before}
    res: Dict[str, Any] = {"before": b, "after": a, "removed": sum(removed.values()),
                           "removed_per_query": sum(removed.values()) / max(len(before), 1),
                           "queries_with_removals": sum(1 for v in removed.values() if v)}
    if "evidence_tokens" in b and b["evidence_tokens"] > 0:
        res["evidence_tokens_change"] = a["evidence_tokens"] / b["evidence_tokens"] - 1.0
    return res


def version_truth(dataset, qualifiers: Sequence[str] = ("date",)) -> Dict[str, Any]:
    """Ground truth for the filter metrics from a dataset whose records carry ``published`` and
    ``meta["facts"]`` (e.g. the versioned set C): records sharing a fact key (head, relation, qualified by
    the ``qualifiers`` meta keys as :class:`MetadataExtractor` does, :func:`tempokern.rerank.fact_key`)
    are versions of one fact; those with the latest ``published`` in their group are current, the others
    **outdated**. Returns ``{"outdated": set of ids, "latest": {qid: ids}, "gold_value": {qid: value},
    "doc_value": fn(qid, doc_id)}``: a query's latest versions are its gold records (rel > 0) with the
    latest date among them; its gold value is ``meta["answer"]`` when given, else the value its latest gold
    record states; a document's value for a query is its value for the key of the query's gold fact."""
    groups: Dict[Tuple[str, str], List[Any]] = {}
    facts_of: Dict[str, Dict[Tuple[str, str], Optional[str]]] = {}
    for r in dataset.records:
        fs = (r.meta or {}).get("facts") or []
        kv = {}
        for f in fs:
            if isinstance(f, Mapping) and "head" in f and "relation" in f:
                key = fact_key(f, r.meta, qualifiers)
                kv.setdefault(key, None if f.get("value") is None else str(f.get("value")))
        facts_of[r.id] = kv
        for key in kv:
            groups.setdefault(key, []).append(r)
    outdated: Set[str] = set()
    for key, rs in groups.items():
        dates = [r.published or _dt.date.min for r in rs]
        top = max(dates)
        outdated.update(r.id for r, d in zip(rs, dates) if d != top)
    latest, gold_value, qkey = {}, {}, {}
    for q in dataset.queries:
        gold = [d for d in q.relevant_ids() if d in dataset]
        if not gold:
            continue
        recs = [dataset.record(d) for d in gold]
        top = max(r.published or _dt.date.min for r in recs)
        lat = [r.id for r in recs if (r.published or _dt.date.min) == top]
        latest[q.id] = lat
        keys = list(facts_of.get(lat[0], {}))
        qkey[q.id] = keys[0] if keys else None
        ans = (q.meta or {}).get("answer")
        gold_value[q.id] = str(ans) if ans is not None else (facts_of[lat[0]].get(keys[0]) if keys else None)

    def doc_value(qid: str, doc_id: str) -> Optional[str]:
        key = qkey.get(qid)
        return None if key is None else facts_of.get(doc_id, {}).get(key)

    return {"outdated": outdated, "latest": latest, "gold_value": gold_value, "doc_value": doc_value}


def recency_report(run: Mapping[str, Mapping[str, float]], dataset, rfilter, *, k: int = 5, tokenizer=None,
                   max_reasons: int = 20, results: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The filter applied to the top ``k`` of ``run`` over ``dataset`` (queries of the run; records with
    ``published`` and, for the version metrics, ``meta["facts"]``): ``{"retrieval": {"before", "after"}}``
    (:func:`re3_metrics` R@1/R@5/MRR of the run and of :func:`filtered_run`), the evidence metrics of
    :func:`compare_evidence` under :func:`version_truth`, ``"failures"`` (queries where the extractor
    failed and nothing was filtered) and the first ``max_reasons`` recorded reasons. ``results``: the
    :func:`apply_recency` results of this run when already computed (then ``rfilter`` is only named)."""
    import warnings
    qtext = {q.id: q.text for q in dataset.queries if q.id in run}
    missing = [qid for qid in run if qid not in qtext]
    if missing:
        raise KeyError(f"run names queries not in dataset {dataset.name!r}: {missing[:5]}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if results is None:
            results = apply_recency(run, dataset, rfilter, qtext, k=k)
        elif set(results) != set(run):
            raise ValueError("results must hold one FilterResult per query of run")
    after_run = filtered_run(run, results)
    qrels = {q.id: {d: q.gold[d] for d in q.relevant_ids()} for q in dataset.queries if q.id in run}
    truth = version_truth(dataset)
    before, after = evidence_lists(results)
    cmp = compare_evidence(before, after, outdated=truth["outdated"], latest=truth["latest"],
                           gold_value=truth["gold_value"], doc_value=truth["doc_value"],
                           texts={r.id: r.text for r in dataset.records}, tokenizer=tokenizer)
    reasons = [f"{qid}: {x}" for qid, res in results.items() for x in res.reasons]
    return {"filter": repr(rfilter), "k": k,
            "retrieval": {"before": re3_metrics(run, qrels, ks=(1, 5)), "after": re3_metrics(after_run, qrels, ks=(1, 5))},
            **cmp, "failures": sum(1 for r in results.values() if not r.ok),
            "warnings": len(caught), "reasons": reasons[:max_reasons], "num_reasons": len(reasons)}
