"""A time-prior reranker: a retriever's score plus ``c`` times a rule match between the query's interval and
the document's dated expressions, with ``c`` fitted on a training run.

It is the row a temporal method must beat to show it learned time rather than a rule: on TimeQA a zero-shot
retriever plus 0.5 when one of the paragraph's years lies in the question's interval ranks better than the
fine-tuned rows. ChunQiuTR reports BM25+TimeKDE for the same reason (:mod:`tempokern.baselines.timekde`).

Score of document ``d`` for query ``q`` in a given run::

    s'(q, d) = s(q, d) + c * match(q, d)

``match`` (the ``match`` option):

* ``any_inside``: 1 when any dated expression of ``d`` lies in the query's interval, else 0;
* ``first_date``: 1 when the *first* dated expression of ``d`` (in text order) lies in it, else 0;
* ``timekde``: ChunQiuTR's TimeKDE prior, ``log(p_q(t(d)) + 1e-8)``, where ``p_q`` is a Gaussian kernel
  density over the time axis estimated from the times of the run's top ``kde_topk`` documents
  (:func:`tempokern.baselines.timekde.time_kde_prior`: ``sigma`` in units of the axis, the kernel truncated
  at ``3 sigma``); ``t(d)`` is the middle of the hull of ``d``'s dated expressions. It reads the run, not the
  query's interval (a pseudo-relevance prior, as in the paper); the axis is months when ``kde_unit="month"``,
  years when ``"year"`` (default: years, the resolution of most TimeQA dates).

"Lies in" (the ``relation`` option): ``inside`` (default) = the expression's whole span is contained in the
query's interval; ``overlap`` = the two share a unit. The ``granularity`` option sets the unit: ``year``
(default) compares whole years (both spans widened to the years they touch: "1995" lies in "in March 1995" and
"March 1996" in "from 1995 to 1996"), ``month`` compares months (then "1995", 1995-01 .. 1995-12, does not lie
in "in March 1995"). On TimeQA dev the year rule is the better one (docs/benchmark-timeqa.md).

Times are months (``year * 12 + month - 1``) read from date prefixes: a record's or query's
``meta["times"]`` (``[[start, end], ...]`` prefixes ``"YYYY"`` / ``"YYYY-MM"`` / ``"YYYY-MM-DD"`` or int
tuples, as the TimeQA and BEIR loaders keep them), else a BEIR row's time fields (``start`` / ``end``, ``time``,
``date``: one expression), else its text's dated expressions from the project's
tagger (:func:`tempokern.text.time_intervals`, cached per id). A query's interval is the hull of its
expressions; a query may also be given directly as a ``(start, end)`` pair of prefixes where ``None`` is an
open end (``(None, "2004")`` = up to 2004). A query without an interval and an undated document match 0 (the
score is unchanged).

``c`` is fitted (:meth:`TimePrior.fit`) on a run *you pass* — the training queries, never the evaluation
queries: grid search maximising the mean nDCG@10 of the reranked run (binary gains, trec_eval's tie order)
over the queries that have gold documents; ties go to the smallest ``c``. The default grid is relative to
the run's score scale (``GRID_MULTIPLIERS`` times the median over queries of the top-1 minus the
lowest-ranked score in the run), so it suits cosine scores and BM25 scores alike; pass ``grid=`` for
absolute values.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["TimePrior", "MATCHES", "RELATIONS", "GRANULARITIES", "GRID_MULTIPLIERS", "month_span", "coarsen", "record_spans", "query_span",
           "match_any_inside", "match_first_date", "span_in"]

MATCHES = ("any_inside", "first_date", "timekde")
RELATIONS = ("inside", "overlap")
GRANULARITIES = ("year", "month")
#: the default grid of c, as multiples of the fit run's score scale (0 = the retriever alone)
GRID_MULTIPLIERS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)

Span = Tuple[float, float]          # (first month, last month); -inf / +inf for open ends
Run = Dict[str, Dict[str, float]]


# ---- times ---------------------------------------------------------------------------------------------

def _prefix(p, arg: str) -> Tuple[int, ...]:
    if isinstance(p, str):
        try:
            parts = tuple(int(x) for x in p.strip().split("-") if x != "")
        except ValueError:
            raise ValueError(f"{arg}: date prefix {p!r} is not 'YYYY', 'YYYY-MM' or 'YYYY-MM-DD'") from None
    elif isinstance(p, (tuple, list)) and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        parts = tuple(p)
    else:
        raise ValueError(f"{arg}: a date prefix must be a string 'YYYY[-MM[-DD]]' or a tuple of ints, got {p!r}")
    if not 1 <= len(parts) <= 3 or (len(parts) >= 2 and not 1 <= parts[1] <= 12):
        raise ValueError(f"{arg}: date prefix {p!r} is not (year[, month[, day]]) with a month in 1..12")
    return parts


def month_span(start, end, *, arg: str = "span") -> Span:
    """The (first month, last month) of the date prefixes ``start`` .. ``end``; ``None`` is an open end
    (-inf / +inf). Months are ``year * 12 + month - 1``; a prefix covers all its months (``"1995"`` =
    1995-01 .. 1995-12)."""
    lo = -math.inf if start is None else _first_month(_prefix(start, arg))
    hi = math.inf if end is None else _last_month(_prefix(end, arg))
    if lo > hi:
        raise ValueError(f"{arg}: interval ends ({end!r}) before it starts ({start!r})")
    return (lo, hi)


def _first_month(p: Tuple[int, ...]) -> float:
    return float(p[0] * 12 + (p[1] - 1 if len(p) >= 2 else 0))


def _last_month(p: Tuple[int, ...]) -> float:
    return float(p[0] * 12 + (p[1] - 1 if len(p) >= 2 else 11))


def _spans_of_times(times, arg: str) -> List[Span]:
    if not isinstance(times, (list, tuple)):
        raise ValueError(f"{arg}: times must be a list of [start, end] date prefixes, got {type(times).__name__}")
    out = []
    for t in times:
        if not isinstance(t, (list, tuple)) or len(t) != 2:
            raise ValueError(f"{arg}: each time must be a [start, end] pair of date prefixes, got {t!r}")
        a, b = t
        # a pair of ints is a (start, end) of year prefixes only when both look like prefixes
        out.append((_first_month(_prefix(a, arg)), _last_month(_prefix(b, arg))))
    return out


def _meta_times(meta) -> Optional[list]:
    """``meta["times"]``, else a BEIR row's time fields (``start`` / ``end``, or ``time`` / ``date``) as one
    expression, else None."""
    meta = meta or {}
    if meta.get("times") is not None:
        return meta["times"]
    if meta.get("start") is not None and meta.get("end") is not None:
        return [[str(meta["start"]), str(meta["end"])]]
    for f in ("time", "date"):
        if meta.get(f) is not None:
            return [[str(meta[f]), str(meta[f])]]
    return None


def record_spans(record, *, cache: Optional[dict] = None) -> List[Span]:
    """Every dated expression of a record (in text order) as month spans: ``meta["times"]`` when it has
    them (else a BEIR row's ``start`` / ``end`` or ``time`` / ``date`` fields), else the project's tagger on
    its text (cached by id in ``cache``)."""
    times = _meta_times(getattr(record, "meta", None))
    rid = getattr(record, "id", None)
    if times is not None:
        return _spans_of_times(times, f"docs[{rid!r}].meta['times']")
    if cache is not None and rid in cache:
        return cache[rid]
    text = getattr(record, "text", None)
    if not isinstance(text, str):
        raise TypeError(f"docs: record {rid!r} has neither meta['times'] nor a text to tag")
    from ..text.intervals import time_intervals
    spans = [(_first_month(a), _last_month(b)) for a, b in time_intervals(text)]
    if cache is not None:
        cache[rid] = spans
    return spans


def query_span(query) -> Optional[Span]:
    """A query's interval as a month span (the hull of its dated expressions), or None when it has none.
    ``query``: a Query (``meta["times"]``, else its text tagged) or a ``(start, end)`` pair of prefixes
    (``None`` = open end) or None."""
    if query is None:
        return None
    if isinstance(query, (tuple, list)):
        if len(query) != 2:
            raise ValueError(f"queries: an interval must be a (start, end) pair of date prefixes, got {query!r}")
        if query[0] is None and query[1] is None:
            return None
        return month_span(query[0], query[1], arg="queries")
    times = _meta_times(getattr(query, "meta", None))
    if times is not None:
        spans = _spans_of_times(times, f"queries[{getattr(query, 'id', '?')!r}].meta['times']")
    else:
        text = getattr(query, "text", None)
        if not isinstance(text, str):
            raise TypeError(f"queries: expected a Query, a (start, end) pair or None, got {type(query).__name__}")
        from ..text.intervals import time_intervals
        spans = [(_first_month(a), _last_month(b)) for a, b in time_intervals(text)]
    if not spans:
        return None
    return (min(s[0] for s in spans), max(s[1] for s in spans))


def coarsen(span: Optional[Span], granularity: str = "year") -> Optional[Span]:
    """A month span widened to the whole years it touches (``granularity="year"``), or unchanged
    (``"month"``); open ends stay open, None stays None."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if span is None or granularity == "month":
        return span
    lo, hi = span
    return (lo if math.isinf(lo) else float(math.floor(lo / 12) * 12),
            hi if math.isinf(hi) else float(math.floor(hi / 12) * 12 + 11))


def span_in(doc: Span, q: Span, relation: str = "inside") -> bool:
    """Whether a document expression's span lies in the query's interval (``relation``: ``inside`` =
    contained, ``overlap`` = shares a month)."""
    if relation == "inside":
        return q[0] <= doc[0] and doc[1] <= q[1]
    if relation == "overlap":
        return doc[0] <= q[1] and q[0] <= doc[1]
    raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")


def match_any_inside(q: Optional[Span], doc_spans: Sequence[Span], relation: str = "inside") -> float:
    """1.0 when any of the document's expressions lies in the query's interval; 0.0 otherwise, for a query
    without an interval (None) and for an undated document."""
    if q is None:
        return 0.0
    return 1.0 if any(span_in(d, q, relation) for d in doc_spans) else 0.0


def match_first_date(q: Optional[Span], doc_spans: Sequence[Span], relation: str = "inside") -> float:
    """1.0 when the document's first expression (text order) lies in the query's interval, else 0.0."""
    if q is None or not doc_spans:
        return 0.0
    return 1.0 if span_in(doc_spans[0], q, relation) else 0.0


# ---- the reranker --------------------------------------------------------------------------------------

def _as_run(run, arg: str = "run") -> Run:
    if not isinstance(run, Mapping):
        raise TypeError(f"{arg} must be a dict {{qid: {{doc_id: score}}}}, got {type(run).__name__}")
    out = {}
    for qid, docs in run.items():
        if not isinstance(docs, Mapping):
            raise TypeError(f"{arg}[{qid!r}] must be a dict {{doc_id: score}}, got {type(docs).__name__}")
        row = {}
        for d, s in docs.items():
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(float(s)):
                raise ValueError(f"{arg}[{qid!r}][{d!r}]: score must be a finite number, got {s!r}")
            row[str(d)] = float(s)
        out[str(qid)] = row
    return out


def _as_map(items, arg: str) -> Dict[str, Any]:
    """{id: item} from a mapping, a RetrievalDataset (its records for docs / queries) or an iterable of
    objects with ``.id``."""
    if isinstance(items, Mapping):
        return {str(k): v for k, v in items.items()}
    if hasattr(items, "records") and arg == "docs":
        items = items.records
    elif hasattr(items, "queries") and arg == "queries":
        items = items.queries
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(f"{arg} must be a dict {{id: item}}, a RetrievalDataset or a list of objects with .id, "
                        f"got {type(items).__name__}")
    out = {}
    for x in items:
        if not hasattr(x, "id"):
            raise TypeError(f"{arg}: item {x!r} has no .id (pass a dict {{id: item}} instead)")
        out[str(x.id)] = x
    return out


class TimePrior:
    """``s'(q, d) = s(q, d) + c * match(q, d)`` over a given run (module doc).

    ``match``: one of :data:`MATCHES`; ``c``: the weight (None: call :meth:`fit` first); ``grid``: the
    values of ``c`` tried by :meth:`fit` (None: :data:`GRID_MULTIPLIERS` times the fit run's score scale);
    ``relation``: ``inside`` / ``overlap``; ``granularity``: ``year`` / ``month`` (the unit the relation
    compares); ``kde_topk``, ``kde_sigma``, ``kde_unit``: the ``timekde``
    match's top-K documents, kernel width and axis (``year`` / ``month``).

    After :meth:`fit`: ``c`` (the chosen weight), ``fit_report`` (``{"grid": [...], "objective": [...],
    "best": ..., "baseline": objective at c = 0, "queries": n, "scale": ...}``)."""

    def __init__(self, match: str = "any_inside", c: Optional[float] = None, *, grid: Optional[Sequence[float]] = None,
                 relation: str = "inside", granularity: str = "year", kde_topk: int = 200, kde_sigma: float = 1.0,
                 kde_unit: str = "year"):
        if match not in MATCHES:
            raise ValueError(f"match must be one of {MATCHES}, got {match!r}")
        if relation not in RELATIONS:
            raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c)):
            raise ValueError(f"c must be a finite number or None, got {c!r}")
        if grid is not None:
            grid = [float(g) for g in grid]
            if not grid or not all(math.isfinite(g) for g in grid):
                raise ValueError(f"grid must be a non-empty list of finite numbers, got {grid!r}")
        if isinstance(kde_topk, bool) or not isinstance(kde_topk, int) or kde_topk < 1:
            raise ValueError(f"kde_topk must be an int >= 1, got {kde_topk!r}")
        if not kde_sigma > 0:
            raise ValueError(f"kde_sigma must be > 0, got {kde_sigma!r}")
        if kde_unit not in ("year", "month"):
            raise ValueError(f"kde_unit must be 'year' or 'month', got {kde_unit!r}")
        self.match, self.relation, self.granularity = match, relation, granularity
        self.c = None if c is None else float(c)
        self.grid = grid
        self.kde_topk, self.kde_sigma, self.kde_unit = kde_topk, float(kde_sigma), kde_unit
        self.fit_report: Optional[dict] = None
        self._cache: dict = {}

    def __repr__(self) -> str:
        return (f"TimePrior(match={self.match!r}, c={self.c!r}, relation={self.relation!r}, "
                f"granularity={self.granularity!r})")

    # -- match values ----------------------------------------------------------------------------------
    def match_scores(self, run, queries, docs) -> Run:
        """``{qid: {doc_id: match}}`` for every (query, document) of ``run``. ``queries``: {qid: Query or
        (start, end)} / a list of Queries / a RetrievalDataset; ``docs``: {doc_id: Record or list of
        [start, end] prefixes} / a list of Records / a RetrievalDataset. Every query and document of the
        run must be among them."""
        run = _as_run(run)
        qmap, dmap = _as_map(queries, "queries"), _as_map(docs, "docs")
        out: Run = {}
        for qid, row in run.items():
            if qid not in qmap:
                raise KeyError(f"queries: run query {qid!r} is not among the queries given")
            qspan = query_span(qmap[qid])
            spans = {}
            for d in row:
                if d not in dmap:
                    raise KeyError(f"docs: run document {d!r} (query {qid!r}) is not among the docs given")
                x = dmap[d]
                spans[d] = (_spans_of_times(x, f"docs[{d!r}]") if isinstance(x, (list, tuple))
                            else record_spans(x, cache=self._cache))
            if self.match == "timekde":
                out[qid] = self._kde(row, spans)
            else:
                f = match_any_inside if self.match == "any_inside" else match_first_date
                g = self.granularity
                qspan = coarsen(qspan, g)
                out[qid] = {d: f(qspan, [coarsen(x, g) for x in spans[d]], self.relation) for d in row}
        return out

    def _kde(self, row: Mapping[str, float], spans: Mapping[str, List[Span]]) -> Dict[str, float]:
        import numpy as np
        from ..baselines.timekde import time_kde_prior
        div = 12 if self.kde_unit == "year" else 1
        ids = list(row)
        mids = [None if not spans[d] else (min(s[0] for s in spans[d]) + max(s[1] for s in spans[d])) / 2 / div
                for d in ids]
        timed = [m for m in mids if m is not None]
        if not timed:
            return {d: 0.0 for d in ids}
        base = math.floor(min(timed))
        bins = np.asarray([-1 if m is None else int(math.floor(m)) - base for m in mids], dtype=np.int64)
        nb = int(bins.max()) + 1
        scores = np.asarray([row[d] for d in ids], dtype=np.float64)
        # time_kde_prior takes the top-K by score: shift scores to be positive so that "no score" cannot
        # happen for runs of negative cosines
        scores = scores - scores.min() + 1.0
        p = time_kde_prior(scores, bins, nb, topk=self.kde_topk, sigma=self.kde_sigma)
        # untimed documents get 0 (no shift), as in the binary matches; timed ones log p - log(1/nb) (the
        # uniform density's log: a constant per query, so the ranking is the paper's)
        return {d: (0.0 if b < 0 else float(math.log(pv + 1e-8) - math.log(1.0 / nb)))
                for d, b, pv in zip(ids, bins.tolist(), p.tolist())}

    # -- rerank / fit ----------------------------------------------------------------------------------
    @staticmethod
    def _shift(run: Run, match: Run, c: float) -> Run:
        return {q: {d: s + c * match[q][d] for d, s in row.items()} for q, row in run.items()}

    def rerank(self, run, queries, docs, *, c: Optional[float] = None) -> Run:
        """A new run: the same documents per query, each score ``s + c * match`` (``c``: this prior's
        ``c`` unless given). Queries and documents are never added or dropped."""
        c = self.c if c is None else float(c)
        if c is None:
            raise ValueError("TimePrior.rerank: c is not set: pass c= or call fit(run, queries, docs) first")
        run = _as_run(run)
        return self._shift(run, self.match_scores(run, queries, docs), c)

    def fit(self, run, queries, docs) -> "TimePrior":
        """Choose ``c`` on ``run`` (training queries: never the queries you evaluate on) by grid search
        maximising the mean nDCG@10 over the queries of the run that have gold documents (``query.gold``
        with a value > 0). Returns self."""
        from ..eval.metrics import per_query_metrics, rank_documents
        run = _as_run(run)
        qmap = _as_map(queries, "queries")
        gold = {}
        for qid in run:
            q = qmap.get(qid)
            g = getattr(q, "gold", None) if q is not None else None
            if g:
                rel = {d for d, r in g.items() if r > 0}
                if rel:
                    gold[qid] = rel
        if not gold:
            raise ValueError("TimePrior.fit: no query of run has gold documents among queries (fit needs a run of "
                             "training queries with their gold)")
        match = self.match_scores(run, queries, docs)
        spread = sorted(max(row.values()) - min(row.values()) for row in run.values() if row)
        scale = spread[len(spread) // 2] if spread else 0.0
        scale = scale if scale > 0 else 1.0
        grid = list(self.grid) if self.grid is not None else [m * scale for m in GRID_MULTIPLIERS]
        objective = []
        for c in grid:
            total = 0.0
            for qid, rel in gold.items():
                row = run[qid]
                shifted = {d: s + c * match[qid][d] for d, s in row.items()}
                total += per_query_metrics(rank_documents(shifted)[:10], rel, ks=(10,))["nDCG@10"]
            objective.append(total / len(gold))
        best = max(range(len(grid)), key=lambda i: (objective[i], -abs(grid[i])))
        self.c = float(grid[best])
        base = None
        if 0.0 in grid:
            base = objective[grid.index(0.0)]
        self.fit_report = {"match": self.match, "relation": self.relation, "granularity": self.granularity,
                           "grid": grid, "objective": objective,
                           "best": self.c, "objective_best": objective[best], "objective_c0": base,
                           "queries": len(gold), "scale": scale}
        return self
