"""CTD rows on set B (monthly facts, `Calendar.gregorian(..., resolution="month")`): the ablation
variants baseline / context / bias / full of `tempokern.training.train_ctd` (the path `tempokern train`
runs) with the suite's backbone, mean pooling and the shared budget."""
from __future__ import annotations

import time

from dataclasses import replace

from ..registry import REAL_SETS, Method, MethodOutput, register

CTD_VARIANTS = ("baseline", "context", "bias", "full")
#: learning rate of the randomly initialised calendar heads, context and offset bias (the backbone
#: uses the suite budget's lr): with a few dozen steps at the backbone's lr they would barely move
TEMPORAL_LR = 1e-3


def _train_subset(ctx):
    """The set with only the budget's training queries (so no validation pass: the suite evaluates). With a
    budget that sets ``hard_negatives`` (real data), each query's gold is its training row's positive and
    its ``meta["negatives"]`` the row's first that many hard negatives: the pairs and negatives every other
    trained row sees."""
    from ...datasets import RetrievalDataset
    rows = {r.query_id: r for r in ctx.train_rows()}
    qs = [q for q in ctx.dataset.queries if q.split == "train" and q.id in rows]
    if ctx.budget.hard_negatives is not None:
        k = int(ctx.budget.hard_negatives)
        qs = [replace(q, gold={rows[q.id].positive: 1},
                      meta={**(q.meta or {}), "negatives": list(rows[q.id].hard_negatives[:k])}) for q in qs]
    return RetrievalDataset(f"{ctx.dataset.name}[suite-train]", ctx.dataset.records, qs, ctx.dataset.calendar)


#: gallery positions sampled for the offset-bias diagnostics (pairs = BIAS_SAMPLE^2)
BIAS_SAMPLE = 256


def bias_diagnostics(model, u, *, sample: int = BIAS_SAMPLE, seed: int = 0) -> dict:
    """What the trained relative-offset bias does, for results.json: its scale ε (initialised at 0), and the
    largest |bias| over all ordered pairs of `sample` gallery positions `u` drawn without replacement (seeded):
    in logit units (the scorer adds it to q.g / temperature), in cosine units (× temperature: the cosine change
    it is worth) and of the unscaled MLP (the bias divided by ε). Cost: one (sample x sample) bias evaluation
    (65,536 pairs x a 32-wide MLP at the default, ~4 MFLOP)."""
    import torch
    from ...nn.offset_bias import bias_params
    from ... import offset_bias
    u = u.detach().float().reshape(-1)
    g = torch.Generator().manual_seed(int(seed))
    idx = torch.randperm(u.numel(), generator=g)[:sample]
    us = u[idx].contiguous()
    w1, b1, w2, b2, scale = (p.detach().float().cpu() for p in bias_params(model.offset_bias))
    with torch.no_grad():
        mlp = offset_bias(us, us, w1, b1, w2, b2, torch.ones(()))
    eps = float(scale)
    max_mlp = float(mlp.abs().max()) if mlp.numel() else 0.0
    # bias = eps * MLP: the max over the same pairs (computed as the op does, for the reader to compare)
    with torch.no_grad():
        max_bias = float(offset_bias(us, us, w1, b1, w2, b2, scale).abs().max()) if mlp.numel() else 0.0
    return {"bias_scale": eps, "bias_max_abs": max_bias,
            "bias_max_abs_cosine_units": max_bias * float(model.temperature),
            "bias_mlp_max_abs": max_mlp, "bias_pairs": int(us.numel()) ** 2,
            "bias_u_range": [float(us.min()), float(us.max())] if us.numel() else None}


#: the loss options of the suite's CTD rows: ctd_<variant> keeps ChunQiuTR's overlap positives and calendar keys
#: on every set; ctd_group takes the trainer's per-dataset defaults (TimeQA, a BEIR folder with a page field:
#: positives within the query's page plus its own gold, calendar-CE targets from the records' intervals)
LOSS_OPTIONS = {"overlap": dict(positives="overlap", calendar_labels="key"),
                "auto": dict(positives="auto", calendar_labels="auto")}


def _rows(enc, idx):
    """The rows ``idx`` of an ``Encoded`` (embeddings, u, per-level logits)."""
    import torch
    i = torch.as_tensor(idx, dtype=torch.long)
    return type(enc)(enc.embeddings[i], enc.u[i], [lg[i] for lg in enc.logits])


def run_ctd(variant: str, loss: str = "overlap"):
    def run(ctx):
        import torch
        from ...models import CTDEncoder
        from ...training import CTDConfig, train_ctd
        from ...training.evaluate import score_topk
        from ...training.trainer import seed_everything
        if ctx.dataset.calendar is None:
            raise ValueError(f"set {ctx.set_name} has no calendar: CTD needs one")
        b = ctx.budget
        seed_everything(ctx.seed)
        model = CTDEncoder(ctx.backbone_path, ctx.dataset.calendar, pooling="mean", max_length=b.max_length)
        hn = ctx.budget.hard_negatives is not None and ctx.budget.hard_negatives > 0
        cfg = CTDConfig(variant=variant, epochs=b.epochs, batch_size=b.batch_size, lr=b.lr, temporal_lr=TEMPORAL_LR,
                        seed=ctx.seed, progress=ctx.progress_enabled, hard_negatives=hn,
                        **({"hard_negative_source": "query"} if hn else {}), **LOSS_OPTIONS[loss])
        ds = _train_subset(ctx)
        # epoch checkpoints in the unit's work_dir: a unit stopped part-way resumes at its last finished epoch
        from ...training.resume import resume_or_restart
        res, resume = resume_or_restart(lambda r: train_ctd(model, ds, cfg, ctx.work_dir, resume=r, device=ctx.device,
                                                            log=ctx.log), ctx.work_dir, ctx.log)
        steps = [h for h in res.history if h.get("event") == "step"]
        info = {"train_seconds": round(res.seconds, 2), "steps": res.steps, "train_queries": len(ds.queries),
                "hard_negatives": int(hn),
                "first_loss": steps[0]["loss"] if steps else None, "final_loss": res.final_loss,
                "temporal_lr": TEMPORAL_LR, "resumed": resume, **{f"loss_{k}": v for k, v in res.setup.items()}}
        t = time.time()
        model.eval()
        # every split's gallery encoded once (ctx.all_gallery()), each split ranked over its own rows
        all_enc = model.encode([r.text for r in ctx.all_gallery()], batch_size=b.eval_batch_size)
        g_enc = _rows(all_enc, ctx.gallery_index())
        if model.use_bias:   # does the bias move scores at all? (diagnostics only, no effect on the runs)
            info.update(bias_diagnostics(model, g_enc.u, seed=ctx.seed))
        if "bias_max_abs" in info:
            ctx.log(f"offset bias: scale {info['bias_scale']:.4g}, largest |bias| {info['bias_max_abs']:.4g} logits "
                    f"= {info['bias_max_abs_cosine_units']:.4g} cosine units over {info['bias_pairs']} gallery pairs")
        runs = {}
        for split in ctx.eval_splits:
            qs = ctx.queries(split)
            doc_ids = [r.id for r in ctx.gallery(split)]
            s_enc = _rows(all_enc, ctx.gallery_index(split))
            vals, idx = score_topk(model, [q.text for q in qs], s_enc, ctx.depth, batch_size=b.eval_batch_size)
            runs[split] = {q.id: {doc_ids[j]: float(v) for j, v in zip(idx[i].tolist(), vals[i].tolist())}
                           for i, q in enumerate(qs)}
        info["eval_seconds"] = round(time.time() - t, 2)

        def embed(texts):
            with torch.no_grad():
                return model.encode(list(texts), batch_size=b.eval_batch_size).embeddings
        return MethodOutput(runs, info=info, embed=embed)
    return run


_TEXT = {"baseline": "CTD trainer, semantic baseline variant (single-positive InfoNCE, no temporal module)",
         "context": "CTD: multi-positive loss + absolute calendar context + calendar CE (no bias)",
         "bias": "CTD: multi-positive loss + relative-offset bias + calendar CE (no context)",
         "full": "full CTD: multi-positive, context, bias, calendar CE"}

for _v in CTD_VARIANTS:
    # --quick keeps the two ends of the ablation (as the Zizhi Tongjian demo's --quick does)
    # real data: full CTD (the ablation's other rows on set B)
    register(Method(f"ctd_{_v}", "ctd", ("B",) + (REAL_SETS if _v == "full" else ()), run_ctd(_v),
                    needs=("transformers",), description=_TEXT[_v],
                    in_quick=_v in ("baseline", "full")))

register(Method("ctd_group", "ctd", REAL_SETS, run_ctd("full", loss="auto"), needs=("transformers",),
                description="full CTD with group-scoped positives (overlaps within the query's page plus its "
                            "gold) and calendar-CE targets from record intervals where records have no key",
                in_quick=False))
