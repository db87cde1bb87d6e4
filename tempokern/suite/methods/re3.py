"""Re³ rows of the English comparison suite: re3-base, re3-film, re3-film_margins (frozen MiniLM backbone;
docs/re3.md). The recency-filter rows are added by the recency filter's module.

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


def _run(variant: str, **model_kw):
    def run(ctx):
        import torch

        from ...training.re3 import (Re3Config, build_re3_model, docs_from_dataset, examples_from_synth, re3_runs,
                                     train_re3)

        class _Rows:      # the budget's rows (same for every method of this seed), with the synth's queries
            def __init__(self, synth, rows):
                self.dataset, self.train_rows = synth.dataset, rows

        rows = ctx.train_rows()
        examples = examples_from_synth(_Rows(ctx.synth, rows))
        cfg = Re3Config(variant=variant, epochs=EPOCHS["quick" if ctx.quick else "full"],
                        batch_size=max(2, ctx.budget.batch_size), lr=LR, seed=ctx.seed, progress=False)
        torch.manual_seed(ctx.seed)
        model = build_re3_model(ctx.backbone_path, cfg, pooling="mean", max_length=ctx.budget.max_length, **model_kw)
        model.to(ctx.device)
        key = (str(ctx.backbone_path), ctx.budget.max_length, str(ctx.device))
        model.enable_semantic_cache(_SEM_CACHES.setdefault(key, {}))
        from ...training.resume import resume_or_restart
        t0 = time.time()
        res, resume = resume_or_restart(lambda r: train_re3(model, docs_from_dataset(ctx.dataset), examples, cfg,
                                                            ctx.work_dir, resume=r, log=ctx.log), ctx.work_dir, ctx.log)
        train_s = time.time() - t0
        t1 = time.time()
        runs = re3_runs(model, ctx.eval_dataset(), ctx.eval_splits, depth=ctx.depth,
                        batch_size=ctx.budget.eval_batch_size)
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
