"""CTDLoss: the ChunQiuTR training loss (multi-positive interval-overlap InfoNCE plus the relative-offset
bias) as a module on the fused kernel, with optional all-gather of the batch over torch.distributed."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .._ops.common import check_positive
from .._ops.multipos_infonce import _span_bounds, multipos_infonce, multipos_infonce_partial, validate
from .offset_bias import bias_params


def _bias_tuple(offset_bias, u_q, u_d):
    return (u_q, u_d, *bias_params(offset_bias))


def _sizes(n: int, world: int, group, device) -> list:
    """The first-dimension size of a tensor on every rank."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(parts, t, group=group)
    return [int(p.item()) for p in parts]


def _gather(x: torch.Tensor, rank: int, world: int, group, sizes=None) -> torch.Tensor:
    """Concatenation over ranks along dim 0 (first dimensions may differ between ranks: ``sizes``, asked
    for when not given); this rank's slice is ``x`` itself (keeps its autograd graph), the others arrive
    detached."""
    if sizes is None:
        sizes = _sizes(x.shape[0], world, group, x.device)
    m = max(sizes)
    pad = x.detach().new_zeros((m,) + tuple(x.shape[1:]))
    pad[:x.shape[0]] = x.detach()
    parts = [torch.empty_like(pad) for _ in range(world)]
    torch.distributed.all_gather(parts, pad, group=group)
    parts = [p[:n] for p, n in zip(parts, sizes)]
    parts[rank] = x
    return torch.cat(parts, dim=0)


class CTDLoss(torch.nn.Module):
    """Multi-positive interval-overlap InfoNCE with the temporal offset bias, fused (no B x B buffer).

    ``forward(q, d, q_span, d_span, u_q=None, u_d=None, extra_neg=None)``: q, d (B, H) query/document
    embeddings (L2-normalised here when ``normalize``), spans = (start, end) integer (B,) tensors,
    u_q/u_d (B,) latent calendar positions (needed iff ``offset_bias`` is given), extra_neg (N, H) extra
    negatives for the q->d direction. ``offset_bias``: a ``tempokern.nn.OffsetBias`` (any module with
    ``mlp[0]``/``mlp[2]`` Linear layers and a ``scale`` parameter); its bias is added inside the kernel.

    ``gather=True`` with an initialised torch.distributed group: documents, queries, spans, u and extra
    negatives are all-gathered, so rank r scores its B_r local queries against all T = sum_r B_r documents
    (and, when symmetric, its local documents against all T queries). The rank's loss is
    ``(W B_r / T) * (w * mean_{local rows} row_loss + w * mean_{local columns} col_loss)`` (W ranks; w = 1/2
    symmetric, else 1 and no column term; the factor is 1 when every rank has the same batch size), so
    the MEAN over ranks equals the single-process loss on the concatenated batch, also when the local
    batch sizes differ (an epoch's last batch) and extra_neg counts differ. Gradients: other ranks'
    embeddings arrive detached, as in the ChunQiuTR reference, so local embeddings receive the exact
    gradient of their own rows/columns, but not of the terms where they only appear as candidates for
    another rank's anchors. Without an initialised group, gather=True computes the local loss."""

    def __init__(self, temperature: float = 0.05, offset_bias: Optional[torch.nn.Module] = None,
                 symmetric: bool = True, normalize: bool = True, gather: bool = False):
        super().__init__()
        self.temperature = check_positive("temperature", temperature)
        if offset_bias is not None and not (hasattr(offset_bias, "mlp") and hasattr(offset_bias, "scale")):
            raise TypeError("offset_bias must be a tempokern.nn.OffsetBias (a module with .mlp and .scale), "
                            f"got {type(offset_bias).__name__}")
        self.offset_bias = offset_bias
        for name, v in (("symmetric", symmetric), ("normalize", normalize), ("gather", gather)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
        self.symmetric, self.normalize, self.gather = symmetric, normalize, gather

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}, symmetric={self.symmetric}, normalize={self.normalize}, "
                f"gather={self.gather}")

    def forward(self, q: torch.Tensor, d: torch.Tensor, q_span, d_span, u_q: Optional[torch.Tensor] = None,
                u_d: Optional[torch.Tensor] = None, extra_neg: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.offset_bias is None:
            if u_q is not None or u_d is not None:
                raise ValueError("u_q/u_d were given but this CTDLoss has no offset_bias to use them")
            bias = None
        else:
            if u_q is None or u_d is None:
                raise ValueError("this CTDLoss has an offset_bias, so u_q and u_d (B,) are required")
            bias = _bias_tuple(self.offset_bias, u_q, u_d)
        if self.normalize:
            q, d = F.normalize(q, dim=-1), F.normalize(d, dim=-1)
            if extra_neg is not None:
                extra_neg = F.normalize(extra_neg, dim=-1)
        dist = torch.distributed
        if not (self.gather and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return multipos_infonce(q, d, q_span, d_span, temperature=self.temperature, bias=bias,
                                    extra_neg=extra_neg, symmetric=self.symmetric)
        return self._gathered(q, d, q_span, d_span, bias, extra_neg)

    def _gathered(self, q, d, q_span, d_span, bias, extra_neg):
        dist = torch.distributed
        validate(q, d, q_span, d_span, self.temperature, bias, extra_neg, self.symmetric)
        group, rank, world = None, dist.get_rank(), dist.get_world_size()
        sizes = _sizes(q.shape[0], world, group, q.device)
        start, total = sum(sizes[:rank]), sum(sizes)
        if total == 0:
            raise ValueError("gather=True: every rank has an empty batch")
        q_lo, q_hi = _span_bounds(q_span)
        d_lo, d_hi = _span_bounds(d_span)
        g = lambda x: _gather(x, rank, world, group, sizes)  # noqa: E731
        d_all, d_lo_all, d_hi_all = g(d), g(d_lo), g(d_hi)
        neg_all = None if extra_neg is None else _gather(extra_neg, rank, world, group)
        # each rank's mean over its own rows, weighted so that the mean over ranks is the global mean
        w = (0.5 if self.symmetric else 1.0) * world * sizes[rank] / total
        bias_q = None
        if bias is not None:
            u_q, u_d, *mlp = bias
            u_d_all = g(u_d)
            bias_q = (u_q, u_d_all, *mlp)
        loss = multipos_infonce_partial(q, d_all, q_lo, q_hi, d_lo_all, d_hi_all, temperature=self.temperature,
                                        bias=bias_q, extra_neg=neg_all, row_weight=w, col_weight=0.0,
                                        diag_offset=start)
        if not self.symmetric:
            return loss
        q_all, q_lo_all, q_hi_all = g(q), g(q_lo), g(q_hi)
        bias_d = None if bias is None else (g(bias[0]), bias[1], *bias[2:])
        loss_d = multipos_infonce_partial(q_all, d, q_lo_all, q_hi_all, d_lo, d_hi, temperature=self.temperature,
                                          bias=bias_d, extra_neg=None, row_weight=0.0, col_weight=w,
                                          diag_offset=-start)
        return loss + loss_d
