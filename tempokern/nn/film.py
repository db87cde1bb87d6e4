"""Re³'s continuous time embedding (Eqs. 4-7) and FiLM fusion (Eqs. 8-9).

No fused kernel (design notes §3.3): per text these are four tiny lookups/MLPs and an elementwise
modulation, noise next to the backbone forward.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


#: how MLP_y reads the year: the paper's normalised scalar, or (an extension) the scalar and sin / cos pairs
YEAR_ENCODINGS = ("scalar", "multiscale")
#: the multiscale encoding's default periods, in years
YEAR_PERIODS = (10.0, 100.0, 1000.0)


def _check_int(name, v, lo=1):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def periodic(x: torch.Tensor, period: float) -> torch.Tensor:
    """``φ(x, T) = [sin(2πx/T), cos(2πx/T)]`` -> (..., 2)."""
    a = x * (2.0 * math.pi / period)
    return torch.stack((torch.sin(a), torch.cos(a)), dim=-1)


class TimeEmbedding(nn.Module):
    """``e_time = [h_y; h_m; h_dom; h_doy]`` (Re³ Eqs. 4-7), four blocks of ``⌈dim/4⌉`` truncated to ``dim``
    (B5):

    - ``h_y = MLP_y((y - μ_y)/σ_y) ⊙ v_y`` with ``MLP_y = Linear(1, b) -> GELU -> Linear(b, b)`` (B3);
    - ``h_m = φ(m, 12) W_m ⊙ v_m``, ``W_m ∈ R^{2×b}`` (no bias);
    - ``h_dom = E_dom[dom] ⊙ v_dom``, ``E_dom ∈ R^{32×b}`` (row 0 unused, B4);
    - ``h_doy = φ(doy, 366) W_doy ⊙ (v_y ∧ v_m ∧ v_dom)``.

    ``forward(values (B, 4) int: y, m, dom, doy; mask (B, 3 or 4) bool: v_y, v_m, v_dom[, ignored])``:
    ``Exist_doy`` is always recomputed as ``v_y ∧ v_m ∧ v_dom`` (a fourth mask column is accepted and
    ignored). Unobserved blocks are exact zeros (``torch.where``), so a row with no observed part embeds to
    0. Observed values must be in range (month 1-12, dom 1-31, doy 1-366); masked values are ignored.
    ``year_mean`` / ``year_std`` (σ floored at 1 year) are buffers, saved with the state dict;
    :meth:`set_year_stats` fits them to observed years. The output dtype is the module's.

    ``year_encoding``: ``"scalar"`` (the paper's, default): ``MLP_y`` reads the one number ``(y - μ_y)/σ_y``;
    with σ_y of a century, neighbouring years differ by 0.01 input units, so ``h_y`` describes an era rather
    than a year. ``"multiscale"`` (an extension, not in the paper): ``MLP_y`` reads
    ``[(y - μ_y)/σ_y; φ(y, T_1); ...; φ(y, T_k)]`` for the periods ``year_periods`` (default 10, 100, 1000
    years: one year turns the 10-year pair by 36°), ``Linear(1 + 2k, b)``. A period of 1 year is refused: on
    integer years its sin / cos are constant."""

    def __init__(self, dim: int, *, year_mean: float = 2000.0, year_std: float = 10.0,
                 year_encoding: str = "scalar", year_periods=YEAR_PERIODS):
        super().__init__()
        _check_int("dim", dim)
        if year_encoding not in YEAR_ENCODINGS:
            raise ValueError(f"year_encoding must be one of {YEAR_ENCODINGS}, got {year_encoding!r}")
        periods = tuple(float(t) for t in year_periods)
        if year_encoding == "multiscale":
            if not periods or any(not (math.isfinite(t) and t > 1) for t in periods):
                raise ValueError(f"year_periods must be periods > 1 year, got {year_periods!r}")
        self.dim = dim
        self.year_encoding = year_encoding
        self.year_periods = periods if year_encoding == "multiscale" else ()
        self.block = b = -(-dim // 4)
        self.mlp_y = nn.Sequential(nn.Linear(1 + 2 * len(self.year_periods), b), nn.GELU(), nn.Linear(b, b))
        self.w_m = nn.Linear(2, b, bias=False)
        self.e_dom = nn.Embedding(32, b)
        self.w_doy = nn.Linear(2, b, bias=False)
        self.register_buffer("year_mean", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("year_std", torch.tensor(1.0, dtype=torch.float64))
        self.set_year_stats(mean=year_mean, std=year_std)

    def set_year_stats(self, years: Optional[Iterable[int]] = None, *, mean: Optional[float] = None,
                       std: Optional[float] = None) -> "TimeEmbedding":
        """Set μ_y, σ_y from observed ``years`` (mean / population std) or explicitly; σ floored at 1."""
        if years is not None:
            ys = torch.as_tensor([float(y) for y in years], dtype=torch.float64)
            if ys.numel() == 0:
                raise ValueError("years: no observed year to fit the year statistics on")
            mean, std = float(ys.mean()), float(ys.std(unbiased=False))
        if mean is None or std is None:
            raise ValueError("set_year_stats needs years= or both mean= and std=")
        if not (math.isfinite(mean) and math.isfinite(std)):
            raise ValueError(f"year_mean / year_std must be finite, got {mean!r}, {std!r}")
        with torch.no_grad():
            self.year_mean.fill_(float(mean))
            self.year_std.fill_(max(float(std), 1.0))
        return self

    def extra_repr(self) -> str:
        return f"dim={self.dim}, block={self.block}, year_mean={float(self.year_mean):.2f}, " \
               f"year_std={float(self.year_std):.2f}, year_encoding={self.year_encoding!r}"

    def forward(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not isinstance(values, torch.Tensor) or values.dim() != 2 or values.shape[1] != 4:
            raise ValueError(f"values must be a (B, 4) tensor (y, m, dom, doy), got "
                             f"{tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__}")
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TypeError(f"values must be an integer tensor, got {values.dtype}")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != values.shape[0] \
                or mask.shape[1] not in (3, 4):
            raise ValueError(f"mask must be a (B, 3) or (B, 4) bool tensor matching values' B={values.shape[0]}, "
                             f"got {tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
        w = self.w_m.weight
        dtype, dev = w.dtype, w.device
        values, mask = values.to(dev), mask.to(dev)
        vy, vm, vd = mask[:, 0], mask[:, 1], mask[:, 2]
        vdoy = vy & vm & vd
        y, m, dom, doy = values.unbind(1)
        for name, x, ok, lo, hi in (("month", m, vm, 1, 12), ("day of month", dom, vd, 1, 31),
                                    ("day of year", doy, vdoy, 1, 366)):
            bad = ok & ((x < lo) | (x > hi))
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"values: observed {name} {int(x[i])} at row {i} is outside {lo}..{hi}")
        zero = torch.zeros((), dtype=dtype, device=dev)
        yn = ((y.to(torch.float64) - self.year_mean) / self.year_std).to(dtype)
        yn = torch.where(vy, yn, zero)  # keeps the masked rows' MLP input finite
        x_y = yn[:, None]
        if self.year_periods:
            yr = torch.where(vy, y, 0).to(torch.float64)
            x_y = torch.cat([x_y] + [periodic(yr, t).to(dtype) for t in self.year_periods], dim=1)
        h_y = torch.where(vy[:, None], self.mlp_y(x_y), zero)
        h_m = torch.where(vm[:, None], self.w_m(periodic(m.to(dtype), 12.0)), zero)
        h_dom = torch.where(vd[:, None], self.e_dom(torch.where(vd, dom, 0)), zero)
        h_doy = torch.where(vdoy[:, None], self.w_doy(periodic(doy.to(dtype), 366.0)), zero)
        return torch.cat((h_y, h_m, h_dom, h_doy), dim=1)[:, :self.dim]


class FiLM(nn.Module):
    """Re³ FiLM fusion (Eqs. 8-9): ``(γ, β) = MLP_proj(e_time)``,
    ``e_final = normalize((1 + α γ) ⊙ e_sem + β)``.

    ``MLP_proj = Linear(dim, dim, bias=False) -> GELU -> Linear(dim, 2 dim, bias=False)`` (B2: bias-free, so
    ``e_time = 0`` gives ``γ = β = 0`` and ``e_final = normalize(e_sem)`` exactly); its last layer is
    zero-initialised and ``α = 1`` (B6: training starts at the base retriever). ``forward(e_sem (B, dim),
    e_time (B, dim)) -> (B, dim)`` L2-normalised (``F.normalize``, eps 1e-12). Computed in ``e_sem``'s
    dtype."""

    def __init__(self, dim: int, *, hidden: Optional[int] = None, alpha: float = 1.0):
        super().__init__()
        _check_int("dim", dim)
        hidden = dim if hidden is None else hidden
        _check_int("hidden", hidden)
        self.dim, self.hidden = dim, hidden
        self.proj = nn.Sequential(nn.Linear(dim, hidden, bias=False), nn.GELU(), nn.Linear(hidden, 2 * dim, bias=False))
        nn.init.zeros_(self.proj[2].weight)
        self.alpha = nn.Parameter(torch.tensor(float(alpha)))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden={self.hidden}"

    def modulation(self, e_time: torch.Tensor):
        """``(γ, β)``, each (B, dim)."""
        gb = self.proj(e_time)
        return gb[:, :self.dim], gb[:, self.dim:]

    def forward(self, e_sem: torch.Tensor, e_time: torch.Tensor) -> torch.Tensor:
        for name, x in (("e_sem", e_sem), ("e_time", e_time)):
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.dim:
                raise ValueError(f"{name} must be a (B, {self.dim}) tensor, got "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
            if not x.dtype.is_floating_point:
                raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
        if e_sem.shape[0] != e_time.shape[0]:
            raise ValueError(f"e_sem has {e_sem.shape[0]} rows, e_time {e_time.shape[0]}")
        gamma, beta = self.modulation(e_time.to(self.proj[0].weight.dtype))
        gamma, beta = gamma.to(e_sem.dtype), beta.to(e_sem.dtype)
        h = (1 + self.alpha.to(e_sem.dtype) * gamma) * e_sem + beta
        return F.normalize(h, dim=-1)


__all__ = ["TimeEmbedding", "FiLM", "periodic", "YEAR_ENCODINGS", "YEAR_PERIODS"]
