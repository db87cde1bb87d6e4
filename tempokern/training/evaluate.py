"""Dense CTD retrieval evaluation with ChunQiuTR-style metrics (per query family)."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from .._ops.ctd_topk import ctd_topk
from ..eval import retrieval_metrics
from ..nn.offset_bias import bias_params
from ..models.encoder import check_scorer
from .data import queries_of

METRIC_KEYS = ("R@1", "R@5", "R@10", "MRR@10", "nDCG@10")


def gallery_of(dataset, *, neg: bool = True, ne: bool = True):
    return dataset.gallery(neg=neg, ne=ne)


@torch.no_grad()
def score_topk(model, q_texts: Sequence[str], g_enc, k: int, *, batch_size: int = 64, scorer: str = "ctd"):
    """Top-k gallery indices and scores. scorer="ctd": the model's full CTD score
    s = q.g / temperature + bias(u_q, u_g) (bias only when the model uses it); "encoder": the cosine of
    the backbone's pooled vectors (g_enc must then come from model.encode(..., scorer="encoder"))."""
    check_scorer(scorer)
    qe = model.encode(list(q_texts), batch_size=batch_size, scorer=scorer)
    bias = None
    if scorer == "ctd" and model.use_bias:
        bias = (qe.u.float().contiguous(), g_enc.u.float().contiguous(),
                *[p.detach().float().cpu() for p in bias_params(model.offset_bias)])
    k = min(k, g_enc.embeddings.shape[0])
    vals, idx = ctd_topk(qe.embeddings.float().contiguous(), g_enc.embeddings.float().contiguous(), k,
                        temperature=model.temperature if scorer == "ctd" else 1.0, bias=bias)
    return vals, idx


def evaluate_model(model, dataset, split: str = "test", *, ks=(1, 5, 10), depth: int = 100,
                   neg: bool = True, ne: bool = True, drop_no_event: bool = False, batch_size: int = 64,
                   gallery_enc=None, scorer: str = "ctd", return_run: bool = False):
    """{"all": metrics, "<family>": metrics, ...} for the queries of `split` against the gallery
    chosen by ChunQiuTR's switches (neg: neg_comment records, ne: no_event records, drop_no_event:
    drop queries whose gold is all no_event; the reference names the combination
    neg{neg}_ne{ne}_dq{drop_no_event}). Gold lists are cut to the gallery; queries left with no gold
    are dropped (ChunQiuTR protocol). scorer: "ctd" (the full model) or "encoder" (the backbone alone,
    as the reference's evaluate.py and validation score); see docs/eval.md. return_run: also return the
    ranking the table is computed from, ``(table, {qid: {doc_id: score}})`` (the top ``depth``)."""
    check_scorer(scorer)
    gallery = gallery_of(dataset, neg=neg, ne=ne)
    gids = [r.id for r in gallery]
    in_gallery = set(gids)
    queries = [q for q in queries_of(dataset, split)
               if not (drop_no_event and getattr(q, "pure_no_event", False))]
    qrels = {}
    for q in queries:
        gold = {d: q.gold[d] for d in q.relevant_ids() if d in in_gallery}   # score > 0 (is_relevant)
        if gold:
            qrels[q.id] = gold
    queries = [q for q in queries if q.id in qrels]
    if not queries:
        raise ValueError(f"no query of split {split!r} has a gold record in the gallery")
    if gallery_enc is None:
        gallery_enc = model.encode([r.text for r in gallery], batch_size=batch_size, scorer=scorer)
    vals, idx = score_topk(model, [q.text for q in queries], gallery_enc, depth, batch_size=batch_size,
                           scorer=scorer)
    run = {q.id: {gids[j]: float(v) for j, v in zip(idx[i].tolist(), vals[i].tolist())}
           for i, q in enumerate(queries)}
    table = {"all": _clean(retrieval_metrics(run, qrels, ks=tuple(ks)), len(queries))}
    for fam in sorted({q.family for q in queries}):
        ids = [q.id for q in queries if q.family == fam]
        table[fam] = _clean(retrieval_metrics({i: run[i] for i in ids}, {i: qrels[i] for i in ids}, ks=tuple(ks)),
                            len(ids))
    return (table, run) if return_run else table


def _clean(m: dict, n: int) -> dict:
    out = {k: float(v) for k, v in m.items() if isinstance(v, (int, float))}
    out["queries"] = n
    return out


def _cell(key: str, v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if "seconds" in key:
            return f"{v:.1f} s"
        if "loss" in key:
            return f"{v:.4g}"
        return f"{v:.3f}"
    return str(v)


def markdown_table(rows: Sequence[dict], keys: Sequence[str] = METRIC_KEYS, name_key: str = "name") -> str:
    """Rows as a markdown table: metrics with 3 decimals, losses with 4 significant digits, durations
    (keys with "seconds") as "12.3 s"."""
    head = "| " + " | ".join([name_key] + [k.replace("_seconds", " time") for k in keys]) + " |"
    sep = "|" + "---|" * (len(keys) + 1)
    lines = [head, sep]
    for r in rows:
        cells = [str(r.get(name_key, ""))] + [_cell(k, r.get(k)) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
