"""CTD's relative-offset bias as an nn.Module (training, fused op) and its frozen lookup table (inference)."""
from __future__ import annotations

import torch
from torch import nn

from .._ops.offset_bias import bias_params, check_table_points, offset_bias, offset_bias_lookup  # noqa: F401
from ..reference.offset_bias import offset_bias_table_values

#: Default table size (16 KiB of float32). Worst absolute error vs the exact op, measured over 200 randomly
#: initialised modules (nn.Linear init, features = hidden = 32, scale = 1) at 20001 float32 deltas in
#: [-1, 1]: 5.4e-6 (values are ~1e-2; the error is O(1/points), dominated by the ReLU kinks).
#: TABLE_ERROR_BOUND is the bound the tests hold such modules to; it scales with |scale| (docs/offset_bias.md).
DEFAULT_TABLE_POINTS = 4097
TABLE_ERROR_BOUND = 1e-5


class BiasTable:
    """Frozen lookup table of the bias as a function of delta = clamp(u_d - u_q, -1, 1).

    ``values`` is a float32 (points,) tensor, points >= 2, with
    ``values[p] = scale * (w2 . relu(w1 phi(delta_p) + b1) + b2)`` at ``delta_p = -1 + 2 p / (points - 1)``:
    scale and b2 are included, a value IS the bias. Evaluation interpolates linearly between the two
    neighbouring points (csrc/offset_bias/bias_math.h::bias_table_lookup, spec
    :func:`tempokern.reference.offset_bias_lookup`). Inference only: no gradients flow through it."""

    __slots__ = ("_values",)

    def __init__(self, values: torch.Tensor):
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.dim() != 1 or values.shape[0] < 2:
            raise ValueError(f"values must be 1-D with at least 2 points, got shape {tuple(values.shape)}")
        if not values.is_floating_point():
            raise TypeError(f"values must be floating point, got {values.dtype}")
        v = values.detach().to(torch.float32).contiguous().clone()
        if not bool(torch.isfinite(v).all()):
            raise ValueError("values contains NaN or Inf")
        object.__setattr__(self, "_values", v)

    def __setattr__(self, name, value):
        raise AttributeError("BiasTable is frozen; build a new one with OffsetBias.table()")

    @property
    def values(self) -> torch.Tensor:
        """The float32 table (a copy, so the table stays frozen)."""
        return self._values.clone()

    @property
    def points(self) -> int:
        return int(self._values.shape[0])

    @property
    def device(self) -> torch.device:
        return self._values.device

    def to(self, device) -> "BiasTable":
        return BiasTable(self._values.to(device))

    def __call__(self, u_q: torch.Tensor, u_d: torch.Tensor) -> torch.Tensor:
        """(Bq, Bd) bias read from the table (fused lookup kernel)."""
        return offset_bias_lookup(u_q, u_d, self._values)

    def __repr__(self) -> str:
        return f"BiasTable(points={self.points}, device={self.device})"


class OffsetBias(nn.Module):
    """Relative-offset bias eps * MLP(phi(clamp(u_d - u_q, -1, 1))) added to query-document scores (CTD).

    ``mlp = Sequential(Linear(features, hidden), ReLU(), Linear(hidden, 1))`` and ``scale`` (the paper's
    eps, initialised at 0 so training starts from the absolute-only scorer). The names map one to one onto
    the published ChunQiuTR checkpoints: ``time_rel_mlp.*`` -> ``mlp.*`` and ``time_rel_alpha`` -> ``scale``.
    ``forward(u_q, u_d)`` returns the (Bq, Bd) bias through the fused op :func:`tempokern.offset_bias`.

    ``table_points=N`` (constructor argument or attribute, default None = exact MLP) trains through the table
    mode: the MLP is evaluated exactly at N grid points of delta and interpolated (``offset_bias(...,
    table_points=N)``); gradients are exact for the interpolant. See docs/offset_bias.md for the error vs the
    exact bias and the recommended N."""

    def __init__(self, features: int = 32, hidden: int = 32, table_points=None):
        super().__init__()
        for name, v in (("features", features), ("hidden", hidden)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.features, self.hidden = features, hidden
        self.mlp = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.scale = nn.Parameter(torch.tensor(0.0))
        self.table_points = None if table_points is None else check_table_points("table_points", table_points)

    def forward(self, u_q: torch.Tensor, u_d: torch.Tensor) -> torch.Tensor:
        return offset_bias(u_q, u_d, *bias_params(self), table_points=self.table_points)

    @torch.no_grad()
    def table(self, points: int = DEFAULT_TABLE_POINTS) -> BiasTable:
        """Frozen lookup table of the current weights (evaluated in float64, stored as float32)."""
        if isinstance(points, bool) or not isinstance(points, int):
            raise TypeError(f"points must be an int, got {type(points).__name__}")
        if points < 2:
            raise ValueError(f"points must be >= 2, got {points}")
        return BiasTable(offset_bias_table_values(*bias_params(self), points))

    def extra_repr(self) -> str:
        extra = "" if self.table_points is None else f", table_points={self.table_points}"
        return f"features={self.features}, hidden={self.hidden}{extra}"
