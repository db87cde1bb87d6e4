"""Plain PyTorch versions of every tempokern op, with the same signatures.

They define the semantics: every fused op is tested against them (forward and
gradients) and benchmarked against them."""
from .calendar import calendar_context, calendar_scalar, fourier_table, level_weights
from .offset_bias import (bias_frequencies, offset_bias, offset_bias_lookup, offset_bias_table_values,
                          offset_bias_table, offset_bias_tabulated,
                          offset_features, table_points_delta)
from .multipos_infonce import multipos_infonce, overlap_positives
from .multipos_infonce import hardest_negatives
from .re3 import re3_loss
from .ctd_topk import ctd_scores, ctd_topk
from .matryoshka_infonce import matryoshka_infonce, truncate

__all__ = [
    "calendar_scalar", "calendar_context", "fourier_table", "level_weights",
    "offset_bias", "bias_frequencies", "offset_features", "offset_bias_lookup",
    "offset_bias_table_values", "table_points_delta", "offset_bias_table", "offset_bias_tabulated",
    "multipos_infonce", "overlap_positives",
    "ctd_topk", "ctd_scores",
    "matryoshka_infonce", "truncate",
    "hardest_negatives", "re3_loss",
]
