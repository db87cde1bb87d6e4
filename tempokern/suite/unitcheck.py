"""Checks of a finished unit file against the data it is reused for (tempokern.suite.runner).

A unit whose checksum and settings match can still not fit the run: its query ids differ from the set's
(edited by hand and re-hashed, or written for other data under the same settings), or a metric holds
something other than numbers. :func:`unit_problem` says what, so that the runner names the unit file and
recomputes it instead of failing later while merging the units into the table."""
from __future__ import annotations

import numbers
from typing import Optional

from .metrics import METRICS


def _numbers(vals) -> bool:
    return isinstance(vals, list) and all(
        v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool)) for v in vals)


def _split_problem(sp: str, table, dataset, extra) -> Optional[str]:
    if not isinstance(table, dict):
        return f"split {sp!r} is not a table"
    spec = extra.get(sp)     # an extra split (fit, <split>@corpus): another split's queries, maybe a subset
    base = spec["queries"] if spec else sp
    keep = None if not spec or spec.get("query_ids") is None else set(spec["query_ids"])
    want = [q.id for q in dataset.queries if q.split == base and q.relevant_ids()
            and (keep is None or q.id in keep)]
    got = table.get("qids")
    if not isinstance(got, list):
        return f"split {sp!r} has no 'qids' list"
    if got != want:
        return (f"split {sp!r}: its {len(got)} query ids are not the data's {len(want)} "
                f"(first difference: {next((a for a, b in zip(got, want) if a != b), '(count)')!r})")
    for m in METRICS:
        if m in table and (not _numbers(table[m]) or len(table[m]) != len(want)):
            return f"split {sp!r}: metric {m!r} is not a list of {len(want)} numbers"
    return None


def unit_problem(payload: dict, dataset, extra_splits: Optional[dict] = None) -> Optional[str]:
    """What makes a unit's payload unfit for `dataset` (None when it fits); ``extra_splits``: the set's extra
    splits (``RealSet.extra_splits``), whose queries are another split's."""
    extra = extra_splits or {}
    splits = payload.get("splits")
    if not isinstance(splits, dict) or not splits:
        return "has no 'splits' table"
    for sp, table in splits.items():
        why = _split_problem(sp, table, dataset, extra)
        if why:
            return why
    dims = payload.get("dims") or {}
    if not isinstance(dims, dict):
        return "'dims' is not a table"
    for dim, per in dims.items():
        if not isinstance(per, dict):
            return f"dims[{dim!r}] is not a table"
        for sp, table in per.items():
            why = _split_problem(sp, table, dataset, extra)
            if why:
                return f"dim {dim}: {why}"
    return None
