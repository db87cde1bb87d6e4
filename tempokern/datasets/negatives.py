"""Hard negatives of a :class:`RetrievalDataset`'s queries: BM25-mined (lexically closest non-gold
records) and same-group (the other records of a query's page / group, which share its entity and
differ in time: the temporal confounders)."""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

from .base import is_relevant

__all__ = ["bm25_negatives", "group_negatives", "word_tokenize"]

_WORD = re.compile(r"\w+", re.UNICODE)


def word_tokenize(text: str) -> List[str]:
    """Lower-cased word tokens (BM25 over English text)."""
    return _WORD.findall(text.lower())


def bm25_negatives(dataset, k: int = 4, *, queries: Optional[Sequence] = None, tokenizer=None,
                   exclude: Optional[Dict[str, set]] = None, chunk: int = 256) -> Dict[str, List[str]]:
    """``{query id: [record id, ...]}``: the ``k`` highest-BM25 records of the whole gallery that are
    not gold for the query (nor in ``exclude[qid]``), best first. Deterministic (ties by gallery order).
    ``tokenizer``: default :func:`word_tokenize`; needs the ``bm25s`` package."""
    import numpy as np

    from ..baselines import BM25Scorer
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    qs = list(dataset.queries if queries is None else queries)
    gallery = list(dataset.records)
    scorer = BM25Scorer(tokenizer=tokenizer or word_tokenize)
    out: Dict[str, List[str]] = {}
    for s in range(0, len(qs), chunk):
        part = qs[s:s + chunk]
        sc = np.asarray(scorer(part, gallery), dtype=np.float64)
        depth = min(sc.shape[1], k + 64)
        for i, q in enumerate(part):
            skip = set(q.relevant_ids()) | set((exclude or {}).get(q.id, ()))
            row = sc[i]
            top = np.argpartition(-row, depth - 1)[:depth] if depth < len(row) else np.arange(len(row))
            top = sorted(top.tolist(), key=lambda j: (-row[j], j))
            picked = [gallery[j].id for j in top if gallery[j].id not in skip and row[j] > 0][:k]
            out[q.id] = picked
    return out


def group_negatives(dataset, key: str = "page", *, k: Optional[int] = None, timed_first: bool = True,
                    queries: Optional[Sequence] = None) -> Dict[str, List[str]]:
    """``{query id: [record id, ...]}``: the records sharing the query's ``meta[key]`` (e.g. its page)
    that are not gold for it, in gallery order (records with a time in their text first when
    ``timed_first``); at most ``k``. Queries without ``meta[key]`` get none."""
    by_group: Dict[str, List] = {}
    for r in dataset.records:
        g = (r.meta or {}).get(key)
        if g is not None:
            by_group.setdefault(str(g), []).append(r)
    out: Dict[str, List[str]] = {}
    for q in (dataset.queries if queries is None else queries):
        g = (q.meta or {}).get(key)
        cands = [r for r in by_group.get(str(g), ()) if not is_relevant(q.gold.get(r.id, 0))] if g is not None else []
        if timed_first:
            cands = [r for r in cands if r.interval is not None] + [r for r in cands if r.interval is None]
        ids = [r.id for r in cands]
        out[q.id] = ids if k is None else ids[:k]
    return out
