"""Temporal-expression tagging for TMRL's temporal tokens T(x) (Eq. 8): a rule tagger (pure Python, no Java,
no network; the paper used SUTime) and the character-span -> subword-token mask through a fast tokenizer's
offsets.

``temporal_spans(text)`` returns ``[(start, end, kind), ...]`` (character offsets, ``text[start:end]`` is the
expression, sorted, non-overlapping). Kinds:

==========  =====================================================================================
kind        examples
==========  =====================================================================================
date        ``2019-05-04``, ``5/4/2019``, ``04.05.2019``, ``4 May 2019``, ``the 4th of May, 2019``,
            ``May 4, 2019``, ``Saturday, May 4, 2019``, ``May 4th``, ``4 May``
month       ``May 2019``, ``Sept. 2019``, ``March of 2019``, ``2019-05``, ``March`` (a capitalised full month
            name standing alone; never ``May`` alone, which is usually the verb)
year        ``1066``, ``in 1906``, ``'98``, ``44 BC``, ``AD 79``, ``the year 1906``
season      ``spring 2016``, ``the summer of 1969``
quarter     ``Q3 2019``, ``the third quarter of 2019``, ``the first half of 2019``
decade      ``the 1990s``, ``1990's``, ``the early 1990s``, ``mid-1980s``, ``the '90s``, ``the nineties``
century     ``the 19th century``, ``19th-century``, ``the twentieth century``, ``the 1800s``,
            ``the 5th century BC``
weekday     ``Monday``, ``on Tuesday``
range       ``from 2012 to 2014``, ``between 2012 and 2014``, ``2005-2007``, ``2005–07``, ``1990-95``,
            ``May–June 2019``, ``5–7 May 2019``, ``May 5–7, 2019``, ``from May 2010 until June 2011``
relative    ``now``, ``today``, ``yesterday``, ``currently``, ``last year``, ``next month``,
            ``this summer``, ``three years ago``, ``the past two decades``, ``in recent years``
==========  =====================================================================================

Prepositional anchors and modifiers are kept in the span, as TMRL's data pipeline asks (§A.4): ``in 1906``,
``after July 2010``, ``since the early 1990s``, ``by the end of 2019``. Bare four-digit numbers are years
only in 1000-2099 and not when they are amounts: after a currency sign or ``#`` (``$1999``), before ``%``,
a decimal part, ``x`` or a unit (``2048 km``), or before a plural count noun (``2048 rows``; a lowercase word
ending in -s that is not a common verb/function word) unless a temporal preposition precedes (``in 2016
elections`` stays a year). ``YYYY-MM`` with a month 01-12 is read as ISO year-month (``2005-07`` = July
2005); with an en dash, or a second part that is no month, it is a range (``2005–07``, ``1990-95``)."""
from __future__ import annotations

import bisect
import re
from typing import Iterable, List, Sequence, Tuple, Union

from ..limits import cap_text

__all__ = ["temporal_spans", "temporal_token_mask", "KINDS"]

KINDS = ("date", "month", "year", "season", "quarter", "decade", "century", "weekday", "range", "relative")

_MONTHS_FULL = ("january", "february", "march", "april", "may", "june", "july", "august", "september",
                "october", "november", "december")
_MONTHS_ABBR = ("jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec")
_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_SEASONS = ("spring", "summer", "autumn", "fall", "winter")
_ORD_WORDS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
              "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
              "eighteenth", "nineteenth", "twentieth", "twenty-first", "twenty first")
_NUM_WORDS = ("a", "an", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
              "twelve", "fifteen", "twenty", "thirty", "fifty", "a hundred", "several", "a few", "few", "many",
              "some")
_UNITS = ("years", "year", "months", "month", "weeks", "week", "days", "day", "decades", "decade", "centuries",
          "century", "hours", "hour", "minutes", "minute")
_DECADE_WORDS = ("twenties", "thirties", "forties", "fifties", "sixties", "seventies", "eighties", "nineties")

_M = r"(?:%s)" % "|".join(sorted(_MONTHS_FULL, key=len, reverse=True)
                          + [a + r"\.?" for a in sorted(_MONTHS_ABBR, key=len, reverse=True)])
_MFULL = r"(?:%s)" % "|".join(_MONTHS_FULL)
_WD = r"(?:%s)" % "|".join(_WEEKDAYS)
_SEA = r"(?:%s)" % "|".join(_SEASONS)
_WDN = r"(?:(?i:%s),?\s+)?" % "|".join(_WEEKDAYS)          # an optional weekday before a numeric date
_DAY = r"(?:3[01]|[12]\d|0?[1-9])(?:st|nd|rd|th)?"
_Y = r"(?:[12]\d{3})"                     # a year where the context already says it is one
_ORD = r"(?:\d{1,2}(?:st|nd|rd|th)|%s)" % "|".join(w.replace(" ", r"\s") for w in _ORD_WORDS)
_NUMW = r"(?:\d+|%s)" % "|".join(w.replace(" ", r"\s+") for w in sorted(_NUM_WORDS, key=len, reverse=True))
_UNIT = r"(?:%s)" % "|".join(_UNITS)
_RELUNIT = r"(?:year|month|week|decade|century|quarter|semester|weekend|night|morning|afternoon|evening|%s|%s|%s)" % (
    _SEA, _WD, _MFULL)
_END = r"(?!\w)(?!['’](?!s\b)\w)"              # a word ends here (a possessive 's may follow)
_BEG = r"(?<![\w'’])"
_DASH = r"\s*[-–—]\s*"

# (kind, pattern, flags); the pattern's whole match is the span (group "x", when present, is the span instead)
_I = re.IGNORECASE
_PATTERNS: List[Tuple[str, str, int]] = [
    # ranges written as one expression
    ("range", _BEG + _M + _DASH + _M + r",?\s+" + _Y + _END, _I),                               # May–June 2019
    ("range", _BEG + _DAY + _DASH + _DAY + r"\s+" + _M + r",?\s+" + _Y + _END, _I),           # 5–7 May 2019
    ("range", _BEG + _M + r"\s+" + _DAY + _DASH + _DAY + r",?\s+" + _Y + _END, _I),           # May 5–7, 2019
    ("range", _BEG + r"(?:1\d{3}|20\d{2})(?:'?s)?\s*[–—]\s*(?:[12]\d{3}|\d{2})(?:'?s)?" + _END, 0),   # 2005–2007
    ("range", _BEG + r"(?:1\d{3}|20\d{2})'?s-(?:[12]\d{3})'?s" + _END, 0),                          # 1980s-1990s
    ("range", _BEG + r"(?P<a>1\d{3}|20\d{2})-(?P<b>[12]\d{3}|\d{2})" + _END, 0),               # 2005-2007 / 1990-95
    # full dates
    ("date", _BEG + r"(?:" + _WD + r",?\s+)?" + _M + r"\s+" + _DAY + r"(?:,\s*|\s+)" + _Y + _END, _I),
    ("date", _BEG + r"(?:" + _WD + r",?\s+)?(?:the\s+)?" + _DAY + r"(?:\s+of)?\s+" + _M + r",?\s+" + _Y + _END, _I),
    ("date", _BEG + _WDN + r"(?P<iy>[12]\d{3})-(?P<im>\d{2})-(?P<id>\d{2})(?:T\d{2}:\d{2}(?::\d{2})?)?" + _END, 0),
    ("date", _BEG + _WDN + r"(?P<iy>[12]\d{3})/(?P<im>\d{1,2})/(?P<id>\d{1,2})" + _END, 0),
    ("date", _BEG + _WDN + r"(?P<u1>\d{1,2})/(?P<u2>\d{1,2})/(?P<uy>\d{4}|\d{2})" + _END, 0),
    ("date", _BEG + _WDN + r"(?P<u1>\d{1,2})\.(?P<u2>\d{1,2})\.(?P<uy>\d{4})" + _END, 0),
    # dates without a year (the month must be capitalised)
    ("date", _BEG + r"(?:" + _WD + r",?\s+)?" + _M + r"\s+" + _DAY + r"(?!\s*[-–—:.,]?\d)" + _END, _I),
    ("date", _BEG + r"(?:the\s+)?" + _DAY + r"(?:\s+of)?\s+" + _M + _END, _I),
    # months
    ("month", _BEG + _M + r",?\s+(?:of\s+)?" + _Y + _END, _I),
    ("month", _BEG + r"(?P<my>[12]\d{3})-(?P<mm>\d{2})" + _END, 0),
    ("month", _BEG + r"(?P<nm>\d{1,2})/(?P<ny>[12]\d{3})" + _END, 0),                              # 02/2014
    ("month", _BEG + r"(?:the\s+)?(?:%s|\d{1,2}(?:st|nd|rd|th))\s+month\s+of\s+" % "|".join(_ORD_WORDS[:12])
     + _Y + _END, _I),                                                                         # the second month of 2012
    ("month", _BEG + _MFULL + _END, _I),
    # seasons, quarters
    ("season", _BEG + r"(?:the\s+)?" + _SEA + r",?\s+(?:of\s+)?" + _Y + _END, _I),
    ("quarter", _BEG + r"Q[1-4]\s*" + _Y + _END, 0),
    ("quarter", _BEG + r"(?:the\s+)?(?:first|second|third|fourth|last|1st|2nd|3rd|4th)\s+(?:quarter|half)\s+of\s+"
     + _Y + _END, _I),
    # decades and centuries
    ("decade", _BEG + r"(?:1\d|20)\d0'?s" + _END, 0),
    ("decade", r"(?<!\w)(?:the\s+)(?:early\s+|mid-?|late\s+)?['’]?\d0'?s" + _END, _I),
    ("decade", _BEG + r"the\s+(?:early\s+|mid-?|late\s+)?(?:%s)" % "|".join(_DECADE_WORDS) + _END, _I),
    ("century", _BEG + r"(?:the\s+)?" + _ORD + r"[\s-]+centur(?:y|ies)(?:\s+(?:BC|BCE|AD|CE)\b)?" + _END, _I),
    # years
    ("year", _BEG + r"\d{1,4}\s+(?:BC|BCE|B\.C\.)" + r"(?![\w])", 0),
    ("year", _BEG + r"(?:AD|A\.D\.)\s+\d{1,4}" + _END, 0),
    ("year", _BEG + r"(?:the\s+)?year\s+" + _Y + _END, _I),
    ("year", r"(?<![\w'’$€£¥#])['’]\d{2}" + r"(?![\w'’])", 0),
    ("year", r"(?P<bare>(?<![\w$€£¥#.,])(?:1\d{3}|20\d{2})(?![\w]|[.,]\d))", 0),
    # weekdays
    ("weekday", _BEG + _WD + _END, _I),
    # relative expressions
    ("relative", _BEG + r"(?:the\s+day\s+(?:before\s+yesterday|after\s+tomorrow)|right\s+now|nowadays|now|today|"
     r"tonight|yesterday|tomorrow|currently|presently|at\s+present|these\s+days|recently|lately|"
     r"in\s+recent\s+years|the\s+present\s+day|so\s+far\s+this\s+year)" + _END, _I),
    ("relative", r"(?<=\bto\s)(?:the\s+)?present" + _END, _I),
    ("relative", r"(?<=\btill\s)(?:the\s+)?present" + _END, _I),
    ("relative", r"(?<=\buntil\s)(?:the\s+)?present" + _END, _I),
    ("relative", _BEG + r"(?:(?:earlier|later)\s+)?(?:this|last|next|past|previous|coming|following)\s+"
     + _RELUNIT + _END, _I),
    ("relative", _BEG + _NUMW + r"\s+" + _UNIT + r"\s+(?:ago|earlier|later|from\s+now|before|after)" + _END, _I),
    ("relative", _BEG + r"the\s+(?:past|last|next|coming|previous|following)\s+(?:" + _NUMW + r"\s+)?"
     + _UNIT + _END, _I),
]
_COMPILED = [(k, re.compile(p, f)) for k, p, f in _PATTERNS]
_PRIORITY = {k: i for i, k in enumerate(("range", "date", "month", "season", "quarter", "century", "decade",
                                         "year", "relative", "weekday"))}

_PREPS = ("in", "on", "at", "after", "before", "since", "until", "till", "by", "during", "around", "circa",
          "from", "throughout", "through", "as of", "prior to", "up to", "as early as", "as late as", "starting",
          "beginning", "ending", "over", "until around", "by around", "since around", "between", "within")
_PREP_RE = re.compile(r"(?<![\w'’])(?:%s)\s+$" % "|".join(p.replace(" ", r"\s+") for p in
                                                         sorted(_PREPS, key=len, reverse=True)), _I)
_MOD_RE = re.compile(r"(?<![\w'’])(?:(?:the\s+)?(?:end|beginning|start|middle|turn|spring|summer|autumn|fall|"
                     r"winter)\s+of\s+(?:the\s+)?|(?:the\s+)?(?:early|late|mid)(?:\s+|-)|(?:the\s+)?mid-|"
                     r"(?:the\s+)?(?:earlier|later)\s+(?:part\s+of\s+)?(?:the\s+)?)$", _I)
_THE_RE = re.compile(r"(?<![\w'’])the\s+$", _I)
_THE_KINDS = ("decade", "century", "season", "quarter")
# range connectors between two tagged expressions
_TO_RE = re.compile(r"^\s*(?:to|until|till|through|thru|[-–—])\s*$", _I)
_AND_RE = re.compile(r"^\s*and\s*$", _I)
_FROM_RE = re.compile(r"(?<![\w'’])from\s+$", _I)
_BETWEEN_RE = re.compile(r"(?<![\w'’])between\s+$", _I)

# words after a bare number that make it an amount, not a year
_VERBISH_S = frozenset("""was is has as its his this thus always whereas does goes says sees marks brings
remains becomes seems looks follows includes begins starts ends saw plus versus yes us gives shows""".split())
_UNIT_WORDS = frozenset("""km kg mg g mb gb kb tb m cm mm ft lb lbs mph hz khz mhz ghz mi ml l w kw mw v px dpi
bpm rpm ms ns x bit bits byte bytes k""".split())
_AMOUNT_BEFORE = re.compile(r"(?:(?<![\w'’])(?:no\.|number|page|pages|pp\.|p\.|room|route|flight|model|version|"
                            r"v\.|id|code|rank|ranked|pin|port)\s+|[x×*/+=]\s*)$", _I)
_TEMPORAL_PREP_BEFORE = re.compile(r"(?<![\w'’])(?:in|since|by|until|till|after|before|during|from|through|"
                                   r"circa|around|of|year)\s+$", _I)
_NAME_BEFORE = re.compile(r"(?<![\w'’])([A-Z][a-z]+)\s+$")
_FUNCTION_WORDS = frozenset("""on by until till since every each next last this that the from through before after
and or of in at for to during every until, a an whole all last past""".split())
_CURRENCY_BEFORE = re.compile(r"[$€£¥#]\s*$")
_WIN = 64                                 # how far the context rules look around a match (keeps tagging linear)
_WORD_AFTER = re.compile(r"^(?:-|\s+)([A-Za-z]+)")


def _valid_md(month: int, day: int) -> bool:
    return 1 <= month <= 12 and 1 <= day <= 31


def _accept(kind: str, m: re.Match, text: str) -> bool:
    g = m.groupdict()
    s, e = m.span()
    if g.get("iy") is not None:                                     # ISO / Y/M/D dates
        return _valid_md(int(g["im"]), int(g["id"]))
    if g.get("u1") is not None:                                     # M/D/Y or D.M.Y
        a, b = int(g["u1"]), int(g["u2"])
        return _valid_md(a, b) or _valid_md(b, a)
    if g.get("my") is not None:                                     # YYYY-MM
        return 1 <= int(g["mm"]) <= 12
    if g.get("nm") is not None:                                     # MM/YYYY
        return 1 <= int(g["nm"]) <= 12
    if g.get("a") is not None:                                      # YYYY-YYYY / YYYY-YY with a hyphen
        a, b = g["a"], g["b"]
        if len(b) == 2:
            if 1 <= int(b) <= 12:                                   # ISO year-month (2005-07), not a range
                return False
            return int(b) > int(a[2:])
        return int(b) > int(a)
    if kind == "range" and re.fullmatch(r"\d{4}(?:'?s)?\s*[–—]\s*\d{2,4}(?:'?s)?", m.group(0)):
        nums = re.findall(r"\d+", m.group(0))
        a, b = nums[0], nums[1]
        return int(b) > (int(a[2:]) if len(b) == 2 else int(a))
    word = m.group(0)
    if kind in ("date", "month", "range"):
        # a month name must be capitalised: "May 2019" / "may 2019", but not "you may 5"
        for mn in re.finditer(_M, word, _I):
            if not mn.group(0)[0].isupper():
                return False
        if kind == "month" and re.fullmatch(_MFULL, word, _I):      # a month name standing alone
            return word[0].isupper() and word.lower() != "may"
    if kind == "weekday":
        # "Easter Monday", "Good Friday", "Cyber Monday": a weekday after a capitalised word that is not a
        # function word is part of a name
        prev = _NAME_BEFORE.search(text, max(0, s - _WIN), s)
        return word[0].isupper() and not (prev is not None and prev.group(1).lower() not in _FUNCTION_WORDS)
    if g.get("bare") is not None:                                   # a bare four-digit number
        lo = max(0, s - _WIN)
        after = text[e:e + _WIN]
        if after[:1] == "%" or re.match(r"^\s*(?:%|percent|per\s+cent)", after, _I):
            return False
        if _AMOUNT_BEFORE.search(text, lo, s) or _CURRENCY_BEFORE.search(text, lo, s):
            return False
        if re.match(r"^\s*[x×*]\s*\d", after):
            return False
        w = _WORD_AFTER.match(after)
        if w is not None:
            nxt = w.group(1)
            if nxt.lower() in _UNIT_WORDS and (nxt.islower() or after[:1] == "-"):
                return False
            if (nxt.islower() and len(nxt) >= 3 and nxt.endswith("s") and not nxt.endswith("ss")
                    and nxt not in _VERBISH_S and not _TEMPORAL_PREP_BEFORE.search(text, lo, s)):
                return False
        return True
    return True


def _candidates(text: str):
    out = []
    for kind, rx in _COMPILED:
        for m in rx.finditer(text):
            if m.end() > m.start() and _accept(kind, m, text):
                out.append((m.start(), m.end(), kind))
    # "the 1800s" is a century
    fixed = []
    for s, e, kind in out:
        if kind == "decade" and re.search(r"1\d00'?s$", text[s:e]):
            kind = "century"
        fixed.append((s, e, kind))
    return fixed


def _select(cands):
    """Longest non-overlapping matches (ties: kind priority, then position)."""
    starts, chosen = [], []                  # chosen spans, sorted by start (they never overlap)
    for s, e, kind in sorted(cands, key=lambda c: (-(c[1] - c[0]), _PRIORITY[c[2]], c[0])):
        i = bisect.bisect_left(starts, s)
        if (i < len(chosen) and chosen[i][0] < e) or (i > 0 and chosen[i - 1][1] > s):
            continue
        starts.insert(i, s)
        chosen.insert(i, (s, e, kind))
    return chosen


def _merge_ranges(text: str, spans):
    """``X to Y`` / ``from X until Y`` / ``between X and Y`` / ``X–Y`` over two tagged expressions -> one range."""
    out = list(spans)
    i = 0
    while i + 1 < len(out):
        (s1, e1, k1), (s2, e2, k2) = out[i], out[i + 1]
        gap = text[e1:s2]
        open_end = k2 == "relative" and re.fullmatch(r"(?:the\s+)?present|now|today", text[s2:e2], _I)
        if k1 == "relative" or (k2 == "relative" and not open_end) or \
                ("weekday" in (k1, k2) and not _FROM_RE.search(text, max(0, s1 - _WIN), s1)):
            i += 1
            continue
        start = None
        if _TO_RE.match(gap):
            f = _FROM_RE.search(text, max(0, s1 - _WIN), s1)
            start = f.start() if f else s1
        elif _AND_RE.match(gap):
            b = _BETWEEN_RE.search(text, max(0, s1 - _WIN), s1)
            start = b.start() if b else None
        if start is None:
            i += 1
            continue
        out[i:i + 2] = [(start, e2, "range")]
    return out


def _extend_left(text: str, spans):
    """Keep prepositional anchors and modifiers in the span: "in 1906", "since the early 1990s",
    "by the end of 2019", "after July 2010"."""
    out = []
    prev_end = 0
    for s, e, kind in spans:
        ns = s
        if kind != "relative" or re.match(r"(?:this|last|next|past|previous|coming|following)\b", text[s:e], _I):
            mod = _MOD_RE.search(text, max(prev_end, ns - _WIN), ns)
            if mod is not None and kind not in ("weekday",):
                ns = mod.start()
            elif kind in _THE_KINDS or (kind == "range" and re.match(r"\d{3}0'?s", text[s:e])):
                the = _THE_RE.search(text, max(prev_end, ns - _WIN), ns)
                if the is not None:
                    ns = the.start()
        prep = _PREP_RE.search(text, max(prev_end, ns - _WIN), ns)
        if prep is not None and not (kind == "range" and re.match(r"(?:from|between)\b", text[ns:e], _I)):
            ns = prep.start()
        out.append((ns, e, kind))
        prev_end = e
    return out


def temporal_spans(text: str) -> List[Tuple[int, int, str]]:
    """Temporal expressions of ``text`` as sorted, non-overlapping ``(start, end, kind)`` character spans
    (module docstring: kinds, formats, rules). Rule-based, deterministic, no network."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    text = cap_text(text)     # spans of the first MAX_TEXT_CHARS characters (tempokern.limits)
    spans = _select(_candidates(text))
    spans = _merge_ranges(text, spans)
    spans = _extend_left(text, spans)
    return spans


# ---------------------------------------------------------------------------------------------------------
# token alignment

SpanLike = Union[Tuple[int, int], Tuple[int, int, str], Sequence[int]]


def _offsets_of(encoding):
    if isinstance(encoding, dict) or hasattr(encoding, "keys"):
        if "offset_mapping" not in encoding:
            raise ValueError("encoding has no offset_mapping: tokenize with a fast tokenizer and "
                             "return_offsets_mapping=True")
        return encoding["offset_mapping"]
    raise TypeError("encoding must be a tokenizer output (BatchEncoding / dict) holding offset_mapping, got "
                    f"{type(encoding).__name__}")


def temporal_token_mask(encoding, spans_per_text: Sequence[Iterable[SpanLike]], *, include_cls: bool,
                        text_offset: Union[int, Sequence[int]] = 0):
    """TMRL's T(x) per text as a (B, L) bool tensor: token l of text b is temporal when its character range
    ``[s, e)`` (the fast tokenizer's ``offset_mapping``; special and padding tokens have ``s == e`` and are
    never temporal) overlaps one of the text's spans ``[start, end)``. ``include_cls=True`` (CLS-pooling
    backbones, §3.2) also marks position 0, the token CLS pooling reads (``tempokern.models.encoder.pool``).

    encoding: the batched output of a fast tokenizer called with ``return_offsets_mapping=True``;
    spans_per_text: one iterable of ``(start, end)`` or ``(start, end, kind)`` per text (e.g.
    ``[temporal_spans(t) for t in texts]``, or spans given by the data); ``text_offset``: added to every span
    of a text (one int, or one per text) — the length of a prefix prepended to the text before tokenizing
    when the spans were found on the text without it."""
    import torch

    if not isinstance(include_cls, bool):
        raise TypeError(f"include_cls must be a bool, got {type(include_cls).__name__}")
    off = _offsets_of(encoding)
    off = off if isinstance(off, torch.Tensor) else torch.as_tensor(off)
    if off.dim() != 3 or off.shape[-1] != 2:
        raise ValueError("encoding's offset_mapping must be batched, shape (B, L, 2), got "
                         f"{tuple(off.shape)} (tokenize a list of texts)")
    B, L, _ = off.shape
    if isinstance(spans_per_text, (str, bytes)) or not isinstance(spans_per_text, Sequence):
        raise TypeError(f"spans_per_text must be a sequence (one list of spans per text), got "
                        f"{type(spans_per_text).__name__}")
    if len(spans_per_text) != B:
        raise ValueError(f"spans_per_text must have one entry per text ({B}), got {len(spans_per_text)}")
    if isinstance(text_offset, bool):
        raise TypeError("text_offset must be an int or a sequence of ints, got bool")
    if isinstance(text_offset, int):
        shifts = [text_offset] * B
    elif isinstance(text_offset, Sequence) and len(text_offset) == B and all(
            isinstance(v, int) and not isinstance(v, bool) for v in text_offset):
        shifts = list(text_offset)
    else:
        raise ValueError(f"text_offset must be an int or {B} ints (one per text), got {text_offset!r}")
    off = off.to(torch.int64)
    tok_s, tok_e = off[..., 0], off[..., 1]
    real = tok_e > tok_s
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, spans in enumerate(spans_per_text):
        if isinstance(spans, (str, bytes)):
            raise TypeError(f"spans_per_text[{b}] must be a list of (start, end[, kind]) spans, got a string")
        for sp in spans:
            if not isinstance(sp, Sequence) or isinstance(sp, (str, bytes)) or len(sp) not in (2, 3):
                raise ValueError(f"spans_per_text[{b}] holds {sp!r}: each span is (start, end) or (start, end, kind)")
            a, z = sp[0], sp[1]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, z)) or not 0 <= a <= z:
                raise ValueError(f"spans_per_text[{b}] holds {sp!r}: start and end must be ints, 0 <= start <= end")
            a, z = a + shifts[b], z + shifts[b]
            mask[b] |= real[b] & (tok_s[b] < z) & (tok_e[b] > a)
    if include_cls:
        mask[:, 0] = True
    return mask.to(off.device)
