"""BEIR-style corpus/queries/qrels with optional time fields (TEMPO, TimeQA and similar).

* ``corpus.jsonl``: ``{"_id", "text", "title"?}`` plus optional time: ``"time"`` / ``"date"``
  (one date or prefix: ``"2019"``, ``"2019-05"``, ``"2019-05-03"``, or a year int) or
  ``"start"`` and ``"end"``;
  and an optional publication date ``"published"`` or ``"pub_date"`` (ISO date ``"2019-05-03"`` or
  datetime ``"2019-05-03T10:00:00Z"``) -> :attr:`Record.published` (a ``datetime.date``);
* ``queries.jsonl``: ``{"_id", "text"}`` with the same optional time fields (the query's target
  span) and optional ``"family"``;
* ``qrels/<split>.tsv``: ``query-id  corpus-id  score`` (tab separated, header line optional); every
  file present is read (``train.tsv``, ``dev.tsv``, ``test.tsv``, ...) and a query's split is its file's
  name, so a training folder needs no ``test.tsv``.

A row without time fields takes its times from its text: the rule tagger's every date expression
(:func:`tempokern.text.time_intervals`), kept in ``meta["times"]``; the interval is their hull (earliest
start to latest end; docs/datasets-english.md says why). Extra fields stay in ``meta`` (e.g. a TimeQA
export's ``page`` and ``neg_page`` / ``neg_bm25`` hard negatives).
"""
from __future__ import annotations

import datetime as _dt
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ..calendar import Calendar
from ..limits import YEAR_MAX, YEAR_MIN
from .base import (DataFormatError, LoadReport, Query, Record, RetrievalDataset, _check_on_error, handle, read_jsonl,
                   utf8_reason)

__all__ = ["load_beir", "parse_published"]

_DATE = re.compile(r"^\s*(-?\d+)(?:-(\d{1,2}))?(?:-(\d{1,2}))?(?:[T ].*)?\s*$")


def _check_year(y: int, v: Any) -> None:
    if not YEAR_MIN <= y <= YEAR_MAX:
        raise ValueError(f"year {y} of {v!r} is outside the supported range {YEAR_MIN}..{YEAR_MAX}")


def _parse_date(v: Any) -> Tuple[int, ...]:
    """A date field as (year,), (year, month) or (year, month, day); the year in YEAR_MIN..YEAR_MAX."""
    if isinstance(v, bool):
        raise ValueError(f"not a date: {v!r}")
    if isinstance(v, int):
        _check_year(v, v)
        return (v,)
    if isinstance(v, _dt.date):
        return (v.year, v.month, v.day)
    m = _DATE.match(str(v)) if isinstance(v, str) else None
    if not m:
        raise ValueError(f"not a date (want YYYY, YYYY-MM or YYYY-MM-DD): {v!r}")
    parts = tuple(int(x) for x in m.groups() if x is not None)
    _check_year(parts[0], v)
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


def _read_qrels(path: str, report: LoadReport, on_error: str) -> Dict[str, Dict[str, Tuple[int, int]]]:
    """``{qid: {doc_id: (score, line)}}``."""
    report.files.append(path)
    out: Dict[str, Dict[str, Tuple[int, int]]] = {}
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
            qid, doc = parts[0].strip(), parts[1].strip()
            prev = out.get(qid, {}).get(doc)
            if prev is not None:   # the first judgement is kept (skip) or the file is refused (raise)
                handle(DataFormatError(path, ln, f"duplicate qrels row: query {qid!r}, document {doc!r} is judged "
                                                 f"at line {prev[1]} already"), report, on_error)
                continue
            out.setdefault(qid, {})[doc] = (rel, ln)
    return out


def qrels_files(folder: str) -> Dict[str, str]:
    """``{split: path}`` of the ``qrels/*.tsv`` files of a BEIR folder, sorted by split name."""
    d = os.path.join(folder, "qrels")
    if not os.path.isdir(d):
        raise FileNotFoundError(f"BEIR folder {folder} has no qrels/ folder (want qrels/<split>.tsv)")
    out = {f[:-4]: os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".tsv")}
    if not out:
        raise FileNotFoundError(f"{d} holds no <split>.tsv file")
    return out


def load_beir(folder: Optional[str] = None, *, corpus: Optional[str] = None, queries: Optional[str] = None,
              qrels: Optional[str] = None, split: Optional[str] = None, calendar: Optional[Calendar] = None,
              on_error: str = "raise", name: Optional[str] = None, text_times: bool = True,
              resolution: str = "auto") -> RetrievalDataset:
    """Load a BEIR-style set: ``folder`` with ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/*.tsv``
    (or explicit paths; ``qrels=`` one file whose queries get split ``split or "test"``).

    - ``split``: read only ``qrels/<split>.tsv``; default every qrels file, each query's split named
      after its file (a query judged in two files is an error).
    - Times: the ``time`` / ``date`` or ``start`` / ``end`` fields; a row without them, with
      ``text_times``, its text's dates (every expression; the interval is their hull).
    - ``calendar``: default a :meth:`Calendar.gregorian` spanning the years found, day-level when a
      time field names a day (``resolution="auto"``), else year/month; ``"day"`` / ``"month"`` force one.
      A date prefix such as ``"2019-05"`` covers the whole month.
    - Qrels naming unknown queries or documents are errors naming file:line (or skipped and reported
      with ``on_error="skip"``); only queries with qrels are kept."""
    _check_on_error(on_error)
    if resolution not in ("auto", "day", "month"):
        raise ValueError(f"resolution must be 'auto', 'day' or 'month', got {resolution!r}")
    if folder is not None:
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"BEIR folder {folder} does not exist")
        corpus = corpus or os.path.join(folder, "corpus.jsonl")
        queries = queries or os.path.join(folder, "queries.jsonl")
        for what, pth in (("corpus", corpus), ("queries", queries)):  # the documents first: the likeliest slip
            if not os.path.isfile(pth):
                raise FileNotFoundError(f"{what} file {pth} does not exist (a BEIR set is corpus.jsonl, "
                                        "queries.jsonl and qrels/<split>.tsv)")
        if qrels is None:
            files = qrels_files(folder)
            if split is not None:
                if split not in files:
                    raise FileNotFoundError(f"{os.path.join(folder, 'qrels', split + '.tsv')} does not exist "
                                            f"(the folder has qrels for: {', '.join(files)})")
                files = {split: files[split]}
        else:
            files = {split or "test": qrels}
    elif corpus and queries and qrels:
        files = {split or "test": qrels}
    else:
        raise ValueError("give a folder, or all of corpus=, queries= and qrels= paths")
    for what, pth in (("corpus", corpus), ("queries", queries), *(("qrels", f) for f in files.values())):
        if not os.path.isfile(pth):
            raise FileNotFoundError(f"{what} file {pth} does not exist (a BEIR set is corpus.jsonl, queries.jsonl "
                                    "and qrels/<split>.tsv)")
    report = LoadReport()
    raw_docs: List[Tuple[str, int, Dict[str, Any], Any]] = []
    raw_qs: List[Tuple[str, int, Dict[str, Any], Any]] = []
    published: Dict[str, _dt.date] = {}
    years: List[int] = []
    field_day = False
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
                obj["text"] = report.cap(obj["text"])   # before the date tagger (tempokern.limits)
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
            times = None
            if t is not None:
                field_day = field_day or len(t[0]) == 3 or len(t[1]) == 3
            elif text_times:
                from ..text.intervals import hull, time_intervals
                times = time_intervals(obj["text"])
                t = hull(times)
            if t is not None:
                years += [t[0][0], t[1][0]]
            sink.append((str(path), ln, obj, (t, times)))
    if not raw_docs:
        raise ValueError(f"{corpus} holds no usable documents (a BEIR set needs corpus.jsonl rows with '_id' and 'text')")
    if not raw_qs:
        raise ValueError(f"{queries} holds no usable queries (a BEIR set needs queries.jsonl rows with '_id' and 'text')")
    cal = calendar
    if cal is None and years:
        res = resolution if resolution != "auto" else ("day" if field_day else "month")
        cal = Calendar.gregorian(min(years), max(years), resolution=res)

    def with_intervals(raw, what):
        """(obj, id, interval or None, text times) of each row whose time is on the calendar; the others
        are reported."""
        for path, ln, obj, (t, times) in raw:
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
            yield obj, _id, iv, times

    def meta_of(obj, times, drop):
        m = {k: v for k, v in obj.items() if k not in drop}
        if times is not None:
            m["times"] = [[_fmt(a), _fmt(b)] for a, b in times]
        return m

    records: List[Record] = []
    for obj, _id, iv, times in with_intervals(raw_docs, "document"):
        records.append(Record(_id, obj["text"], interval=iv, title=str(obj.get("title") or ""),
                              meta=meta_of(obj, times, ("_id", "id", "text", "title")),
                              published=published.get(_id)))
    doc_ids = {r.id for r in records}
    q_rows = {_id: (obj, iv, times) for obj, _id, iv, times in with_intervals(raw_qs, "query")}
    q_split: Dict[str, str] = {}
    golds: Dict[str, Dict[str, int]] = {}
    for sp, qpath in files.items():
        for qid, docs in _read_qrels(str(qpath), report, on_error).items():
            first = min(ln for _, ln in docs.values())
            if qid in q_split:
                handle(DataFormatError(str(qpath), first, f"query {qid!r} is judged in qrels/{q_split[qid]}.tsv "
                                                          f"too (a query belongs to one split)"), report, on_error)
                continue
            if qid not in q_rows:
                handle(DataFormatError(str(qpath), first, f"query {qid!r} is not in {queries}"), report, on_error)
                continue
            gold = {}
            for d, (rel, ln) in docs.items():
                if d not in doc_ids:
                    handle(DataFormatError(str(qpath), ln, f"query {qid!r}: document {d!r} is not in the corpus"),
                           report, on_error)
                    continue
                gold[d] = rel
            if not gold:
                report.notes.append(f"query {qid!r} left out: none of its qrels documents is in the corpus")
                continue
            q_split[qid], golds[qid] = sp, gold
    out_q: List[Query] = []
    for _id, (obj, iv, times) in q_rows.items():
        if _id not in golds:
            continue
        out_q.append(Query(_id, obj["text"], interval=iv, family=str(obj.get("family", "all")), gold=golds[_id],
                           split=q_split[_id], meta=meta_of(obj, times, ("_id", "id", "text"))))
    report.records, report.queries = len(records), len(out_q)
    return RetrievalDataset(name or os.path.basename(os.path.normpath(folder or os.path.dirname(corpus))),
                            records, out_q, cal, report)


def _fmt(p: Tuple[int, ...]) -> str:
    return "-".join([f"{p[0]:04d}"] + [f"{x:02d}" for x in p[1:]])
