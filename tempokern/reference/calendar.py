"""Plain PyTorch soft-calendar ops: the specification the fused kernels are tested against."""
from __future__ import annotations

import math
from typing import Sequence

import torch


def level_weights(sizes: Sequence[int]) -> list[float]:
    """Weight of each level's expected index in u: prod(n_k for k > l) / (prod(n) - 1)."""
    total = math.prod(int(n) for n in sizes)
    if total <= 1:
        return [0.0] * len(sizes)
    return [math.prod(int(n) for n in sizes[l + 1:]) / (total - 1) for l in range(len(sizes))]


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def calendar_scalar(logits: Sequence[torch.Tensor], tau: float = 1.0) -> torch.Tensor:
    """u = sum_l E_{softmax(logits_l/tau)}[c] * prod_{k>l} n_k / (prod_l n_l - 1), in float32
    (float64 for float64 input). For 12 dukes x 32 years x 12 months this is
    (g*Y*M + y*M + m) / (G*Y*M - 1) with g, y, m the expected indices."""
    dt = _acc_dtype(logits[0])
    weights = level_weights([x.shape[1] for x in logits])
    u = torch.zeros(logits[0].shape[0], dtype=dt, device=logits[0].device)
    for x, w in zip(logits, weights):
        p = torch.softmax(x.to(dt) / tau, dim=-1)
        idx = torch.arange(x.shape[1], dtype=dt, device=x.device)
        u = u + w * (p @ idx)
    return u


def fourier_table(n: int, dim: int, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Fixed sinusoidal codebook (n, dim): position c/(n-1) (0 if n == 1), half = dim // 2
    frequencies exp(-ln(10000) i / max(1, half - 1)), columns [sin, cos], zero-padded to dim.
    dim == 1 (no frequency): the position column c/(n-1) itself, as ChunQiuTR's _build_fourier_table."""
    half = dim // 2
    pos = torch.arange(n, dtype=torch.float64) / max(1, n - 1)
    if half == 0:
        return pos[:, None].to(dtype=dtype, device=device)
    i = torch.arange(half, dtype=torch.float64)
    freqs = torch.exp(-math.log(10000.0) * i / max(1, half - 1))
    ang = pos[:, None] * freqs[None, :]
    table = torch.zeros(n, dim, dtype=torch.float64)
    table[:, :half] = torch.sin(ang)
    table[:, half:2 * half] = torch.cos(ang)
    return table.to(dtype=dtype, device=device)


def calendar_context(logits: Sequence[torch.Tensor], dim: int, tau: float = 1.0) -> torch.Tensor:
    """Concatenation over levels of softmax(logits_l / tau) @ fourier_table(n_l, dim); (B, L*dim)
    in the logits' dtype, computed in float32 (float64 for float64 input)."""
    dt = _acc_dtype(logits[0])
    parts = []
    for x in logits:
        p = torch.softmax(x.to(dt) / tau, dim=-1)
        parts.append(p @ fourier_table(x.shape[1], dim, dtype=dt, device=x.device))
    return torch.cat(parts, dim=-1).to(logits[0].dtype)
