"""Fused relative-offset bias scale * MLP(phi(clamp(u_d - u_q, -1, 1))) over a (Bq, Bd) grid, and the
table lookup used for inference. No (Bq, Bd, D) or (Bq, Bd, hidden) tensor is ever built: the kernels
recompute the hidden layer in backward and reduce weight gradients into an O(hidden * D) partial sum."""
from __future__ import annotations

import os
from typing import List, Tuple

import torch

from .._util import cache_put
from ..reference.offset_bias import bias_frequencies, offset_bias_table, offset_features
from . import backend, dispatch
from .common import acc_dtype, check_finite, check_same_device, check_tensor, dtype_code, ptr

# The classification grids per (D, device), in a bounded module-level cache (the frequency
# vectors are cached by reference.bias_frequencies itself).


def _out_dtype(*ts: torch.Tensor) -> torch.dtype:
    dt = ts[0].dtype
    for t in ts[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def _frequencies(D: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return bias_frequencies(D, dtype, device).contiguous()  # cached there, per (K, dtype, device)


def _num_parts(be, Bq: int, Bd: int) -> int:
    """Partial-sum slots of the backward reduction: one per CPU thread, one per CUDA block. CUDA grid (both
    directions): gx = ceil(Bd / 32) column blocks x gy row groups with gx * gy >= 8 x SMs where the batch has
    the rows (csrc/offset_bias/offset_bias_kernels.cuh); the forward takes gy from this too. be: the backend
    (or a tensor / device it is resolved from)."""
    be = backend.of(be)
    if be.cuda_path:
        gx = max(1, -(-Bd // 32))
        sms = be.sm_count
        return gx * max(1, min(-(-Bq // 8), -(-8 * sms // gx), 65535))
    return max(64, os.cpu_count() or 1)


_SAMPLES = 1024  # intervals of the [-1, 1] grid used to classify hidden units


_grids: dict = {}


def _grid(D: int, device: torch.device = torch.device("cpu")):
    """phi on the classification grid, and f^2 per feature column (|d^2 phi_m / d delta^2| <= f_m^2), float64,
    on `device` (made on the CPU, then copied once per device)."""
    key = (D, torch.device(device))
    g = _grids.get(key)
    if g is None:
        if key[1].type == "cpu":
            d = torch.linspace(-1.0, 1.0, _SAMPLES + 1, dtype=torch.float64)
            f = bias_frequencies(D, torch.float64)
            fsq = torch.cat([f * f, f * f])[:D]
            fsq = torch.cat([fsq, fsq.new_zeros(D - fsq.numel())])
            g = (offset_features(d, D), fsq)
        else:
            with torch.inference_mode(False):
                g = tuple(t.to(key[1]) for t in _grid(D))
        g = cache_put(_grids, key, g)
    return g


def interval_bounds(w1: torch.Tensor, b1: torch.Tensor, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bounds (lo, hi), each (hidden, _SAMPLES) float64, of every hidden unit's pre-activation
    h_n(delta) = w1_n . phi(delta) + b1_n over the _SAMPLES equal intervals of [-1, 1], with a margin for
    float32 rounding folded in: lo > 0 proves the unit on over that interval, hi < 0 proves it off.
    h_n is evaluated in float64 at the interval ends and bounded between them by the chord minus
    max|h''| s^2 / 8 (s the interval width). Computed on `device` (default: the CPU; the CUDA path passes
    the weights' device, so no host sync)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    w = w1.detach().double().to(device)
    b = b1.detach().double().to(device).reshape(-1)
    phi, fsq = _grid(w.shape[1], device)
    h = phi @ w.t() + b                                    # (samples + 1, hidden)
    curv = (w.abs() * fsq).sum(1) * (2.0 / _SAMPLES) ** 2 / 8
    margin = 1e-4 * (b.abs() + w.abs().sum(1)) + 1e-30
    lo = torch.minimum(h[:-1], h[1:]) - curv - margin
    hi = torch.maximum(h[:-1], h[1:]) + curv + margin
    return lo.t().contiguous(), hi.t().contiguous()


def _unit_classes(w1: torch.Tensor, b1: torch.Tensor, device=None):
    """Hidden units whose pre-activation is provably > 0 (always on) or < 0 (always off) for every
    delta in [-1, 1] (the clamp keeps delta there); the others stay exact ReLU units. Boolean (hidden,)
    tensors on `device` (default: the CPU)."""
    lo, hi = interval_bounds(w1, b1, device)
    return lo.amin(1) > 0, hi.amax(1) < 0


#: Linear slots of the CUDA path: the merged always-on units as a float64 value split into two values of the
#: accumulation dtype (hi + lo), so that a float32 call does not round the merged weights once for every pair
#: alike; the kernels evaluate the two slots together as one float64 unit (linear_units in offset_bias_kernels.cuh).
N_LINEAR_SLOTS = 2


def _device_units(w1a, b1a, w2a, w1, b1, acc):
    """CUDA path: the units the kernels evaluate, without a host sync. Slots 0-1 are the always-on units merged
    into one linear unit (sum of w2_n w1_n, w2_n b1_n in float64, as hi + lo); slots 2.. are all units permuted
    so that the ones that need a ReLU come first; the kernels read the count of evaluated slots
    (2 + mixed units) from the device and skip the rest (csrc/offset_bias/offset_bias_kernels.cuh, active_units)."""
    hidden = w1a.shape[0]
    on, off = _unit_classes(w1, b1, w1.device)
    mix = ~(on | off)
    order = (~mix).to(torch.int64) * hidden + torch.arange(hidden, device=w1a.device)
    perm = torch.argsort(order)                            # mixed units first, each group in its order
    w2on = w2a.double() * on.double()
    lin = torch.cat([w2on[None, :] @ w1a.double(), (w2on * b1a.double()).sum().reshape(1, 1)], dim=1)  # (1, D + 1)
    # centred: the kernels sum w_sin s + w_cos (cos - 1), so the bias slot carries b + sum(w_cos) (linear_units)
    D = w1a.shape[1]
    K = bias_frequencies(D, torch.float64, torch.device("cpu")).numel()
    lin[0, D] = lin[0, D] + lin[0, K:min(2 * K, D)].sum()
    hi = lin.to(acc)
    lo = (lin - hi.double()).to(acc)
    kw1 = torch.cat([hi[:, :-1], lo[:, :-1], w1a[perm]]).contiguous()
    kb1 = torch.cat([hi[0, -1:], lo[0, -1:], b1a[perm]]).contiguous()
    kw2 = torch.cat([w2a.new_ones(N_LINEAR_SLOTS), w2a[perm]]).contiguous()
    nact = (mix.sum() + N_LINEAR_SLOTS).to(torch.int32).reshape(1)
    return kw1, kb1, kw2, nact, ("device", on, perm)


def _prepared(u_q, u_d, w1, b1, w2, b2, scale, be=None):
    """Kernel arguments in the accumulation dtype. On CPU, provably always-off hidden units are dropped
    and provably always-on ones merged into one linear unit (exact: relu is the identity or zero there);
    ``mapping`` says how to expand the kernel's reduced gradient sums back to all units."""
    acc = acc_dtype(_out_dtype(u_q, u_d, w1, b1, w2, b2, scale))
    c = lambda t: t.to(acc).contiguous()  # noqa: E731  (O(B) or O(hidden * D) copies only)
    w1a, b1a, w2a = c(w1), c(b1).reshape(-1), c(w2).reshape(-1)
    base = (c(u_q), c(u_d), c(b2).reshape(1), c(scale).reshape(1), _frequencies(w1.shape[1], acc, u_q.device))
    mapping = None
    kw1, kb1, kw2, nlin, nact = w1a, b1a, w2a, 0, None
    path = dispatch.choose("offset_bias", None, backend.resolve(u_q) if be is None else be).name
    if path == "pruned":  # merged units: fwd+bwd 38.0 -> 16.5 ms at 8,192^2 pairs on the H100 (dispatch.py)
        kw1, kb1, kw2, nact, mapping = _device_units(w1a, b1a, w2a, w1, b1, acc)
        nlin = N_LINEAR_SLOTS
    else:  # "merged units", on the CPU
        on, off = _unit_classes(w1, b1)
        if bool(on.any()) or bool(off.any()):
            mix = (~on & ~off).nonzero().flatten()
            on_idx = on.nonzero().flatten()
            # merged in float64, rounded once (float32 calls: a float32 sum of products here would put one
            # correlated rounding error into every pair's y)
            lin_w = (w2a[on_idx, None].double() * w1a[on_idx].double()).sum(0, keepdim=True).to(acc)
            lin_b = (w2a[on_idx].double() * b1a[on_idx].double()).sum().reshape(1).to(acc)
            kw1 = torch.cat([lin_w, w1a[mix]]).contiguous()
            kb1 = torch.cat([lin_b, b1a[mix]]).contiguous()
            kw2 = torch.cat([w2a.new_ones(1), w2a[mix]]).contiguous()
            nlin = 1  # (an all-zero linear unit when nothing is always on: harmless, keeps hidden >= 1)
            mapping = (on_idx, mix)
    return base[0], base[1], kw1, kb1, kw2, base[2], base[3], base[4], nlin, nact, mapping, (w1a, b1a, w2a)


def bias_params(module) -> Tuple[torch.Tensor, ...]:
    """(w1, b1, w2, b2, scale) of an OffsetBias, in the order the fused ops take them. Duck-typed: any module
    with ``mlp[0]``/``mlp[2]`` Linear layers and a ``scale`` works (CTDLoss and TemporalIndex accept those)."""
    l1, l2 = module.mlp[0], module.mlp[2]
    return l1.weight, l1.bias, l2.weight, l2.bias, module.scale


# ---- forward -----------------------------------------------------------------------------------

@torch.library.custom_op("tempokern::offset_bias", mutates_args=())
def _offset_bias(u_q: torch.Tensor, u_d: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                 b2: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_dt = _out_dtype(u_q, u_d, w1, b1, w2, b2, scale)
    Bq, Bd = u_q.shape[0], u_d.shape[0]
    hidden, D = w1.shape
    out = torch.empty(Bq, Bd, dtype=out_dt, device=u_q.device)
    if Bq == 0 or Bd == 0:
        return out
    be = backend.resolve(u_q)
    uq, ud, kw1, kb1, kw2, b2a, sa, f, nlin, nact, _, _ = _prepared(u_q, u_d, w1, b1, w2, b2, scale, be)
    dev, stream = be.launch
    nparts = _num_parts(be, Bq, Bd) if be.cuda_path else 0  # CUDA: sets the grid
    be.kernels.offset_bias_launch("fwd", dev, stream, dtype_code(out), Bq, Bd, D, kw1.shape[0], ptr(uq), ptr(ud), ptr(f),
                          ptr(kw1), kw1.stride(0), ptr(kb1), ptr(kw2), ptr(b2a), ptr(sa), ptr(out), out.stride(0),
                          0, 0, 1, 0, 0, 0, nparts, 0, 0, nlin, 0 if nact is None else ptr(nact))
    return out


@_offset_bias.register_fake
def _(u_q, u_d, w1, b1, w2, b2, scale):
    return u_q.new_empty(u_q.shape[0], u_d.shape[0], dtype=_out_dtype(u_q, u_d, w1, b1, w2, b2, scale))


# ---- backward ----------------------------------------------------------------------------------

@torch.library.custom_op("tempokern::offset_bias_backward", mutates_args=())
def _offset_bias_backward(grad: torch.Tensor, u_q: torch.Tensor, u_d: torch.Tensor, w1: torch.Tensor,
                          b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                          scale: torch.Tensor) -> List[torch.Tensor]:
    out_dt = _out_dtype(u_q, u_d, w1, b1, w2, b2, scale)
    acc = acc_dtype(out_dt)
    Bq, Bd = u_q.shape[0], u_d.shape[0]
    hidden, D = w1.shape
    if Bq == 0 or Bd == 0:  # no pair: every gradient is zero (and no kernel grid has a row or column)
        return [torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (u_q, u_d, w1, b1, w2, b2, scale)]
    be = backend.resolve(u_q)
    uq, ud, kw1, kb1, kw2, b2a, sa, f, nlin, nact, mapping, (w1a, b1a, w2a) = _prepared(u_q, u_d, w1, b1, w2, b2,
                                                                                        scale, be)
    grad = grad.to(out_dt)  # no copy in the usual case; strides (even 0, broadcast) go to the kernel as they are
    dev, stream = be.launch
    nparts = _num_parts(be, Bq, Bd)
    kh = kw1.shape[0]
    psz = kh * (D + 1) + 2
    if be.cuda_path:  # per-block partials: d u_q (gx, Bq) in acc, d u_d (gy, Bd) and slots in float64
        gx = max(1, -(-Bd // 32))
        g_uq = torch.empty(gx, Bq, dtype=acc, device=u_q.device)
        g_ud = torch.empty(nparts // gx, Bd, dtype=torch.float64, device=u_q.device)
        parts = torch.empty(nparts, psz, dtype=torch.float64, device=u_q.device)
    else:
        g_uq = torch.empty(1, Bq, dtype=acc, device=u_q.device)
        g_ud = torch.empty(1, Bd, dtype=acc, device=u_q.device)
        parts = torch.empty(nparts, psz, dtype=acc, device=u_q.device)
    be.kernels.offset_bias_launch("bwd", dev, stream, dtype_code(grad), Bq, Bd, D, kh, ptr(uq), ptr(ud), ptr(f),
                          ptr(kw1), kw1.stride(0), ptr(kb1), ptr(kw2), ptr(b2a), ptr(sa), 0, 0,
                          ptr(grad), grad.stride(0), grad.stride(1), ptr(g_uq), ptr(g_ud), ptr(parts), nparts, 0, 0,
                          nlin, 0 if nact is None else ptr(nact))
    tot = parts.double().sum(0)
    g_uq, g_ud = g_uq.double().sum(0), g_ud.double().sum(0)
    s1, s0 = tot[-2], tot[-1]
    Rk = tot[:kh * (D + 1)].view(kh, D + 1)
    if mapping is None:
        R = Rk
    elif mapping[0] == "device":  # slots 0-1: the linear unit (equal sums); slot 2 + s: unit perm[s] (0 where
        _, on, perm = mapping       # not evaluated)
        Rp = Rk.new_zeros(hidden, D + 1).index_copy_(0, perm, Rk[N_LINEAR_SLOTS:])
        R = torch.where(on[:, None], Rk[0].expand(hidden, D + 1), Rp)
    else:  # always-on units all see M = G scale (the linear unit's sums); always-off units get nothing
        on_idx, mix = mapping
        R = Rk.new_zeros(hidden, D + 1)
        R[on_idx] = Rk[0]
        R[mix] = Rk[1:]
    # Weight gradients from R = sum_pairs M phi (see csrc/offset_bias/bias_math.h).
    w2d, b1d, w1d = w2a.double(), b1a.double(), w1a.double()  # the last products in float64 too
    g_w1 = w2d[:, None] * R[:, :D]
    g_b1 = w2d * R[:, D]
    g_w2 = b1d * R[:, D] + (w1d * R[:, :D]).sum(1)
    g_scale = s1 + b2a[0].double() * s0
    g_b2 = sa[0].double() * s0
    return [g_uq.to(u_q.dtype), g_ud.to(u_d.dtype), g_w1.to(w1.dtype), g_b1.to(b1.dtype).reshape(b1.shape),
            g_w2.to(w2.dtype).reshape(w2.shape), g_b2.to(b2.dtype).reshape(b2.shape),
            g_scale.to(scale.dtype).reshape(scale.shape)]


@_offset_bias_backward.register_fake
def _(grad, u_q, u_d, w1, b1, w2, b2, scale):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (u_q, u_d, w1, b1, w2, b2, scale)]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return tuple(torch.ops.tempokern.offset_bias_backward(grad, *ctx.saved_tensors))


_offset_bias.register_autograd(_backward, setup_context=_setup)


# ---- validation ----------------------------------------------------------------------------------

def _validate(u_q, u_d, w1, b1, w2, b2, scale) -> None:
    check_tensor("u_q", u_q, ndim=1, floating=True)
    check_tensor("u_d", u_d, ndim=1, floating=True)
    check_tensor("w1", w1, ndim=2, floating=True)
    hidden, D = w1.shape
    if hidden < 1 or D < 1:
        raise ValueError(f"w1 must have shape (hidden, D) with hidden >= 1 and D >= 1, got {tuple(w1.shape)}")
    check_tensor("b1", b1, floating=True)
    if tuple(b1.shape) != (hidden,):
        raise ValueError(f"b1 must have shape (hidden,) = ({hidden},) to match w1 of shape {tuple(w1.shape)}, "
                         f"got {tuple(b1.shape)}")
    check_tensor("w2", w2, floating=True)
    if tuple(w2.shape) != (1, hidden):
        raise ValueError(f"w2 must have shape (1, hidden) = (1, {hidden}) to match w1 of shape {tuple(w1.shape)}, "
                         f"got {tuple(w2.shape)}")
    check_tensor("b2", b2, floating=True)
    if tuple(b2.shape) != (1,):
        raise ValueError(f"b2 must have shape (1,), got {tuple(b2.shape)}")
    check_tensor("scale", scale, floating=True)
    if scale.dim() != 0:
        raise ValueError(f"scale must be a 0-d (scalar) tensor, got shape {tuple(scale.shape)}")
    check_same_device(u_q=u_q, u_d=u_d, w1=w1, b1=b1, w2=w2, b2=b2, scale=scale)
    for name, t in (("u_q", u_q), ("u_d", u_d), ("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2), ("scale", scale)):
        check_finite(name, t)


#: Largest training table: 2^20 + 1 points (step 1.9e-6: the interpolation error, ~4e-6 at 4,097 points and
#: falling with the square of the step, is then far below float32's resolution). The table backward keeps one
#: float64 histogram of the table per thread / CTA, so a larger table costs memory and buys no accuracy.
MAX_TABLE_POINTS = 2 ** 20 + 1


def check_table_points(name: str, points) -> int:
    """A table size: an int in [2, MAX_TABLE_POINTS] (bools rejected)."""
    if isinstance(points, bool) or not isinstance(points, int):
        raise TypeError(f"{name} must be an int (or None), got {type(points).__name__}")
    if points < 2:
        raise ValueError(f"{name} must be >= 2, got {points}")
    if points > MAX_TABLE_POINTS:
        raise ValueError(f"{name} must be <= {MAX_TABLE_POINTS} (2**20 + 1), got {points}")
    return points


def offset_bias(u_q: torch.Tensor, u_d: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                b2: torch.Tensor, scale: torch.Tensor, table_points=None) -> torch.Tensor:
    """Relative-offset bias (Bq, Bd): scale * (w2 . relu(w1 phi(clamp(u_d[j] - u_q[i], -1, 1)) + b1) + b2).

    u_q (Bq,), u_d (Bd,), w1 (hidden, D), b1 (hidden,), w2 (1, hidden), b2 (1,), scale 0-d; phi as in
    :func:`tempokern.reference.offset_bias`. Output in the promoted dtype of the inputs (float32
    accumulation, float64 for float64); differentiable in all seven inputs. Memory O(Bq*Bd + B*D).

    ``table_points=N`` (an int >= 2) is the training table mode: the MLP is evaluated exactly in float64 at
    the N grid points delta_p = -1 + 2p/(N-1) (:func:`tempokern.reference.offset_bias_table`, differentiable
    torch), and the kernels interpolate linearly between them; gradients are exact for that interpolated
    function (spec: :func:`tempokern.reference.offset_bias_tabulated`) and reach all seven inputs. The output
    then has the promoted dtype of u_q and u_d (like the lookup). Extra memory O(N x 2 SMs) float64 on CUDA."""
    _validate(u_q, u_d, w1, b1, w2, b2, scale)
    if table_points is None:
        return torch.ops.tempokern.offset_bias(u_q, u_d, w1, b1, w2, b2, scale)
    N = check_table_points("table_points", table_points)
    return torch.ops.tempokern.offset_bias_interp(u_q, u_d, offset_bias_table(w1, b1, w2, b2, scale, N))


# ---- training table mode: interpolation of a differentiable table -----------------------------------

def _table_parts(be, Bq: int, Bd: int):
    """(rparts, cparts, nparts): rows of the d u_q / d u_d partial arrays and histogram slots of the table
    backward (CUDA: one per column / row tile and one per CTA, grid = min(tiles, 2 x SMs); CPU: 1, 1, threads)."""
    be = backend.of(be)
    if be.cuda_path:
        n_ct, n_rt = -(-Bd // _TABLE_TILE_COLS), -(-Bq // _TABLE_TILE_ROWS)
        return n_ct, n_rt, max(1, min(n_ct * n_rt, 2 * be.sm_count))
    return 1, 1, max(1, min(64, os.cpu_count() or 1))


_TABLE_TILE_ROWS, _TABLE_TILE_COLS = 64, 256  # csrc/offset_bias/offset_bias.h kTableTile{Rows,Cols}


def _table_launch(op: str, u_q, u_d, values, table_dtype=None):
    """(Bq, Bd) interpolated table over (u_q, u_d), in the promoted dtype of u: "tfwd" (training: the table in
    the accumulation dtype) or "lookup" (inference: a float32 BiasTable, table_dtype=float32)."""
    out_dt = torch.promote_types(u_q.dtype, u_d.dtype)
    acc = acc_dtype(out_dt)
    out = torch.empty(u_q.shape[0], u_d.shape[0], dtype=out_dt, device=u_q.device)
    if out.numel() == 0:
        return out
    uq, ud = u_q.to(acc).contiguous(), u_d.to(acc).contiguous()
    v = values.to(acc if table_dtype is None else table_dtype).contiguous()
    be = backend.resolve(u_q)
    dev, stream = be.launch
    be.kernels.offset_bias_launch(op, dev, stream, dtype_code(out), out.shape[0], out.shape[1], 0, 0, ptr(uq), ptr(ud),
                                 0, 0, 0, 0, 0, 0, 0, ptr(out), out.stride(0), 0, 0, 1, 0, 0, 0, 0, ptr(v), v.numel(),
                                 0, 0)
    return out


@torch.library.custom_op("tempokern::offset_bias_interp", mutates_args=())
def _offset_bias_interp(u_q: torch.Tensor, u_d: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return _table_launch("tfwd", u_q, u_d, values)


@_offset_bias_interp.register_fake
def _(u_q, u_d, values):
    return u_q.new_empty(u_q.shape[0], u_d.shape[0], dtype=torch.promote_types(u_q.dtype, u_d.dtype))


@torch.library.custom_op("tempokern::offset_bias_interp_backward", mutates_args=())
def _offset_bias_interp_backward(grad: torch.Tensor, u_q: torch.Tensor, u_d: torch.Tensor,
                                 values: torch.Tensor) -> List[torch.Tensor]:
    out_dt = torch.promote_types(u_q.dtype, u_d.dtype)
    acc = acc_dtype(out_dt)
    Bq, Bd, N = u_q.shape[0], u_d.shape[0], values.shape[0]
    dev_t = u_q.device
    if Bq == 0 or Bd == 0:
        return [torch.zeros_like(u_q), torch.zeros_like(u_d), torch.zeros_like(values)]
    uq, ud, v = u_q.to(acc).contiguous(), u_d.to(acc).contiguous(), values.to(acc).contiguous()
    grad = grad.to(out_dt)
    be = backend.resolve(u_q)
    rparts, cparts, nparts = _table_parts(be, Bq, Bd)
    g_uq = torch.empty(rparts, Bq, dtype=acc, device=dev_t)
    g_ud = torch.empty(cparts, Bd, dtype=acc, device=dev_t)
    hist = torch.empty(nparts, N, dtype=torch.float64, device=dev_t)
    dev, stream = be.launch
    be.kernels.offset_bias_launch("tbwd", dev, stream, dtype_code(grad), Bq, Bd, 0, 0, ptr(uq), ptr(ud), 0, 0, 0, 0, 0,
                                 0, 0, 0, 0, ptr(grad), grad.stride(0), grad.stride(1), ptr(g_uq), ptr(g_ud),
                                 ptr(hist), nparts, ptr(v), N, 0, 0)
    return [g_uq.double().sum(0).to(u_q.dtype), g_ud.double().sum(0).to(u_d.dtype), hist.sum(0).to(values.dtype)]


@_offset_bias_interp_backward.register_fake
def _(grad, u_q, u_d, values):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (u_q, u_d, values)]


def _interp_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _interp_backward(ctx, grad):
    return tuple(torch.ops.tempokern.offset_bias_interp_backward(grad, *ctx.saved_tensors))


_offset_bias_interp.register_autograd(_interp_backward, setup_context=_interp_setup)


# ---- table lookup (inference) ----------------------------------------------------------------------

@torch.library.custom_op("tempokern::offset_bias_lookup", mutates_args=())
def _offset_bias_lookup(u_q: torch.Tensor, u_d: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return _table_launch("lookup", u_q, u_d, values, torch.float32)


@_offset_bias_lookup.register_fake
def _(u_q, u_d, values):
    return u_q.new_empty(u_q.shape[0], u_d.shape[0], dtype=torch.promote_types(u_q.dtype, u_d.dtype))


def offset_bias_lookup(u_q: torch.Tensor, u_d: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Bias read from a table (see :class:`tempokern.nn.BiasTable`) by linear interpolation over
    delta = clamp(u_d[j] - u_q[i], -1, 1); (Bq, Bd) in the promoted dtype of u_q and u_d. Inference only
    (no autograd). Spec: :func:`tempokern.reference.offset_bias_lookup`."""
    check_tensor("u_q", u_q, ndim=1, floating=True)
    check_tensor("u_d", u_d, ndim=1, floating=True)
    check_tensor("values", values, ndim=1, dtypes=(torch.float32,))
    if values.shape[0] < 2:
        raise ValueError(f"values must hold at least 2 table points, got {values.shape[0]}")
    check_same_device(u_q=u_q, u_d=u_d, values=values)
    check_finite("u_q", u_q)
    check_finite("u_d", u_d)
    return torch.ops.tempokern.offset_bias_lookup(u_q, u_d, values)
