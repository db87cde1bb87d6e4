"""CTDEncoder: a transformers backbone plus ChunQiuTR's temporal modules (calendar heads,
absolute calendar context, relative offset bias), computed with tempokern's fused ops."""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._ops.calendar import calendar_context, calendar_scalar

from ..limits import cap_texts
from ..nn import OffsetBias
from ..search import TemporalIndex
from ._batching import length_sorted_batches, progress as _progress
from .checkpoint import load_chunqiu_ctd, load_encoder, save_encoder
from .levels import LevelSpec, calendar_levels, calendar_name  # noqa: F401  (LevelSpec: part of the API here)

POOLINGS = ("cls", "mean", "last")
#: how retrieval vectors are scored: "ctd" = the full CTD model (calendar context in the embedding, offset
#: bias on pairs, each when the model uses it); "encoder" = the backbone alone (pooled, L2-normalised, dot
#: product; no context, no bias), as ChunQiuTR's evaluate.py ("enc_only") and its validation do
SCORERS = ("ctd", "encoder")


#: what a text is to the encoders' ``encode(..., role=)`` (CTDEncoder, TMRLEncoder, Re3Encoder)
ROLES = ("query", "document")


def check_scorer(scorer: str) -> str:
    if scorer not in SCORERS:
        raise ValueError(f"scorer must be one of {SCORERS}, got {scorer!r}")
    return scorer


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role


class CTDOutput(NamedTuple):
    """emb: retrieval vectors (B, H); u: latent calendar position (B,) in [0, 1]; logits: one
    (B, n_l) tensor per level; base: the pooled text vector before the calendar context."""
    emb: torch.Tensor
    u: torch.Tensor
    logits: List[torch.Tensor]
    base: torch.Tensor


class Encoded(NamedTuple):
    embeddings: torch.Tensor
    u: torch.Tensor
    logits: List[torch.Tensor]


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Pool (B, T, H) token states under a (B, T) attention mask."""
    if how == "cls":
        return hidden[:, 0]
    m = mask.to(hidden.dtype).unsqueeze(-1)
    if how == "mean":
        return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-6)
    # last real token; the argmax of position*mask finds it under left and right padding alike
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = (pos * (mask > 0)).argmax(dim=1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


class CTDEncoder(nn.Module):
    """Dual encoder with the CTD temporal modules on any transformers backbone.

    backbone: a transformers model name/path (loaded with AutoModel/AutoTokenizer) or a built
    `PreTrainedModel` (pass `tokenizer=` to use `encode`). calendar: a `tempokern.Calendar` (or
    (name, size) pairs): one linear head per level gives logits; `calendar_scalar` turns them
    into u; `calendar_context` -> Linear(L*ctx_dim, H) -> h + gamma*c (gamma learned, init 1)
    when use_context; `OffsetBias(bias_features, bias_hidden)` (scale init 0) scores pairs when
    use_bias. temperature is the scale the scores were trained at (used by search)."""

    def __init__(self, backbone: Any, calendar: Any, *, pooling: str = "cls", ctx_dim: int = 64,
                 bias_features: int = 32, bias_hidden: int = 32, use_context: bool = True,
                 use_bias: bool = True, normalize: bool = True, tokenizer: Any = None,
                 max_length: int = 128, temperature: float = 0.05, calendar_tau: float = 1.0):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        for name, v in (("ctx_dim", ctx_dim), ("bias_features", bias_features), ("bias_hidden", bias_hidden),
                        ("max_length", max_length)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if isinstance(backbone, str):
            from transformers import AutoModel, AutoTokenizer
            self.backbone_name = backbone
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(backbone)
            backbone = AutoModel.from_pretrained(backbone)
        else:
            self.backbone_name = getattr(getattr(backbone, "config", None), "_name_or_path", "") or ""
        if not isinstance(backbone, nn.Module) or not hasattr(backbone, "config"):
            raise TypeError("backbone must be a transformers model name/path or a PreTrainedModel, "
                            f"got {type(backbone).__name__}")
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.calendar = calendar
        self.levels = calendar_levels(calendar)
        self.calendar_kind = calendar_name(calendar)
        self.pooling, self.normalize = pooling, bool(normalize)
        self.use_context, self.use_bias = bool(use_context), bool(use_bias)
        self.ctx_dim, self.bias_features, self.bias_hidden = ctx_dim, bias_features, bias_hidden
        self.max_length, self.temperature, self.calendar_tau = max_length, float(temperature), float(calendar_tau)
        H = int(backbone.config.hidden_size)
        self.hidden_size = H
        self.time_heads = nn.ModuleList([nn.Linear(H, n) for _, n in self.levels])
        # the context and bias modules always exist so every ablation row has the same state dict
        self.ctx_proj = nn.Linear(len(self.levels) * ctx_dim, H)
        self.ctx_gate = nn.Parameter(torch.tensor(1.0))
        self.offset_bias = OffsetBias(bias_features, bias_hidden)

    # ---- configuration ----------------------------------------------------------------------
    def config_dict(self) -> dict:
        return {
            "pooling": self.pooling, "ctx_dim": self.ctx_dim, "bias_features": self.bias_features,
            "bias_hidden": self.bias_hidden, "use_context": self.use_context, "use_bias": self.use_bias,
            "normalize": self.normalize, "max_length": self.max_length, "temperature": self.temperature,
            "calendar_tau": self.calendar_tau, "levels": [list(l) for l in self.levels],
            "calendar": self.calendar_kind, "backbone_name": self.backbone_name,
        }

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **extra) -> CTDOutput:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **extra)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        base = pool(hidden, attention_mask, self.pooling)
        return self.temporal(base)

    def temporal(self, base: torch.Tensor) -> CTDOutput:
        """Apply heads, u, context and normalisation to pooled vectors (B, H)."""
        logits = [head(base) for head in self.time_heads]
        flogits = [x.float() for x in logits]
        u = calendar_scalar(flogits, self.calendar_tau)
        h = base
        if self.use_context:
            ctx = calendar_context(flogits, self.ctx_dim, self.calendar_tau)
            h = base + self.ctx_gate.to(base.dtype) * self.ctx_proj(ctx.to(self.ctx_proj.weight.dtype)).to(base.dtype)
        emb = F.normalize(h, dim=-1) if self.normalize else h
        return CTDOutput(emb, u, logits, base)

    def pair_bias(self, u_q: torch.Tensor, u_d: torch.Tensor) -> Optional[torch.Tensor]:
        """The (Bq, Bd) relative-offset bias, or None when use_bias is off."""
        return self.offset_bias(u_q.float(), u_d.float()) if self.use_bias else None

    # ---- text API -----------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> dict:
        if self.tokenizer is None:
            raise ValueError("this CTDEncoder has no tokenizer: pass tokenizer= when building it "
                             "from a PreTrainedModel")
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a list of strings")
        enc = self.tokenizer(cap_texts(texts), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    def encode(self, texts: Sequence[str], *, role: str = "query", batch_size: int = 64, device=None,
               scorer: str = "ctd", progress: Optional[bool] = None) -> Encoded:
        """Embeddings (N, H) float32, u (N,) and per-level logits, in eval mode under
        ``torch.inference_mode``, in length-sorted batches each padded to its longest text (results in
        input order). ``role``: "query" | "document", the keyword of every tempokern encoder; CTD encodes
        both roles with the same tower and no prefix, so the two give the same vectors.
        scorer="ctd": the CTD embedding (with the calendar context when use_context);
        "encoder": the backbone's pooled vector, L2-normalised (ChunQiuTR's encoder-only scoring).
        ``progress``: show progress (default: :func:`tempokern.models._batching.set_progress`)."""
        check_role(role)
        check_scorer(scorer)
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings")
        texts = list(texts)
        device = torch.device(device) if device is not None else self.device
        N = len(texts)
        embs = torch.empty(N, self.hidden_size)
        us = torch.empty(N)
        logits = [torch.empty(N, n) for _, n in self.levels]
        was_training = self.training
        self.eval()
        batches = length_sorted_batches(texts, batch_size)
        try:
            with torch.inference_mode():
                for idx in _progress(batches, len(batches), "encode", progress):
                    batch = {k: v.to(device) for k, v in self.tokenize([texts[i] for i in idx]).items()}
                    out = self(**batch)
                    emb = out.emb if scorer == "ctd" else F.normalize(out.base.float(), dim=-1)
                    at = torch.as_tensor(idx)
                    embs[at] = emb.float().cpu()
                    us[at] = out.u.float().cpu()
                    for l, x in enumerate(out.logits):
                        logits[l][at] = x.float().cpu()
        finally:
            self.train(was_training)
        return Encoded(embs, us, logits)

    def to_index(self, records: Sequence[Any], *, backend: str = "exact", batch_size: int = 64,
                 ids: Optional[Sequence[int]] = None, **index_kwargs):
        """Encode records (dicts or objects with `text`, and an integer `id`) into a TemporalIndex,
        which stores int64 ids. Records with other ids (every `tempokern.datasets.Record` has a
        string id) need `ids=`: e.g. `ids=range(len(records))`, keeping `[r.id for r in records]` to
        map the positions back (`tempokern index` writes that list next to the index)."""
        texts = [_field(r, "text") for r in records]
        if ids is None:
            raw = [_field(r, "id", None) for r in records]
            bad = next((x for x in raw if not (isinstance(x, int) and not isinstance(x, bool))), ...)
            if bad is not ...:
                raise ValueError(f"to_index: record id {bad!r} is not an int, and TemporalIndex stores int64 ids; "
                                 "pass ids= (e.g. ids=range(len(records))) and keep the records' own ids to map "
                                 "the search results back")
            ids = raw
        ids = torch.as_tensor(list(ids), dtype=torch.int64)
        if ids.numel() != len(texts):
            raise ValueError(f"ids has {ids.numel()} entries for {len(texts)} records")
        enc = self.encode(texts, batch_size=batch_size)
        index = TemporalIndex(self.hidden_size, backend=backend, **index_kwargs)
        index.add(ids, enc.embeddings, enc.u)
        return index

    def search(self, index, texts: Sequence[str], k: int = 10, **kw):
        """Encode queries and search an index under the full CTD score (bias when use_bias)."""
        enc = self.encode(texts)
        return index.search(enc.embeddings, enc.u, k, bias=self.offset_bias if self.use_bias else None,
                            temperature=self.temperature, **kw)

    # ---- persistence (tempokern/models/checkpoint.py) -----------------------------------------
    def save(self, path, *, extra_files=None) -> None:
        """A checkpoint directory (tempokern/models/checkpoint.py:save_encoder); extra_files
        ({name: bytes}) are stored in it under the same checksum manifest."""
        save_encoder(self, path, extra_files=extra_files)

    @classmethod
    def load(cls, path, calendar: Any = None, *, map_location="cpu",
             allow_missing_manifest: bool = False) -> "CTDEncoder":
        """Every file is verified against the checkpoint's checksums.json first; allow_missing_manifest=True
        accepts a checkpoint saved without one (with a warning)."""
        return load_encoder(path, calendar=calendar, map_location=map_location,
                            allow_missing_manifest=allow_missing_manifest, cls=cls)

    def load_chunqiu_state_dict(self, state_dict, *, include_backbone: bool = False) -> dict:
        return load_chunqiu_ctd(self, state_dict, include_backbone=include_backbone)


def _field(r: Any, name: str, default: Any = ...):
    if isinstance(r, dict):
        if name in r:
            return r[name]
    elif hasattr(r, name):
        return getattr(r, name)
    if name == "text":
        for alt in ("description", "content", "body"):
            if isinstance(r, dict) and alt in r:
                return r[alt]
            if hasattr(r, alt):
                return getattr(r, alt)
    if default is ...:
        raise ValueError(f"record {r!r} has no {name!r} field")
    return default
