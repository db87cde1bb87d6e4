"""Plain PyTorch relative-offset bias (CTD's eps * MLP(phi(u_d - u_q))): the specification the fused
kernels in tempokern.offset_bias are tested against. It materialises the (Bq, Bd, D) Fourier tensor and
the (Bq, Bd, hidden) activation, which is exactly what the fused op avoids."""
from __future__ import annotations

import math

import torch

#: The lookup table covers delta in [-TABLE_RANGE, TABLE_RANGE] (the clamp range of the bias).
TABLE_RANGE = 1.0


from .._util import CACHE_MAX, cache_put  # noqa: F401  (bounded module-level caches)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def bias_frequencies(D: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The K = max(1, D // 2) frequencies f_k = exp(-ln(10000) * t_k), t = linspace(0, 1, K) (f_0 = 1).

    Computed in float32 (float64 when ``dtype`` is float64) exactly like the reference does, then cast to
    ``dtype``; the fused kernels receive this tensor rather than recomputing it."""
    K = max(1, int(D) // 2)
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    # Computed once on the CPU (the same numbers on every device) and cached per (K, dtype, device): a fresh
    # copy per call would be a host-to-device copy from pageable memory, which waits for the stream, i.e. one
    # host sync per training step in the bias modes (measured on the H100). Callers must not
    # modify the returned tensor.
    key = (K, dtype, dev)
    f = _FREQ_CACHE.get(key)
    if f is None:
        with torch.inference_mode(False), torch.no_grad():   # usable by autograd even if first made in inference
            work = torch.float64 if dtype == torch.float64 else torch.float32
            t = torch.linspace(0, 1, K, dtype=work)
            f = cache_put(_FREQ_CACHE, key, torch.exp(-math.log(10000.0) * t).to(dtype=dtype, device=dev))
    return f


_FREQ_CACHE: dict = {}


def offset_features(delta: torch.Tensor, D: int) -> torch.Tensor:
    """phi(delta) = [sin(delta f_0..f_{K-1}), cos(delta f_0..f_{K-1})], zero-padded (or, for D = 1,
    truncated) to D features; shape delta.shape + (D,)."""
    f = bias_frequencies(D, delta.dtype, delta.device)
    ang = delta[..., None] * f
    feats = torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1)
    if feats.shape[-1] >= D:
        return feats[..., :D]
    pad = feats.new_zeros(feats.shape[:-1] + (D - feats.shape[-1],))
    return torch.cat([feats, pad], dim=-1)


def offset_bias(u_q: torch.Tensor, u_d: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
                w2: torch.Tensor, b2: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """out[i, j] = scale * (w2 . relu(w1 phi(clamp(u_d[j] - u_q[i], -1, 1)) + b1) + b2), shape (Bq, Bd).

    u_q (Bq,), u_d (Bd,), w1 (hidden, D), b1 (hidden,), w2 (1, hidden), b2 (1,), scale 0-d.
    Computed in torch's type promotion of all inputs (plain PyTorch, no upcast), so a bfloat16 call
    shows plain PyTorch's own bfloat16 error; pass float32 inputs for the accuracy reference."""
    dt = u_q.dtype
    for t in (u_d, w1, b1, w2, b2, scale):
        dt = torch.promote_types(dt, t.dtype)
    delta = torch.clamp(u_d.to(dt)[None, :] - u_q.to(dt)[:, None], -1.0, 1.0)   # (Bq, Bd)
    phi = offset_features(delta, w1.shape[1])                                   # (Bq, Bd, D)
    h = torch.relu(phi @ w1.to(dt).t() + b1.to(dt))                              # (Bq, Bd, hidden)
    y = (h @ w2.to(dt).t()).squeeze(-1) + b2.to(dt)                              # (Bq, Bd)
    return scale.to(dt) * y


def table_points_delta(points: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The table's sample positions: delta_p = -1 + 2 p / (points - 1), p = 0..points-1."""
    return torch.linspace(-TABLE_RANGE, TABLE_RANGE, int(points), dtype=dtype, device=device)


def offset_bias_table_values(w1, b1, w2, b2, scale, points: int) -> torch.Tensor:
    """Tabulated bias: values[p] = scale * (w2 . relu(w1 phi(delta_p) + b1) + b2) at table_points_delta,
    computed in float64 and returned as float32 (the BiasTable format: scale and b2 included)."""
    with torch.no_grad():
        d = table_points_delta(points, torch.float64, w1.device)
        phi = offset_features(d, w1.shape[1])
        h = torch.relu(phi @ w1.double().t() + b1.double())
        y = (h @ w2.double().t()).squeeze(-1) + b2.double()
        return (scale.double() * y).to(torch.float32)


def offset_bias_table(w1, b1, w2, b2, scale, points: int) -> torch.Tensor:
    """The tabulated bias as a differentiable float64 (points,) tensor: values[p] = scale * (w2 . relu(w1
    phi(delta_p) + b1) + b2) at delta_p = table_points_delta(points). The training table mode
    (``bias_table_points=N`` of multipos_infonce / CTDLoss, ``table_points=N`` of offset_bias) evaluates
    the MLP here, exactly, and interpolates it with :func:`offset_bias_lookup`; gradients reach all five
    MLP inputs through this function."""
    phi = table_features(points, w1.shape[1], w1.device)
    h = torch.relu(phi @ w1.double().t() + b1.double())
    y = (h @ w2.double().t()).squeeze(-1) + b2.double().reshape(())
    return scale.double().reshape(()) * y


_TABLE_PHI: dict = {}


def table_features(points: int, D: int, device=None) -> torch.Tensor:
    """phi(delta_p) at the table's points, float64 (points, D): a constant of (points, D, device), cached
    (the training table mode evaluates the MLP at these points every step; recomputing them was ~8 small
    launches per step in the forward alone)."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    key = (int(points), int(D), dev)
    phi = _TABLE_PHI.get(key)
    if phi is None:
        with torch.inference_mode(False), torch.no_grad():
            phi = cache_put(_TABLE_PHI, key, offset_features(table_points_delta(points, torch.float64, dev), D))
    return phi


def offset_bias_tabulated(u_q, u_d, w1, b1, w2, b2, scale, points: int) -> torch.Tensor:
    """The table mode of the bias: ``offset_bias_lookup(u_q, u_d, offset_bias_table(w1, ..., points))``,
    differentiable in all seven inputs (the interpolant's slope for u_q/u_d, zero where the clamp bites).
    Returned in the promoted dtype of u_q and u_d, like the lookup."""
    return offset_bias_lookup(u_q, u_d, offset_bias_table(w1, b1, w2, b2, scale, points))


def offset_bias_lookup(u_q: torch.Tensor, u_d: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Table evaluation, the spec for the in-kernel lookup: x = (clamp(u_d[j] - u_q[i], -1, 1) + 1) / 2
    * (P - 1) for P = values.numel() points; out = lerp(values[floor(x)], values[floor(x) + 1], x - floor(x))
    with the index clamped to [0, P - 2]. Computed in float32 (float64 for float64 u), returned in the
    promoted dtype of u_q and u_d; (Bq, Bd)."""
    out_dt = torch.promote_types(u_q.dtype, u_d.dtype)
    acc = _acc_dtype(out_dt)
    v = values.to(acc)
    P = v.numel()
    delta = torch.clamp(u_d.to(acc)[None, :] - u_q.to(acc)[:, None], -1.0, 1.0)
    if P == 1:
        return v[0].expand_as(delta).to(out_dt)
    x = (delta + 1.0) * (0.5 * (P - 1))
    i0 = torch.clamp(torch.floor(x), 0, P - 2)
    t = x - i0
    i0 = i0.long()
    return (v[i0] + t * (v[i0 + 1] - v[i0])).to(out_dt)
