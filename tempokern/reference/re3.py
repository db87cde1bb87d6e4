"""Plain PyTorch Re³ training loss (Cao et al., ACL 2026, Eqs. 10-13): the eager formulation that
``tempokern.nn.Re3Loss`` is tested and benchmarked against. It materialises the (B, B) cosine and logit
matrices, the masked copy for the hardest negative and the softmax of each direction.

    L_nce  = (L_{q->d} + L_{d->q}) / 2        symmetric InfoNCE over s = <q_i, d_j> / temperature
    L_hard = (1/B) sum_i relu(margin + <q_i, d_{j*_i}> - <q_i, d_i>)   j*_i = argmax over in-batch negatives
    L_tw   = (1/B) sum_i relu(margin + <q_i, d_tw_i> - <q_i, d_i>)
    L      = L_nce + lambda_hard L_hard + lambda_tw L_tw

Choices (design notes §3.2): margins in cosine units (B7); negatives are the in-batch columns that are not
positives of the row, never the time-wrong documents (B8); with ``dedup`` rows of the same document
(equal ``doc_ids``) are positives of each other, not negatives (B8), else the pure diagonal; ties in the
max go to the lowest column (B9); a row with no negative contributes 0 to L_hard, whose mean is over all B
rows (Eq. 11's 1/B)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .multipos_infonce import hardest_negatives


def re3_positives(B: int, doc_ids: Optional[torch.Tensor], dedup: bool, device) -> torch.Tensor:
    """(B, B) bool: pos[i, j] = doc_ids[i] == doc_ids[j] with dedup (and doc_ids given), else the diagonal."""
    if dedup and doc_ids is not None:
        return doc_ids[:, None] == doc_ids[None, :]
    return torch.eye(B, dtype=torch.bool, device=device)


def first_copies(x: torch.Tensor) -> torch.Tensor:
    """(n,) int64: for each row of x (n, H), the lowest index of a row equal to it (itself when unique). No host
    synchronisation (sort, cummax, gathers): rows are keyed by an integer hash of their bits (equal rows, equal keys),
    grouped by a stable sort, and a key shared by unequal rows (a collision) falls back to the row itself after an
    exact comparison."""
    n = x.shape[0]
    # integer keys from the float64 bit patterns: exact and independent of the reduction order (a float key is not:
    # torch's row sums round equal rows differently by position); the two 32-bit halves times fixed weights < 2^14
    # keep every sum below 2^63 for H < 2^15; two keys with different weights, sorted lexicographically
    bits = x.to(torch.float64).contiguous().view(torch.int64)
    lo, hi = bits & 0xFFFFFFFF, (bits >> 32) & 0xFFFFFFFF
    h = torch.arange(1, x.shape[1] + 1, dtype=torch.float64, device=x.device)

    def weights(seed: float) -> torch.Tensor:  # pseudo-random in [1, 16384), no linear relations between positions
        return ((h * seed).sin() * 43758.5453).frac().abs().mul(16383).to(torch.int64) + 1

    keys = [(lo * weights(a) + hi * weights(c)).sum(1) for a, c in ((12.9898, 78.233), (39.3468, 11.135))]
    order = torch.sort(keys[1], stable=True).indices
    order = order[torch.sort(keys[0][order], stable=True).indices]  # by key 0, then key 1, then index
    k0, k1 = keys[0][order], keys[1][order]
    pos = torch.arange(n, device=x.device)
    start = torch.ones(n, dtype=torch.bool, device=x.device)
    start[1:] = (k0[1:] != k0[:-1]) | (k1[1:] != k1[:-1])
    run_start = torch.where(start, pos, torch.zeros_like(pos)).cummax(0).values
    first = torch.empty_like(order).scatter_(0, order, order[run_start])
    same = (x[first] == x).all(1)
    return torch.where(same, first, pos)


def re3_loss(q: torch.Tensor, d: torch.Tensor, d_tw: Optional[torch.Tensor] = None,
             doc_ids: Optional[torch.Tensor] = None, *, temperature: float = 0.05, margin: float = 0.1,
             lambda_hard: float = 0.1, lambda_tw: float = 0.1, tw_in_nce: bool = False,
             dedup: bool = True) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Eager Re³ loss. q, d (B, D) final (L2-normalised) query / positive-document embeddings, d_tw (B, D)
    time-wrong negatives or None (then L_tw = 0 and ``tw_in_nce`` adds nothing), doc_ids (B,) integer.
    ``tw_in_nce``: d_tw joins the q->d InfoNCE denominators as extra negatives.
    Returns (loss, parts) with parts "nce", "hard", "tw", "total" (0-d, not detached: this is the spec)
    and "hardest_col" (B,) int64 (-1 for a row without negative)."""
    B = q.shape[0]
    cos = q @ d.t()                                                     # (B, B)
    s = cos / temperature
    pos = re3_positives(B, doc_ids, dedup, q.device)
    neg_inf = torch.finfo(s.dtype).min
    s_all = s
    if tw_in_nce and d_tw is not None:
        s_all = torch.cat([s, (q @ d_tw.t()) / temperature], dim=1)
    loss_q = (torch.logsumexp(s_all, dim=1) - torch.logsumexp(s.masked_fill(~pos, neg_inf), dim=1)).mean()
    loss_d = (torch.logsumexp(s, dim=0) - torch.logsumexp(s.masked_fill(~pos, neg_inf), dim=0)).mean()
    l_nce = (loss_q + loss_d) / 2
    # hardest in-batch negative: masked max over the (B, B) matrix, lowest column among exact ties
    # identical document embeddings are exact ties (duplicates of one document): their scores are taken from the
    # first copy, so that the lowest-column rule does not depend on how the product rounds a column by position
    # (MKL on an AMD EPYC gave two copies scores 1 ulp apart in float64)
    sel = s.detach()
    if B > 1:
        sel = sel[:, first_copies(d.detach())]
    hard_col = hardest_negatives(sel, pos)
    has = hard_col >= 0
    s_pos = cos.diagonal()
    s_neg = cos.gather(1, hard_col.clamp(min=0)[:, None])[:, 0]
    hinge = torch.where(has, torch.relu(margin + s_neg - s_pos), torch.zeros_like(s_pos))
    l_hard = hinge.sum() / B if B else cos.new_zeros(())
    if d_tw is not None:
        l_tw = torch.relu(margin + (q * d_tw).sum(dim=1) - s_pos).mean() if B else cos.new_zeros(())
    else:
        l_tw = cos.new_zeros(())
    total = l_nce + lambda_hard * l_hard + lambda_tw * l_tw
    return total, {"nce": l_nce, "hard": l_hard, "tw": l_tw, "total": total, "hardest_col": hard_col}
