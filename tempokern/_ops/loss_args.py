"""Argument checks shared by the two InfoNCE losses (tempokern/_ops/multipos_infonce.py and
matryoshka_infonce.py) and their torch.nn wrappers: the (start, end) span pairs and their int64 bounds,
the offset-bias argument (the 7-tuple of offset_bias, or (u_q, u_d, module)) and ``bias_table_points``."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .common import check_finite, check_tensor
from .offset_bias import bias_params, check_table_points

#: the names of offset_bias's seven inputs, in the order of the bias tuple (for messages)
BIAS_NAMES = ("u_q", "u_d", "w1", "b1", "w2", "b2", "scale")


def check_span(name: str, span, B: int):
    """Checks a (start, end) pair of integer (B,) tensors; returns it unchanged."""
    if isinstance(span, torch.Tensor) or not isinstance(span, (tuple, list)) or len(span) != 2:
        raise TypeError(f"{name} must be a (start, end) pair of integer tensors of shape ({B},)")
    for k, t in zip(("start", "end"), span):
        check_tensor(f"{name} {k}", t, ndim=1, integer=True)
        if t.shape[0] != B:
            raise ValueError(f"{name} {k} has length {t.shape[0]}, expected {B} (one span per row)")
    return span


def span_bounds(span) -> Tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) int64 contiguous bounds of a checked span pair (closed intervals, either order)."""
    s, e = (t.to(torch.int64) for t in span)
    return torch.minimum(s, e).contiguous(), torch.maximum(s, e).contiguous()


def id_spans(n: int, start: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bounds (i, i) for rows start .. start + n - 1: spans that overlap only on the diagonal."""
    ids = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return ids, ids


_BIAS_FORMS = ("bias must be None, (u_q, u_d, module) with module a tempokern.nn.OffsetBias, or the 7-tuple "
               "(u_q, u_d, w1, b1, w2, b2, scale) of offset_bias")


def _is_bias_module(m) -> bool:
    return isinstance(m, torch.nn.Module) and hasattr(m, "mlp") and hasattr(m, "scale")


def validate_bias(bias, Bq: int, Bd: int):
    """Checks a bias argument and returns it as the 7-tuple (u_q, u_d, w1, b1, w2, b2, scale).
    ``(u_q, u_d, module)`` with an OffsetBias (or any module with ``mlp[0]``/``mlp[2]`` Linear layers and a
    ``scale``) becomes ``(u_q, u_d, *bias_params(module))``: the module's own parameters, so gradients reach
    them. The exact MLP is used; the module's ``table_points`` attribute is not read (pass
    ``bias_table_points=`` for the table mode)."""
    if _is_bias_module(bias):
        raise TypeError(f"{_BIAS_FORMS}; got the module alone: pass bias=(u_q, u_d, module)")
    if isinstance(bias, (tuple, list)) and len(bias) == 3:
        m = bias[2]
        if not _is_bias_module(m):
            what = type(m).__name__
            hint = (" (a BiasTable is the inference table of ctd_topk and TemporalIndex.search; "
                    "the loss needs the module)") if what == "BiasTable" else ""
            raise TypeError(f"{_BIAS_FORMS}; got a 3-tuple whose third item is a {what}{hint}")
        bias = (bias[0], bias[1], *bias_params(m))
    if isinstance(bias, torch.Tensor) or not isinstance(bias, (tuple, list)) or len(bias) != 7:
        got = type(bias).__name__ + (f" of length {len(bias)}" if isinstance(bias, (tuple, list)) else "")
        raise TypeError(f"{_BIAS_FORMS}, got {got}")
    for n, t in zip(BIAS_NAMES, bias):
        check_tensor(f"bias {n}", t, floating=True)
        check_finite(f"bias {n}", t)
    u_q, u_d, w1, b1, w2, b2, scale = bias
    if u_q.shape != (Bq,):
        raise ValueError(f"bias u_q must have shape ({Bq},), got {tuple(u_q.shape)}")
    if u_d.shape != (Bd,):
        raise ValueError(f"bias u_d must have shape ({Bd},), got {tuple(u_d.shape)}")
    if w1.dim() != 2 or w1.shape[0] < 1 or w1.shape[1] < 1:
        raise ValueError(f"bias w1 must be (hidden, D) with hidden, D >= 1, got shape {tuple(w1.shape)}")
    hidden = w1.shape[0]
    if b1.shape != (hidden,):
        raise ValueError(f"bias b1 must have shape ({hidden},) to match w1, got {tuple(b1.shape)}")
    if w2.shape != (1, hidden):
        raise ValueError(f"bias w2 must have shape (1, {hidden}) to match w1, got {tuple(w2.shape)}")
    if b2.numel() != 1 or b2.dim() > 1:
        raise ValueError(f"bias b2 must have shape (1,), got {tuple(b2.shape)}")
    if scale.numel() != 1 or scale.dim() > 1:
        raise ValueError(f"bias scale must be a scalar tensor, got shape {tuple(scale.shape)}")
    return tuple(bias)


def check_bias_table_points(points, bias) -> Optional[int]:
    """Validates a loss's ``bias_table_points``: None (exact bias) or an int in [2, MAX_TABLE_POINTS], with a
    bias."""
    if points is None:
        return None
    check_table_points("bias_table_points", points)
    if bias is None:
        raise ValueError("bias_table_points was given without a bias")
    return points


def check_groups(q_group, d_group, Bq: int, Bd: int):
    """Checks the group ids of a loss call: both None, or integer (Bq,) and (Bd,) tensors (any integer dtype,
    compared as int64). Returns them as int64 contiguous tensors, or (None, None)."""
    if q_group is None and d_group is None:
        return None, None
    if q_group is None or d_group is None:
        given, missing = ("q_group", "d_group") if d_group is None else ("d_group", "q_group")
        raise ValueError(f"{given} was given without {missing}: pass both (one group id per query row and per "
                         "document row) or neither")
    out = []
    for name, t, n in (("q_group", q_group, Bq), ("d_group", d_group, Bd)):
        check_tensor(name, t, ndim=1, integer=True)
        if t.shape[0] != n:
            raise ValueError(f"{name} has length {t.shape[0]}, expected {n} (one group id per row)")
        out.append(t.to(torch.int64).contiguous())
    return tuple(out)


def group_scoped_bounds(q_group, d_group, q_lo, q_hi, d_lo, d_hi):
    """Span bounds on which the closed-interval overlap test is the group-scoped one: rows i and j overlap on
    the returned bounds iff their intervals overlap and q_group[i] == d_group[j].

    Every bound becomes the dense rank of its key (group, bound) in lexicographic order (equal keys, equal
    ranks): within a group the order of the bounds and their ties are kept, so the overlap test is unchanged
    there, and every bound of a smaller group lies below every bound of a larger one, so intervals of two
    groups never meet. Two stable sorts and a cumulative sum over the 2 Bq + 2 Bd bounds, on the bounds'
    device: O(B log B) time, O(B) memory, static shapes (torch.compile traces it). The ranks are < 2^31, so
    the blocked path's int32 bounds keep them as they are."""
    Bq, Bd = q_lo.shape[0], d_lo.shape[0]
    v = torch.cat([q_lo, q_hi, d_lo, d_hi])
    g = torch.cat([q_group, q_group, d_group, d_group])
    order = torch.argsort(v, stable=True)
    order = order[torch.argsort(g[order], stable=True)]
    gs, vs = g[order], v[order]
    new = torch.ones_like(vs, dtype=torch.bool)
    new[1:] = (gs[1:] != gs[:-1]) | (vs[1:] != vs[:-1])
    rank = torch.empty_like(v).index_copy_(0, order, torch.cumsum(new.to(torch.int64), 0) - 1)
    return (rank[:Bq].contiguous(), rank[Bq:2 * Bq].contiguous(), rank[2 * Bq:2 * Bq + Bd].contiguous(),
            rank[2 * Bq + Bd:].contiguous())
