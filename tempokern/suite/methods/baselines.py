"""Baseline rows: BM25 (both tie orders), MiniLM zero-shot, MiniLM fine-tuned (plain in-batch InfoNCE)."""
from __future__ import annotations

import math
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ..._ops.routing import multipos_infonce
from ..backbone import dense_runs, embed_batch, encode_texts, load_backbone
from ..registry import REAL_SETS, SYNTH_SETS, Method, MethodOutput, register

ALL_SETS = SYNTH_SETS + REAL_SETS
#: full fine-tuning saves its state (weights, optimiser, schedule, RNG, losses) to the unit's work_dir every this
#: many optimizer steps; a unit stopped part-way resumes at the last save (``finetune_infonce``)
CHECKPOINT_EVERY = 5
#: the fine-tuning state's checkpoint directory inside the unit's work_dir: ``trainer_state.pt`` under a
#: ``checksums.json`` manifest (tempokern.training.resume.save_state_dir)
FINETUNE_STATE_DIR = "finetune_state"
#: the entries of a fine-tuning state
_FINETUNE_KEYS = ("key", "step", "losses", "seconds", "model", "optimizer", "scheduler", "torch_rng")


# ---- BM25 --------------------------------------------------------------------------------------------

def bm25_ranked_runs(ctx, gold_first: bool):
    """BM25 (bm25s, Lucene variant, k1 1.5, b 0.75, lower-cased word tokens) over each split's gallery (its
    statistics are the gallery's). Ties
    are frequent on templated text, so the order inside a group of equal scores is set explicitly:
    gold documents first (``gold_first``, the optimistic bound) or last (the pessimistic bound).
    The run's scores are then ``depth - position`` (the ranking is all the metrics use)."""
    from ...baselines.bm25 import BM25Scorer
    scorer = BM25Scorer()
    runs = {}
    for split in ctx.eval_splits:
        gallery = ctx.gallery(split)
        doc_ids = [r.id for r in gallery]
        qs = ctx.queries(split)
        scores = scorer(qs, gallery).astype(np.float64)
        out = {}
        where = {d: i for i, d in enumerate(doc_ids)}
        for i, q in enumerate(qs):
            gold = np.zeros(len(doc_ids))
            for d in q.relevant_ids():
                if d in where:
                    gold[where[d]] = 1.0
            tie = gold if gold_first else -gold
            # primary key score (descending), secondary the gold flag
            order = np.lexsort((-tie, -scores[i]))[:ctx.depth]
            out[q.id] = {doc_ids[j]: float(ctx.depth - p) for p, j in enumerate(order)}
        runs[split] = out
    return runs


def _bm25(gold_first):
    def run(ctx):
        t = time.time()
        runs = bm25_ranked_runs(ctx, gold_first)
        return MethodOutput(runs, info={"train_seconds": 0.0, "eval_seconds": round(time.time() - t, 2)})
    return run


register(Method("bm25_ties_gold", "lexical", SYNTH_SETS, _bm25(True), needs=("bm25s",), seeded=False,
                description="BM25 (bm25s, word tokens); tied documents ordered gold first (optimistic bound)"))
register(Method("bm25_ties_last", "lexical", ALL_SETS, _bm25(False), needs=("bm25s",), seeded=False,
                description="BM25, tied documents ordered gold last (pessimistic bound)"))


# ---- MiniLM zero-shot ----------------------------------------------------------------------------------

def _embedder(model, tok, ctx):
    return lambda texts: encode_texts(model, tok, list(texts), max_length=ctx.budget.max_length,
                                      batch_size=ctx.budget.eval_batch_size, device=ctx.device)


def _dense_output(ctx, model, tok, info):
    t = time.time()
    emb = _embedder(model, tok, ctx)
    docs = encode_texts(model, tok, [r.text for r in ctx.all_gallery()], max_length=ctx.budget.max_length,
                        batch_size=ctx.budget.eval_batch_size, device=ctx.device, progress=ctx.progress)
    runs = dense_runs(ctx, emb, docs)
    info["eval_seconds"] = round(time.time() - t, 2)
    return MethodOutput(runs, info=info, embed=emb)


def run_zeroshot(ctx):
    model, tok = load_backbone(ctx.backbone_path, ctx.device)
    return _dense_output(ctx, model, tok, {"train_seconds": 0.0})


register(Method("minilm_zeroshot", "dense", ALL_SETS, run_zeroshot, needs=("transformers",), seeded=False,
                description="the backbone as shipped (mean pooling, L2-normalised), no training"))


# ---- MiniLM fine-tuned -----------------------------------------------------------------------------------

def finetune_infonce(ctx, model, tok, *, temperature: float = 0.05, warmup_ratio: float = 0.1,
                     weight_decay: float = 0.01, max_grad_norm: float = 1.0):
    """Plain in-batch InfoNCE on ``ctx.train_rows()`` (query, positive document): symmetric
    (query->document and document->query), the batch's other positives as negatives, rows sharing a
    positive document counted as positives of each other (``tempokern.multipos_infonce`` with the
    document index as the span: no false negatives from duplicates). With a budget that sets
    ``hard_negatives`` (the real-data sets), each row's first that many hard negatives join the
    query->document denominators (``extra_neg``; one that is a positive of the batch is left out).
    AdamW, linear warm-up/decay, ``ctx.budget`` epochs / batch size / lr / max_length. Every
    ``CHECKPOINT_EVERY`` steps the state goes to ``ctx.work_dir/finetune_state/`` (a checkpoint directory:
    ``trainer_state.pt`` under a ``checksums.json`` manifest, written atomically); a rerun of the same unit
    (same seed, budget and rows) resumes there and ends with the weights of an uninterrupted run. A state that
    cannot be resumed (a file that fails its checksum, an unreadable or incomplete state, other settings) is
    logged, naming the file, and fine-tuning starts from the first step. The directory is removed when
    training ends. Returns an info dict."""
    b = ctx.budget
    rows = ctx.train_rows()
    pos = {r.id: i for i, r in enumerate(ctx.dataset.records)}
    qtext = {q.id: q.text for q in ctx.dataset.queries}
    k_neg = ctx.rows_hard_negatives(0)
    pairs = [(getattr(r, "query", None) or qtext[r.query_id], pos[r.positive],
              [pos[d] for d in r.hard_negatives[:k_neg] if d in pos])
             for r in rows if r.positive in pos]
    torch.manual_seed(ctx.seed)
    rng = random.Random(ctx.seed)
    # batches per epoch as the CTD / TMRL trainers count them (the last, partial batch kept when it has two
    # rows or more), so that every trained row of a table takes the same number of steps
    n_batches = max(1, math.ceil(len(pairs) / b.batch_size)) if len(pairs) >= 2 else 0
    if n_batches > 1 and len(pairs) - (n_batches - 1) * b.batch_size < 2:
        n_batches -= 1
    total = n_batches * b.epochs
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=b.lr)
    warm = max(1, int(warmup_ratio * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))
    model.train()
    losses, t0, step = [], time.time(), 0
    state_path = Path(ctx.work_dir) / FINETUNE_STATE_DIR
    key = {"seed": ctx.seed, "budget": dict(b.__dict__), "rows": len(pairs), "steps": total,
           "temperature": temperature, "warmup_ratio": warmup_ratio, "weight_decay": weight_decay}
    resumed, earlier_seconds = _load_finetune_state(state_path, key, model, opt, sched, ctx)
    if resumed:
        losses = list(resumed["losses"])
    for epoch in range(b.epochs):
        order = list(range(len(pairs)))
        rng.shuffle(order)           # every epoch's order is drawn, so that a resumed run sees the same batches
        batches = [order[i * b.batch_size:(i + 1) * b.batch_size] for i in range(n_batches)]
        for batch in ctx.progress(batches, f"fine-tune epoch {epoch + 1}/{b.epochs}"):
            if resumed and step < resumed["step"]:    # done before the interruption
                step += 1
                continue
            texts_q = [pairs[i][0] for i in batch]
            docs = [pairs[i][1] for i in batch]
            in_batch = set(docs)
            negs = [j for i in batch for j in pairs[i][2] if j not in in_batch]   # never a row's positive
            texts_d = [ctx.dataset.records[j].text for j in docs + negs]
            e = embed_batch(model, tok, texts_q + texts_d, b.max_length, ctx.device)
            n = len(batch)
            ids = torch.tensor(docs, dtype=torch.int64, device=e.device)
            loss = multipos_infonce(e[:n], e[n:2 * n], (ids, ids), (ids, ids), temperature=temperature,
                                    symmetric=True, extra_neg=e[2 * n:] if negs else None)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            sched.step()
            step += 1
            losses.append(float(loss.detach()))
            if CHECKPOINT_EVERY and step % CHECKPOINT_EVERY == 0 and step < total:
                _save_finetune_state(state_path, key, model, opt, sched, step, losses,
                                     earlier_seconds + time.time() - t0)
    model.eval()
    shutil.rmtree(state_path, ignore_errors=True)
    return {"train_seconds": round(earlier_seconds + time.time() - t0, 2), "steps": step, "resumed_at_step":
            resumed["step"] if resumed else None, "train_rows": len(pairs), "hard_negatives": k_neg,
            "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
            "loss_first_5": float(np.mean(losses[:5])) if losses else None,
            "loss_last_5": float(np.mean(losses[-5:])) if losses else None, "losses": losses}


def _save_finetune_state(path: Path, key: dict, model, opt, sched, step: int, losses, seconds: float) -> None:
    from ...training.resume import save_state_dir
    save_state_dir(path, {"key": key, "step": step, "losses": list(losses), "seconds": seconds,
                          "model": model.state_dict(), "optimizer": opt.state_dict(),
                          "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state(),
                          "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None})


def _load_finetune_state(path: Path, key: dict, model, opt, sched, ctx):
    """(state, seconds trained before) of an interrupted run of this unit, loaded into model / opt / sched;
    (None, 0.0) when there is none, or it was made under other settings, or it cannot be resumed (said, naming
    the file; the directory is then removed). The manifest is verified, the state read and its weights' names
    and shapes compared with the model's before anything is loaded; a state the optimizer or scheduler refuses
    leaves them (and the model) as they were."""
    from ...training.resume import read_state_dir
    legacy = path.parent / "finetune_state.pt"      # a state file without a manifest: not resumed
    if legacy.exists():
        ctx.log(f"{legacy} has no checksum manifest and is not resumed: fine-tuning starts over")
        legacy.unlink(missing_ok=True)
    if not path.exists():
        return None, 0.0
    try:
        st = read_state_dir(path, required=_FINETUNE_KEYS)   # tensors and plain containers (weights_only)
        if st.get("key") != key:
            ctx.log(f"{path} was saved under other settings: fine-tuning starts over")
            shutil.rmtree(path, ignore_errors=True)
            return None, 0.0
        mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        saved = {k: tuple(v.shape) for k, v in st["model"].items()}
        if saved != mine:
            raise ValueError(f"its weights do not fit this backbone "
                             f"({sorted(set(saved.items()) ^ set(mine.items()))[:3]} ...)")
        fresh_opt, fresh_sched = opt.state_dict(), sched.state_dict()
        try:
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
        except Exception:
            opt.load_state_dict(fresh_opt)
            sched.load_state_dict(fresh_sched)
            raise
        model.load_state_dict(st["model"])
        torch.set_rng_state(st["torch_rng"])
        if st.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda_rng"])
    except Exception as e:  # noqa: BLE001 - a damaged or foreign state: start over rather than fail the unit
        ctx.log(f"cannot resume from {path}: {type(e).__name__}: {e}; fine-tuning starts from the first step")
        shutil.rmtree(path, ignore_errors=True)
        return None, 0.0
    ctx.log(f"resuming fine-tuning at step {st['step']} of {key['steps']} ({path})")
    return st, float(st.get("seconds", 0.0))


def loss_summary(losses) -> str:
    """How the training loss went, comparing disjoint steps: the mean of the first k steps against the mean of
    the last k (k = 5, fewer in a short run); one step has no trend to show."""
    n = len(losses)
    if n == 0:
        return "no training step"
    if n == 1:
        return f"loss {losses[0]:.4f} (one step)"
    k = min(5, n // 2)
    first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    if k == 1:
        return f"loss {first:.4f} (step 1) -> {last:.4f} (step {n})"
    return f"loss {first:.4f} (mean of steps 1-{k}) -> {last:.4f} (steps {n - k + 1}-{n})"


def run_finetuned(ctx):
    model, tok = load_backbone(ctx.backbone_path, ctx.device)
    info = finetune_infonce(ctx, model, tok)
    ctx.log(f"fine-tuned {info['steps']} steps in {info['train_seconds']} s, {loss_summary(info['losses'])}")
    info.pop("losses")
    return _dense_output(ctx, model, tok, info)


register(Method("minilm_ft", "dense", ALL_SETS, run_finetuned, needs=("transformers",),
                description="the backbone fine-tuned with plain in-batch InfoNCE (symmetric, T 0.05) on the "
                            "training rows"))
