"""Re³ rows of the English comparison suite: re3-base, re3-film, re3-film_margins (frozen MiniLM backbone;
docs/re3.md), and on real text the option rows (re3-multi_time, re3-range_start, re3-learned) and
re3-passages / re3-passages-multiscale (one-date passages, same-page time-wrong twins, the epoch chosen on a dev
split of the training pages; docs/re3.md, "Long, many-dated documents"). The recency-filter rows are added by the
recency filter's module.

All three rows share one semantic cache per (backbone, max_length): each text meets the frozen backbone once per
suite run, whatever the row or seed; training then runs on the cached vectors (the design notes' "pre-compute
e_sem once")."""
from __future__ import annotations

import time

from ..registry import REAL_SETS, Method, MethodOutput, register

#: e_sem caches, keyed by (backbone path, max_length): the backbone is frozen, so they never go stale
_SEM_CACHES: dict = {}
#: epochs over the budget's training rows (the time modules train on cached vectors: an epoch is cheap)
EPOCHS = {"quick": 10, "full": 10}
LR = 1e-3


def _model(ctx, variant: str, model_kw: dict):
    """The row's Re3Config and Re3Encoder on the frozen backbone, sharing the run's semantic cache."""
    import torch
    from ...training.re3 import Re3Config, build_re3_model
    cfg = Re3Config(variant=variant, epochs=EPOCHS["quick" if ctx.quick else "full"],
                    batch_size=max(2, ctx.budget.batch_size), lr=LR, seed=ctx.seed, progress=False)
    torch.manual_seed(ctx.seed)
    model = build_re3_model(ctx.backbone_path, cfg, pooling="mean", max_length=ctx.budget.max_length, **model_kw)
    model.to(ctx.device)
    key = (str(ctx.backbone_path), ctx.budget.max_length, str(ctx.device))
    model.enable_semantic_cache(_SEM_CACHES.setdefault(key, {}))
    return cfg, model


def _split_runs(model, ctx) -> dict:
    """``{split: run}`` of a Re³ model, each split ranked over its own gallery (the semantic cache encodes a
    text once)."""
    from ...training.re3 import re3_runs
    runs = {}
    for split in ctx.eval_splits:
        runs.update(re3_runs(model, ctx.eval_dataset(split), [split], depth=ctx.depth,
                             batch_size=ctx.budget.eval_batch_size))
    return runs


def _run(variant: str, **model_kw):
    def run(ctx):
        from ...training.re3 import docs_from_dataset, examples_from_synth, train_re3
        from ...training.resume import resume_or_restart

        class _Rows:      # the budget's rows (same for every method of this seed), with the synth's queries
            def __init__(self, synth, rows):
                self.dataset, self.train_rows = synth.dataset, rows

        rows = ctx.train_rows()
        examples = examples_from_synth(_Rows(ctx.synth, rows))
        cfg, model = _model(ctx, variant, model_kw)
        t0 = time.time()
        res, resume = resume_or_restart(lambda r: train_re3(model, docs_from_dataset(ctx.dataset), examples, cfg,
                                                            ctx.work_dir, resume=r, log=ctx.log), ctx.work_dir, ctx.log)
        train_s = time.time() - t0
        t1 = time.time()
        runs = _split_runs(model, ctx)
        info = {"train_seconds": round(train_s, 2), "encode_seconds": round(res.encode_seconds, 2),
                "fit_seconds": round(res.train_seconds, 2), "eval_seconds": round(time.time() - t1, 2),
                "steps": res.steps, "examples": res.num_examples, "variant": variant, "epochs": cfg.epochs,
                "batch_size": cfg.batch_size, "lr": cfg.effective_lr, "model": dict(model_kw),
                "examples_with_time_wrong": sum(e.tw_negative is not None for e in examples),
                "alpha": float(model.film.alpha.detach()), "final_loss": res.final_loss}
        embed = lambda texts: model.encode(list(texts), role="document")  # noqa: E731
        return MethodOutput(runs, info=info, embed=embed)
    return run


def run_re3(ctx, variant: str = "film_margins") -> MethodOutput:
    """One Re³ row's output on ``ctx`` (for rows built on it, e.g. Re³ + the recency filter on its runs)."""
    return _run(variant)(ctx)


_DESC = {
    "base": "frozen MiniLM, zero-initialised FiLM (= the base retriever; times parsed but unused)",
    "film": "frozen MiniLM + time embedding + FiLM trained on cached e_sem, symmetric InfoNCE (λ = 0)",
    "film_margins": "as re3-film plus the hardest-negative and time-wrong margins (λ_hard = λ_tw = 0.1, δ = 0.1)",
}
for _v in ("base", "film", "film_margins"):
    register(Method(f"re3-{_v}", "re3", ("B", "C") + (REAL_SETS if _v == "film_margins" else ()), _run(_v),
                    needs=("transformers",), description=_DESC[_v], in_quick=_v != "film", quick_sets=("B",)))

# real text: the two documented options beside the paper's one-time, rule-parsed representation
register(Method("re3-multi_time", "re3", REAL_SETS, _run("film_margins", multi_time=True), needs=("transformers",),
                in_quick=False,
                description="re3-film_margins with multi_time=True (an extension: one time per date expression of a "
                            "document, scored by its best-matching time)"))
register(Method("re3-range_start", "re3", REAL_SETS, _run("film_margins", ranges="start"), needs=("transformers",),
                in_quick=False,
                description="re3-film_margins with ranges='start' (a range such as 'from 2004 to 2006' read as its "
                            "start, as a one-point parser does) instead of its interval"))
register(Method("re3-learned", "re3", REAL_SETS, _run("film_margins", time_parser="learned"), needs=("transformers",),
                in_quick=False,
                description="re3-film_margins with the paper's learned time parser (heads on [CLS], fitted on silver "
                            "labels of the rule parser) instead of the rules"))


# ---- real text: one-date passages, same-page time-wrong twins, dev epoch selection, normalised e_sem ---------
#: share of the training pages set apart (by a seeded hash) to choose the epoch on
DEV_SHARE = 0.12


def _run_passages(**model_kw):
    def run(ctx):
        from ...datasets import RetrievalDataset
        from ...training.re3 import Re3Example, dev_groups, dev_scorer, docs_from_dataset, time_wrong_twins, train_re3
        from ...training.resume import resume_or_restart

        ds = ctx.dataset
        qby = {q.id: q for q in ds.queries}
        rows = [r for r in ctx.train_rows() if r.query_id in qby]
        page = lambda x: (x.meta or {}).get("page")  # noqa: E731
        train_pages = {page(qby[r.query_id]) for r in rows} - {None}
        dev_pages = dev_groups(train_pages, share=DEV_SHARE, seed=ctx.seed)
        fit_rows = [r for r in rows if page(qby[r.query_id]) not in dev_pages]
        dev_qs = [qby[r.query_id] for r in rows if page(qby[r.query_id]) in dev_pages]
        train_recs = [r for r in ds.records if page(r) in train_pages - dev_pages]
        twins = time_wrong_twins(ds, [qby[r.query_id] for r in fit_rows], group_key="page", candidates=train_recs,
                                 log=ctx.log)
        examples = [Re3Example(r.query, r.positive, twins.get(r.query_id),
                               (qby[r.query_id].meta or {}).get("query_time")) for r in fit_rows]
        dev_eval = None
        if any(v > 0 for q in dev_qs for v in (q.gold or {}).values()):
            dev_ds = RetrievalDataset(f"{ds.name}[dev pages]", [r for r in ds.records if page(r) in dev_pages],
                                      dev_qs, ds.calendar)
            dev_eval = dev_scorer(dev_ds, dev_qs, batch_size=ctx.budget.eval_batch_size)
            ctx.log(f"dev split: {len(dev_pages)} of {len(train_pages)} training pages, {dev_eval.queries} queries "
                    f"over {dev_eval.records} paragraphs; {len(examples)} training examples")
        else:   # no page field (or one page): nothing to set apart, the last epoch is kept
            ctx.log(f"no dev split ({len(train_pages)} training pages): the last epoch is kept")
        cfg, model = _model(ctx, "film_margins", model_kw)
        t0 = time.time()
        res, resume = resume_or_restart(lambda r: train_re3(model, docs_from_dataset(ds), examples, cfg, ctx.work_dir,
                                                            resume=r, log=ctx.log, dev_eval=dev_eval),
                                        ctx.work_dir, ctx.log)
        train_s = time.time() - t0
        t1 = time.time()
        runs = _split_runs(model, ctx)
        info = {"train_seconds": round(train_s, 2), "encode_seconds": round(res.encode_seconds, 2),
                "fit_seconds": round(res.train_seconds, 2), "eval_seconds": round(time.time() - t1, 2),
                "steps": res.steps, "examples": res.num_examples, "variant": cfg.variant, "epochs": cfg.epochs,
                "batch_size": cfg.batch_size, "lr": cfg.effective_lr, "model": dict(model_kw),
                "examples_with_time_wrong": sum(e.tw_negative is not None for e in examples),
                "dev_pages": len(dev_pages), "dev_queries": dev_eval.queries if dev_eval else 0,
                "dev_history": res.dev_history,
                "best_epoch": res.best_epoch, "alpha": float(model.film.alpha.detach()), "final_loss": res.final_loss}
        embed = lambda texts: model.encode(list(texts), role="document")  # noqa: E731
        return MethodOutput(runs, info=info, embed=embed)
    return run


_PASSAGES_KW = dict(passages="date_windows", normalize_sem=True)
register(Method("re3-passages", "re3", REAL_SETS, _run_passages(**_PASSAGES_KW), needs=("transformers",),
                in_quick=False,
                description="re3-film_margins on one-date passages (a document scores by its best passage), "
                            "normalised e_sem, same-page time-wrong twins (every date outside the question's "
                            "interval) and the epoch chosen on a dev split of the training pages"))
register(Method("re3-passages-multiscale", "re3", REAL_SETS,
                _run_passages(**_PASSAGES_KW, year_encoding="multiscale"), needs=("transformers",), in_quick=False,
                description="re3-passages with the multiscale year encoding (an extension: the scalar plus sin / cos "
                            "of the year at periods 10, 100, 1000)"))
