"""MatryoshkaInfoNCE: the Matryoshka (nested-prefix) InfoNCE as a module on the fused single-pass op,
with optional all-gather of the batch over torch.distributed (as CTDLoss)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._ops.common import check_reciprocal
from .._ops.loss_args import id_spans, span_bounds
from .._ops.matryoshka_infonce import check_dims, matryoshka_partial, validate
from .._ops.routing import matryoshka_infonce


def _row_none(q_lo, q_hi, d_lo, d_hi) -> torch.Tensor:
    """(Bq,) bool: rows whose span overlaps no document span (sorted bounds, O((Bq + Bd) log))."""
    Bd = d_lo.shape[0]
    dlo, dhi = torch.sort(d_lo).values, torch.sort(d_hi).values
    n = Bd - (Bd - torch.searchsorted(dlo, q_hi, right=True)) - torch.searchsorted(dhi, q_lo)
    return n == 0


def _all_gather_rows(x: torch.Tensor, sizes, rank: int, world: int) -> torch.Tensor:
    """Concatenation over ranks along dim 0 (sizes may differ); this rank's slice is ``x`` itself (keeps
    its graph), the others arrive detached."""
    m = max(sizes)
    pad = x.detach().new_zeros((m,) + tuple(x.shape[1:]))
    pad[:x.shape[0]] = x.detach()
    parts = [torch.empty_like(pad) for _ in range(world)]
    torch.distributed.all_gather(parts, pad)
    parts = [p[:n] for p, n in zip(parts, sizes)]
    parts[rank] = x
    return torch.cat(parts, dim=0)


class MatryoshkaInfoNCE(torch.nn.Module):
    """sum_k w_k InfoNCE at each nested prefix dim m_k of the embeddings (``tempokern.matryoshka_infonce``):
    one fused pass over the feature dimension for all levels, no (B, B) buffer.

    ``forward(q, d, extra_neg=None, q_span=None, d_span=None)``: raw q (B, H), d (B, H) (d[i] is q[i]'s
    positive unless spans say otherwise), extra_neg (N, H) hard negatives in the q->d denominators.

    ``gather=True`` with an initialised torch.distributed group (CTDLoss's ``gather_mode="tempokern"``
    semantics): rank r scores its B_r queries against all T = sum_r B_r documents and all ranks' extra
    negatives (and, when symmetric, its documents against all T queries); its loss is weighted by
    W B_r / T, so the mean over ranks equals the single-process loss on the concatenated batch. Other
    ranks' tensors arrive detached. Without spans the positives are the global pairs (q_i, d_i). Every
    rank must pass q and d with equal row counts and agree on extra_neg / spans presence. Without an
    initialised group, gather=True computes the local loss."""

    def __init__(self, dims: Sequence[int], weights: Optional[Sequence[float]] = None, temperature: float = 0.05,
                 symmetric: bool = False, gather: bool = False):
        super().__init__()
        self.temperature = check_reciprocal("temperature", temperature, torch.float64)  # forward: its dtype
        for name, v in (("symmetric", symmetric), ("gather", gather)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
        dims_s, w_s = check_dims(dims, None, weights)
        self.dims, self.weights = tuple(dims_s), tuple(w_s)
        self.symmetric, self.gather = symmetric, gather

    def extra_repr(self) -> str:
        return (f"dims={self.dims}, weights={self.weights}, temperature={self.temperature}, "
                f"symmetric={self.symmetric}, gather={self.gather}")

    def forward(self, q: torch.Tensor, d: torch.Tensor, extra_neg: Optional[torch.Tensor] = None, q_span=None,
                d_span=None) -> torch.Tensor:
        dist = torch.distributed
        if not (self.gather and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return matryoshka_infonce(q, d, self.dims, temperature=self.temperature, weights=self.weights,
                                      extra_neg=extra_neg, symmetric=self.symmetric, q_span=q_span, d_span=d_span)
        return self._gathered(q, d, extra_neg, q_span, d_span)

    def _gathered(self, q, d, extra_neg, q_span, d_span):
        dist = torch.distributed
        validate(q, d, self.dims, self.temperature, self.weights, extra_neg, self.symmetric, q_span, d_span, True,
                 False)
        if d.shape[0] != q.shape[0]:
            raise ValueError(f"MatryoshkaInfoNCE(gather=True) needs as many rows in d as in q, got {q.shape[0]} "
                             f"and {d.shape[0]}")
        rank, world = dist.get_rank(), dist.get_world_size()
        row = torch.tensor([q.shape[0], extra_neg is not None, 0 if extra_neg is None else extra_neg.shape[0],
                            q_span is not None, q.shape[1]], dtype=torch.int64, device=q.device)
        parts = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(parts, row)
        meta = [[int(v) for v in p.tolist()] for p in parts]
        for col, what in ((1, "whether extra_neg is given"), (3, "whether spans are given"), (4, "the embedding size")):
            vals = [m[col] for m in meta]
            if len(set(vals)) > 1:
                raise ValueError(f"MatryoshkaInfoNCE(gather=True): ranks disagree on {what}: {vals} (rank order)")
        sizes = [m[0] for m in meta]
        start, total = sum(sizes[:rank]), sum(sizes)
        if q_span is None:
            q_lo, q_hi = id_spans(q.shape[0], start, q.device)
            d_lo, d_hi = id_spans(d.shape[0], start, q.device)
        else:
            q_lo, q_hi = span_bounds(q_span)
            d_lo, d_hi = span_bounds(d_span)
        g = lambda x: _all_gather_rows(x, sizes, rank, world)  # noqa: E731
        d_all, d_lo_all, d_hi_all = g(d), g(d_lo), g(d_hi)
        neg_all = None if extra_neg is None else _all_gather_rows(extra_neg, [m[2] for m in meta], rank, world)
        w = (0.5 if self.symmetric else 1.0) * world * sizes[rank] / total
        loss, _ = matryoshka_partial(q, d_all, q_lo, q_hi, d_lo_all, d_hi_all, self.dims, self.weights,
                                     temperature=self.temperature, extra_neg=neg_all, row_weight=w, col_weight=0.0,
                                     diag_offset=start)
        if not self.symmetric:
            return loss
        q_all, q_lo_all, q_hi_all = g(q), g(q_lo), g(q_hi)
        row_none = _row_none(q_lo_all, q_hi_all, d_lo_all, d_hi_all)
        loss_d, _ = matryoshka_partial(q_all, d, q_lo_all, q_hi_all, d_lo, d_hi, self.dims, self.weights,
                                       temperature=self.temperature, extra_neg=None, row_weight=0.0, col_weight=w,
                                       diag_offset=-start, row_none=row_none)
        return loss + loss_d
