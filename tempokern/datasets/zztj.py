"""Zizhi Tongjian (资治通鉴) jsonl: records keyed by (reign title, era year, lunar month), generated
point queries (one per month key, classical-Chinese templates, as in ChunQiuTR's cross-corpus
pilot) and synthesized ``no_event`` records for the months with no entry."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..calendar import LEAP_MONTH, Calendar, Interval

from .._resources import ZZTJ_QIJI, data_path
from .base import (DataFormatError, LoadReport, Query, Record, RetrievalDataset, _check_on_error, handle,
                   read_jsonl)

__all__ = ["load_zztj", "load_zztj_sample", "zztj_time_text", "parse_reign", "cn_int", "ZZTJ_TEMPLATES",
           "PAPER_TEMPLATE"]

#: the ChunQiuTR release's pilot template
PAPER_TEMPLATE = "《资治通鉴·{subset}》在{time}记载了什么？"
#: default templates, used in turn (by the month's rank) for variety
ZZTJ_TEMPLATES = (
    PAPER_TEMPLATE,
    "{time}，所记何事？",
    "{time}有何事？",
    "《通鉴·{subset}》{time}之事。",
)
NO_EVENT_TEMPLATE = "{time}，是月无事。"

_DIGITS = "〇一二三四五六七八九"
_MONTHS = {1: "正月", 2: "二月", 3: "三月", 4: "四月", 5: "五月", 6: "六月", 7: "七月", 8: "八月", 9: "九月",
           10: "十月", 11: "十一月", 12: "十二月"}


def _cn_number(n: int) -> str:
    if n < 10:
        return _DIGITS[n]
    if n < 20:
        return "十" + (_DIGITS[n % 10] if n % 10 else "")
    if n < 100:
        return _DIGITS[n // 10] + "十" + (_DIGITS[n % 10] if n % 10 else "")
    return "".join(_DIGITS[int(c)] for c in str(n))


def zztj_time_text(key: Tuple[Any, ...]) -> str:
    """Classical time phrase of a (reign, era_year, month) key: ``("永明", 2, 1)`` -> 永明二年正月,
    year 1 -> 元年, the intercalary month -> 闰月."""
    reign, year, month = key
    y = "元" if int(year) == 1 else _cn_number(int(year))
    m = "闰月" if month == LEAP_MONTH else _MONTHS.get(int(month), f"{_cn_number(int(month))}月")
    return f"{reign}{y}年{m}"


_CN_DIGIT = {"〇": 0, "零": 0, "一": 1, "二": 2, "三": 3, "四": 4, "五": 5, "六": 6, "七": 7, "八": 8, "九": 9}
_REIGN_YEAR = re.compile(r"^\s*(?P<title>.+?)(?P<year>元|[〇零一二三四五六七八九十廿卅百0-9]+)年"
                         r"(?:[\s,，、]*(?P<month>(?:闰|閏)?(?:正|[一二三四五六七八九十]+|[0-9]+)?月))?\s*$")


def cn_int(s: str) -> int:
    """A Chinese numeral up to the hundreds (or Arabic digits): 十 -> 10, 二十三 -> 23, 廿一 -> 21, 元 -> 1."""
    s = s.strip()
    if s.isdigit():
        return int(s)
    if s in ("元", "正"):
        return 1
    s = s.replace("廿", "二十").replace("卅", "三十")
    total, cur = 0, 0
    for ch in s:
        if ch in _CN_DIGIT:
            cur = _CN_DIGIT[ch]
        elif ch == "十":
            total += (cur or 1) * 10
            cur = 0
        elif ch == "百":
            total += (cur or 1) * 100
            cur = 0
        else:
            raise ValueError(f"not a Chinese numeral: {s!r}")
    return total + cur


def parse_reign(s: str) -> Optional[Tuple[str, int, Optional[str]]]:
    """``"咸宁四年, 十月"`` -> ``("咸宁", 4, "十月")``, ``"建元元年"`` -> ``("建元", 1, None)``: the era title,
    the era year and the month label (None when absent) of a reign string that carries its year, as the
    ChunQiuTR reference keys records; None when the string is an era title alone."""
    m = _REIGN_YEAR.match(s)
    if not m:
        return None
    try:
        year = cn_int(m["year"])
    except ValueError:
        return None
    return m["title"].strip(), year, m["month"]


def _month_of_label(label: str) -> Optional[int]:
    """正月 -> 1, 十月 -> 10, 闰月 / 闰十月 -> LEAP_MONTH; None when it names no month."""
    label = label.strip()
    if label.startswith(("闰", "閏")):
        return LEAP_MONTH
    body = label[:-1] if label.endswith("月") else label
    if not body:
        return None
    try:
        n = cn_int(body)
    except ValueError:
        return None
    return n if 1 <= n <= 12 else None


def _parse_row(path: str, ln: int, obj: Dict[str, Any]):
    """-> ("span", None) for span-header rows, else ("record", fields)."""
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid.strip():
        raise DataFormatError(path, ln, "missing or empty string field 'id'")
    tm = obj.get("time_meta")
    if not isinstance(tm, dict):
        raise DataFormatError(path, ln, f"record {rid!r}: missing object field 'time_meta'")
    if "reign" not in tm and "start_ad_year" in tm:
        return "span", rid
    text = obj.get("description")
    if not isinstance(text, str) or not text.strip():
        raise DataFormatError(path, ln, f"record {rid!r}: missing or empty string field 'description'")
    reign = tm.get("reign")
    if not isinstance(reign, str) or not reign.strip():
        raise DataFormatError(path, ln, f"record {rid!r}: time_meta.reign must be a non-empty string, got {reign!r}")
    ey = tm.get("era_year")
    lm, label = tm.get("lunar_month"), tm.get("lunar_month_label")
    label = label.strip() if isinstance(label, str) else ""
    parsed = parse_reign(reign)
    if parsed is not None:   # "咸宁四年, 十月": the year (and month) are in the reign string
        title, p_year, p_month = parsed
        if ey is not None and ey != p_year:
            raise DataFormatError(path, ln, f"record {rid!r}: time_meta.era_year {ey!r} contradicts the reign "
                                            f"string {reign!r} (year {p_year})")
        reign, ey = title, p_year
        if p_month and (lm is None or lm == 0) and not label:
            pm = _month_of_label(p_month)
            if pm is None:
                raise DataFormatError(path, ln, f"record {rid!r}: no month in {p_month!r} of reign string {reign!r}")
            if pm == LEAP_MONTH:
                label = p_month
            else:
                lm = pm
    if isinstance(ey, bool) or not isinstance(ey, int) or ey < 1:
        raise DataFormatError(path, ln, f"record {rid!r}: time_meta.era_year must be an int >= 1, or null with the "
                                        f"year in time_meta.reign (e.g. \"咸宁四年, 十月\"), got {ey!r} with reign "
                                        f"{reign!r}")
    no_month = lm is None or (lm == 0 and not isinstance(lm, bool))
    year_label = None
    if no_month and label.startswith(("闰", "閏")):
        month: Any = LEAP_MONTH
    elif isinstance(lm, int) and not isinstance(lm, bool) and 1 <= lm <= 12:
        month = lm
    elif no_month and (label or _season(tm)):
        # a record dated to the year only (无月 "no month", 是岁 "this year", "—", or a season without a
        # month): keyed by its label as the reference's extract_month_key (label, else the season)
        month, year_label = None, label or _season(tm)
    else:
        raise DataFormatError(path, ln, f"record {rid!r}: time_meta.lunar_month must be 1..12, or 0/null with a "
                                        f"lunar_month_label (闰月 for an intercalary month; 无月, 是岁, ... for a "
                                        f"record dated to the year) or a season, got {lm!r} / {label!r}")
    ad = tm.get("ad_year")
    meta = {k: obj[k] for k in ("time", "location", "source") if k in obj} | {"time_meta": tm}
    emperor = tm.get("emperor")
    if isinstance(emperor, str) and emperor.strip():
        meta["emperor"] = emperor.strip()
    if year_label is not None:
        meta["month_label"] = year_label
    return "record", dict(id=rid.strip(), text=text.strip(), title=str(obj.get("title") or ""),
                          reign=reign.strip(), year=ey, month=month,
                          ad_year=ad if isinstance(ad, int) and not isinstance(ad, bool) else None,
                          meta=meta)


def _season(tm) -> str:
    s = tm.get("season")
    return s.strip() if isinstance(s, str) else ""


def load_zztj(path: str, *, subset: Optional[str] = None, eras: Optional[Sequence[Tuple]] = None,
              templates: Sequence[str] = ZZTJ_TEMPLATES, no_event_records: bool = True,
              no_event_queries: bool = False, on_error: str = "raise") -> RetrievalDataset:
    """Load a Zizhi Tongjian jsonl file (see docs/eval.md for the row format).

    - Records: one per event row, keyed ``(reign, era_year, month)`` on a
      :meth:`Calendar.reign` calendar; ``month`` is 1..12 or :data:`~tempokern.calendar.LEAP_MONTH`
      for 闰月 rows (placed after the last numbered month seen before it in that year).
    - ``eras``: chronological ``(title, n_years[, first_ad_year])``; default inferred from the rows
      (each era up to the last year seen, in order of first appearance).
    - Span-header rows (``time_meta`` with ``start_ad_year`` and no ``reign``) are not events; they
      are left out and listed in ``report.notes``.
    - A ``reign`` string that carries the year (``"咸宁四年, 十月"``) gives the era title, the year and,
      when the row has no month of its own, the month (:func:`parse_reign`); ``era_year`` may then be
      null, and one that contradicts the string is a data error.
    - ``no_event_records``: add one ``no_event`` record for every calendar month with no row.
    - Queries: one ``point`` query per month key that has records (gold = its records), from
      ``templates`` (used in turn); ``no_event_queries`` also adds one per empty month (gold = its
      no_event record, ``pure_no_event=True``).
    - Malformed rows raise :class:`DataFormatError` (file:line) or, with ``on_error="skip"``, are
      skipped and listed in ``dataset.report``.
    """
    _check_on_error(on_error)
    if not templates:
        raise ValueError("templates must hold at least one query template")
    for t in templates:
        if "{time}" not in t:
            raise ValueError(f"query template {t!r} must contain '{{time}}'")
    report = LoadReport()
    rows: List[Tuple[int, Dict[str, Any]]] = []
    spans, ids = [], set()
    for ln, obj in read_jsonl(path, report, on_error):
        try:
            kind, fields = _parse_row(str(path), ln, obj)
            if kind == "record" and fields["id"] in ids:
                raise DataFormatError(str(path), ln, f"duplicate record id {fields['id']!r}")
        except DataFormatError as e:
            handle(e, report, on_error)
            continue
        if kind == "span":
            spans.append(fields)
            continue
        fields["text"] = report.cap(fields["text"])   # before anything reads it (tempokern.limits)
        ids.add(fields["id"])
        rows.append((ln, fields))
    if spans:
        report.notes.append(f"{len(spans)} span-header row(s) left out (not events): {', '.join(spans)}")
    if subset is None:
        src = next((f["meta"].get("source") for _, f in rows if f["meta"].get("source")), "")
        subset = src.split("·")[-1] if src else "资治通鉴"

    # place intercalary months: after the last numbered month seen before them in the same year
    leap: Dict[Tuple[str, int], int] = {}
    last: Dict[Tuple[str, int], int] = {}
    kept = []
    for ln, f in rows:
        ry = (f["reign"], f["year"])
        if f["month"] is None:            # dated to the year only: takes no month slot
            kept.append((ln, f))
            continue
        if f["month"] == LEAP_MONTH:
            if ry not in last:
                handle(DataFormatError(str(path), ln, f"record {f['id']!r}: 闰月 of {ry[0]}{ry[1]} comes before any "
                                                      "numbered month of that year; cannot place it"), report, on_error)
                continue
            if ry in leap and leap[ry] != last[ry]:
                handle(DataFormatError(str(path), ln, f"record {f['id']!r}: second intercalary month in "
                                                      f"{ry[0]}{ry[1]} (after month {leap[ry]} and {last[ry]})"),
                       report, on_error)
                continue
            leap[ry] = last[ry]
        else:
            last[ry] = f["month"]
        kept.append((ln, f))
    rows = kept

    if eras is None:
        order: List[str] = []
        n_years: Dict[str, int] = {}
        first_ad: Dict[str, int] = {}
        for _, f in rows:
            if f["reign"] not in n_years:
                order.append(f["reign"])
            n_years[f["reign"]] = max(n_years.get(f["reign"], 0), f["year"])
            if f["ad_year"] is not None:
                first_ad.setdefault(f["reign"], f["ad_year"] - f["year"] + 1)
        if not order:
            raise ValueError(f"{path}: no dated record to build a calendar from")
        eras = [(t, n_years[t], first_ad[t]) if t in first_ad else (t, n_years[t]) for t in order]
    cal = Calendar.reign(eras, leap_months=leap, name=f"zztj-{subset}")

    records: List[Record] = []
    by_rank: Dict[int, List[str]] = {}
    by_year_label: Dict[Tuple[str, int, str], List[str]] = {}
    year_iv: Dict[Tuple[str, int, str], Any] = {}
    for ln, f in rows:
        if f["month"] is None:
            key = (f["reign"], f["year"])
            try:
                iv = cal.span(key)
            except (KeyError, ValueError, IndexError) as e:
                handle(DataFormatError(str(path), ln, f"record {f['id']!r}: year {key} not in the era list: {e}"),
                       report, on_error)
                continue
            g = (f["reign"], f["year"], f["meta"]["month_label"])
            records.append(Record(f["id"], f["text"], key=key, interval=iv, type="event", title=f["title"],
                                  meta=dict(f["meta"])))
            by_year_label.setdefault(g, []).append(f["id"])
            year_iv[g] = iv
            continue
        key = (f["reign"], f["year"], f["month"])
        try:
            r = cal.rank(key)
        except (KeyError, ValueError) as e:
            handle(DataFormatError(str(path), ln, f"record {f['id']!r}: time key {key} not in the era list: {e}"),
                   report, on_error)
            continue
        meta = dict(f["meta"])
        records.append(Record(f["id"], f["text"], key=cal.key_at(r), interval=_iv(r), type="event",
                              title=f["title"], meta=meta))
        by_rank.setdefault(r, []).append(f["id"])
    report.records = len(records)
    if by_year_label:
        report.notes.append(f"{sum(map(len, by_year_label.values()))} record(s) dated to a year without a month "
                            f"({', '.join(sorted({g[2] for g in by_year_label}))}): year-long intervals, "
                            f"{len(by_year_label)} (reign, year, label) query group(s)")

    empty = [r for r in range(cal.num_units) if r not in by_rank]
    ne_ids: Dict[int, str] = {}
    if no_event_records:
        for r in empty:
            key = cal.key_at(r)
            rid = f"no_event:{cal.key_str(key)}"
            if rid in ids:
                raise ValueError(f"{path}: a record id collides with synthesized id {rid!r}")
            records.append(Record(rid, NO_EVENT_TEMPLATE.format(time=zztj_time_text(key), subset=subset), key=key,
                                  interval=_iv(r), type="no_event", meta={"synthesized": True}))
            ne_ids[r] = rid
        report.synthesized = len(ne_ids)

    queries: List[Query] = []
    q_ranks = sorted(by_rank) + (sorted(ne_ids) if no_event_queries else [])
    for r in sorted(q_ranks):
        key = cal.key_at(r)
        tmpl = templates[r % len(templates)]
        gold = {d: 1 for d in by_rank[r]} if r in by_rank else {ne_ids[r]: 1}
        queries.append(Query(f"q:{cal.key_str(key)}", tmpl.format(time=zztj_time_text(key), subset=subset),
                             interval=_iv(r), family="point", gold=gold, pure_no_event=r not in by_rank,
                             meta={"key": key, "template": tmpl}))
    # one query per (reign, year, label) group of year-dated records, as the reference's month groups
    # (extract_month_key keys them by label): interval = the year, gold = the group's records
    for g in sorted(by_year_label, key=lambda g: (year_iv[g].start, g[2])):
        reign, year, label = g
        tmpl = templates[year_iv[g].start % len(templates)]
        y = "元" if int(year) == 1 else _cn_number(int(year))
        queries.append(Query(f"q:{reign}-{year}-{label}", tmpl.format(time=f"{reign}{y}年{label}", subset=subset),
                             interval=year_iv[g], family="year", gold={d: 1 for d in by_year_label[g]},
                             meta={"key": (reign, year), "month_label": label, "template": tmpl}))
    report.queries = len(queries)
    return RetrievalDataset(f"zztj-{subset}", records, queries, cal, report)


def _iv(r: int):
    return Interval(r, r)


def load_zztj_sample(**kwargs) -> RetrievalDataset:
    """The packaged sample: 268 rows of the Zizhi Tongjian Qi annals (齐纪, 479-489 CE) from the
    ChunQiuTR release (MIT): 266 event records over 92 month keys (4 of them 闰月), 2 span headers.
    Keyword arguments go to :func:`load_zztj`."""
    with data_path(ZZTJ_QIJI) as p:
        return load_zztj(str(p), **kwargs)
