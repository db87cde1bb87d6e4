"""Re²-style jsonl (Re³'s Re²Bench layout, design notes §3.4 "Data"): one row per query with its positive
and typed hard negatives. Each row::

    {"id"?: str, "query": str, "query_time"?: date, "answer"?: str|number, "split"?: str,
     "positive": DOC, "negatives"?: [DOC + {"kind": "time_wrong"|"entity_wrong"|"attribute_wrong"|"outdated"}]}
    DOC = {"id": str, "text": str, "time"?: date, "published"?: ISO date/datetime,
           "facts"?: [{"head", "relation", "value"}], ...other keys kept in Record.meta}

Dates (``time``, ``query_time``) are ``YYYY``, ``YYYY-MM`` or ``YYYY-MM-DD`` (as :func:`load_beir`);
``published`` is an ISO date or datetime. Documents are shared across rows by id (the same id must carry
the same text and publication date). Result: a :class:`RetrievalDataset` (gallery = every positive and
negative; each query's gold = its positive) and the training triples (:class:`Re2Triple`).
"""
from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..calendar import Calendar
from .base import DataFormatError, LoadReport, Query, Record, RetrievalDataset, _check_on_error, handle, read_jsonl
from .beir import _parse_date, parse_published

__all__ = ["load_re2", "Re2Triple", "Re2Data", "NEGATIVE_KINDS"]

NEGATIVE_KINDS = ("time_wrong", "entity_wrong", "attribute_wrong", "outdated")
_DOC_KEYS = ("id", "text", "time", "published", "facts", "kind")


@dataclass(frozen=True)
class Re2Triple:
    """One training row: the query, its positive document id and its hard negatives with their kinds
    (field names as the synthetic sets' ``TrainRow``)."""
    query_id: str
    query: str
    positive: str
    hard_negatives: List[str] = field(default_factory=list)
    negative_kinds: List[str] = field(default_factory=list)
    query_time: Optional[str] = None


class Re2Data(NamedTuple):
    dataset: RetrievalDataset
    triples: List[Re2Triple]


def _check_facts(facts: Any, what: str) -> List[Dict[str, Any]]:
    if not isinstance(facts, list):
        raise ValueError(f"{what}: 'facts' must be a list of {{head, relation, value}}, got {type(facts).__name__}")
    for j, f in enumerate(facts):
        if not isinstance(f, dict) or not {"head", "relation", "value"} <= set(f):
            raise ValueError(f"{what}: facts[{j}] must be an object with head, relation and value")
        for k in ("head", "relation"):
            if not isinstance(f[k], str):
                raise ValueError(f"{what}: facts[{j}].{k} must be a string")
    return facts


def _doc(obj: Any, what: str, negative: bool) -> Tuple[Dict[str, Any], Optional[Tuple[Tuple[int, ...], ...]],
                                                        Optional[_dt.date]]:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be an object, got {type(obj).__name__}")
    _id = obj.get("id", obj.get("_id"))
    if isinstance(_id, int) and not isinstance(_id, bool):
        _id = str(_id)
    if not isinstance(_id, str) or not _id:
        raise ValueError(f"{what} without a string 'id'")
    if not isinstance(obj.get("text"), str):
        raise ValueError(f"{what} {_id!r}: missing string field 'text'")
    if negative and obj.get("kind") not in NEGATIVE_KINDS:
        raise ValueError(f"{what} {_id!r}: 'kind' must be one of {NEGATIVE_KINDS}, got {obj.get('kind')!r}")
    t = None
    if obj.get("time") is not None:
        d = _parse_date(obj["time"])
        t = (d, d)
    pub = parse_published(obj["published"]) if obj.get("published") is not None else None
    if obj.get("facts") is not None:
        _check_facts(obj["facts"], f"{what} {_id!r}")
    return dict(obj, id=_id), t, pub


def load_re2(path: str, *, split: str = "test", calendar: Optional[Calendar] = None, on_error: str = "raise",
             name: Optional[str] = None) -> Re2Data:
    """Read a Re²-style jsonl file (format in the module docstring). ``split``: the queries' split when a
    row gives none. ``calendar``: the calendar for ``time``/``query_time`` (default: day-level Gregorian over
    the years found). Malformed rows raise :class:`DataFormatError` naming file and line, or are skipped
    and counted in ``dataset.report`` with ``on_error="skip"``."""
    _check_on_error(on_error)
    if not os.path.exists(path):
        raise FileNotFoundError(f"Re2 file {path} does not exist")
    report = LoadReport()
    rows = []
    docs: Dict[str, Tuple[Dict[str, Any], Any, Optional[_dt.date], int]] = {}
    qids = set()
    years: List[int] = []
    for ln, obj in read_jsonl(path, report, on_error):
        try:
            try:
                qid = obj.get("id", obj.get("_id", obj.get("qid")))
                if qid is None:
                    qid = f"q{ln}"
                if isinstance(qid, int) and not isinstance(qid, bool):
                    qid = str(qid)
                if not isinstance(qid, str) or not qid:
                    raise ValueError(f"query id must be a non-empty string, got {qid!r}")
                if qid in qids:
                    raise ValueError(f"duplicate query id {qid!r}")
                if not isinstance(obj.get("query"), str) or not obj["query"].strip():
                    raise ValueError(f"query {qid!r}: missing string field 'query'")
                qt = _parse_date(obj["query_time"]) if obj.get("query_time") is not None else None
                if "positive" not in obj:
                    raise ValueError(f"query {qid!r}: missing 'positive'")
                pos = _doc(obj["positive"], f"query {qid!r}: positive", False)
                negs_raw = obj.get("negatives") or []
                if not isinstance(negs_raw, list):
                    raise ValueError(f"query {qid!r}: 'negatives' must be a list")
                negs = [_doc(n, f"query {qid!r}: negatives[{j}]", True) for j, n in enumerate(negs_raw)]
                if any(n[0]["id"] == pos[0]["id"] for n in negs):
                    raise ValueError(f"query {qid!r}: the positive {pos[0]['id']!r} is also a negative")
                ans = obj.get("answer")
                if ans is not None and not isinstance(ans, (str, int, float)) or isinstance(ans, bool):
                    raise ValueError(f"query {qid!r}: 'answer' must be a string or number")
                for d, t, pub in [pos] + negs:
                    prev = docs.get(d["id"])
                    if prev is not None and (prev[0]["text"] != d["text"] or prev[2] != pub):
                        raise ValueError(f"document {d['id']!r} differs from its first occurrence on line {prev[3]} "
                                         "(text or published)")
            except ValueError as e:
                raise DataFormatError(str(path), ln, str(e)) from None
        except DataFormatError as e:
            handle(e, report, on_error)
            continue
        qids.add(qid)
        for d, t, pub in [pos] + negs:
            if d["id"] not in docs:
                docs[d["id"]] = (d, t, pub, ln)
                if t is not None:
                    years += [t[0][0], t[1][0]]
        if qt is not None:
            years.append(qt[0])
        rows.append((ln, qid, obj, qt, pos, negs))
    cal = calendar
    if cal is None and years:
        cal = Calendar.gregorian(min(years), max(years))

    def interval(t, where, ln):
        if t is None:
            return None
        n = cal.num_levels
        try:
            return cal.interval(t[0][:n], t[1][:n])
        except (KeyError, ValueError, TypeError) as e:
            raise DataFormatError(str(path), ln, f"{where}: time {t[0]} not on calendar {cal.name!r}: "
                                                 f"{e.args[0] if e.args else e}") from None

    records: List[Record] = []
    bad_docs = set()
    for did, (d, t, pub, ln) in docs.items():
        try:
            iv = interval(t, f"document {did!r}", ln)
        except DataFormatError as e:
            handle(e, report, on_error)
            bad_docs.add(did)
            continue
        meta = {k: v for k, v in d.items() if k not in ("id", "_id", "text", "kind")}
        meta.pop("published", None)
        records.append(Record(did, report.cap(d["text"]), interval=iv, meta=meta, published=pub))
    queries: List[Query] = []
    triples: List[Re2Triple] = []
    for ln, qid, obj, qt, pos, negs in rows:
        if pos[0]["id"] in bad_docs:
            report.notes.append(f"query {qid!r} left out: its positive {pos[0]['id']!r} was skipped")
            continue
        try:
            qiv = interval((qt, qt) if qt is not None else None, f"query {qid!r}", ln)
        except DataFormatError as e:
            handle(e, report, on_error)
            continue
        meta = {k: v for k, v in obj.items() if k not in ("id", "_id", "qid", "query", "positive", "negatives",
                                                           "split")}
        meta["query_time"] = obj.get("query_time")
        meta["answer"] = obj.get("answer")
        queries.append(Query(qid, report.cap(obj["query"]), interval=qiv, family=str(obj.get("family", "all")),
                             gold={pos[0]["id"]: 1}, split=str(obj.get("split") or split), meta=meta))
        kept = [n for n in negs if n[0]["id"] not in bad_docs]
        triples.append(Re2Triple(qid, queries[-1].text, pos[0]["id"], [n[0]["id"] for n in kept],
                                 [n[0]["kind"] for n in kept],
                                 None if obj.get("query_time") is None else str(obj["query_time"])))
    report.records, report.queries = len(records), len(queries)
    ds = RetrievalDataset(name or os.path.splitext(os.path.basename(path))[0], records, queries, cal, report)
    return Re2Data(ds, triples)
