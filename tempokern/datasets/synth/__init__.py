"""Offline English temporal retrieval sets, generated from PyPI-installed records (no network).

``load_synth(name, *, seed=0, size="full"|"quick", cache_dir=None) -> SynthSet`` for

* ``"A"`` — TMRL-style explicit-time QA (holidays of 15 countries 1990-2030 from ``holidays``, plus
  vega-datasets records): one temporal expression per passage, Explicit / Implicit / TemporalAnswer queries,
  negative queries per passage, time-less queries;
* ``"B"`` — Re²-style relevance (monthly US employment and stock prices, daily Seattle weather): entity-,
  attribute- and time-wrong siblings, 9 document / 8 query templates per source, a 30% masked/relative-date
  subset resolved through ``published``;
* ``"C"`` — versioned Seattle forecasts (synthetic versions published 1-7 days before the day, the observed
  record as the latest version), Type A (explicit date) and Type B ("latest forecast", with a query time).

Sets are deterministic given the seed, generated at first use and cached under ``cache_dir`` (default
``$TEMPOKERN_CACHE/synth`` or ``~/.cache/tempokern/synth``) as one file written atomically, whose sha256 is
verified on load (a damaged file is regenerated). See docs/datasets-english.md."""
from __future__ import annotations

import json
from typing import Dict, Optional

from ._common import (GENERATOR_VERSION, HELD_OUT, NEG_KINDS, QUERY_SPLITS, SIZES, SynthSet, TrainRow,
                      cache_file, cache_root, canonical, checksum, from_payload, read_cache, to_payload,
                      write_cache)

__all__ = ["load_synth", "generate_synth", "SynthSet", "TrainRow", "SET_NAMES", "QUERY_SPLITS", "HELD_OUT",
           "NEG_KINDS", "GENERATOR_VERSION", "SIZES", "EVAL_CAPS"]

SET_NAMES = ("A", "B", "C")

#: queries kept per split (None: all); training queries are never capped
EVAL_CAPS: Dict[str, Dict[str, Optional[int]]] = {
    "full": {"train": None, "val": 300, "test_template": 400, "test_date": 400, "test_year": 400,
             "test_masked": 400},
    "quick": {"train": None, "val": 60, "test_template": 80, "test_date": 80, "test_year": 80,
              "test_masked": 80},
}


def _check(name, seed, size) -> str:
    if not isinstance(name, str) or name.upper() not in SET_NAMES:
        raise ValueError(f"name: unknown synthetic set {name!r}; expected one of {SET_NAMES}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise TypeError(f"seed must be a non-negative int, got {seed!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    return name.upper()


def generate_synth(name: str, *, seed: int = 0, size: str = "full") -> SynthSet:
    """Generate a set without touching the cache."""
    name = _check(name, seed, size)
    payload = _payload(name, seed, size)
    digest = checksum(payload)
    return from_payload(json.loads(canonical(payload)), digest)


def _payload(name: str, seed: int, size: str) -> dict:
    from . import set_a, set_b, set_c
    mod = {"A": set_a, "B": set_b, "C": set_c}[name]
    b, extra = mod.generate(seed, size, EVAL_CAPS[size])
    from ..base import RetrievalDataset
    from ._common import make_calendar
    cal = make_calendar(extra["calendar"])
    ds = RetrievalDataset(f"synth-{name}", b.records, b.queries, cal)
    splits = {}
    for q in b.queries:
        splits[q.split] = splits.get(q.split, 0) + 1
    from ._common import source_digest
    info = {"name": name, "seed": seed, "size": size, "generator_version": GENERATOR_VERSION,
            "source_digest": source_digest(),
            "records": len(b.records), "queries": len(b.queries), "train_rows": len(b.rows),
            "queries_per_split": dict(sorted(splits.items())),
            "masked_records": sum(1 for r in b.records if r.meta.get("masked")), **extra}
    s = SynthSet(name, ds, cal, b.rows, info)
    return to_payload(s)


def load_synth(name: str, *, seed: int = 0, size: str = "full", cache_dir=None) -> SynthSet:
    """The set ``name`` ("A", "B" or "C") for ``seed`` and ``size``, from the cache when its file verifies,
    otherwise generated (deterministically) and cached atomically."""
    name = _check(name, seed, size)
    path = cache_file(cache_root(cache_dir), name, seed, size)
    got = read_cache(path)
    if got is not None:
        payload, digest = got
        return from_payload(payload, digest)
    payload = _payload(name, seed, size)
    digest = checksum(payload)
    write_cache(path, payload, digest)
    return from_payload(json.loads(canonical(payload)), digest)
