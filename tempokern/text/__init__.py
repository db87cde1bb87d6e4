"""Text-side helpers for temporal retrieval: temporal-expression tagging (TMRL) and time parsing (Re³)."""
