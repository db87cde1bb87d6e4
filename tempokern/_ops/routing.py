"""The loss entry points that route calls between the two InfoNCE op modules: :func:`multipos_infonce`
(whose candidate tensor-core route runs the Matryoshka kernels for one level of all H features) and
:func:`matryoshka_infonce` (whose CUDA levels path runs :func:`multipos_infonce` once per level). The op
modules (multipos_infonce.py, matryoshka_infonce.py) hold the kernels and their custom ops and import neither
each other nor this module; the table of default and candidate paths is dispatch.py."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import backend, dispatch
from .common import acc_dtype, check_same_device
from .loss_args import (BIAS_NAMES, check_bias_table_points, check_groups, group_scoped_bounds, id_spans, span_bounds,
                        validate_bias)
from .matryoshka_blocked import tc_call
from .matryoshka_infonce import matryoshka_partial, matryoshka_path
from .matryoshka_infonce import validate as validate_matryoshka
from .multipos_infonce import multipos_kernel_partial
from .multipos_infonce import validate as validate_multipos


class MultiposCall:
    """A multipos_infonce call as the dispatch table sees it (tempokern/_ops/dispatch.py's predicates read it)."""
    __slots__ = ("q", "d", "bias", "extra_neg", "table_points", "return_hardest", "groups", "table", "rows", "cols")

    def __init__(self, q, d, bias, extra_neg, table_points, return_hardest: bool, groups: bool):
        self.q, self.d, self.bias, self.extra_neg = q, d, bias, extra_neg
        self.table_points, self.return_hardest, self.groups = table_points, return_hardest, groups
        self.table = table_points is not None
        self.rows, self.cols = q.shape[0], d.shape[0]

    def tensor_cores(self, be) -> bool:
        """tc_call for one level of H features (which also rules out extra negatives, the exact bias and H not a
        multiple of 16)."""
        return tc_call(self.q, self.d, [self.q.shape[1]], self.extra_neg, self.bias, self.table_points, be)


def multipos_infonce_partial(q, d, q_lo, q_hi, d_lo, d_hi, *, temperature: float, bias=None, extra_neg=None,
                             row_weight: float = 1.0, col_weight: float = 0.0, diag_offset: int = 0,
                             bias_table_points: Optional[int] = None, row_none: Optional[torch.Tensor] = None,
                             return_hardest: bool = False, q_group: Optional[torch.Tensor] = None,
                             d_group: Optional[torch.Tensor] = None):
    """The kernel entry on validated inputs: q (Bq, H) vs d (Bd, H), spans as int64 (lo, hi) bounds,
    row/column weights (each loss is the mean over its own rows/columns) and the diagonal offset
    (row i's fallback positive is column i + diag_offset). Used by multipos_infonce and CTDLoss.
    ``row_none`` (Bq,) bool: rows with no overlapping document anywhere (default: none among these d), which
    decides the column fallback (CTDLoss's gathered column pass sees only the local documents).
    The path is dispatch.choose's (tempokern/_ops/dispatch.py): the enabled mpb_tc candidate (the Matryoshka
    tensor-core kernels for one level) where it takes the call, else the blocked path or the fused tiled kernel
    (multipos_kernel_partial).
    ``return_hardest``: returns ``(loss, hardest)``, hardest (Bq,) int64 the hardest in-batch negative of each
    row (see :func:`multipos_infonce`), in the caller's row and column order (the CPU path's u-sort undone).
    ``q_group``/``d_group`` (int64 (Bq,), (Bd,), checked): group-scoped positives, the overlaps within a group
    plus each row's diagonal partner always. Every kernel path takes them the same way: the bounds become
    :func:`group_scoped_bounds` (on which overlap means overlap within a group) and ``row_none`` all ones (a
    row's diagonal partner is a row positive, and then a column positive, on every path); ``row_none`` must
    then be None. Group-scoped calls stay off the mpb_tc candidate (the blocked or the fused kernels)."""
    path = dispatch.choose(dispatch.MULTIPOS, MultiposCall(q, d, bias, extra_neg, bias_table_points, return_hardest,
                                                          q_group is not None), backend.resolve(q)).name
    if q_group is not None:
        if row_none is not None:
            raise ValueError("row_none cannot be combined with q_group/d_group (with groups every row's diagonal "
                             "partner is a positive)")
        q_lo, q_hi, d_lo, d_hi = group_scoped_bounds(q_group, d_group, q_lo, q_hi, d_lo, d_hi)
        row_none = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    if path == "mpb_tc":
        if row_none is not None:
            row_none = row_none.to(torch.uint8).contiguous()
        return matryoshka_partial(q, d, q_lo, q_hi, d_lo, d_hi, [q.shape[1]], [1.0], temperature=temperature,
                                  row_weight=row_weight, col_weight=col_weight, diag_offset=diag_offset,
                                  row_none=row_none, normalize=False, bias=bias,
                                  bias_table_points=bias_table_points, tensor_cores=True)[0]
    return multipos_kernel_partial(q, d, q_lo, q_hi, d_lo, d_hi, temperature=temperature, bias=bias,
                                   extra_neg=extra_neg, row_weight=row_weight, col_weight=col_weight,
                                   diag_offset=diag_offset, bias_table_points=bias_table_points, row_none=row_none,
                                   return_hardest=return_hardest, blocked=path == "blocked")


def multipos_infonce(q: torch.Tensor, d: torch.Tensor, q_span, d_span, *, temperature: float,
                     bias: Optional[Sequence[torch.Tensor]] = None, extra_neg: Optional[torch.Tensor] = None,
                     symmetric: bool = True, bias_table_points: Optional[int] = None,
                     return_hardest: bool = False, q_group: Optional[torch.Tensor] = None,
                     d_group: Optional[torch.Tensor] = None):
    """Fused multi-positive interval-overlap InfoNCE; same semantics as
    :func:`tempokern.reference.multipos_infonce`.

    CPU (no table): one tiled kernel, memory O((B + N) * H + B * hidden * D). CUDA: cuBLAS score blocks
    and fused passes around them (tempokern/_ops/multipos_blocked.py), memory O(R * (B + N)) for blocks of
    R rows (the whole batch when it fits in 1 GiB). ``bias_table_points=N`` (with a bias): the table mode,
    the MLP evaluated exactly at N points of [-1, 1] and linearly interpolated (gradients exact for the
    interpolant; 4097 recommended, see docs/multipos_infonce.md); None: the exact MLP per pair.

    q, d (B, H) used as given; q_span = (q_start, q_end), d_span = (d_start, d_end) integer (B,) tensors
    (closed intervals, either order); bias None or offset_bias's (u_q, u_d, w1, b1, w2, b2, scale);
    extra_neg (N, H) joins the q->d denominators only. Returns a 0-d float32 tensor (float64 for
    float64 input); gradients flow to q, d, extra_neg and all seven bias inputs.

    ``return_hardest=True`` returns ``(loss, hardest_col)``: hardest_col (B,) int64, for each row i the column
    j among the B in-batch documents (never extra_neg) that is not a positive of row i (no span overlap, and
    not the diagonal when the row falls back to it) with the largest logit s_ij = q_i . d_j / temperature +
    bias_ij (the logit the softmax sees), the lowest j among exact ties, -1 when the row has no negative;
    spec: :func:`tempokern.reference.hardest_negatives`. A by-product of the forward pass (O(B) extra
    state, no extra product); not differentiable.

    ``q_group``, ``d_group``: optional integer (B,) group ids, both or neither (for example the entity or page
    a query asks about and the page a document comes from). Given, the positives of row i are the documents
    whose interval overlaps and whose group equals q_group[i], plus row i's own document d[i] always (also
    when other documents overlap); the d->q direction uses the same mask. None: the interval overlaps with
    the diagonal fallback above, unchanged (ChunQiuTR's positives). No B x B mask is built: the kernels see
    group-scoped span bounds (O(B) memory, see docs/multipos_infonce.md)."""
    if not isinstance(return_hardest, bool):
        raise TypeError(f"return_hardest must be a bool, got {type(return_hardest).__name__}")
    temperature, bias = validate_multipos(q, d, q_span, d_span, temperature, bias, extra_neg, symmetric)
    q_group, d_group = check_groups(q_group, d_group, q.shape[0], d.shape[0])
    if q_group is not None:
        check_same_device(q=q, q_group=q_group, d_group=d_group)
    bias_table_points = check_bias_table_points(bias_table_points, bias)
    q_lo, q_hi = span_bounds(q_span)
    d_lo, d_hi = span_bounds(d_span)
    w = 0.5 if symmetric else 1.0
    return multipos_infonce_partial(q, d, q_lo, q_hi, d_lo, d_hi, temperature=temperature, bias=bias,
                                    extra_neg=extra_neg, row_weight=w, col_weight=w if symmetric else 0.0,
                                    diag_offset=0, bias_table_points=bias_table_points,
                                    return_hardest=return_hardest, q_group=q_group, d_group=d_group)


def matryoshka_infonce(q: torch.Tensor, d: torch.Tensor, dims: Sequence[int], *, temperature: float,
                       weights: Optional[Sequence[float]] = None, extra_neg: Optional[torch.Tensor] = None,
                       symmetric: bool = False, q_span=None, d_span=None, bias=None, normalize: bool = True,
                       return_levels: bool = False, bias_table_points: Optional[int] = None):
    """Fused Matryoshka InfoNCE, one pass over the feature dimension for all levels; same semantics as
    :func:`tempokern.reference.matryoshka_infonce` (the sentence-transformers MatryoshkaLoss loop).

    q (B, H), d (B', H) raw embeddings (B' >= B; B' == B when symmetric); dims: ints in [1, H], any order,
    unique (sorted ascending with their weights); weights: finite, >= 0, default 1 (a zero weight skips its
    level: no gradient through it). Per level m the embeddings' first m coordinates are L2-normalised
    (``normalize=False``: plain prefix dot products) and the logits divided by ``temperature``.
    Positives: d[i] for q[i], or with q_span/d_span (integer (start, end) pairs) the multi-positive
    interval overlap of :func:`tempokern.multipos_infonce` (diagonal fallback). extra_neg (N, H) joins the
    q->d denominators only. symmetric=True: each level is (q->d + d->q) / 2.
    bias: None, offset_bias's 7-tuple (u_q (B,), u_d (B',), w1, b1, w2, b2, scale) or (u_q, u_d, module) with
    a :class:`tempokern.nn.OffsetBias`, as :func:`tempokern.multipos_infonce` accepts: the same per-pair bias
    added to every level's q->d logits (not to extra_neg's), computed once per row block and shared by the
    K levels; gradients reach all seven inputs (a module's own parameters). ``bias_table_points=N`` (an int
    >= 2, with a bias): the table mode (the MLP exact at N points of [-1, 1], linearly interpolated). With a
    bias every device runs the blocked path (blocks of R rows, memory O(R * B')).
    Returns the 0-d weighted sum of the level losses (float32; float64 for float64 input), or with
    ``return_levels=True`` ``(loss, levels)`` with the K level losses in ascending-dim order (differentiable).
    Memory O((B + B' + N) * (H + K)); no B x B' or B x N buffer, forward or backward."""
    temperature, dims, weights = validate_matryoshka(q, d, dims, temperature, weights, extra_neg, symmetric, q_span,
                                                     d_span, normalize, return_levels)
    top = max(dims)
    if top < q.shape[1]:  # columns past the largest dim are not read (as in the reference: a NaN there stays out)
        q, d = q[:, :top], d[:, :top]
        extra_neg = None if extra_neg is None else extra_neg[:, :top]
    if bias is not None:
        bias = validate_bias(bias, q.shape[0], d.shape[0])
        check_same_device(q=q, **{f"bias {n}": t for n, t in zip(BIAS_NAMES, bias)})
    bias_table_points = check_bias_table_points(bias_table_points, bias)
    path = matryoshka_path(q, d, dims, bias, extra_neg, bias_table_points)
    if path == "levels":
        loss, levels = _levels_path(q, d, dims, weights, temperature, extra_neg, symmetric, q_span, d_span, normalize,
                                    return_levels)
        loss = _zero_weight_nonfinite(loss, q, d, extra_neg, bias, dims, weights)
        return (loss, levels) if return_levels else loss
    if q_span is None:
        q_lo, q_hi = id_spans(q.shape[0], 0, q.device)
        d_lo, d_hi = id_spans(d.shape[0], 0, q.device)
    else:
        q_lo, q_hi = span_bounds(q_span)
        d_lo, d_hi = span_bounds(d_span)
    w = 0.5 if symmetric else 1.0
    loss, levels = matryoshka_partial(q, d, q_lo, q_hi, d_lo, d_hi, dims, weights, temperature=temperature,
                                      extra_neg=extra_neg, row_weight=w, col_weight=w if symmetric else 0.0,
                                      normalize=normalize, bias=bias, bias_table_points=bias_table_points,
                                      tensor_cores=path == "mrl_tc")
    loss = _zero_weight_nonfinite(loss, q, d, extra_neg, bias, dims, weights)
    return (loss, levels) if return_levels else loss


def _zero_weight_nonfinite(loss, q, d, extra_neg, bias, dims, weights):
    """A zero-weight level is skipped, but the reference adds 0 x its loss: NaN when a NaN or an infinity sits in
    the coordinates it reads (its prefix of q, d and extra_neg, or the bias inputs). ``(x * 0).sum()`` over those
    is 0 for finite input (no overflow, gradient exactly 0) and NaN otherwise, so the loss is NaN exactly where
    the reference's is; it costs one elementwise pass over the widest zero-weight prefix."""
    zero = [int(m) for m, w in zip(dims, weights) if float(w) == 0.0]
    if not zero:
        return loss
    mz = max(zero)
    parts = [q[:, :mz], d[:, :mz]] + ([] if extra_neg is None else [extra_neg[:, :mz]])
    parts += [t for t in (bias or ()) if isinstance(t, torch.Tensor)]
    term = sum((t * 0).sum().to(loss.dtype) for t in parts)
    return loss + term


def _levels_path(q, d, dims, weights, temperature, extra_neg, symmetric, q_span, d_span, normalize, want_levels):
    """The reference's loop (tempokern.reference.matryoshka_infonce) with tempokern's fused multipos_infonce per
    level: on a GPU each level is the blocked cuBLAS + fused-pass loss the GPU suite measures (no B x B' buffer
    kept across levels; per level O(block x B')). K single-level losses of width m_k instead of the fused
    kernels' K per-level score blocks through HBM on every pass (docs/matryoshka_infonce.md, "CUDA: the levels
    path")."""
    if q_span is None:  # candidate i is row i's positive: spans (i, i) overlap only on the diagonal
        q_lo, q_hi = d_lo, d_hi = id_spans(q.shape[0], 0, q.device)
    else:  # (validated with the call: each level runs multipos_infonce's kernels on these bounds, not re-checked)
        q_lo, q_hi = span_bounds(q_span)
        d_lo, d_hi = span_bounds(d_span)
    w = 0.5 if symmetric else 1.0
    order = sorted(range(len(dims)), key=lambda k: dims[k])
    if normalize:
        def shrink(x, m):
            return torch.nn.functional.normalize(x[:, :m], dim=-1)
    else:
        def shrink(x, m):
            return x[:, :m]
    levels = []
    for k in order:
        m, wk = int(dims[k]), float(weights[k])
        if wk == 0.0 and not want_levels:
            continue
        # a zero-weight level is left out of the loss; with return_levels its value (and the gradient of the
        # returned levels) is still there, as in the reference and the fused kernels
        lv = multipos_infonce_partial(shrink(q, m), shrink(d, m), q_lo, q_hi, d_lo, d_hi, temperature=temperature,
                                      extra_neg=None if extra_neg is None else shrink(extra_neg, m), row_weight=w,
                                      col_weight=w if symmetric else 0.0)
        levels.append((wk, lv))
    live = [wk * lv for wk, lv in levels if wk != 0.0]
    loss = sum(live[1:], live[0]) if live else q.new_zeros((), dtype=acc_dtype(q.dtype))
    if not want_levels:
        return loss, None
    return loss, torch.stack([lv for _, lv in levels])
