"""Batched inference over a list of texts: length-sorted batches (each padded only to its longest text),
results put back in input order, and an optional progress display.

Sorting by length first (longest first, as sentence-transformers does) makes each batch hold texts of
similar length, so little of every batch is padding; the tokenizer pads each batch to its own longest
text (``padding=True``), never to ``max_length``."""
from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, List, Optional, Sequence

__all__ = ["length_sorted_batches", "progress", "set_progress", "progress_enabled"]

_PROGRESS = False


def set_progress(enabled: bool) -> None:
    """Turn the progress display of long encoding passes on or off (the command line turns it on unless
    ``--no-progress``; off by default for library use)."""
    global _PROGRESS
    _PROGRESS = bool(enabled)


def progress_enabled(flag: Optional[bool] = None) -> bool:
    return _PROGRESS if flag is None else bool(flag)


def length_sorted_batches(texts: Sequence[str], batch_size: int) -> List[List[int]]:
    """Index lists of ``batch_size`` texts, longest first (ties in input order)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


class _Lines:
    """Progress as a few plain lines (about every 10% and at the end) when stderr is not a terminal."""

    def __init__(self, it, total: int, desc: str, stream):
        self.it, self.total, self.desc, self.stream = it, total, desc, stream
        self.step = max(1, total // 10)

    def __iter__(self) -> Iterator:
        t0 = time.time()
        for i, x in enumerate(self.it, 1):
            yield x
            if i % self.step == 0 or i == self.total:
                print(f"{self.desc}: {i}/{self.total} batches, {time.time() - t0:.1f} s", file=self.stream, flush=True)


def progress(it: Iterable, total: int, desc: str, enabled: Optional[bool] = None, min_total: int = 2):
    """``it`` with a progress display: a tqdm bar on a terminal, plain lines otherwise; nothing when
    disabled (see :func:`set_progress`) or for fewer than ``min_total`` steps."""
    if not progress_enabled(enabled) or total < min_total:
        return it
    stream = sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return _Lines(it, total, desc, stream)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Lines(it, total, desc, stream)
    return tqdm(it, total=total, desc=desc, leave=False, dynamic_ncols=True, file=stream)
