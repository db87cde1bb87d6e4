"""Perturbed copies of a synthetic set that show how much a method leans on the generator's own formats.

The synthetic sets render every date with :func:`tempokern.text.dates.format_date` and give each document one
date (and, on set B, a publication date that anchors the relative ones): Re³'s rule parser reads exactly that
back. Real text is not like this (on TimeQA 60% of gold paragraphs state two or more years). Two perturbations,
each applied to the gallery only (queries, splits, gold and training rows keep their ids; a training row's
document text is the perturbed record's):

* ``second_date``: a seeded ``share`` of the records (default 70%) get a leading sentence naming another year
  (1-6 years off), e.g. ``"Figures for 2009 are listed separately. "`` — the record's time is unchanged, but a
  first-date parser now reads the wrong year;
* ``no_pub``: every record loses its publication date (the paper's parser reads text only), so relative dates
  ("last month") cannot be resolved.

Set names in the suite: ``"<base>-2date"`` and ``"<base>-nopub"`` (e.g. ``"B-2date"``).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import random
from dataclasses import replace
from typing import Dict

from ..base import RetrievalDataset
from ._common import SynthSet

__all__ = ["perturb", "PERTURBATIONS", "perturbed_name", "split_name"]

#: suite set-name suffix -> perturbation kind
PERTURBATIONS: Dict[str, str] = {"2date": "second_date", "nopub": "no_pub"}
_PREFIXES = ("Figures for {y} are listed separately. ", "A {y} report covered this earlier. ",
             "Filed with the {y} records. ", "Revised after the {y} review. ")


def perturbed_name(base: str, kind: str) -> str:
    suffix = {v: k for k, v in PERTURBATIONS.items()}.get(kind)
    if suffix is None:
        raise ValueError(f"unknown perturbation {kind!r}: expected one of {', '.join(PERTURBATIONS.values())}")
    return f"{base}-{suffix}"


def split_name(name: str):
    """``"B-2date"`` -> ``("B", "second_date")``; a plain name -> ``(name, None)``."""
    base, _, suffix = name.partition("-")
    if not suffix:
        return name, None
    if suffix not in PERTURBATIONS:
        raise ValueError(f"unknown set {name!r}: a perturbed set is <base>-{'|'.join(PERTURBATIONS)}")
    return base, PERTURBATIONS[suffix]


def _rng(rid: str, seed: int) -> random.Random:
    return random.Random(int(hashlib.sha256(f"{seed}:{rid}".encode()).hexdigest()[:16], 16))


def perturb(synth: SynthSet, kind: str, *, share: float = 0.7, seed: int = 0) -> SynthSet:
    """A perturbed copy of ``synth`` (module doc). Deterministic given ``seed``: a record's choice depends on
    its id only, so the same records are perturbed whatever else the set holds."""
    if kind not in PERTURBATIONS.values():
        raise ValueError(f"unknown perturbation {kind!r}: expected one of {', '.join(PERTURBATIONS.values())}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    recs, changed = [], 0
    for r in synth.dataset.records:
        if kind == "no_pub":
            changed += r.published is not None
            recs.append(replace(r, published=None))
            continue
        rng = _rng(r.id, seed)
        if rng.random() >= share:
            recs.append(r)
            continue
        meta = dict(r.meta or {})
        year = _dt.date.fromisoformat(meta["date"]).year if meta.get("date") else None
        if year is None:
            recs.append(r)
            continue
        other = year + rng.choice((-6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6))
        prefix = rng.choice(_PREFIXES).format(y=other)
        at = prefix.index(str(other))
        spans = [[at, at + len(str(other))]] + [[a + len(prefix), b + len(prefix)]
                                                for a, b in (meta.get("temporal_spans") or [])]
        meta.update(temporal_spans=spans, second_date=other)
        recs.append(replace(r, text=prefix + r.text, meta=meta))
        changed += 1
    name = perturbed_name(synth.name, kind)
    ds = RetrievalDataset(f"{synth.dataset.name}-{kind}", recs, synth.dataset.queries, synth.dataset.calendar,
                          synth.dataset.report)
    info = dict(synth.info)
    info.update(name=name, perturbation={"kind": kind, "share": share if kind == "second_date" else 1.0,
                                         "seed": seed, "records_changed": changed, "base": synth.name})
    info["checksum"] = hashlib.sha256(f"{synth.info.get('checksum')}:{kind}:{share}:{seed}".encode()).hexdigest()
    return SynthSet(name, ds, synth.calendar, synth.train_rows, info)
