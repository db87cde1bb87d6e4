"""Re³ time tuples and the rule-based time parser (Re³ §3.2, design notes §3.4).

``TimeTuple(year, month, day, mask)``: a possibly partial date; ``mask = (v_y, v_m, v_dom)`` says which parts
are observed (masked parts hold 0). ``doy`` (1-based day of year) exists only when all three are observed
and the date is real.

``parse_time(text, *, ref=None)`` finds the *first* temporal expression of ``text`` (by position; at one
position the longest expression) and returns its :class:`TimeTuple`, or ``None`` when the text has none.
Covered: every surface form of :data:`tempokern.text.dates.DATE_FORMATS` and more —

- numeric: ISO ``2014-03-07`` (also ``2014/03/07``, ``2014-03-07T10:00``), US ``03/07/2014`` and
  ``3/7/2014`` (read as month/day; day/month when the first number exceeds 12), ``07.03.2014`` (day.month),
  ``2014-03``, ``03/2014``;
- named: ``March 7, 2014``, ``7 March 2014``, ``Mar. 7, 2014``, ``Sept 7 2014``, ``March 7th, 2014``, ``the
  7th of March 2014``, weekday prefixes (``Friday, March 7, 2014``; the weekday is not checked), ``March
  2014``, ``March of 2014``, ``the third month of 2014``, ``early/mid/late March 2014``, ``end of March 2014``;
- partial: ``March 7`` (no year: year masked), ``May``/``in early May`` (month only; the bare name must be
  capitalised, and ``May`` needs a preposition before it or punctuation/end after it, so the verb "may"
  and "May I" are not months), a year alone (1000-2199, not when it reads as a quantity: ``$2014``,
  ``2014 people``, ``2014.5``, ``2,014``, ``2014%``), decades (``the 1990s`` -> 1995, ``the '90s`` -> 1995,
  month/day masked), seasons (``spring 2016`` -> the year only; ``season_months=True`` adds the season's
  middle month);
- relative, resolved against ``ref`` (a document's publication date): ``today``, ``yesterday``,
  ``tomorrow``, ``the day before yesterday``, ``N days/weeks ago`` (digits or number words), ``a week
  ago``, ``last/next <weekday>`` (1-7 days before/after ``ref``, never ``ref`` itself), ``last/this/next
  month``, ``last/this/next year``. Without ``ref`` a relative expression is not resolved: it is skipped
  when a resolvable expression follows it, and if none does the result is the empty tuple (mask 0);
- ranges (``March 3-5, 2014``, ``3 to 5 March 2014``, ``from March 3 to April 5, 2014``, ``2010-2015``)
  give their start; two separate dates: the first wins. :func:`find_times` gives every expression of a
  text, ranges as intervals (start and end).

An impossible day (``29 February 2023``, ``02/30/2014``) keeps year and month and masks the day (B4).
"""
from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from ..limits import YEAR_MAX, YEAR_MIN, cap_text
from .dates import MONTHS, NUMBER_WORDS, ORDINAL_WORDS, SEASONS, WEEKDAYS


@dataclass(frozen=True)
class TimeTuple:
    """A possibly partial date: ``year``, ``month``, ``day`` and ``mask = (v_y, v_m, v_dom)``.

    Masked parts are stored as 0. ``doy`` is the 1-based day of the year when all three parts are observed
    (0 otherwise)."""

    year: int = 0
    month: int = 0
    day: int = 0
    mask: Tuple[bool, bool, bool] = (False, False, False)

    def __post_init__(self):
        mask = tuple(bool(v) for v in self.mask)
        if len(mask) != 3:
            raise ValueError(f"mask: expected 3 bools (v_y, v_m, v_dom), got {self.mask!r}")
        object.__setattr__(self, "mask", mask)
        for nm in ("year", "month", "day"):
            v = getattr(self, nm)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{nm}: expected int, got {type(v).__name__}")
        vy, vm, vd = mask
        y, m, d = (self.year if vy else 0), (self.month if vm else 0), (self.day if vd else 0)
        if vy and not YEAR_MIN <= y <= YEAR_MAX:
            raise ValueError(f"year: {y} outside {YEAR_MIN}..{YEAR_MAX}")
        if vm and not 1 <= m <= 12:
            raise ValueError(f"month: {m} outside 1..12")
        if vd and not 1 <= d <= 31:
            raise ValueError(f"day: {d} outside 1..31")
        if vy and vm and vd:
            try:
                _dt.date(y, m, d)
            except ValueError:
                raise ValueError(f"day: {y:04d}-{m:02d}-{d:02d} is not a real date (mask the day instead)") from None
        object.__setattr__(self, "year", y)
        object.__setattr__(self, "month", m)
        object.__setattr__(self, "day", d)

    # ---- constructors ------------------------------------------------------------------------------------
    @classmethod
    def from_date(cls, date: _dt.date) -> "TimeTuple":
        if isinstance(date, _dt.datetime):
            date = date.date()
        if not isinstance(date, _dt.date):
            raise TypeError(f"date: expected datetime.date, got {type(date).__name__}")
        return cls(date.year, date.month, date.day, (True, True, True))

    @classmethod
    def partial(cls, year: Optional[int] = None, month: Optional[int] = None,
                day: Optional[int] = None) -> "TimeTuple":
        """Observed parts given, the others ``None``; an impossible full date masks its day (B4)."""
        if year is not None and month is not None and day is not None:
            try:
                _dt.date(year, month, day)
            except ValueError:
                day = None
        return cls(year or 0, month or 0, day or 0, (year is not None, month is not None, day is not None))

    @classmethod
    def empty(cls) -> "TimeTuple":
        return cls()

    # ---- views -------------------------------------------------------------------------------------------
    @property
    def is_empty(self) -> bool:
        return not any(self.mask)

    @property
    def is_complete(self) -> bool:
        return all(self.mask)

    @property
    def doy(self) -> int:
        if not self.is_complete:
            return 0
        return _dt.date(self.year, self.month, self.day).timetuple().tm_yday

    def parts(self) -> Tuple[Optional[int], Optional[int], Optional[int]]:
        """``(year, month, day)`` with ``None`` for masked parts."""
        return tuple(v if b else None for v, b in zip((self.year, self.month, self.day), self.mask))

    def to_date(self) -> _dt.date:
        if not self.is_complete:
            raise ValueError(f"TimeTuple {self} is partial; to_date needs year, month and day")
        return _dt.date(self.year, self.month, self.day)

    def to_interval(self, calendar):
        """The calendar interval this time covers (a day, a month or a year), or ``None`` when the year is
        unknown (a month or a day without a year names no single interval). Raises ``KeyError`` when the
        period lies outside the calendar."""
        vy, vm, vd = self.mask
        if not vy:
            return None
        if vm and vd:
            key = (self.year, self.month, self.day)
        elif vm:
            key = (self.year, self.month)
        else:
            key = (self.year,)
        if len(key) > calendar.num_levels:
            key = key[:calendar.num_levels]
        return calendar.span(key)

    def values(self) -> Tuple[int, int, int, int]:
        """``(y, m, dom, doy)`` (masked parts 0)."""
        return (self.year, self.month, self.day, self.doy)

    def mask4(self) -> Tuple[bool, bool, bool, bool]:
        """``(v_y, v_m, v_dom, Exist_doy)`` with ``Exist_doy = v_y and v_m and v_dom``."""
        return (*self.mask, self.is_complete)

    def __str__(self) -> str:
        y, m, d = self.parts()
        return "{}-{}-{}".format("????" if y is None else f"{y:04d}", "??" if m is None else f"{m:02d}",
                                 "??" if d is None else f"{d:02d}")

    # ---- batched tensor form -----------------------------------------------------------------------------
    @staticmethod
    def batch(times: Sequence[Optional["TimeTuple"]], device=None):
        """``(values (B, 4) int64: y, m, dom, doy; mask (B, 4) bool: v_y, v_m, v_dom, Exist_doy)``;
        ``None`` entries are all-masked rows."""
        import torch
        vals, masks = [], []
        for i, t in enumerate(times):
            if t is None:
                t = TimeTuple()
            elif not isinstance(t, TimeTuple):
                raise TypeError(f"times[{i}]: expected TimeTuple or None, got {type(t).__name__}")
            vals.append(t.values())
            masks.append(t.mask4())
        v = torch.tensor(vals, dtype=torch.int64, device=device).reshape(len(vals), 4)
        m = torch.tensor(masks, dtype=torch.bool, device=device).reshape(len(masks), 4)
        return v, m

    @staticmethod
    def unbatch(values, mask) -> List["TimeTuple"]:
        out = []
        for (y, m, d, _), (vy, vm, vd, _) in zip(values.tolist(), mask.tolist()):
            out.append(TimeTuple(int(y), int(m), int(d), (vy, vm, vd)))
        return out


# ================================================================================================ parser
_MONTH_NAMES = {n.lower(): i + 1 for i, n in enumerate(MONTHS)}
_MONTH_ABBR = {"jan": 1, "feb": 2, "mar": 3, "apr": 4, "jun": 6, "jul": 7, "aug": 8, "sep": 9, "sept": 9,
               "oct": 10, "nov": 11, "dec": 12}
_WEEKDAY = {n.lower(): i for i, n in enumerate(WEEKDAYS)}
_NUMWORD = {w: i for i, w in enumerate(NUMBER_WORDS)}
_NUMWORD.update({"a": 1, "an": 1, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
                 "twenty": 20, "thirty": 30})
_ORDWORD = {w: i + 1 for i, w in enumerate(ORDINAL_WORDS)}

# month name (full or abbreviated, optional dot); ``(?i:...)`` keeps case-insensitivity local
_MON = r"(?P<{g}>(?i:january|february|march|april|may|june|july|august|september|october|november|december" \
       r"|jan|feb|mar|apr|jun|jul|aug|sept|sep|oct|nov|dec)\b\.?)"
_DAY = r"(?P<{g}>[12][0-9]|3[01]|0?[1-9])(?i:st|nd|rd|th)?"
_YEAR = r"(?P<{g}>[12][0-9]{{3}})"
_WD = r"(?:(?i:monday|tuesday|wednesday|thursday|friday|saturday|sunday|mon|tue|tues|wed|thu|thur|thurs|fri|sat|sun)\b\.?,?\s+)?"
_RANGE_SEP = r"\s*(?:-|–|—|(?i:to|until|till|through|thru|and))\s*"
_END = r"(?![0-9])"
# the separator before a year: a comma or not, spaces after it; also a space before the comma, as tokenised text
# (TimeQA: "November 15 , 1988", "15 November , 1988") writes it
_COMMA = r"(?:\s*,\s*|\s+)"
_BEG = r"(?<![0-9A-Za-z$€£#.,/-])"


def _mon(g="mon"):
    return _MON.format(g=g)


def _day(g="day"):
    return _DAY.format(g=g)


def _year(g="year"):
    return _YEAR.format(g=g)


def _month_of(s: str) -> int:
    s = s.lower().rstrip(".")
    return _MONTH_NAMES.get(s) or _MONTH_ABBR[s]


def _num(s: str) -> int:
    s = s.lower()
    return int(s) if s.isdigit() else _NUMWORD[s]


class _Unresolved:
    """A relative expression met without ``ref``."""


_UNRESOLVED = _Unresolved()
_PREP_BEFORE_MAY = re.compile(r"(?i:\b(?:in|on|during|early|mid|late|of|by|until|till|since|from|through|"
                              r"this|last|next|before|after|throughout|end|beginning|start)[\s-]+)$")
_CTX = 64   # characters a rule looks at before / after its match
_QUANTITY_AFTER = re.compile(
    r"\s*(?:%|°|percent\b|(?i:people|persons|men|women|children|students|employees|workers|jobs|units|cars|"
    r"vehicles|houses|homes|km|kilometers|kilometres|miles|meters|metres|m|ft|feet|kg|tons|tonnes|pounds|lbs|"
    r"dollars|euros|usd|points|votes|copies|items|pages|words|calories|hpa|mb|mm|cm|inches|in\.|"
    r"degrees|times|cases|deaths|visitors|tickets|shares|barrels|acres|hectares)\b)")


def _check_ref(ref):
    if ref is None:
        return None
    if isinstance(ref, _dt.datetime):
        return ref.date()
    if isinstance(ref, _dt.date):
        return ref
    if isinstance(ref, TimeTuple):
        return ref.to_date()
    if isinstance(ref, str):
        try:
            return _dt.date.fromisoformat(ref[:10])
        except ValueError:
            raise ValueError(f"ref: {ref!r} is not an ISO date") from None
    raise TypeError(f"ref: expected datetime.date, ISO string or None, got {type(ref).__name__}")


def _day_tuple(y, m, d):
    return TimeTuple.partial(y, m, d)


# each rule: (compiled regex, handler(match, text, ref, opts) -> TimeTuple | _UNRESOLVED | None (reject))
_RULES: List[Tuple[re.Pattern, Callable]] = []


def _rule(pattern: str):
    rx = re.compile(pattern)

    def deco(fn):
        _RULES.append((rx, fn))
        return fn
    return deco


# ---- numeric -----------------------------------------------------------------------------------------------
@_rule(_BEG + r"(?P<year>[12][0-9]{3})[-/](?P<mon>0?[1-9]|1[0-2])[-/](?P<day>[0-3]?[0-9])" + _END)
def _iso(m, text, ref, opts):
    d = int(m["day"])
    if not 1 <= d <= 31:
        return None
    return _day_tuple(int(m["year"]), int(m["mon"]), d)


@_rule(_BEG + r"(?P<a>[0-3]?[0-9])/(?P<b>[0-3]?[0-9])/(?P<year>[12][0-9]{3})" + _END)
def _slash(m, text, ref, opts):
    a, b, y = int(m["a"]), int(m["b"]), int(m["year"])
    if 1 <= a <= 12 and 1 <= b <= 31:
        return _day_tuple(y, a, b)
    if 1 <= b <= 12 and 13 <= a <= 31:
        return _day_tuple(y, b, a)
    return None


@_rule(_BEG + r"(?P<day>[0-3]?[0-9])\.(?P<mon>0?[1-9]|1[0-2])\.(?P<year>[12][0-9]{3})" + _END)
def _dots(m, text, ref, opts):
    d = int(m["day"])
    return _day_tuple(int(m["year"]), int(m["mon"]), d) if 1 <= d <= 31 else None


@_rule(_BEG + r"(?P<year>[12][0-9]{3})-(?P<mon>0[1-9]|1[0-2])(?![0-9]|-[0-9])")
def _yyyy_mm(m, text, ref, opts):
    return TimeTuple.partial(int(m["year"]), int(m["mon"]))


@_rule(_BEG + r"(?P<mon>0?[1-9]|1[0-2])/(?P<year>[12][0-9]{3})" + _END)
def _mm_yyyy(m, text, ref, opts):
    return TimeTuple.partial(int(m["year"]), int(m["mon"]))


# ---- named months ------------------------------------------------------------------------------------------
@_rule(r"\b" + _WD + _mon() + r"\s+" + _day() + r"(?:" + _RANGE_SEP + r"(?:" + _mon("mon2") + r"\s+)?"
       + _day("day2") + r")?\b" + _COMMA + r"(?:(?i:of)\s+)?" + _year() + _END)
def _mon_d_yyyy(m, text, ref, opts):
    return _day_tuple(int(m["year"]), _month_of(m["mon"]), int(m["day"]))


@_rule(r"\b" + _WD + r"(?:(?i:the)\s+)?" + _day() + r"(?:" + _RANGE_SEP + r"(?:(?i:the)\s+)?" + _day("day2")
       + r")?\s+(?:(?i:of)\s+)?" + _mon() + _COMMA + _year() + _END)
def _d_mon_yyyy(m, text, ref, opts):
    return _day_tuple(int(m["year"]), _month_of(m["mon"]), int(m["day"]))


@_rule(r"\b" + _WD + _mon() + r"\s+" + _day() + r"(?![0-9:])")
def _mon_d(m, text, ref, opts):
    if m["mon"][0].islower() and m["mon"].lower().startswith("may"):
        return None
    return TimeTuple.partial(None, _month_of(m["mon"]), int(m["day"]))


@_rule(r"\b" + _WD + r"(?:(?i:the)\s+)?" + _day() + r"\s+(?:(?i:of)\s+)?" + _mon())
def _d_mon(m, text, ref, opts):
    if m["mon"][0].islower() and m["mon"].lower().startswith("may"):
        return None
    return TimeTuple.partial(None, _month_of(m["mon"]), int(m["day"]))


@_rule(r"\b(?:(?P<part>(?i:early|mid|late|end\s+of|the\s+end\s+of|beginning\s+of|the\s+beginning\s+of|"
       r"the\s+start\s+of|start\s+of))[\s-]+)?" + _mon() + _COMMA + r"(?:(?i:of)\s+)?" + _year() + _END)
def _mon_yyyy(m, text, ref, opts):
    return TimeTuple.partial(int(m["year"]), _month_of(m["mon"]))


@_rule(r"\b(?i:the)\s+(?P<ord>(?i:" + "|".join(ORDINAL_WORDS) + r"))\s+(?i:month)\s+(?i:of)\s+" + _year() + _END)
def _nth_month(m, text, ref, opts):
    return TimeTuple.partial(int(m["year"]), _ORDWORD[m["ord"].lower()])


@_rule(r"\b(?:(?P<part>(?i:early|mid|late))[\s-]+)?(?P<mon>January|February|March|April|May|June|July|August|"
       r"September|October|November|December|Jan\.|Feb\.|Mar\.|Apr\.|Jun\.|Jul\.|Aug\.|Sept\.|Sep\.|Oct\.|"
       r"Nov\.|Dec\.)(?![A-Za-z])")
def _bare_month(m, text, ref, opts):
    name = m["mon"]
    if name == "May" and m["part"] is None:
        before = text[max(0, m.start() - _CTX):m.start()]   # windows: linear in the text, not quadratic
        after = text[m.end():m.end() + _CTX]
        if not (_PREP_BEFORE_MAY.search(before) or re.match(r"\s*(?:[,.;:!?)]|$)", after)):
            return None
    return TimeTuple.partial(None, _month_of(name))


# ---- years, decades, seasons -------------------------------------------------------------------------------
@_rule(r"(?<![0-9A-Za-z])(?:(?i:the)\s+)?(?:(?P<dec>[12][0-9]{2})0s|'(?P<short>[0-9])0s)\b")
def _decade(m, text, ref, opts):
    if m["dec"]:
        return TimeTuple.partial(int(m["dec"]) * 10 + 5)
    return TimeTuple.partial(1900 + int(m["short"]) * 10 + 5)


@_rule(r"\b(?P<season>(?i:spring|summer|autumn|fall|winter))(?:\s+(?i:of))?\s+" + _year() + _END)
def _season(m, text, ref, opts):
    y = int(m["year"])
    if opts.get("season_months"):
        return TimeTuple.partial(y, SEASONS[m["season"].lower()])
    return TimeTuple.partial(y)


@_rule(r"(?<![0-9A-Za-z$€£#.,/'-])(?P<year>1[0-9]{3}|20[0-9]{2}|21[0-9]{2})(?![0-9]|[.,][0-9]|s\b)")
def _year_alone(m, text, ref, opts):
    after = text[m.end():m.end() + _CTX]
    if _QUANTITY_AFTER.match(after):
        return None
    if re.match(r"\s*:[0-9]", after) or re.search(r"[0-9][,.:]\s?$|[0-9]\s$", text[max(0, m.start() - 4):m.start()]):
        return None
    return TimeTuple.partial(int(m["year"]))


# ---- relative ----------------------------------------------------------------------------------------------
def _rel(ref, days):
    """The day `days` after `ref`; None (no date) where that falls outside YEAR_MIN..YEAR_MAX ("tomorrow" in a
    document dated 9999-12-31)."""
    if ref is None:
        return _UNRESOLVED
    try:
        return TimeTuple.from_date(ref + _dt.timedelta(days=days))
    except OverflowError:
        return None


@_rule(r"\b(?i:the\s+day\s+before\s+yesterday)\b")
def _day_before_yesterday(m, text, ref, opts):
    return _rel(ref, -2)


@_rule(r"\b(?i:the\s+day\s+after\s+tomorrow)\b")
def _day_after_tomorrow(m, text, ref, opts):
    return _rel(ref, 2)


@_rule(r"\b(?P<w>(?i:today|yesterday|tomorrow|tonight))\b")
def _today(m, text, ref, opts):
    return _rel(ref, {"today": 0, "tonight": 0, "yesterday": -1, "tomorrow": 1}[m["w"].lower()])


@_rule(r"\b(?P<n>[0-9]{1,3}|(?i:a|an|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|"
       r"thirteen|fourteen|fifteen|twenty|thirty))\s+(?P<unit>(?i:days?|weeks?))\s+(?P<dir>(?i:ago|later|"
       r"from\s+now|earlier|before|after))\b")
def _n_ago(m, text, ref, opts):
    n = _num(m["n"]) * (7 if m["unit"].lower().startswith("week") else 1)
    d = m["dir"].lower()
    if d in ("before", "after"):  # "three days before the election": no anchor
        return None
    return _rel(ref, -n if d in ("ago", "earlier") else n)


@_rule(r"\b(?P<dir>(?i:last|next|this|past|coming))\s+(?P<wd>(?i:monday|tuesday|wednesday|thursday|friday|"
       r"saturday|sunday))\b")
def _last_wd(m, text, ref, opts):
    if ref is None:
        return _UNRESOLVED
    wd = _WEEKDAY[m["wd"].lower()]
    d = m["dir"].lower()
    if d in ("last", "past"):
        back = (ref.weekday() - wd) % 7 or 7
        return _rel(ref, -back)
    fwd = (wd - ref.weekday()) % 7
    if d in ("next", "coming"):
        return _rel(ref, fwd or 7)
    return _rel(ref, fwd)  # "this Friday": ref itself or the next one


@_rule(r"\b(?P<dir>(?i:last|this|next|past))\s+(?P<unit>(?i:month|year))\b")
def _last_month(m, text, ref, opts):
    if ref is None:
        return _UNRESOLVED
    step = {"last": -1, "past": -1, "this": 0, "next": 1}[m["dir"].lower()]
    if m["unit"].lower() == "year":
        y, mo = ref.year + step, None
    else:
        k = ref.year * 12 + (ref.month - 1) + step
        y, mo = k // 12, k % 12 + 1
    if not YEAR_MIN <= y <= YEAR_MAX:   # "next year" of 9999, "last year" of year 1: no date
        return None
    return TimeTuple.partial(y, mo)


def _candidates(text: str):
    """All rule matches as (start, -length, rule order, match, handler), in reading order, in the first
    MAX_TEXT_CHARS characters (tempokern.limits)."""
    text = cap_text(text)
    out = []
    for order, (rx, fn) in enumerate(_RULES):
        for m in rx.finditer(text):
            if m.end() > m.start():
                out.append((m.start(), -(m.end() - m.start()), order, m, fn))
    out.sort(key=lambda c: c[:3])
    return out


def _parse_rules(text: str, ref, opts, *, with_span: bool = False):
    unresolved = None
    for start, _, _, m, fn in _candidates(text):
        r = fn(m, text, ref, opts)
        if r is None:
            continue
        if r is _UNRESOLVED:
            unresolved = unresolved or (m.start(), m.end())
            continue
        return (r, (m.start(), m.end())) if with_span else r
    if unresolved is not None:
        return (TimeTuple(), unresolved) if with_span else TimeTuple()
    return (None, None) if with_span else None


def parse_time(text: str, *, ref=None, backend: str = "rules", season_months: bool = False) -> Optional[TimeTuple]:
    """The first temporal expression of ``text`` as a :class:`TimeTuple` (None when there is none).

    ``ref``: the reference date for relative expressions (``datetime.date``/``datetime``, ISO string or a
    complete ``TimeTuple``); for documents, their publication date. ``backend``: ``"rules"`` (the tested
    default) or ``"dateparser"`` (needs the optional ``dateparser`` package; finds the first date with
    ``dateparser.search``; relative dates use ``ref``). See the module docstring for the covered forms."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    text = cap_text(text)   # the first MAX_TEXT_CHARS characters (tempokern.limits)
    ref = _check_ref(ref)
    if backend == "rules":
        return _parse_rules(text, ref, {"season_months": bool(season_months)})
    if backend == "dateparser":
        try:
            from dateparser.search import search_dates
        except ImportError as e:  # pragma: no cover - optional
            raise ImportError("parse_time(backend='dateparser') needs the 'dateparser' package") from e
        settings = {"PREFER_DAY_OF_MONTH": "first"}
        if ref is not None:
            settings["RELATIVE_BASE"] = _dt.datetime(ref.year, ref.month, ref.day)
        found = search_dates(text, languages=["en"], settings=settings)
        if not found:
            return None
        return TimeTuple.from_date(found[0][1].date())
    raise ValueError(f"backend: expected 'rules' or 'dateparser', got {backend!r}")


def find_time(text: str, *, ref=None, season_months: bool = False):
    """``(TimeTuple | None, (start, end) | None)``: :func:`parse_time` plus the character span of the
    expression it read."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    return _parse_rules(text, _check_ref(ref), {"season_months": bool(season_months)}, with_span=True)


class TimeSpan(NamedTuple):
    """One temporal expression of a text: ``start`` and ``end`` (equal for a single date; a range such as
    ``2010-2015`` or ``March 3-5, 2014`` has its two ends) and the character ``span`` it covers."""
    start: TimeTuple
    end: TimeTuple
    span: Tuple[int, int]

    @property
    def is_range(self) -> bool:
        return self.start != self.end


_RANGE_GAP = re.compile(_RANGE_SEP)
_BETWEEN_BEFORE = re.compile(r"(?i:\bbetween\s+)$")
_FROM_BEFORE = re.compile(r"(?i:\b(?:from|between)\s+)$")


def _fill(a: TimeTuple, b: TimeTuple) -> TimeTuple:
    """``a`` with the year (and month, when a has a day but no month) it lacks taken from ``b``."""
    if a.is_empty or b.is_empty:
        return a
    y = a.year if a.mask[0] else (b.year if b.mask[0] else None)
    m = a.month if a.mask[1] else (b.month if (a.mask[2] and b.mask[1]) else None)
    d = a.day if a.mask[2] else None
    try:
        return TimeTuple.partial(y, m, d)
    except ValueError:
        return a


def _in_rule_end(m, start: TimeTuple) -> TimeTuple:
    """The end of a range written inside one rule's match (``March 3-5, 2014``, ``3 to 5 March 2014``,
    ``March 3 to April 5, 2014``): its ``day2`` / ``mon2`` groups; ``start`` when the match has none."""
    gd = m.groupdict()
    if not gd.get("day2"):
        return start
    mon = _month_of(gd["mon2"]) if gd.get("mon2") else start.month
    return _day_tuple(start.year, mon, int(gd["day2"]))


def find_times(text: str, *, ref=None, season_months: bool = False) -> List[TimeSpan]:
    """Every temporal expression of ``text`` in reading order (non-overlapping; at one position the longest
    that parses), each as a :class:`TimeSpan`. Ranges are intervals: ``2010-2015``, ``from 1999 to 2003``,
    ``between 2010 and 2015``, ``March 2014 - June 2015``, ``March 3-5, 2014``, ``3 to 5 March 2014``,
    ``from March 3 to April 5, 2014`` give ``start`` and ``end`` (a part one end lacks is taken from the
    other: ``from 5 May to 7 June 2015`` starts on 5 May 2015); a decade (``the 1990s``) is its ten years.
    Relative expressions are resolved against ``ref``; without it they are left out. :func:`parse_time`
    agrees with the first span's ``start`` on every part it observes."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    text = cap_text(text)   # the first MAX_TEXT_CHARS characters (tempokern.limits)
    ref = _check_ref(ref)
    opts = {"season_months": bool(season_months)}
    out: List[TimeSpan] = []
    cursor = 0
    for st, _, _, m, fn in _candidates(text):
        if st < cursor:
            continue
        r = fn(m, text, ref, opts)
        if r is None or r is _UNRESOLVED or r.is_empty:
            continue
        start, end, e = r, _in_rule_end(m, r), m.end()
        if fn is _decade:                       # "the 1990s": 1990-1999 (parse_time reads its middle year)
            start, end = TimeTuple.partial(r.year - 5), TimeTuple.partial(r.year + 4)
        elif end == start:
            # a range across two expressions: "<E1> - <E2>", "from <E1> to <E2>", "between <E1> and <E2>"
            g = _RANGE_GAP.match(text, e)
            if g is not None and g.end() > e:
                sep = g.group(0).strip().lower()
                ok = sep != "and" or _BETWEEN_BEFORE.search(text[:st]) is not None
                if sep in ("to", "until", "till", "through", "thru") and not _FROM_BEFORE.search(text[:st]):
                    ok = ok and bool(re.match(r"\s*[12][0-9]{3}\b|\s*[A-Z]", text[g.end():]))
                if ok:
                    r2, sp2 = _parse_rules(text[g.end():], ref, opts, with_span=True)
                    if r2 is not None and not r2.is_empty and sp2[0] == 0:
                        end, e = _fill(r2, start), g.end() + sp2[1]
                        start = _fill(start, r2)
        out.append(TimeSpan(start, end, (st, e)))
        cursor = e
    return out


def parse_times(texts: Sequence[str], *, refs=None, season_months: bool = False) -> List[Optional[TimeTuple]]:
    """:func:`parse_time` over a list; ``refs`` None or one reference date (or None) per text."""
    if refs is None:
        refs = [None] * len(texts)
    if len(refs) != len(texts):
        raise ValueError(f"refs: expected {len(texts)} entries (one per text), got {len(refs)}")
    return [parse_time(t, ref=r, season_months=season_months) for t, r in zip(texts, refs)]


# ================================================================================================ passages
#: a sentence ends at . ! ? followed by space and an upper-case letter, a digit or an opening quote / bracket,
#: unless the word before the stop is one letter (an initial: "Newton D . Baker") or a common abbreviation
_SENT_END = re.compile(r"[.!?]+(?=\s+[\"'(\[A-Z0-9])")
_ABBREV = {"mr", "mrs", "ms", "dr", "st", "jr", "sr", "prof", "gen", "col", "lt", "capt", "sgt", "rev", "hon", "no",
           "vs", "etc", "inc", "co", "corp", "ltd", "mt", "ft", "u.s", "u.k", "jan", "feb", "mar", "apr", "jun",
           "jul", "aug", "sep", "sept", "oct", "nov", "dec", "vol", "pp", "fig", "op", "ca", "c"}


def sentence_spans(text: str) -> List[Tuple[int, int]]:
    """Character spans of the sentences of ``text`` (rule-based; also for tokenised text such as TimeQA's,
    where the stop is written apart from its word: ``"... in 1794 . After ..."``)."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    out, start = [], 0
    for m in _SENT_END.finditer(text):
        before = text[start:m.start()].rstrip().split()
        word = before[-1].lower() if before else ""
        if len(word) == 1 and word.isalpha() or word in _ABBREV:
            continue
        out.append((start, m.end()))
        start = m.end()
        while start < len(text) and text[start].isspace():
            start += 1
    if start < len(text) and text[start:].strip():
        out.append((start, len(text)))
    return out or [(0, len(text))]


class Passage(NamedTuple):
    """One passage of a text: its ``text``, its date ``time`` (a :class:`TimeSpan`; None for a text without
    any date, whose one passage is the whole text) and the character ``span`` of the passage in the text."""
    text: str
    time: Optional[TimeSpan]
    span: Tuple[int, int]


def date_passages(text: str, *, context: int = 1, ref=None, season_months: bool = False) -> List[Passage]:
    """One passage per date expression of ``text`` (:func:`find_times`, reading order): the sentence that holds
    the expression and ``context`` sentences on either side, with that one expression as its time (Re³'s
    one-time passages; a paragraph that names many periods becomes many passages, each about one of them).
    A text without a date is one passage, the whole text, with ``time=None``."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an int >= 0, got {context!r}")
    spans = find_times(text, ref=ref, season_months=season_months)
    if not spans:
        return [Passage(text, None, (0, len(text)))]
    sents = sentence_spans(text)
    out = []
    for sp in spans:
        i = next((k for k, (a, b) in enumerate(sents) if a <= sp.span[0] < b), len(sents) - 1)
        a, b = sents[max(0, i - context)][0], sents[min(len(sents) - 1, i + context)][1]
        out.append(Passage(text[a:b].strip(), sp, (a, b)))
    return out


__all__ = ["TimeTuple", "TimeSpan", "parse_time", "parse_times", "find_time", "find_times", "Passage",
           "date_passages", "sentence_spans"]
