"""Shared pieces of the offline English generators: text assembly with temporal spans, the split
rules, the record/query builders, the cache (atomic write, checksum verified on load)."""
from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import importlib.util
import json
import os
import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ...calendar import Calendar, Interval
from ..base import Query, Record, RetrievalDataset
from ..._util import atomic_write

#: bump when the generated content changes (part of the cache key and of info)
GENERATOR_VERSION = 1
SIZES = ("full", "quick")
QUERY_SPLITS = ("train", "val", "test_template", "test_date", "test_year", "test_masked", "timeless")
#: splits whose passages, templates or dates must never reach a training row
HELD_OUT = ("val", "test_template", "test_date", "test_year", "test_masked")
NEG_KINDS = ("time_wrong", "entity_wrong", "attribute_wrong", "outdated")
CACHE_FORMAT = "tempokern-synth"

_FMT = string.Formatter()


@dataclass
class TrainRow:
    """One training example: the query, its positive document and hard negatives (with the attribute
    each negative is wrong in), and negative queries (same entity, other time; sets A and B)."""
    query_id: str
    query: str
    positive: str
    hard_negatives: List[str] = field(default_factory=list)
    negative_kinds: List[str] = field(default_factory=list)
    negative_queries: List[str] = field(default_factory=list)


@dataclass
class SynthSet:
    """A generated set: ``dataset`` (records + queries with splits), ``calendar``, ``train_rows``,
    ``info`` (seed, size, generator version, counts, checksum, sources)."""
    name: str
    dataset: RetrievalDataset
    calendar: Calendar
    train_rows: List[TrainRow]
    info: Dict[str, Any]

    def __repr__(self) -> str:
        return (f"SynthSet({self.name!r}: {len(self.dataset.records)} records, {len(self.dataset.queries)} "
                f"queries, {len(self.train_rows)} train rows, seed {self.info.get('seed')}, "
                f"{self.info.get('size')})")

    def queries(self, split: str) -> List[Query]:
        return self.dataset.queries_in(split)


# ---- text -----------------------------------------------------------------------------------------

def fill(template: str, values: Dict[str, Any], temporal: Iterable[str] = ()) -> Tuple[str, List[List[int]]]:
    """``template.format(**values)`` plus the character spans ``[start, end)`` of the fields named in
    `temporal` (the temporal expressions), in text order. The first letter is capitalised when the text
    starts with a lower-case letter (``"in March 2014, ..."``)."""
    temporal = set(temporal)
    out: List[str] = []
    spans: List[List[int]] = []
    pos = 0
    for lit, name, spec, conv in _FMT.parse(template):
        out.append(lit)
        pos += len(lit)
        if name is None:
            continue
        v = _FMT.format_field(values[name], spec or "")
        if name in temporal:
            spans.append([pos, pos + len(v)])
        out.append(v)
        pos += len(v)
    text = "".join(out)
    if text[:1].islower():   # a sentence starts with a capital ("{when}, ..." -> "In March 2014, ...")
        text = text[0].upper() + text[1:]
    return text, spans


# ---- sources --------------------------------------------------------------------------------------

def vega_csv(name: str) -> List[Dict[str, str]]:
    """Rows of a csv shipped inside the vega-datasets wheel (read locally, never downloaded)."""
    spec = importlib.util.find_spec("vega_datasets")
    if spec is None or not spec.origin:
        raise ImportError('the offline English sets need the "vega-datasets" package: pip install ".[minilm]"')
    p = Path(spec.origin).parent / "_data" / name
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing from the installed vega-datasets package")
    with open(p, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def vega_version() -> str:
    try:
        from importlib.metadata import version
        return version("vega-datasets")
    except Exception:   # pragma: no cover
        return "unknown"


# ---- calendar positions (exact arithmetic; tests compare with Calendar.span) ----------------------

def month_rank(cal_first_year: int, d: _dt.date) -> int:
    return (d.year - cal_first_year) * 12 + d.month - 1


def day_rank(cal_first_year: int, d: _dt.date) -> int:
    return (d - _dt.date(cal_first_year, 1, 1)).days


def iso(d: Optional[_dt.date]) -> Optional[str]:
    return None if d is None else d.isoformat()


# ---- splits ---------------------------------------------------------------------------------------

def rng_for(name: str, seed: int, what: str) -> random.Random:
    """A private, reproducible stream per (set, seed, purpose)."""
    return random.Random(f"tempokern-synth/{name}/{seed}/{what}")


def cap(rng: random.Random, items: Sequence, n: Optional[int]) -> list:
    """At most n items, a seeded sample kept in input order."""
    items = list(items)
    if n is None or len(items) <= n:
        return items
    keep = set(rng.sample(range(len(items)), n))
    return [x for i, x in enumerate(items) if i in keep]


# ---- builder --------------------------------------------------------------------------------------

class Builder:
    """Accumulates records, queries and train rows of one set."""

    def __init__(self, name: str):
        self.name = name
        self.records: List[Record] = []
        self.queries: List[Query] = []
        self.rows: List[TrainRow] = []
        self._rid = set()
        self._qid = set()

    def record(self, rid: str, text: str, spans, *, interval: Interval, key, published: Optional[_dt.date],
               entity: str, attribute: str, date: _dt.date, template: int, masked: bool, facts: List[dict],
               version: Optional[int] = None, **extra) -> Record:
        if rid in self._rid:
            raise AssertionError(f"duplicate record id {rid}")
        self._rid.add(rid)
        meta = {"entity": entity, "attribute": attribute, "date": iso(date), "template": int(template),
                "masked": bool(masked), "facts": facts, "temporal_spans": spans, "version": version}
        meta.update(extra)
        r = Record(rid, text, key=tuple(key), interval=interval, type="event", meta=meta, published=published)
        self.records.append(r)
        return r

    def query(self, qid: str, text: str, spans, *, interval: Optional[Interval], gold: Dict[str, int], split: str,
              entity: str, attribute: str, date: Optional[_dt.date], template: int, kind: str,
              answer: Any, query_time: Optional[_dt.date] = None, time_wrong_twin: Optional[str] = None,
              **extra) -> Query:
        if qid in self._qid:
            raise AssertionError(f"duplicate query id {qid}")
        if split not in QUERY_SPLITS:
            raise AssertionError(f"bad split {split}")
        self._qid.add(qid)
        meta = {"entity": entity, "attribute": attribute, "date": iso(date), "template": int(template),
                "kind": kind, "query_time": iso(query_time), "temporal_spans": spans,
                "time_wrong_twin": time_wrong_twin, "answer": answer}
        meta.update(extra)
        q = Query(qid, text, interval=interval, family=kind, gold=dict(gold), split=split, meta=meta)
        self.queries.append(q)
        return q


# ---- serialisation and cache ----------------------------------------------------------------------

def _interval_json(iv: Optional[Interval]):
    return None if iv is None else [iv.start, iv.end]


def to_payload(s: SynthSet) -> Dict[str, Any]:
    """The set as canonical JSON-able data (what the checksum covers)."""
    recs = [{"id": r.id, "text": r.text, "key": list(r.key) if r.key is not None else None,
             "interval": _interval_json(r.interval), "published": iso(r.published), "meta": r.meta}
            for r in s.dataset.records]
    qs = [{"id": q.id, "text": q.text, "interval": _interval_json(q.interval), "family": q.family,
           "gold": q.gold, "split": q.split, "meta": q.meta} for q in s.dataset.queries]
    rows = [{"query_id": t.query_id, "query": t.query, "positive": t.positive, "hard_negatives": t.hard_negatives,
             "negative_kinds": t.negative_kinds, "negative_queries": t.negative_queries} for t in s.train_rows]
    info = {k: v for k, v in s.info.items() if k != "checksum"}
    return {"name": s.name, "calendar": s.info["calendar"], "records": recs, "queries": qs, "train_rows": rows,
            "info": info}


def canonical(payload: Dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def checksum(payload: Dict[str, Any]) -> str:
    return hashlib.sha256(canonical(payload)).hexdigest()


def make_calendar(spec: Dict[str, Any]) -> Calendar:
    return Calendar.gregorian(int(spec["first_year"]), int(spec["last_year"]), resolution=spec["resolution"])


def from_payload(payload: Dict[str, Any], digest: str) -> SynthSet:
    cal = make_calendar(payload["calendar"])
    recs = [Record(r["id"], r["text"], key=tuple(r["key"]) if r["key"] is not None else None,
                   interval=Interval(*r["interval"]) if r["interval"] is not None else None, type="event",
                   meta=r["meta"], published=_dt.date.fromisoformat(r["published"]) if r["published"] else None)
            for r in payload["records"]]
    qs = [Query(q["id"], q["text"], interval=Interval(*q["interval"]) if q["interval"] is not None else None,
                family=q["family"], gold=q["gold"], split=q["split"], meta=q["meta"]) for q in payload["queries"]]
    rows = [TrainRow(**t) for t in payload["train_rows"]]
    info = dict(payload["info"])
    info["checksum"] = digest
    ds = RetrievalDataset(f"synth-{payload['name']}", recs, qs, cal)
    ds.report.records, ds.report.queries, ds.report.synthesized = len(recs), len(qs), len(recs)
    ds.report.notes.append(f"generated by tempokern.datasets.synth v{info.get('generator_version')} "
                           f"(seed {info.get('seed')}, size {info.get('size')}, sha256 {digest[:12]})")
    return SynthSet(payload["name"], ds, cal, rows, info)


def cache_root(cache_dir=None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("TEMPOKERN_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "tempokern"
    return base / "synth"


_SOURCE_DIGEST: Optional[str] = None


def source_digest() -> str:
    """sha256 (12 hex) of what the generated content depends on: the generator's source files, the date
    formatter and the versions of the source packages (so an edited generator or an upgraded `holidays`
    never reuses a stale cache file)."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        h = hashlib.sha256()
        here = Path(__file__).resolve().parent
        for p in sorted(here.glob("*.py")) + [here.parent.parent / "text" / "dates.py"]:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        for pkg in ("holidays", "vega-datasets"):
            try:
                from importlib.metadata import version
                h.update(f"{pkg}={version(pkg)}".encode())
            except Exception:   # pragma: no cover - reported when the set is generated
                h.update(pkg.encode())
        _SOURCE_DIGEST = h.hexdigest()[:12]
    return _SOURCE_DIGEST


def cache_file(root: Path, name: str, seed: int, size: str) -> Path:
    return root / f"synth-{name}-{size}-seed{seed}-v{GENERATOR_VERSION}-{source_digest()}.json"


def write_cache(path: Path, payload: Dict[str, Any], digest: str) -> None:
    """One file: a header line ``{"format", "sha256"}`` and the canonical payload; written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({"format": CACHE_FORMAT, "version": GENERATOR_VERSION, "sha256": digest}).encode("utf-8")
    atomic_write(path, head + b"\n" + canonical(payload))


def read_cache(path: Path) -> Optional[Tuple[Dict[str, Any], str]]:
    """(payload, sha256) when the file is complete and its checksum verifies; None otherwise (the
    caller regenerates it)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    nl = data.find(b"\n")
    if nl < 0:
        return None
    try:
        head = json.loads(data[:nl])
    except ValueError:
        return None
    body = data[nl + 1:]
    if not isinstance(head, dict) or head.get("format") != CACHE_FORMAT or head.get("version") != GENERATOR_VERSION:
        return None
    digest = hashlib.sha256(body).hexdigest()
    if digest != head.get("sha256"):
        return None
    try:
        return json.loads(body), digest
    except ValueError:
        return None
