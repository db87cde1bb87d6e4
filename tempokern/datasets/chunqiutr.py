"""ChunQiuTR-format data: time-keyed records and point/window/gap queries on a calendar
(default :meth:`Calendar.chunqiu`), split by month key.

Two readers:

* :func:`load_chunqiutr` reads tempokern's plain jsonl form (``records.jsonl`` + ``queries.jsonl``,
  documented in docs/eval.md);
* :func:`load_chunqiutr_release` reads the official release files (``chunqiu_meta_sid_fixed.json``
  with its ``time_mapping``, and ``queries_all_labeledv3.jsonl``).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..calendar import Calendar, Interval
from .base import (QUERY_FAMILIES, RECORD_TYPES, DataFormatError, LoadReport, Query, Record, RetrievalDataset,
                   _check_on_error, handle, read_jsonl, read_utf8, with_split)

__all__ = ["load_chunqiutr", "load_chunqiutr_release", "gold_from_interval", "POS_SOURCES"]

#: sources whose passages are positives (the annals and the three commentaries) in the release
POS_SOURCES = ("春秋", "春秋左氏傳", "春秋公羊傳", "春秋穀梁傳")


def _key(cal: Calendar, raw: Any, path: str, ln: int, what: str) -> Tuple[Any, ...]:
    try:
        return cal.parse(raw)
    except (KeyError, ValueError, TypeError) as e:
        msg = e.args[0] if e.args else str(e)
        raise DataFormatError(path, ln, f"{what}: bad time key {raw!r}: {msg}") from None


def _target(cal: Calendar, raw: Any, path: str, ln: int) -> Interval:
    """``"g-y-m"`` / ``[g, y, m]`` (a point) or ``[start, end]`` (keys or key prefixes)."""
    if isinstance(raw, (list, tuple)) and len(raw) == 2 and all(isinstance(x, (list, tuple, str)) for x in raw):
        try:
            return cal.interval(raw[0], raw[1])
        except (KeyError, ValueError, TypeError) as e:
            raise DataFormatError(path, ln, f"bad target interval {raw!r}: {e.args[0] if e.args else e}") from None
    try:
        return cal.span(raw)
    except (KeyError, ValueError, TypeError) as e:
        raise DataFormatError(path, ln, f"bad target {raw!r}: {e.args[0] if e.args else e}") from None


def gold_from_interval(records: Sequence[Record], interval: Interval) -> Dict[str, int]:
    """Gold of a query with no explicit list: the event and no_event records whose time
    overlaps the target interval (neg_comment records are never gold)."""
    return {r.id: 1 for r in records
            if r.type in ("event", "no_event") and r.interval is not None and r.interval.overlaps(interval)}


def _finish_query(q_fields: Dict[str, Any], records_by_id: Dict[str, Record], records: Sequence[Record],
                  path: str, ln: int) -> Query:
    gold = q_fields.pop("gold")
    if gold is None:
        gold = gold_from_interval(records, q_fields["interval"])
    else:
        unknown = [d for d in gold if d not in records_by_id]
        if unknown:
            raise DataFormatError(path, ln, f"query {q_fields['id']!r}: gold ids not in the records: {unknown[:5]}")
    if not gold:
        raise DataFormatError(path, ln, f"query {q_fields['id']!r}: no gold record (none given and none in "
                                        "its target interval)")
    types = {records_by_id[d].type for d in gold}
    computed = types == {"no_event"}
    flag = q_fields.pop("pure_no_event")
    if flag is not None and bool(flag) != computed:
        raise DataFormatError(path, ln, f"query {q_fields['id']!r}: pure_no_event={flag} contradicts its gold "
                                        f"record types {sorted(types)}")
    return Query(gold=gold, pure_no_event=computed, **q_fields)


def _id_and_text(obj: dict, path: str, ln: int, seen, what: str):
    """The row's id (ints accepted as strings; must be new to `seen`) and its non-empty text."""
    rid, text = obj.get("id"), obj.get("text")
    if isinstance(rid, int) and not isinstance(rid, bool):
        rid = str(rid)
    if not isinstance(rid, str) or not rid:
        raise DataFormatError(path, ln, "missing or empty field 'id'")
    if rid in seen:
        raise DataFormatError(path, ln, f"duplicate {what} id {rid!r}")
    if not isinstance(text, str) or not text.strip():
        raise DataFormatError(path, ln, f"{what} {rid!r}: missing or empty string field 'text'")
    return rid, text


def _category_and_time(obj: dict, path: str, ln: int, label: str, field: str, default: str,
                       allowed: Sequence[str], time_field: str):
    """The row's category (`field`, default `default`, one of `allowed`) and its raw time field (required)."""
    value = obj.get(field, default)
    if value not in allowed:
        raise DataFormatError(path, ln, f"{label}: {field} must be one of {allowed}, got {value!r}")
    if time_field not in obj:
        raise DataFormatError(path, ln, f"{label}: missing field {time_field!r}")
    return value, obj[time_field]


def load_chunqiutr(records_path: str, queries_path: str, *, calendar: Optional[Calendar] = None,
                   on_error: str = "raise", name: str = "chunqiutr") -> RetrievalDataset:
    """Load ChunQiuTR-format jsonl files.

    ``records.jsonl`` rows: ``{"id", "text", "time": "g-y-m" | [g, y, m], "type": "event" |
    "no_event" | "neg_comment"}`` (optional ``title``, ``source``).
    ``queries.jsonl`` rows: ``{"id", "text", "target": key | [start_key, end_key], "family":
    "point" | "window" | "gap"}`` with optional ``"gold": [record ids]`` (default: every
    event/no_event record overlapping the target) and ``"pure_no_event": bool`` (checked against the
    gold's types). A query's split is the calendar split of its target months, ``"mixed"`` when they
    straddle splits (such queries belong to no evaluation split)."""
    _check_on_error(on_error)
    cal = calendar or Calendar.chunqiu()
    report = LoadReport()
    records: List[Record] = []
    by_id: Dict[str, Record] = {}
    rp = str(records_path)
    for ln, obj in read_jsonl(records_path, report, on_error):
        try:
            rid, text = _id_and_text(obj, rp, ln, by_id, "record")
            typ, when = _category_and_time(obj, rp, ln, f"record {rid!r}", "type", "event", RECORD_TYPES, "time")
            key = _key(cal, when, rp, ln, f"record {rid!r}")
            if not cal.is_real(key):
                raise DataFormatError(rp, ln, f"record {rid!r}: time {when!r} is a padding slot, not a real "
                                              f"unit of calendar {cal.name!r}")
        except DataFormatError as e:
            handle(e, report, on_error)
            continue
        r = cal.rank(key)
        rec = Record(rid, report.cap(text.strip()), key=key, interval=Interval(r, r), type=typ, title=str(obj.get("title") or ""),
                     meta={k: obj[k] for k in ("source",) if k in obj})
        records.append(rec)
        by_id[rid] = rec
    report.records = len(records)

    queries: List[Query] = []
    qp = str(queries_path)
    seen = set()
    for ln, obj in read_jsonl(queries_path, report, on_error):
        try:
            qid, text = _id_and_text(obj, qp, ln, seen, "query")
            fam, target = _category_and_time(obj, qp, ln, f"query {qid!r}", "family", "point", QUERY_FAMILIES,
                                             "target")
            iv = _target(cal, target, qp, ln)
            gold = obj.get("gold")
            if gold is not None:
                if not isinstance(gold, list) or not gold:
                    raise DataFormatError(qp, ln, f"query {qid!r}: gold must be a non-empty list of record ids")
                gold = {str(d): 1 for d in gold}
            pne = obj.get("pure_no_event")
            if pne is not None and not isinstance(pne, bool):
                raise DataFormatError(qp, ln, f"query {qid!r}: pure_no_event must be true/false, got {pne!r}")
            q = _finish_query(dict(id=qid, text=report.cap(text.strip()), interval=iv, family=fam, gold=gold,
                                   pure_no_event=pne, meta={"target": target}), by_id, records, qp, ln)
        except DataFormatError as e:
            handle(e, report, on_error)
            continue
        seen.add(qid)
        queries.append(with_split(q, cal))
    report.queries = len(queries)
    return RetrievalDataset(name, records, queries, cal, report)


def load_chunqiutr_release(meta_path: str, queries_path: str, *, calendar: Optional[Calendar] = None,
                           on_error: str = "raise", name: str = "chunqiutr") -> RetrievalDataset:
    """Load the official ChunQiuTR release files.

    ``meta_path`` (``chunqiu_meta_sid_fixed.json``): ``{"time_mapping": {..: {"sort_key": [g, y, m],
    "no_event": bool, "versions": [{<source>: [{"sid", "text"}], "neg_sample": [{"source",
    "parsed_comment": [{"sid", "text"}]}]}], "neg_samples": [...]}}}``. Passages of the annals
    and its three commentaries (:data:`POS_SOURCES`) become event records (no_event records when the
    month is flagged ``no_event``); parsed later commentary becomes neg_comment records.
    ``queries_path`` (``queries_all_labeledv3.jsonl``): ``{"qid", "query", "type": point | window |
    gap, "sort_key" (point) | "target_sort_keys", "pos_sids"}``; gold = ``pos_sids`` present in the
    corpus (queries left with none are reported and skipped, as the release's loader does)."""
    _check_on_error(on_error)
    cal = calendar or Calendar.chunqiu()
    report = LoadReport(files=[str(meta_path)])
    mp = str(meta_path)
    try:
        meta = json.loads(read_utf8(meta_path))
    except json.JSONDecodeError as e:
        raise DataFormatError(mp, e.lineno, f"invalid JSON ({e.msg})") from None
    tmap = meta.get("time_mapping") if isinstance(meta, dict) else None
    if not isinstance(tmap, dict):
        raise DataFormatError(mp, 1, "expected an object with a 'time_mapping' object")
    records: List[Record] = []
    by_id: Dict[str, Record] = {}

    def add(sid, text, key, typ, source, where):
        if not isinstance(text, str) or not text.strip() or sid is None:
            raise DataFormatError(mp, 0, f"{where}: passage without sid/text")
        rid = str(sid)
        if rid in by_id:
            raise DataFormatError(mp, 0, f"{where}: duplicate sid {rid}")
        r = cal.rank(key)
        rec = Record(rid, report.cap(text.strip()), key=key, interval=Interval(r, r), type=typ, meta={"source": source})
        records.append(rec)
        by_id[rid] = rec

    for tkey, info in tmap.items():
        report.rows_read += 1
        where = f"time_mapping[{tkey!r}]"
        try:
            if not isinstance(info, dict) or not isinstance(info.get("sort_key"), list):
                raise DataFormatError(mp, 0, f"{where}: missing 'sort_key' list")
            key = _key(cal, tuple(info["sort_key"]), mp, 0, where)
            if not cal.is_real(key):
                raise DataFormatError(mp, 0, f"{where}: sort_key {info['sort_key']} is not a real month")
            pos_type = "no_event" if info.get("no_event") else "event"
            for ver in info.get("versions", []) or []:
                if not isinstance(ver, dict):
                    raise DataFormatError(mp, 0, f"{where}: each version must be an object")
                for src in POS_SOURCES:
                    for e in (ver.get(src) or []) if isinstance(ver.get(src), list) else []:
                        add(e.get("sid"), e.get("text"), key, pos_type, src, where)
                for blk in ver.get("neg_sample", []) or []:
                    for e in blk.get("parsed_comment") or []:
                        add(e.get("sid"), e.get("text"), key, "neg_comment", blk.get("source", "comment"), where)
            for blk in info.get("neg_samples", []) or []:
                for e in blk.get("parsed_comment") or []:
                    add(e.get("sid"), e.get("text"), key, "neg_comment", blk.get("source", "comment"), where)
        except DataFormatError as e:
            handle(e, report, on_error)
    report.records = len(records)

    queries: List[Query] = []
    qp = str(queries_path)
    n_nogold = 0
    for ln, obj in read_jsonl(queries_path, report, on_error):
        try:
            qid = str(obj.get("qid", f"line{ln}"))
            text, fam = obj.get("query"), obj.get("type") or obj.get("source") or "point"
            if not isinstance(text, str) or not text.strip():
                raise DataFormatError(qp, ln, f"query {qid!r}: missing or empty string field 'query'")
            if fam not in QUERY_FAMILIES:
                raise DataFormatError(qp, ln, f"query {qid!r}: type must be one of {QUERY_FAMILIES}, got {fam!r}")
            raw = [obj.get("sort_key")] if fam == "point" else (obj.get("target_sort_keys") or [])
            ranks = []
            for sk in raw:
                if sk is None:
                    continue
                if not isinstance(sk, list):
                    raise DataFormatError(qp, ln, f"query {qid!r}: sort keys must be [g, y, m] lists, got {sk!r}")
                k = _key(cal, tuple(sk), qp, ln, f"query {qid!r}")
                if cal.is_real(k):
                    ranks.append(cal.rank(k))
            pos = [str(s) for s in (obj.get("pos_sids") or []) if str(s) in by_id]
            if not pos:
                n_nogold += 1
                continue
            if not ranks:  # the release falls back to the first gold's month
                ranks = [by_id[pos[0]].interval.start]
            iv = Interval(min(ranks), max(ranks))
            q = _finish_query(dict(id=qid, text=report.cap(text.strip()), interval=iv, family=fam, gold={d: 1 for d in pos},
                                   pure_no_event=None, meta={"target_ranks": sorted(set(ranks))}),
                              by_id, records, qp, ln)
        except DataFormatError as e:
            handle(e, report, on_error)
            continue
        queries.append(with_split(q, cal))
    if n_nogold:
        report.notes.append(f"{n_nogold} queries have no pos_sids in the corpus and were left out")
    report.queries = len(queries)
    return RetrievalDataset(name, records, queries, cal, report)
