"""Re3Encoder: a (by default frozen) transformers backbone + Re³'s time embedding and FiLM fusion.

``e_final = normalize((1 + α γ) ⊙ e_sem + β)``, ``(γ, β) = MLP_proj(TimeEmbedding(parse(text)))`` (Re³
Eqs. 4-9). Scores are plain inner products of ``e_final``, so ``tempokern.ctd_topk`` and
``TemporalIndex`` serve the model unchanged. With every time part unobserved the embedding is exactly the
frozen backbone's normalised pooled vector (B2) — :meth:`Re3Encoder.base_embeddings` computes that one
without the time modules, for comparison.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._files import tmp_prefix
from ..limits import cap_texts
from .._util import sha256_file
from ..nn.film import FiLM, TimeEmbedding
from ..search import TemporalIndex
from ..nn.film import YEAR_ENCODINGS, YEAR_PERIODS
from ..text.time import TimeTuple, date_passages, find_times, parse_time
from .time_heads import TimeParserHeads
from .encoder import POOLINGS, ROLES, _field, check_role, pool  # noqa: F401  (ROLES: part of the API here)
from ._batching import progress as _progress
from .checkpoint import CheckpointError, check_save_target, file_digest, finish_checkpoint, recover_dir, require_keys, verify_checkpoint

DOC_TIMES = ("content", "published", "content_or_published")
TIME_PARSERS = ("rules", "learned")
RANGES = ("interval", "start")
#: how a document is cut before encoding: None (the whole text, the paper) or "date_windows" (one passage per date)
PASSAGES = (None, "date_windows")
FORMAT = "tempokern-re3-encoder"
VERSION = 1
CONFIG_FILE = "tempokern_re3.json"
TIME_FILE = "time_modules.safetensors"
BACKBONE_FILE = "backbone.safetensors"
TOKENIZER_DIR = "tokenizer"
_BACKBONE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")




def backbone_checksum(path) -> str:
    """sha256 over the weight file(s) of a transformers model directory (``model.safetensors`` or
    ``pytorch_model.bin``; sharded: every ``*.safetensors`` in name order)."""
    path = Path(path)
    files = [path / n for n in _BACKBONE_WEIGHTS if (path / n).exists()][:1]
    if not files:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model weights (model.safetensors / pytorch_model.bin) under {path}")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def _as_date(x, what: str):
    if x is None:
        return None
    if isinstance(x, _dt.datetime):
        return x.date()
    if isinstance(x, _dt.date):
        return x
    if isinstance(x, str):
        try:
            return _dt.date.fromisoformat(x[:10])
        except ValueError:
            raise ValueError(f"{what}: {x!r} is not an ISO date") from None
    raise TypeError(f"{what}: expected datetime.date, ISO string or None, got {type(x).__name__}")


def _check_time_args(n: int, role, doc_time, pub, times):
    """The shared checks of resolve_times / resolve_intervals: role and doc_time among their choices, pub (dates)
    and times with one entry per text. Returns (pub as dates or None, times as a list or None)."""
    check_role(role)
    if doc_time not in DOC_TIMES:
        raise ValueError(f"doc_time must be one of {DOC_TIMES}, got {doc_time!r}")
    if pub is not None:
        pub = list(pub)
        if len(pub) != n:
            raise ValueError(f"pub: expected {n} dates (one per text), got {len(pub)}")
        pub = [_as_date(p, f"pub[{i}]") for i, p in enumerate(pub)]
    if times is not None:
        times = list(times)
        if len(times) != n:
            raise ValueError(f"times: expected {n} entries (one per text), got {len(times)}")
    return pub, times


def resolve_times(texts: Sequence[str], *, times=None, pub=None, role: str = "query",
                  doc_time: str = "content") -> List[Optional[TimeTuple]]:
    """One ``TimeTuple | None`` per text.

    ``times`` given (a list of ``TimeTuple`` / ``datetime.date`` / ISO string / None): used as they are.
    Otherwise each text is parsed with :func:`tempokern.text.parse_time`, relative dates resolved against
    ``pub[i]`` (publication date of a document, query time of a query). For ``role="document"``,
    ``doc_time`` picks the document time (B10): ``"content"`` (parsed from the text), ``"published"``
    (``pub`` itself), ``"content_or_published"`` (parsed, else ``pub``)."""
    n = len(texts)
    pub, times = _check_time_args(n, role, doc_time, pub, times)
    if times is not None:
        out = []
        for i, t in enumerate(times):
            if t is None or isinstance(t, TimeTuple):
                out.append(t)
            else:
                out.append(TimeTuple.from_date(_as_date(t, f"times[{i}]")))
        return out
    out = []
    for i, text in enumerate(texts):
        ref = pub[i] if pub is not None else None
        if role == "document" and doc_time == "published":
            out.append(TimeTuple.from_date(ref) if ref is not None else None)
            continue
        t = parse_time(text, ref=ref)
        if (t is None or t.is_empty) and role == "document" and doc_time == "content_or_published" and ref is not None:
            t = TimeTuple.from_date(ref)
        out.append(t)
    return out


def _as_time(x, what: str) -> Optional[TimeTuple]:
    if x is None or isinstance(x, TimeTuple):
        return x
    return TimeTuple.from_date(_as_date(x, what))


def _as_intervals(x, what: str) -> List[Tuple[TimeTuple, TimeTuple]]:
    """An explicit time entry as a list of (start, end): None -> []; a TimeTuple / date / ISO string -> one
    point; a (start, end) tuple -> one interval; a list of those -> several."""
    if x is None:
        return []
    if isinstance(x, tuple) and len(x) == 2 and not isinstance(x, TimeTuple):
        a, b = _as_time(x[0], what), _as_time(x[1], what)
        if a is None or a.is_empty:
            return []
        return [(a, b if b is not None and not b.is_empty else a)]
    if isinstance(x, list):
        return [iv for i, y in enumerate(x) for iv in _as_intervals(y, f"{what}[{i}]")]
    t = _as_time(x, what)
    return [] if t is None or t.is_empty else [(t, t)]


def resolve_intervals(texts: Sequence[str], *, times=None, pub=None, role: str = "query",
                      doc_time: str = "content", ranges: str = "interval", every: bool = False,
                      ) -> List[List[Tuple[TimeTuple, TimeTuple]]]:
    """Per text, its times as ``(start, end)`` intervals (``[]``: no time). Parsed with
    :func:`tempokern.text.find_times` (relative dates against ``pub[i]``): a range is its interval
    (``ranges="interval"``) or its start (``ranges="start"``); ``every=False`` keeps the first expression
    (Re³'s one time per text), ``every=True`` every expression (the multi-time extension). ``doc_time`` as
    in :func:`resolve_times`. ``times`` given: per text a TimeTuple / date / ISO string / None, a
    ``(start, end)`` pair, or a list of those (used as they are)."""
    n = len(texts)
    if ranges not in RANGES:
        raise ValueError(f"ranges must be one of {RANGES}, got {ranges!r}")
    pub, times = _check_time_args(n, role, doc_time, pub, times)
    if times is not None:
        out = [_as_intervals(t, f"times[{i}]") for i, t in enumerate(times)]
    else:
        out = []
        for i, text in enumerate(texts):
            ref = pub[i] if pub is not None else None
            if role == "document" and doc_time == "published":
                out.append([(TimeTuple.from_date(ref),) * 2] if ref is not None else [])
                continue
            ivs = [(sp.start, sp.end) for sp in find_times(text, ref=ref)]
            if not ivs and role == "document" and doc_time == "content_or_published" and ref is not None:
                ivs = [(TimeTuple.from_date(ref),) * 2]
            out.append(ivs)
    if ranges == "start":
        out = [[(a, a) for a, _ in ivs] for ivs in out]
    return out if every else [ivs[:1] for ivs in out]


def interval_batch(intervals: Sequence[Sequence[Tuple[TimeTuple, TimeTuple]]], device=None):
    """``(values, mask, end_values, end_mask)`` of the first interval of each entry (an empty entry: all
    masked), for :meth:`Re3Encoder.fuse`."""
    starts = [ivs[0][0] if ivs else None for ivs in intervals]
    ends = [ivs[0][1] if ivs else None for ivs in intervals]
    v, m = TimeTuple.batch(starts, device=device)
    ve, me = TimeTuple.batch(ends, device=device)
    return v, m, ve, me


class Re3Encoder(nn.Module):
    """Re³ dual encoder (shared for queries and documents).

    backbone: a transformers model directory (loaded offline with AutoModel/AutoTokenizer; kept as the
    reference a checkpoint points to) or a built ``PreTrainedModel`` (pass ``tokenizer=``).
    ``freeze_backbone=True`` (B1, default): the backbone never trains and stays in eval mode, so its
    embeddings can be cached (:meth:`semantic`). ``lora``: a ``peft.LoraConfig`` or a dict of its
    arguments (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``); wraps the backbone with
    peft (imported only then) — the paper's LoRA baseline. ``use_time=False`` turns the time path off
    (every time masked: the encoder is the backbone; the LoRA baseline). ``doc_time``: B10.

    ``time_parser``: ``"rules"`` (:func:`tempokern.text.find_times`) or ``"learned"`` (the paper's learned
    parser, §3.2: :class:`tempokern.models.time_heads.TimeParserHeads` on the backbone's [CLS] hidden state,
    year classes ``parser_years`` = (first, last); fitted by
    :func:`tempokern.training.re3.fit_time_parser` on silver labels, or by the Re3 trainer before the time
    modules; saved and loaded with the checkpoint). Times can also be given explicitly to :meth:`encode`.

    ``ranges``: ``"interval"`` (default) — a range (``2010-2015``, ``March 3-5, 2014``) is its interval, and
    its time embedding is the mean of its two ends' (``e_time = (E(start) + E(end)) / 2``; a single date is
    unchanged); ``"start"`` — a range is its start. ``multi_time`` (an extension, not in the paper, which
    predicts one time per text): a document is represented by one vector per temporal expression
    (:meth:`encode_multi`) and scored by its best-matching one (:meth:`score_multi`, the maximum over its
    vectors); a document without a time has one (time-less) vector. Queries keep one time. The Re3
    trainer trains a multi-time document with its time closest to the example's query (else its first).

    ``passages``: ``None`` (default, the paper: one vector per text) or ``"date_windows"`` (an option for
    long, many-dated documents such as TimeQA's Wikipedia paragraphs): a document is cut into one passage per
    date expression — the sentence holding it and ``passage_context`` sentences on either side
    (:func:`tempokern.text.time.date_passages`) — each encoded with its own ``e_sem`` and that one date, and
    the document scores by its best passage (:meth:`encode_multi` / :meth:`score_multi`); a document without
    a date is one time-less passage (the whole text). Needs ``time_parser="rules"`` (the passages are cut
    at the rule parser's expressions); not combined with ``multi_time``. The Re3 trainer trains each
    example's documents with their passage whose date is closest to the query's. :meth:`encode` keeps
    one whole-text vector per text.

    ``normalize_sem``: ``False`` (default) fuses the backbone's pooled vector as it is; ``True`` L2-normalises
    ``e_sem`` before FiLM (the paper's BGE-M3 embedding is normalised; a raw mean pool's norm varies
    several-fold across texts, and with it the weight of the additive time term β).
    ``year_encoding``: ``"scalar"`` (the paper) or ``"multiscale"`` (an extension), ``year_periods``:
    see :class:`tempokern.nn.TimeEmbedding`."""

    def __init__(self, backbone: Any, *, pooling: str = "cls", freeze_backbone: bool = True, lora: Any = None,
                 time_parser: str = "rules", doc_time: str = "content", tokenizer: Any = None,
                 max_length: int = 128, year_mean: float = 2000.0, year_std: float = 10.0,
                 film_hidden: Optional[int] = None, use_time: bool = True, temperature: float = 0.05,
                 parser_years: Tuple[int, int] = (1900, 2100), ranges: str = "interval", multi_time: bool = False,
                 parser_fitted: bool = False, passages: Optional[str] = None, passage_context: int = 1,
                 normalize_sem: bool = False, year_encoding: str = "scalar",
                 year_periods: Sequence[float] = YEAR_PERIODS):
        super().__init__()
        if passages not in PASSAGES:
            raise ValueError(f"passages must be one of {PASSAGES}, got {passages!r}")
        if passages is not None and time_parser != "rules":
            raise ValueError("passages='date_windows' needs time_parser='rules' (passages are cut at the rule "
                             "parser's date expressions)")
        if passages is not None and multi_time:
            raise ValueError("passages='date_windows' and multi_time=True are exclusive (both score a document "
                             "by its best time; passages also cut its text)")
        if isinstance(passage_context, bool) or not isinstance(passage_context, int) or passage_context < 0:
            raise ValueError(f"passage_context must be an int >= 0, got {passage_context!r}")
        if year_encoding not in YEAR_ENCODINGS:
            raise ValueError(f"year_encoding must be one of {YEAR_ENCODINGS}, got {year_encoding!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if doc_time not in DOC_TIMES:
            raise ValueError(f"doc_time must be one of {DOC_TIMES}, got {doc_time!r}")
        if time_parser not in TIME_PARSERS:
            raise ValueError(f"time_parser must be one of {TIME_PARSERS}, got {time_parser!r}")
        if ranges not in RANGES:
            raise ValueError(f"ranges must be one of {RANGES}, got {ranges!r}")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.backbone_path: Optional[str] = None
        if isinstance(backbone, (str, Path)):
            from transformers import AutoModel, AutoTokenizer
            self.backbone_path = str(Path(backbone).resolve()) if Path(backbone).exists() else str(backbone)
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(str(backbone))
            backbone = AutoModel.from_pretrained(str(backbone))
        if not isinstance(backbone, nn.Module) or not hasattr(backbone, "config"):
            raise TypeError("backbone must be a transformers model directory or a PreTrainedModel, "
                            f"got {type(backbone).__name__}")
        self.tokenizer = tokenizer
        self.pooling, self.doc_time, self.time_parser = pooling, doc_time, time_parser
        self.max_length, self.temperature, self.use_time = max_length, float(temperature), bool(use_time)
        self.freeze_backbone = bool(freeze_backbone) and lora is None
        self.lora_config = None
        self.lora_merged = False
        H = int(backbone.config.hidden_size)
        self.hidden_size = H
        if lora is not None:
            backbone = self._wrap_lora(backbone, lora)
        self.backbone = backbone
        if self.freeze_backbone:
            for p in self.backbone.parameters():
                p.requires_grad_(False)
            self.backbone.eval()
        self.time_embed = TimeEmbedding(H, year_mean=year_mean, year_std=year_std, year_encoding=year_encoding,
                                        year_periods=year_periods)
        self.passages, self.passage_context = passages, int(passage_context)
        self.normalize_sem = bool(normalize_sem)
        self.film = FiLM(H, hidden=film_hidden)
        self.ranges, self.multi_time = ranges, bool(multi_time)
        self.parser = None
        self.parser_fitted = bool(parser_fitted)
        if time_parser == "learned":
            y0, y1 = (int(y) for y in parser_years)
            self.parser = TimeParserHeads(H, first_year=y0, last_year=y1)
        self._backbone_sha = None
        self._sem_cache = None

    # ---- LoRA ---------------------------------------------------------------------------------------------
    def _wrap_lora(self, backbone, lora):
        try:
            import peft
        except ImportError as e:  # pragma: no cover - optional dependency
            raise ImportError("Re3Encoder(lora=...) needs the 'peft' package (pip install tempokern[peft])") from e
        if isinstance(lora, dict):
            args = {"r": 16, "lora_alpha": 64, "lora_dropout": 0.1, "target_modules": "all-linear"}
            args.update(lora)
            cfg = peft.LoraConfig(**args)
        elif isinstance(lora, peft.LoraConfig):
            cfg = lora
        else:
            raise TypeError(f"lora must be a peft.LoraConfig or a dict of its arguments, got {type(lora).__name__}")
        self.lora_config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.to_dict().items()
                            if k in ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora")}
        return peft.get_peft_model(backbone, cfg)

    def _plain_backbone(self):
        """The backbone as a plain transformers model (LoRA merged into a copy when present)."""
        if self.lora_config is None:
            return self.backbone
        import copy
        return copy.deepcopy(self.backbone).merge_and_unload()

    # ---- modes --------------------------------------------------------------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        if self.freeze_backbone:
            self.backbone.eval()
        return self

    @property
    def device(self) -> torch.device:
        return self.film.alpha.device

    def time_parameters(self) -> List[nn.Parameter]:
        """The time embedding's and FiLM's parameters (the parser heads train separately)."""
        return list(self.time_embed.parameters()) + list(self.film.parameters())

    def config_dict(self) -> dict:
        return {"pooling": self.pooling, "doc_time": self.doc_time, "time_parser": self.time_parser,
                "max_length": self.max_length, "temperature": self.temperature, "use_time": self.use_time,
                "film_hidden": self.film.hidden, "freeze_backbone": self.freeze_backbone,
                "year_mean": float(self.time_embed.year_mean), "year_std": float(self.time_embed.year_std),
                "ranges": self.ranges, "multi_time": self.multi_time,
                # options beside the paper's defaults: recorded only when set, so older checkpoints read alike
                **({"passages": self.passages, "passage_context": self.passage_context} if self.passages else {}),
                **({"normalize_sem": True} if self.normalize_sem else {}),
                **({"year_encoding": self.time_embed.year_encoding,
                    "year_periods": list(self.time_embed.year_periods)}
                   if self.time_embed.year_encoding != "scalar" else {}),
                **({"parser_years": [self.parser.first_year, self.parser.last_year],
                    "parser_fitted": self.parser_fitted} if self.parser is not None else {}),
                "lora": self.lora_config}

    # ---- tensors ------------------------------------------------------------------------------------------
    def semantic_from_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``e_sem``: the backbone's pooled vector (B, H), not normalised."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return pool(hidden, attention_mask, self.pooling)

    def fuse(self, e_sem: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
             end_values: Optional[torch.Tensor] = None, end_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``e_final`` (B, H) from cached/computed ``e_sem`` and the batched times (see
        ``TimeTuple.batch``; ``normalize_sem``: ``e_sem`` L2-normalised first). ``end_values`` / ``end_mask``: the
        ends of intervals (``ranges="interval"``):
        ``e_time = (E(start) + E(end)) / 2`` (exactly ``E(start)`` where the end equals the start). With
        ``use_time=False`` the times are ignored (all masked)."""
        if not self.use_time:
            mask = torch.zeros_like(mask)
            end_mask = None if end_mask is None else torch.zeros_like(end_mask)
        if self.normalize_sem:
            e_sem = F.normalize(e_sem, dim=-1)
        e_time = self.time_embed(values, mask)
        if end_values is not None:
            e_time = (e_time + self.time_embed(end_values, end_mask)) / 2
        return self.film(e_sem, e_time.to(e_sem.dtype))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        return self.fuse(self.semantic_from_ids(input_ids, attention_mask), values, mask)

    # ---- text API -----------------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> dict:
        if self.tokenizer is None:
            raise ValueError("this Re3Encoder has no tokenizer: pass tokenizer= when building it from a model")
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a list of strings")
        enc = self.tokenizer(cap_texts(texts), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    def enable_semantic_cache(self, cache: Optional[dict] = None) -> dict:
        """Keep ``e_sem`` per text (CPU float32) so a text meets the frozen backbone once: the trainer's
        encoding pass, the gallery and the queries of an evaluation share it; pass the same ``cache`` dict
        to several encoders on the same backbone (e.g. the base / film / film_margins rows). Only with a
        frozen backbone (its ``e_sem`` never changes)."""
        if not self.freeze_backbone:
            raise ValueError("the semantic cache needs a frozen backbone (e_sem changes while LoRA trains)")
        self._sem_cache = {} if cache is None else cache
        return self._sem_cache

    def disable_semantic_cache(self) -> None:
        self._sem_cache = None

    def semantic(self, texts: Sequence[str], *, batch_size: int = 64, grad: bool = False,
                 progress=None) -> torch.Tensor:
        """``e_sem`` (N, H) for a list of texts (no gradient unless ``grad``). Without gradient the texts are
        encoded in batches of similar length (less padding) and, with :meth:`enable_semantic_cache`, each
        distinct text once."""
        dev = self.device
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings")
        texts = list(texts)
        if grad:
            outs = [self.semantic_from_ids(**{k: v.to(dev) for k, v in self.tokenize(texts[i:i + batch_size]).items()})
                    for i in range(0, len(texts), batch_size)]
            return torch.cat(outs) if outs else torch.empty(0, self.hidden_size, device=dev)
        cache = getattr(self, "_sem_cache", None)
        todo = list(dict.fromkeys(t for t in texts if cache is None or t not in cache))
        todo.sort(key=len)
        rows = {}
        it = range(0, len(todo), batch_size)
        if progress is not None:
            it = progress(it)
        else:   # the command line's progress setting (tempokern.models._batching.set_progress)
            it = _progress(it, len(it), "encode")
        with torch.no_grad():
            for i in it:
                chunk = todo[i:i + batch_size]
                e = self.semantic_from_ids(**{k: v.to(dev) for k, v in self.tokenize(chunk).items()})
                for t, row in zip(chunk, e):
                    rows[t] = row
        if cache is not None:
            for t, row in rows.items():
                cache[t] = row.detach().float().cpu()
            src = cache
        else:
            src = rows
        if not texts:
            return torch.empty(0, self.hidden_size, device=dev)
        dtype = self.film.alpha.dtype
        return torch.stack([src[t] for t in texts]).to(dev, dtype)

    def times(self, texts: Sequence[str], *, times=None, pub=None, role: str = "query"):
        """Batched ``(values (N, 4), mask (N, 4))`` of each text's first time's start (see
        :meth:`intervals`)."""
        v, m, _, _ = interval_batch(self.intervals(texts, times=times, pub=pub, role=role), device=self.device)
        return v, m

    def intervals(self, texts: Sequence[str], *, times=None, pub=None, role: str = "query",
                  every: bool = False, batch_size: int = 64) -> List[List[Tuple[TimeTuple, TimeTuple]]]:
        """Per text, its times as ``(start, end)`` intervals: explicit ``times``, else the rule parser
        (:func:`resolve_intervals`, with this encoder's ``doc_time`` and ``ranges``) or the learned parser
        (one point per text from :meth:`parse_learned`; ``doc_time="published"`` / ``"content_or_published"``
        use ``pub`` as with the rules). ``every``: every expression (multi-time), else the first."""
        if times is not None or self.time_parser == "rules":
            return resolve_intervals(texts, times=times, pub=pub, role=role, doc_time=self.doc_time,
                                     ranges=self.ranges, every=every)
        n = len(texts)
        pubs = [None] * n if pub is None else [_as_date(p, f"pub[{i}]") for i, p in enumerate(pub)]
        if len(pubs) != n:
            raise ValueError(f"pub: expected {n} dates (one per text), got {len(pubs)}")
        if role == "document" and self.doc_time == "published":
            return [[(TimeTuple.from_date(p),) * 2] if p is not None else [] for p in pubs]
        pred = self.parse_learned(texts, batch_size=batch_size)
        out = []
        for t, p in zip(pred, pubs):
            if t.is_empty and role == "document" and self.doc_time == "content_or_published" and p is not None:
                t = TimeTuple.from_date(p)
            out.append([] if t.is_empty else [(t, t)])
        return out

    @torch.no_grad()
    def cls_states(self, texts: Sequence[str], *, batch_size: int = 64) -> torch.Tensor:
        """The backbone's [CLS] (first-token) hidden state per text (N, H): the learned parser's input."""
        outs = []
        was = self.backbone.training
        self.backbone.eval()
        try:
            for i in range(0, len(texts), batch_size):
                enc = {k: v.to(self.device) for k, v in self.tokenize(list(texts[i:i + batch_size])).items()}
                out = self.backbone(**enc)
                hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
                outs.append(hidden[:, 0].float())
        finally:
            self.backbone.train(was)
        return torch.cat(outs) if outs else torch.empty(0, self.hidden_size, device=self.device)

    @torch.no_grad()
    def parse_learned(self, texts: Sequence[str], *, batch_size: int = 64) -> List[TimeTuple]:
        """The learned parser's time per text (:meth:`TimeParserHeads.predict` on :meth:`cls_states`)."""
        if self.parser is None:
            raise ValueError("this Re3Encoder has no learned parser (build it with time_parser='learned')")
        if not texts:
            return []
        h = self.cls_states(texts, batch_size=batch_size)
        return self.parser.predict(h.to(self.parser.presence.weight.dtype))

    def has_time(self, texts: Sequence[str], *, times=None, pub=None, role: str = "query") -> List[bool]:
        """Whether each text has an observed time (what :meth:`encode` conditions on)."""
        return [bool(ivs) and self.use_time for ivs in self.intervals(texts, times=times, pub=pub, role=role)]

    @torch.no_grad()
    def encode(self, texts: Sequence[str], *, times=None, pub=None, role: str = "query",
               batch_size: int = 64) -> torch.Tensor:
        """``e_final`` (N, H) float32, in eval mode. ``times``: explicit times (else parsed from the texts,
        relative dates against ``pub``); ``role="document"`` applies ``doc_time``."""
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings")
        was = self.training
        self.eval()
        try:
            ivs = self.intervals(texts, times=times, pub=pub, role=role, batch_size=batch_size)
            v, m, ve, me = interval_batch(ivs, device=self.device)
            e_sem = self.semantic(texts, batch_size=batch_size)
            return self.fuse(e_sem, v, m, ve, me).float().cpu()
        finally:
            self.train(was)

    @torch.no_grad()
    def encode_multi(self, texts: Sequence[str], *, times=None, pub=None, role: str = "document",
                     batch_size: int = 64) -> Tuple[torch.Tensor, torch.Tensor]:
        """The multi-time extension: ``(emb (M, H), owner (M,) int64)`` — one ``e_final`` per (text, time
        expression) with its interval, and one time-less vector for a text without a time; ``owner[k]`` is
        the text of row k. Score with :meth:`score_multi`. With ``passages="date_windows"``: one ``e_final``
        per passage (its own text and date, :meth:`passages_of`)."""
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings")
        was = self.training
        self.eval()
        try:
            if self.passages is not None and times is None:
                per = self.passages_of(texts, pub=pub, role=role)
                owner = torch.tensor([i for i, ps in enumerate(per) for _ in ps], dtype=torch.int64)
                flat = [p for ps in per for p in ps]
                e_sem = self.semantic([t for t, _ in flat], batch_size=batch_size)
                v, m, ve, me = interval_batch([ivs for _, ivs in flat], device=self.device)
                return self.fuse(e_sem, v, m, ve, me).float().cpu(), owner
            ivs = self.intervals(texts, times=times, pub=pub, role=role, every=True, batch_size=batch_size)
            e_sem = self.semantic(texts, batch_size=batch_size)
            owner = torch.tensor([i for i, x in enumerate(ivs) for _ in range(max(1, len(x)))], dtype=torch.int64)
            flat = [[iv] for x in ivs for iv in (x if x else [None])]
            flat = [[] if f == [None] else f for f in flat]
            v, m, ve, me = interval_batch(flat, device=self.device)
            emb = self.fuse(e_sem[owner.to(e_sem.device)], v, m, ve, me).float().cpu()
            return emb, owner
        finally:
            self.train(was)

    def passages_of(self, texts: Sequence[str], *, pub=None, role: str = "document"
                    ) -> List[List[Tuple[str, List[Tuple[TimeTuple, TimeTuple]]]]]:
        """Per text, its passages as ``(passage text, [(start, end)] or [])`` (``passages="date_windows"``:
        :func:`tempokern.text.time.date_passages` with ``passage_context``, dates resolved against ``pub``;
        ``ranges="start"`` reads a range as its start). A query (``role="query"``) or an encoder without
        passages: the text itself with its first time. ``doc_time="published"`` / ``"content_or_published"``:
        a document without a date in its text is dated by ``pub``."""
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings")
        texts = list(texts)
        if self.passages is None or role != "document":
            return [[(t, ivs)] for t, ivs in zip(texts, self.intervals(texts, pub=pub, role=role))]
        pubs = [None] * len(texts) if pub is None else [_as_date(p, f"pub[{i}]") for i, p in enumerate(pub)]
        if len(pubs) != len(texts):
            raise ValueError(f"pub: expected {len(texts)} dates (one per text), got {len(pubs)}")
        out = []
        for t, p in zip(texts, pubs):
            if self.doc_time == "published":
                out.append([(t, [(TimeTuple.from_date(p),) * 2] if p is not None else [])])
                continue
            ps = []
            for x in date_passages(t, context=self.passage_context, ref=p):
                if x.time is None:
                    iv = [(TimeTuple.from_date(p),) * 2] if (p is not None and self.doc_time != "content") else []
                else:
                    iv = [(x.time.start, x.time.start if self.ranges == "start" else x.time.end)]
                ps.append((x.text, iv))
            out.append(ps)
        return out

    @staticmethod
    def score_multi(q: torch.Tensor, emb: torch.Tensor, owner: torch.Tensor, n: int) -> torch.Tensor:
        """``(Q, n)`` scores: each document's best-matching vector, ``max_{k: owner[k] = j} <q, emb[k]>``."""
        s = q.float() @ emb.float().t()                                   # (Q, M)
        out = s.new_full((q.shape[0], n), float("-inf"))
        return out.scatter_reduce(1, owner.to(s.device).unsqueeze(0).expand_as(s), s, reduce="amax")

    @torch.no_grad()
    def base_embeddings(self, texts: Sequence[str], *, batch_size: int = 64) -> torch.Tensor:
        """The base retriever's embeddings ``normalize(e_sem)`` (no time modules) — what :meth:`encode`
        returns for texts without any observed time (``base_equivalent``)."""
        was = self.training
        self.eval()
        try:
            return F.normalize(self.semantic(texts, batch_size=batch_size), dim=-1).float().cpu()
        finally:
            self.train(was)

    base_equivalent = base_embeddings

    def to_index(self, records: Sequence[Any], *, backend: str = "exact", batch_size: int = 64,
                 ids: Optional[Sequence[int]] = None, times=None, **index_kwargs):
        """Encode documents (dicts/objects with ``text``, optional ``published`` and an int ``id``, or pass
        ``ids=``) as ``role="document"`` into a :class:`tempokern.search.TemporalIndex` (plain inner
        product; the calendar positions are unused zeros)."""
        texts = [_field(r, "text") for r in records]
        pub = [_field(r, "published", None) for r in records]
        if ids is None:
            raw = [_field(r, "id", None) for r in records]
            bad = next((x for x in raw if not (isinstance(x, int) and not isinstance(x, bool))), ...)
            if bad is not ...:
                raise ValueError(f"to_index: record id {bad!r} is not an int, and TemporalIndex stores int64 ids; "
                                 "pass ids= (e.g. ids=range(len(records))) and map positions back to the records")
            ids = raw
        ids = torch.as_tensor(list(ids), dtype=torch.int64)
        if ids.numel() != len(texts):
            raise ValueError(f"ids has {ids.numel()} entries for {len(texts)} records")
        emb = self.encode(texts, times=times, pub=pub, role="document", batch_size=batch_size)
        index = TemporalIndex(self.hidden_size, backend=backend, **index_kwargs)
        index.add(ids, emb, torch.zeros(len(texts)))
        return index

    def to_base_index(self, records: Sequence[Any], *, backend: str = "exact", batch_size: int = 64,
                      ids: Optional[Sequence[int]] = None, **index_kwargs):
        """A :class:`tempokern.search.TemporalIndex` of the documents' base embeddings (``normalize(e_sem)``,
        no time modules), for :meth:`search`'s ``base_index``: queries without a time are scored there."""
        texts = [_field(r, "text") for r in records]
        if ids is None:
            ids = [_field(r, "id", None) for r in records]
        ids = torch.as_tensor(list(ids), dtype=torch.int64)
        index = TemporalIndex(self.hidden_size, backend=backend, **index_kwargs)
        index.add(ids, self.base_embeddings(texts, batch_size=batch_size), torch.zeros(len(texts)))
        return index

    def search(self, index, texts: Sequence[str], k: int = 10, *, times=None, pub=None, base_index=None, **kw):
        """Encode queries and return ``index.search`` (ids (Q, k), scores (Q, k) = ⟨q, d⟩ / temperature).
        ``base_index`` (from :meth:`to_base_index` on the same documents): queries without an observed time
        are searched there with their base embeddings, i.e. scored by the base relevance score."""
        q = self.encode(texts, times=times, pub=pub, role="query")
        ids, scores = index.search(q, torch.zeros(q.shape[0]), k, temperature=self.temperature, **kw)
        if base_index is not None:
            rows = [i for i, h in enumerate(self.has_time(texts, times=times, pub=pub, role="query")) if not h]
            if rows:
                qb = self.base_embeddings([texts[i] for i in rows])
                bi, bs = base_index.search(qb, torch.zeros(len(rows)), k, temperature=self.temperature, **kw)
                ids, scores = ids.clone(), scores.clone()
                r = torch.tensor(rows)
                ids[r], scores[r] = bi.to(ids.dtype), bs.to(scores.dtype)
        return ids, scores

    # ---- persistence --------------------------------------------------------------------------------------
    def save(self, path, *, embed_backbone: Optional[bool] = None) -> None:
        """Write a directory atomically: ``tempokern_re3.json`` (config, checksums) and
        ``time_modules.safetensors``. The frozen backbone is referenced by its directory and checksum
        (not copied) when it was loaded from a directory and is untouched; otherwise (built in memory, or
        LoRA-tuned: merged) its weights, config and tokenizer are stored too. ``embed_backbone=True``
        forces a copy. ``checksums.json`` covers every file written; `path` must be new, an empty
        directory or a checkpoint directory (FileExistsError otherwise)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        recover_dir(path)
        check_save_target(path)
        if embed_backbone is None:
            embed_backbone = self.backbone_path is None or self.lora_config is not None \
                or not Path(self.backbone_path).is_dir()
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(path.name), dir=path.parent))
        try:
            sd = {k: v.detach().cpu().contiguous() for k, v in self._time_state().items()}
            save_file(sd, str(tmp / TIME_FILE))
            meta = {"format": FORMAT, "version": VERSION, "encoder": self.config_dict(),
                    "time_sha256": sha256_file(tmp / TIME_FILE)}
            if embed_backbone:
                bb = self._plain_backbone()
                bsd = {k: v.detach().cpu().contiguous() for k, v in bb.state_dict().items()}
                save_file(bsd, str(tmp / BACKBONE_FILE))
                meta["backbone"] = {"kind": "embedded", "config": bb.config.to_dict(),
                                    "sha256": sha256_file(tmp / BACKBONE_FILE),
                                    "lora_merged": self.lora_config is not None, "source": self.backbone_path}
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
            else:
                if self._backbone_sha is None:
                    self._backbone_sha = backbone_checksum(self.backbone_path)
                meta["backbone"] = {"kind": "path", "path": self.backbone_path, "sha256": self._backbone_sha}
            (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1, ensure_ascii=False, default=str))
            finish_checkpoint(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _time_state(self) -> dict:
        """The saved time modules: time embedding, FiLM and (time_parser="learned") the parser heads."""
        sd = {**self.time_embed.state_dict(prefix="time_embed."), **self.film.state_dict(prefix="film.")}
        if self.parser is not None:
            sd.update(self.parser.state_dict(prefix="parser."))
        return sd

    @classmethod
    def load(cls, path, *, backbone_path: Optional[str] = None, map_location="cpu",
             allow_missing_manifest: bool = False) -> "Re3Encoder":
        """Rebuild a saved Re3Encoder; every file is verified against checksums.json before anything is
        read (allow_missing_manifest=True accepts a checkpoint saved without one, with a warning). A
        referenced backbone is loaded from its recorded directory (or ``backbone_path``, e.g. after moving
        it) and must match the recorded checksum."""
        from safetensors.torch import load_file

        path = Path(path)
        recover_dir(path)
        cfg_file = path / CONFIG_FILE
        if not cfg_file.exists():
            raise FileNotFoundError(f"{path} is not a saved Re3Encoder (no {CONFIG_FILE})")
        try:
            meta = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
        if not isinstance(meta, dict):
            raise CheckpointError(f"{cfg_file} must hold a JSON object")
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{cfg_file}: format {meta.get('format')!r} version {meta.get('version')!r}, expected "
                             f"{FORMAT!r} version {VERSION}")
        require_keys(meta, cfg_file, (("encoder", dict), ("backbone", dict)))
        digests = verify_checkpoint(path, allow_missing_manifest=allow_missing_manifest)
        if meta["backbone"].get("kind") not in ("path", "embedded"):
            raise CheckpointError(f"{cfg_file}: unknown backbone kind {meta['backbone'].get('kind')!r}")
        tfile = path / TIME_FILE
        if not tfile.exists():
            raise FileNotFoundError(f"{tfile} is missing")
        if file_digest(path, TIME_FILE, digests) != meta.get("time_sha256"):
            raise ValueError(f"{tfile} does not match the checksum in {CONFIG_FILE} (truncated or corrupted)")
        try:
            enc = dict(meta["encoder"])
            enc.pop("lora", None)
            enc.pop("freeze_backbone", None)
            b = meta["backbone"]
            if b["kind"] == "path":
                src = backbone_path or b["path"]
                if not Path(src).is_dir():
                    raise FileNotFoundError(f"the backbone this Re3Encoder references, {src}, is not a directory; "
                                            "pass backbone_path= where it lives now")
                digest = backbone_checksum(src)
                if digest != b["sha256"]:
                    raise ValueError(f"backbone at {src} does not match the checksum the Re3Encoder was saved with "
                                     "(a different or modified model)")
                model = cls(src, **enc)
                model._backbone_sha = digest
            elif b["kind"] == "embedded":
                from transformers import AutoConfig, AutoModel, AutoTokenizer
                bfile = path / BACKBONE_FILE
                if not bfile.exists():
                    raise FileNotFoundError(f"{bfile} is missing")
                if file_digest(path, BACKBONE_FILE, digests) != b.get("sha256"):
                    raise ValueError(f"{bfile} does not match the checksum in {CONFIG_FILE} (truncated or corrupted)")
                bcfg = dict(b["config"])
                config = AutoConfig.for_model(bcfg.pop("model_type"), **bcfg)
                backbone = AutoModel.from_config(config)
                bsd = load_file(str(bfile))
                missing, unexpected = backbone.load_state_dict(bsd, strict=False)
                # AutoModel.from_config may add children the saved model was built without (BERT's pooler)
                for child in {k.split(".")[0] for k in missing}:
                    names = [f"{child}.{n}" for n, _ in getattr(backbone, child).named_parameters()]
                    if names and all(n in missing for n in names) and not any(k.startswith(child + ".") for k in bsd):
                        setattr(backbone, child, None)
                        missing = [k for k in missing if k not in names]
                if missing or unexpected:
                    raise ValueError(f"{bfile} does not fit its config: missing {sorted(missing)[:8]}, unexpected "
                                     f"{sorted(unexpected)[:8]}")
                tok = AutoTokenizer.from_pretrained(str(path / TOKENIZER_DIR)) if (path / TOKENIZER_DIR).exists() else None
                model = cls(backbone, tokenizer=tok, **enc)
                model.backbone_path = b.get("source")
            else:
                raise ValueError(f"{cfg_file}: unknown backbone kind {b['kind']!r}")
        except (TypeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{cfg_file}: the model cannot be rebuilt from this config: "
                                  f"{type(e).__name__}: {e}") from None
        sd = load_file(str(tfile))
        own = model._time_state()
        if set(sd) != set(own):
            raise ValueError(f"{tfile} does not fit the time modules: missing {sorted(set(own) - set(sd))[:8]}, "
                             f"unexpected {sorted(set(sd) - set(own))[:8]}")
        model.time_embed.load_state_dict({k[len("time_embed."):]: v for k, v in sd.items() if k.startswith("time_embed.")})
        model.film.load_state_dict({k[len("film."):]: v for k, v in sd.items() if k.startswith("film.")})
        if model.parser is not None:
            model.parser.load_state_dict({k[len("parser."):]: v for k, v in sd.items() if k.startswith("parser.")})
        return model.to(map_location)


__all__ = ["Re3Encoder", "resolve_times", "resolve_intervals", "interval_batch", "backbone_checksum", "DOC_TIMES",
           "TIME_PARSERS", "RANGES", "PASSAGES"]
