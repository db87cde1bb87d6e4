"""Single-pass fused Matryoshka InfoNCE (spec: ../shared/design/tmrl-re3.md §2.3 K1): every nested-prefix
level of the loss from one pass over the feature dimension, at the matmul cost of one level.

The wrapper builds the per-level inverse prefix norms rho (K, B), kap (K, B'), kneg (K, N) with torch
(O((B + B' + N) * sum(dims)), differentiable); the kernel accumulates raw dot products segment by segment,
snapshots after each segment (level logits z_l = G_l * rho_l * kap_l / T), keeps one online log-sum-exp per
level, and in backward returns dL/dq, dL/dd, dL/dextra_neg through the raw products plus dL/drho, dL/dkap,
dL/dkneg, which autograd carries back through the norms. No (B, B') or (B, N) buffer, forward or backward."""
from __future__ import annotations

import math
import numbers
import warnings
from typing import List, Optional, Sequence, Tuple

import torch

from .common import (check_finite, check_positive, check_same_device, check_tensor, dtype_code, kernels, launch_args,
                     on_cuda_path, ptr)
from .multipos_infonce import _check_span, _span_bounds

EPS = 1e-12  # F.normalize's clamp of the norm


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _operand(t: torch.Tensor) -> torch.Tensor:
    if t.stride(-1) != 1 or (t.shape[0] > 1 and t.stride(0) < t.shape[1]):
        t = t.contiguous()
    return t


def _sizes(q, d, extra_neg, seg, diag_offset):
    N = 0 if extra_neg is None else extra_neg.shape[0]
    ldn = 0 if extra_neg is None else extra_neg.stride(0)
    return [q.shape[0], d.shape[0], N, q.shape[1], q.stride(0), d.stride(0), ldn, len(seg) - 1, int(diag_offset),
            *[int(s) for s in seg]]


def _ptrs(**kw):
    return {k: ptr(v) for k, v in kw.items() if v is not None}


@torch.library.custom_op("tempokern::matryoshka_infonce", mutates_args=())
def _mat(q: torch.Tensor, d: torch.Tensor, extra_neg: Optional[torch.Tensor], rho: torch.Tensor, kap: torch.Tensor,
         kneg: Optional[torch.Tensor], q_lo: torch.Tensor, q_hi: torch.Tensor, d_lo: torch.Tensor, d_hi: torch.Tensor,
         row_none: Optional[torch.Tensor], seg: List[int], coef: List[float], inv_temp: float, row_weight: float,
         col_weight: float, diag_offset: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    K = len(seg) - 1
    acc = q.dtype
    loss = torch.zeros((), dtype=acc, device=q.device)
    levels = torch.zeros(K, dtype=acc, device=q.device)
    row_stats = torch.zeros(K, 3, q.shape[0], dtype=acc, device=q.device)
    col_stats = torch.zeros(K, 3, d.shape[0], dtype=acc, device=q.device)
    dev, stream = launch_args(q)
    ptrs = _ptrs(q=q, d=d, neg=extra_neg, rho=rho, kap=kap, kneg=kneg, q_lo=q_lo, q_hi=q_hi, d_lo=d_lo, d_hi=d_hi,
                 row_none=row_none, loss=loss, levels=levels, row_stats=row_stats, col_stats=col_stats)
    kernels().matryoshka_infonce_launch("fwd", dev, stream, dtype_code(q), _sizes(q, d, extra_neg, seg, diag_offset),
                                        [inv_temp, row_weight, col_weight, *coef], ptrs)
    return loss, levels, row_stats, col_stats


@_mat.register_fake
def _(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, coef, inv_temp, row_weight, col_weight,
      diag_offset):
    K = len(seg) - 1
    return (q.new_empty(()), q.new_empty((K,)), q.new_empty((K, 3, q.shape[0])), q.new_empty((K, 3, d.shape[0])))


@torch.library.custom_op("tempokern::matryoshka_infonce_backward", mutates_args=())
def _mat_backward(lcoef: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor, q: torch.Tensor,
                  d: torch.Tensor, extra_neg: Optional[torch.Tensor], rho: torch.Tensor, kap: torch.Tensor,
                  kneg: Optional[torch.Tensor], q_lo: torch.Tensor, q_hi: torch.Tensor, d_lo: torch.Tensor,
                  d_hi: torch.Tensor, row_none: Optional[torch.Tensor], seg: List[int], inv_temp: float,
                  row_weight: float, col_weight: float, diag_offset: int) -> List[torch.Tensor]:
    coef = [float(c) for c in lcoef.detach().to("cpu", torch.float64).tolist()]
    z = lambda t: None if t is None else torch.zeros(t.shape, dtype=q.dtype, device=q.device)  # noqa: E731
    dq, dd, dneg, drho, dkap, dkneg = z(q), z(d), z(extra_neg), z(rho), z(kap), z(kneg)
    dev, stream = launch_args(q)
    row_stats, col_stats = row_stats.contiguous(), col_stats.contiguous()
    ptrs = _ptrs(q=q, d=d, neg=extra_neg, rho=rho, kap=kap, kneg=kneg, q_lo=q_lo, q_hi=q_hi, d_lo=d_lo, d_hi=d_hi,
                 row_none=row_none, row_stats=row_stats, col_stats=col_stats, dq=dq, dd=dd, dneg=dneg, drho=drho,
                 dkap=dkap, dkneg=dkneg)
    kernels().matryoshka_infonce_launch("bwd", dev, stream, dtype_code(q), _sizes(q, d, extra_neg, seg, diag_offset),
                                        [inv_temp, row_weight, col_weight, *coef], ptrs)
    return [dq, dd, q.new_empty(0) if dneg is None else dneg, drho, dkap, q.new_empty(0) if dkneg is None else dkneg]


@_mat_backward.register_fake
def _(lcoef, row_stats, col_stats, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp,
      row_weight, col_weight, diag_offset):
    return [torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(d, memory_format=torch.contiguous_format),
            q.new_empty(0) if extra_neg is None else torch.empty_like(extra_neg, memory_format=torch.contiguous_format),
            torch.empty_like(rho), torch.empty_like(kap), q.new_empty(0) if kneg is None else torch.empty_like(kneg)]


_NT = 11  # tensor inputs of the forward op
_GRAD_OF = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5}  # input index -> index among the backward's outputs


def _setup(ctx, inputs, output):
    _, _, row_stats, col_stats = output
    ctx.save_for_backward(row_stats, col_stats, *inputs[:_NT])
    ctx.present = [t is not None for t in inputs[:_NT]]
    ctx.seg, ctx.coef = inputs[_NT], inputs[_NT + 1]
    ctx.scalars = inputs[_NT + 2:]


def _backward(ctx, g_loss, g_levels, _g_rows, _g_cols):
    row_stats, col_stats, *ins = ctx.saved_tensors
    ins = [t if present else None for t, present in zip(ins, ctx.present)]
    w = torch.tensor(ctx.coef, dtype=row_stats.dtype, device=row_stats.device)
    lcoef = g_loss.reshape(()).to(w.dtype) * w
    if g_levels is not None:
        lcoef = lcoef + g_levels.to(w.dtype)
    grads = torch.ops.tempokern.matryoshka_infonce_backward(lcoef, row_stats, col_stats, *ins[:6], *ins[6:], ctx.seg,
                                                             *ctx.scalars)
    out = [None] * (_NT + 2 + len(ctx.scalars))
    for i, g in _GRAD_OF.items():
        if ins[i] is not None and ctx.needs_input_grad[i]:
            out[i] = grads[g]
    return tuple(out)


_mat.register_autograd(_backward, setup_context=_setup)


# ---- validation ------------------------------------------------------------------------------------

def check_dims(dims, H: int, weights=None) -> Tuple[List[int], List[float]]:
    """dims (any order) and weights -> (dims ascending, their weights). Raises ValueError/TypeError naming
    ``dims``/``weights``; warns when H is not among the dims (the trailing dimensions then get no gradient)."""
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) and not isinstance(dims, torch.Tensor):
        raise TypeError(f"dims must be a sequence of ints, got {type(dims).__name__}")
    dims = list(dims.tolist() if isinstance(dims, torch.Tensor) else dims)
    if not dims:
        raise ValueError("dims must not be empty")
    for m in dims:
        if isinstance(m, bool) or not isinstance(m, numbers.Integral):
            raise TypeError(f"dims must hold ints, got {m!r} ({type(m).__name__})")
    dims = [int(m) for m in dims]
    for m in dims:
        if m < 1 or m > H:
            raise ValueError(f"dims must lie in [1, {H}] (the embedding size), got {m}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"dims must be unique, got {dims}")
    if weights is None:
        w = [1.0] * len(dims)
    else:
        if isinstance(weights, torch.Tensor):
            weights = weights.detach().tolist()
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
            raise TypeError(f"weights must be a sequence of numbers, got {type(weights).__name__}")
        if len(weights) != len(dims):
            raise ValueError(f"weights has {len(weights)} entries, expected {len(dims)} (one per dim)")
        w = []
        for x in weights:
            if isinstance(x, bool) or not isinstance(x, numbers.Real):
                raise TypeError(f"weights must hold numbers, got {x!r}")
            x = float(x)
            if not math.isfinite(x) or x < 0:
                raise ValueError(f"weights must be finite and >= 0, got {x}")
            w.append(x)
    order = sorted(range(len(dims)), key=lambda k: dims[k])
    dims_s, w_s = [dims[k] for k in order], [w[k] for k in order]
    if dims_s[-1] != H:
        warnings.warn(f"matryoshka_infonce: the largest dim {dims_s[-1]} is smaller than the embedding size {H}; "
                      f"dimensions {dims_s[-1]}..{H - 1} get no gradient", stacklevel=3)
    return dims_s, w_s


def inverse_prefix_norms(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """(K, n): 1 / max(||x[:, :m]||, 1e-12) per dim m (differentiable; F.normalize's clamp)."""
    return torch.stack([torch.linalg.vector_norm(x[:, :m], dim=1).clamp_min(EPS).reciprocal() for m in dims]).contiguous()


def _id_spans(n: int, start: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return ids, ids


def matryoshka_partial(q, d, q_lo, q_hi, d_lo, d_hi, dims: Sequence[int], weights: Sequence[float], *,
                       temperature: float, extra_neg=None, row_weight: float = 1.0, col_weight: float = 0.0,
                       diag_offset: int = 0, row_none: Optional[torch.Tensor] = None, normalize: bool = True):
    """The kernel entry on validated inputs (dims ascending): q (Bq, H) vs d (Bd, H), int64 span bounds,
    per-level loss = row_weight * mean row loss + col_weight * mean column loss (diagonal fallback at
    column i + diag_offset). Returns (loss = sum_l weights_l level_l, levels (K,))."""
    if on_cuda_path(q):
        raise NotImplementedError("matryoshka_infonce: the CUDA path is not implemented yet (CPU tensors only)")
    acc = _acc(q.dtype)
    qk, dk = _operand(q.to(acc)), _operand(d.to(acc))
    nk = None if extra_neg is None else _operand(extra_neg.to(acc))
    if normalize:
        rho, kap = inverse_prefix_norms(qk, dims), inverse_prefix_norms(dk, dims)
        kneg = None if nk is None else inverse_prefix_norms(nk, dims)
    else:
        rho = qk.new_ones(len(dims), qk.shape[0])
        kap = qk.new_ones(len(dims), dk.shape[0])
        kneg = None if nk is None else qk.new_ones(len(dims), nk.shape[0])
    if row_none is not None:
        row_none = row_none.to(torch.uint8).contiguous()
    seg = [0, *[int(m) for m in dims]]
    loss, levels, _, _ = torch.ops.tempokern.matryoshka_infonce(
        qk, dk, nk, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, [float(w) for w in weights],
        1.0 / temperature, float(row_weight), float(col_weight), int(diag_offset))
    return loss, levels


def validate(q, d, dims, temperature, weights, extra_neg, symmetric, q_span, d_span, normalize, return_levels):
    check_tensor("q", q, ndim=2, floating=True)
    check_tensor("d", d, ndim=2, floating=True)
    if d.dtype != q.dtype:
        raise TypeError(f"d has dtype {d.dtype}, expected {q.dtype} like q")
    if d.shape[1] != q.shape[1]:
        raise ValueError(f"d has hidden size {d.shape[1]}, expected {q.shape[1]} like q")
    if q.shape[1] < 1:
        raise ValueError("q and d must have a hidden size >= 1")
    for name, v in (("symmetric", symmetric), ("normalize", normalize), ("return_levels", return_levels)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    if symmetric and d.shape[0] != q.shape[0]:
        raise ValueError(f"symmetric=True needs as many rows in d as in q (every column needs its diagonal "
                         f"partner), got {q.shape[0]} and {d.shape[0]}")
    if d.shape[0] < q.shape[0]:
        raise ValueError(f"d must have at least as many rows as q (row i's default positive is d[i]), got "
                         f"{q.shape[0]} and {d.shape[0]}")
    if q.shape[0] < 1:
        raise ValueError("q must have at least one row")
    temperature = check_positive("temperature", temperature)
    dims, weights = check_dims(dims, q.shape[1], weights)
    if extra_neg is not None:
        check_tensor("extra_neg", extra_neg, ndim=2, floating=True)
        if extra_neg.shape[1] != q.shape[1]:
            raise ValueError(f"extra_neg has hidden size {extra_neg.shape[1]}, expected {q.shape[1]} like q")
        if extra_neg.dtype != q.dtype:
            raise TypeError(f"extra_neg has dtype {extra_neg.dtype}, expected {q.dtype} like q")
    if (q_span is None) != (d_span is None):
        raise ValueError("q_span and d_span go together: give both or neither")
    devs = dict(q=q, d=d, extra_neg=extra_neg)
    if q_span is not None:
        _check_span("q_span", q_span, q.shape[0])
        _check_span("d_span", d_span, d.shape[0])
        devs.update(q_start=q_span[0], q_end=q_span[1], d_start=d_span[0], d_end=d_span[1])
    check_same_device(**devs)
    for n, t in (("q", q), ("d", d), ("extra_neg", extra_neg)):
        if t is not None:
            check_finite(n, t)
    return temperature, dims, weights


def matryoshka_infonce(q: torch.Tensor, d: torch.Tensor, dims: Sequence[int], *, temperature: float,
                       weights: Optional[Sequence[float]] = None, extra_neg: Optional[torch.Tensor] = None,
                       symmetric: bool = False, q_span=None, d_span=None, bias=None, normalize: bool = True,
                       return_levels: bool = False):
    """Fused Matryoshka InfoNCE, one pass over the feature dimension for all levels; same semantics as
    :func:`tempokern.reference.matryoshka_infonce` (the sentence-transformers MatryoshkaLoss loop).

    q (B, H), d (B', H) raw embeddings (B' >= B; B' == B when symmetric); dims: ints in [1, H], any order,
    unique (sorted ascending with their weights); weights: finite, >= 0, default 1 (a zero weight skips its
    level: no gradient through it). Per level m the embeddings' first m coordinates are L2-normalised
    (``normalize=False``: plain prefix dot products) and the logits divided by ``temperature``.
    Positives: d[i] for q[i], or with q_span/d_span (integer (start, end) pairs) the multi-positive
    interval overlap of :func:`tempokern.multipos_infonce` (diagonal fallback). extra_neg (N, H) joins the
    q->d denominators only. symmetric=True: each level is (q->d + d->q) / 2.
    Returns the 0-d weighted sum of the level losses (float32; float64 for float64 input), or with
    ``return_levels=True`` ``(loss, levels)`` with the K level losses in ascending-dim order (differentiable).
    Memory O((B + B' + N) * (H + K)); no B x B' or B x N buffer, forward or backward."""
    temperature, dims, weights = validate(q, d, dims, temperature, weights, extra_neg, symmetric, q_span, d_span,
                                          normalize, return_levels)
    if bias is not None:
        raise NotImplementedError("matryoshka_infonce: bias is not implemented in the fused op yet "
                                  "(tempokern.reference.matryoshka_infonce has it)")
    if q_span is None:
        q_lo, q_hi = _id_spans(q.shape[0], 0, q.device)
        d_lo, d_hi = _id_spans(d.shape[0], 0, q.device)
    else:
        q_lo, q_hi = _span_bounds(q_span)
        d_lo, d_hi = _span_bounds(d_span)
    w = 0.5 if symmetric else 1.0
    loss, levels = matryoshka_partial(q, d, q_lo, q_hi, d_lo, d_hi, dims, weights, temperature=temperature,
                                      extra_neg=extra_neg, row_weight=w, col_weight=w if symmetric else 0.0,
                                      normalize=normalize)
    return (loss, levels) if return_levels else loss


def truncate(emb: torch.Tensor, m: int) -> torch.Tensor:
    """The Matryoshka embedding at dim m: ``F.normalize(emb[..., :m], dim=-1)`` (inference, indexing)."""
    check_tensor("emb", emb, floating=True)
    if emb.dim() < 1:
        raise ValueError("emb must have at least one dimension")
    if isinstance(m, bool) or not isinstance(m, numbers.Integral):
        raise TypeError(f"m must be an int, got {type(m).__name__}")
    if not 1 <= int(m) <= emb.shape[-1]:
        raise ValueError(f"m must lie in [1, {emb.shape[-1]}] (the embedding size), got {m}")
    return torch.nn.functional.normalize(emb[..., :int(m)], dim=-1)
