"""The evaluation runner: ChunQiuTR's protocol over any scorer.

``evaluate(scorer, dataset, protocol=...)`` builds each protocol mode's gallery, scores the
queries of each split against it, and reports per-family rows of ChunQiuTR metrics (plus TEMPO's
TP/TR when the data is time-keyed).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from ..datasets.base import Query, Record, RetrievalDataset
from .metrics import retrieval_metrics
from .temporal import interval_verdicts, temporal_metrics

__all__ = ["evaluate", "EvalTable", "Mode", "parse_protocol", "CHUNQIU_MODES"]


@dataclass(frozen=True)
class Mode:
    """One protocol mode: ``neg`` neg_comment records in the gallery, ``ne`` no_event records in the
    gallery, ``dq`` drop queries whose gold is all no_event."""
    neg: bool = True
    ne: bool = True
    dq: bool = False

    @property
    def name(self) -> str:
        return f"neg{int(self.neg)}_ne{int(self.ne)}_dq{int(self.dq)}"

    @classmethod
    def parse(cls, s: str) -> "Mode":
        parts = s.strip().lower().split("_")
        vals = {}
        for p in parts:
            for flag in ("neg", "ne", "dq"):
                if p.startswith(flag) and p[len(flag):] in ("0", "1"):
                    vals[flag] = p[len(flag):] == "1"
                    break
        if len(parts) != 3 or set(vals) != {"neg", "ne", "dq"}:
            raise ValueError(f"protocol mode must look like 'neg1_ne1_dq0', got {s!r}")
        return cls(**vals)


#: the six modes the ChunQiuTR scripts report (ne0 with dq0 is left out: with no no_event record in
#: the gallery, pure no-event queries have no gold left and drop out anyway)
CHUNQIU_MODES = tuple(Mode(neg, ne, dq) for neg in (False, True) for ne in (False, True) for dq in (False, True)
                      if ne or dq)


def parse_protocol(protocol) -> List[Mode]:
    """``"chunqiu"`` (the six modes), ``"full"`` (= ``"neg1_ne1_dq0"``), a mode string, a
    :class:`Mode`, a dict of flags, or a list of those."""
    if isinstance(protocol, Mode):
        return [protocol]
    if isinstance(protocol, str):
        p = protocol.strip().lower()
        if p in ("chunqiu", "chunqiutr", "all"):
            return list(CHUNQIU_MODES)
        if p == "full":
            return [Mode(True, True, False)]
        return [Mode.parse(p)]
    if isinstance(protocol, dict):
        bad = set(protocol) - {"neg", "ne", "dq"}
        if bad:
            raise ValueError(f"protocol dict keys must be neg/ne/dq, got {sorted(bad)}")
        return [Mode(**{k: bool(v) for k, v in protocol.items()})]
    if isinstance(protocol, (list, tuple)) and protocol:
        out: List[Mode] = []
        for p in protocol:
            out += parse_protocol(p)
        return out
    raise TypeError(f"protocol must be 'chunqiu', 'full', a mode like 'neg1_ne1_dq0', a Mode, a dict or a list, "
                    f"got {protocol!r}")


def _atomic_write(path: str, text: str) -> None:
    from ..models.checkpoint import atomic_write
    atomic_write(path, text)


class EvalTable:
    """Rows ``{"mode", "split", "family", "N", <metrics>}`` plus run details (gallery sizes, dropped
    query counts). ``to_dict()``, ``to_json(path=None)``, ``to_markdown()``, ``get(...)``."""

    def __init__(self, rows: List[Dict[str, Any]], info: Dict[str, Any], metrics: Sequence[str]):
        self.rows, self.info, self.metrics = rows, info, list(metrics)

    def get(self, mode: Optional[str] = None, split: Optional[str] = None, family: str = "all") -> Dict[str, Any]:
        """The one row matching; mode/split may be left out when there is only one."""
        hits = [r for r in self.rows if r["family"] == family and (mode is None or r["mode"] == mode)
                and (split is None or r["split"] == split)]
        if len(hits) != 1:
            raise KeyError(f"{len(hits)} rows match mode={mode!r} split={split!r} family={family!r}")
        return hits[0]

    def to_dict(self) -> Dict[str, Any]:
        return {"metrics": self.metrics, "rows": self.rows, "info": self.info}

    def to_json(self, path: Optional[str] = None, indent: int = 2) -> str:
        """JSON text; with ``path``, also written atomically (temp file + rename)."""
        text = json.dumps(self.to_dict(), ensure_ascii=False, indent=indent)
        if path is not None:
            _atomic_write(path, text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str) -> "EvalTable":
        text = text_or_path
        if os.path.exists(text_or_path):
            with open(text_or_path, encoding="utf-8") as f:
                text = f.read()
        d = json.loads(text)
        if not isinstance(d, dict) or not {"metrics", "rows", "info"} <= set(d):
            raise ValueError("not an EvalTable JSON (needs metrics, rows, info)")
        return cls(d["rows"], d["info"], d["metrics"])

    def to_markdown(self, digits: int = 4) -> str:
        cols = ["mode", "split", "family", "N"] + self.metrics
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if c in ("mode", "split", "family") else "---:"
                                                               for c in cols) + "|"]
        for r in self.rows:
            cells = [str(r[c]) if not isinstance(r.get(c), float) else f"{r[c]:.{digits}f}" for c in cols]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.to_markdown()


Scorer = Callable[[Sequence[Query], Sequence[Record]], Any]


def _resolve_scorer(obj) -> Scorer:
    if callable(obj):
        return obj
    for name in ("score", "score_queries"):
        fn = getattr(obj, name, None)
        if callable(fn):
            return fn
    raise TypeError("scorer_or_index must be callable as scorer(queries, gallery) -> (Q, G) scores, or have a "
                    f".score(queries, gallery) method; got {type(obj).__name__}")


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _run_for(scorer: Scorer, queries: List[Query], gallery: List[Record], depth: int, batch: int
             ) -> Dict[str, Dict[str, float]]:
    ids = [r.id for r in gallery]
    run: Dict[str, Dict[str, float]] = {}
    k = min(depth, len(gallery))
    for s in range(0, len(queries), batch):
        qs = queries[s:s + batch]
        sc = _to_numpy(scorer(qs, gallery))
        if sc.shape != (len(qs), len(gallery)):
            raise ValueError(f"scorer returned shape {sc.shape}, expected (num_queries, gallery_size) = "
                             f"({len(qs)}, {len(gallery)})")
        if np.isnan(sc).any():
            raise ValueError("scorer returned NaN scores")
        top = np.argpartition(-sc, k - 1, axis=1)[:, :k] if k < len(gallery) else np.tile(np.arange(len(gallery)),
                                                                                           (len(qs), 1))
        for i, q in enumerate(qs):
            run[q.id] = {ids[j]: float(sc[i, j]) for j in top[i]}
    return run


def _family_rows(fam: str) -> List[str]:
    # the paper's "window" row holds every non-point query (window and gap)
    return ["all", "point"] if fam == "point" else ["all", "window"] + ([fam] if fam != "window" else [])


def evaluate(scorer_or_index, dataset: RetrievalDataset, protocol: Union[str, Mode, dict, list] = "full",
             splits: Optional[Sequence[str]] = None, ks: Sequence[int] = (1, 5, 10), depth: int = 100,
             batch_size: int = 256, temporal: Optional[bool] = None, temporal_k: int = 10) -> EvalTable:
    """Evaluate a scorer on a dataset under ChunQiuTR's protocol.

    ``scorer_or_index``: any callable ``scorer(queries, gallery) -> (len(queries), len(gallery))``
    scores (numpy, torch or nested lists; higher is better), e.g. :class:`tempokern.baselines.BM25Scorer`,
    a dense model, or an index object with ``.score(queries, gallery)``.
    ``protocol``: see :func:`parse_protocol` (default ``"full"``: neg1_ne1_dq0; ``"chunqiu"`` runs the
    paper's six modes). For each mode: the gallery is the whole corpus filtered by neg/ne; each
    split's queries (``splits`` default: the dataset's splits, else all queries) lose their
    pure-no-event members when dq; gold lists are cut to the gallery and queries left with none are
    dropped (counted in ``info``). ``depth``: ranking depth kept per query (>= max(ks), 10).
    Rows: families ``all``, ``point``, ``window`` (every non-point query, as in the paper's scripts)
    and ``gap`` when gap queries exist. ``temporal``: add TEMPO's TP@k / TR@k from interval overlap
    (default: when queries and records carry intervals)."""
    scorer = _resolve_scorer(scorer_or_index)
    if not isinstance(dataset, RetrievalDataset):
        raise TypeError(f"dataset must be a tempokern.datasets.RetrievalDataset, got {type(dataset).__name__}")
    modes = parse_protocol(protocol)
    ks = tuple(ks)
    depth = max(int(depth), max(ks), 10)
    if splits is None:
        have = dataset.splits()
        splits = [s for s in ("val", "test") if s in have] or [s for s in have if s != "mixed"] or [None]
    if temporal is None:
        temporal = any(q.interval is not None for q in dataset.queries) and \
            any(r.interval is not None for r in dataset.records)
    metric_names = [f"R@{k}" for k in ks] + ["MRR@10", "nDCG@10"] + [f"recall@{k}" for k in ks]
    if temporal:
        metric_names += [f"TP@{temporal_k}", f"TR@{temporal_k}"]
    rows: List[Dict[str, Any]] = []
    info: Dict[str, Any] = {"dataset": dataset.name, "modes": {}, "depth": depth}
    q_iv = {q.id: q.interval for q in dataset.queries}
    d_iv = {r.id: r.interval for r in dataset.records}
    verdict = interval_verdicts(q_iv, d_iv) if temporal else None
    for mode in modes:
        gallery = dataset.gallery(neg=mode.neg, ne=mode.ne)
        if not gallery:
            raise ValueError(f"mode {mode.name}: the gallery is empty")
        in_gallery = {r.id for r in gallery}
        minfo = info["modes"][mode.name] = {"gallery_size": len(gallery), "splits": {}}
        for split in splits:
            qs = dataset.queries if split is None else dataset.queries_in(split)
            kept, dropped_dq, dropped_nogold = [], 0, 0
            qrels: Dict[str, Dict[str, int]] = {}
            for q in qs:
                if mode.dq and q.pure_no_event:
                    dropped_dq += 1
                    continue
                g = {d: q.gold[d] for d in q.relevant_ids() if d in in_gallery}
                if not g:
                    dropped_nogold += 1
                    continue
                kept.append(q)
                qrels[q.id] = g
            sname = "all" if split is None else split
            minfo["splits"][sname] = {"queries": len(kept), "dropped_pure_no_event": dropped_dq,
                                      "dropped_no_gold_in_gallery": dropped_nogold}
            if not kept:
                continue
            run = _run_for(scorer, kept, gallery, depth, batch_size)
            per = retrieval_metrics(run, qrels, ks, per_query=True)["per_query"]
            tem = temporal_metrics(run, verdict, (temporal_k,), queries=[q.id for q in kept],
                                   per_query=True)["per_query"] if temporal else {}
            groups: Dict[str, List[str]] = {}
            for q in kept:
                for fam in _family_rows(q.family):
                    groups.setdefault(fam, []).append(q.id)
            order = ["all", "point", "window"] + sorted(set(groups) - {"all", "point", "window"})
            for fam in order:
                ids = groups.get(fam)
                if not ids:
                    continue
                row: Dict[str, Any] = {"mode": mode.name, "split": sname, "family": fam, "N": len(ids)}
                for m in metric_names:
                    src = tem if m.startswith(("TP@", "TR@")) else per
                    row[m] = float(np.mean([src[i][m] for i in ids]))
                rows.append(row)
    return EvalTable(rows, info, metric_names)
