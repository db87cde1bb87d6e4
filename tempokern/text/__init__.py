"""Text-side helpers for temporal retrieval: temporal-expression tagging (TMRL) and time parsing (Re³)."""
from .temporal import KINDS as TEMPORAL_KINDS, temporal_spans, temporal_token_mask

__all__ = ["temporal_spans", "temporal_token_mask", "TEMPORAL_KINDS"]
