"""Plain PyTorch Matryoshka InfoNCE: the literal sentence-transformers ``MatryoshkaLoss`` loop (slice to each
dim, L2-normalise, one InfoNCE per level, weighted sum), with the positives, extra negatives, symmetric
direction and bias of :func:`tempokern.reference.multipos_infonce`. The specification the fused
``tempokern.matryoshka_infonce`` is tested against. It materialises K (B, B') score matrices."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .multipos_infonce import overlap_positives
from .offset_bias import offset_bias, offset_bias_tabulated


def truncate(emb: torch.Tensor, m: int) -> torch.Tensor:
    """The Matryoshka embedding at dim m: ``F.normalize(emb[..., :m], dim=-1)``."""
    return F.normalize(emb[..., :m], dim=-1)


def _level(q, d, extra_neg, q_span, d_span, temperature, bias_matrix, symmetric):
    B, Bd = q.shape[0], d.shape[0]
    s = (q @ d.t()) / temperature
    if bias_matrix is not None:
        s = s + bias_matrix.to(s.dtype)
    s_all = s if extra_neg is None else torch.cat([s, (q @ extra_neg.t()) / temperature], dim=1)
    if q_span is None:  # MultipleNegativesRankingLoss: row i's positive is candidate i
        labels = torch.arange(B, device=q.device)
        loss_q = F.cross_entropy(s_all, labels)
        if not symmetric:
            return loss_q
        return (loss_q + F.cross_entropy(s.t(), torch.arange(Bd, device=q.device))) / 2
    # multipos_infonce's positives: span overlap, diagonal fallback per row, ChunQiuTR's column positives
    pos = overlap_positives(q_span, d_span)
    eye = torch.eye(B, Bd, dtype=torch.bool, device=q.device)
    pos_r = pos | (eye & ~pos.any(dim=1, keepdim=True))
    pos_c = pos_r | (eye & ~pos_r.any(dim=0, keepdim=True))
    neg_inf = torch.finfo(s.dtype).min
    loss_q = (torch.logsumexp(s_all, dim=1) - torch.logsumexp(s.masked_fill(~pos_r, neg_inf), dim=1)).mean()
    if not symmetric:
        return loss_q
    loss_d = (torch.logsumexp(s, dim=0) - torch.logsumexp(s.masked_fill(~pos_c, neg_inf), dim=0)).mean()
    return (loss_q + loss_d) / 2


def matryoshka_infonce(q: torch.Tensor, d: torch.Tensor, dims: Sequence[int], *, temperature: float,
                       weights: Optional[Sequence[float]] = None, extra_neg: Optional[torch.Tensor] = None,
                       symmetric: bool = False, q_span=None, d_span=None,
                       bias: Optional[Sequence[torch.Tensor]] = None, normalize: bool = True,
                       return_levels: bool = False, bias_table_points: Optional[int] = None):
    """sum_k w_k * InfoNCE(shrink(q, m_k), shrink(d, m_k)) over the dims m_k (sorted ascending with their
    weights; default weights 1), shrink(x, m) = normalize(x[:, :m]) (just x[:, :m] with normalize=False).

    q (B, H), d (B', H): raw embeddings. Without spans row i's positive is candidate i (cross-entropy over
    [d, extra_neg], as MultipleNegativesRankingLoss); with q_span/d_span the multi-positive overlap of
    :func:`multipos_infonce` (diagonal fallback). extra_neg (N, H) joins the q->d denominators only.
    symmetric=True: each level is (loss_q + loss_d) / 2. bias: offset_bias's 7-tuple, the same per-pair
    bias added to every level's logits. return_levels=True also returns the K level losses (ascending dims).
    Computed in the inputs' dtype."""
    order = sorted(range(len(dims)), key=lambda k: dims[k])
    dims_s = [int(dims[k]) for k in order]
    w = [1.0] * len(dims) if weights is None else [float(weights[k]) for k in order]
    if q_span is not None and d_span is not None:
        spans = (q_span, d_span)
    else:
        spans = (None, None)
    b = None
    if bias is not None:
        b = offset_bias(*bias) if bias_table_points is None else offset_bias_tabulated(*bias, bias_table_points)
    shrink = (lambda x, m: F.normalize(x[:, :m], dim=-1)) if normalize else (lambda x, m: x[:, :m])
    levels = []
    for m in dims_s:
        levels.append(_level(shrink(q, m), shrink(d, m), None if extra_neg is None else shrink(extra_neg, m),
                             spans[0], spans[1], temperature, b, symmetric))
    loss = sum(wk * lv for wk, lv in zip(w, levels))
    if return_levels:
        return loss, torch.stack(levels)
    return loss
