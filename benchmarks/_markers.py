"""Generated parts of a document: the text between a ``<!-- name:begin -->`` and ``<!-- name:end -->`` marker
pair, rewritten by a table script (benchmarks/perf_table.py, benchmarks/quality_table.py)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, List


def render_between(text: str, tbl: str, begin: str, end: str) -> str:
    """``text`` with the part between the markers replaced by ``tbl``; a ValueError when they are missing."""
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"markers {begin} / {end} not found")
    return text[:i + len(begin)] + "\n" + tbl + "\n" + text[j:]


def table_main(argv: List[str], make_table: Callable[[], str], begin: str, end: str) -> int:
    """No argument: print the table; else rewrite the marked part of every file named."""
    tbl = make_table()
    if not argv:
        print(tbl)
        return 0
    for p in argv:
        path = Path(p)
        text = path.read_text(encoding="utf-8")
        new = render_between(text, tbl, begin, end)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"updated {p}", file=sys.stderr)
    return 0
