"""CTDLoss: the ChunQiuTR training loss (multi-positive interval-overlap InfoNCE plus the relative-offset
bias) as a module on the fused kernel, with optional all-gather of the batch over torch.distributed."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .._ops.common import check_reciprocal
from .._ops.multipos_blocked import none_flags, spans32
from .._ops.loss_args import check_bias_table_points, check_groups, span_bounds
from .._ops.multipos_infonce import validate
from .._ops.routing import multipos_infonce, multipos_infonce_partial
from .._ops.offset_bias import offset_bias as _offset_bias
from .offset_bias import bias_params

GATHER_MODES = ("tempokern", "chunqiutr")


def _bias_tuple(offset_bias, u_q, u_d):
    return (u_q, u_d, *bias_params(offset_bias))


def _sizes(n: int, world: int, group, device) -> list:
    """The first-dimension size of a tensor on every rank."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(parts, t, group=group)
    return [int(p.item()) for p in parts]


def _meta(q: torch.Tensor, extra_neg, bias, mode: str, world: int, group) -> list:
    """Every rank's (B, has extra_neg, N, has bias, H, gather mode) in one all_gather, checked for
    agreement: ranks that disagree raise the same ValueError together (instead of hanging in a
    collective that only some of them enter)."""
    row = [q.shape[0], extra_neg is not None, 0 if extra_neg is None else extra_neg.shape[0], bias is not None,
           q.shape[1], GATHER_MODES.index(mode)]
    t = torch.tensor([int(x) for x in row], dtype=torch.int64, device=q.device)
    parts = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(parts, t, group=group)
    rows = [[int(v) for v in p.tolist()] for p in parts]

    def disagree(col, what):
        vals = [r[col] for r in rows]
        if len(set(vals)) > 1:
            raise ValueError(f"CTDLoss(gather=True): ranks disagree on {what}: {vals} (rank order); every rank "
                             "must pass the same kind of inputs")
    disagree(1, "whether extra_neg is given")
    disagree(3, "whether the offset bias is used (u_q/u_d given)")
    disagree(4, "the embedding size H")
    disagree(5, "gather_mode (0 = tempokern, 1 = chunqiutr)")
    if mode == "chunqiutr":
        disagree(0, "the batch size (gather_mode='chunqiutr' all-gathers equal-sized batches, as the reference)")
        disagree(2, "the number of extra negatives (gather_mode='chunqiutr' needs equal counts, as the reference)")
    return rows


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

    ``forward(q, d, q_span, d_span, u_q=None, u_d=None, extra_neg=None, q_group=None, d_group=None)``: q, d
    (B, H) query/document embeddings (L2-normalised here when ``normalize``), spans = (start, end) integer (B,)
    tensors, u_q/u_d (B,) latent calendar positions (needed iff ``offset_bias`` is given), extra_neg (N, H)
    extra negatives for the q->d direction. q_group/d_group (B,) integer group ids (both or neither):
    group-scoped positives (the overlaps within a group, plus each row's own document always; see
    :func:`tempokern.multipos_infonce`), gathered with the batch under ``gather=True``; None: the overlap
    positives of ChunQiuTR. ``offset_bias``: a ``tempokern.nn.OffsetBias`` (any module with
    ``mlp[0]``/``mlp[2]`` Linear layers and a ``scale`` parameter); its bias is added inside the kernel.

    ``gather=True`` with an initialised torch.distributed group: documents, queries, spans, u and extra
    negatives are all-gathered. Two semantics (``gather_mode``):

    * ``"tempokern"`` (default): rank r scores its B_r local queries against all T = sum_r B_r documents
      (and, when symmetric, its local documents against all T queries), the bias on every pair. The
      rank's loss is ``(W B_r / T) * (w * mean_{local rows} row_loss + w * mean_{local columns} col_loss)``
      (W ranks; w = 1/2 symmetric, else 1 and no column term; the factor is 1 when every rank has the same
      batch size), so **the mean over ranks equals the single-process loss on the concatenated batch**
      (what DDP's gradient averaging then optimises), also when local batch sizes (an epoch's last batch)
      or extra_neg counts differ, and with the bias. Gradients: the rank's own slice of the gathered
      tensors keeps its autograd graph, other ranks' slices arrive detached, so local embeddings get the
      exact gradient of every term in which a local row or column is the anchor (including local
      embeddings as candidates of local anchors), not of the terms where they are candidates for another
      rank's anchors.
    * ``"chunqiutr"``: exactly ChunQiuTR's ``contrastive_loss_global_inbatch`` (``retrieval_utils.py``):
      everything gathered is detached, the rank's own slice too (only the local anchors q_r in q->d and
      d_r in d->q carry gradients); the q->d gallery is [all documents, all extra negatives]; the bias is
      added to the local B x B block only; row positives are the overlaps with all documents, else the
      global diagonal; the d->q positives are the overlaps of d_r with all queries, else the global
      diagonal (the raw overlap, not the transposed row-fallback mask the single-process loss uses);
      loss = mean over local rows (+ mean over local columns, halved, when symmetric), no rank weighting.
      Every rank must have the same B and extra-negative count (the reference's all_gather needs that).
      Not fused: plain PyTorch on the rank's (B_r, T + N_total) block, as the reference (memory
      O(B_r * (T + N_total))); for reproduction, not for large batches.

    Ranks that disagree on extra_neg or bias presence, H or the mode raise ValueError (all of them),
    instead of hanging. Without an initialised group, gather=True computes the local loss."""

    def __init__(self, temperature: float = 0.05, offset_bias: Optional[torch.nn.Module] = None,
                 symmetric: bool = True, normalize: bool = True, gather: bool = False,
                 gather_mode: str = "tempokern", bias_table_points: Optional[int] = None):
        super().__init__()
        self.temperature = check_reciprocal("temperature", temperature, torch.float64)  # forward: its dtype
        if offset_bias is not None and not (hasattr(offset_bias, "mlp") and hasattr(offset_bias, "scale")):
            raise TypeError("offset_bias must be a tempokern.nn.OffsetBias (a module with .mlp and .scale), "
                            f"got {type(offset_bias).__name__}")
        self.offset_bias = offset_bias
        for name, v in (("symmetric", symmetric), ("normalize", normalize), ("gather", gather)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
        self.symmetric, self.normalize, self.gather = symmetric, normalize, gather
        if gather_mode not in GATHER_MODES:
            raise ValueError(f"gather_mode must be one of {GATHER_MODES}, got {gather_mode!r}")
        self.gather_mode = gather_mode
        if bias_table_points is not None:
            if offset_bias is None:
                raise ValueError("bias_table_points needs an offset_bias")
            check_bias_table_points(bias_table_points, ())
            if gather and gather_mode == "chunqiutr":
                raise ValueError("bias_table_points is not available with gather_mode='chunqiutr' (plain torch)")
        self.bias_table_points = bias_table_points

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}, symmetric={self.symmetric}, normalize={self.normalize}, "
                f"gather={self.gather}, gather_mode={self.gather_mode!r}, "
                f"bias_table_points={self.bias_table_points}")

    def forward(self, q: torch.Tensor, d: torch.Tensor, q_span, d_span, u_q: Optional[torch.Tensor] = None,
                u_d: Optional[torch.Tensor] = None, extra_neg: Optional[torch.Tensor] = None,
                q_group: Optional[torch.Tensor] = None, d_group: Optional[torch.Tensor] = None) -> torch.Tensor:
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
                                    extra_neg=extra_neg, symmetric=self.symmetric,
                                    bias_table_points=self.bias_table_points, q_group=q_group, d_group=d_group)
        return self._gathered(q, d, q_span, d_span, bias, extra_neg, q_group, d_group)

    def _gathered(self, q, d, q_span, d_span, bias, extra_neg, q_group=None, d_group=None):
        dist = torch.distributed
        validate(q, d, q_span, d_span, self.temperature, bias, extra_neg, self.symmetric)
        q_group, d_group = check_groups(q_group, d_group, q.shape[0], d.shape[0])
        group, rank, world = None, dist.get_rank(), dist.get_world_size()
        meta = _meta(q, extra_neg, bias, self.gather_mode, world, group)
        sizes = [m[0] for m in meta]
        disagree = torch.tensor([int(q_group is not None)], dtype=torch.int64, device=q.device)
        flags = [torch.empty_like(disagree) for _ in range(world)]
        dist.all_gather(flags, disagree, group=group)
        if len({int(f.item()) for f in flags}) > 1:
            raise ValueError("CTDLoss(gather=True): ranks disagree on whether q_group/d_group are given: "
                             f"{[int(f.item()) for f in flags]} (rank order)")
        if self.gather_mode == "chunqiutr":
            return self._chunqiutr(q, d, q_span, d_span, bias, extra_neg, rank, world, group, q_group, d_group)
        start, total = sum(sizes[:rank]), sum(sizes)
        if total == 0:
            raise ValueError("gather=True: every rank has an empty batch")
        q_lo, q_hi = span_bounds(q_span)
        d_lo, d_hi = span_bounds(d_span)
        g = lambda x: _gather(x, rank, world, group, sizes)  # noqa: E731
        d_all, d_lo_all, d_hi_all = g(d), g(d_lo), g(d_hi)
        dg_all = None if d_group is None else g(d_group)
        neg_all = None if extra_neg is None else _gather(extra_neg, rank, world, group, [m[2] for m in meta])
        # each rank's mean over its own rows, weighted so that the mean over ranks is the global mean
        w = (0.5 if self.symmetric else 1.0) * world * sizes[rank] / total
        bias_q = None
        if bias is not None:
            u_q, u_d, *mlp = bias
            u_d_all = g(u_d)
            bias_q = (u_q, u_d_all, *mlp)
        loss = multipos_infonce_partial(q, d_all, q_lo, q_hi, d_lo_all, d_hi_all, temperature=self.temperature,
                                        bias=bias_q, extra_neg=neg_all, row_weight=w, col_weight=0.0,
                                        diag_offset=start, bias_table_points=self.bias_table_points,
                                        q_group=q_group, d_group=dg_all)
        if not self.symmetric:
            return loss
        q_all, q_lo_all, q_hi_all = g(q), g(q_lo), g(q_hi)
        bias_d = None if bias is None else (g(bias[0]), bias[1], *bias[2:])
        # the column fallback needs to know which queries overlap no document on any rank (ChunQiuTR's d->q mask
        # is the row-fallback mask transposed): decided here against all documents (with groups: every
        # query's own document is a positive, nothing to decide)
        qg_all = row_none = None
        if q_group is None:
            row_none = none_flags(*spans32(q_lo_all, q_hi_all, d_lo_all, d_hi_all))[0].bool()
        else:
            qg_all = g(q_group)
        loss_d = multipos_infonce_partial(q_all, d, q_lo_all, q_hi_all, d_lo, d_hi, temperature=self.temperature,
                                          bias=bias_d, extra_neg=None, row_weight=0.0, col_weight=w,
                                          diag_offset=-start, row_none=row_none,
                                          bias_table_points=self.bias_table_points, q_group=qg_all,
                                          d_group=d_group)
        return loss + loss_d

    def _chunqiutr(self, q, d, q_span, d_span, bias, extra_neg, rank, world, group, q_group=None, d_group=None):
        """contrastive_loss_global_inbatch of the ChunQiuTR reference, term for term (see the class doc); with
        groups, the overlaps within a group plus the global diagonal always."""
        def gather_detached(x):
            parts = [torch.empty_like(x) for _ in range(world)]
            torch.distributed.all_gather(parts, x.detach().contiguous(), group=group)
            return torch.cat(parts, dim=0)

        B, dev = q.shape[0], q.device
        q_lo, q_hi = span_bounds(q_span)
        d_lo, d_hi = span_bounds(d_span)
        q_all, d_all = gather_detached(q), gather_detached(d)
        gallery = d_all if extra_neg is None else torch.cat([d_all, gather_detached(extra_neg)], dim=0)
        q_lo_all, q_hi_all = gather_detached(q_lo), gather_detached(q_hi)
        d_lo_all, d_hi_all = gather_detached(d_lo), gather_detached(d_hi)
        T, c0 = d_all.shape[0], rank * B
        diag = torch.arange(B, device=dev) + c0
        rows = torch.arange(B, device=dev)
        s_qd = (q @ gallery.t()) / self.temperature                       # (B, T + N_total)
        tb = None
        if bias is not None:
            tb = _offset_bias(*bias).to(s_qd.dtype)                       # (B, B): local block only
            s_qd = torch.cat([s_qd[:, :c0], s_qd[:, c0:c0 + B] + tb, s_qd[:, c0 + B:]], dim=1)
        pos = (q_lo[:, None] <= d_hi_all[None, :]) & (q_hi[:, None] >= d_lo_all[None, :])   # (B, T)
        if q_group is not None:
            dg_all = gather_detached(d_group)
            pos &= q_group[:, None] == dg_all[None, :]
        pos = torch.cat([pos, pos.new_zeros(B, gallery.shape[0] - T)], dim=1)
        pos[rows, diag] |= ~pos.any(dim=1) if q_group is None else True
        loss = _multipos_rows(s_qd, pos)
        if not self.symmetric:
            return loss
        s_dq = (d @ q_all.t()) / self.temperature                         # (B, T)
        if tb is not None:
            s_dq = torch.cat([s_dq[:, :c0], s_dq[:, c0:c0 + B] + tb.t(), s_dq[:, c0 + B:]], dim=1)
        pos_t = (d_lo[:, None] <= q_hi_all[None, :]) & (d_hi[:, None] >= q_lo_all[None, :])
        if q_group is not None:
            pos_t &= d_group[:, None] == gather_detached(q_group)[None, :]
        pos_t[rows, diag] |= ~pos_t.any(dim=1) if q_group is None else True
        return 0.5 * (loss + _multipos_rows(s_dq, pos_t))


def _multipos_rows(s: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """mean_i [logsumexp_j s_ij - logsumexp_{j in pos_i} s_ij] (every row has a positive)."""
    fill = torch.finfo(s.dtype).min
    return (torch.logsumexp(s, dim=1) - torch.logsumexp(s.masked_fill(~pos, fill), dim=1)).mean()
