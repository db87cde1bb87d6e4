"""TREC run files: ``qid Q0 docid rank score tag``, one line per retrieved document.

The format trec_eval, ranx and pyserini read, so that a run of ``tempokern eval --run-out FILE`` can be scored
by any of them or compared query by query with another system's run (paired tests). Ranks follow
:func:`tempokern.eval.rank_documents` (score descending, ties by doc id descending, trec_eval's own order), so
trec_eval and :func:`tempokern.eval.retrieval_metrics` read the same ranking from the file.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Mapping, Optional

from .._util import atomic_write
from .metrics import rank_documents, validate_run

__all__ = ["write_run", "read_run", "TrecFormatError"]


class TrecFormatError(ValueError):
    """A malformed line of a run file (the message names file:line)."""


def write_run(run: Mapping[str, Mapping[str, float]], path, *, tag: str = "tempokern",
              depth: Optional[int] = None) -> int:
    """Write ``run`` (``{qid: {docid: score}}``) to ``path`` atomically; the top ``depth`` documents of each
    query (all when None). Queries in sorted order. Returns the number of lines written."""
    validate_run(run)
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ValueError(f"depth must be a positive int or None, got {depth!r}")
    if not isinstance(tag, str) or not tag or any(c.isspace() for c in tag):
        raise ValueError(f"tag must be a non-empty string without whitespace, got {tag!r}")
    def check(name: str, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError(f"a TREC run cannot hold the {name} {v!r} (empty or with whitespace)")
        return v

    lines = []
    for qid in sorted(run, key=str):
        q = check("query id", str(qid))
        for rank, doc in enumerate(rank_documents(run[qid], depth), start=1):
            lines.append(f"{q} Q0 {check('document id', str(doc))} {rank} {float(run[qid][doc]):.9g} {tag}")
    atomic_write(Path(path), "".join(line + "\n" for line in lines))
    return len(lines)


def read_run(path) -> Dict[str, Dict[str, float]]:
    """``{qid: {docid: score}}`` from a TREC run file (6 whitespace-separated columns; the rank and tag
    columns are not used: the scores order the documents). A malformed line, a NaN score or a document listed
    twice for one query raises :class:`TrecFormatError` naming ``file:line``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"run file {path} does not exist")
    run: Dict[str, Dict[str, float]] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 6:
                raise TrecFormatError(f"{path}:{n}: expected 6 columns 'qid Q0 docid rank score tag', "
                                      f"got {len(parts)}")
            qid, _, doc, rank, score, _ = parts
            try:
                int(rank)
                s = float(score)
            except ValueError:
                raise TrecFormatError(f"{path}:{n}: rank {rank!r} must be an integer and score {score!r} a "
                                      "number") from None
            if math.isnan(s):
                raise TrecFormatError(f"{path}:{n}: score is NaN")
            docs = run.setdefault(qid, {})
            if doc in docs:
                raise TrecFormatError(f"{path}:{n}: document {doc!r} is listed twice for query {qid!r}")
            docs[doc] = s
    return run
