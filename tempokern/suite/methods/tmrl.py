"""TMRL rows of the suite (design notes §2.5): ``lora`` (full-dim InfoNCE), ``mrl`` (LoRA-MRL),
``tmrl_noaux`` (MRL + α L_Temp) and ``tmrl`` (all terms), each with per-dim runs, on sets A and B and the
real-data sets; on the real-data sets also ``tmrl_full`` (full fine-tuning), ``tmrl_t17`` (t at the paper's
TimeQA ratio of the full dim) and ``tmrl_1expr`` (passages cut to one date expression's sentence).

Recipe (A9, all-MiniLM-L6-v2, d = 384): mean pooling, dims (32, 64, 128, 256, 384), t = 32, α = 0.25,
β = γ = 0.1, τ = 0.05, LoRA r 4 / lora_alpha 16 (peft scaling 4, TMRL §A.2) / dropout 0.1 on every
linear layer, 2 hard negatives and 2 negative queries per row, the suite budget's rows / epochs / max_length /
batch size, and a LoRA learning rate of 10× the budget's full-fine-tuning rate (5e-4 at the default 5e-5:
the rate of the LoRA-MRL run measured in the design notes §2.5). LoRA is merged before encoding."""
from __future__ import annotations

from ..registry import REAL_SETS, Method, MethodOutput, register

DIMS_MINILM = (32, 64, 128, 256, 384)
RECIPE = dict(t=32, alpha=0.25, beta=0.1, gamma=0.1, temperature=0.05, hard_negatives=2, negative_queries=2,
              lora_lr_factor=10.0)


def _make_run(variant: str, lora: str = "lora", t_ratio=None, one_expression: bool = False):
    def run(ctx) -> MethodOutput:
        import torch

        from ...datasets.tmrl import rows_from_train_rows
        from ...models.tmrl import TMRLEncoder
        from ...training.tmrl import TMRLConfig, runs_by_dim, t_from_ratio, train_tmrl
        torch.manual_seed(ctx.seed)
        b = ctx.budget
        from transformers import AutoConfig
        H = int(AutoConfig.from_pretrained(ctx.backbone_path).hidden_size)
        dims = DIMS_MINILM if H == 384 else tuple(m for m in (32, 64, 128, 256, 512) if m < H) + (H,)
        # t_ratio: the temporal subspace as a share of the full dim (tmrl_t17: the paper's TimeQA ratio)
        t = RECIPE["t"] if t_ratio is None else t_from_ratio(t_ratio, dims[-1])
        model = TMRLEncoder(ctx.backbone_path, pooling="mean", max_length=b.max_length, dims=dims,
                            t=t, temperature=RECIPE["temperature"], **({"lora": "full"} if lora == "full" else {}))
        data = rows_from_train_rows(ctx.dataset, ctx.train_rows(), name=f"synth-{ctx.set_name}")
        one_expr = None
        if one_expression:   # the paper's passages: one date expression each (datasets.tmrl.one_expression_rows)
            from ...datasets.tmrl import one_expression_rows
            data, one_expr = one_expression_rows(data)
            ctx.log(f"one date expression per passage: positives {one_expr['positives']}, hard negatives "
                    f"{one_expr['hard_negatives']}")
        cfg = TMRLConfig(variant=variant, t=t, alpha=RECIPE["alpha"], beta=RECIPE["beta"],
                         gamma=RECIPE["gamma"], temperature=RECIPE["temperature"],
                         lr=b.lr * (RECIPE["lora_lr_factor"] if lora == "lora" else 1.0), lora=lora,
                         batch_size=b.batch_size, epochs=b.epochs,
                         hard_negatives=ctx.rows_hard_negatives(RECIPE["hard_negatives"]),
                         negative_queries=RECIPE["negative_queries"],
                         seed=ctx.seed, progress=ctx.progress_enabled)
        from ...training.resume import resume_or_restart
        res, resume = resume_or_restart(lambda r: train_tmrl(model, data, cfg, ctx.work_dir, resume=r, device=ctx.device,
                                                             log=ctx.log), ctx.work_dir, ctx.log)
        model.merge_lora().to(ctx.device)
        dim_runs = {d: {} for d in dims}
        for split in ctx.eval_splits:   # each split over its own gallery
            for d, r in runs_by_dim(model, ctx.eval_dataset(split), [split], dims, depth=ctx.depth,
                                    batch_size=b.eval_batch_size).items():
                dim_runs[d].update(r)
        steps = [h for h in res.history if h.get("event") == "step"]
        last = steps[-1] if steps else {}
        info = {"train_seconds": round(res.seconds, 1), "steps": res.steps, "rows": len(data),
                "final_loss": res.final_loss, "resumed": resume, "dims": list(dims), **RECIPE,
                "hard_negatives": cfg.hard_negatives, "lora": lora, "t": t, "t_ratio": t_ratio,
                "lr": cfg.lr, "last_step": steps[-1] if steps else None,
                # do the auxiliary terms move the model? the last step's parts (unweighted means) and the
                # gradient diagnostics of its last micro-batch (TMRLTrainer.grad_diagnostics: the weighted
                # terms and ||grad(beta L_Dist + gamma L_CKA)|| / ||grad L_total|| on the step's embeddings)
                "final_parts": {k: last.get(k) for k in ("mrl", "temp", "dist", "cka", "total")} if last else None,
                "grad_diagnostics": res.diagnostics,
                # the same at the first step (each term's ||grad|| / ||grad L_total|| before training moved
                # anything), and the share of training rows with a negative query (the rows L_Temp can use)
                "grad_diagnostics_first": res.first_diagnostics,
                "negative_query_coverage": res.coverage, "one_expression": one_expr}
        return MethodOutput(runs=dim_runs[dims[-1]], dim_runs=dim_runs, info=info,
                            embed=lambda texts: model.encode(list(texts), role="document"))
    return run


for _v, _d in (("lora", "LoRA fine-tuning, full-dim InfoNCE only"),
               ("mrl", "LoRA-MRL: Matryoshka InfoNCE over dims 32..384"),
               ("tmrl_noaux", "TMRL without the self-distillation terms (beta = gamma = 0)"),
               ("tmrl", "TMRL: MRL + temporal subspace + distillation + CKA")):
    # --quick English runs: only the full TMRL row, on set A; the comparison rows run in full runs. Real data:
    # all four (mrl and tmrl_noaux: the ablations that say what of TMRL's gain over lora is the temporal
    # subspace); --quick real-data runs: tmrl only (the others when named with --methods)
    register(Method(_v, family="tmrl", sets=("A", "B") + REAL_SETS,
                    run=_make_run(_v), needs=("peft",), description=_d, in_quick=_v == "tmrl", quick_sets=("A",)))

# real data: the TMRL objective with full fine-tuning, the same parameterisation as minilm_ft (so the two rows
# differ only in the objective), at the budget's full fine-tuning lr
register(Method("tmrl_full", family="tmrl", sets=REAL_SETS, run=_make_run("tmrl", lora="full"), needs=("peft",),
                description="TMRL's objective (MRL + temporal subspace + distillation + CKA) with full fine-tuning "
                            "instead of LoRA, at the full fine-tuning lr", in_quick=False))

# real data: TMRL with the temporal subspace at the paper's TimeQA ratio of the full dim (T_RATIOS["paper_timeqa"]
# = 128 / 768: t = 64 on MiniLM's 384 dims instead of the recipe's 32), everything else as tmrl
register(Method("tmrl_t17", family="tmrl", sets=REAL_SETS, run=_make_run("tmrl", t_ratio="paper_timeqa"),
                needs=("peft",), description="TMRL (LoRA) with t at the paper's TimeQA ratio, 128/768 of the full "
                                             "dim (t = 64 of 384)", in_quick=False))

# real data: TMRL trained on passages cut to the sentence of one date expression (the question's, for the
# positive), as the paper's training passages; the gallery stays whole paragraphs
register(Method("tmrl_1expr", family="tmrl", sets=REAL_SETS, run=_make_run("tmrl", one_expression=True),
                needs=("peft",), description="TMRL (LoRA) trained on passages cut to the sentence of one date "
                                             "expression (the question's, for the positive)", in_quick=False))
