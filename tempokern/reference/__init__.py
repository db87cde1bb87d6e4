"""Plain PyTorch versions of every tempokern op, with the same signatures.

They define the semantics: every fused op is tested against them (forward and
gradients) and benchmarked against them."""
from .calendar import calendar_context, calendar_scalar, fourier_table, level_weights

__all__ = ["calendar_scalar", "calendar_context", "fourier_table", "level_weights"]
from .ctd_topk import ctd_topk
