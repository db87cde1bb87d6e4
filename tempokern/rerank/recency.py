"""Re³'s conflict-aware recency filter (Cao et al., ACL 2026, §3.4, Eq. 14) and its fact extractors.

Given a query and its top-k candidates (each with a publication date ``published`` = Re³'s ``d_pub``),
an extractor states, per candidate, the fact it makes about the question as ``(head, relation, value)``
(``value=None`` = NULL: the candidate does not address it). Facts are grouped by (head, relation); in each
group the **winning version** ``v*`` is the value of the candidate with the latest ``published``, and

    s_rec(d) = +1 if d supports v*,  −1 if d states some v' ≠ v*,  0 otherwise          (Eq. 14)

Candidates with ``s_rec < 0`` are removed; survivors keep their order. Choices of the design notes:
B9 (several candidates share the latest date and disagree ⇒ ``v*`` undefined ⇒ nobody in that group is
voted −1), B11 (:func:`default_equal`), B12 (``mode="rerank"``: ``score + recency_weight · s_rec``, nothing
removed), B13 (``policy="latest_only"``: only the latest candidates of each group survive). A candidate
without ``published`` counts as the oldest (with a warning). A candidate with facts in several groups is
voted −1 when any of its groups votes it −1, else +1 when any votes +1, else 0. An extractor that raises
or returns malformed output removes nothing; the reason is recorded in :attr:`FilterResult.reasons`.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import re
import unicodedata
import warnings
from dataclasses import dataclass, field, replace
from typing import (Any, Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple, Union,
                    runtime_checkable)

__all__ = ["Candidate", "Fact", "Extraction", "ExtractionError", "Extractor", "FilterResult", "RecencyFilter",
           "MetadataExtractor", "RuleExtractor", "LLMExtractor", "build_prompt", "parse_facts_json",
           "default_equal", "normalize_text", "parse_number", "find_dates", "date_parts", "fact_key",
           "qualified_relation", "GENERIC_WORDS", "POLICIES", "MODES",
           "DEFAULT_ALIASES", "DEFAULT_METRICS", "DEFAULT_CATEGORIES"]

POLICIES = ("conflict", "latest_only")
MODES = ("filter", "rerank")


# ---- data ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """A retrieved document: ``published`` (``datetime.date`` or None) orders versions; ``score`` is the
    retriever's; ``meta`` the record's metadata (``meta["facts"]`` feeds :class:`MetadataExtractor`)."""
    id: str
    text: str
    published: Optional[_dt.date] = None
    score: float = 0.0
    meta: Dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_record(cls, record, score: float = 0.0) -> "Candidate":
        """From a :class:`tempokern.datasets.Record`."""
        return cls(record.id, record.text, getattr(record, "published", None), float(score),
                   dict(getattr(record, "meta", None) or {}))


@dataclass(frozen=True)
class Fact:
    """The claim candidate ``doc_index`` makes: ``value=None`` is NULL (it does not address the question)."""
    doc_index: int
    head: Optional[str]
    relation: Optional[str]
    value: Optional[str]


@dataclass
class Extraction:
    """What an extractor may return instead of a plain fact list: the facts plus notes (recovered
    problems, e.g. items with wrong indices that were ignored); the notes go to ``FilterResult.reasons``."""
    facts: List[Fact]
    notes: List[str] = field(default_factory=list)


class ExtractionError(RuntimeError):
    """An extractor could not produce facts (unparseable LLM output, malformed metadata)."""


@runtime_checkable
class Extractor(Protocol):
    def __call__(self, query: str, docs: Sequence[Candidate]) -> Union[List[Fact], Extraction]: ...


@dataclass
class FilterResult:
    """``kept``: survivors in their original order (``mode="rerank"``: every candidate, sorted by the new
    score, with ``score`` replaced); ``removed``: candidates voted −1 (filter mode only); ``votes``:
    ``{id: -1/0/+1}``; ``groups``: ``{(head, relation): {"members", "values", "latest", "winner",
    "status"}}``; ``reasons``: why nothing or less was done (extractor failure, missing dates, ...);
    ``facts``: the extractor's facts; ``ok``: False when the extractor failed (nothing was filtered)."""
    kept: List[Candidate]
    removed: List[Candidate]
    votes: Dict[str, int]
    groups: Dict[Tuple[str, str], Dict[str, Any]]
    reasons: List[str] = field(default_factory=list)
    facts: List[Fact] = field(default_factory=list)
    ok: bool = True


# ---- value normalisation (B11) ---------------------------------------------------------------------------

_WS = re.compile(r"\s+")


def normalize_text(s: Any) -> str:
    """Unicode NFC, case-folded, whitespace collapsed, trimmed, trailing sentence punctuation removed."""
    s = unicodedata.normalize("NFC", str(s)).casefold()
    s = _WS.sub(" ", s).strip()
    return s.rstrip(" .;,!?").strip()


_NUMBER_VALUE = re.compile(
    r"^(?:[$€£¥]\s*)?([+\-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+\-]?\.\d+)\s*([^\d]*)$")


def parse_number(s: Any) -> Optional[Tuple[float, str]]:
    """``(number, unit)`` when the whole (normalised) string is a number with an optional unit
    (``"12.5 °C"``, ``"1,200 jobs"``, ``"$3.20"``, ``"-4"``), else None. Thousands separators are removed,
    the unicode minus is read as ``-``."""
    t = normalize_text(s).replace("\u2212", "-")
    m = _NUMBER_VALUE.match(t)
    if not m:
        return None
    try:
        x = float(m.group(1).replace(",", ""))
    except ValueError:
        return None
    if not math.isfinite(x):
        return None
    return x, m.group(2).strip()


def default_equal(a: Optional[str], b: Optional[str]) -> bool:
    """B11: equal after :func:`normalize_text` (case, whitespace, NFC), or, when both sides are a number
    with an optional unit, equal as floats with the units stripped (``"12.0 °C" == "12 C" == "12"``)."""
    if a is None or b is None:
        return a is None and b is None
    na, nb = normalize_text(a), normalize_text(b)
    if na == nb:
        return True
    pa, pb = parse_number(na), parse_number(nb)
    if pa is not None and pb is not None:
        return pa[0] == pb[0]
    return False


# ---- the filter ------------------------------------------------------------------------------------------

def _group_key(head: Optional[str], relation: Optional[str]) -> Tuple[str, str]:
    return (normalize_text(head) if head is not None else "", normalize_text(relation) if relation is not None else "")


def _check_facts(out: Any, n: int) -> Tuple[List[Fact], List[str]]:
    """Validates an extractor's output; raises ExtractionError (with the reason) when malformed."""
    notes: List[str] = []
    if isinstance(out, Extraction):
        notes = [str(x) for x in out.notes]
        out = out.facts
    if not isinstance(out, (list, tuple)):
        raise ExtractionError(f"extractor returned {type(out).__name__}, expected a list of Fact")
    facts = []
    for i, f in enumerate(out):
        if not isinstance(f, Fact):
            raise ExtractionError(f"extractor output item {i} is {type(f).__name__}, not a Fact")
        if isinstance(f.doc_index, bool) or not isinstance(f.doc_index, int) or not 0 <= f.doc_index < n:
            raise ExtractionError(f"extractor output item {i}: doc_index {f.doc_index!r} is not in [0, {n})")
        for name in ("head", "relation", "value"):
            v = getattr(f, name)
            if v is not None and not isinstance(v, str):
                raise ExtractionError(f"extractor output item {i}: {name} is {type(v).__name__}, not str or None")
        facts.append(f)
    return facts, notes


class RecencyFilter:
    """Re³'s conflict-aware recency filter (Eq. 14) over an extractor's facts.

    ``policy``: ``"conflict"`` (the paper: remove candidates that state a value other than the latest
    one's) or ``"latest_only"`` (B13: in each group only the candidates with the latest ``published``
    survive, whatever their values). ``mode``: ``"filter"`` (remove ``s_rec < 0``) or ``"rerank"`` (B12:
    ``score' = score + recency_weight · s_rec``, nothing removed, candidates sorted by ``score'``, ties in
    their original order). ``values_equal(a, b)``: value equality (default :func:`default_equal`)."""

    def __init__(self, extractor: Callable[..., Any], *, policy: str = "conflict", mode: str = "filter",
                 recency_weight: float = 1.0, values_equal: Callable[[str, str], bool] = default_equal):
        if not callable(extractor):
            raise TypeError(f"extractor must be callable (query, candidates) -> facts, got {type(extractor).__name__}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(recency_weight, bool) or not isinstance(recency_weight, (int, float)) \
                or not math.isfinite(recency_weight):
            raise ValueError(f"recency_weight must be a finite number, got {recency_weight!r}")
        if not callable(values_equal):
            raise TypeError("values_equal must be callable (a, b) -> bool")
        self.extractor, self.policy, self.mode = extractor, policy, mode
        self.recency_weight, self.values_equal = float(recency_weight), values_equal

    def __repr__(self) -> str:
        return (f"RecencyFilter({type(self.extractor).__name__}, policy={self.policy!r}, mode={self.mode!r}, "
                f"recency_weight={self.recency_weight})")

    @staticmethod
    def _check_candidates(candidates) -> List[Candidate]:
        cands = list(candidates)
        seen = set()
        for i, c in enumerate(cands):
            if not isinstance(c, Candidate):
                raise TypeError(f"candidates[{i}] is {type(c).__name__}, expected Candidate "
                                "(Candidate.from_record(record, score) converts a Record)")
            if c.published is not None and not isinstance(c.published, _dt.date):
                raise TypeError(f"candidates[{i}].published must be a datetime.date or None, got "
                                f"{type(c.published).__name__}")
            if c.id in seen:
                raise ValueError(f"candidates: duplicate id {c.id!r}")
            seen.add(c.id)
        return cands

    def _finish(self, cands, votes, groups, reasons, facts, ok) -> FilterResult:
        if self.mode == "rerank":
            new = [replace(c, score=float(c.score) + self.recency_weight * votes[c.id]) for c in cands]
            order = sorted(range(len(new)), key=lambda i: (-new[i].score, i))
            return FilterResult([new[i] for i in order], [], votes, groups, reasons, facts, ok)
        kept = [c for c in cands if votes[c.id] >= 0]
        removed = [c for c in cands if votes[c.id] < 0]
        return FilterResult(kept, removed, votes, groups, reasons, facts, ok)

    def __call__(self, query: str, candidates: Sequence[Candidate]) -> FilterResult:
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        cands = self._check_candidates(candidates)
        votes = {c.id: 0 for c in cands}
        reasons: List[str] = []
        if not cands:
            return self._finish(cands, votes, {}, reasons, [], True)
        name = type(self.extractor).__name__
        try:
            out = self.extractor(query, cands)
        except Exception as e:  # never a silent drop: record and pass everything on
            reasons.append(f"extractor {name} raised {type(e).__name__}: {e}; nothing removed")
            return self._finish(cands, votes, {}, reasons, [], False)
        try:
            facts, notes = _check_facts(out, len(cands))
        except ExtractionError as e:
            reasons.append(f"extractor {name} returned malformed output ({e}); nothing removed")
            return self._finish(cands, votes, {}, reasons, [], False)
        reasons += notes

        members: Dict[Tuple[str, str], List[Tuple[int, str]]] = {}
        for f in facts:
            if f.value is None:
                continue
            key = _group_key(f.head, f.relation)
            lst = members.setdefault(key, [])
            if any(i == f.doc_index for i, _ in lst):  # one value per candidate and group: the first
                reasons.append(f"candidate {cands[f.doc_index].id!r} states several values for {key}; "
                               "the first is used")
                continue
            lst.append((f.doc_index, f.value))

        undated = set()
        group_votes: Dict[int, List[int]] = {}
        groups: Dict[Tuple[str, str], Dict[str, Any]] = {}
        for key, mem in members.items():
            if len(mem) > 1:
                undated.update(cands[i].id for i, _ in mem if cands[i].published is None)
            pub = {i: (cands[i].published or _dt.date.min) for i, _ in mem}  # missing date = the oldest
            latest = max(pub.values())
            top = [(i, v) for i, v in mem if pub[i] == latest]
            agree = all(self.values_equal(top[0][1], v) for _, v in top[1:])
            info = {"members": [cands[i].id for i, _ in mem], "values": {cands[i].id: v for i, v in mem},
                    "latest": None if latest == _dt.date.min else latest.isoformat(),
                    "winner": top[0][1] if agree else None}
            if len(mem) == 1:
                info["status"] = "single"
            elif not agree:
                info["status"] = "tie"
                reasons.append(f"group {key}: {len(top)} candidates share the latest date {info['latest']} and "
                               "disagree; the winning version is undefined (B9)")
            else:
                info["status"] = "ok"
            for i, v in mem:
                if self.policy == "latest_only":
                    s = (1 if agree else 0) if pub[i] == latest else -1
                elif not agree:
                    s = 0
                else:
                    s = 1 if self.values_equal(v, top[0][1]) else -1
                group_votes.setdefault(i, []).append(s)
            info["votes"] = {cands[i].id: group_votes[i][-1] for i, _ in mem}
            groups[key] = info
        for i, vs in group_votes.items():
            votes[cands[i].id] = -1 if -1 in vs else (1 if 1 in vs else 0)
        if undated:
            msg = (f"{len(undated)} candidate(s) without a publication date are treated as the oldest version: "
                   f"{sorted(undated)[:5]}")
            reasons.append(msg)
            warnings.warn(f"RecencyFilter: {msg}", RuntimeWarning, stacklevel=2)
        return self._finish(cands, votes, groups, reasons, facts, True)


# ---- MetadataExtractor ------------------------------------------------------------------------------------

class MetadataExtractor:
    """Facts from ``candidate.meta["facts"]`` = ``[{"head", "relation", "value"}, ...]`` (records generated
    from structured data: exact, the oracle). A candidate without the key states nothing (NULL); a value
    of None / ``"NULL"`` is NULL; a malformed entry raises :class:`ExtractionError` (the filter then
    removes nothing). ``qualifiers``: meta keys whose values, when present, are appended to the relation
    (default ``("date",)``: a fact is a (head, relation) *at a date*, so versions of one day's value are
    compared with each other and not with other days' values — what the paper's LLM does by marking a
    document about another day NULL); see :func:`fact_key`. ``relevant(query, fact_dict) -> bool``
    optionally keeps only the facts that answer the query (default: all)."""

    def __init__(self, key: str = "facts", relevant: Optional[Callable[[str, Mapping[str, Any]], bool]] = None,
                 qualifiers: Sequence[str] = ("date",)):
        if isinstance(qualifiers, str):
            qualifiers = (qualifiers,)
        self.key, self.relevant, self.qualifiers = key, relevant, tuple(qualifiers)

    def __call__(self, query: str, docs: Sequence[Candidate]) -> List[Fact]:
        out = []
        for i, d in enumerate(docs):
            raw = (d.meta or {}).get(self.key)
            if raw is None:
                continue
            if not isinstance(raw, (list, tuple)):
                raise ExtractionError(f"candidate {d.id!r}: meta[{self.key!r}] must be a list of "
                                      f"{{head, relation, value}}, got {type(raw).__name__}")
            for j, f in enumerate(raw):
                if not isinstance(f, Mapping) or not {"head", "relation", "value"} <= set(f):
                    raise ExtractionError(f"candidate {d.id!r}: meta[{self.key!r}][{j}] must be an object with "
                                          f"head, relation and value, got {f!r}")
                if self.relevant is not None and not self.relevant(query, f):
                    continue
                out.append(Fact(i, _str_or_none(f["head"]), qualified_relation(f["relation"], d.meta, self.qualifiers),
                                _value_or_null(f["value"])))
        return out


def qualified_relation(relation: Any, meta: Optional[Mapping[str, Any]], qualifiers: Sequence[str] = ("date",)
                       ) -> Optional[str]:
    """``relation`` with the values of ``meta``'s qualifier keys appended (``"high @ date=2014-03-05"``);
    unchanged when none is present."""
    if relation is None:
        return None
    quals = [f"{k}={meta[k]}" for k in qualifiers if meta and meta.get(k) is not None]
    return str(relation) if not quals else f"{relation} @ " + ", ".join(quals)


def fact_key(fact: Mapping[str, Any], meta: Optional[Mapping[str, Any]] = None,
             qualifiers: Sequence[str] = ("date",)) -> Tuple[str, str]:
    """The normalised group key (head, relation) of a ``meta["facts"]`` entry, qualified as
    :class:`MetadataExtractor` does."""
    return _group_key(_str_or_none(fact.get("head")), qualified_relation(fact.get("relation"), meta, qualifiers))


def _str_or_none(v) -> Optional[str]:
    return None if v is None else str(v)


_NULLS = {"", "null", "none", "n/a", "na", "unknown"}


def _value_or_null(v) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(v) if isinstance(v, float) else str(v)
    s = str(v)
    return None if normalize_text(s) in _NULLS else s


# ---- dates in text (for RuleExtractor) -----------------------------------------------------------------

_MONTHS = {m: i + 1 for i, m in enumerate(
    ["january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
     "november", "december"])}
_MONTHS.update({m[:3]: i for m, i in list(_MONTHS.items())})
_MONTHS["sept"] = 9
_MON = r"(january|february|march|april|may|june|july|august|september|october|november|december|" \
       r"jan|feb|mar|apr|jun|jul|aug|sept|sep|oct|nov|dec)\.?"
_DATE_PATTERNS = [
    ("ymd", re.compile(r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b")),
    ("mdy_num", re.compile(r"\b(\d{1,2})/(\d{1,2})/(\d{4})\b")),
    ("mdy", re.compile(r"\b" + _MON + r"\s+(\d{1,2})(?:st|nd|rd|th)?,?\s+(\d{4})\b", re.I)),
    ("dmy", re.compile(r"\b(\d{1,2})(?:st|nd|rd|th)?\s+(?:of\s+)?" + _MON + r",?\s+(\d{4})\b", re.I)),
    ("my", re.compile(r"\b" + _MON + r"\s+(\d{4})\b", re.I)),
    ("md", re.compile(r"\b" + _MON + r"\s+(\d{1,2})(?:st|nd|rd|th)?\b(?!\s*,?\s*\d)", re.I)),
    ("ym", re.compile(r"\b(\d{4})-(\d{1,2})\b(?!-)")),
    ("my_num", re.compile(r"\b(\d{1,2})/(\d{4})\b")),
    ("rel", re.compile(r"\b(today|tomorrow|yesterday)\b", re.I)),
    ("year", re.compile(r"\b(1[89]\d\d|20\d\d)\b")),
]


DateParts = Tuple[Optional[int], Optional[int], Optional[int]]


def date_parts(text: str, *, ref: Optional[_dt.date] = None) -> List[Tuple[int, int, DateParts]]:
    """Every date-like span of ``text`` as ``(start, end, (year, month, day))`` with None for the parts it
    does not name: ISO, ``MM/DD/YYYY``, ``Month D, YYYY`` and ``D Month YYYY`` name all three (an impossible
    day, 30 February, keeps year and month only), ``Month YYYY`` / ``YYYY-MM`` / ``MM/YYYY`` year and month, ``Month D``
    month and day, a year alone the year; ``today``/``tomorrow``/``yesterday`` are resolved against ``ref``
    (all None without it). Spans do not overlap (earlier patterns win) and come in text order."""
    out: List[Tuple[int, int, DateParts]] = []
    taken: List[Tuple[int, int]] = []
    for kind, pat in _DATE_PATTERNS:
        for m in pat.finditer(text):
            s, e = m.span()
            if any(s < b and a < e for a, b in taken):
                continue
            g = m.group
            if kind == "ymd":
                y, mo, d = int(g(1)), int(g(2)), int(g(3))
            elif kind == "mdy_num":
                y, mo, d = int(g(3)), int(g(1)), int(g(2))
            elif kind == "mdy":
                y, mo, d = int(g(3)), _MONTHS[g(1).lower()], int(g(2))
            elif kind == "dmy":
                y, mo, d = int(g(3)), _MONTHS[g(2).lower()], int(g(1))
            elif kind == "my":
                y, mo, d = int(g(2)), _MONTHS[g(1).lower()], None
            elif kind == "md":
                if g(1).lower() == "may" and not g(2):
                    continue
                y, mo, d = None, _MONTHS[g(1).lower()], int(g(2))
            elif kind == "ym":
                y, mo, d = int(g(1)), int(g(2)), None
            elif kind == "my_num":
                y, mo, d = int(g(2)), int(g(1)), None
            elif kind == "rel":
                if ref is None:
                    y = mo = d = None
                else:
                    r = ref + _dt.timedelta(days={"today": 0, "tomorrow": 1, "yesterday": -1}[g(1).lower()])
                    y, mo, d = r.year, r.month, r.day
            else:
                y, mo, d = int(g(1)), None, None
            if mo is not None and not 1 <= mo <= 12:
                if kind in ("ym", "my_num", "mdy_num", "ymd"):
                    continue
            if d is not None:
                try:
                    _dt.date(y if y is not None else 2000, mo, d)
                except ValueError:
                    d = None
            taken.append((s, e))
            out.append((s, e, (y, mo, d)))
    out.sort()
    return out


def find_dates(text: str, *, ref: Optional[_dt.date] = None) -> List[Tuple[int, int, Optional[_dt.date]]]:
    """:func:`date_parts` as ``(start, end, date or None)``: the ``datetime.date`` of spans that name a
    whole, possible date, None for partial ones (``Month YYYY``, ``Month D``, ``YYYY-MM``, a year), impossible
    days and unresolved relative words."""
    return [(s, e, _dt.date(*p) if None not in p else None) for s, e, p in date_parts(text, ref=ref)]


def _parts_key(p: DateParts) -> str:
    return "-".join("?" if x is None else f"{x:02d}" for x in p)


def _covers(span: DateParts, want: DateParts) -> bool:
    """``span`` names every part ``want`` names, with the same values."""
    return all(w is None or s == w for s, w in zip(span, want))


# ---- RuleExtractor ---------------------------------------------------------------------------------------

#: canonical entity -> aliases (matched case-insensitively as whole words); extend with ``aliases=``
DEFAULT_ALIASES: Dict[str, List[str]] = {
    "New York City": ["New York City", "NYC", "New York", "N.Y.C."],
    "Seattle": ["Seattle"],
    "San Francisco": ["San Francisco", "SF"],
    "Los Angeles": ["Los Angeles", "L.A."],
    "United States": ["United States", "USA", "U.S."],
}

#: metric (relation) -> (keywords in query/document, kind: "number" or "category")
DEFAULT_METRICS: Dict[str, Tuple[List[str], str]] = {
    "temp_max": (["high temperature", "maximum temperature", "max temperature", "daytime high", "high of",
                  "highs", "high"], "number"),
    "temp_min": (["low temperature", "minimum temperature", "min temperature", "overnight low", "low of", "lows",
                  "low"], "number"),
    "precipitation": (["precipitation", "rainfall", "rain total", "snowfall"], "number"),
    "wind": (["wind speed", "winds", "wind"], "number"),
    "weather": (["weather", "conditions", "sky", "forecast"], "category"),
    "price": (["closing price", "share price", "stock price", "price", "closed at", "traded at"], "number"),
    "employment": (["employment", "jobs", "employees", "employed"], "number"),
    "cases": (["new cases", "cases"], "number"),
    "deaths": (["deaths", "died"], "number"),
    "temperature": (["temperature", "degrees"], "number"),
}

#: categorical word -> canonical value (weather conditions); extend with ``categories=``
DEFAULT_CATEGORIES: Dict[str, str] = {
    "sun": "sun", "sunny": "sun", "sunshine": "sun", "clear": "sun", "fair": "sun",
    "rain": "rain", "rainy": "rain", "showers": "rain", "shower": "rain", "wet": "rain",
    "drizzle": "drizzle", "drizzly": "drizzle",
    "snow": "snow", "snowy": "snow", "flurries": "snow", "sleet": "snow",
    "fog": "fog", "foggy": "fog", "mist": "fog", "misty": "fog",
    "cloudy": "cloud", "overcast": "cloud", "clouds": "cloud",
    "thunderstorm": "thunderstorm", "thunderstorms": "thunderstorm", "storm": "thunderstorm",
}

_UNIT = (r"(?:\s*(?:°\s*[cf]\b|°|º\s*[cf]?|degrees?(?:\s+(?:celsius|fahrenheit|c|f)\b)?|"
         r"mm\b|cm\b|inch(?:es)?\b|in\b|mph\b|km/h|kph\b|m/s|knots\b|%|percent\b|points?\b|"
         r"dollars?\b|usd\b|thousand\b|million\b|billion\b|k\b|"
         r"(?!(?:and|or|of|on|in|at|to|for|with|the|a|an|by|from|than|per|is|was|were|are)\b)[^\W\d_]{2,}\b))?")
_NUM_IN_TEXT = re.compile(r"(?<![\w.])([$€£¥]\s*)?([+\-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)" + _UNIT, re.I)
#: query words that never distinguish a fact (question words, function words, "latest")
GENERIC_WORDS = frozenset("""
what which who whom whose when where why how was were is are be been being the a an of in on at for to from by with
and or did does do has have had there their its it this that these those as about than value values number
latest current recent most newest last currently recorded reported report according give tell me please much many
during day date month year week time level levels amount total like will would going expected predicted observed
actual measured get got see show shows find know look looks be can could should say says said new old
next previous prior coming upcoming this forecast forecasts outlook outlooks prediction predictions estimate estimates
""".split())
_WORD = re.compile(r"[^\W\d_][^\W_]*(?:['’][a-z]+)?")
_SENT = re.compile(r"[^.!?]*(?:[.!?](?!\d)|$)")


def _word_re(phrase: str) -> re.Pattern:
    return re.compile(r"(?<!\w)" + re.escape(normalize_text(phrase)) + r"(?!\w)")


class RuleExtractor:
    """The LLM-free extractor of design notes §3.5.

    * **relation**: the metric of the query from ``metrics`` (``{name: (keywords, "number"|"category")}``,
      the longest keyword found wins) or, when none is found, the query's normalised text (all candidates
      answer the same question).
    * **head**: the query's entity from the alias table (``{canonical: [aliases]}``, whole-word,
      case-insensitive, merged over :data:`DEFAULT_ALIASES` unless ``default_aliases=False``); a candidate
      that mentions none of its aliases states NULL. A query naming no known entity gives every candidate
      the head ``""`` when ``require_entity=False`` (default True: all NULL, nothing removed).
    * **time**: a candidate's *content dates* are the dates its text names (:func:`date_parts`;
      today/tomorrow/yesterday resolved against its ``published``), less those equal to its ``published``
      date when it names others ("issued March 3" does not make a forecast for March 6 a March 3
      document). When the query names a date (its first date span: a day, a month or a year), a candidate
      addresses it only if one of its content dates names the same parts (a March 5 document answers a
      "March 2014" question, a "March 2014" document does not answer a "March 5, 2014" one); otherwise NULL.
      With ``qualify_by_date`` (default) the relation is qualified by the candidate's (matching, else
      first) content date — ``"temp_max @ 2014-03-05"`` — so documents about different days are different
      facts and only versions of one day's value compete (a candidate naming no date keeps the bare
      relation).
    * **terms**: with ``match_terms`` (default) and a metric found, a candidate must also contain every
      distinguishing word of the query — its words of three letters or more that are not entity aliases, metric keywords, month or
      weekday names, categorical values or :data:`GENERIC_WORDS` (e.g. "government" in "employment in
      government in the United States in 08/2014") — else it is NULL: attribute siblings (another
      series of the same entity and metric) are not versions of the asked fact.
    * **value**: for a metric, the first number (with its unit) after one of its keywords in the
      candidate, or the first categorical word (``categories``, canonicalised) for categorical metrics;
      otherwise the span that differs between the candidates sharing the head: their numbers with units
      and categorical words (dates masked out), the positions where they disagree; when a candidate has
      no such item, the sentence containing the head. No match ⇒ NULL."""

    def __init__(self, aliases: Optional[Mapping[str, Sequence[str]]] = None, *,
                 metrics: Optional[Mapping[str, Tuple[Sequence[str], str]]] = None,
                 categories: Optional[Mapping[str, str]] = None, default_aliases: bool = True,
                 require_entity: bool = True, match_time: bool = True, qualify_by_date: bool = True,
                 match_terms: bool = True, window: int = 40):
        al = {k: list(v) for k, v in DEFAULT_ALIASES.items()} if default_aliases else {}
        for k, v in (aliases or {}).items():
            if isinstance(v, str) or not all(isinstance(a, str) for a in v):
                raise TypeError(f"aliases[{k!r}] must be a list of strings")
            al.setdefault(k, [])
            al[k] = list(dict.fromkeys(list(al[k]) + [k] + list(v)))
        self.aliases = {k: [_word_re(a) for a in (list(v) + [k])] for k, v in al.items()}
        ms = dict(DEFAULT_METRICS)
        for k, v in (metrics or {}).items():
            if not (isinstance(v, (tuple, list)) and len(v) == 2 and v[1] in ("number", "category")):
                raise ValueError(f"metrics[{k!r}] must be (keywords, 'number'|'category'), got {v!r}")
            ms[k] = (list(v[0]), v[1])
        self.metrics = {k: ([(_word_re(w), len(w)) for w in kw], kind) for k, (kw, kind) in ms.items()}
        self.categories = {normalize_text(k): v for k, v in {**DEFAULT_CATEGORIES, **(categories or {})}.items()}
        self._cat_re = re.compile(r"(?<!\w)(" + "|".join(sorted(map(re.escape, self.categories), key=len,
                                                                 reverse=True)) + r")(?!\w)")
        self.require_entity, self.match_time, self.window = require_entity, match_time, int(window)
        self.qualify_by_date, self.match_terms = qualify_by_date, match_terms
        self._known_words = set(GENERIC_WORDS) | set(_MONTHS) | {"monday", "tuesday", "wednesday", "thursday",
                                                                  "friday", "saturday", "sunday"}
        for kws, _ in self.metrics.values():
            for p, _ in kws:
                self._known_words.update(_WORD.findall(p.pattern.replace("\\", "")))
        for pats in self.aliases.values():
            for p in pats:
                self._known_words.update(_WORD.findall(p.pattern.replace("\\", "")))

    # -- query analysis
    def _entities(self, text: str) -> List[str]:
        found = []
        for canon, pats in self.aliases.items():
            pos = [m.start() for p in pats for m in p.finditer(text)]
            if pos:
                found.append((min(pos), canon))
        return [c for _, c in sorted(found)]

    def _metric(self, text: str) -> Optional[str]:
        best = None
        for name, (kws, _) in self.metrics.items():
            for p, ln in kws:
                if p.search(text) and (best is None or ln > best[0]):
                    best = (ln, name)
        return best[1] if best else None

    def _masked(self, text: str, ref) -> Tuple[str, List[DateParts]]:
        """Normalised text with date spans blanked, and the date parts of the spans (text order)."""
        spans = date_parts(text, ref=ref)
        chars = list(text)
        for s, e, _ in spans:
            chars[s:e] = " " * (e - s)
        return "".join(chars), [p for _, _, p in spans if p != (None, None, None)]

    def _items(self, masked: str) -> List[str]:
        items = []
        for m in sorted(list(_NUM_IN_TEXT.finditer(masked)) + list(self._cat_re.finditer(masked)),
                        key=lambda m: m.start()):
            if m.re is self._cat_re:
                items.append(self.categories[m.group(1)])
            else:
                items.append(m.group(0).strip())
        return items

    def _metric_value(self, masked: str, metric: str) -> Optional[str]:
        kws, kind = self.metrics[metric]
        hits = sorted((m.end(), ln) for p, ln in kws for m in p.finditer(masked))
        for end, _ in hits:
            span = masked[end:end + self.window]
            if kind == "number":
                m = _NUM_IN_TEXT.search(span)
                if m:
                    return m.group(0).strip()
            else:
                m = self._cat_re.search(span)
                if m:
                    return self.categories[m.group(1)]
        if kind == "category":
            m = self._cat_re.search(masked)
            if m:
                return self.categories[m.group(1)]
        return None

    def __call__(self, query: str, docs: Sequence[Candidate]) -> List[Fact]:
        qn = normalize_text(query)
        ents = self._entities(qn)
        metric = self._metric(qn)
        relation = metric if metric is not None else qn
        qmasked, qdates = self._masked(qn, None)
        qdate = qdates[0] if (self.match_time and qdates) else None
        words = [re.split(r"['’]", w)[0] for w in _WORD.findall(qmasked)]   # possessives: seattle's -> seattle
        terms = [w for w in dict.fromkeys(words) if len(w) > 2 and w not in self._known_words
                 and w not in self.categories] if (self.match_terms and metric is not None) else []
        term_res = [re.compile(r"(?<!\w)" + re.escape(w.rstrip("s") if len(w) > 4 else w)) for w in terms]
        if not ents and self.require_entity:
            return [Fact(i, None, relation, None) for i in range(len(docs))]
        head = ents[0] if ents else ""
        pats = self.aliases.get(head, [])
        facts: List[Fact] = []
        pending: List[Tuple[int, List[str], str, str]] = []
        for i, d in enumerate(docs):
            text = normalize_text(d.text)
            hm = None
            if pats:
                hm = min((m for p in pats for m in [p.search(text)] if m), key=lambda m: m.start(), default=None)
                if hm is None:
                    facts.append(Fact(i, head, relation, None))
                    continue
            if any(not t.search(text) for t in term_res):    # it does not mention what the query asks about
                facts.append(Fact(i, head, relation, None))
                continue
            masked, dparts = self._masked(text, d.published)
            pub = (d.published.year, d.published.month, d.published.day) if d.published is not None else None
            content = [p for p in dparts if p != pub] or dparts       # the publication date names no content
            if qdate is not None:
                content = [p for p in content if _covers(p, qdate)]
                if not content:
                    facts.append(Fact(i, head, relation, None))
                    continue
            rel = relation
            if self.qualify_by_date and content:
                rel = f"{relation} @ {_parts_key(content[0])}"
            if metric is not None:
                v = self._metric_value(masked, metric)
                if v is not None:
                    facts.append(Fact(i, head, rel, v))
                    continue
            pos = hm.start() if hm is not None else 0
            sent = next((m.group(0) for m in _SENT.finditer(text) if m.start() <= pos < max(m.end(), m.start() + 1)),
                        text)
            pending.append((i, self._items(masked), normalize_text(sent), rel))
        # the span that differs between the candidates sharing the head
        if pending:
            lens = {len(it) for _, it, _, _ in pending}
            same_len = len(lens) == 1
            diff = set()
            if same_len:
                n = lens.pop()
                diff = {k for k in range(n) if len({it[k] for _, it, _, _ in pending}) > 1}
            for i, it, sent, rel in pending:
                if not it:
                    v = sent
                elif same_len and diff:
                    v = "; ".join(it[k] for k in sorted(diff))
                else:
                    v = "; ".join(it)
                facts.append(Fact(i, head, rel, v or None))
        facts.sort(key=lambda f: f.doc_index)
        return facts


# ---- LLMExtractor ----------------------------------------------------------------------------------------

_PROMPT = """You are given a question and {n} retrieved documents, each with its publication date. \
Documents may describe the same fact at different times; newer documents may update older ones.

For EACH document, extract the single fact it states that answers the question, as a triple:
- "head": the entity the question is about, written in one normalised form shared by all documents \
(e.g. "NYC" and "New York City" are the same entity: use one name for both);
- "relation": the attribute or relation asked about, written identically for documents that address the \
same attribute;
- "value": the value the document states for it, copied as written (numbers with their units); \
"NULL" if the document does not address the question.

Question: {query}

Documents:
{docs}

Answer with a JSON array only, one object per document, in document order:
[{{"doc_index": 0, "head": "...", "relation": "...", "value": "..."}}, ...]"""


def build_prompt(query: str, docs: Sequence[Candidate], *, max_chars: Optional[int] = None) -> str:
    """The listwise fact-extraction prompt (after Re³'s Fig. 10): the question, then each candidate as
    ``[i] (published YYYY-MM-DD) text`` (``unknown`` when it has no date), then the JSON format. ``max_chars``
    truncates each document's text."""
    lines = []
    for i, d in enumerate(docs):
        t = " ".join(str(d.text).split())
        if max_chars is not None and len(t) > max_chars:
            t = t[:max_chars] + " ..."
        pub = d.published.isoformat() if d.published is not None else "unknown"
        lines.append(f"[{i}] (published {pub}) {t}")
    return _PROMPT.format(n=len(docs), query=" ".join(query.split()), docs="\n".join(lines))


_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*\n?(.*?)(?:```|$)", re.S)


def _json_items(text: str) -> Tuple[List[Any], List[str]]:
    """Objects of the first JSON array (or object) in ``text``: code fences stripped, trailing text
    ignored, a truncated array read up to its last complete object."""
    notes: List[str] = []
    m = _FENCE.search(text)
    if m:
        text = m.group(1)
    dec = json.JSONDecoder()
    a, o = text.find("["), text.find("{")
    if a < 0 and o < 0:
        raise ExtractionError("no JSON array or object in the output")
    if a >= 0 and (o < 0 or a < o):
        try:
            val, _ = dec.raw_decode(text, a)
            if isinstance(val, list):
                return val, notes
        except json.JSONDecodeError:
            pass
        # truncated (or broken) array: read objects one by one
        items, pos = [], a + 1
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] == "]":
                break
            try:
                val, pos = dec.raw_decode(text, pos)
            except json.JSONDecodeError:
                notes.append(f"output truncated or broken after {len(items)} complete item(s); the rest is ignored")
                break
            items.append(val)
        if not items:
            raise ExtractionError("the output's JSON array has no complete item")
        return items, notes
    try:
        val, _ = dec.raw_decode(text, o)
    except json.JSONDecodeError as e:
        raise ExtractionError(f"invalid JSON in the output ({e.msg})") from None
    if isinstance(val, dict):
        for k in ("facts", "documents", "results", "items"):
            if isinstance(val.get(k), list):
                return val[k], notes
        return [val], notes
    raise ExtractionError("no JSON array in the output")


def parse_facts_json(text: str, n: int) -> Extraction:
    """Facts from an LLM's answer to :func:`build_prompt` for ``n`` documents. Tolerates code fences,
    text before/after the JSON, a truncated array (complete objects are kept), ``"NULL"``/null values,
    numeric values and string indices. Items with a missing or out-of-range ``doc_index``, a duplicate
    index (the first wins) or no head/relation are ignored with a note; documents without an item state
    NULL. Raises :class:`ExtractionError` when no JSON can be read at all."""
    if not isinstance(text, str):
        raise ExtractionError(f"generate returned {type(text).__name__}, expected str")
    items, notes = _json_items(text)
    facts: List[Fact] = []
    seen = set()
    for j, it in enumerate(items):
        if not isinstance(it, Mapping):
            notes.append(f"item {j} is not an object; ignored")
            continue
        idx = it.get("doc_index", it.get("index", it.get("doc")))
        if isinstance(idx, str) and idx.strip().lstrip("[").rstrip("]").isdigit():
            idx = int(idx.strip().lstrip("[").rstrip("]"))
        if isinstance(idx, float) and idx.is_integer():
            idx = int(idx)
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
            notes.append(f"item {j}: doc_index {idx!r} is not in [0, {n}); ignored")
            continue
        if idx in seen:
            notes.append(f"item {j}: duplicate doc_index {idx}; ignored")
            continue
        value = _value_or_null(it.get("value"))
        head, rel = it.get("head"), it.get("relation")
        if value is not None and (not isinstance(head, str) or not isinstance(rel, str)):
            notes.append(f"item {j} (doc_index {idx}): head/relation missing or not strings; ignored")
            continue
        seen.add(idx)
        facts.append(Fact(idx, head if isinstance(head, str) else None, rel if isinstance(rel, str) else None,
                          value))
    missing = [i for i in range(n) if i not in seen]
    if missing:
        notes.append(f"no fact for document(s) {missing}: NULL (kept)")
    return Extraction(facts, notes)


class LLMExtractor:
    """Listwise fact extraction with a user-supplied model: ``generate(prompt) -> text`` (any LLM client;
    tempokern ships and downloads no model). One call per query over all candidates (the paper's design),
    prompt from :func:`build_prompt`, answer parsed by :func:`parse_facts_json`; the call's problems are
    returned as notes (they end up in ``FilterResult.reasons``). ``max_chars`` truncates each document in
    the prompt."""

    def __init__(self, generate: Callable[[str], str], *, max_chars: Optional[int] = 2000):
        if not callable(generate):
            raise TypeError("generate must be callable: prompt (str) -> completion (str)")
        self.generate, self.max_chars = generate, max_chars
        self.last_prompt: Optional[str] = None
        self.last_output: Optional[str] = None

    def __call__(self, query: str, docs: Sequence[Candidate]) -> Extraction:
        prompt = build_prompt(query, docs, max_chars=self.max_chars)
        self.last_prompt = prompt
        out = self.generate(prompt)
        self.last_output = out
        return parse_facts_json(out, len(docs))
