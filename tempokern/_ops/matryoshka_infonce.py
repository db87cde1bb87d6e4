"""Single-pass fused Matryoshka InfoNCE (spec: tempokern.reference.matryoshka_infonce and the TMRL paper): every nested-prefix
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

from .common import (acc_dtype, check_finite, check_reciprocal, check_same_device, check_tensor, compiling,
                     device_constant, dtype_code, ptr)
from . import backend, dispatch
from .loss_args import check_span
from .matryoshka_blocked import blocked_backward, blocked_forward, tc_call, use_fused
from ..reference.offset_bias import offset_bias_table

EPS = 1e-12  # F.normalize's clamp of the norm


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


#: per-thread logit buffer the CPU kernel may keep for the gradient-in-forward, checked for 64-row blocks
#: (K x 64 rows x (B' + N)); the kernel itself uses 32-256 rows per block, at most 8 MiB of logits unless 32 rows
#: need more (so never more than this check allows)
GIF_BUDGET_BYTES = 256 * 2**20


def _blocked(be) -> bool:
    """The blocked path: the CUDA kernels' backends, and a CPU backend a test installed block rows on."""
    return be.cuda_path or be.block_rows is not None


def _block_rows(be) -> int:
    return 0 if be.block_rows is None else be.block_rows


def _gif(want_grad: bool, col_weight: float, K: int, Bd: int, N: int, itemsize: int, be=None) -> bool:
    """Whether the forward also computes the gradient (unit upstream gradient, scaled in backward): only
    without a column term (the row statistics of a row block are then final after its own pass), saving
    the backward's recomputed products (6 instead of 8 B B' H flops)."""
    if be is not None and _blocked(be):  # the fused CUDA path does it without a budget (blocks of rows)
        return bool(want_grad) and col_weight == 0.0 and use_fused(be, Bd)
    return bool(want_grad) and col_weight == 0.0 and K * 64 * (Bd + N) * itemsize <= GIF_BUDGET_BYTES


@torch.library.custom_op("tempokern::matryoshka_infonce", mutates_args=())
def _mat(q: torch.Tensor, d: torch.Tensor, extra_neg: Optional[torch.Tensor], rho: torch.Tensor, kap: torch.Tensor,
         kneg: Optional[torch.Tensor], q_lo: torch.Tensor, q_hi: torch.Tensor, d_lo: torch.Tensor, d_hi: torch.Tensor,
         row_none: Optional[torch.Tensor], seg: List[int], coef: List[float], inv_temp: float, row_weight: float,
         col_weight: float, diag_offset: int, bf16_operands: bool, tensor_cores: bool,
         want_grad: bool) -> List[torch.Tensor]:
    K = len(seg) - 1
    acc = q.dtype
    N = 0 if extra_neg is None else extra_neg.shape[0]
    be = backend.resolve(q)
    if _blocked(be):
        gif = _gif(want_grad, col_weight, K, d.shape[0], N, q.element_size(), be)
        out = blocked_forward(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, coef, inv_temp,
                              row_weight, col_weight, diag_offset, _block_rows(be), want_grad=gif,
                              known_half=torch.bfloat16 if bf16_operands else None, tensor_cores=tensor_cores, be=be)
        return out if gif else out + [q.new_empty(0) for _ in range(6)]
    loss = torch.zeros((), dtype=acc, device=q.device)
    levels = torch.zeros(K, dtype=acc, device=q.device)
    row_stats = torch.zeros(K, 3, q.shape[0], dtype=acc, device=q.device)
    col_stats = torch.zeros(K, 3, d.shape[0], dtype=acc, device=q.device)
    grads = dict(dq=None, dd=None, dneg=None, drho=None, dkap=None, dkneg=None)
    if _gif(want_grad, col_weight, K, d.shape[0], N, q.element_size(), be):
        z = lambda t: None if t is None else torch.zeros(t.shape, dtype=acc, device=q.device)  # noqa: E731
        grads = dict(dq=z(q), dd=z(d), dneg=z(extra_neg), drho=z(rho), dkap=z(kap), dkneg=z(kneg))
    dev, stream = be.launch
    ptrs = _ptrs(q=q, d=d, neg=extra_neg, rho=rho, kap=kap, kneg=kneg, q_lo=q_lo, q_hi=q_hi, d_lo=d_lo, d_hi=d_hi,
                 row_none=row_none, loss=loss, levels=levels, row_stats=row_stats, col_stats=col_stats, **grads)
    be.kernels.matryoshka_infonce_launch("fwd", dev, stream, dtype_code(q), _sizes(q, d, extra_neg, seg, diag_offset),
                                        [inv_temp, row_weight, col_weight, *coef], ptrs)
    return [loss, levels, row_stats, col_stats, *[q.new_empty(0) if g is None else g for g in grads.values()]]


@_mat.register_fake
def _(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, coef, inv_temp, row_weight, col_weight,
      diag_offset, bf16_operands, tensor_cores, want_grad):
    K = len(seg) - 1
    N = 0 if extra_neg is None else extra_neg.shape[0]
    out = [q.new_empty(()), q.new_empty((K,)), q.new_empty((K, 3, q.shape[0])), q.new_empty((K, 3, d.shape[0]))]
    gif = _gif(want_grad, col_weight, K, d.shape[0], N, q.element_size(), backend.resolve(q))
    for t in (q, d, extra_neg, rho, kap, kneg):
        out.append(q.new_empty(t.shape) if gif and t is not None else q.new_empty(0))
    return out


@torch.library.custom_op("tempokern::matryoshka_infonce_backward", mutates_args=())
def _mat_backward(lcoef: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor, q: torch.Tensor,
                  d: torch.Tensor, extra_neg: Optional[torch.Tensor], rho: torch.Tensor, kap: torch.Tensor,
                  kneg: Optional[torch.Tensor], q_lo: torch.Tensor, q_hi: torch.Tensor, d_lo: torch.Tensor,
                  d_hi: torch.Tensor, row_none: Optional[torch.Tensor], seg: List[int], inv_temp: float,
                  row_weight: float, col_weight: float, diag_offset: int, bf16_operands: bool,
                  tensor_cores: bool) -> List[torch.Tensor]:
    be = backend.resolve(q)
    if _blocked(be):
        return blocked_backward(lcoef, row_stats, col_stats, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi,
                                row_none, seg, inv_temp, row_weight, col_weight, diag_offset, _block_rows(be),
                                known_half=torch.bfloat16 if bf16_operands else None, tensor_cores=tensor_cores,
                                be=be)
    coef = [float(c) for c in lcoef.detach().to("cpu", torch.float64).tolist()]
    z = lambda t: None if t is None else torch.zeros(t.shape, dtype=q.dtype, device=q.device)  # noqa: E731
    dq, dd, dneg, drho, dkap, dkneg = z(q), z(d), z(extra_neg), z(rho), z(kap), z(kneg)
    dev, stream = be.launch
    row_stats, col_stats = row_stats.contiguous(), col_stats.contiguous()
    ptrs = _ptrs(q=q, d=d, neg=extra_neg, rho=rho, kap=kap, kneg=kneg, q_lo=q_lo, q_hi=q_hi, d_lo=d_lo, d_hi=d_hi,
                 row_none=row_none, row_stats=row_stats, col_stats=col_stats, dq=dq, dd=dd, dneg=dneg, drho=drho,
                 dkap=dkap, dkneg=dkneg)
    be.kernels.matryoshka_infonce_launch("bwd", dev, stream, dtype_code(q), _sizes(q, d, extra_neg, seg, diag_offset),
                                        [inv_temp, row_weight, col_weight, *coef], ptrs)
    return [dq, dd, q.new_empty(0) if dneg is None else dneg, drho, dkap, q.new_empty(0) if dkneg is None else dkneg]


@_mat_backward.register_fake
def _(lcoef, row_stats, col_stats, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp,
      row_weight, col_weight, diag_offset, bf16_operands, tensor_cores):
    return [torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(d, memory_format=torch.contiguous_format),
            q.new_empty(0) if extra_neg is None else torch.empty_like(extra_neg, memory_format=torch.contiguous_format),
            torch.empty_like(rho), torch.empty_like(kap), q.new_empty(0) if kneg is None else torch.empty_like(kneg)]


_NT = 11  # tensor inputs of the forward op
_GRAD_OF = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5}  # input index -> index among the gradients


def _setup(ctx, inputs, output):
    # unused outputs (the levels of a plain loss call) get None, not a zero tensor: the backward then skips their
    # call without inspecting a device tensor (a host synchronisation per step)
    ctx.set_materialize_grads(False)
    row_stats, col_stats = output[2], output[3]
    ctx.gif = _gif(inputs[-1], inputs[_NT + 4], len(inputs[_NT]) - 1, inputs[1].shape[0],
                   0 if inputs[2] is None else inputs[2].shape[0], inputs[0].element_size(),
                   backend.resolve(inputs[0]))
    ctx.save_for_backward(row_stats, col_stats, *inputs[:_NT], *(output[4:] if ctx.gif else ()))
    ctx.present = [t is not None for t in inputs[:_NT]]
    ctx.seg, ctx.coef = inputs[_NT], inputs[_NT + 1]
    ctx.scalars = inputs[_NT + 2:-1]


def _backward(ctx, grads_out):
    g_loss, g_levels = grads_out[0], grads_out[1]
    row_stats, col_stats, *rest = ctx.saved_tensors
    ins = [t if present else None for t, present in zip(rest[:_NT], ctx.present)]
    g_loss = row_stats.new_zeros(()) if g_loss is None else g_loss.reshape(()).to(row_stats.dtype)
    grads = None
    if ctx.gif:  # the forward computed the gradient for a unit upstream gradient of the loss
        grads = [g_loss * t for t in rest[_NT:]]
        # eager tensors are plain torch.Tensor: skip the (zero-coefficient) call when nothing flows into levels;
        # traced ones (fake/functional subclasses) cannot be inspected, so the call stays in the graph
        traced = compiling() or type(g_levels) is not torch.Tensor
        if g_levels is not None and (traced or bool(g_levels.any())):
            extra = torch.ops.tempokern.matryoshka_infonce_backward(g_levels.to(row_stats.dtype), row_stats, col_stats,
                                                                    *ins, ctx.seg, *ctx.scalars)
            grads = [a + b for a, b in zip(grads, extra)]
    else:
        w = device_constant([float(x) for x in ctx.coef], row_stats.dtype, row_stats)
        lcoef = g_loss * w
        if g_levels is not None:
            lcoef = lcoef + g_levels.to(w.dtype)
        grads = torch.ops.tempokern.matryoshka_infonce_backward(lcoef, row_stats, col_stats, *ins, ctx.seg,
                                                                 *ctx.scalars)
    out = [None] * (_NT + 3 + len(ctx.scalars))
    for i, g in _GRAD_OF.items():
        if ins[i] is not None and ctx.needs_input_grad[i]:
            out[i] = grads[g]
    return tuple(out)


_mat.register_autograd(_backward, setup_context=_setup)


# ---- the bias: always the blocked path (CPU and CUDA) -----------------------------------------------

_BIAS_IN = ("u_q", "u_d", "table", "w1", "b1", "w2", "b2", "scale")


@torch.library.custom_op("tempokern::matryoshka_infonce_bias", mutates_args=())
def _mat_bias(q: torch.Tensor, d: torch.Tensor, extra_neg: Optional[torch.Tensor], rho: torch.Tensor,
              kap: torch.Tensor, kneg: Optional[torch.Tensor], q_lo: torch.Tensor, q_hi: torch.Tensor,
              d_lo: torch.Tensor, d_hi: torch.Tensor, row_none: Optional[torch.Tensor], u_q: torch.Tensor,
              u_d: torch.Tensor, table: Optional[torch.Tensor], w1: Optional[torch.Tensor],
              b1: Optional[torch.Tensor], w2: Optional[torch.Tensor], b2: Optional[torch.Tensor],
              scale: Optional[torch.Tensor], seg: List[int], coef: List[float], inv_temp: float, row_weight: float,
              col_weight: float, diag_offset: int, bf16_operands: bool, tensor_cores: bool) -> List[torch.Tensor]:
    """matryoshka_infonce with offset_bias's per-pair bias added to every level's logits: [loss, levels,
    row_stats, col_stats] by the blocked path. table (points,) given: the table mode (w1..scale None);
    else the exact MLP (w1..scale). bf16_operands: q, d and extra_neg hold bfloat16 values (the caller's
    tensors were bfloat16), so the CUDA path needs no check of the values (a pass and a device sync)."""
    be = backend.resolve(q)
    return blocked_forward(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, coef, inv_temp,
                           row_weight, col_weight, diag_offset, _block_rows(be),
                           bias=(u_q, u_d, table, w1, b1, w2, b2, scale),
                           known_half=torch.bfloat16 if bf16_operands else None, tensor_cores=tensor_cores, be=be)


@_mat_bias.register_fake
def _(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, u_q, u_d, table, w1, b1, w2, b2, scale, seg,
      coef, inv_temp, row_weight, col_weight, diag_offset, bf16_operands, tensor_cores):
    K = len(seg) - 1
    return [q.new_empty(()), q.new_empty((K,)), q.new_empty((K, 3, q.shape[0])), q.new_empty((K, 3, d.shape[0]))]


@torch.library.custom_op("tempokern::matryoshka_infonce_bias_backward", mutates_args=())
def _mat_bias_backward(lcoef: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor, q: torch.Tensor,
                       d: torch.Tensor, extra_neg: Optional[torch.Tensor], rho: torch.Tensor, kap: torch.Tensor,
                       kneg: Optional[torch.Tensor], q_lo: torch.Tensor, q_hi: torch.Tensor, d_lo: torch.Tensor,
                       d_hi: torch.Tensor, row_none: Optional[torch.Tensor], u_q: torch.Tensor, u_d: torch.Tensor,
                       table: Optional[torch.Tensor], w1: Optional[torch.Tensor], b1: Optional[torch.Tensor],
                       w2: Optional[torch.Tensor], b2: Optional[torch.Tensor], scale: Optional[torch.Tensor],
                       seg: List[int], inv_temp: float, row_weight: float, col_weight: float,
                       diag_offset: int, bf16_operands: bool, tensor_cores: bool) -> List[torch.Tensor]:
    """[dq, dd, dneg, drho, dkap, dkneg] in the accumulation dtype, then [du_q, du_d, dtable, dw1, db1, dw2,
    db2, dscale] in float64 (empty where absent)."""
    be = backend.resolve(q)
    return blocked_backward(lcoef, row_stats, col_stats, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi,
                            row_none, seg, inv_temp, row_weight, col_weight, diag_offset, _block_rows(be),
                            bias=(u_q, u_d, table, w1, b1, w2, b2, scale),
                            known_half=torch.bfloat16 if bf16_operands else None, tensor_cores=tensor_cores, be=be)


@_mat_bias_backward.register_fake
def _(lcoef, row_stats, col_stats, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, u_q, u_d, table,
      w1, b1, w2, b2, scale, seg, inv_temp, row_weight, col_weight, diag_offset, bf16_operands, tensor_cores):
    out = [q.new_empty(q.shape), q.new_empty(d.shape), q.new_empty(0) if extra_neg is None else q.new_empty(
        extra_neg.shape), q.new_empty(rho.shape), q.new_empty(kap.shape),
        q.new_empty(0) if kneg is None else q.new_empty(kneg.shape)]
    for t in (u_q, u_d, table, w1, b1, w2, b2, scale):
        out.append(q.new_empty(0, dtype=torch.float64) if t is None else q.new_empty(t.shape, dtype=torch.float64))
    return out


_NTB = 19  # tensor inputs of the bias op (the 11 of matryoshka_infonce, then the 8 bias inputs)


def _bias_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2], output[3], *inputs[:_NTB])
    ctx.present = [t is not None for t in inputs[:_NTB]]
    ctx.dtypes = [None if t is None else t.dtype for t in inputs[:_NTB]]
    ctx.seg, ctx.coef = inputs[_NTB], inputs[_NTB + 1]
    ctx.scalars = inputs[_NTB + 2:]


def _bias_backward(ctx, grads_out):
    g_loss, g_levels = grads_out[0], grads_out[1]
    row_stats, col_stats, *rest = ctx.saved_tensors
    ins = [t if present else None for t, present in zip(rest, ctx.present)]
    w = device_constant([float(x) for x in ctx.coef], row_stats.dtype, row_stats)
    lcoef = w * (0.0 if g_loss is None else g_loss.reshape(()).to(w.dtype))
    if g_levels is not None:
        lcoef = lcoef + g_levels.to(w.dtype)
    grads = torch.ops.tempokern.matryoshka_infonce_bias_backward(lcoef, row_stats, col_stats, *ins, ctx.seg,
                                                                  *ctx.scalars)
    out = [None] * (_NTB + 2 + len(ctx.scalars))
    for i, k in _BIAS_GRAD_OF.items():
        if ins[i] is not None and ctx.needs_input_grad[i]:
            out[i] = grads[k].to(ctx.dtypes[i])
    return tuple(out)


# input index -> index among the backward op's outputs
_BIAS_GRAD_OF = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, **{11 + k: 6 + k for k in range(8)}}

_mat_bias.register_autograd(_bias_backward, setup_context=_bias_setup)


# ---- validation ------------------------------------------------------------------------------------

def check_dims(dims, H: Optional[int], weights=None) -> Tuple[List[int], List[float]]:
    """dims (any order) and weights -> (dims ascending, their weights). Raises ValueError/TypeError naming
    ``dims``/``weights``; warns when H is not among the dims (the trailing dimensions then get no gradient).
    H=None (a module before it has seen an input) checks everything but the upper bound."""
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
        if m < 1 or (H is not None and m > H):
            raise ValueError(f"dims must lie in [1, {'H' if H is None else H}] (the embedding size), got {m}")
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
    if H is not None and dims_s[-1] != H:
        warnings.warn(f"matryoshka_infonce: the largest dim {dims_s[-1]} is smaller than the embedding size {H}; "
                      f"dimensions {dims_s[-1]}..{H - 1} get no gradient", stacklevel=3)
    return dims_s, w_s


class _PrefixSquares(torch.autograd.Function):
    """(x * x) @ P for a (H, K) 0/1 prefix matrix P, with the backward as one product and one product-wise
    multiply: dx = (g @ (2 P)^T) * x (autograd of x * x took two multiplies and an add over (n, H) for the
    same, bit-identical, values). The backward is built from differentiable ops (double backward works)."""

    @staticmethod
    def forward(x, P):
        return (x * x) @ P

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, P = ctx.saved_tensors
        return (g @ (P + P).t()) * x, None


def inverse_prefix_norms(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """(K, n): 1 / max(||x[:, :m]||, 1e-12) per dim m (differentiable; F.normalize's clamp, applied to the
    squared norm). The K prefix sums of squares are one product with a (H, K) 0/1 prefix matrix: a handful
    of full-size ops forward and backward instead of K norms (they cost ~15% of the step at B = 2,048)."""
    H = x.shape[1]
    ends = device_constant([int(m) for m in dims], torch.int64, x)  # cached: no host-to-device copy per call
    prefix = torch.arange(H, device=x.device)[:, None] < ends[None, :]
    ss = _PrefixSquares.apply(x, prefix.to(x.dtype))
    return ss.clamp_min(EPS * EPS).rsqrt().t().contiguous()


class MatryoshkaCall:
    """A matryoshka_infonce call as the dispatch table sees it."""
    __slots__ = ("q", "d", "dims", "bias", "extra_neg", "table_points", "rows", "cols")

    def __init__(self, q, d, dims, bias, extra_neg, table_points):
        self.q, self.d, self.dims, self.bias, self.extra_neg = q, d, dims, bias, extra_neg
        self.table_points = table_points
        self.rows, self.cols = q.shape[0], d.shape[0]

    def tensor_cores(self, be) -> bool:
        return tc_call(self.q, self.d, self.dims, self.extra_neg, self.bias, self.table_points, be)


def matryoshka_path(q, d, dims, bias, extra_neg, table_points) -> str:
    """The name of the path dispatch.choose picks for a Matryoshka call ("fused" on the CPU; "levels", "fused" or
    "mrl_tc" on the CUDA kernels' backends)."""
    return dispatch.choose(dispatch.MATRYOSHKA, MatryoshkaCall(q, d, dims, bias, extra_neg, table_points),
                           backend.resolve(q)).name


def matryoshka_partial(q, d, q_lo, q_hi, d_lo, d_hi, dims: Sequence[int], weights: Sequence[float], *,
                       temperature: float, extra_neg=None, row_weight: float = 1.0, col_weight: float = 0.0,
                       diag_offset: int = 0, row_none: Optional[torch.Tensor] = None, normalize: bool = True,
                       bias=None, bias_table_points: Optional[int] = None, tensor_cores: Optional[bool] = None):
    """The kernel entry on validated inputs (dims ascending): q (Bq, H) vs d (Bd, H), int64 span bounds,
    per-level loss = row_weight * mean row loss + col_weight * mean column loss (diagonal fallback at
    column i + diag_offset). bias: None or the validated 7-tuple (u_q, u_d, w1, b1, w2, b2, scale), with
    ``bias_table_points`` for the table mode; it runs the blocked path on every device.
    ``tensor_cores``: whether the candidate tensor-core kernels may take the call (they still check that it is
    theirs); None: whether dispatch.choose picks the mrl_tc candidate (tempokern/_ops/dispatch.py).
    Returns (loss = sum_l weights_l level_l, levels (K,))."""
    if tensor_cores is None:
        tensor_cores = matryoshka_path(q, d, dims, bias, extra_neg, bias_table_points) == "mrl_tc"
    acc = acc_dtype(q.dtype)
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
    # bfloat16 inputs: their float32 copies are bf16 values, which the CUDA path's half-operand products need
    # to know (else it checks the values: a pass and a device synchronisation per call)
    bf16 = q.dtype == torch.bfloat16 and d.dtype == torch.bfloat16 and (extra_neg is None or
                                                                         extra_neg.dtype == torch.bfloat16)
    if bias is not None:
        u_q, u_d, w1, b1, w2, b2, scale = bias
        if bias_table_points is not None:
            table = offset_bias_table(w1, b1, w2, b2, scale, int(bias_table_points)).to(acc)
            bk = (u_q.to(acc).contiguous(), u_d.to(acc).contiguous(), table, None, None, None, None, None)
        else:
            bk = (u_q.contiguous(), u_d.contiguous(), None, w1, b1, w2, b2, scale)
        out = torch.ops.tempokern.matryoshka_infonce_bias(
            qk, dk, nk, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, *bk, seg, [float(w) for w in weights],
            1.0 / temperature, float(row_weight), float(col_weight), int(diag_offset), bf16, bool(tensor_cores))
        return out[0], out[1]
    want = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qk, dk, nk, rho, kap, kneg))
    out = torch.ops.tempokern.matryoshka_infonce(
        qk, dk, nk, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, [float(w) for w in weights],
        1.0 / temperature, float(row_weight), float(col_weight), int(diag_offset), bf16, bool(tensor_cores),
        bool(want))
    return out[0], out[1]


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
    temperature = check_reciprocal("temperature", temperature, acc_dtype(q.dtype))
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
        check_span("q_span", q_span, q.shape[0])
        check_span("d_span", d_span, d.shape[0])
        devs.update(q_start=q_span[0], q_end=q_span[1], d_start=d_span[0], d_end=d_span[1])
    check_same_device(**devs)
    for n, t in (("q", q), ("d", d), ("extra_neg", extra_neg)):
        if t is not None:
            check_finite(n, t)
    return temperature, dims, weights


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
