"""Re³ training (Eqs. 10-13) and evaluation of a :class:`tempokern.models.Re3Encoder`.

Frozen backbone (default, B1): the backbone's pooled vectors ``e_sem`` of every training text are computed
**once** (one encoding pass), then the time embedding, FiLM MLP and α train on the cached vectors — an
epoch costs a few small matmuls per example instead of a transformer forward. ``variant="lora"`` (the
paper's LoRA baseline) tunes the backbone with LoRA and plain InfoNCE, time path off, encoding every
batch. The loss is :class:`tempokern.nn.Re3Loss`; AdamW with linear warm-up/decay, gradient clipping,
resume from ``out_dir/last``, JSONL logs (``out_dir/log.jsonl``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence

import torch

from ..text.time import TimeTuple
from .. import ctd_topk
from ..eval import re3_metrics
from ..eval.metrics import per_query_metrics, rank_documents
from ..models.re3 import Re3Encoder, _as_intervals, interval_batch, resolve_intervals, resolve_times
from ..nn import Re3Loss
from .trainer import _linear_warmup, _progress, check_save_every
from . import resume as _resume

VARIANTS: Dict[str, dict] = {
    "base": dict(train=False, lora=False, use_time=True, margins=False),
    "film": dict(train=True, lora=False, use_time=True, margins=False),
    "film_margins": dict(train=True, lora=False, use_time=True, margins=True),
    "lora": dict(train=True, lora=True, use_time=False, margins=False),
}


#: Re3Config.film_times choices
FILM_TIMES = ("model", "silver")


@dataclass
class Re3Config:
    variant: str = "film_margins"
    temperature: float = 0.05
    margin: float = 0.1
    lambda_hard: float = 0.1
    lambda_tw: float = 0.1
    freeze_backbone: bool = True
    lr: Optional[float] = None          # default 1e-3 for the time modules, 1e-4 with LoRA (B7)
    batch_size: int = 128
    epochs: int = 3
    tw_in_nce: bool = False
    dedup: bool = True
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0
    max_steps: Optional[int] = None
    stop_after_epochs: Optional[int] = None   # end this run early; resume continues it
    save_every: Optional[int] = None          # also write last/ every N steps (resumable mid-epoch)
    encode_batch_size: int = 64
    fit_year_stats: bool = True               # μ_y, σ_y from the training texts' observed years (B3)
    # torch threads while training on cached e_sem (small matmuls + elementwise ops: OpenMP fork/join costs
    # more than it gains there on a shared machine); None = leave torch's setting
    cached_threads: Optional[int] = 1
    lora_r: int = 16
    lora_alpha: int = 64
    lora_dropout: float = 0.1
    progress: bool = True
    # time_parser="learned": the parser heads are fitted first (fit_time_parser) on the training texts'
    # silver labels (the data's time fields, else the rule parser) when the model's are not fitted yet
    parser_epochs: int = 30
    parser_lr: float = 1e-2
    # which times the FiLM modules train on: "model" (the times the model reads at evaluation: a learned-parser
    # model's own predictions once its heads are fitted; the rules otherwise) or "silver" (always the data's
    # time fields / the rule parser, also for a learned-parser model)
    film_times: str = "model"

    def validate(self) -> "Re3Config":
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown Re3 variant {self.variant!r}: expected one of {', '.join(VARIANTS)}")
        check_save_every(self.save_every)
        for name in ("epochs", "batch_size", "encode_batch_size", "lora_r", "parser_epochs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "epochs" else 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.film_times not in FILM_TIMES:
            raise ValueError(f"film_times must be one of {FILM_TIMES}, got {self.film_times!r}")
        if self.batch_size < 2:
            raise ValueError("batch_size must be >= 2 (in-batch negatives)")
        for name in ("temperature", "parser_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        for name in ("margin", "lambda_hard", "lambda_tw", "weight_decay", "max_grad_norm"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int)
                                           or self.max_steps < 1):
            raise ValueError(f"max_steps must be None or a positive int, got {self.max_steps!r}")
        return self

    @property
    def effective_lr(self) -> float:
        if self.lr is not None:
            return float(self.lr)
        return 1e-4 if VARIANTS[self.variant]["lora"] else 1e-3

    def loss_weights(self) -> tuple:
        """(lambda_hard, lambda_tw) of the variant: the margins only in ``film_margins``."""
        if VARIANTS[self.variant]["margins"]:
            return float(self.lambda_hard), float(self.lambda_tw)
        return 0.0, 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "Re3Config":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown Re3 training option(s) {unknown}; known: {sorted(names)}")
        return cls(**d).validate()


class Re3Example(NamedTuple):
    """One training triple: the query text, its reference date (query time; anchors relative dates), the
    positive document id and an optional time-wrong negative document id (``d⁻_tw``)."""
    query: str
    positive: Any
    tw_negative: Any = None
    query_ref: Any = None
    query_time: Optional[TimeTuple] = None


class Re3Doc(NamedTuple):
    text: str
    published: Any = None
    time: Optional[TimeTuple] = None


@dataclass
class Re3Result:
    steps: int
    history: List[dict] = field(default_factory=list)
    final_loss: Optional[float] = None
    seconds: float = 0.0
    encode_seconds: float = 0.0
    train_seconds: float = 0.0
    num_examples: int = 0
    #: with ``dev_eval``: ``[{"epoch", "dev"}]`` (epoch 0 = before training) and the epoch whose weights were kept
    dev_history: List[dict] = field(default_factory=list)
    best_epoch: Optional[int] = None


# ---- data ---------------------------------------------------------------------------------------------------
def docs_from_dataset(dataset) -> Dict[Any, Re3Doc]:
    """``{record id: Re3Doc(text, published)}`` for a :class:`tempokern.datasets.RetrievalDataset`."""
    return {r.id: Re3Doc(r.text, r.published) for r in dataset.records}


def examples_from_synth(synth, *, require_tw: bool = False) -> List[Re3Example]:
    """Training triples from a ``SynthSet``'s ``train_rows``: the first ``time_wrong`` hard negative is
    ``d⁻_tw``; the query's reference date is its ``meta["query_time"]``."""
    qmeta = {q.id: q.meta for q in synth.dataset.queries}
    out = []
    for row in synth.train_rows:
        tw = None
        for nid, kind in zip(row.hard_negatives, row.negative_kinds):
            if kind == "time_wrong":
                tw = nid
                break
        if tw is None and require_tw:
            continue
        out.append(Re3Example(row.query, row.positive, tw, (qmeta.get(row.query_id) or {}).get("query_time")))
    return out


def examples_from_dataset(dataset, split: str = "train") -> List[Re3Example]:
    """Training triples from the queries of one split: the best-scored gold document is the positive (a query
    whose documents all score <= 0 — judged, not relevant — has none and is skipped);
    ``meta["time_wrong_twin"]`` (when present) the time-wrong negative; ``meta["query_time"]`` the
    reference date."""
    out = []
    for q in dataset.queries:
        if q.split != split or not q.gold:
            continue
        rel = q.relevant_ids()   # score > 0 only (tempokern.datasets.base.is_relevant)
        if not rel:
            continue
        pos = max(rel, key=lambda d: q.gold[d])
        out.append(Re3Example(q.text, pos, q.meta.get("time_wrong_twin"), q.meta.get("query_time")))
    if not out:
        raise ValueError(f"dataset {dataset.name!r} has no query with a relevant document (qrels score > 0) in split "
                         f"{split!r}")
    return out


def _day_range(start: TimeTuple, end: TimeTuple):
    """The (first, last) proleptic ordinal days an interval covers (a missing month / day widens it); None
    without a year."""
    import calendar as _cal
    import datetime as _dt
    if not (start.mask[0] and end.mask[0]):
        return None
    m0 = start.month if start.mask[1] else 1
    d0 = start.day if (start.mask[1] and start.mask[2]) else 1
    m1 = end.month if end.mask[1] else 12
    d1 = end.day if (end.mask[1] and end.mask[2]) else _cal.monthrange(end.year, m1)[1]
    a, b = _dt.date(start.year, m0, d0).toordinal(), _dt.date(end.year, m1, d1).toordinal()
    return (a, b) if a <= b else (b, a)


def time_wrong_twins(dataset, queries, *, group_key: str = "page", candidates=None, log: Callable = print
                     ) -> Dict[Any, Any]:
    """``{query id: record id | None}``: each query's **time-wrong twin** — a record of the same group
    (``meta[group_key]``, e.g. the same TimeQA page) that is not relevant to it (qrels score <= 0 or absent)
    and whose dates all lie **outside** the query's interval (no date expression of the record overlaps it,
    day ranges from the rule parser, a missing month / day widening a date to its year / month). Among those,
    the one whose nearest date is closest to the query's interval (then the first in the dataset's order):
    the same subject at another time, the negative Eq. 12's L_tw is written for. None where the query has no
    dated interval or its group has no such record (the example then has no L_tw term). ``candidates``: the
    records to choose from (default: every record of the dataset). Logs the coverage."""
    recs = list(candidates if candidates is not None else dataset.records)
    by_group: Dict[Any, List[Any]] = {}
    for r in recs:
        g = (r.meta or {}).get(group_key)
        if g is not None:
            by_group.setdefault(g, []).append(r)
    need = {g for g in ((q.meta or {}).get(group_key) for q in queries) if g is not None}
    pool = [r for g in need for r in by_group.get(g, ())]
    rdays = {}
    if pool:
        every = resolve_intervals([r.text for r in pool], pub=[r.published for r in pool], role="document",
                                  every=True)
        for r, ivs in zip(pool, every):
            rdays[r.id] = [x for x in (_day_range(a, b) for a, b in ivs) if x is not None]
    qivs = resolve_intervals([q.text for q in queries], pub=[(q.meta or {}).get("query_time") for q in queries],
                             role="query")
    out, no_time = {}, 0
    for q, ivs in zip(queries, qivs):
        qd = _day_range(*ivs[0]) if ivs else None
        g = (q.meta or {}).get(group_key)
        if qd is None:
            no_time += 1
            out[q.id] = None
            continue
        best, best_gap = None, None
        for r in by_group.get(g, ()):
            days = rdays.get(r.id) or []
            if not days or (q.gold or {}).get(r.id, 0) > 0:
                continue
            if any(a <= qd[1] and qd[0] <= b for a, b in days):
                continue
            gap = min(qd[0] - b if b < qd[0] else a - qd[1] for a, b in days)
            if best_gap is None or gap < best_gap:
                best, best_gap = r.id, gap
        out[q.id] = best
    n = len(out)
    have = sum(v is not None for v in out.values())
    log(f"re3: time-wrong twins (same {group_key}, every date outside the query's interval) for {have}/{n} "
        f"queries; {no_time} without a dated interval, {n - have - no_time} whose {group_key} has no such record "
        "(no L_tw term for them)")
    return out


def dev_groups(groups, *, share: float = 0.12, seed: int = 0) -> set:
    """The groups (e.g. training pages) set apart for epoch selection: those whose
    ``sha256(f"re3-dev:{seed}:{group}")`` falls in the first ``share`` of the hash range — fixed per (group,
    seed), independent of the other groups. At least one group when ``share > 0`` and there are two or more."""
    import hashlib
    if not 0 <= share < 1:
        raise ValueError(f"share must be in [0, 1), got {share!r}")
    groups = sorted(set(groups), key=str)
    h = {g: int(hashlib.sha256(f"re3-dev:{seed}:{g}".encode("utf-8")).hexdigest(), 16) / 2.0 ** 256 for g in groups}
    out = {g for g in groups if h[g] < share}
    if not out and share > 0 and len(groups) >= 2:
        out = {min(groups, key=lambda g: h[g])}
    return out


def dev_scorer(dataset, queries, *, metric: str = "nDCG@10", batch_size: int = 64) -> Callable:
    """``model -> float``: the mean ``metric`` of ``queries`` ranked (:func:`re3_runs`) over ``dataset``'s
    records (give a dataset of the dev groups' records only). For ``train_re3(dev_eval=...)``."""
    from ..datasets import RetrievalDataset
    qs = [q for q in queries if any(v > 0 for v in (q.gold or {}).values())]
    if not qs:
        raise ValueError("dev_scorer: no query with a relevant document")
    qs = [dataclasses.replace(q, split="dev") for q in qs]
    ds = RetrievalDataset(f"{dataset.name}[re3-dev]", list(dataset.records), qs, dataset.calendar)

    def score(model) -> float:
        runs = re3_runs(model, ds, ["dev"], depth=min(100, len(ds.records)), batch_size=batch_size)
        return float(re3_eval(ds, runs)["dev"][metric])
    score.queries = len(qs)
    score.records = len(ds.records)
    return score


def _as_given_all(g):
    """A document's own time field as every interval it names (None: not given)."""
    return None if g is None else _as_intervals(g, "document time")


def _resolve_batch(model, texts, refs, given, role):
    """Per text, the first time interval ``[(start, end)]`` (``[]``: none): the data's own time field where
    given (a TimeTuple / date or a (start, end) pair), else the rule parser (``model.ranges``, ``doc_time``).
    Training labels always come from the data or the rules, also for a learned-parser model."""
    out = [None if g is None else _as_intervals(g, f"time of {t[:40]!r}")[:1] for g, t in zip(given, texts)]
    todo = [i for i, g in enumerate(out) if g is None]
    if todo:
        rs = resolve_intervals([texts[i] for i in todo], pub=[refs[i] for i in todo], role=role,
                               doc_time=model.doc_time, ranges=getattr(model, "ranges", "interval"))
        for i, r in zip(todo, rs):
            out[i] = r
    return out


def _time_distance(a: TimeTuple, b: TimeTuple) -> float:
    """How far two times are, in days, over the parts both observe (0 when they share none)."""
    d = 0.0
    for k, (x, y, w) in enumerate(((a.year, b.year, 365.25), (a.month, b.month, 30.44), (a.day, b.day, 1.0))):
        if a.mask[k] and b.mask[k]:
            d += abs(x - y) * w
    return d


def best_matching(doc_intervals, query_interval):
    """The interval of ``doc_intervals`` closest to ``query_interval`` (start to start, then end to end;
    the first one on a tie, and when the query has no time): the time a multi-time document is trained with,
    as it is scored by its best-matching time."""
    if not doc_intervals:
        return []
    if not query_interval:
        return doc_intervals[:1]
    qs, qe = query_interval[0]
    return [min(doc_intervals, key=lambda iv: (_time_distance(iv[0], qs), _time_distance(iv[1], qe)))]


def fit_time_parser(model, texts: Sequence[str], *, times=None, pub=None, role: str = "document",
                    epochs: int = 30, lr: float = 1e-2, batch_size: int = 64, seed: int = 0,
                    log: Callable = print) -> dict:
    """Fit a ``Re3Encoder(time_parser="learned")``'s parser heads (the paper's learned parser, Re³ §3.2) on
    silver labels: ``times`` (the data's time fields: TimeTuple / date / ISO string / None per text) where
    given, else the rule parser on the text (relative dates against ``pub``). The backbone stays frozen:
    its [CLS] states are computed once, the heads' input standardisation is fitted to them
    (``TimeParserHeads.set_feature_stats``) and the heads train on them (calendar CE + presence BCE, AdamW).
    Sets ``model.parser_fitted``. Returns ``{"texts", "epochs", "loss", "train_exact"}`` (the share of
    training texts whose predicted (year, month, day, mask) equals the label)."""
    if model.parser is None:
        raise ValueError("fit_time_parser needs a Re3Encoder built with time_parser='learned'")
    texts = list(texts)
    if not texts:
        raise ValueError("fit_time_parser: no text")
    labels = resolve_times(texts, times=times, pub=pub, role=role, doc_time="content")
    if times is not None:   # a text without a given time falls back to the rule parser
        rule = resolve_times(texts, pub=pub, role=role, doc_time="content")
        labels = [t if t is not None else r for t, r in zip(labels, rule)]
    labels = [t if t is not None else TimeTuple() for t in labels]
    h = model.cls_states(texts, batch_size=batch_size).detach()
    heads = model.parser
    heads.to(h.device).float().train()
    heads.set_feature_stats(h)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    loss = torch.zeros(())
    for ep in range(epochs):
        perm = torch.randperm(len(texts), generator=g)
        for i in range(0, len(texts), batch_size):
            idx = perm[i:i + batch_size]
            loss = heads.loss(h[idx.to(h.device)], [labels[j] for j in idx.tolist()])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    heads.eval()
    pred = heads.predict(h)
    exact = sum(p == t for p, t in zip(pred, labels)) / len(texts)
    model.parser_fitted = True
    log(f"re3: learned time parser fitted on {len(texts)} texts, {epochs} epochs, train exact match {exact:.3f}")
    return {"texts": len(texts), "epochs": epochs, "loss": float(loss.detach()), "train_exact": exact}


# ---- trainer -------------------------------------------------------------------------------------------------
def _default_loss(cfg: Re3Config):
    lh, lt = cfg.loss_weights()
    return Re3Loss(temperature=cfg.temperature, margin=cfg.margin, lambda_hard=lh, lambda_tw=lt,
                   tw_in_nce=cfg.tw_in_nce, dedup=cfg.dedup)


def _trainable_state(model) -> Dict[str, torch.Tensor]:
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    sd = model.state_dict()
    keep = {k: v.detach().cpu().clone() for k, v in sd.items()
            if k in names or k.startswith("time_embed.") or k.startswith("film.")}
    return keep


class Re3Trainer:
    """``Re3Trainer(model, docs, examples, config, out_dir=None).fit(resume=False)``.

    ``docs``: ``{doc id: Re3Doc | (text, published) | text}``; ``examples``: :class:`Re3Example` list (doc ids
    into ``docs``). ``loss_fn``: defaults to ``tempokern.nn.Re3Loss`` configured from ``config``; any module
    with ``forward(q, d, d_tw=None, doc_ids=None) -> (loss, parts)`` works."""

    def __init__(self, model, docs: Mapping[Any, Any], examples: Sequence[Re3Example], config: Optional[Re3Config] = None,
                 out_dir=None, *, loss_fn=None, log: Callable = print, dev_eval: Optional[Callable] = None):
        self.cfg = (config or Re3Config()).validate()
        self.dev_eval = dev_eval
        self.model, self.log = model, log
        self.out = Path(out_dir) if out_dir is not None else None
        self.variant = VARIANTS[self.cfg.variant]
        self.docs = {k: _as_doc(k, v) for k, v in docs.items()}
        self.examples = [e if isinstance(e, Re3Example) else Re3Example(*e) for e in examples]
        if not self.examples and self.variant["train"]:
            raise ValueError("examples: no training example")
        for i, e in enumerate(self.examples):
            for what, d in (("positive", e.positive), ("tw_negative", e.tw_negative)):
                if d is not None and d not in self.docs:
                    raise KeyError(f"examples[{i}].{what}: document id {d!r} is not in docs")
        if self.variant["lora"] and model.lora_config is None:
            raise ValueError("variant 'lora' needs a Re3Encoder built with lora=... (see build_re3_model)")
        if not self.variant["lora"] and not model.freeze_backbone:
            self.log("note: the backbone is not frozen; it trains with the time modules (no e_sem cache)")
        model.use_time = self.variant["use_time"]
        self.loss_fn = loss_fn if loss_fn is not None else (_default_loss(self.cfg) if self.variant["train"] else None)

    # -- preparation: times and (frozen) semantic cache --
    def _prepare(self):
        m, ex = self.model, self.examples
        doc_ids = sorted({e.positive for e in ex} | {e.tw_negative for e in ex if e.tw_negative is not None}, key=str)
        self.doc_row = {d: i for i, d in enumerate(doc_ids)}
        dtexts = [self.docs[d].text for d in doc_ids]
        dtimes = _resolve_batch(m, dtexts, [self.docs[d].published for d in doc_ids],
                                [self.docs[d].time for d in doc_ids], "document")
        qtexts = [e.query for e in ex]
        qtimes = _resolve_batch(m, qtexts, [e.query_ref for e in ex], [e.query_time for e in ex], "query")
        self.dpubs, self.qrefs = [self.docs[d].published for d in doc_ids], [e.query_ref for e in ex]
        self.dtexts, self.qtexts = dtexts, qtexts
        self.dtimes, self.qtimes = dtimes, qtimes
        # (start, end) of each text's first interval: the ends enter e_time with ranges="interval"
        self.dv, self.dm, self.dve, self.dme = interval_batch(dtimes)
        self.qv, self.qm, self.qve, self.qme = interval_batch(qtimes)
        years = [t.year for ivs in dtimes + qtimes for iv in ivs for t in iv if t.mask[0]]
        # multi-time (an extension): a document is trained with its time closest to the query's (per example,
        # for the positive and the time-wrong negative), as it is scored by its best-matching time
        self.ex_times = None
        self.ex_rows = None
        if getattr(m, "passages", None) is not None:
            years += self._prepare_passages(doc_ids, qtimes)
        elif getattr(m, "multi_time", False):
            every = [_as_given_all(self.docs[d].time) for d in doc_ids]
            todo = [i for i, g in enumerate(every) if g is None]
            if todo:
                rs = resolve_intervals([dtexts[i] for i in todo],
                                       pub=[self.docs[doc_ids[i]].published for i in todo], role="document",
                                       doc_time=m.doc_time, ranges=m.ranges, every=True)
                for i, r in zip(todo, rs):
                    every[i] = r
            pos = [best_matching(every[self.doc_row[e.positive]], q) for e, q in zip(ex, qtimes)]
            tw = [best_matching(every[self.doc_row[e.tw_negative]], q) if e.tw_negative is not None else []
                  for e, q in zip(ex, qtimes)]
            self.ex_times = (interval_batch(pos), interval_batch(tw))
            years += [t.year for ivs in every for iv in ivs for t in iv if t.mask[0]]
        return years

    def _prepare_passages(self, doc_ids, qtimes) -> List[int]:
        """``passages="date_windows"``: each example's positive and time-wrong negative are trained as their
        passage whose date is closest to the query's (:func:`best_matching`; the first passage when the query
        has no time or the document no date), with that passage's own ``e_sem``. Replaces ``dtexts`` by the
        distinct passage texts; returns the passages' observed years (for μ_y, σ_y)."""
        m, ex = self.model, self.examples
        per = m.passages_of([self.docs[d].text for d in doc_ids], pub=[self.docs[d].published for d in doc_ids],
                            role="document")
        rows: Dict[str, int] = {}

        def pick(doc, q):
            units = per[self.doc_row[doc]]
            timed = [iv for _, ivs in units for iv in ivs[:1]]
            want = best_matching(timed, q) if timed else []
            k = next((i for i, (_, ivs) in enumerate(units) if want and ivs[:1] == want), 0)
            text, ivs = units[k]
            return rows.setdefault(text, len(rows)), ivs[:1]

        pos = [pick(e.positive, q) for e, q in zip(ex, qtimes)]
        tw = [pick(e.tw_negative, q) if e.tw_negative is not None else pos[i]
              for i, (e, q) in enumerate(zip(ex, qtimes))]
        self.dtexts = list(rows)
        self.ex_rows = (torch.tensor([r for r, _ in pos], dtype=torch.int64),
                        torch.tensor([r for r, _ in tw], dtype=torch.int64))
        self.ex_times = (interval_batch([iv for _, iv in pos]), interval_batch([iv for _, iv in tw]))
        self.num_passages = sum(len(u) for u in per)
        return [t.year for ps in per for _, ivs in ps for iv in ivs for t in iv if t.mask[0]]

    def _use_model_times(self) -> None:
        """``film_times="model"`` with a fitted learned parser: the training texts' times become the parser's
        predictions (what the model reads at evaluation), replacing the silver labels it was fitted on."""
        m = self.model
        self.dtimes = m.intervals(self.dtexts, pub=self.dpubs, role="document")
        self.qtimes = m.intervals(self.qtexts, pub=self.qrefs, role="query")
        self.dv, self.dm, self.dve, self.dme = interval_batch(self.dtimes)
        self.qv, self.qm, self.qve, self.qme = interval_batch(self.qtimes)
        self.log(f"re3: the time modules train on the learned parser's times ({sum(map(bool, self.dtimes))}/"
                 f"{len(self.dtimes)} documents, {sum(map(bool, self.qtimes))}/{len(self.qtimes)} queries dated)")

    def _doc_times(self, rows: torch.Tensor, idx: torch.Tensor, which: int, dev):
        """(values, mask, end values, end mask) of the documents ``rows`` for the examples ``idx``: the
        document's first time, or (multi-time) its time closest to the example's query."""
        if self.ex_times is not None:
            return tuple(t[idx].to(dev) for t in self.ex_times[which])
        return tuple(t[rows].to(dev) for t in (self.dv, self.dm, self.dve, self.dme))

    def _encode_cache(self):
        m, cfg = self.model, self.cfg
        if m._sem_cache is None:
            m.enable_semantic_cache()   # kept: evaluation after training reuses these e_sem
        t0 = time.time()
        prog = (lambda it: _progress(it, cfg.progress, "re3 encode")) if cfg.progress else None
        self.d_sem = m.semantic(self.dtexts, batch_size=cfg.encode_batch_size, progress=prog).detach()
        self.q_sem = m.semantic(self.qtexts, batch_size=cfg.encode_batch_size, progress=prog).detach()
        return time.time() - t0

    def _batches(self, epoch: int) -> List[torch.Tensor]:
        g = torch.Generator().manual_seed(self.cfg.seed * 1000003 + epoch)
        perm = torch.randperm(len(self.examples), generator=g)
        B = self.cfg.batch_size
        out = [perm[i:i + B] for i in range(0, len(perm), B)]
        if len(out) > 1 and len(out[-1]) < 2:   # a 1-row batch has no in-batch negative: fold it in
            out[-2] = torch.cat([out[-2], out[-1]])
            out.pop()
        return out

    def _loss(self, idx: torch.Tensor):
        m, dev = self.model, self.model.device
        ex = [self.examples[i] for i in idx.tolist()]
        pos = torch.tensor([self.doc_row[e.positive] for e in ex])
        has_tw = [e.tw_negative is not None for e in ex]
        tw = torch.tensor([self.doc_row[e.tw_negative] if e.tw_negative is not None else self.doc_row[e.positive]
                           for e in ex])
        # rows of d_sem: the documents' (or, with passages, each example's chosen passages')
        prow, trow = (pos, tw) if self.ex_rows is None else (self.ex_rows[0][idx], self.ex_rows[1][idx])
        if self.cache:
            q_sem, d_sem = self.q_sem[idx].to(dev), self.d_sem[prow].to(dev)
            t_sem = self.d_sem[trow].to(dev)
        else:
            q_sem = m.semantic([self.qtexts[i] for i in idx.tolist()], grad=True)
            d_sem = m.semantic([self.dtexts[i] for i in prow.tolist()], grad=True)
            t_sem = m.semantic([self.dtexts[i] for i in trow.tolist()], grad=True) if any(has_tw) else None
        q = m.fuse(q_sem, self.qv[idx].to(dev), self.qm[idx].to(dev), self.qve[idx].to(dev), self.qme[idx].to(dev))
        d = m.fuse(d_sem, *self._doc_times(pos, idx, 0, dev))
        lh, lt = self.cfg.loss_weights()
        d_tw = None
        need_tw = (lt > 0 or self.cfg.tw_in_nce) and any(has_tw)
        if need_tw:
            d_tw = m.fuse(t_sem, *self._doc_times(tw, idx, 1, dev))
        doc_ids = pos.to(dev)
        extra = None
        if need_tw and not all(has_tw):
            # Re3Loss takes a d_tw for every row; rows without a time-wrong negative get their term here:
            # (λ_tw / B) Σ_{rows with d_tw} max(0, δ + <q, d_tw> - <q, d+>) (rows without one add 0)
            sel = torch.tensor(has_tw, device=dev)
            hinge = torch.relu(self.cfg.margin + (q * d_tw).sum(-1) - (q * d).sum(-1))
            extra = lt * (hinge * sel).sum() / len(ex)
            d_tw = None
        loss, parts = self.loss_fn(q, d, d_tw, doc_ids)
        if extra is not None:
            loss = loss + extra
            parts = dict(parts)
            parts["tw"] = (extra / lt).detach() if lt > 0 else extra.detach()
            parts["total"] = loss.detach()
        return loss, parts

    def fit(self, *, resume: bool = False, resume_anyway: bool = False) -> Re3Result:
        cfg, m = self.cfg, self.model
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        t_start = time.time()
        if resume and self.out is not None and (self.out / "last" / _resume.STATE_FILE).exists():
            # settings and data checked before any encoding (tempokern.training.resume)
            saved = _resume.read_state_dir(self.out / "last")
            _resume.check_resume(self.out / "last" / _resume.STATE_FILE, saved, cfg, self._fingerprint(),
                                 anyway=resume_anyway, log=self.log)
            for note in _resume.mutable_notes(saved["config"], asdict(cfg)):
                self.log(f"re3: resume: {note}")
        years = self._prepare()
        if getattr(m, "parser", None) is not None and not m.parser_fitted and not resume:
            # the learned parser first, on the training texts' silver labels (the times just resolved)
            texts = self.dtexts + self.qtexts
            times = [ivs[0][0] if ivs else None for ivs in self.dtimes + self.qtimes]
            fit_time_parser(m, texts, times=times, epochs=cfg.parser_epochs, lr=cfg.parser_lr,
                            batch_size=cfg.encode_batch_size, seed=cfg.seed, log=self.log)
        if (getattr(m, "parser", None) is not None and m.parser_fitted and cfg.film_times == "model"
                and self.ex_times is None and self.variant["train"]):
            self._use_model_times()
        if not self.variant["train"]:
            if cfg.fit_year_stats and years:
                m.time_embed.set_year_stats(years)
            if self.out is not None:
                m.save(self.out / "model")
            return Re3Result(0, [], None, time.time() - t_start, 0.0, 0.0, len(self.examples))
        if cfg.fit_year_stats and years and not resume:
            m.time_embed.set_year_stats(years)
        self.cache = m.freeze_backbone
        enc_s = 0.0
        if self.cache:
            enc_s = self._encode_cache()
            self.log(f"re3: encoded {len(self.dtexts)} documents and {len(self.qtexts)} queries once in {enc_s:.1f} s")
        params = [p for p in m.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=cfg.effective_lr)
        nb = len(self._batches(0))
        total = nb * cfg.epochs
        if cfg.max_steps is not None:
            total = min(total, cfg.max_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _linear_warmup(max(total, 1), int(cfg.warmup_ratio * total)))
        start_epoch, step, history, skip = 0, 0, [], 0
        if resume:
            if self.out is None:
                raise ValueError("resume needs the output directory of the interrupted run (out_dir)")
            st_file = self.out / "last" / _resume.STATE_FILE
            if not st_file.exists():
                raise FileNotFoundError(f"cannot resume: {st_file} does not exist")
            st = _resume.read_state_dir(st_file.parent)   # checksum manifest, then weights_only=True (checked above)
            if st.get("variant") != cfg.variant:
                raise ValueError(f"cannot resume: {st_file} is a {st.get('variant')!r} run, this is {cfg.variant!r}")
            missing, unexpected = m.load_state_dict(st["model"], strict=False)
            if unexpected or any(k in st["model"] for k in missing):
                raise ValueError(f"{st_file} does not fit the model: unexpected {sorted(unexpected)[:8]}")
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
            start_epoch, skip = (st["epoch"] + 1, 0) if st["epoch_done"] else (st["epoch"], st["batch"])
            step, history = st["step"], st["history"]
            _resume.set_rng_state(st["rng"])
            _resume.truncate_log(self.out / "log.jsonl", step)
            self.log(f"re3: resumed from {st_file.parent} at epoch {start_epoch} (0-based), batch {skip}, step {step}")
        logf = None
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            logf = open(self.out / "log.jsonl", "a")
        # epoch selection on a dev set (dev_eval): epoch 0 is the model before training
        dev = {"history": [], "best_epoch": None, "best": None, "state": None}
        if resume and st.get("dev"):
            dev = st["dev"]

        def dev_step(epoch):
            if self.dev_eval is None:
                return
            was = m.training
            m.eval()
            try:
                v = float(self.dev_eval(m))
            finally:
                m.train(was)
            dev["history"].append({"epoch": epoch, "dev": v})
            better = dev["best"] is None or v > dev["best"]
            if better:
                dev.update(best=v, best_epoch=epoch, state=_trainable_state(m))
            self.log(f"re3: dev {v:.4f} after epoch {epoch}" + (" (best so far)" if better else ""))
            if logf:
                logf.write(json.dumps({"event": "dev", "epoch": epoch, "dev": v, "best_epoch": dev["best_epoch"]}) + "\n")
                logf.flush()

        if not dev["history"]:
            dev_step(0)
        m.train()
        t0 = time.time()
        last_loss = None
        threads = torch.get_num_threads()
        if self.cache and cfg.cached_threads is not None:
            torch.set_num_threads(cfg.cached_threads)
        try:
            for epoch in range(start_epoch, cfg.epochs):
                if cfg.max_steps is not None and step >= cfg.max_steps:
                    break
                batches = self._batches(epoch)
                start_bi, skip = skip, 0   # batches of this epoch done before a mid-epoch resume
                bar = _progress(batches[start_bi:], cfg.progress, f"re3 {cfg.variant} epoch {epoch + 1}/{cfg.epochs}")
                done = start_bi
                for done, idx in enumerate(bar, start=start_bi + 1):
                    loss, parts = self._loss(idx)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if cfg.max_grad_norm:
                        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                    opt.step()
                    sched.step()
                    step += 1
                    last_loss = float(loss.detach())
                    rec = {"event": "step", "variant": cfg.variant, "epoch": epoch, "step": step, "loss": last_loss,
                           **{f"loss_{k}": float(v) for k, v in parts.items()
                              if k in ("nce", "hard", "tw") and torch.is_tensor(v) and v.numel() == 1},
                           "alpha": float(m.film.alpha.detach()), "lr": sched.get_last_lr()[0],
                           "seconds": round(time.time() - t0, 3)}
                    history.append(rec)
                    if logf:
                        logf.write(json.dumps(rec) + "\n")
                        logf.flush()
                    if hasattr(bar, "set_postfix"):
                        bar.set_postfix(loss=f"{last_loss:.4f}")
                    if cfg.max_steps is not None and step >= cfg.max_steps:
                        break
                    if cfg.save_every and step % cfg.save_every == 0 and done < len(batches) and self.out is not None:
                        self._save_state(opt, sched, epoch, done, False, step, history, dev)
                dev_step(epoch + 1)
                if self.out is not None:
                    self._save_state(opt, sched, epoch, done, done >= len(batches), step, history, dev)
                if cfg.stop_after_epochs is not None and epoch + 1 - start_epoch >= cfg.stop_after_epochs:
                    break
        finally:
            torch.set_num_threads(threads)
            if logf:
                logf.close()
        if dev["state"] is not None:
            m.load_state_dict(dev["state"], strict=False)
            self.log(f"re3: kept the weights of epoch {dev['best_epoch']} (dev {dev['best']:.4f}; epoch 0 = untrained)")
        m.eval()
        train_s = time.time() - t0
        if self.out is not None:
            m.save(self.out / "model")
        return Re3Result(step, history, last_loss, time.time() - t_start, enc_s, train_s, len(self.examples),
                         [dict(h) for h in dev["history"]], dev["best_epoch"])

    def _fingerprint(self) -> dict:
        """The documents, training examples and tokenizer vocabulary this run trains on (computed once)."""
        if getattr(self, "_data_fp", None) is None:
            self._data_fp = _resume.data_fingerprint(
                getattr(self.model, "tokenizer", None), examples=self.examples,
                docs=sorted(((str(k), v) for k, v in self.docs.items()), key=lambda x: x[0]))
        return self._data_fp

    def _save_state(self, opt, sched, epoch, batch, epoch_done, step, history, dev) -> None:
        """last/: the trainable weights and the trainer state under one checksum manifest."""
        _resume.save_state_dir(self.out / "last", {
            "variant": self.cfg.variant, "model": _trainable_state(self.model), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "epoch": epoch, "batch": batch, "epoch_done": epoch_done,
            "step": step, "history": history, "rng": _resume.rng_state(), "config": asdict(self.cfg),
            "data": self._fingerprint(), "dev": dev})


def _as_doc(k, v) -> Re3Doc:
    if isinstance(v, Re3Doc):
        return v
    if isinstance(v, str):
        return Re3Doc(v)
    if isinstance(v, (tuple, list)):
        return Re3Doc(*v)
    if hasattr(v, "text"):
        return Re3Doc(v.text, getattr(v, "published", None))
    raise TypeError(f"docs[{k!r}]: expected Re3Doc, (text, published) or text, got {type(v).__name__}")


def build_re3_model(backbone, config: Optional[Re3Config] = None, **kw):
    """A :class:`Re3Encoder` set up for ``config.variant`` (LoRA for ``lora``; frozen otherwise)."""
    cfg = (config or Re3Config()).validate()
    v = VARIANTS[cfg.variant]
    lora = None
    if v["lora"]:
        lora = {"r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout}
    kw.setdefault("temperature", cfg.temperature)
    return Re3Encoder(backbone, freeze_backbone=cfg.freeze_backbone and not v["lora"], lora=lora,
                      use_time=v["use_time"], **kw)


def train_re3(model, docs, examples, config: Optional[Re3Config] = None, out_dir=None, *, resume: bool = False,
              resume_anyway: bool = False, loss_fn=None, log: Callable = print,
              dev_eval: Optional[Callable] = None) -> Re3Result:
    """Train a Re3Encoder's time modules (frozen backbone: on cached ``e_sem``) or its LoRA backbone.

    ``dev_eval``: ``model -> float`` (higher is better; e.g. :func:`dev_scorer` on groups set apart from the
    training data by :func:`dev_groups`), evaluated before training (epoch 0) and after every epoch; the
    trainable weights of the best epoch (the earliest on a tie, so the untrained model when no epoch beats
    it) are kept at the end. Without it the last epoch's weights are kept."""
    return Re3Trainer(model, docs, examples, config, out_dir, loss_fn=loss_fn, log=log,
                      dev_eval=dev_eval).fit(resume=resume, resume_anyway=resume_anyway)


# ---- evaluation ---------------------------------------------------------------------------------------------
def _error_kind(top: Mapping, gold: Mapping) -> str:
    if not top or not gold:
        return "other"
    same_e = top.get("entity") == gold.get("entity")
    same_a = top.get("attribute") == gold.get("attribute")
    same_t = top.get("date") == gold.get("date")
    if same_e and same_a and not same_t:
        return "time_wrong"
    if same_a and not same_e:
        return "entity_wrong"
    if same_e and not same_a:
        return "attribute_wrong"
    return "other"


#: what a query without an observed time is scored with (re3_runs(no_time=...))
NO_TIME = ("base", "film")


@torch.no_grad()
def re3_runs(model, dataset, splits: Sequence[str], *, depth: int = 100, batch_size: int = 64,
             gallery_emb: Optional[torch.Tensor] = None, base: bool = False,
             no_time: str = "base") -> Dict[str, Dict[str, Dict[str, float]]]:
    """``{split: {qid: {doc id: score}}}`` (top ``depth`` over the whole gallery, exact ``ctd_topk``).
    Documents are encoded as ``role="document"`` with their ``published`` dates; queries with
    ``meta["query_time"]`` as the reference date. ``base=True``: the base retriever (no time modules).

    ``no_time``: how a query without an observed time is scored. ``"base"`` (default): with the base
    relevance score, ``<normalize(e_sem(q)), normalize(e_sem(d))>`` over the gallery's base embeddings, so
    such a query ranks exactly as with the frozen base retriever (a time-less query carries no time signal
    for the FiLM-modulated gallery to use, and would otherwise be scored against time-shifted document
    vectors). ``"film"``: its (time-less) ``e_final`` against the time-conditioned gallery.
    ``model.multi_time`` (the multi-time extension): each document scores by its best-matching time
    vector (:meth:`Re3Encoder.score_multi`; ``gallery_emb`` is then ignored)."""
    if no_time not in NO_TIME:
        raise ValueError(f"no_time must be one of {NO_TIME}, got {no_time!r}")
    recs = dataset.records
    texts_g = [r.text for r in recs]
    pub_g = [r.published for r in recs]
    multi = (bool(getattr(model, "multi_time", False)) or getattr(model, "passages", None) is not None) and not base
    g_multi = None
    if multi:
        g_multi = model.encode_multi(texts_g, pub=pub_g, role="document", batch_size=batch_size)
    elif gallery_emb is None:
        gallery_emb = (model.base_embeddings(texts_g, batch_size=batch_size) if base else
                       model.encode(texts_g, pub=pub_g, role="document", batch_size=batch_size))
    g_base = None
    k = min(depth, len(recs))
    runs = {}
    for split in splits:
        qs = dataset.queries_in(split)
        if not qs:
            runs[split] = {}
            continue
        texts = [q.text for q in qs]
        pubs = [(q.meta or {}).get("query_time") for q in qs]
        if base:
            qe = model.base_embeddings(texts, batch_size=batch_size)
            vals, idx = ctd_topk(qe, gallery_emb, k)
        else:
            qe = model.encode(texts, pub=pubs, role="query", batch_size=batch_size)
            if multi:
                vals, idx = model.score_multi(qe, *g_multi, len(recs)).topk(k, dim=1)
            else:
                vals, idx = ctd_topk(qe, gallery_emb, k)
            timeless = [i for i, h in enumerate(model.has_time(texts, pub=pubs, role="query")) if not h]
            if no_time == "base" and timeless:
                if g_base is None:
                    g_base = model.base_embeddings(texts_g, batch_size=batch_size)
                qb = model.base_embeddings([texts[i] for i in timeless], batch_size=batch_size)
                bv, bi = ctd_topk(qb, g_base, k)
                vals, idx = vals.clone(), idx.clone()
                rows = torch.tensor(timeless)
                vals[rows], idx[rows] = bv.to(vals.dtype), bi.to(idx.dtype)
        runs[split] = {q.id: {recs[j].id: float(s) for s, j in zip(vr.tolist(), ir.tolist()) if j >= 0}
                       for q, vr, ir in zip(qs, vals, idx)}
    return runs


def re3_eval(dataset, runs: Mapping[str, Mapping[str, Mapping[str, float]]]) -> Dict[str, dict]:
    """Per split: R@1, R@5, MRR (``tempokern.eval.re3_metrics``), MRR@10 and nDCG@10 (as the other methods'
    evaluations report them, ``tempokern.eval.metrics.per_query_metrics``) and the top-1 error split — the share of
    queries whose top-1 document is wrong and has the gold's entity and attribute at another date
    (``err_time_wrong``), another entity with the gold's attribute (``err_entity_wrong``), the gold's
    entity with another attribute (``err_attribute_wrong``) or anything else (``err_other``); from
    record ``meta`` ``entity`` / ``attribute`` / ``date``."""
    by_id = {r.id: r for r in dataset.records}
    qby = {q.id: q for q in dataset.queries}
    out = {}
    for split, run in runs.items():
        qrels = {qid: {d: qby[qid].gold[d] for d in qby[qid].relevant_ids()} for qid in run if qby[qid].relevant_ids()}
        if not qrels:
            continue
        row = dict(re3_metrics({q: dict(s) for q, s in run.items()}, qrels, ks=(1, 5)))
        per = [per_query_metrics(rank_documents(run.get(qid) or {}), set(gold), ks=(1,))
               for qid, gold in qrels.items()]
        row.update({m: sum(p[m] for p in per) / len(per) for m in ("MRR@10", "nDCG@10")})
        errs = {"time_wrong": 0, "entity_wrong": 0, "attribute_wrong": 0, "other": 0}
        for qid, gold in qrels.items():
            scores = run.get(qid) or {}
            if not scores:
                errs["other"] += 1
                continue
            top = max(scores, key=lambda d: scores[d])
            if gold.get(top, 0) > 0:
                continue
            g = max(gold, key=lambda d: gold[d])
            errs[_error_kind(by_id[top].meta, by_id[g].meta)] += 1
        n = max(len(qrels), 1)
        row.update({f"err_{k}": v / n for k, v in errs.items()})
        out[split] = row
    return out


__all__ = ["Re3Config", "Re3Example", "Re3Doc", "Re3Result", "Re3Trainer", "VARIANTS", "train_re3",
           "build_re3_model", "examples_from_synth", "examples_from_dataset", "docs_from_dataset", "re3_runs",
           "re3_eval", "fit_time_parser", "NO_TIME", "FILM_TIMES", "time_wrong_twins", "dev_groups", "dev_scorer"]
