"""Where the encoder and trainer get the pieces other tempokern modules provide.

`OffsetBias`, `CTDLoss`, `TemporalIndex`, `retrieval_metrics` and the reference loss come
from their own modules (tempokern.nn, tempokern.search, tempokern.eval, tempokern.reference).
While one of them is missing from an install (a partial checkout), a plain-PyTorch
stand-in written to the same specification is used instead, and `dependency_report()`
says so: nothing is silently different, and the stand-ins are the slow reference path."""
from __future__ import annotations

import math
import warnings
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

_USED: Dict[str, str] = {}


def _note(name: str, where: str) -> None:
    if _USED.get(name) != where:
        _USED[name] = where
        if where == "stand-in":
            warnings.warn(f"tempokern: {name} is not available in this install; using the plain-PyTorch "
                          "stand-in from tempokern.models._compat", RuntimeWarning, stacklevel=3)


def dependency_report() -> Dict[str, str]:
    """{name: "tempokern" | "stand-in"} for every dependency resolved so far."""
    for fn in (offset_bias_cls, ctd_loss_cls, temporal_index_cls, retrieval_metrics_fn,
               reference_multipos_fn, ctd_topk_fn):
        fn()
    return dict(_USED)


# ---- offset bias -------------------------------------------------------------------------------

def fourier_features(x: torch.Tensor, dim: int) -> torch.Tensor:
    """phi(x) of the offset-bias spec: [sin(x f_k), cos(x f_k)], K = max(1, dim // 2), zero-padded."""
    K = max(1, dim // 2)
    f = torch.exp(-math.log(10000.0) * torch.linspace(0, 1, K, dtype=x.dtype, device=x.device))
    ang = x.unsqueeze(-1) * f
    feat = torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1)
    if feat.shape[-1] > dim:
        feat = feat[..., :dim]
    elif feat.shape[-1] < dim:
        feat = F.pad(feat, (0, dim - feat.shape[-1]))
    return feat


def _offset_bias_ref(u_q, u_d, w1, b1, w2, b2, scale):
    delta = (u_d[None, :] - u_q[:, None]).clamp(-1.0, 1.0)
    h = torch.relu(fourier_features(delta, w1.shape[1]) @ w1.T + b1)
    return scale * ((h @ w2.T).squeeze(-1) + b2)


class _OffsetBiasStandIn(nn.Module):
    """Same parameters and semantics as tempokern.nn.OffsetBias (materialises Bq x Bd x D)."""

    def __init__(self, features: int = 32, hidden: int = 32):
        super().__init__()
        self.features, self.hidden = features, hidden
        self.mlp = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.scale = nn.Parameter(torch.tensor(0.0))

    def forward(self, u_q: torch.Tensor, u_d: torch.Tensor) -> torch.Tensor:
        return _offset_bias_ref(u_q, u_d, *bias_params(self))


def bias_params(ob: nn.Module) -> Tuple[torch.Tensor, ...]:
    """(w1, b1, w2, b2, scale) of an OffsetBias module, the tail of the ops' bias tuple."""
    return ob.mlp[0].weight, ob.mlp[0].bias, ob.mlp[2].weight, ob.mlp[2].bias, ob.scale


def offset_bias_cls():
    try:
        from ..nn import OffsetBias  # type: ignore
        _note("OffsetBias", "tempokern")
        return OffsetBias
    except ImportError:
        _note("OffsetBias", "stand-in")
        return _OffsetBiasStandIn


# ---- multi-positive InfoNCE ----------------------------------------------------------------------

def _span_bounds(span):
    a, b = span
    return torch.minimum(a, b), torch.maximum(a, b)


def _multipos_ref(q, d, q_span, d_span, *, temperature, bias=None, extra_neg=None, symmetric=True):
    s = (q @ d.T) / temperature
    if bias is not None:
        s = s + _offset_bias_ref(*bias).to(s.dtype)
    qlo, qhi = _span_bounds(q_span)
    dlo, dhi = _span_bounds(d_span)
    pos = (qlo[:, None] <= dhi[None, :]) & (dlo[None, :] <= qhi[:, None])
    eye = torch.eye(pos.shape[0], pos.shape[1], dtype=torch.bool, device=pos.device)
    rows = pos | (eye & ~pos.any(1, keepdim=True))
    cols = pos | (eye & ~pos.any(0, keepdim=True))
    full = s if extra_neg is None else torch.cat([s, (q @ extra_neg.T) / temperature], dim=1)
    neg_inf = torch.finfo(s.dtype).min
    loss_q = (torch.logsumexp(full, 1) - torch.logsumexp(s.masked_fill(~rows, neg_inf), 1)).mean()
    if not symmetric:
        return loss_q
    loss_d = (torch.logsumexp(s.T, 1) - torch.logsumexp(s.T.masked_fill(~cols.T, neg_inf), 1)).mean()
    return (loss_q + loss_d) / 2


def reference_multipos_fn():
    try:
        from ..reference import multipos_infonce  # type: ignore
        _note("reference.multipos_infonce", "tempokern")
        return multipos_infonce
    except ImportError:
        _note("reference.multipos_infonce", "stand-in")
        return _multipos_ref


def fused_multipos_fn():
    """The fused op, or None when this install lacks it."""
    try:
        from .. import multipos_infonce  # type: ignore
        return multipos_infonce
    except ImportError:
        return None


class _CTDLossStandIn(nn.Module):
    """Same constructor/forward as tempokern.nn.CTDLoss, computed by the materialising reference.
    gather=True all-gathers queries and documents; only the local slices carry gradients."""

    def __init__(self, temperature=0.05, offset_bias=None, symmetric=True, normalize=True, gather=False):
        super().__init__()
        self.temperature, self.offset_bias = float(temperature), offset_bias
        self.symmetric, self.normalize, self.gather = symmetric, normalize, gather

    def forward(self, q, d, q_span, d_span, u_q=None, u_d=None, extra_neg=None):
        if self.normalize:
            q, d = F.normalize(q, dim=-1), F.normalize(d, dim=-1)
            extra_neg = None if extra_neg is None else F.normalize(extra_neg, dim=-1)
        if self.gather and torch.distributed.is_available() and torch.distributed.is_initialized():
            q, d = _gather_with_grad(q), _gather_with_grad(d)
            q_span = tuple(_gather_with_grad(x) for x in q_span)
            d_span = tuple(_gather_with_grad(x) for x in d_span)
            u_q = None if u_q is None else _gather_with_grad(u_q)
            u_d = None if u_d is None else _gather_with_grad(u_d)
            extra_neg = None if extra_neg is None else _gather_with_grad(extra_neg)
        bias = None
        if self.offset_bias is not None and u_q is not None and u_d is not None:
            bias = (u_q.float(), u_d.float(), *bias_params(self.offset_bias))
        return _multipos_ref(q, d, q_span, d_span, temperature=self.temperature, bias=bias,
                             extra_neg=extra_neg, symmetric=self.symmetric)


def _gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.detach().contiguous())
    parts[dist.get_rank()] = x
    return torch.cat(parts, 0)


def ctd_loss_cls():
    try:
        from ..nn import CTDLoss  # type: ignore
        _note("CTDLoss", "tempokern")
        return CTDLoss
    except ImportError:
        _note("CTDLoss", "stand-in")
        return _CTDLossStandIn


# ---- top-k scoring and the index -----------------------------------------------------------------

def _ctd_topk_ref(q, g, k, *, temperature=1.0, bias=None, exclude=None):
    s = (q.float() @ g.float().T) / temperature
    if bias is not None:
        s = s + _offset_bias_ref(*bias)
    if exclude is not None:
        ex = exclude.clamp_min(0)
        s = s.scatter(1, ex, torch.where(exclude >= 0, float("-inf"), s.gather(1, ex)))
    # stable sort: ties go to the lower gallery index, as ctd_topk specifies
    order = torch.sort(-s, dim=1, stable=True).indices[:, :k]
    return s.gather(1, order), order


def ctd_topk_fn():
    try:
        from .. import ctd_topk  # type: ignore
        _note("ctd_topk", "tempokern")
        return ctd_topk
    except ImportError:
        _note("ctd_topk", "stand-in")
        return _ctd_topk_ref


class _TemporalIndexStandIn:
    """Exact-backend subset of tempokern.search.TemporalIndex (add/remove/search/save/load)."""

    def __init__(self, dim: int, *, backend: str = "exact", device="cpu", **_):
        if backend != "exact":
            raise ValueError(f"backend {backend!r} needs tempokern.search (this install has only 'exact')")
        self.dim, self.device = int(dim), torch.device(device)
        self.ids = torch.empty(0, dtype=torch.int64)
        self.emb = torch.empty(0, self.dim)
        self.u = torch.empty(0)

    def __len__(self):
        return int(self.ids.numel())

    def add(self, ids, emb, u):
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if emb.ndim != 2 or emb.shape[1] != self.dim:
            raise ValueError(f"emb must be (N, {self.dim}), got {tuple(emb.shape)}")
        if emb.shape[0] != ids.numel() or torch.as_tensor(u).numel() != ids.numel():
            raise ValueError("ids, emb and u must have the same length")
        self.ids = torch.cat([self.ids, ids])
        self.emb = torch.cat([self.emb, emb.detach().float().cpu()])
        self.u = torch.cat([self.u, torch.as_tensor(u).detach().float().cpu().reshape(-1)])

    def remove(self, ids):
        keep = ~torch.isin(self.ids, torch.as_tensor(ids, dtype=torch.int64))
        self.ids, self.emb, self.u = self.ids[keep], self.emb[keep], self.u[keep]

    def search(self, q, u_q, k, *, candidates=None, bias=None, temperature=1.0):
        b = None
        if bias is not None:
            b = (torch.as_tensor(u_q).float().reshape(-1), self.u, *bias_params(bias))
        with torch.no_grad():
            vals, idx = _ctd_topk_ref(q.float().cpu(), self.emb, min(k, len(self)),
                                      temperature=temperature, bias=b)
        return self.ids[idx], vals

    def save(self, path):
        import os
        tmp = f"{path}.tmp"
        torch.save({"format": "tempokern-standin-index", "version": 1, "dim": self.dim,
                    "ids": self.ids, "emb": self.emb, "u": self.u}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path, **_):
        blob = torch.load(path, map_location="cpu")
        if not isinstance(blob, dict) or blob.get("format") != "tempokern-standin-index":
            raise ValueError(f"{path} is not a tempokern index file")
        idx = cls(blob["dim"])
        idx.ids, idx.emb, idx.u = blob["ids"], blob["emb"], blob["u"]
        return idx


def temporal_index_cls():
    try:
        from ..search import TemporalIndex  # type: ignore
        _note("TemporalIndex", "tempokern")
        return TemporalIndex
    except ImportError:
        _note("TemporalIndex", "stand-in")
        return _TemporalIndexStandIn


# ---- metrics ------------------------------------------------------------------------------------

def _retrieval_metrics_ref(run, qrels, ks=(1, 5, 10)):
    """ChunQiuTR definitions: R@k hit rate, MRR@10, nDCG@10 (binary gains), recall@k fraction."""
    ks = tuple(ks)
    acc: Dict[str, float] = {f"R@{k}": 0.0 for k in ks}
    acc.update({f"recall@{k}": 0.0 for k in ks})
    acc.update({"MRR@10": 0.0, "nDCG@10": 0.0})
    n = 0
    for qid, gold_rel in qrels.items():
        gold = {d for d, r in gold_rel.items() if r > 0}
        if not gold:
            continue
        n += 1
        ranked = [d for d, _ in sorted(run.get(qid, {}).items(), key=lambda kv: (-kv[1], kv[0]))]
        for k in ks:
            hits = sum(1 for d in ranked[:k] if d in gold)
            acc[f"R@{k}"] += float(hits > 0)
            acc[f"recall@{k}"] += hits / len(gold)
        first = next((r for r, d in enumerate(ranked[:10], 1) if d in gold), None)
        acc["MRR@10"] += 0.0 if first is None else 1.0 / first
        dcg = sum(1.0 / math.log2(r + 1) for r, d in enumerate(ranked[:10], 1) if d in gold)
        idcg = sum(1.0 / math.log2(r + 1) for r in range(1, min(len(gold), 10) + 1))
        acc["nDCG@10"] += dcg / idcg
    out = {key: (v / n if n else 0.0) for key, v in acc.items()}
    out["queries"] = n
    return out


def retrieval_metrics_fn():
    try:
        from ..eval import retrieval_metrics  # type: ignore
        _note("retrieval_metrics", "tempokern")
        return retrieval_metrics
    except ImportError:
        _note("retrieval_metrics", "stand-in")
        return _retrieval_metrics_ref
