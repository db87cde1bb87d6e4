"""Fused multi-positive interval-overlap InfoNCE (the CTD training loss) with the relative-offset bias
folded into the kernel: tiled online log-sum-exp, no (B, B), (B, N) or (B, B, hidden) buffer anywhere.

The bias enters the kernel in angle-difference form: per-row weights A (B, hidden, 2K) and per-column
sin/cos features Ct (2K, B) are built here with torch (O(B * hidden * D), differentiable), the kernel
forms the first layer as a small matrix product per tile and returns dL/dA, dL/dCt, and torch's
autograd carries them back to w1, b1, u_q and u_d. Pairs where the clamp bites use the constant
pre-activations at delta = +-1 (``zc``), so u outside [0, 1] is exact. On CPU, rows and columns are
first sorted by u (``_sorted_by_u``) and the kernel gets provable bounds of every hidden unit
(``interval_bounds``), so each tile evaluates only the units it cannot prove always on or off."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..reference.multipos_infonce import multipos_infonce_partial as ref_partial
from ..reference.offset_bias import bias_frequencies, offset_bias_table, offset_features
from . import backend
from .common import (acc_dtype, check_finite, check_reciprocal, check_same_device, check_tensor, compiling, dtype_code,
                     ptr)
from .loss_args import BIAS_NAMES, check_span, validate_bias
from .multipos_blocked import blocked_loss
from .offset_bias import interval_bounds
_GRAD_NAMES = ("dq", "dd", "dneg", "dA", "dCt", "db1", "dw2", "db2", "dscale", "dzc")


def _kernel_operand(t: torch.Tensor, acc: torch.dtype, be=None) -> torch.Tensor:
    """The CPU kernel reads float32/float64 rows with unit column stride; the CUDA kernels (backend ``be``) any
    dtype (``acc`` = t's dtype: no conversion, ``be`` not needed)."""
    if t.dtype != acc and not be.cuda_path:
        t = t.to(acc)
    if t.stride(-1) != 1 or (t.dim() == 2 and t.shape[0] > 1 and t.stride(0) < t.shape[1]):
        t = t.contiguous()
    return t


def _launch_dict(q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, A, Ct, b1, w2, b2, scale, zc, u_q, u_d, z_lo, z_hi,
                 diag_col, diag_row, row_none=None, col_map=None):
    return {k: ptr(v) for k, v in dict(q=q, d=d, neg=extra_neg, q_lo=q_lo, q_hi=q_hi, d_lo=d_lo, d_hi=d_hi, A=A,
                                        Ct=Ct, b1=b1, w2=w2, b2=b2, scale=scale, zc=zc, u_q=u_q, u_d=u_d, z_lo=z_lo,
                                        z_hi=z_hi, diag_col=diag_col, diag_row=diag_row, row_none=row_none,
                                        col_map=col_map).items()
            if v is not None}


def _sizes(q, d, extra_neg, A, diag_offset, z_lo):
    N = 0 if extra_neg is None else extra_neg.shape[0]
    ldn = 0 if extra_neg is None else extra_neg.stride(0)
    hidden = 0 if A is None else A.shape[1]
    K2 = 0 if A is None else A.shape[2]
    return [q.shape[0], d.shape[0], N, q.shape[1], q.stride(0), d.stride(0), ldn, hidden, K2, diag_offset, 0,
            0 if z_lo is None else z_lo.shape[1]]


@torch.library.custom_op("tempokern::multipos_infonce", mutates_args=())
def _multipos(q: torch.Tensor, d: torch.Tensor, q_lo: torch.Tensor, q_hi: torch.Tensor, d_lo: torch.Tensor,
              d_hi: torch.Tensor, extra_neg: Optional[torch.Tensor], A: Optional[torch.Tensor],
              Ct: Optional[torch.Tensor], b1: Optional[torch.Tensor], w2: Optional[torch.Tensor],
              b2: Optional[torch.Tensor], scale: Optional[torch.Tensor], zc: Optional[torch.Tensor],
              u_q: Optional[torch.Tensor], u_d: Optional[torch.Tensor], z_lo: Optional[torch.Tensor],
              z_hi: Optional[torch.Tensor], diag_col: Optional[torch.Tensor], diag_row: Optional[torch.Tensor],
              row_none: Optional[torch.Tensor], col_map: Optional[torch.Tensor], inv_temp: float,
              row_weight: float, col_weight: float, diag_offset: int,
              want_hardest: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, row_stats, col_stats, hardest): hardest (Bq,) int64 when want_hardest (the row's hardest
    in-batch negative, written as col_map[j] when col_map is given; see multipos_infonce.h), else empty."""
    acc = acc_dtype(q.dtype)
    be = backend.resolve(q)
    q, d = _kernel_operand(q, acc, be), _kernel_operand(d, acc, be)
    if extra_neg is not None:
        extra_neg = _kernel_operand(extra_neg, acc, be)
    loss = torch.zeros((), dtype=acc, device=q.device)
    row_stats = torch.zeros(3, q.shape[0], dtype=acc, device=q.device)
    col_stats = torch.zeros(3, d.shape[0], dtype=acc, device=q.device)
    hardest = torch.empty(q.shape[0] if want_hardest else 0, dtype=torch.int64, device=q.device)
    dev, stream = be.launch
    ptrs = _launch_dict(q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, A, Ct, b1, w2, b2, scale, zc, u_q, u_d, z_lo, z_hi,
                        diag_col, diag_row, row_none, col_map if want_hardest else None)
    ptrs.update(loss=ptr(loss), row_stats=ptr(row_stats), col_stats=ptr(col_stats))
    if want_hardest:
        ptrs.update(hardest=ptr(hardest))
    sizes = _sizes(q, d, extra_neg, A, diag_offset, z_lo)
    scalars = [inv_temp, row_weight, col_weight]
    be.kernels.multipos_infonce_launch("fwd", dev, stream, dtype_code(q), sizes, scalars, ptrs, 0, 0)
    return loss, row_stats, col_stats, hardest


@_multipos.register_fake
def _(q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, A, Ct, b1, w2, b2, scale, zc, u_q, u_d, z_lo, z_hi, diag_col,
      diag_row, row_none, col_map, inv_temp, row_weight, col_weight, diag_offset, want_hardest):
    acc = acc_dtype(q.dtype)
    return (q.new_empty((), dtype=acc), q.new_empty((3, q.shape[0]), dtype=acc),
            q.new_empty((3, d.shape[0]), dtype=acc),
            q.new_empty((q.shape[0] if want_hardest else 0,), dtype=torch.int64))


@torch.library.custom_op("tempokern::multipos_infonce_backward", mutates_args=())
def _multipos_backward(grad: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor, q: torch.Tensor,
                       d: torch.Tensor, q_lo: torch.Tensor, q_hi: torch.Tensor, d_lo: torch.Tensor,
                       d_hi: torch.Tensor, extra_neg: Optional[torch.Tensor], A: Optional[torch.Tensor],
                       Ct: Optional[torch.Tensor], b1: Optional[torch.Tensor], w2: Optional[torch.Tensor],
                       b2: Optional[torch.Tensor], scale: Optional[torch.Tensor], zc: Optional[torch.Tensor],
                       u_q: Optional[torch.Tensor], u_d: Optional[torch.Tensor], z_lo: Optional[torch.Tensor],
                       z_hi: Optional[torch.Tensor], diag_col: Optional[torch.Tensor],
                       diag_row: Optional[torch.Tensor], row_none: Optional[torch.Tensor], inv_temp: float,
                       row_weight: float, col_weight: float, diag_offset: int) -> List[torch.Tensor]:
    acc = acc_dtype(q.dtype)
    in_dtypes = (q.dtype, d.dtype, None if extra_neg is None else extra_neg.dtype)
    be = backend.resolve(q)
    q, d = _kernel_operand(q, acc, be), _kernel_operand(d, acc, be)
    if extra_neg is not None:
        extra_neg = _kernel_operand(extra_neg, acc, be)
    grad = grad.to(acc).reshape(()).contiguous()

    def zeros(t):
        return None if t is None else torch.zeros(t.shape, dtype=acc, device=q.device)

    grads = dict(dq=zeros(q), dd=zeros(d), dneg=zeros(extra_neg), dA=zeros(A), dCt=zeros(Ct), db1=zeros(b1),
                 dw2=zeros(w2), db2=zeros(b2), dscale=zeros(scale), dzc=zeros(zc))
    dev, stream = be.launch
    ptrs = _launch_dict(q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, A, Ct, b1, w2, b2, scale, zc, u_q, u_d, z_lo, z_hi,
                        diag_col, diag_row, row_none)
    # held in locals: a temporary .contiguous() copy would be freed before the (asynchronous) kernel reads it
    row_stats, col_stats = row_stats.contiguous(), col_stats.contiguous()
    ptrs.update(row_stats=ptr(row_stats), col_stats=ptr(col_stats),
                grad_loss=ptr(grad), **{k: ptr(v) for k, v in grads.items() if v is not None})
    sizes = _sizes(q, d, extra_neg, A, diag_offset, z_lo)
    scalars = [inv_temp, row_weight, col_weight]
    be.kernels.multipos_infonce_launch("bwd", dev, stream, dtype_code(q), sizes, scalars, ptrs, 0, 0)
    out = []
    for k in _GRAD_NAMES:
        g = grads[k]
        if g is None:
            out.append(q.new_empty(0, dtype=acc))
        else:
            if k in ("dq", "dd", "dneg"):
                g = g.to(in_dtypes[("dq", "dd", "dneg").index(k)])
            out.append(g)
    return out


@_multipos_backward.register_fake
def _(grad, row_stats, col_stats, q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, A, Ct, b1, w2, b2, scale, zc, u_q, u_d,
      z_lo, z_hi, diag_col, diag_row, row_none, inv_temp, row_weight, col_weight, diag_offset):
    acc = acc_dtype(q.dtype)
    out = [torch.empty_like(q, memory_format=torch.contiguous_format),
           torch.empty_like(d, memory_format=torch.contiguous_format)]
    out.append(q.new_empty(0, dtype=acc) if extra_neg is None
               else torch.empty_like(extra_neg, memory_format=torch.contiguous_format))
    for t in (A, Ct, b1, w2, b2, scale, zc):
        out.append(q.new_empty(0, dtype=acc) if t is None else q.new_empty(t.shape, dtype=acc))
    return out


_NTENSORS = 21  # tensor inputs of the backward op (the forward adds col_map, then scalars and want_hardest)
_NINPUTS = 27    # inputs of the forward op
_DIFF_INPUTS = {0: 0, 1: 1, 6: 2, 7: 3, 8: 4, 9: 5, 10: 6, 11: 7, 12: 8, 13: 9}  # input index -> grad index


def _setup(ctx, inputs, output):
    _, row_stats, col_stats, _hardest = output
    ctx.save_for_backward(row_stats, col_stats, *inputs[:_NTENSORS])
    ctx.scalars = inputs[_NTENSORS + 1:_NINPUTS - 1]  # inv_temp, row_weight, col_weight, diag_offset
    ctx.present = [t is not None for t in inputs[:_NTENSORS]]


def _backward(ctx, grad, _g_rows, _g_cols, _g_hardest):
    row_stats, col_stats, *ins = ctx.saved_tensors
    ins = [t if present else None for t, present in zip(ins, ctx.present)]
    grads = torch.ops.tempokern.multipos_infonce_backward(grad, row_stats, col_stats, *ins, *ctx.scalars)
    out = [None] * _NINPUTS
    for i, g in _DIFF_INPUTS.items():
        if ins[i] is not None and ctx.needs_input_grad[i]:
            out[i] = grads[g].to(ins[i].dtype)
    return tuple(out)


_multipos.register_autograd(_backward, setup_context=_setup)



# ---- the blocked path: CUDA (cuBLAS score blocks + fused passes), and the table mode of the bias on CPU ----

_BLOCKED_OUT = ("loss", "dq", "dd", "dneg", "du_q", "du_d", "dtable", "dw1", "db1", "dw2", "db2", "dscale")
# input index of the op -> index of its gradient among the outputs
_BLOCKED_GRAD_OF = {0: 1, 1: 2, 6: 3, 7: 4, 8: 5, 9: 6, 10: 7, 11: 8, 12: 9, 13: 10, 14: 11}


def _blocked_impl(q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, u_q, u_d, table, w1, b1, w2, b2, scale, inv_temp,
                  row_weight, col_weight, diag_offset, want_grad, block_rows, row_none,
                  want_hardest) -> List[torch.Tensor]:
    exact = None if w1 is None else (w1, b1, w2, b2, scale)
    out = blocked_loss(q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, u_q, u_d, table, exact, inv_temp, row_weight,
                       col_weight, diag_offset, want_grad, block_rows, row_none, want_hardest)
    acc = acc_dtype(q.dtype)
    res = [t if t is not None else q.new_empty(0, dtype=acc) for t in out[:-1]]
    return res + [out[-1] if out[-1] is not None else q.new_empty(0, dtype=torch.int64)]


@torch.library.custom_op("tempokern::multipos_blocked", mutates_args=())
def _multipos_blocked(q: torch.Tensor, d: torch.Tensor, q_lo: torch.Tensor, q_hi: torch.Tensor, d_lo: torch.Tensor,
                      d_hi: torch.Tensor, extra_neg: Optional[torch.Tensor], u_q: Optional[torch.Tensor],
                      u_d: Optional[torch.Tensor], table: Optional[torch.Tensor], w1: Optional[torch.Tensor],
                      b1: Optional[torch.Tensor], w2: Optional[torch.Tensor], b2: Optional[torch.Tensor],
                      scale: Optional[torch.Tensor], inv_temp: float, row_weight: float, col_weight: float,
                      diag_offset: int, want_grad: bool, block_rows: int,
                      row_none: Optional[torch.Tensor], want_hardest: bool) -> List[torch.Tensor]:
    return _blocked_impl(q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, u_q, u_d, table, w1, b1, w2, b2, scale, inv_temp,
                         row_weight, col_weight, diag_offset, want_grad, block_rows, row_none, want_hardest)


@_multipos_blocked.register_fake
def _(q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, u_q, u_d, table, w1, b1, w2, b2, scale, inv_temp, row_weight,
      col_weight, diag_offset, want_grad, block_rows, row_none, want_hardest):
    acc = acc_dtype(q.dtype)
    ins = dict(dq=q, dd=d, dneg=extra_neg, du_q=u_q, du_d=u_d, dtable=table, dw1=w1, db1=b1, dw2=w2, db2=b2,
               dscale=scale)
    out = [q.new_empty((), dtype=acc)]
    for name in _BLOCKED_OUT[1:]:
        t = ins[name]
        if not want_grad or t is None or (name in ("du_q", "du_d") and table is None and w1 is None):
            out.append(q.new_empty(0, dtype=acc))
        else:
            out.append(q.new_empty(t.shape, dtype=torch.float64 if w1 is not None and name in (
                "du_q", "du_d", "dw1", "db1", "dw2", "db2", "dscale") else acc))
    out.append(q.new_empty((q.shape[0] if want_hardest else 0,), dtype=torch.int64))
    return out


def _blocked_setup(ctx, inputs, output):
    ctx.want_grad = inputs[19]
    ctx.in_meta = [(t.dtype, t.shape) if isinstance(t, torch.Tensor) else None for t in inputs[:15]]
    ctx.save_for_backward(*output[1:])


def _blocked_backward(ctx, grads):
    g = grads[0]
    if g is None:  # (grads are not materialised in eager mode: no gradient reached the loss)
        return (None,) * 23
    if not ctx.want_grad:
        raise RuntimeError("multipos_infonce: backward was called, but the forward ran without gradients (no input "
                           "required grad, or grad mode was off); call it again with grad enabled")
    saved = ctx.saved_tensors
    out = [None] * 23
    for i, k in _BLOCKED_GRAD_OF.items():
        meta = ctx.in_meta[i]
        if meta is None or not ctx.needs_input_grad[i]:
            continue
        dt, shape = meta
        out[i] = (saved[k - 1] * g.to(saved[k - 1].dtype)).reshape(shape).to(dt)
    return tuple(out)


_multipos_blocked.register_autograd(_blocked_backward, setup_context=_blocked_setup)


class _BlockedEager(torch.autograd.Function):
    """Eager-mode twin of the tempokern::multipos_blocked op: the same implementation, setup and backward,
    without the custom-op layer's argument processing (about 0.8 ms of Python per call with 21 arguments,
    as much as the whole GPU step at B = 8,192). torch.compile and fake tensors go through the op."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _blocked_impl(*inputs)
        _blocked_setup(ctx, inputs, out)
        ctx.mark_non_differentiable(*out[1:])
        ctx.set_materialize_grads(False)  # no zeros for the 12 non-differentiable outputs (backward ignores them)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        return _blocked_backward(ctx, grads)


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def blocked_multipos(q, d, q_lo, q_hi, d_lo, d_hi, *, temperature: float, bias=None, extra_neg=None,
                     row_weight: float = 1.0, col_weight: float = 0.0, diag_offset: int = 0,
                     bias_table_points: Optional[int] = None, block_rows: int = 0,
                     row_none: Optional[torch.Tensor] = None, return_hardest: bool = False):
    """The blocked path on validated inputs (see multipos_blocked.py): every CUDA call, and the table
    mode of the bias on CPU. With ``bias_table_points=N`` the bias MLP is evaluated exactly in float64 at N
    points of [-1, 1] (differentiable torch) and interpolated in the kernels; gradients are exact for the
    interpolated function."""
    acc = acc_dtype(q.dtype)
    u_q = u_d = table = None
    exact = (None,) * 5
    if bias is not None:
        u_q, u_d, w1, b1, w2, b2, scale = bias
        if bias_table_points is not None:
            table = offset_bias_table(w1, b1, w2, b2, scale, int(bias_table_points)).to(acc)
            u_q, u_d = u_q.to(acc).contiguous(), u_d.to(acc).contiguous()
        else:
            exact = (w1, b1, w2, b2, scale)
            u_q, u_d = u_q.contiguous(), u_d.contiguous()
    q, d = _kernel_operand(q, q.dtype), _kernel_operand(d, d.dtype)
    if extra_neg is not None:
        extra_neg = _kernel_operand(extra_neg, extra_neg.dtype)
    want = _needs_grad(q, d, extra_neg, u_q, u_d, table, *exact)
    args = (q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, u_q, u_d, table, *exact, 1.0 / temperature, float(row_weight),
            float(col_weight), int(diag_offset), want, int(block_rows), row_none, bool(return_hardest))
    if compiling() or not want:
        out = torch.ops.tempokern.multipos_blocked(*args)
    else:
        out = _BlockedEager.apply(*args)
    return (out[0], out[-1]) if return_hardest else out[0]

# ---- preparation and validation ------------------------------------------------------------------

def bias_kernel_inputs(bias: Sequence[torch.Tensor], acc: torch.dtype):
    """(A, Ct, b1, w2, b2, scale, zc, u_q, u_d) for the kernel from offset_bias's 7 inputs, differentiable.

    A[i, n] = [Ws cos(f u_q_i) + Wc sin(f u_q_i), Wc cos(f u_q_i) - Ws sin(f u_q_i)] (hidden x 2K),
    Ct[:, j] = [sin(f u_d_j), cos(f u_d_j)], so w1 phi(u_d_j - u_q_i) = A_i Ct[:, j] (angle-difference identities);
    zc = w1 phi(+-1) + b1 for the pairs where the clamp bites."""
    u_q, u_d, w1, b1, w2, b2, scale = bias
    hidden, D = w1.shape
    K = max(1, D // 2)
    P = min(2 * K, D)
    W = w1.to(acc)
    if P < 2 * K:
        W = torch.cat([W[:, :P], W.new_zeros(hidden, 2 * K - P)], dim=1)
    else:
        W = W[:, :2 * K]
    Ws, Wc = W[:, :K], W[:, K:]
    f = bias_frequencies(D, acc, u_q.device)
    uq, ud = u_q.to(acc), u_d.to(acc)
    bq = uq[:, None] * f
    sq, cq = torch.sin(bq)[:, None, :], torch.cos(bq)[:, None, :]
    A = torch.cat([Ws * cq + Wc * sq, Wc * cq - Ws * sq], dim=-1).contiguous()
    bd = ud[:, None] * f
    Ct = torch.cat([torch.sin(bd), torch.cos(bd)], dim=1).t().contiguous()
    ends = torch.linspace(1.0, -1.0, 2, dtype=acc, device=u_q.device)   # [1, -1] made on the device: no copy
    zc = (offset_features(ends, D) @ w1.to(acc).t() + b1.to(acc)).contiguous()
    return (A, Ct, b1.to(acc).contiguous(), w2.to(acc).reshape(-1).contiguous(), b2.to(acc).reshape(()).contiguous(),
            scale.to(acc).reshape(()).contiguous(), zc, uq.detach().contiguous(), ud.detach().contiguous())


def _sorted_by_u(q, d, q_lo, q_hi, d_lo, d_hi, bias, diag_offset):
    """Rows sorted by u_q and columns by u_d (CPU kernels): a tile then spans a narrow range of
    delta = u_d - u_q, over which the kernel proves most bias units always on or off (see
    interval_bounds). The loss is a mean over rows and columns, so only the diagonal fallback needs
    the permutations: returned as explicit partners (diag_col, diag_row), -1 for none. Differentiable
    (index ops); O(B * H) copies."""
    u_q, u_d = bias[0], bias[1]
    Bq, Bd = q.shape[0], d.shape[0]
    pq, pd = torch.argsort(u_q.detach(), stable=True), torch.argsort(u_d.detach(), stable=True)
    inv_q, inv_d = torch.empty_like(pq), torch.empty_like(pd)
    inv_q[pq] = torch.arange(Bq, device=pq.device)
    inv_d[pd] = torch.arange(Bd, device=pd.device)
    tgt, src = pq + diag_offset, pd - diag_offset
    diag_col = torch.where((tgt >= 0) & (tgt < Bd), inv_d[tgt.clamp(0, Bd - 1)], -1).contiguous()
    diag_row = torch.where((src >= 0) & (src < Bq), inv_q[src.clamp(0, Bq - 1)], -1).contiguous()
    bias = (u_q[pq], u_d[pd], *bias[2:])
    return (q[pq], d[pd], q_lo[pq].contiguous(), q_hi[pq].contiguous(), d_lo[pd].contiguous(), d_hi[pd].contiguous(),
            bias, (diag_col, diag_row))


def multipos_kernel_partial(q, d, q_lo, q_hi, d_lo, d_hi, *, temperature: float, bias=None, extra_neg=None,
                            row_weight: float = 1.0, col_weight: float = 0.0, diag_offset: int = 0,
                            bias_table_points: Optional[int] = None, row_none: Optional[torch.Tensor] = None,
                            return_hardest: bool = False, blocked: bool = False):
    """This module's kernels on validated inputs (the arguments and result of
    :func:`tempokern._ops.routing.multipos_infonce_partial`, which also routes calls to the candidate
    tensor-core kernels): ``blocked`` (the path dispatch.choose picked there) runs the blocked path, else the
    fused tiled kernel (the CPU's)."""
    if q.shape[0] == 0 or d.shape[0] == 0:
        return _empty_batch(q, d, q_lo, q_hi, d_lo, d_hi, temperature, bias, extra_neg, row_weight, col_weight,
                            diag_offset, row_none, bias_table_points, return_hardest)
    if row_none is not None:
        row_none = row_none.to(torch.uint8).contiguous()
    if blocked:
        return blocked_multipos(q, d, q_lo, q_hi, d_lo, d_hi, temperature=temperature, bias=bias,
                                extra_neg=extra_neg, row_weight=row_weight, col_weight=col_weight,
                                diag_offset=diag_offset, bias_table_points=bias_table_points, row_none=row_none,
                                return_hardest=return_hardest)
    acc = acc_dtype(q.dtype)
    extras = (None,) * 4
    pq = col_map = None
    if bias is not None and q.shape[0] and d.shape[0] and not q.is_meta:  # (meta: no values to sort by)
        pq = torch.argsort(bias[0].detach(), stable=True)
        if row_none is not None:  # the same stable permutation _sorted_by_u applies to the rows
            row_none = row_none[pq].contiguous()
        if return_hardest:  # sorted column -> the caller's column (tie-break and output)
            col_map = torch.argsort(bias[1].detach(), stable=True).contiguous()
        q, d, q_lo, q_hi, d_lo, d_hi, bias, diag = _sorted_by_u(q, d, q_lo, q_hi, d_lo, d_hi, bias, diag_offset)
        extras = (*interval_bounds(bias[2], bias[3]), *diag)
    kb = (None,) * 9 if bias is None else bias_kernel_inputs(bias, acc)
    loss, _, _, hardest = torch.ops.tempokern.multipos_infonce(
        q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, *kb, *extras, row_none, col_map, 1.0 / temperature,
        float(row_weight), float(col_weight), int(diag_offset), bool(return_hardest))
    if not return_hardest:
        return loss
    if pq is not None:  # rows back to the caller's order
        hardest = torch.empty_like(hardest).index_copy_(0, pq, hardest)
    return loss, hardest


def _empty_batch(q, d, q_lo, q_hi, d_lo, d_hi, temperature, bias, extra_neg, row_weight, col_weight, diag_offset,
                 row_none, bias_table_points, return_hardest):
    """No query or no document: the reference's result (a mean over no rows is NaN, as torch's mean of an empty
    tensor; a zero weight drops its term), in the accumulation dtype, with its (zero-size or zero) gradients.
    Nothing of size B x B exists, so the plain-torch spec is the implementation here."""
    out = ref_partial(q, d, q_lo, q_hi, d_lo, d_hi, temperature=temperature, bias=bias, extra_neg=extra_neg,
                      row_weight=row_weight, col_weight=col_weight, diag_offset=diag_offset, row_none=row_none,
                      bias_table_points=bias_table_points, return_hardest=return_hardest)
    if return_hardest:
        return out[0].to(acc_dtype(q.dtype)), out[1]
    return out.to(acc_dtype(q.dtype))


def validate(q, d, q_span, d_span, temperature, bias, extra_neg, symmetric, *, square: bool = True):
    check_tensor("q", q, ndim=2, floating=True)
    check_tensor("d", d, ndim=2, floating=True)
    if d.dtype != q.dtype:
        raise TypeError(f"d has dtype {d.dtype}, expected {q.dtype} like q")
    if d.shape[1] != q.shape[1]:
        raise ValueError(f"d has hidden size {d.shape[1]}, expected {q.shape[1]} like q (shapes {tuple(q.shape)}, "
                         f"{tuple(d.shape)})")
    if square and d.shape[0] != q.shape[0]:
        raise ValueError(f"q and d must have the same batch size, got {q.shape[0]} and {d.shape[0]}")
    if q.shape[1] < 1:
        raise ValueError("q and d must have a hidden size >= 1")
    check_span("q_span", q_span, q.shape[0])
    check_span("d_span", d_span, d.shape[0])
    temperature = check_reciprocal("temperature", temperature, acc_dtype(q.dtype))
    if extra_neg is not None:
        check_tensor("extra_neg", extra_neg, ndim=2, floating=True)
        if extra_neg.shape[1] != q.shape[1]:
            raise ValueError(f"extra_neg has hidden size {extra_neg.shape[1]}, expected {q.shape[1]} like q")
        if extra_neg.dtype != q.dtype:
            raise TypeError(f"extra_neg has dtype {extra_neg.dtype}, expected {q.dtype} like q")
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
    if bias is not None:
        bias = validate_bias(bias, q.shape[0], d.shape[0])
    devs = dict(q=q, d=d, q_start=q_span[0], q_end=q_span[1], d_start=d_span[0], d_end=d_span[1], extra_neg=extra_neg)
    if bias is not None:
        devs.update({f"bias {n}": t for n, t in zip(BIAS_NAMES, bias)})
    check_same_device(**devs)
    for n, t in (("q", q), ("d", d), ("extra_neg", extra_neg)):
        if t is not None:
            check_finite(n, t)
    return temperature, bias
