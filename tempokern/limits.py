"""Limits on the data tempokern reads, stated once (docs/datasets-english.md, "Limits").

- :data:`YEAR_MIN` .. :data:`YEAR_MAX`: the years a date may name (a Gregorian calendar's range, Python's
  ``datetime.date``). A data file's date field outside it is a ``file:line`` error (``--on-error skip``
  leaves the row out); relative expressions that would leave it ("tomorrow" on 9999-12-31) have no date.
- :data:`MAX_TEXT_CHARS`: characters of a text that are read. Longer texts are truncated to it when a
  dataset is loaded (the loader says so once, with the count), and the date tagger and every tokenizer
  look at no more than that, so the time and memory a text costs are bounded by this cap, not by the text.
"""
from __future__ import annotations

from typing import Sequence, List

YEAR_MIN, YEAR_MAX = 1, 9999
MAX_TEXT_CHARS = 100_000


def cap_text(text: str) -> str:
    """`text` truncated to :data:`MAX_TEXT_CHARS` characters."""
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS]


def cap_texts(texts: Sequence[str]) -> List[str]:
    """Every text truncated to :data:`MAX_TEXT_CHARS` characters (before tokenizing)."""
    return [t[:MAX_TEXT_CHARS] if isinstance(t, str) and len(t) > MAX_TEXT_CHARS else t for t in texts]
