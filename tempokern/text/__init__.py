"""Text-side helpers for temporal retrieval: temporal-expression tagging (TMRL) and time parsing (Re³)."""
from .dates import DATE_FORMATS, FORMAT_GRANULARITY, RELATIVE_FORMATS, expressible, format_date
from .temporal import KINDS as TEMPORAL_KINDS, temporal_spans, temporal_token_mask
from .time import TimeTuple, find_time, parse_time, parse_times
from .intervals import hull, time_intervals

__all__ = ["temporal_spans", "temporal_token_mask", "TEMPORAL_KINDS",
           "TimeTuple", "parse_time", "parse_times", "find_time", "DATE_FORMATS", "FORMAT_GRANULARITY",
           "RELATIVE_FORMATS", "format_date", "expressible", "time_intervals", "hull"]
