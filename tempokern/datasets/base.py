"""Records, queries, datasets and the load report shared by every loader."""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..calendar import Calendar, Interval
from ..limits import MAX_TEXT_CHARS

__all__ = ["Record", "Query", "RetrievalDataset", "LoadReport", "DataFormatError", "RECORD_TYPES",
           "QUERY_FAMILIES", "read_jsonl"]

#: record types of the ChunQiuTR format
RECORD_TYPES = ("event", "no_event", "neg_comment")
#: query families of the ChunQiuTR format
QUERY_FAMILIES = ("point", "window", "gap")


class DataFormatError(ValueError):
    """A malformed row: the message names the file and the 1-based line."""

    def __init__(self, path: str, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


@dataclass
class LoadReport:
    """What a loader read, kept and skipped (nothing is dropped silently)."""
    files: List[str] = field(default_factory=list)
    rows_read: int = 0
    records: int = 0
    queries: int = 0
    synthesized: int = 0
    skipped: List[Tuple[str, int, str]] = field(default_factory=list)   # (path, line, reason)
    notes: List[str] = field(default_factory=list)
    truncated: int = 0    # texts cut to tempokern.limits.MAX_TEXT_CHARS characters

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def cap(self, text: str) -> str:
        """`text` cut to :data:`tempokern.limits.MAX_TEXT_CHARS` characters, counted in :attr:`truncated`."""
        if len(text) <= MAX_TEXT_CHARS:
            return text
        self.truncated += 1
        return text[:MAX_TEXT_CHARS]

    def truncation_note(self) -> str:
        """One line saying how many texts were truncated ("" when none)."""
        if not self.truncated:
            return ""
        return (f"{self.truncated} text(s) longer than {MAX_TEXT_CHARS} characters truncated to their first "
                f"{MAX_TEXT_CHARS} (tempokern.limits.MAX_TEXT_CHARS)")

    def skip(self, err: DataFormatError) -> None:
        self.skipped.append((err.path, err.line, err.reason))

    def summary(self) -> str:
        s = (f"read {self.rows_read} rows from {len(self.files)} file(s): {self.records} records, "
             f"{self.queries} queries, {self.synthesized} synthesized, {self.num_skipped} skipped")
        for p, l, r in self.skipped[:10]:
            s += f"\n  skipped {p}:{l}: {r}"
        if self.num_skipped > 10:
            s += f"\n  ... {self.num_skipped - 10} more"
        if self.truncated:
            s += f"\n  note: {self.truncation_note()}"
        for n in self.notes:
            s += f"\n  note: {n}"
        return s


@dataclass(frozen=True)
class Record:
    """A gallery document.

    ``interval``: its time on the calendar's rank axis (None for untimed documents); ``key``: the
    unit key for point-dated records; ``type``: ``event`` / ``no_event`` / ``neg_comment``;
    ``published``: the publication date (``datetime.date``), which orders versions of a fact (Re³'s
    ``d_pub``) and anchors relative dates in the text; None when unknown."""
    id: str
    text: str
    key: Optional[Tuple[Any, ...]] = None
    interval: Optional[Interval] = None
    type: str = "event"
    title: str = ""
    meta: Dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    published: Optional[_dt.date] = None


def is_relevant(score) -> bool:
    """The one relevance rule of every training and evaluation path: a qrels score > 0 is relevant; 0 and
    negative scores (judged not relevant) are not."""
    return score > 0


@dataclass(frozen=True)
class Query:
    """A query: ``interval`` is its target time span (rank axis); ``gold`` its relevant record ids
    with graded relevance (``{doc_id: rel}``, rel > 0 relevant); ``family`` point/window/gap (or any
    label for non-ChunQiuTR sets); ``pure_no_event``: every gold record is a no_event record."""
    id: str
    text: str
    interval: Optional[Interval] = None
    family: str = "point"
    gold: Dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    pure_no_event: bool = False
    split: Optional[str] = None
    meta: Dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def relevant_ids(self) -> List[str]:
        """The ids of the records this query's qrels mark relevant (:func:`is_relevant`), in qrels order."""
        return [d for d, rel in self.gold.items() if is_relevant(rel)]


class RetrievalDataset:
    """Gallery records + queries (+ calendar). The gallery is always the whole corpus (ChunQiuTR
    retrieves over the full time-keyed gallery); :meth:`split` only selects queries."""

    def __init__(self, name: str, records: Sequence[Record], queries: Sequence[Query],
                 calendar: Optional[Calendar] = None, report: Optional[LoadReport] = None):
        self.name = name
        self.records: List[Record] = list(records)
        self.queries: List[Query] = list(queries)
        self.calendar = calendar
        self.report = report or LoadReport()
        self._by_id: Dict[str, Record] = {}
        for r in self.records:
            if r.id in self._by_id:
                raise ValueError(f"dataset {name!r}: duplicate record id {r.id!r}")
            self._by_id[r.id] = r
        seen = set()
        for q in self.queries:
            if q.id in seen:
                raise ValueError(f"dataset {name!r}: duplicate query id {q.id!r}")
            seen.add(q.id)

    def __repr__(self) -> str:
        return (f"RetrievalDataset({self.name!r}: {len(self.records)} records, {len(self.queries)} queries"
                + (f", calendar {self.calendar.name!r}" if self.calendar else "") + ")")

    def record(self, doc_id: str) -> Record:
        return self._by_id[doc_id]

    def __contains__(self, doc_id: str) -> bool:
        return doc_id in self._by_id

    def gallery(self, neg: bool = True, ne: bool = True) -> List[Record]:
        """Records in the gallery under ChunQiuTR's switches: ``neg`` keeps neg_comment records,
        ``ne`` keeps no_event records; event (and any other type) records are always kept."""
        out = []
        for r in self.records:
            if r.type == "neg_comment" and not neg:
                continue
            if r.type == "no_event" and not ne:
                continue
            out.append(r)
        return out

    def qrels(self, queries: Optional[Sequence[Query]] = None) -> Dict[str, Dict[str, int]]:
        """``{qid: {doc_id: rel}}`` of the (given or all) queries."""
        return {q.id: dict(q.gold) for q in (self.queries if queries is None else queries)}

    def queries_in(self, name: str) -> List[Query]:
        """The queries of split ``name`` (empty when the split has none)."""
        return [q for q in self.queries if q.split == name]

    def split(self, name: str) -> "RetrievalDataset":
        """Same gallery, only the queries of split ``name``."""
        qs = self.queries_in(name)
        if not qs:
            have = sorted({str(q.split) for q in self.queries})
            raise ValueError(f"dataset {self.name!r} has no queries in split {name!r}; splits: {have}")
        return RetrievalDataset(f"{self.name}[{name}]", self.records, qs, self.calendar, self.report)

    def records_in_split(self, name: str) -> List[Record]:
        """Records whose time lies wholly in split ``name`` of the calendar (e.g. the training
        gallery for a trainer); untimed records are never in a split."""
        if self.calendar is None or not self.calendar.has_splits:
            raise ValueError(f"dataset {self.name!r} has no calendar with splits")
        return [r for r in self.records
                if r.interval is not None and self.calendar.split_of_interval(r.interval) == name]

    def with_calendar(self, calendar: Calendar) -> "RetrievalDataset":
        """The same data on a calendar with the same units (e.g. ``calendar.with_splits(...)``);
        query splits are re-derived from their intervals."""
        if self.calendar is not None and list(calendar) != list(self.calendar):
            raise ValueError("with_calendar needs a calendar with the same units in the same order")
        qs = [with_split(replace(q, split=None), calendar) for q in self.queries]
        return RetrievalDataset(self.name, self.records, qs, calendar, self.report)

    def splits(self) -> List[str]:
        return sorted({q.split for q in self.queries if q.split is not None})

    def filter_queries(self, pred: Callable[[Query], bool], suffix: str = "filtered") -> "RetrievalDataset":
        return RetrievalDataset(f"{self.name}[{suffix}]", self.records, [q for q in self.queries if pred(q)],
                                self.calendar, self.report)

    def record_ranks(self) -> Dict[str, Interval]:
        """``{doc_id: interval}`` of timed records."""
        return {r.id: r.interval for r in self.records if r.interval is not None}


def read_jsonl(path: str, report: LoadReport, on_error: str) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """Yield (line number, object) of a jsonl file; blank lines are ignored, undecodable or
    non-object lines raise :class:`DataFormatError` or are skipped into ``report``."""
    _check_on_error(on_error)
    report.files.append(str(path))
    with open(path, "rb") as f:
        for ln, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                report.rows_read += 1
                handle(DataFormatError(str(path), ln, utf8_reason(raw, e)), report, on_error)
                continue
            if not line.strip():
                continue
            report.rows_read += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                handle(DataFormatError(str(path), ln, f"invalid JSON ({e.msg} at column {e.colno})"),
                       report, on_error)
                continue
            if not isinstance(obj, dict):
                handle(DataFormatError(str(path), ln, f"expected a JSON object, got {type(obj).__name__}"),
                       report, on_error)
                continue
            yield ln, obj


def utf8_reason(line: bytes, e: UnicodeDecodeError) -> str:
    """What is wrong with a line that is not UTF-8 (for a DataFormatError)."""
    return f"not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})"


def read_utf8(path) -> str:
    """A whole text file; invalid UTF-8 raises :class:`DataFormatError` naming file:line."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        start = data.rfind(b"\n", 0, e.start) + 1
        line = data[start:data.find(b"\n", e.start) if b"\n" in data[e.start:] else len(data)]
        e2 = UnicodeDecodeError(e.encoding, line, e.start - start, e.end - start, e.reason)
        raise DataFormatError(str(path), data[:e.start].count(b"\n") + 1, utf8_reason(line, e2)) from None


def _check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def handle(err: DataFormatError, report: LoadReport, on_error: str) -> None:
    if on_error == "raise":
        raise err
    report.skip(err)


def with_split(q: Query, calendar: Optional[Calendar]) -> Query:
    """Fill ``q.split`` from a calendar with splits (``"mixed"`` when its interval spans several)."""
    if q.split is not None or calendar is None or not calendar.has_splits or q.interval is None:
        return q
    return replace(q, split=calendar.split_of_interval(q.interval))
