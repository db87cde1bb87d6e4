"""Recency-filter rows (Re³ §3.4, design notes §3.6 "Filter"): a base retriever's top-k with and
without the conflict-aware recency filter, on set C (versioned forecasts) and set B (no outdated versions:
the filter must remove nothing there).

Rows ``<base>+recency-<variant>``: base ``minilm-zs`` (the suite's backbone, mean pooled, L2-normalised,
no training), ``bm25`` (bm25s, word tokens) or ``re3`` (the trained ``re3-film_margins`` row of the same
seed: Re³'s retriever followed by its filter, as in the paper; its runs reach depth ``ctx.depth``, so after
removals a few queries hold slightly fewer than ``ctx.depth`` documents); variant ``none`` (the base alone), ``metadata`` /
``rule`` (:class:`MetadataExtractor` — the oracle from the records' facts — or :class:`RuleExtractor`,
policy ``conflict``), ``metadata-latest`` / ``rule-latest`` (policy ``latest_only``). The filter reads the
top :data:`K` of each query; ``runs`` are the base runs with the removed documents dropped (so the suite's
R@k/MRR show its effect on ranking), and ``info["metrics"][split]`` carries the filter metrics of
:mod:`tempokern.eval.recency` at k, before (``*_base``) and after the filter: ``stale_rate``,
``version_accuracy``, ``answer_proxy``, ``evidence_tokens`` (the backbone's tokenizer, no special tokens),
``evidence_docs``, and ``removed`` / ``removed_per_query`` / ``queries_with_removals`` /
``filter_failures``. The base runs are computed once per (base, set) and shared by the rows.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

from .. import Method, MethodOutput, register, topk_runs

K = 5
BASES = {"minilm-zs": ("transformers",), "bm25": ("bm25s",), "re3": ("transformers",)}
VARIANTS = {"none": (None, "conflict"), "metadata": ("metadata", "conflict"), "rule": ("rule", "conflict"),
            "metadata-latest": ("metadata", "latest_only"), "rule-latest": ("rule", "latest_only")}
SETS = ("B", "C")

_BASE_CACHE: Dict[Tuple, Dict[str, Dict[str, Dict[str, float]]]] = {}
_TOKENIZERS: Dict[str, Any] = {}


def _cache_key(ctx, base: str) -> Tuple:
    recs = ctx.dataset.records
    return (base, str(ctx.backbone_path) if base != "bm25" else None, ctx.seed if base == "re3" else None,
            ctx.set_name, len(recs),
            recs[0].id if recs else None, recs[-1].id if recs else None, len(ctx.dataset.queries),
            ctx.budget.max_length, tuple(ctx.eval_splits), ctx.depth)


def _dense_encoder(ctx):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer
    from ...models.encoder import pool
    tok = AutoTokenizer.from_pretrained(str(ctx.backbone_path))
    model = AutoModel.from_pretrained(str(ctx.backbone_path)).to(ctx.device).eval()

    @torch.no_grad()
    def encode(texts, desc):
        out = []
        bs = ctx.budget.eval_batch_size
        for i in ctx.progress(range(0, len(texts), bs), desc):
            enc = tok(list(texts[i:i + bs]), padding=True, truncation=True, max_length=ctx.budget.max_length,
                      return_tensors="pt").to(ctx.device)
            h = model(**enc).last_hidden_state
            out.append(F.normalize(pool(h, enc["attention_mask"], "mean").float(), dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, model.config.hidden_size)
    return encode


def base_runs(ctx, base: str) -> Dict[str, Dict[str, Dict[str, float]]]:
    """``{split: run}`` of the zero-shot base over the whole gallery (top ``ctx.depth + K``, so that at
    least ``ctx.depth`` documents remain after the filter removes some of the top K)."""
    key = _cache_key(ctx, base)
    if key in _BASE_CACHE:
        return _BASE_CACHE[key]
    depth = ctx.depth + K
    runs = {}
    if base == "minilm-zs":
        import torch
        encode = _dense_encoder(ctx)
        g = encode([r.text for r in ctx.all_gallery()], "gallery")
        for split in ctx.eval_splits:   # each split over its own gallery
            qs = ctx.queries(split)
            q = encode([x.text for x in qs], split)
            gi = torch.as_tensor(ctx.gallery_index(split), dtype=torch.long)
            runs[split] = topk_runs(q @ g[gi].T, [x.id for x in qs], [r.id for r in ctx.gallery(split)], depth)
    elif base == "bm25":
        from ...baselines import BM25Scorer
        scorer = BM25Scorer(ngram=1)
        for split in ctx.eval_splits:
            qs = ctx.queries(split)
            gallery = ctx.gallery(split)
            runs[split] = topk_runs(scorer(qs, gallery), [x.id for x in qs], [r.id for r in gallery], depth)
    elif base == "re3":   # the trained Re³ row (film_margins) of this seed: the paper's retriever + filter
        from .re3 import run_re3
        runs = run_re3(ctx, "film_margins").runs
    else:
        raise ValueError(f"unknown base retriever {base!r}: expected one of {', '.join(BASES)}")
    _BASE_CACHE[key] = runs
    return runs


def _tokenizer(ctx):
    p = str(ctx.backbone_path)
    if p not in _TOKENIZERS:
        try:
            from transformers import AutoTokenizer
            _TOKENIZERS[p] = AutoTokenizer.from_pretrained(p)
        except Exception as e:   # noqa: BLE001  - reported, whitespace words are used instead
            ctx.log(f"no tokenizer at {p} ({type(e).__name__}: {e}); evidence tokens are whitespace words")
            _TOKENIZERS[p] = None
    return _TOKENIZERS[p]


def _num(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None


def filter_metrics(rep: Dict[str, Any]) -> Dict[str, float]:
    """The flat ``{name: number}`` row of :func:`tempokern.eval.recency.recency_report` for the suite
    (NaN metrics, e.g. version accuracy without versioned gold, are left out)."""
    out: Dict[str, float] = {}
    for name in ("stale_rate", "version_accuracy", "answer_proxy", "evidence_tokens", "evidence_docs"):
        for side, suffix in (("after", ""), ("before", "_base")):
            v = _num(rep[side].get(name))
            if v is not None:
                out[f"{name}{suffix}@{rep['k']}"] = v
    for name in ("removed", "removed_per_query", "queries_with_removals"):
        out[name] = float(rep[name])
    out["filter_failures"] = float(rep["failures"])
    return out


def run_recency(ctx, base: str, variant: str) -> MethodOutput:
    from ...eval.recency import apply_recency, filtered_run, make_filter, recency_report
    import time
    extractor, policy = VARIANTS[variant]
    t0 = time.perf_counter()
    runs = base_runs(ctx, base)
    base_sec = time.perf_counter() - t0
    tok = _tokenizer(ctx)
    rf = make_filter(extractor or "metadata", policy=policy)   # "none" measures the base's evidence only
    out_runs, metrics = {}, {}
    t1 = time.perf_counter()
    for split, run in runs.items():
        qtext = {q.id: q.text for q in ctx.queries(split)}
        res = apply_recency(run, ctx.dataset, rf, qtext, k=K)
        rep = recency_report(run, ctx.dataset, rf, k=K, tokenizer=tok, results=res)
        if extractor is None:
            out_runs[split] = run
            rep = dict(rep, after=rep["before"], removed=0, removed_per_query=0.0, queries_with_removals=0, failures=0)
        else:
            out_runs[split] = filtered_run(run, res)
        metrics[split] = filter_metrics(rep)
        if extractor is not None:
            ctx.log(f"{split}: stale rate {rep['before']['stale_rate']:.3f} -> {rep['after']['stale_rate']:.3f}, "
                    f"removed {rep['removed']} of {K * len(run)}")
    return MethodOutput(runs=out_runs, info={"metrics": metrics, "base_seconds": round(base_sec, 2),
                                             "filter_seconds": round(time.perf_counter() - t1, 2),
                                             "k": K, "base": base, "extractor": extractor or "none",
                                             "policy": policy, "train_seconds": 0.0})


def _make_run(base: str, variant: str):
    return lambda ctx: run_recency(ctx, base, variant)


for _base, _needs in BASES.items():
    for _variant in VARIANTS:
        _ex, _pol = VARIANTS[_variant]
        if _base == "re3" and _variant == "none":
            continue   # = the re3-film_margins row itself
        # zero-shot and BM25 bases are deterministic (one run stands for every seed); --quick runs only the
        # zero-shot base with and without the oracle filter, on set C
        register(Method(f"{_base}+recency-{_variant}", family="recency", sets=SETS, run=_make_run(_base, _variant),
                        needs=_needs, seeded=_base == "re3",
                        in_quick=_base == "minilm-zs" and _variant in ("none", "metadata"), quick_sets=("C",),
                        description=(("" if _base == "re3" else "zero-shot ") + f"{_base} top-{K}" + ("" if _ex is None else
                                     f" through the recency filter ({_ex} extractor, {_pol})"))),
                 replace=True)
