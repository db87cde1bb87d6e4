"""Plain PyTorch CTD top-k: the full (Q, N) score matrix, then a stable sort.

This is the specification `tempokern.ctd_topk` is tested against:

    s_ij = q_i . g_j / temperature + bias_ij

top-k per query sorted by score descending, ties broken by the LOWER gallery index
(`torch.topk` does not promise that, hence the stable sort). Excluded ids get no slot;
when fewer than k gallery items remain for a query, the tail is value -inf, index -1.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fourier_features(delta: torch.Tensor, D: int) -> torch.Tensor:
    """phi(delta) as in issue 3: [sin(x f), cos(x f)] zero-padded (or cut) to D, K = max(1, D // 2),
    f_k = exp(-ln(10000) t_k), t = linspace(0, 1, K)."""
    K = max(1, D // 2)
    t = torch.linspace(0, 1, K, dtype=torch.float64)
    f = torch.exp(-math.log(10000.0) * t).to(delta.dtype).to(delta.device)
    ang = delta[..., None] * f
    phi = torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1)
    if phi.shape[-1] >= D:
        return phi[..., :D]
    pad = torch.zeros(*phi.shape[:-1], D - phi.shape[-1], dtype=phi.dtype, device=phi.device)
    return torch.cat([phi, pad], dim=-1)


def offset_bias(u_q, u_g, w1, b1, w2, b2, scale) -> torch.Tensor:
    """The exact relative-offset bias (Q, N). Issue 3's `tempokern.reference.offset_bias` is the
    spec; this uses it when present and otherwise the same formula written out here."""
    try:
        from .offset_bias import offset_bias as _ob  # issue 3
    except ImportError:
        _ob = None
    if _ob is not None:
        return _ob(u_q, u_g, w1, b1, w2, b2, scale)
    dt = torch.float64 if u_q.dtype == torch.float64 else torch.float32
    delta = (u_g.to(dt)[None, :] - u_q.to(dt)[:, None]).clamp(-1.0, 1.0)
    phi = _fourier_features(delta, w1.shape[1])
    h = torch.relu(phi @ w1.to(dt).t() + b1.to(dt))
    return scale.to(dt) * ((h @ w2.to(dt).t()).squeeze(-1) + b2.to(dt).reshape(()))


def table_values(table) -> torch.Tensor:
    """The float32 samples of a bias table (a BiasTable, or its `values` tensor itself)."""
    values = table if isinstance(table, torch.Tensor) else getattr(table, "values", None)
    if not isinstance(values, torch.Tensor):
        raise TypeError("table must be a tempokern.nn.BiasTable (or a tensor of samples), "
                        f"got {type(table).__name__}")
    return values


def table_bias(u_q, u_g, table) -> torch.Tensor:
    """Bias by linear interpolation in P samples at delta = -1 + 2 i / (P - 1),
    delta = clamp(u_g - u_q, -1, 1)."""
    values = table_values(table).to(torch.float32)
    P = values.shape[0]
    delta = (u_g.to(torch.float32)[None, :] - u_q.to(torch.float32)[:, None]).clamp(-1.0, 1.0)
    t = (delta + 1.0) * (0.5 * (P - 1))
    i = t.floor().clamp(0, P - 2).to(torch.long)
    frac = t - i.to(t.dtype)
    v = values.to(delta.device)
    return v[i] + frac * (v[i + 1] - v[i])


def ctd_scores(q, g, *, temperature: float = 1.0, bias=None) -> torch.Tensor:
    """The full (Q, N) CTD score matrix in the accumulation dtype (float32; float64 for float64)."""
    dt = _acc_dtype(q)
    s = (q.to(dt) @ g.to(dt).t()) / temperature
    if bias is None:
        return s
    if len(bias) == 7:
        b = offset_bias(*bias)
    elif len(bias) == 3:
        b = table_bias(*bias)
    else:
        raise ValueError("bias must be None, (u_q, u_g, w1, b1, w2, b2, scale) or (u_q, u_g, table)")
    return s + b.to(dt)


def sorted_topk(scores: torch.Tensor, k: int):
    """Top-k of each row by score descending, ties by the lower column index; -inf entries
    (excluded) come back as index -1."""
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    values = order.values[:, :k].contiguous()
    indices = order.indices[:, :k].to(torch.int64).contiguous()
    indices[values == float("-inf")] = -1
    return values, indices


def ctd_topk(q: torch.Tensor, g: torch.Tensor, k: int, *, temperature: float = 1.0, bias=None,
             exclude: Optional[torch.Tensor] = None):
    """(values (Q, k) float32 [float64 for float64 input], indices (Q, k) int64). See module doc."""
    if k > g.shape[0]:
        raise ValueError(f"k must be <= the gallery size {g.shape[0]}, got {k}")
    s = ctd_scores(q, g, temperature=temperature, bias=bias)
    if exclude is not None and exclude.numel() > 0:
        ex = exclude.to(torch.long)
        rows = torch.arange(s.shape[0], device=s.device)[:, None].expand_as(ex)
        keep = ex >= 0
        s = s.clone()
        s[rows[keep], ex[keep]] = float("-inf")
    return sorted_topk(s, k)
