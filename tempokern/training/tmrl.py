"""TMRL fine-tuning of a TMRLEncoder (design notes §2.1 T9, §2.2 A1/A5/A8, §2.4 "Training").

One step: batch rows ``(q⁺_i, p_i, {p⁻_ik}, {q⁻_ik})`` (A1) are encoded, and
``TMRLLoss`` = L_MRL (query anchors; candidates = all in-batch positives + all hard-negative passages,
one direction, A8) + α L_Temp (passage anchors against their positive and negative queries, Eq. 10) +
β L_Dist + γ L_CKA over every embedding of the step (A5). Negative queries and temporal masks are
encoded only when α > 0, so α = β = γ = 0 runs exactly the ``mrl`` variant's computation.

Machinery shared with the CTD trainer (tempokern/training/trainer.py): seeding, AdamW with linear warm-up,
gradient accumulation, AMP on CUDA (bf16/fp16 with a GradScaler), gradient clipping, torchrun data
parallelism (parameters broadcast from rank 0, gradients averaged), resume from ``last/``, JSONL logs,
progress bars / plain progress lines.

GradCache (``cache_embeddings=True``, luyug/GradCache as sentence-transformers'
CachedMultipleNegativesRankingLoss): embed the step's texts in mini-batches without a graph (saving each
mini-batch's RNG state), compute the loss on the cached ``(emb, x_T)`` and its gradient with respect to
them, then re-embed each mini-batch with a graph under the same RNG state and back-propagate the cached
gradient into the parameters. Memory: one mini-batch's activations instead of the whole step's."""
from __future__ import annotations

import contextlib
import io
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..datasets.tmrl import TMRLData, TMRLRow
from .trainer import (CTDTrainer, _amp_setup, _linear_warmup, _progress, check_save_every, dist_info,
                      init_distributed_from_env, seed_everything)
from . import resume as _resume
from ..models.checkpoint import verify_checkpoint
from ..models.encoder import ROLES
from ..models.tmrl import BACKBONE_FILE, PROJECTOR_FILE
from .._ops.ctd_topk import ctd_topk
from ..eval import retrieval_metrics
from ..nn import TMRLLoss

__all__ = ["TMRLConfig", "TMRLTrainer", "TMRLResult", "TMRL_VARIANTS", "train_tmrl", "variant_weights", "runs_by_dim",
           "evaluate_dims", "T_RATIOS", "t_from_ratio", "negative_query_coverage"]

#: the rows of the paper's comparison: which loss terms each trains
TMRL_VARIANTS = ("zero_shot", "lora", "mrl", "tmrl_noaux", "tmrl")
AMP_MODES = ("auto", "off", "bf16", "fp16")
LORA_MODES = ("lora", "none", "full")
#: A1's two readings: which side anchors L_MRL
MRL_ANCHORS = ("query", "passage")
#: scalings of L_Dist / L_CKA (tempokern.nn.TMRLLoss): A5's mean over pairs, or Eq. 11 as printed
AUX_SCALES = ("mean", "literal")
#: the paper's LoRA "scaling factor 4" (§A.2) as peft's lora_alpha / r
LORA_SCALING = 4.0
#: named temporal-subspace ratios t / d (``t_from_ratio``). ``paper_timeqa``: TMRL Table 6's TimeQA column
#: uses t = 128 for four of its six encoders, all 768-dim (contriever, nomic, bge, gte1.5): 128 / 768 = 16.7 %
#: (the other two: gte t = 64 of 768, 8.3 %; bge-m3 t = 128 of 1024, 12.5 %). On d = 384 it gives t = 64.
T_RATIOS = {"paper_timeqa": 128 / 768}


def t_from_ratio(ratio, dim: int) -> int:
    """The temporal-subspace size at ``ratio`` of the full embedding dim: ``t = round(ratio * dim)``, halves
    rounded up. ``ratio``: a number in (0, 1] or a name of :data:`T_RATIOS`. The result must be >= 1."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    name = ratio if isinstance(ratio, str) else None
    if name is not None:
        if name not in T_RATIOS:
            raise ValueError(f"t_ratio must be a number in (0, 1] or one of {sorted(T_RATIOS)}, got {ratio!r}")
        ratio = T_RATIOS[name]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) \
            or not 0 < ratio <= 1:
        raise ValueError(f"t_ratio must be a number in (0, 1] or one of {sorted(T_RATIOS)}, got {ratio!r}")
    t = int(math.floor(ratio * dim + 0.5))
    if t < 1:
        raise ValueError(f"t_ratio {ratio!r} of dim {dim} rounds to t = 0; the temporal subspace needs t >= 1")
    return t


def negative_query_coverage(rows, per_step: Optional[int] = None) -> dict:
    """How many training rows can take part in L_Temp: ``rows``, ``with_negative_queries`` (rows with at
    least one), their ``share``, the ``mean`` count per row and the ``max``; with ``per_step`` (the
    config's negative_queries) also ``mean_used``, the mean of min(count, per_step): the negative queries a
    row contributes per step. A row without one leaves L_Temp (its passage has nothing to contrast)."""
    rows = list(rows.rows if isinstance(rows, TMRLData) else rows)
    counts = [len(r.negative_queries) for r in rows]
    n = len(counts)
    k = sum(c > 0 for c in counts)
    out = {"rows": n, "with_negative_queries": k, "share": k / n if n else 0.0,
           "mean": sum(counts) / n if n else 0.0, "max": max(counts, default=0)}
    if per_step is not None:
        out["per_step"] = int(per_step)
        out["mean_used"] = sum(min(c, per_step) for c in counts) / n if n else 0.0
    return out


@dataclass
class TMRLConfig:
    """Training options. dims / t: None = the model's own. t_ratio (instead of t): the temporal subspace as a
    share of the full dim, t = round(t_ratio * dims[-1]) (:func:`t_from_ratio`; a number in (0, 1] or a name of
    :data:`T_RATIOS`, e.g. "paper_timeqa"); the model's projector must have that t. alpha, beta, gamma: weights of L_Temp, L_Dist,
    L_CKA (Eq. 15; the variant may zero them, :func:`variant_weights`). hard_negatives / negative_queries:
    per row and step, drawn from the row's lists (fewer when a row has fewer). lora_*: used when the CLI
    builds the model (the trainer trains whatever the model has trainable). cache_embeddings: GradCache
    with mini-batches of mini_batch_size texts. mrl_anchor: "query" (A1's default: query anchors against
    the in-batch positives + hard-negative passages) or "passage" (A1's other reading: passage anchors
    against the in-batch positive queries + every negative query of the batch; every row needs at least
    one negative query, negative_queries >= 1, and hard-negative passages are not encoded).

    temperature: None (default) = the model's own (``TMRLEncoder.temperature``, the backbone's τ of TMRL
    Table 5: 0.05 or 0.02). lora_alpha: None (default) = 4 x lora_r, peft scaling lora_alpha / r = 4, the
    paper's "scaling factor 4" (§A.2; 16 at r = 4); a number is passed to peft as it is (4 = scaling 1,
    the other reading of A7). aux_scale: "mean" (A5: L_Dist averaged over its neighbour pairs) or "literal"
    (Eq. 11 summed over the pairs, as printed), see ``tempokern.nn.TMRLLoss``.

    Rows with fewer negative queries than the batch's largest count are filled with repeats of their own
    (the batch is a tensor); the repeats are masked out of every loss term (``TMRLLoss(qc_valid=...)``),
    so they neither count twice in L_Temp nor enter L_Dist / L_CKA as duplicate rows."""
    variant: str = "tmrl"
    dims: Optional[Tuple[int, ...]] = None
    t: Optional[int] = None
    t_ratio: Optional[object] = None
    alpha: float = 0.1
    beta: float = 0.1
    gamma: float = 0.1
    distill_k: int = 10
    detach_teacher: bool = True
    temperature: Optional[float] = None
    aux_scale: str = "mean"
    lr: float = 1e-4
    weight_decay: float = 0.01
    batch_size: int = 256
    hard_negatives: int = 4
    negative_queries: int = 4
    epochs: int = 5
    warmup_ratio: float = 0.1
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    lora: str = "lora"
    lora_r: int = 4
    lora_alpha: Optional[float] = None
    lora_dropout: float = 0.1
    mrl_anchor: str = "query"
    cache_embeddings: bool = False
    mini_batch_size: int = 32
    amp: str = "auto"
    seed: int = 0
    max_steps: Optional[int] = None
    stop_after_epochs: Optional[int] = None
    save_every: Optional[int] = None          # also write last/ every N optimizer steps (resumable mid-epoch)
    progress: bool = True

    def validate(self) -> "TMRLConfig":
        if self.variant not in TMRL_VARIANTS:
            raise ValueError(f"variant must be one of {TMRL_VARIANTS}, got {self.variant!r}")
        if self.amp not in AMP_MODES:
            raise ValueError(f"amp must be one of {AMP_MODES}, got {self.amp!r}")
        if self.lora not in LORA_MODES:
            raise ValueError(f"lora must be one of {LORA_MODES}, got {self.lora!r}")
        if self.aux_scale not in AUX_SCALES:
            raise ValueError(f"aux_scale must be one of {AUX_SCALES}, got {self.aux_scale!r}")
        if self.mrl_anchor not in MRL_ANCHORS:
            raise ValueError(f"mrl_anchor must be one of {MRL_ANCHORS}, got {self.mrl_anchor!r}")
        if self.dims is not None:
            if isinstance(self.dims, int) or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 1
                                                     for m in self.dims) or not len(self.dims):
                raise ValueError(f"dims must be None or a non-empty sequence of positive ints, got {self.dims!r}")
            self.dims = tuple(self.dims)
            if any(b <= a for a, b in zip(self.dims, self.dims[1:])):
                raise ValueError(f"dims must be strictly increasing, got {self.dims!r}")
        if self.t is not None and (isinstance(self.t, bool) or not isinstance(self.t, int) or self.t < 1):
            raise ValueError(f"t must be None or a positive int, got {self.t!r}")
        if self.t_ratio is not None:
            if self.t is not None:
                raise ValueError(f"give t or t_ratio, not both (t={self.t!r}, t_ratio={self.t_ratio!r})")
            t_from_ratio(self.t_ratio, 1 << 20)      # the ratio's own checks (name or number in (0, 1])
        check_save_every(self.save_every)
        for name in ("epochs", "batch_size", "grad_accum", "mini_batch_size", "distill_k", "lora_r"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "epochs" else 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("hard_negatives", "negative_queries"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.mrl_anchor == "passage" and self.negative_queries < 1:
            raise ValueError("negative_queries must be >= 1 with mrl_anchor='passage' (the negative queries are "
                             "the passage-anchored L_MRL's hard negatives)")
        if self.batch_size < 2:
            raise ValueError("batch_size must be >= 2 (in-batch negatives)")
        for name in ("lr", "temperature", "lora_alpha"):
            v = getattr(self, name)
            if v is None and name != "lr":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("alpha", "beta", "gamma", "weight_decay", "max_grad_norm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        for name in ("max_steps", "stop_after_epochs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or a positive int, got {v!r}")
        return self

    @classmethod
    def from_dict(cls, d: dict) -> "TMRLConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TMRL training option(s) {unknown}; known: {sorted(names)}")
        return cls(**d).validate()

    def lora_options(self):
        """The TMRLEncoder(lora=...) argument these options stand for."""
        if self.lora == "none":
            return False
        if self.lora == "full":
            return "full"
        return {"r": self.lora_r, "lora_alpha": self.effective_lora_alpha, "lora_dropout": self.lora_dropout,
                "target_modules": "all-linear"}

    @property
    def effective_lora_alpha(self) -> float:
        """peft's lora_alpha: the given one, else LORA_SCALING x lora_r (scaling lora_alpha / r = 4)."""
        return float(self.lora_alpha) if self.lora_alpha is not None else LORA_SCALING * self.lora_r

    def effective_temperature(self, model) -> float:
        """The InfoNCE temperature: the given one, else the model's (``model.temperature``)."""
        if self.temperature is not None:
            return float(self.temperature)
        tau = getattr(model, "temperature", None)
        if tau is None:
            raise ValueError("TMRLConfig.temperature is None and the model has no temperature attribute")
        return float(tau)


def variant_weights(cfg: TMRLConfig, model) -> Tuple[Tuple[int, ...], int, float, float, float]:
    """(dims, t, alpha, beta, gamma) a variant trains: lora = full-dim InfoNCE only; mrl = all dims,
    alpha = beta = gamma = 0; tmrl_noaux = beta = gamma = 0; tmrl = the config's weights."""
    dims = tuple(cfg.dims) if cfg.dims is not None else tuple(model.dims)
    t = cfg.t if cfg.t is not None else t_from_ratio(cfg.t_ratio, dims[-1]) if cfg.t_ratio is not None else model.t
    H = model.hidden_size
    if dims[-1] > H:
        raise ValueError(f"dims {dims} exceed the model's hidden size {H}")
    a, b, g = cfg.alpha, cfg.beta, cfg.gamma
    if cfg.variant == "lora":
        dims, a, b, g = (H,), 0.0, 0.0, 0.0
    elif cfg.variant in ("mrl", "zero_shot"):
        a, b, g = 0.0, 0.0, 0.0
    elif cfg.variant == "tmrl_noaux":
        b, g = 0.0, 0.0
    if a > 0:
        if t is None:
            raise ValueError("alpha > 0 needs t (the temporal-subspace size): set TMRLConfig.t or the model's t")
        if model.projector is None or model.t != t:
            raise ValueError(f"alpha > 0 needs the model's temporal projector with t={t} "
                             f"(the model has t={model.t}, projector {'on' if model.projector is not None else 'off'})")
    return dims, t, float(a), float(b), float(g)


@dataclass
class TMRLResult:
    steps: int
    history: List[dict] = field(default_factory=list)
    final_loss: Optional[float] = None
    seconds: float = 0.0
    #: gradient diagnostics of the run's last optimizer step (its last micro-batch), see
    #: :meth:`TMRLTrainer.grad_diagnostics`; None when no step ran or the loss is not a TMRLLoss
    diagnostics: Optional[dict] = None
    #: the same at the run's first optimizer step (its first micro-batch; kept across a resume)
    first_diagnostics: Optional[dict] = None
    #: :func:`negative_query_coverage` of the training rows, with ``used`` (whether a term reads them)
    coverage: Optional[dict] = None


class _RandState:
    """The RNG state before a mini-batch's first forward, replayed for its second forward (GradCache;
    sentence-transformers' RandContext)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replay(self):
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


# an item to encode: (text, role "query" | "document", spans or None, wants the temporal representation)
_Item = Tuple[str, str, Optional[list], bool]


class TMRLTrainer:
    """Trains `model` (a :class:`tempokern.models.TMRLEncoder`) on TMRL rows.

    loss_fn: defaults to ``tempokern.nn.TMRLLoss(dims, t, alpha=, beta=, gamma=, temperature=, k=)`` for the
    variant; any callable with TMRLLoss's ``forward`` signature returning ``(loss, parts)`` works."""

    def __init__(self, model, rows, config: TMRLConfig, out_dir=None, *, device=None, log=print,
                 loss_fn: Optional[Callable] = None):
        self.model, self.cfg = model, config.validate()
        self.rows: List[TMRLRow] = list(rows.rows if isinstance(rows, TMRLData) else rows)
        if not all(isinstance(r, TMRLRow) for r in self.rows):
            raise TypeError("rows must be TMRLRow objects (tempokern.datasets.tmrl) or a TMRLData")
        self.out = Path(out_dir) if out_dir is not None else None
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.rank, self.world = dist_info()
        self.log = log if self.rank == 0 else (lambda *a, **k: None)
        if model.tokenizer is None:
            raise ValueError("the model needs a tokenizer to train (TMRLEncoder(..., tokenizer=...))")
        self.dims, self.t, self.alpha, self.beta, self.gamma = variant_weights(self.cfg, model)
        #: the InfoNCE temperature of every term: the config's, else the encoder's (TMRL Table 5)
        self.temperature = self.cfg.effective_temperature(model)
        if len(self.rows) < 2 * self.world and self.cfg.variant != "zero_shot":
            raise ValueError(f"{len(self.rows)} training rows; need at least {2 * self.world}")
        self.passage_anchor = self.cfg.mrl_anchor == "passage" and self.cfg.variant != "zero_shot"
        if self.passage_anchor:
            for i, r in enumerate(self.rows):
                if not r.negative_queries:
                    raise ValueError(f"training row {i} (query_id {r.query_id!r}) has no negative queries; "
                                     f"mrl_anchor='passage' uses them as the hard negatives of L_MRL: give every "
                                     f"row at least one negative query, or use mrl_anchor='query'")
        if loss_fn is None and self.cfg.variant != "zero_shot":
            loss_fn = TMRLLoss(self.dims, self.t if self.t is not None else self.dims[0], alpha=self.alpha,
                               beta=self.beta, gamma=self.gamma, temperature=self.temperature,
                               k=self.cfg.distill_k, detach_teacher=self.cfg.detach_teacher,
                               mrl_anchor=self.cfg.mrl_anchor, aux_scale=self.cfg.aux_scale)
        self.loss_fn = loss_fn
        self.last_diagnostics: Optional[dict] = None
        self._first_diagnostics: Optional[dict] = None
        #: also measure the exact ratio on the backbone's trainable parameters (LoRA adapters; not the
        #: projector) at the diagnosed step: two extra encoder backward passes, so off by default
        self.diagnose_params = False

    # ---- batches --------------------------------------------------------------------------------------
    def num_batches(self) -> int:
        n, g = len(self.rows), self.cfg.batch_size * self.world
        nb = max(1, math.ceil(n / g))
        if nb > 1 and n - (nb - 1) * g < 2 * self.world:
            nb -= 1
        return nb

    def epoch_batches(self, epoch: int) -> List[List[tuple]]:
        """This rank's batches of one epoch: lists of (row index, hard-negative indices, negative-query
        indices), drawn deterministically from (seed, epoch)."""
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1000003 + epoch)
        order = list(range(len(self.rows)))
        rng.shuffle(order)
        g = cfg.batch_size * self.world
        batches = [order[i:i + g] for i in range(0, len(order), g)]
        if len(batches) > 1 and len(batches[-1]) < 2 * self.world:
            batches.pop()
        out = []
        for b in batches:
            per = len(b) // self.world
            mine = b[self.rank * per:(self.rank + 1) * per]
            rows = []
            for ri in mine:
                r = self.rows[ri]
                hn = sorted(rng.sample(range(len(r.hard_negatives)), min(cfg.hard_negatives, len(r.hard_negatives))))
                nq = sorted(rng.sample(range(len(r.negative_queries)),
                                       min(cfg.negative_queries, len(r.negative_queries))))
                rows.append((ri, hn, nq))
            out.append(rows)
        return out

    def batch_items(self, batch) -> Tuple[List[_Item], dict]:
        """The texts a step encodes, in order: B queries, B positives, the hard negatives (not with
        mrl_anchor='passage'), and (alpha > 0 or mrl_anchor='passage') B x n negative queries; plus the
        layout to cut the embeddings back (``nq_valid``: which of the n slots of each row are real negative
        queries, not cyclic repeats)."""
        temporal = self.alpha > 0
        passage = self.passage_anchor
        rows = [(self.rows[ri], hn, nq) for ri, hn, nq in batch]
        B = len(rows)
        items: List[_Item] = [(r.query, "query", r.query_spans, temporal) for r, _, _ in rows]
        items += [(r.positive, "document", r.positive_spans, temporal) for r, _, _ in rows]
        for r, hn, _ in rows:
            for j in (hn if not passage else ()):
                items.append((r.hard_negatives[j], "document",
                              r.hard_negative_spans[j] if r.hard_negative_spans is not None else None, False))
        E = len(items) - 2 * B
        n = 0
        row_ok = [True] * B
        nq_valid = None
        if temporal or passage:
            n = max((len(nq) for _, _, nq in rows), default=0)
            nq_valid = [[k < len(nq) for k in range(n)] for _, _, nq in rows]
            for i, (r, _, nq) in enumerate(rows):
                if not nq:   # no negative query: this row leaves L_Temp (masked below); placeholders
                    row_ok[i] = False
                    sel = [(r.query, r.query_spans)] * n
                else:        # fewer than n: its own negatives again, cyclically
                    sel = [(r.negative_queries[nq[k % len(nq)]],
                            r.negative_query_spans[nq[k % len(nq)]] if r.negative_query_spans is not None else None)
                           for k in range(n)]
                items += [(t, "query", s, temporal) for t, s in sel]
        # rows sharing a positive passage are positives of each other (passage ids as spans)
        ids, pid = {}, []
        for r, _, _ in rows:
            pid.append(ids.setdefault(r.positive, len(ids)))
        layout = {"B": B, "E": E, "n": n, "row_ok": row_ok, "nq_valid": nq_valid,
                  "pid": pid if len(ids) < B else None}
        return items, layout

    # ---- encoding -------------------------------------------------------------------------------------
    def _tokenize(self, items: Sequence[_Item], want_t: bool) -> dict:
        """One padded batch of items of either role (each role tokenised with its prefix); want_t: build
        the temporal mask (rows of items that do not want one are all False)."""
        model = self.model
        parts, order = [], []
        for role in ROLES:
            idx = [i for i, it in enumerate(items) if it[1] == role]
            if not idx:
                continue
            enc = model.tokenize([items[i][0] for i in idx], role=role, temporal=want_t,
                                 spans=[items[i][2] if items[i][3] else [] for i in idx] if want_t else None)
            if want_t:
                keep = torch.tensor([items[i][3] for i in idx], dtype=torch.bool).unsqueeze(1)
                enc["temporal_mask"] = enc["temporal_mask"] & keep
            parts.append(enc)
            order += idx
        L = max(p["input_ids"].shape[1] for p in parts)
        pad_id = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
        left = getattr(model.tokenizer, "padding_side", "right") == "left"
        out = {}
        for key in parts[0]:
            fill = pad_id if key == "input_ids" else 0
            rows = []
            for p in parts:
                x = p[key]
                extra = L - x.shape[1]
                if extra:
                    pad = torch.full((x.shape[0], extra), fill, dtype=x.dtype)
                    x = torch.cat([pad, x] if left else [x, pad], dim=1)
                rows.append(x)
            out[key] = torch.cat(rows)
        inv = torch.empty(len(order), dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(len(order))
        return {k: v[inv].to(self.device) for k, v in out.items()}

    def _embed(self, items: Sequence[_Item]):
        out = self.model(**self._tokenize(items, self.alpha > 0))
        return out.emb, out.temporal, out.has_temporal

    def _loss_from(self, emb, x_t, has, layout, terms: bool = False):
        B, E, n = layout["B"], layout["E"], layout["n"]
        q, p = emb[:B], emb[B:2 * B]
        neg_p = emb[2 * B:2 * B + E] if E else None
        kw = {}
        if layout["pid"] is not None:
            ids = torch.tensor(layout["pid"], device=emb.device)
            kw["q_span"] = kw["d_span"] = (ids, ids)
        s = 2 * B + E
        d = emb.shape[1]
        if self.passage_anchor:
            qc = torch.cat([q.unsqueeze(1), emb[s:s + B * n].reshape(B, n, d)], dim=1)
            valid = torch.tensor([[True] + v for v in layout["nq_valid"]], dtype=torch.bool, device=emb.device)
            kw.update(qc=qc, qc_valid=valid.reshape(B, 1 + n))
        if self.alpha > 0 and x_t is not None and n > 0:   # n = 0: no row of the batch has a negative query
            qc = torch.cat([q.unsqueeze(1), emb[s:s + B * n].reshape(B, n, d)], dim=1)
            # repeats (a row with fewer than n negative queries) and placeholders (a row with none) are
            # masked out of every term: L_Temp's candidates and X of L_Dist / L_CKA
            valid = torch.tensor([[True] + v for v in layout["nq_valid"]], dtype=torch.bool, device=emb.device)
            kw["qc_valid"] = valid.reshape(B, 1 + n)
            qc_t = torch.cat([x_t[:B].unsqueeze(1), x_t[s:s + B * n].reshape(B, n, -1)], dim=1)
            qc_has = torch.cat([has[:B].unsqueeze(1), has[s:s + B * n].reshape(B, n)], dim=1)
            ok = torch.tensor(layout["row_ok"], device=emb.device)
            p_has = has[B:2 * B] & ok
            qc_has = qc_has & ok.unsqueeze(1)
            kw.update(p_T=x_t[B:2 * B], p_has=p_has, qc=qc, qc_T=qc_t, qc_has=qc_has)
        if terms:
            kw["return_terms"] = True
        return self.loss_fn(q, p, neg_p, **kw)

    def can_diagnose(self) -> bool:
        return isinstance(self.loss_fn, TMRLLoss)

    def coverage(self) -> dict:
        """:func:`negative_query_coverage` of the training rows at the config's negative_queries, and
        ``used``: whether a loss term reads the negative queries (alpha > 0, or the passage-anchored L_MRL)."""
        cov = negative_query_coverage(self.rows, self.cfg.negative_queries)
        cov["used"] = bool((self.alpha > 0 and self.cfg.negative_queries > 0) or self.passage_anchor)
        return cov

    def describe_coverage(self, cov: dict) -> str:
        """The log line of :meth:`coverage`."""
        line = (f"tmrl[{self.cfg.variant}] training rows: {cov['rows']}; with >= 1 negative query: "
                f"{cov['with_negative_queries']} ({100 * cov['share']:.1f}%); negative queries per row: mean "
                f"{cov['mean']:.2f}, max {cov['max']}, used per step up to {cov['per_step']} (mean "
                f"{cov['mean_used']:.2f})")
        if not cov["used"]:
            return line + "; not used (alpha = 0: no L_Temp)"
        if cov["rows"] and cov["share"] < 1 and not self.passage_anchor:
            line += (f"; L_Temp (alpha {self.alpha:g}) skips the {cov['rows'] - cov['with_negative_queries']} rows "
                     f"without one")
        return line

    @staticmethod
    def describe_diagnostics(d: dict) -> str:
        """The log line of :meth:`grad_diagnostics` at an optimizer step."""
        r = d.get("grad_ratio") or {}
        terms = ", ".join(f"{k} {v:.4g}" for k, v in r.items() if v is not None)
        aux = d.get("aux_grad_ratio")
        return (f"gradient of each weighted term at step {d.get('step')} (embedding space, "
                f"||grad term|| / ||grad L||): {terms}; beta L_Dist + gamma L_CKA together "
                f"{'n/a' if aux is None else f'{100 * aux:.2f}%'}")

    @staticmethod
    def grad_diagnostics(terms: dict, inputs: Sequence[torch.Tensor]) -> dict:
        """How much each weighted loss term pushes the step's embeddings: the gradients of alpha L_Temp,
        beta L_Dist, gamma L_CKA and L_MRL with respect to every embedding the loss reads (pooled embeddings
        and temporal representations), from the loss graph only (no encoder backward).

        ``aux_grad_ratio = ||grad(beta L_Dist + gamma L_CKA)|| / ||grad L_total||`` and ``aux_grad_cos`` (the
        cosine of the two) in embedding space; ``grad_ratio[term] = ||grad(weighted term)|| / ||grad L_total||``
        for each term (mrl, temp, dist, cka; the terms' gradients are not orthogonal, so these need not sum
        to 1). It is a proxy for the same ratio on the LoRA parameters:
        those gradients are J^T g with the one Jacobian J = d(embeddings)/d(parameters) shared by every
        term, so the two ratios agree up to how J stretches the two directions (exactly when J^T J is a
        multiple of the identity on them); the exact parameter ratio needs one more encoder backward per
        term, the cost of a training step. Cost here: four backward passes through the loss graph."""
        t0 = time.time()
        inputs = [x for x in inputs if x is not None and x.requires_grad]
        flat = {}
        for k, v in terms.items():
            if isinstance(v, torch.Tensor) and v.requires_grad:
                gs = torch.autograd.grad(v, inputs, retain_graph=True, allow_unused=True)
                flat[k] = torch.cat([(g if g is not None else torch.zeros_like(x)).detach().double().reshape(-1)
                                     for g, x in zip(gs, inputs)])
        n = sum(x.numel() for x in inputs)
        for k in terms:
            flat.setdefault(k, torch.zeros(n, dtype=torch.float64))
        total = sum(flat.values())
        aux = flat["dist"] + flat["cka"] if "dist" in flat and "cka" in flat else torch.zeros(n, dtype=torch.float64)
        tn, an = float(total.norm()), float(aux.norm())
        out = {"space": "embeddings", "grad_norm": {k: float(v.norm()) for k, v in flat.items()},
               "grad_ratio": {k: float(v.norm()) / tn if tn > 0 else None for k, v in flat.items()},
               "grad_norm_total": tn, "grad_norm_aux": an,
               "aux_grad_ratio": an / tn if tn > 0 else None,
               "aux_grad_cos": float(aux @ total) / (an * tn) if an > 0 and tn > 0 else None,
               "weighted_terms": {k: float(v.detach()) for k, v in terms.items()}}
        out["seconds"] = round(time.time() - t0, 4)
        return out

    def _param_ratio(self, terms: dict, loss) -> Optional[dict]:
        """The exact ||grad(beta L_Dist + gamma L_CKA)|| / ||grad L_total|| on the backbone's trainable
        parameters (two encoder backward passes; the graph is kept for the step's own backward)."""
        params = [p for n, p in self.model.named_parameters() if p.requires_grad and not n.startswith("projector.")]
        aux = terms["dist"] + terms["cka"]
        if not params or not loss.requires_grad:
            return None

        def flat(t):
            if not isinstance(t, torch.Tensor) or not t.requires_grad:
                return torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
            gs = torch.autograd.grad(t, params, retain_graph=True, allow_unused=True)
            return torch.cat([(g if g is not None else torch.zeros_like(p)).detach().double().reshape(-1)
                              for g, p in zip(gs, params)])
        ga, gt = flat(aux), flat(loss)
        an, tn = float(ga.norm()), float(gt.norm())
        return {"space": "backbone parameters", "tensors": len(params), "grad_norm_total": tn, "grad_norm_aux": an,
                "aux_grad_ratio": an / tn if tn > 0 else None,
                "aux_grad_cos": float(ga @ gt) / (an * tn) if an > 0 and tn > 0 else None}

    def backward_batch(self, batch, *, scale: float = 1.0, scaler=None, amp_dtype=None, diagnose: bool = False):
        """Loss of one batch and its gradients accumulated into the parameters (x scale); GradCache
        when cache_embeddings. Returns (loss detached, parts). diagnose=True (with a TMRLLoss): also sets
        ``self.last_diagnostics`` to :meth:`grad_diagnostics` of this batch."""
        items, layout = self.batch_items(batch)
        ac = dict(device_type=self.device.type, dtype=amp_dtype, enabled=amp_dtype is not None)
        diagnose = diagnose and self.can_diagnose()
        if not self.cfg.cache_embeddings:
            with torch.autocast(**ac):
                emb, x_t, has = self._embed(items)
                res = self._loss_from(emb, x_t, has, layout, terms=diagnose)
            loss, parts = res[:2]
            if diagnose:
                self.last_diagnostics = self.grad_diagnostics(res[2], (emb, x_t))
                if self.diagnose_params:
                    self.last_diagnostics["params"] = self._param_ratio(res[2], loss)
            scaled = loss * scale
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            return loss.detach(), parts
        mb = self.cfg.mini_batch_size
        chunks = [items[i:i + mb] for i in range(0, len(items), mb)]
        states, embs, xts, hass = [], [], [], []
        with torch.no_grad():
            for ch in chunks:
                states.append(_RandState(self.device))
                with torch.autocast(**ac):
                    e, x, h = self._embed(ch)
                embs.append(e)
                xts.append(x)
                hass.append(h)
        emb = torch.cat(embs).detach().requires_grad_(True)
        x_t = None if xts[0] is None else torch.cat(xts).detach().requires_grad_(True)
        has = None if hass[0] is None else torch.cat(hass)
        with torch.autocast(**ac):
            res = self._loss_from(emb, x_t, has, layout, terms=diagnose)
        loss, parts = res[:2]
        if diagnose:
            self.last_diagnostics = self.grad_diagnostics(res[2], (emb, x_t))
        scaled = loss * scale
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        g_emb = emb.grad
        g_xt = x_t.grad if x_t is not None else None
        off = 0
        for ch, st in zip(chunks, states):
            sl = slice(off, off + len(ch))
            off += len(ch)
            with st.replay():
                with torch.autocast(**ac):
                    e, x, _ = self._embed(ch)
                surrogate = (e * g_emb[sl].to(e.dtype)).sum()
                if x is not None and g_xt is not None:
                    surrogate = surrogate + (x * g_xt[sl].to(x.dtype)).sum()
            surrogate.backward()
        return loss.detach(), parts

    # ---- state ----------------------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """The rows this trainer trains on and the tokenizer vocabulary."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = _resume.data_fingerprint(self.model.tokenizer, rows=self.rows)
        return self._fingerprint

    def _save_state(self, where: Path, opt, sched, scaler, epoch, batch, epoch_done, step, history):
        state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "scaler": scaler.state_dict() if scaler is not None else None, "epoch": epoch, "batch": batch,
                 "epoch_done": epoch_done, "step": step, "history": history, "config": asdict(self.cfg),
                 "data": self.fingerprint(), "first_diagnostics": self._first_diagnostics,
                 "rng": _resume.rng_state()}
        # the trainer state goes into the checkpoint directory itself, under its checksum manifest
        self.model.save(where, extra_files={_resume.STATE_FILE: _resume.state_bytes(state)})

    def _load_weights(self, where: Path):
        from safetensors.torch import load_model
        for mod, f in ((self.model.backbone, BACKBONE_FILE), (self.model.projector, PROJECTOR_FILE)):
            if mod is None:
                continue
            missing, unexpected = load_model(mod, str(where / f), strict=False, device=str(self.device))
            if missing or unexpected:
                raise ValueError(f"{where / f} does not fit the model being trained: missing "
                                 f"{sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")

    # ---- loop -----------------------------------------------------------------------------------------
    def fit(self, *, resume: bool = False, resume_anyway: bool = False) -> TMRLResult:
        cfg, model = self.cfg, self.model
        seed_everything(cfg.seed)
        model.to(self.device).train()
        if cfg.variant == "zero_shot":
            model.eval()
            return TMRLResult(0)
        CTDTrainer._sync_params(self)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (lora=False and no projector?)")
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
        nb = self.num_batches()
        steps_per_epoch = max(1, math.ceil(nb / cfg.grad_accum))
        total = steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            total = min(total, cfg.max_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _linear_warmup(total, int(cfg.warmup_ratio * total)))
        amp_dtype, scaler = _amp_setup(cfg.amp, self.device)
        start_epoch, step, history = 0, 0, []
        self._first_diagnostics = None
        skip = 0
        if resume:
            if self.out is None:
                raise ValueError("resume needs the output directory of the interrupted run (out_dir)")
            last = self.out / "last"
            st_file = last / _resume.STATE_FILE
            if not st_file.exists():
                raise FileNotFoundError(f"cannot resume: {st_file} does not exist")
            verify_checkpoint(last)   # weights and trainer state as saved
            st = _resume.load_state(st_file)
            _resume.check_resume(st_file, st, cfg, self.fingerprint(), anyway=resume_anyway, log=self.log)
            for note in _resume.mutable_notes(st["config"], asdict(cfg)):
                self.log(f"resume: {note}")
            self._load_weights(last)
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
            if scaler is not None and st.get("scaler"):
                scaler.load_state_dict(st["scaler"])
            start_epoch, skip = (st["epoch"] + 1, 0) if st["epoch_done"] else (st["epoch"], st["batch"])
            step, history = st["step"], st["history"]
            self._first_diagnostics = st.get("first_diagnostics")
            _resume.set_rng_state(st["rng"])
            if self.rank == 0:
                _resume.truncate_log(self.out / "log.jsonl", step)
            self.log(f"resumed from {last} at epoch {start_epoch} (0-based), batch {skip}, step {step}")
        logf = None
        if self.out is not None and self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            logf = open(self.out / "log.jsonl", "a")
        coverage = self.coverage()
        self.log(self.describe_coverage(coverage))
        if logf:
            logf.write(json.dumps({"event": "data", "variant": cfg.variant, "step": step,
                                   "negative_query_coverage": coverage}) + "\n")
            logf.flush()

        def diag_record(d):
            self.log(self.describe_diagnostics(d))
            if logf:
                logf.write(json.dumps({"event": "grad_diagnostics", "variant": cfg.variant, **d}) + "\n")
                logf.flush()
        t0 = time.time()
        last_loss = None
        self.last_diagnostics, diagnostics = None, None
        last_epoch = cfg.epochs - 1 if cfg.stop_after_epochs is None else min(cfg.epochs,
                                                                            start_epoch + cfg.stop_after_epochs) - 1
        try:
            for epoch in range(start_epoch, cfg.epochs):
                if cfg.max_steps is not None and step >= cfg.max_steps:
                    break
                batches = self.epoch_batches(epoch)
                start_bi, skip = skip, 0   # batches of this epoch done before a mid-epoch resume
                done = start_bi
                bar = _progress(batches[start_bi:], cfg.progress and self.rank == 0,
                                f"tmrl[{cfg.variant}] epoch {epoch + 1}/{cfg.epochs}")
                opt.zero_grad(set_to_none=True)
                acc: Dict[str, float] = {}
                n_acc = 0
                for bi, batch in enumerate(bar, start=start_bi):
                    ends_step = not (bi + 1) % cfg.grad_accum or bi + 1 == len(batches)
                    final = ends_step and ((cfg.max_steps is not None and step + 1 >= cfg.max_steps)
                                           or (epoch == last_epoch and bi + 1 == len(batches)))
                    first = step == 0 and bi == 0      # the run's first micro-batch
                    self.last_diagnostics = None
                    loss, parts = self.backward_batch(batch, scale=1.0 / cfg.grad_accum, scaler=scaler,
                                                      amp_dtype=amp_dtype, diagnose=final or first)
                    if first and self.last_diagnostics is not None:
                        self._first_diagnostics = {"step": 1, "epoch": epoch, **self.last_diagnostics}
                        diag_record(self._first_diagnostics)
                    if final and self.last_diagnostics is not None:
                        diagnostics = {"step": step + 1, "epoch": epoch, **self.last_diagnostics}
                        if not first:
                            diag_record(diagnostics)
                    for k, v in parts.items():
                        if isinstance(v, torch.Tensor) and v.numel() == 1:
                            acc[k] = acc.get(k, 0.0) + float(v)
                    acc["loss"] = acc.get("loss", 0.0) + float(loss)
                    n_acc += 1
                    if (bi + 1) % cfg.grad_accum and bi + 1 != len(batches):
                        continue
                    CTDTrainer._allreduce_grads(self)
                    if scaler is not None:
                        scaler.unscale_(opt)
                    if cfg.max_grad_norm:
                        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                    if scaler is not None:
                        scaler.step(opt)
                        scaler.update()
                    else:
                        opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                    step += 1
                    done = bi + 1
                    means = {k: v / n_acc for k, v in acc.items()}
                    acc, n_acc = {}, 0
                    last_loss = means["loss"]
                    rec = {"event": "step", "variant": cfg.variant, "epoch": epoch, "step": step, **means,
                           "lr": sched.get_last_lr()[0], "seconds": round(time.time() - t0, 3)}
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
                            self._save_state(self.out / "last", opt, sched, scaler, epoch, done, False, step, history)
                        if self.world > 1:
                            import torch.distributed as dist
                            dist.barrier()
                if self.out is not None and self.rank == 0:
                    self._save_state(self.out / "last", opt, sched, scaler, epoch, done, done >= len(batches), step,
                                     history)
                if self.world > 1:
                    import torch.distributed as dist
                    dist.barrier()
                if cfg.stop_after_epochs is not None and epoch + 1 - start_epoch >= cfg.stop_after_epochs:
                    break
        finally:
            if logf:
                logf.close()
        model.eval()
        return TMRLResult(step, history, last_loss, time.time() - t0, diagnostics, self._first_diagnostics, coverage)


def train_tmrl(model, rows, config: Optional[TMRLConfig] = None, out_dir=None, *, resume: bool = False,
               resume_anyway: bool = False, device=None, log=print, loss_fn=None) -> TMRLResult:
    """Fine-tune a TMRLEncoder on TMRL rows (a TMRLData or a list of TMRLRow)."""
    return TMRLTrainer(model, rows, config or TMRLConfig(), out_dir, device=device, log=log,
                       loss_fn=loss_fn).fit(resume=resume, resume_anyway=resume_anyway)


# ---- evaluation per dim -------------------------------------------------------------------------------

def _split_queries(dataset, split: str):
    if split == "all":
        return list(dataset.queries)
    qs = dataset.queries_in(split)
    if not qs and all(q.split is None for q in dataset.queries):
        return list(dataset.queries)     # a set without splits (e.g. one BEIR qrels file)
    if not qs:
        have = sorted({str(q.split) for q in dataset.queries})
        raise ValueError(f"dataset {dataset.name!r} has no queries in split {split!r} (it has {have})")
    return qs


@torch.no_grad()
def runs_by_dim(model, dataset, splits: Sequence[str] = ("test",), dims: Optional[Sequence[int]] = None, *,
                depth: int = 100, batch_size: int = 64) -> Dict[int, Dict[str, Dict[str, Dict[str, float]]]]:
    """``{dim: {split: {qid: {doc_id: cosine}}}}``: the top-`depth` gallery records of every query of each
    split at each nested dim (first dim coordinates, L2-normalised). The gallery (all records) and the
    queries are encoded once at full size; a prefix of a normalised vector, normalised again, is the
    normalised prefix of the raw one."""
    dims = tuple(dims) if dims else tuple(model.dims)
    for m in dims:
        model.check_dim(m)
    gallery = list(dataset.records)
    if not gallery:
        raise ValueError(f"dataset {dataset.name!r} has no records")
    gids = [r.id for r in gallery]
    G = model.encode([r.text for r in gallery], role="document", batch_size=batch_size)
    per_split = {s: _split_queries(dataset, s) for s in splits}
    out: Dict[int, Dict[str, Dict[str, Dict[str, float]]]] = {m: {} for m in dims}
    k = min(depth, len(gallery))
    for s, qs in per_split.items():
        Q = model.encode([q.text for q in qs], role="query", batch_size=batch_size)
        for m in dims:
            g = torch.nn.functional.normalize(G[:, :m], dim=-1).contiguous()
            qv = torch.nn.functional.normalize(Q[:, :m], dim=-1).contiguous()
            vals, idx = ctd_topk(qv, g, k, temperature=1.0)
            out[m][s] = {q.id: {gids[j]: float(v) for j, v in zip(idx[i].tolist(), vals[i].tolist())}
                         for i, q in enumerate(qs)}
    return out


def evaluate_dims(model, dataset, split: str = "test", dims: Optional[Sequence[int]] = None, *,
                  ks: Sequence[int] = (1, 10, 100), depth: int = 100, batch_size: int = 64,
                  return_runs: bool = False):
    """One row per dim: nDCG@10, recall@k, R@k (hit), MRR@10, MRR and the query count
    (``tempokern.eval.retrieval_metrics`` on the top-`depth` run; TMRL reports nDCG@10 and recall@100).
    return_runs: ``(rows, {dim: {qid: {doc_id: cosine}}})``, the rankings the rows are computed from."""
    runs = runs_by_dim(model, dataset, (split,), dims, depth=depth, batch_size=batch_size)
    qs = _split_queries(dataset, split)
    qrels = {q.id: {d: q.gold[d] for d in q.relevant_ids()} for q in qs}   # score > 0 (is_relevant)
    qrels = {q: g for q, g in qrels.items() if g}
    if not qrels:
        raise ValueError(f"no query of split {split!r} has a relevant record")
    rows = []
    for m, by_split in runs.items():
        met = retrieval_metrics(by_split[split], qrels, ks=tuple(ks))
        rows.append({"dim": m, **{k: float(v) for k, v in met.items() if k != "num_queries"},
                     "queries": int(met["num_queries"])})
    return (rows, {m: by_split[split] for m, by_split in runs.items()}) if return_runs else rows
