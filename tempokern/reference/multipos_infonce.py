"""Plain PyTorch multi-positive interval-overlap InfoNCE (the CTD training loss): the specification
the fused kernels in tempokern.multipos_infonce are tested against. It materialises the (B, B) score
matrix, the (B, N) extra-negative scores and, with a bias, offset_bias's (B, B, D) intermediates."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .offset_bias import offset_bias, offset_bias_tabulated


def _span_bounds(span: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    s, e = span
    return torch.minimum(s, e), torch.maximum(s, e)


def overlap_positives(q_span, d_span) -> torch.Tensor:
    """(Bq, Bd) bool: closed intervals [min(qs, qe), max(qs, qe)] and [min(ds, de), max(ds, de)] intersect."""
    qlo, qhi = _span_bounds(q_span)
    dlo, dhi = _span_bounds(d_span)
    return torch.maximum(qlo[:, None], dlo[None, :]) <= torch.minimum(qhi[:, None], dhi[None, :])


def group_positives(q_group, d_group) -> torch.Tensor:
    """(Bq, Bd) bool: the query row and the document row carry the same group id."""
    return q_group[:, None].to(torch.int64) == d_group[None, :].to(torch.int64)


def hardest_negatives(s: torch.Tensor, pos_r: torch.Tensor) -> torch.Tensor:
    """(Bq,) int64: per row of the logits s (Bq, Bd) the column j with ``pos_r[i, j]`` False and the largest
    s_ij, the lowest j among exact ties (written out, not left to torch.max's tie rule), -1 when the row
    has no such column. The spec of ``multipos_infonce(..., return_hardest=True)``."""
    neg = ~pos_r
    Bd = s.shape[1]
    best = s.masked_fill(pos_r, float("-inf")).max(dim=1, keepdim=True).values if Bd else None
    if best is None:
        return torch.full((s.shape[0],), -1, dtype=torch.int64, device=s.device)
    cols = torch.arange(Bd, device=s.device).expand_as(s)
    idx = torch.where(neg & (s == best), cols, Bd).min(dim=1).values
    return torch.where(neg.any(dim=1), idx, -1)


def multipos_infonce(q: torch.Tensor, d: torch.Tensor, q_span, d_span, *, temperature: float,
                     bias: Optional[Sequence[torch.Tensor]] = None, extra_neg: Optional[torch.Tensor] = None,
                     symmetric: bool = True, bias_table_points: Optional[int] = None,
                     return_hardest: bool = False, q_group: Optional[torch.Tensor] = None,
                     d_group: Optional[torch.Tensor] = None):
    """Multi-positive InfoNCE over in-batch scores s_ij = q_i . d_j / temperature + bias_ij.

    q, d: (B, H). q_span = (q_start, q_end), d_span = (d_start, d_end): integer (B,) tensors.
    Positives of row i: P_i = {j : the two closed intervals overlap}; a row with no positive uses its
    diagonal j = i. The d->q direction uses that row-fallback mask transposed, plus the diagonal for
    columns still without a positive, as ChunQiuTR's ``contrastive_loss_inbatch`` does
    (``retrieval_utils.py``): column j's positives are the overlaps, plus (j, j) when row j or column j
    has no overlap. bias: None or the 7-tuple
    (u_q, u_d, w1, b1, w2, b2, scale) of offset_bias, added to the q x d block only. extra_neg (N, H):
    extra negatives with scores q_i . n_k / temperature, in the q->d denominators only.
    bias_table_points=N: the table mode of the bias (:func:`offset_bias_tabulated`: the MLP evaluated
    exactly in float64 at N points of [-1, 1], linearly interpolated).

    loss_q = mean_i [logsumexp_all(s_i.) - logsumexp_{j in P_i}(s_ij)]; symmetric=True returns
    (loss_q + loss_d) / 2 with loss_d the same over columns (no extra negatives there).
    Computed in the inputs' dtype (plain PyTorch, no upcast).

    return_hardest=True: returns (loss, hardest_col), hardest_col (B,) int64 = :func:`hardest_negatives` of
    s (bias included: the logits the softmax sees) and the row positives (overlaps, or the diagonal when
    the row overlaps nothing); extra_neg never counts. Re3's s-_i (Eq. 11) with spans = (doc_id, doc_id).

    Group-scoped positives: q_group (B,), d_group (B',) integer ids (both or neither). Then
    P_i = {j : the intervals overlap and q_group[i] == d_group[j]} together with the row's own document
    j = i, which is always a positive (also when overlapping documents exist); the d->q mask is the same
    (every column j < B has its diagonal). None: the overlap positives above, exactly."""
    B = q.shape[0]
    s = (q @ d.t()) / temperature
    if bias is not None:
        b = offset_bias(*bias) if bias_table_points is None else offset_bias_tabulated(*bias, bias_table_points)
        s = s + b.to(s.dtype)
    pos = overlap_positives(q_span, d_span)
    eye = torch.eye(B, d.shape[0], dtype=torch.bool, device=q.device)
    if q_group is not None:
        pos_r = (pos & group_positives(q_group, d_group)) | eye
    else:
        pos_r = pos | (eye & ~pos.any(dim=1, keepdim=True))
    pos_c = pos_r | (eye & ~pos_r.any(dim=0, keepdim=True))
    neg_inf = torch.finfo(s.dtype).min  # finite fill keeps logsumexp's backward NaN-free
    s_all = s if extra_neg is None else torch.cat([s, (q @ extra_neg.t()) / temperature], dim=1)
    loss_q = (torch.logsumexp(s_all, dim=1) - torch.logsumexp(s.masked_fill(~pos_r, neg_inf), dim=1)).mean()
    hard = hardest_negatives(s.detach(), pos_r) if return_hardest else None
    if not symmetric:
        return (loss_q, hard) if return_hardest else loss_q
    loss_d = (torch.logsumexp(s, dim=0) - torch.logsumexp(s.masked_fill(~pos_c, neg_inf), dim=0)).mean()
    loss = (loss_q + loss_d) / 2
    return (loss, hard) if return_hardest else loss


def multipos_infonce_partial(q, d, q_lo, q_hi, d_lo, d_hi, *, temperature: float, bias=None, extra_neg=None,
                             row_weight: float = 1.0, col_weight: float = 0.0, diag_offset: int = 0,
                             row_none: Optional[torch.Tensor] = None, bias_table_points: Optional[int] = None,
                             return_hardest: bool = False, q_group: Optional[torch.Tensor] = None,
                             d_group: Optional[torch.Tensor] = None):
    """The partial loss CTDLoss(gather=True) computes per rank (spec of
    ``tempokern._ops.multipos_infonce.multipos_infonce_partial``): q (Bq, H) against d (Bd, H), spans as
    (lo, hi) bounds, row i's diagonal partner is column i + diag_offset (none when out of range), ``row_none``
    optionally says which rows overlap no document anywhere (default: none of these d).
    loss = row_weight * mean_i row_loss_i + col_weight * mean_j col_loss_j, a zero weight dropping its term;
    the positives follow ChunQiuTR (see :func:`multipos_infonce`). With q_group/d_group: the overlaps within a
    group, and row i's diagonal partner always (``row_none`` is not used)."""
    Bq, Bd = q.shape[0], d.shape[0]
    s = (q @ d.t()) / temperature
    if bias is not None:
        b = offset_bias(*bias) if bias_table_points is None else offset_bias_tabulated(*bias, bias_table_points)
        s = s + b.to(s.dtype)
    ov = torch.maximum(q_lo[:, None], d_lo[None, :]) <= torch.minimum(q_hi[:, None], d_hi[None, :])
    if q_group is not None:
        ov = ov & group_positives(q_group, d_group)
        rn = torch.ones(Bq, dtype=torch.bool, device=q.device)
    else:
        rn = ~ov.any(dim=1) if row_none is None else row_none.bool()
    cn = ~ov.any(dim=0)
    dg = (torch.arange(Bd, device=q.device)[None, :] - torch.arange(Bq, device=q.device)[:, None]) == diag_offset
    pos_r = ov | (rn[:, None] & dg)
    pos_c = ov | (dg & (rn[:, None] | cn[None, :]))
    neg_inf = torch.finfo(s.dtype).min
    loss = s.new_zeros(())
    if row_weight != 0.0:
        s_all = s if extra_neg is None else torch.cat([s, (q @ extra_neg.t()) / temperature], dim=1)
        lr = torch.logsumexp(s_all, dim=1) - torch.logsumexp(s.masked_fill(~pos_r, neg_inf), dim=1)
        loss = loss + row_weight * lr.mean()
    if col_weight != 0.0:
        lc = torch.logsumexp(s, dim=0) - torch.logsumexp(s.masked_fill(~pos_c, neg_inf), dim=0)
        loss = loss + col_weight * lc.mean()
    if return_hardest:
        return loss, hardest_negatives(s.detach(), pos_r)
    return loss
