"""BEIR-style corpus/queries/qrels with optional time fields (TEMPO, TimeQA and similar).

* ``corpus.jsonl``: ``{"_id", "text", "title"?}`` plus optional time: ``"time"`` / ``"date"``
  (one date or prefix: ``"2019"``, ``"2019-05"``, ``"2019-05-03"``, or a year int) or
  ``"start"`` and ``"end"``;
  and an optional publication date ``"published"`` or ``"pub_date"`` (ISO date ``"2019-05-03"`` or
  datetime ``"2019-05-03T10:00:00Z"``) -> :attr:`Record.published` (a ``datetime.date``);
* ``queries.jsonl``: ``{"_id", "text"}`` with the same optional time fields (the query's target
  span) and optional ``"family"``;
* ``qrels/<split>.tsv``: ``query-id  corpus-id  score`` (tab separated, header line optional).
"""
from __future__ import annotations

import datetime as _dt
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ..calendar import Calendar
from .base import (DataFormatError, LoadReport, Query, Record, RetrievalDataset, _check_on_error, handle, read_jsonl,
                   utf8_reason)

__all__ = ["load_beir", "parse_published"]

_DATE = re.compile(r"^\s*(-?\d{1,4})(?:-(\d{1,2}))?(?:-(\d{1,2}))?(?:[T ].*)?\s*$")


def _parse_date(v: Any) -> Tuple[int, ...]:
    if isinstance(v, bool):
        raise ValueError(f"not a date: {v!r}")
    if isinstance(v, int):
        return (v,)
    if isinstance(v, _dt.date):
        return (v.year, v.month, v.day)
    m = _DATE.match(str(v)) if isinstance(v, str) else None
    if not m:
        raise ValueError(f"not a date (want YYYY, YYYY-MM or YYYY-MM-DD): {v!r}")
    parts = tuple(int(x) for x in m.groups() if x is not None)
    if len(parts) == 3:
        _dt.date(*parts)  # raises on impossible days
    elif len(parts) == 2 and not 1 <= parts[1] <= 12:
        raise ValueError(f"month out of range in {v!r}")
    return parts


def parse_published(v: Any) -> _dt.date:
    """A publication date from an ISO date or datetime string (the date part of a datetime)."""
    if isinstance(v, _dt.datetime):
        return v.date()
    if isinstance(v, _dt.date):
        return v
    if not isinstance(v, str):
        raise ValueError(f"publication date must be an ISO date/datetime string, got {type(v).__name__} {v!r}")
    s = v.strip()
    try:
        if len(s) == 10:
            return _dt.date.fromisoformat(s)
        if len(s) > 10 and s[10] in "T ":
            return _dt.datetime.fromisoformat(s.replace("z", "Z")).date()
    except ValueError:
        pass
    raise ValueError(f"publication date must be an ISO date (YYYY-MM-DD) or datetime, got {v!r}")


def _published_field(obj: Dict[str, Any]) -> Optional[_dt.date]:
    for f in ("published", "pub_date"):
        if obj.get(f) is not None:
            return parse_published(obj[f])
    return None


def _time_fields(obj: Dict[str, Any]) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    if "start" in obj or "end" in obj:
        s, e = obj.get("start"), obj.get("end")
        if s is None or e is None:
            raise ValueError("'start' and 'end' must be given together")
        return _parse_date(s), _parse_date(e)
    for f in ("time", "date"):
        if obj.get(f) is not None:
            d = _parse_date(obj[f])
            return d, d
    return None


def _read_qrels(path: str, report: LoadReport, on_error: str) -> Dict[str, Dict[str, int]]:
    report.files.append(path)
    out: Dict[str, Dict[str, int]] = {}
    with open(path, "rb") as f:
        for ln, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                handle(DataFormatError(path, ln, utf8_reason(raw, e)), report, on_error)
                continue
            if not line.strip():
                continue
            parts = line.rstrip("\r\n").split("\t")
            if ln == 1 and parts[0].strip().lower() in ("query-id", "qid", "query_id"):
                continue
            report.rows_read += 1
            if len(parts) == 4:  # TREC qrels: qid 0 docid rel
                parts = [parts[0], parts[2], parts[3]]
            if len(parts) != 3:
                handle(DataFormatError(path, ln, f"expected 3 tab-separated fields (query-id, corpus-id, score), "
                                                 f"got {len(parts)}"), report, on_error)
                continue
            try:
                rel = int(parts[2])
            except ValueError:
                handle(DataFormatError(path, ln, f"score must be an int, got {parts[2]!r}"), report, on_error)
                continue
            out.setdefault(parts[0].strip(), {})[parts[1].strip()] = rel
    return out


def load_beir(folder: Optional[str] = None, *, corpus: Optional[str] = None, queries: Optional[str] = None,
              qrels: Optional[str] = None, split: str = "test", calendar: Optional[Calendar] = None,
              on_error: str = "raise", name: Optional[str] = None) -> RetrievalDataset:
    """Load a BEIR-style set: ``folder`` with ``corpus.jsonl``, ``queries.jsonl``,
    ``qrels/<split>.tsv`` (or explicit paths). Time fields become intervals on ``calendar``
    (default: a day-level :meth:`Calendar.gregorian` spanning the years found; a date prefix such as
    ``"2019-05"`` covers the whole month). Qrels naming unknown queries or documents are errors
    (or skipped and reported with ``on_error="skip"``); only queries with qrels are kept."""
    _check_on_error(on_error)
    if folder is not None:
        corpus = corpus or os.path.join(folder, "corpus.jsonl")
        queries = queries or os.path.join(folder, "queries.jsonl")
        qrels = qrels or os.path.join(folder, "qrels", f"{split}.tsv")
    if not (corpus and queries and qrels):
        raise ValueError("give a folder, or all of corpus=, queries= and qrels= paths")
    for f in (corpus, queries, qrels):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{f} does not exist (a BEIR set is corpus.jsonl, queries.jsonl and "
                                    "qrels/<split>.tsv)")
    report = LoadReport()
    raw_docs: List[Tuple[str, int, Dict[str, Any], Any]] = []
    raw_qs: List[Tuple[str, int, Dict[str, Any], Any]] = []
    published: Dict[str, _dt.date] = {}
    years: List[int] = []
    for path, sink, what in ((corpus, raw_docs, "document"), (queries, raw_qs, "query")):
        seen = set()
        for ln, obj in read_jsonl(path, report, on_error):
            try:
                _id = obj.get("_id", obj.get("id"))
                if isinstance(_id, int) and not isinstance(_id, bool):
                    _id = str(_id)
                if not isinstance(_id, str) or not _id:
                    raise DataFormatError(str(path), ln, f"{what} without '_id'")
                if _id in seen:
                    raise DataFormatError(str(path), ln, f"duplicate {what} id {_id!r}")
                if not isinstance(obj.get("text"), str):
                    raise DataFormatError(str(path), ln, f"{what} {_id!r}: missing string field 'text'")
                try:
                    t = _time_fields(obj)
                    pub = _published_field(obj) if what == "document" else None
                except ValueError as e:
                    raise DataFormatError(str(path), ln, f"{what} {_id!r}: {e}") from None
            except DataFormatError as e:
                handle(e, report, on_error)
                continue
            seen.add(_id)
            if pub is not None:
                published[_id] = pub
            if t is not None:
                years += [t[0][0], t[1][0]]
            sink.append((str(path), ln, obj, t))
    if not raw_docs:
        raise ValueError(f"{corpus} holds no usable documents (a BEIR set needs corpus.jsonl rows with '_id' and 'text')")
    if not raw_qs:
        raise ValueError(f"{queries} holds no usable queries (a BEIR set needs queries.jsonl rows with '_id' and 'text')")
    cal = calendar
    if cal is None and years:
        cal = Calendar.gregorian(min(years), max(years))

    def with_intervals(raw, what):
        """(obj, id, interval or None) of each row whose time is on the calendar; the others are reported."""
        for path, ln, obj, t in raw:
            _id = str(obj.get("_id", obj.get("id")))
            iv = err = None
            if t is not None:
                try:
                    n = cal.num_levels  # a coarser calendar takes the date's leading fields
                    iv = cal.interval(t[0][:n], t[1][:n])
                except (KeyError, ValueError, TypeError) as e:
                    err = DataFormatError(path, ln, f"{what} {_id!r}: time {t} not on calendar {cal.name!r}: "
                                                    f"{e.args[0] if e.args else e}")
            if err is not None:  # raised (or skipped) outside the except block: no chained KeyError traceback
                handle(err, report, on_error)
                continue
            yield obj, _id, iv

    records: List[Record] = []
    for obj, _id, iv in with_intervals(raw_docs, "document"):
        records.append(Record(_id, obj["text"], interval=iv, title=str(obj.get("title") or ""),
                              meta={k: v for k, v in obj.items() if k not in ("_id", "id", "text", "title")},
                              published=published.get(_id)))
    doc_ids = {r.id for r in records}
    qrels_map = _read_qrels(str(qrels), report, on_error)
    out_q: List[Query] = []
    for obj, _id, iv in with_intervals(raw_qs, "query"):
        if _id not in qrels_map:
            continue
        gold = qrels_map.pop(_id)
        unknown = [d for d in gold if d not in doc_ids]
        if unknown:
            err = DataFormatError(str(qrels), 0, f"query {_id!r}: qrels name documents not in the corpus: {unknown[:5]}")
            handle(err, report, on_error)
            gold = {d: r for d, r in gold.items() if d in doc_ids}
            if not gold:
                report.notes.append(f"query {_id!r} left out: none of its qrels documents is in the corpus")
                continue
        out_q.append(Query(_id, obj["text"], interval=iv, family=str(obj.get("family", "all")), gold=gold,
                           split=split, meta={k: v for k, v in obj.items() if k not in ("_id", "id", "text")}))
    if qrels_map:
        handle(DataFormatError(str(qrels), 0, f"qrels name {len(qrels_map)} queries not in {queries}: "
                                              f"{sorted(qrels_map)[:5]}"), report, on_error)
    report.records, report.queries = len(records), len(out_q)
    return RetrievalDataset(name or os.path.basename(os.path.normpath(folder or os.path.dirname(corpus))),
                            records, out_q, cal, report)
