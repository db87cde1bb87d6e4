"""Plain PyTorch CTD top-k: the full (Q, N) score matrix, then a stable sort.

This is the specification `tempokern.ctd_topk` is tested against:

    s_ij = q_i . g_j / temperature + bias_ij

top-k per query sorted by score descending, ties broken by the LOWER gallery index
(`torch.topk` does not promise that, hence the stable sort). Excluded ids get no slot;
when fewer than k gallery items remain for a query, the tail is value -inf, index -1.
"""
from __future__ import annotations

from typing import Optional

import torch

from .offset_bias import offset_bias as _offset_bias
from .offset_bias import offset_bias_lookup


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def offset_bias(u_q, u_g, w1, b1, w2, b2, scale) -> torch.Tensor:
    """The exact relative-offset bias (Q, N), in float32 at least (the same formula as reference.offset_bias)."""
    dt = torch.float64 if torch.float64 in (u_q.dtype, w1.dtype) else torch.float32
    return _offset_bias(u_q.to(dt), u_g.to(dt), w1.to(dt), b1.to(dt), w2.to(dt).reshape(1, -1),
                        torch.as_tensor(b2).to(dt).reshape(1), torch.as_tensor(scale).to(dt).reshape(()))


def table_values(table) -> torch.Tensor:
    """The float32 samples of a bias table (a BiasTable, or its `values` tensor itself)."""
    values = table if isinstance(table, torch.Tensor) else getattr(table, "values", None)
    if not isinstance(values, torch.Tensor):
        raise TypeError("table must be a tempokern.nn.BiasTable (or a tensor of samples), "
                        f"got {type(table).__name__}")
    return values


def table_bias(u_q, u_g, table) -> torch.Tensor:
    """Bias by linear interpolation in P samples at delta = -1 + 2 i / (P - 1),
    delta = clamp(u_g - u_q, -1, 1) (offset_bias_lookup's formula, in float32 at least)."""
    dt = torch.float64 if u_q.dtype == torch.float64 else torch.float32
    return offset_bias_lookup(u_q.to(dt), u_g.to(dt), table_values(table).to(u_q.device))


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
             exclude: Optional[torch.Tensor] = None, q_group: Optional[torch.Tensor] = None,
             g_group: Optional[torch.Tensor] = None):
    """(values (Q, k) float32 [float64 for float64 input], indices (Q, k) int64). See module doc.
    q_group (Q,), g_group (N,): query i ranks only the rows j with g_group[j] == q_group[i] (the others as
    excluded)."""
    if k > g.shape[0]:
        raise ValueError(f"k must be <= the gallery size {g.shape[0]}, got {k}")
    s = ctd_scores(q, g, temperature=temperature, bias=bias)
    if q_group is not None:
        s = s.masked_fill(q_group.to(torch.int64)[:, None] != g_group.to(torch.int64)[None, :], float("-inf"))
    if exclude is not None and exclude.numel() > 0:
        ex = exclude.to(torch.long)
        rows = torch.arange(s.shape[0], device=s.device)[:, None].expand_as(ex)
        keep = ex >= 0
        s = s.clone()
        s[rows[keep], ex[keep]] = float("-inf")
    return sorted_topk(s, k)


def ctd_rerank(q: torch.Tensor, g: torch.Tensor, cand: torch.Tensor, k: int, *, temperature: float = 1.0,
               bias=None):
    """Spec of `tempokern._ops.ctd_topk.ctd_rerank`: query i scores only the gallery rows cand[i]
    ((Q, C) integers, negative = no candidate, duplicates count once), top-k by score descending with
    ties to the lower row; slots beyond the valid candidates are (-inf, -1). Candidates >= N raise."""
    N = g.shape[0]
    if cand.numel() and int(cand.max()) >= N:
        raise IndexError(f"cand holds gallery row indices, which must be < N={N}")
    s = ctd_scores(q, g, temperature=temperature, bias=bias)
    keep = torch.zeros_like(s, dtype=torch.bool)
    c = cand.to(torch.long)
    rows = torch.arange(s.shape[0], device=s.device)[:, None].expand_as(c)
    ok = c >= 0
    keep[rows[ok], c[ok]] = True
    s = s.masked_fill(~keep, float("-inf"))
    if k > N:  # more slots than rows: the tail is (-inf, -1)
        s = torch.cat([s, s.new_full((s.shape[0], k - N), float("-inf"))], 1)
    return sorted_topk(s, k)
