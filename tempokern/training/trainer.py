"""CTD / semantic-baseline fine-tuning of a CTDEncoder.

Loss: CTDLoss (fused multi-positive InfoNCE, offset bias in-kernel, neg_comment records as extra
negatives) + lambda_time x calendar cross-entropy on the positive records; the semantic baseline
uses the same fused loss with one positive per query (its own pair). AdamW, linear schedule
with warm-up, gradient accumulation, mixed precision on CUDA, checkpoint selection by validation
R@1, resume, seeds, JSONL logs, progress bars; data parallel under torchrun (gradients averaged
across ranks, documents all-gathered by CTDLoss(gather=True))."""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..nn import CTDLoss
from .data import (CALENDAR_LABELS, NEGATIVE_SOURCES, POSITIVES, HardNegatives, QueryNegatives, gold_indices,
                   group_ids, num_training_pairs, record_labels, record_span, resolve_calendar_labels,
                   resolve_positives, train_units, training_pairs)
from .evaluate import evaluate_model
from ..nn.calendar_ce import calendar_ce
from ..models.checkpoint import verify_checkpoint
from . import resume as _resume
from ..models.encoder import check_scorer
from ..nn.ctd_loss import GATHER_MODES

VARIANTS: Dict[str, dict] = {
    # name: (multi-positive loss, offset bias, calendar context, calendar CE)
    "baseline": dict(multipos=False, use_bias=False, use_context=False, time_ce=False),
    "multipos": dict(multipos=True, use_bias=False, use_context=False, time_ce=False),
    "bias": dict(multipos=True, use_bias=True, use_context=False, time_ce=True),
    "context": dict(multipos=True, use_bias=False, use_context=True, time_ce=True),
    "full": dict(multipos=True, use_bias=True, use_context=True, time_ce=True),
}
AMP_MODES = ("auto", "off", "bf16", "fp16")


@dataclass
class CTDConfig:
    variant: str = "full"
    epochs: int = 3
    batch_size: int = 32
    lr: float = 2e-5
    temporal_lr: Optional[float] = None      # calendar heads, context, bias (default: lr)
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    temperature: float = 0.05
    lambda_time: float = 0.1
    label_smoothing: float = 0.2             # epsilon of the calendar CE's smoothing
    neighbor_smoothing: bool = True          # ChunQiuTR's --time_label_smoothing (False: uniform smoothing)
    hard_negatives: bool = True
    hard_negative_pool: int = 16             # ChunQiuTR's num_negatives: the pool one negative is drawn from
    # where a pair's hard negative comes from (tempokern.training.data.QueryNegatives): "auto" (the query's
    # own list, else records of its gold's group, else the month sampler), "query" (meta["negatives"] only),
    # "group" (records sharing the gold's meta[hard_negative_group_key] only), "months" (ChunQiuTR's sampler)
    hard_negative_source: str = "auto"
    hard_negative_group_key: str = "group"
    pairs_per_query: Optional[int] = 1       # gold records drawn per query and epoch (1: ChunQiuTR; None: all)
    amp: str = "auto"
    seed: int = 0
    eval_split: str = "val"
    eval_every: int = 1                      # epochs
    max_steps: Optional[int] = None
    stop_after_epochs: Optional[int] = None  # end this run early (time-boxed); `resume` continues it
    save_every: Optional[int] = None         # also write last/ every N optimizer steps (resumable mid-epoch)
    progress: bool = True
    batch_size_eval: int = 64
    # checkpoint selection as the reference: validation R@1 under neg1_ne1_dq0 (neg_comment and no_event
    # records in the gallery, pure no_event queries kept), scored by the encoder alone (evaluate_model)
    eval_neg: bool = True
    eval_ne: bool = True
    eval_drop_no_event: bool = False
    eval_scorer: str = "encoder"             # "encoder" (the reference's validation) or "ctd" (the full model)
    gather_mode: str = "tempokern"           # CTDLoss(gather=True) semantics under torchrun (see CTDLoss)
    # the multi-positive loss's positives: "overlap" (ChunQiuTR: in-batch documents whose interval overlaps the
    # query's), "overlap_group" (those sharing the query's meta[group_key] too, plus the query's own gold
    # always), "auto" (overlap_group when records carry meta[group_key], else overlap: see resolve_positives)
    positives: str = "auto"
    group_key: str = "page"
    # calendar-CE targets: "key" (records' calendar keys), "interval" (the key, else the calendar unit holding
    # the record's interval), "auto" (interval when no record has a key: see resolve_calendar_labels)
    calendar_labels: str = "auto"

    def validate(self) -> "CTDConfig":
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}: expected one of {', '.join(VARIANTS)}")
        check_scorer(self.eval_scorer)
        if self.gather_mode not in GATHER_MODES:
            raise ValueError(f"gather_mode must be one of {GATHER_MODES}, got {self.gather_mode!r}")
        if self.amp not in AMP_MODES:
            raise ValueError(f"amp must be one of {AMP_MODES}, got {self.amp!r}")
        if self.positives not in POSITIVES:
            raise ValueError(f"positives must be one of {POSITIVES}, got {self.positives!r}")
        if self.calendar_labels not in CALENDAR_LABELS:
            raise ValueError(f"calendar_labels must be one of {CALENDAR_LABELS}, got {self.calendar_labels!r}")
        if not isinstance(self.group_key, str) or not self.group_key:
            raise ValueError(f"group_key must be a non-empty str, got {self.group_key!r}")
        if self.hard_negative_source not in NEGATIVE_SOURCES:
            raise ValueError(f"hard_negative_source must be one of {NEGATIVE_SOURCES}, "
                             f"got {self.hard_negative_source!r}")
        if self.pairs_per_query is not None and (isinstance(self.pairs_per_query, bool)
                                                 or not isinstance(self.pairs_per_query, int)
                                                 or self.pairs_per_query < 1):
            raise ValueError(f"pairs_per_query must be None or a positive int, got {self.pairs_per_query!r}")
        for name in ("epochs", "batch_size", "grad_accum", "eval_every", "hard_negative_pool"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "epochs" else 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.batch_size < 2:
            raise ValueError("batch_size must be >= 2 (in-batch negatives)")
        check_save_every(self.save_every)
        for name in ("lr", "temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        return self

    @classmethod
    def from_dict(cls, d: dict) -> "CTDConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown training option(s) {unknown}; known: {sorted(names)}")
        return cls(**d).validate()


@dataclass
class CTDResult:
    best_metric: Optional[float]
    best_epoch: Optional[int]
    steps: int
    history: List[dict] = field(default_factory=list)
    final_loss: Optional[float] = None
    seconds: float = 0.0
    #: what the loss trained on: the resolved positives ("overlap" / "overlap_group"; "pair" for the baseline
    #: variant), calendar_labels ("key" / "interval") and per calendar level the number of records with a
    #: calendar-CE target (all zero: the calendar CE had nothing to train on)
    setup: Dict[str, object] = field(default_factory=dict)


def check_save_every(v) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"save_every must be None or a positive int (optimizer steps), got {v!r}")


def apply_variant(model, variant: str) -> None:
    v = VARIANTS[variant]
    model.use_bias, model.use_context = v["use_bias"], v["use_context"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % (2 ** 32))
    except ImportError:
        pass


def dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed_from_env() -> bool:
    """Initialise torch.distributed when launched by torchrun (WORLD_SIZE > 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or (dist.is_available() and dist.is_initialized()):
        return dist.is_available() and dist.is_initialized()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return True


def _param_groups(model, lr, temporal_lr, wd):
    temporal = ("time_heads.", "ctx_proj.", "ctx_gate", "offset_bias.")
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_t = n.startswith(temporal)
        decay = p.ndim >= 2   # no decay on biases, norms and scalar gates/scales
        key = (is_t, decay)
        groups.setdefault(key, []).append(p)
    out = []
    for (is_t, decay), ps in groups.items():
        out.append({"params": ps, "lr": (temporal_lr or lr) if is_t else lr, "weight_decay": wd if decay else 0.0})
    return out


def _linear_warmup(total: int, warmup: int):
    def f(step):
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return f


def _amp_setup(mode: str, device: torch.device):
    if device.type != "cuda" or mode == "off":
        return None, None
    if mode == "auto":
        mode = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    dtype = torch.bfloat16 if mode == "bf16" else torch.float16
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    return dtype, scaler


class CTDTrainer:
    def __init__(self, model, dataset, config: CTDConfig, out_dir=None, *, device=None, log=print):
        self.model, self.data, self.cfg = model, dataset, config.validate()
        self.out = Path(out_dir) if out_dir is not None else None
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.rank, self.world = dist_info()
        self.log = log if self.rank == 0 else (lambda *a, **k: None)
        if model.tokenizer is None:
            raise ValueError("the model needs a tokenizer to train (CTDEncoder(..., tokenizer=...))")
        apply_variant(model, config.variant)
        model.temperature = config.temperature
        self.variant = VARIANTS[config.variant]
        self.gold = gold_indices(dataset, "train")
        n_pairs = num_training_pairs(self.gold, config.pairs_per_query)
        if n_pairs < 2:
            raise ValueError(f"dataset {dataset.name!r} has {n_pairs} training (query, gold record) pairs "
                             f"per epoch (pairs_per_query={config.pairs_per_query}); need at least 2")
        self.spans = [record_span(r, i) for i, r in enumerate(dataset.records)]
        self.positives = resolve_positives(dataset, config.positives, config.group_key)
        self.rec_group = self.query_group = None
        if self.positives == "overlap_group":
            ids: Dict[str, int] = {}
            self.rec_group = group_ids(dataset.records, config.group_key, ids)
            self.query_group = group_ids(dataset.queries, config.group_key, ids)
        self.calendar_labels = resolve_calendar_labels(dataset, config.calendar_labels)
        self.labels = [record_labels(dataset, r, from_interval=self.calendar_labels == "interval")
                       for r in dataset.records]
        self.labelled = [sum(1 for x in lab if x >= 0) for lab in zip(*self.labels)] if self.labels else []
        # hard negatives only from the training split's months (no val/test month leaks into training)
        src = config.hard_negative_source
        self.negs = (HardNegatives(dataset, train_units(dataset, "train"), config.hard_negative_pool)
                     if config.hard_negatives and src in ("auto", "months") else None)
        # per-query hard negatives the data provides (a query's meta["negatives"], or its gold's group)
        self.qnegs = (QueryNegatives(dataset, "train", source=src, group_key=config.hard_negative_group_key)
                      if config.hard_negatives and src != "months" else None)
        self.has_val = any(q.split == config.eval_split for q in dataset.queries)

    # ---- batches ------------------------------------------------------------------------------
    def num_batches(self) -> int:
        """Batches per epoch (what len(_epoch_batches(e)) is, without drawing them)."""
        n = num_training_pairs(self.gold, self.cfg.pairs_per_query)
        g = self.cfg.batch_size * self.world
        nb = max(1, math.ceil(n / g))
        if nb > 1 and n - (nb - 1) * g < 2 * self.world:
            nb -= 1
        return nb

    def _epoch_batches(self, epoch: int):
        rng = random.Random(self.cfg.seed * 1000003 + epoch)
        order = training_pairs(self.data, "train", per_query=self.cfg.pairs_per_query, rng=rng, gold=self.gold)
        rng.shuffle(order)
        g = self.cfg.batch_size * self.world
        batches = [order[i:i + g] for i in range(0, len(order), g)]
        if len(batches) > 1 and len(batches[-1]) < 2 * self.world:
            batches.pop()
        out = []
        for bi, b in enumerate(batches):
            per = len(b) // self.world
            mine = b[self.rank * per:(self.rank + 1) * per]
            negs = None
            if self.negs or self.qnegs:
                nrng = random.Random(self.cfg.seed * 7919 + epoch * 104729 + bi)
                negs = [n for n in (self._pick_negative(qi, di, nrng) for qi, di in mine) if n is not None] or None
            out.append((mine, negs, bi * self.cfg.batch_size * self.world + self.rank * per))
        return out

    def _pick_negative(self, qi: int, di: int, rng) -> Optional[int]:
        """One hard negative (record index) for the pair (query qi, positive di): from the data's own
        per-query / same-group candidates when the query has any (QueryNegatives), else ChunQiuTR's
        month sampler (HardNegatives), per ``hard_negative_source``."""
        if self.qnegs is not None and self.qnegs.has(qi):
            return self.qnegs.pick(qi, di, rng)
        if self.negs:
            return self.negs.pick(qi, di, rng)
        return None

    def _loss(self, batch, negs, offset, loss_fn):
        cfg, model, dev = self.cfg, self.model, self.device
        qs = [self.data.queries[qi] for qi, _ in batch]
        ds = [di for _, di in batch]
        texts = [q.text for q in qs] + [self.data.records[d].text for d in ds]
        if negs:
            texts += [self.data.records[n].text for n in negs]
        enc = {k: v.to(dev) for k, v in model.tokenize(texts).items()}
        out = model(**enc)
        B = len(batch)
        q, d = out.emb[:B], out.emb[B:2 * B]
        extra = out.emb[2 * B:] if negs else None
        kw_group = {}
        if self.variant["multipos"]:
            q_span = (torch.tensor([x.interval.start if x.interval is not None else -1 for x in qs], device=dev),
                      torch.tensor([x.interval.end if x.interval is not None else -1 for x in qs], device=dev))
            d_span = tuple(torch.tensor([self.spans[j][k] for j in ds], device=dev) for k in (0, 1))
            if self.rec_group is not None:
                kw_group = dict(q_group=torch.tensor([self.query_group[qi] for qi, _ in batch], device=dev),
                                d_group=torch.tensor([self.rec_group[j] for j in ds], device=dev))
        else:
            ids = torch.arange(offset, offset + B, device=dev)
            q_span = d_span = (ids, ids)
        kw = dict(kw_group)
        if self.variant["use_bias"]:
            kw.update(u_q=out.u[:B], u_d=out.u[B:2 * B])
        loss_ret = loss_fn(q, d, q_span, d_span, extra_neg=extra, **kw)
        loss_time = torch.zeros((), device=dev)
        if self.variant["time_ce"] and cfg.lambda_time > 0:
            labels = torch.tensor([self.labels[j] for j in ds], device=dev, dtype=torch.float32)
            logits = [x[B:2 * B] for x in out.logits]
            loss_time = calendar_ce(logits, labels, smoothing=cfg.label_smoothing, neighbor=cfg.neighbor_smoothing)
        return loss_ret + cfg.lambda_time * loss_time, loss_ret.detach(), loss_time.detach()

    # ---- state --------------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """The data this trainer trains on (records, queries with qrels, tokenizer vocabulary)."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = _resume.dataset_fingerprint(self.data, self.model.tokenizer)
        return self._fingerprint

    def _save_state(self, where: Path, opt, sched, scaler, epoch, batch, epoch_done, step, best, best_epoch,
                    history):
        """last/: the weights and the trainer state (tensors and plain containers; tempokern.training.resume)
        under one checksum manifest. `batch`: batches of `epoch` done; epoch_done: the epoch's end (after its
        validation)."""
        state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "scaler": scaler.state_dict() if scaler is not None else None, "epoch": epoch, "batch": batch,
                 "epoch_done": epoch_done, "step": step, "best": best, "best_epoch": best_epoch,
                 "history": history, "config": asdict(self.cfg), "data": self.fingerprint(),
                 "rng": _resume.rng_state()}
        # the trainer state goes into the checkpoint directory itself, under its checksum manifest
        self.model.save(where, extra_files={_resume.STATE_FILE: _resume.state_bytes(state)})

    def _sync_params(self):
        if self.world > 1:
            for p in self.model.parameters():
                dist.broadcast(p.data, 0)

    def _allreduce_grads(self):
        if self.world > 1:
            for p in self.model.parameters():
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad.div_(self.world)

    def fit(self, *, resume: bool = False, resume_anyway: bool = False) -> CTDResult:
        """Train; resume=True continues the run saved in out_dir/last (same config and data, checked:
        tempokern.training.resume.check_resume; resume_anyway=True logs the differences and continues)."""
        cfg, model = self.cfg, self.model
        seed_everything(cfg.seed)
        model.to(self.device).train()
        self._sync_params()
        gather = self.world > 1
        loss_fn = CTDLoss(temperature=cfg.temperature,
                          offset_bias=model.offset_bias if self.variant["use_bias"] else None,
                          symmetric=True, normalize=False, gather=gather, gather_mode=cfg.gather_mode)
        opt = torch.optim.AdamW(_param_groups(model, cfg.lr, cfg.temporal_lr, cfg.weight_decay), lr=cfg.lr)
        steps_per_epoch = max(1, math.ceil(self.num_batches() / cfg.grad_accum))
        total = steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            total = min(total, cfg.max_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _linear_warmup(total, int(cfg.warmup_ratio * total)))
        amp_dtype, scaler = _amp_setup(cfg.amp, self.device)
        start_epoch, step, best, best_epoch, history = 0, 0, None, None, []
        best_state = None
        skip = 0
        if resume:
            last = self._require_out() / "last"
            st_file = last / _resume.STATE_FILE
            if not st_file.exists():
                raise FileNotFoundError(f"cannot resume: {st_file} does not exist")
            verify_checkpoint(last)   # weights and trainer state as saved
            st = _resume.load_state(st_file)
            _resume.check_resume(st_file, st, cfg, self.fingerprint(), anyway=resume_anyway, log=self.log)
            for note in _resume.mutable_notes(st["config"], asdict(cfg)):
                self.log(f"resume: {note}")
            _load_weights(model, last, self.device)
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
            if scaler is not None and st.get("scaler"):
                scaler.load_state_dict(st["scaler"])
            start_epoch, skip = (st["epoch"] + 1, 0) if st["epoch_done"] else (st["epoch"], st["batch"])
            step, best, best_epoch, history = st["step"], st["best"], st["best_epoch"], st["history"]
            _resume.set_rng_state(st["rng"])
            if self.out is not None and self.rank == 0:
                _resume.truncate_log(self.out / "log.jsonl", step)
            self.log(f"resumed from {last} at epoch {start_epoch} (0-based), batch {skip}, step {step}")
        logf = None
        if self.out is not None and self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            logf = open(self.out / "log.jsonl", "a")
        info = self.setup_info()
        self.log(f"positives: {info['positives']}" + (f" (groups: meta[{cfg.group_key!r}])"
                                                      if info["group_key"] else ""))
        if info["calendar_ce"]:
            lab = info["calendar_labelled_records"]
            if not any(lab.values()):
                self.log("calendar CE: no record has a calendar target (no key, and no interval inside one calendar "
                         "unit): the calendar heads get no supervision")
            else:
                self.log(f"calendar CE targets ({self.calendar_labels}): "
                         + ", ".join(f"{k} {v}/{len(self.data.records)}" for k, v in lab.items()))
        t0 = time.time()
        last_loss = None
        try:
            for epoch in range(start_epoch, cfg.epochs):
                if cfg.max_steps is not None and step >= cfg.max_steps:
                    break
                batches = self._epoch_batches(epoch)
                start_bi, skip = skip, 0   # batches of this epoch done before a mid-epoch resume
                done = start_bi
                bar = _progress(batches[start_bi:], cfg.progress and self.rank == 0,
                                f"{cfg.variant} epoch {epoch + 1}/{cfg.epochs}")
                opt.zero_grad(set_to_none=True)
                for bi, (batch, negs, offset) in enumerate(bar, start=start_bi):
                    with torch.autocast(self.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                        loss, lr_, lt = self._loss(batch, negs, offset, loss_fn)
                    scaled = loss / cfg.grad_accum
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                    if (bi + 1) % cfg.grad_accum and bi + 1 != len(batches):
                        continue
                    self._allreduce_grads()
                    if scaler is not None:
                        scaler.unscale_(opt)
                    if cfg.max_grad_norm:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    if scaler is not None:
                        scaler.step(opt)
                        scaler.update()
                    else:
                        opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                    step += 1
                    done = bi + 1
                    last_loss = float(loss.detach())
                    rec = {"event": "step", "variant": cfg.variant, "epoch": epoch, "step": step, "loss": last_loss,
                           "loss_retrieval": float(lr_), "loss_time": float(lt), "lr": sched.get_last_lr()[0],
                           "seconds": round(time.time() - t0, 3)}
                    history.append(rec)
                    if logf:
                        logf.write(json.dumps(rec) + "\n")
                        logf.flush()
                    if hasattr(bar, "set_postfix"):
                        bar.set_postfix(loss=f"{last_loss:.4f}")
                    if cfg.max_steps is not None and step >= cfg.max_steps:
                        break
                    if cfg.save_every and step % cfg.save_every == 0 and done < len(batches):
                        if self.out is not None and self.rank == 0:
                            self._save_state(self.out / "last", opt, sched, scaler, epoch, done, False, step, best,
                                             best_epoch, history)
                        if self.world > 1:
                            dist.barrier()
                if self.has_val and ((epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs):
                    best, best_epoch, best_state = self._validate(epoch, step, best, best_epoch, best_state,
                                                                  history, logf)
                if self.out is not None and self.rank == 0:
                    self._save_state(self.out / "last", opt, sched, scaler, epoch, done, done >= len(batches),
                                     step, best, best_epoch, history)
                if self.world > 1:
                    dist.barrier()
                if cfg.stop_after_epochs is not None and epoch + 1 - start_epoch >= cfg.stop_after_epochs:
                    break
        finally:
            if logf:
                logf.close()
        if best_state is not None:
            model.load_state_dict(best_state)
        elif self.out is not None and (self.out / "best").exists() and best is not None:
            _load_weights(model, self.out / "best", self.device)
        model.eval()
        return CTDResult(best, best_epoch, step, history, last_loss, time.time() - t0, self.setup_info())

    def setup_info(self) -> Dict[str, object]:
        """The resolved loss options (CTDResult.setup)."""
        ce = self.variant["time_ce"] and self.cfg.lambda_time > 0
        return {"positives": self.positives if self.variant["multipos"] else "pair",
                "group_key": self.cfg.group_key if self.positives == "overlap_group" else None,
                "calendar_labels": self.calendar_labels, "calendar_ce": ce,
                "calendar_labelled_records": dict(zip(self.data.calendar.names, self.labelled))
                if self.data.calendar is not None and self.labelled else {},
                "records": len(self.data.records)}

    def _validate(self, epoch, step, best, best_epoch, best_state, history, logf):
        metric = None
        if self.rank == 0:
            table = evaluate_model(self.model, self.data, self.cfg.eval_split, batch_size=self.cfg.batch_size_eval,
                                   neg=self.cfg.eval_neg, ne=self.cfg.eval_ne,
                                   drop_no_event=self.cfg.eval_drop_no_event, scorer=self.cfg.eval_scorer)
            metric = table["all"]["R@1"]
            rec = {"event": "eval", "variant": self.cfg.variant, "epoch": epoch, "step": step,
                   "split": self.cfg.eval_split, "scorer": self.cfg.eval_scorer,
                   "mode": f"neg{int(self.cfg.eval_neg)}_ne{int(self.cfg.eval_ne)}_dq{int(self.cfg.eval_drop_no_event)}",
                   **{f"{k}": v for k, v in table["all"].items()}}
            history.append(rec)
            if logf:
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
            self.log(f"[{self.cfg.variant}] epoch {epoch + 1}: {self.cfg.eval_split} R@1 {metric:.4f} "
                     f"MRR@10 {table['all']['MRR@10']:.4f}")
        self.model.train()
        if self.world > 1:
            t = torch.tensor([metric if metric is not None else 0.0], dtype=torch.float64)
            dist.broadcast(t, 0)
            metric = float(t)
        if best is None or metric > best:
            best, best_epoch = metric, epoch
            best_state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
            if self.out is not None and self.rank == 0:
                self.model.save(self.out / "best")
        return best, best_epoch, best_state

    def _require_out(self) -> Path:
        if self.out is None:
            raise ValueError("resume needs the output directory of the interrupted run (out_dir)")
        return self.out


def _load_weights(model, where: Path, device) -> None:
    """Load a checkpoint written by model.save into `model` (the same architecture): every parameter
    and buffer must be there (resuming with missing weights would silently train from a mix)."""
    from safetensors.torch import load_model
    missing, unexpected = load_model(model, str(where / "model.safetensors"), strict=False, device=str(device))
    if missing or unexpected:
        raise ValueError(f"{where / 'model.safetensors'} does not fit the model being trained: missing "
                         f"{sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")


class PlainProgress:
    """Progress as plain lines (about every 10% of an epoch and at its end), for logs written to a file:
    a tqdm bar there floods the file with carriage-return frames."""

    def __init__(self, it, desc: str, stream=None, every: float = 0.1):
        import sys
        self.items, self.desc = list(it), desc
        self.stream = stream if stream is not None else sys.stderr
        self.step = max(1, int(len(self.items) * every))
        self.postfix = {}

    def __len__(self):
        return len(self.items)

    def set_postfix(self, **kw):
        self.postfix = kw

    def __iter__(self):
        n = len(self.items)
        t0 = time.time()
        for i, x in enumerate(self.items, 1):
            yield x
            if i % self.step == 0 or i == n:
                post = " ".join(f"{k}={v}" for k, v in self.postfix.items())
                print(f"{self.desc}: {i}/{n} batches, {time.time() - t0:.1f} s{' ' + post if post else ''}",
                      file=self.stream, flush=True)


def _progress(it, enabled: bool, desc: str, stream=None):
    """A tqdm bar on a terminal; plain lines (PlainProgress) when stderr is a file or a pipe."""
    import sys
    if not enabled:
        return it
    stream = stream if stream is not None else sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return PlainProgress(it, desc, stream)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return PlainProgress(it, desc, stream)
    return tqdm(it, desc=desc, leave=False, dynamic_ncols=True, file=stream)


def train_ctd(model, dataset, config: Optional[CTDConfig] = None, out_dir=None, *, resume: bool = False,
              resume_anyway: bool = False, device=None, log=print) -> CTDResult:
    """Fine-tune `model` on the train split of `dataset` (a tempokern.datasets.RetrievalDataset
    whose queries carry splits) and keep the weights with the best validation R@1."""
    return CTDTrainer(model, dataset, config or CTDConfig(), out_dir, device=device,
                      log=log).fit(resume=resume, resume_anyway=resume_anyway)
