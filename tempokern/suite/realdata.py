"""Real-data sets of the comparison suite: TimeQA (``tempokern benchmark --suite timeqa``, the main job
``tempokern demo``) and a BEIR folder of your own (``tempokern benchmark --data DIR``).

A set here has the shape of a synthetic set (``dataset``, ``calendar``, ``train_rows``, ``info``) plus
``eval_splits`` (the query splits the table reports) and ``gallery_ids`` (the records a query is ranked
over). Every trained row of the table trains on the same ``train_rows``: one per training query, its
first gold record as the positive, its hard negatives and negative queries fixed here, not by the method.

TimeQA (:func:`timeqa_set`):

* Train: the queries of the ``train`` pages. Hard negatives: the same page's other dated paragraphs
  first (kind ``time_wrong``: same entity, another time — the confounder the temporal methods exist
  for), then BM25-mined ones over the training pages (kind ``bm25``). Negative queries (TMRL's L_Temp):
  the same (page, relation)'s other questions whose interval differs.
* Evaluation: the ``dev`` pages' queries ranked over the ``dev`` pages' paragraphs (``eval_split="test"``:
  the ``test`` pages). Ranking over the held-out pages only keeps what makes TimeQA hard — choosing
  among one page's paragraphs by time — and costs an eighth of encoding all 15,491 paragraphs per row.
* Fit split (``fit``, for the time-prior rows, never in the tables): the training questions of a fixed,
  seeded sample of as many training pages as there are held-out pages (50 on dev), ranked over those pages'
  paragraphs: a gallery shaped like the evaluation gallery, so a retriever's scores there resemble its dev
  scores. A trained row saw these questions in training, so the weight fitted on them is conservative.
* Whole-corpus split (``dev@corpus`` / ``test@corpus``, ``corpus=True``): the evaluation questions ranked
  over every packaged TimeQA paragraph (15,491, every page of every split).
* Error kinds: a wrong top-1 paragraph of the query's own page is ``err_time`` (right page, wrong
  paragraph: on TimeQA that is nearly always another period of the same life), one of another page
  ``err_entity``.
* ``size="quick"``: a fixed sample of pages (``QUICK_PAGES``) for the CI run of the main job.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence

from ..datasets.base import Query, Record, RetrievalDataset
from ..datasets.synth._common import TrainRow

__all__ = ["RealSet", "timeqa_set", "beir_set", "REAL_SETS", "QUICK_PAGES", "FIT_QUERIES"]

#: set names of real data (the synthetic sets are A, B, C)
REAL_SETS = ("timeqa", "data")
#: (train pages, held-out pages) of the quick TimeQA set, drawn by a fixed seed
QUICK_PAGES = (16, 6)
#: training queries of a BEIR folder's fit split (a seeded sample when it has more)
FIT_QUERIES = 500
#: the seed of the fit split's sample (pages of TimeQA, queries of a BEIR folder)
FIT_SEED = 5151


@dataclass
class RealSet:
    """A real-data set in the suite's shape (see the module doc)."""
    name: str
    dataset: RetrievalDataset
    calendar: Any
    train_rows: List[TrainRow]
    info: Dict[str, Any]
    eval_splits: List[str]
    gallery_ids: Optional[List[str]] = None
    notes: List[str] = field(default_factory=list)
    #: extra splits ``{name: {"queries": query split, "query_ids": [...] or None (all), "gallery_ids": [...]}}``
    #: (``fit``, ``dev@corpus``; :class:`tempokern.suite.SuiteContext` serves them)
    extra_splits: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    #: records an extra split ranks over that are not in ``dataset`` (the whole corpus's other pages)
    extra_records: List[Record] = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"RealSet({self.name!r}: {len(self.dataset.records)} records, {len(self.gallery_ids or ())} in the "
                f"gallery, {len(self.train_rows)} train rows, eval {self.eval_splits})")

    def queries(self, split: str) -> List[Query]:
        return self.dataset.queries_in(split)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def _train_rows(ds: RetrievalDataset, train_qs: Sequence[Query], pool: Sequence[Record], *, k_neg: int,
                k_negq: int, group_key: Optional[str], given: Optional[Dict[str, List[str]]] = None) -> List[TrainRow]:
    """One TrainRow per training query (first gold record = positive): ``k_neg`` hard negatives (same
    group's dated records first, then BM25 over ``pool``), ``k_negq`` negative queries (the same group's
    questions with another interval)."""
    from ..datasets.negatives import bm25_negatives, group_negatives
    view = RetrievalDataset(f"{ds.name}[train]", pool, train_qs, ds.calendar)
    given = {qid: ids[:k_neg] for qid, ids in (given or {}).items() if ids}   # the data's own negatives win
    mine = [q for q in train_qs if q.id not in given]
    group = group_negatives(view, group_key, k=k_neg, queries=mine) if (group_key and k_neg and mine) else {}
    need = [q for q in mine if len(group.get(q.id, ())) < k_neg]
    try:
        mined = bm25_negatives(view, k_neg, queries=need) if (need and k_neg) else {}
    except ImportError:          # bm25s missing: same-group negatives only
        mined = {}
    by_group: Dict[Any, List[Query]] = {}
    for q in train_qs:
        g = (q.meta or {}).get(group_key) if group_key else None
        if g is not None:
            by_group.setdefault((g, (q.meta or {}).get("relation")), []).append(q)
    rows = []
    for q in train_qs:
        gold = [d for d in q.relevant_ids() if d in ds]
        if not gold:
            continue
        pos = gold[0]
        hn = [(d, "given") for d in given.get(q.id, [])]
        hn += [(d, "time_wrong" if ds.record(d).interval is not None else "same_group")
               for d in ([] if hn else group.get(q.id, [])[:k_neg])]
        for d in mined.get(q.id, []):
            if len(hn) >= k_neg:
                break
            if d not in {x for x, _ in hn}:
                hn.append((d, "bm25"))
        nq = []
        g = (q.meta or {}).get(group_key) if group_key else None
        if g is not None and k_negq:
            for o in by_group.get((g, (q.meta or {}).get("relation")), ()):
                if o.id != q.id and o.interval != q.interval and not (set(o.gold) & set(q.gold)):
                    nq.append(o.text)
                if len(nq) >= k_negq:
                    break
        rows.append(TrainRow(q.id, q.text, pos, [d for d, _ in hn], [k for _, k in hn], nq))
    return rows


def _with_entity(r, key: str):
    """A copy of a record / query whose ``meta["entity"]`` is its ``meta[key]`` (the suite's error kinds)."""
    m = dict(r.meta or {})
    if m.get(key) is not None:
        m["entity"] = m[key]
        m.setdefault("attribute", None)
    return replace(r, meta=m)


def timeqa_set(size: str = "full", *, eval_split: str = "dev", path: Optional[str] = None, hard_negatives: int = 1,
               negative_queries: int = 2, corpus: bool = True) -> RealSet:
    """TimeQA as a suite set (module doc). ``size``: ``full`` (every page of the splits) or ``quick``
    (``QUICK_PAGES`` pages drawn by a fixed seed); ``eval_split``: ``dev`` or ``test``; ``path``: a TimeQA
    JSON file (default the packaged copy); ``corpus``: add the whole-corpus split ``<eval_split>@corpus``."""
    from ..datasets.timeqa import load_timeqa
    if size not in ("full", "quick"):
        raise ValueError(f"size must be 'full' or 'quick', got {size!r}")
    if eval_split not in ("dev", "test"):
        raise ValueError(f"eval_split must be 'dev' or 'test', got {eval_split!r}")
    full = load_timeqa(path)
    train_pages = sorted({q.meta["page"] for q in full.queries if q.split == "train"})
    eval_pages = sorted({q.meta["page"] for q in full.queries if q.split == eval_split})
    if size == "quick":
        rng = random.Random(20211)
        train_pages = sorted(rng.sample(train_pages, min(QUICK_PAGES[0], len(train_pages))))
        eval_pages = sorted(rng.sample(eval_pages, min(QUICK_PAGES[1], len(eval_pages))))
    tp, ep = set(train_pages), set(eval_pages)
    records = [_with_entity(r, "page") for r in full.records if r.meta["page"] in tp | ep]
    queries = [_with_entity(q, "page") for q in full.queries
               if (q.split == "train" and q.meta["page"] in tp) or (q.split == eval_split and q.meta["page"] in ep)]
    ds = RetrievalDataset(f"timeqa-{size}", records, queries, full.calendar, full.report)
    pool = [r for r in records if r.meta["page"] in tp]
    train_qs = [q for q in queries if q.split == "train"]
    rows = _train_rows(ds, train_qs, pool, k_neg=hard_negatives, k_negq=negative_queries, group_key="page")
    gallery = [r.id for r in records if r.meta["page"] in ep]
    info = {"source": "TimeQA human-annotated pages (BSD 3-Clause), split by page", "size": size,
            "eval_split": eval_split, "train_pages": len(tp), "eval_pages": len(ep), "gallery": len(gallery),
            "train_queries": len(train_qs), "train_rows": len(rows),
            "eval_queries": sum(q.split == eval_split for q in queries),
            "hard_negatives": hard_negatives, "negative_queries": negative_queries}
    info["checksum"] = _digest({"info": info, "records": [r.id for r in records], "queries": [q.id for q in queries],
                                "rows": [(r.query_id, r.positive, r.hard_negatives, r.negative_queries) for r in rows]})
    # the extra splits (after the checksum: units made before them keep their settings, see runner)
    fit_pages = sorted(random.Random(FIT_SEED).sample(train_pages, min(len(eval_pages), len(train_pages))))
    fp = set(fit_pages)
    extra = {"fit": {"queries": "train", "query_ids": [q.id for q in train_qs if q.meta["page"] in fp],
                     "gallery_ids": [r.id for r in records if r.meta["page"] in fp]}}
    extra_records = []
    if corpus:
        have = {r.id for r in records}
        extra_records = [_with_entity(r, "page") for r in full.records if r.id not in have]
        extra[f"{eval_split}@corpus"] = {"queries": eval_split, "query_ids": None,
                                         "gallery_ids": [r.id for r in full.records]}
    info["fit"] = {"pages": len(fp), "queries": len(extra["fit"]["query_ids"]),
                   "gallery": len(extra["fit"]["gallery_ids"]), "seed": FIT_SEED}
    if corpus:
        info["corpus_gallery"] = len(full.records)
    return RealSet("timeqa", ds, full.calendar, rows, info, [eval_split], gallery, extra_splits=extra,
                   extra_records=extra_records)


def beir_set(folder: str, *, on_error: str = "raise", hard_negatives: int = 1, negative_queries: int = 2,
             group_key: str = "page") -> RealSet:
    """A BEIR folder of your own as a suite set: training rows from ``qrels/train.tsv``, the table on every
    other qrels split (``dev``, ``test``, ...), ranked over the whole corpus. Fit split (the time-prior rows):
    the training queries (a seeded sample of ``FIT_QUERIES`` when there are more) over the whole corpus. Hard negatives: the query's
    ``neg_*`` fields when the folder has them, else the same ``meta[group_key]`` group's records, else
    BM25-mined; negative queries: the same group's other questions with another interval."""
    from ..datasets import load_beir
    full = load_beir(folder, on_error=on_error)
    splits = sorted({q.split for q in full.queries if q.split})
    if "train" not in splits:
        raise ValueError(f"{folder}: no qrels/train.tsv (the suite trains every row on it)")
    evals = [s for s in splits if s != "train"]
    if not evals:
        raise ValueError(f"{folder}: no qrels split besides train to evaluate on (add qrels/dev.tsv or test.tsv)")
    records = [_with_entity(r, group_key) for r in full.records]
    queries = [_with_entity(q, group_key) for q in full.queries]
    ds = RetrievalDataset(full.name, records, queries, full.calendar, full.report)
    train_qs = [q for q in queries if q.split == "train"]
    given = {q.id: [d for key in ("neg_page", "neg_bm25", "negatives") for d in (q.meta or {}).get(key) or ()
                    if d in ds] for q in train_qs}
    rows = _train_rows(ds, train_qs, records, k_neg=hard_negatives, k_negq=negative_queries, group_key=group_key,
                       given={k: list(dict.fromkeys(v)) for k, v in given.items()})
    info = {"source": str(folder), "size": "full", "eval_splits": evals, "gallery": len(records),
            "train_queries": len(train_qs), "train_rows": len(rows), "hard_negatives": hard_negatives,
            "negative_queries": negative_queries}
    info["checksum"] = _digest({"info": info, "records": [(r.id, r.text) for r in records],
                                "queries": [(q.id, q.text, q.split, sorted(q.gold.items())) for q in queries]})
    fit_q = [q.id for q in train_qs]
    if len(fit_q) > FIT_QUERIES:
        fit_q = sorted(random.Random(FIT_SEED).sample(fit_q, FIT_QUERIES))
    info["fit"] = {"queries": len(fit_q), "gallery": len(records), "seed": FIT_SEED}
    extra = {"fit": {"queries": "train", "query_ids": fit_q, "gallery_ids": [r.id for r in records]}}
    return RealSet("data", ds, full.calendar, rows, info, evals, None, extra_splits=extra)
