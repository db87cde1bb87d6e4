"""Set B — Re²-style relevance ("Monthly facts" + "Seattle days").

Documents, one per fact, rendered from real records in the vega-datasets wheel:

* ``us-employment.csv`` (monthly, 2006-2015, 22 series): entity "United States", attribute = the series;
  the other series of the same month are *attribute-wrong* siblings;
* ``stocks.csv`` (monthly, 2000-2010, 5 tickers): entity = the company, attribute "stock price"; the other
  tickers of the same month are *entity-wrong* siblings;
* ``seattle-weather.csv`` (daily, 2012-2015): one document per (day, metric); the other metrics of the
  same day are *attribute-wrong* siblings.

*Time-wrong* siblings are the same entity and attribute at a shifted date (±1 day, ±7 days, ±1 month,
±1 year). Documents use 9 paraphrase templates per source; queries use 8 per source (the last two are
held out for ``test_template``), each with a date surface form drawn independently of the document's.
30% of the documents are *masked*: their date is written in a coarse or relative form ("last month",
"yesterday", "last Friday", "three days ago", "early March 2014", "the third month of 2009") that is
resolved through the record's ``published`` date; ``meta["relative"]`` records the rule
(``expr``, ``format``, ``anchor`` = published, ``resolves_to``).

The calendar is ``Calendar.gregorian(2000, 2015, resolution="month")``: every record's interval is its
month; the exact day of a daily fact is in ``meta["date"]``."""
from __future__ import annotations

import datetime as _dt
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from ...calendar import Interval
from ...text.dates import (FORMAT_GRANULARITY, expressible, format_date)
from ._common import Builder, TrainRow, cap, fill, iso, month_rank, rng_for, vega_csv

FIRST_YEAR, LAST_YEAR = 2000, 2015
UNSEEN_YEAR = 2015
CALENDAR = {"first_year": FIRST_YEAR, "last_year": LAST_YEAR, "resolution": "month"}
MASKED_FRACTION = 0.3
N_QUERY_TEMPLATES = 8
HELD_OUT_TEMPLATES = (6, 7)
TIMELESS_TEMPLATE_BASE = 100

EMPLOYMENT = {   # column -> (label, group)
    "nonfarm": ("total nonfarm", "total"), "private": ("total private", "total"),
    "goods_producing": ("goods-producing industries", "total"),
    "service_providing": ("service-providing industries", "total"),
    "private_service_providing": ("private service-providing industries", "total"),
    "mining_and_logging": ("mining and logging", "goods"), "construction": ("construction", "goods"),
    "manufacturing": ("manufacturing", "goods"), "durable_goods": ("durable goods manufacturing", "goods"),
    "nondurable_goods": ("nondurable goods manufacturing", "goods"),
    "trade_transportation_utilties": ("trade, transportation and utilities", "trade"),
    "wholesale_trade": ("wholesale trade", "trade"), "retail_trade": ("retail trade", "trade"),
    "transportation_and_warehousing": ("transportation and warehousing", "trade"),
    "utilities": ("utilities", "trade"), "information": ("information", "services"),
    "financial_activities": ("financial activities", "services"),
    "professional_and_business_services": ("professional and business services", "services"),
    "education_and_health_services": ("education and health services", "services"),
    "leisure_and_hospitality": ("leisure and hospitality", "services"),
    "other_services": ("other services", "services"), "government": ("government", "services"),
}
QUICK_EMPLOYMENT = ("nonfarm", "construction", "manufacturing", "durable_goods", "nondurable_goods",
                    "retail_trade", "information", "government")
COMPANIES = {"MSFT": "Microsoft", "AMZN": "Amazon", "IBM": "IBM", "GOOG": "Google", "AAPL": "Apple"}
SEATTLE = {   # metric -> (noun, unit format)
    "temp_max": ("high temperature", "{:.1f} °C"), "temp_min": ("low temperature", "{:.1f} °C"),
    "precipitation": ("precipitation", "{:.1f} mm"), "wind": ("average wind speed", "{:.1f} m/s"),
}
FULL_METRICS = ("temp_max", "temp_min", "precipitation", "wind")
QUICK_METRICS = ("temp_max", "precipitation")

# {when}: a prepositional date phrase ("on March 7, 2014", "in March 2014", "yesterday"); {date}: the bare form
DOC_TEMPLATES = {
    "employment": (
        "{when}, US employment in {label} stood at {value} thousand jobs.",
        "{date}: the United States counted {value} thousand jobs in {label}.",
        "The {label} sector employed {value} thousand people in the US {when}.",
        "Payroll data for {date} show {value} thousand US workers in {label}.",
        "US {label} employment reached {value} thousand {when}, according to the monthly jobs report.",
        "According to the jobs report for {date}, {label} accounted for {value} thousand US jobs.",
        "There were {value} thousand jobs in US {label} {when}.",
        "Monthly employment, {label}, United States, {date}: {value} thousand.",
        "For {date}, the official count of {label} jobs in the US was {value} thousand.",
    ),
    "stock": (
        "{when}, {entity} stock was priced at ${value}.",
        "{date}: {entity} ({ticker}) shares were priced at ${value}.",
        "{entity}'s share price stood at ${value} {when}.",
        "Shares of {entity} traded at ${value} {when}.",
        "The monthly price of {ticker} stock was ${value} {when}.",
        "Monthly stock report for {date}: {entity} at ${value} per share.",
        "Investors paid ${value} for one {entity} share {when}.",
        "{ticker} price, {date}: ${value}.",
        "{when} one share of {entity} cost ${value}.",
    ),
    "seattle": (
        "{when}, Seattle recorded {a_metric} of {value}.",
        "{date}: the {metric} in Seattle was {value}.",
        "Seattle weather for {date}: {metric} {value}.",
        "The {metric} measured in Seattle {when} was {value}.",
        "Seattle saw {a_metric} of {value} {when}.",
        "Daily weather log, Seattle, {date}: {metric} of {value}.",
        "According to the station report for {date}, Seattle's {metric} reached {value}.",
        "The Seattle weather station logged {a_metric} of {value} {when}.",
        "Weather observers in Seattle noted {a_metric} of {value} {when}.",
    ),
}
QUERY_TEMPLATES = {
    "employment": (
        "How many people were employed in US {label} {when}?",
        "US {label} jobs {when}",
        "What was employment in {label} in the United States {when}?",
        "{when}, how many US jobs were there in {label}?",
        "Number of {label} jobs in the US for {date}",
        "Give the US {label} employment figure for {date}.",
        "How large was the {label} workforce in the US {when}?",
        "Jobs count in US {label}, {date}?",
    ),
    "stock": (
        "What was {entity}'s stock price {when}?",
        "{entity} share price {when}",
        "How much did a {entity} share cost {when}?",
        "{when}, what was {ticker} trading at?",
        "Price of {ticker} stock for {date}",
        "Give the monthly {entity} stock price for {date}.",
        "At what price did {entity} shares trade {when}?",
        "{ticker} monthly price, {date}?",
    ),
    "seattle": (
        "What was the {metric} in Seattle {when}?",
        "Seattle {metric} {when}",
        "What {metric} did Seattle record {when}?",
        "{when}, what {metric} was measured in Seattle?",
        "Tell me Seattle's {metric} for {date}.",
        "{metric} reading for Seattle, {date}",
        "Which {metric} was reported for Seattle {when}?",
        "I need the Seattle {metric} from {date}.",
    ),
}
TIMELESS_TEMPLATES = {
    "employment": ("How many people work in US {label}?", "US {label} employment figures"),
    "stock": ("What is {entity}'s stock price?", "{entity} share price history"),
    "seattle": ("What {metric} does Seattle record?", "Seattle {metric} readings"),
}
MONTH_QUERY_FORMATS = ("month_yyyy", "abbr_yyyy", "yyyy_mm", "mm_yyyy")
MONTH_DOC_FORMATS = ("month_yyyy", "abbr_yyyy", "yyyy_mm", "mm_yyyy")
DAY_QUERY_FORMATS = ("iso", "us_slash", "month_d_yyyy", "d_month_yyyy", "weekday_month_d_yyyy",
                     "weekday_d_month_yyyy", "weekday_iso", "abbr_d_yyyy")
DAY_DOC_FORMATS = ("iso", "us_slash", "month_d_yyyy", "d_month_yyyy", "abbr_d_yyyy", "d_abbr_yyyy",
                   "month_ordinal_yyyy", "ordinal_of_month_yyyy", "weekday_month_d_yyyy")
MASKED_MONTH_FORMATS = ("last_month", "nth_month_of_yyyy")
MASKED_DAY_FORMATS = ("yesterday", "days_ago", "last_weekday", "today", "early_month_yyyy")


def preposition(fmt: str) -> str:
    """The preposition that turns a date form into a time adverbial ("on" a day, "in" a month)."""
    if fmt in ("today", "yesterday", "tomorrow", "days_ago", "last_weekday", "next_weekday", "last_month",
               "last_year"):
        return ""
    return "on " if FORMAT_GRANULARITY[fmt] == "day" and fmt != "early_month_yyyy" else "in "


def render(template: str, fmt: str, d: _dt.date, values: dict, ref: Optional[_dt.date] = None
           ) -> Tuple[str, List[List[int]], str]:
    """(text, temporal spans, the date expression) of a template with {when}/{date} slots."""
    expr = format_date(d, fmt, ref=ref)
    t = template.replace("{when}", preposition(fmt) + "{date}")
    text, spans = fill(t, {**values, "date": expr}, temporal=("date",))
    return text, spans, expr


# ---- facts ----------------------------------------------------------------------------------------

class Fact:
    __slots__ = ("source", "entity", "attribute", "date", "value", "values", "gran", "rid")

    def __init__(self, source, entity, attribute, date, value, values, gran):
        self.source, self.entity, self.attribute, self.date = source, entity, attribute, date
        self.value, self.values, self.gran = value, values, gran
        self.rid = None


def _facts(size: str) -> List[Fact]:
    quick = size == "quick"
    facts: List[Fact] = []
    cols = QUICK_EMPLOYMENT if quick else tuple(EMPLOYMENT)
    for row in vega_csv("us-employment.csv"):
        d = _dt.date.fromisoformat(row["month"])
        if quick and d.year < 2012:
            continue
        for c in cols:
            label = EMPLOYMENT[c][0]
            v = float(row[c])
            facts.append(Fact("employment", "United States", label, d, f"{v:,.0f}",
                              {"label": label, "value": f"{v:,.0f}"}, "month"))
    for row in vega_csv("stocks.csv"):
        d = _dt.datetime.strptime(row["date"], "%b %d %Y").date()
        if quick and d.year < 2006:
            continue
        t = row["symbol"]
        v = float(row["price"])
        facts.append(Fact("stock", COMPANIES[t], "stock price", d, f"{v:.2f}",
                          {"entity": COMPANIES[t], "ticker": t, "value": f"{v:.2f}"}, "month"))
    metrics = QUICK_METRICS if quick else FULL_METRICS
    rows = vega_csv("seattle-weather.csv")
    if quick:   # every third day of 2013-2015
        rows = [r for i, r in enumerate(rows) if i % 3 == 0 and r["date"] >= "2013"]
    for row in rows:
        d = _dt.datetime.strptime(row["date"], "%Y/%m/%d").date()
        for m in metrics:
            noun, unit = SEATTLE[m]
            v = unit.format(float(row[m]))
            art = "an" if noun[0] in "aeiou" else "a"
            facts.append(Fact("seattle", "Seattle", noun, d, v, {"metric": noun, "a_metric": f"{art} {noun}",
                                                                 "value": v}, "day"))
    return facts


def _shift_month(d: _dt.date, k: int) -> Optional[_dt.date]:
    y, m = divmod(d.year * 12 + d.month - 1 + k, 12)
    try:
        return d.replace(year=y, month=m + 1)
    except ValueError:
        return None


def _shifts(d: _dt.date, gran: str) -> List[_dt.date]:
    out = []
    if gran == "day":
        out += [d + _dt.timedelta(days=k) for k in (1, -1, 7, -7)]
    for k in (1, -1, 12, -12):
        s = _shift_month(d, k)
        if s is not None:
            out.append(s)
    return out


def generate(seed: int, size: str, caps: Dict[str, Optional[int]]) -> Tuple[Builder, dict]:
    b = Builder("B")
    facts = _facts(size)
    rng = rng_for("B", seed, "facts")
    # held-out months (unseen dates within seen years): 10% of each source period's months, >= 3 per period
    held_months = set()
    for lo, hi in ((2000, 2011), (2012, 2014)):
        present = sorted({(f.date.year, f.date.month) for f in facts if lo <= f.date.year <= hi})
        if present:
            held_months.update(rng.sample(present, max(3, len(present) // 10)))
    by_key: Dict[tuple, Fact] = {}
    split_of: Dict[int, str] = {}
    masked: Dict[int, bool] = {}
    for i, f in enumerate(facts):
        by_key[(f.source, f.entity, f.attribute, f.date)] = f
        masked[i] = rng.random() < MASKED_FRACTION
        if f.date.year == UNSEEN_YEAR:
            split_of[i] = "test_year"
        elif masked[i]:
            split_of[i] = "test_masked"
        elif (f.date.year, f.date.month) in held_months:
            split_of[i] = "test_date"
        else:
            u = rng.random()
            split_of[i] = "val" if u < 0.06 else "test_template" if u < 0.16 else "train"
    # ---- records
    trng = rng_for("B", seed, "text")
    for i, f in enumerate(facts):
        tpl = trng.randrange(len(DOC_TEMPLATES[f.source]))
        extra = {}
        if masked[i]:
            if f.gran == "month":
                fmt = trng.choice(MASKED_MONTH_FORMATS)
                pub = _shift_month(f.date.replace(day=1), 1) + _dt.timedelta(days=trng.randrange(0, 25))
            else:
                fmt = trng.choice(MASKED_DAY_FORMATS)
                lag = {"today": 0, "yesterday": 1, "days_ago": trng.randint(2, 6), "last_weekday": trng.randint(1, 7),
                       "early_month_yyyy": 1}[fmt]
                pub = f.date + _dt.timedelta(days=lag)
            assert expressible(f.date, fmt, ref=pub), (f.date, fmt, pub)
            text, spans, expr = render(DOC_TEMPLATES[f.source][tpl], fmt, f.date, f.values, ref=pub)
            extra["relative"] = {"expr": expr, "format": fmt, "anchor": iso(pub), "resolves_to": iso(f.date),
                                 "granularity": FORMAT_GRANULARITY[fmt]}
        else:
            fmt = trng.choice(MONTH_DOC_FORMATS if f.gran == "month" else DAY_DOC_FORMATS)
            pub = (f.date + _dt.timedelta(days=1) if f.gran == "day"
                   else _shift_month(f.date.replace(day=1), 1) + _dt.timedelta(days=trng.randrange(4, 20)))
            text, spans, expr = render(DOC_TEMPLATES[f.source][tpl], fmt, f.date, f.values)
        rid = f"B:{f.source}:{_slug(f.entity)}:{_slug(f.attribute)}:{f.date.isoformat()}"
        f.rid = rid
        r = month_rank(FIRST_YEAR, f.date)
        b.record(rid, text, spans, interval=Interval(r, r), key=(f.date.year, f.date.month), published=pub,
                 entity=f.entity, attribute=f.attribute, date=f.date, template=tpl, masked=masked[i],
                 facts=[{"head": f.entity, "relation": f.attribute, "value": f.value}], source=f.source,
                 split=split_of[i], date_format=fmt, granularity=f.gran, **extra)
    # ---- siblings
    by_month_attr: Dict[tuple, List[int]] = defaultdict(list)     # (source, attribute, date) -> facts
    by_entity_date: Dict[tuple, List[int]] = defaultdict(list)    # (source, entity, date) -> facts
    index = {id(f): i for i, f in enumerate(facts)}
    for i, f in enumerate(facts):
        by_month_attr[(f.source, f.attribute, f.date)].append(i)
        by_entity_date[(f.source, f.entity, f.date)].append(i)

    def time_twin(i: int, allowed) -> Optional[int]:
        f = facts[i]
        cands = _shifts(f.date, f.gran)
        qrng.shuffle(cands)
        for d in cands:
            g = by_key.get((f.source, f.entity, f.attribute, d))
            if g is not None and allowed(index[id(g)]):
                return index[id(g)]
        return None

    def sibling(i: int, kind: str, allowed) -> Optional[int]:
        f = facts[i]
        pool = (by_month_attr[(f.source, f.attribute, f.date)] if kind == "entity_wrong"
                else by_entity_date[(f.source, f.entity, f.date)])
        pool = [j for j in pool if j != i and allowed(j)]
        if not pool:
            return None
        if kind == "attribute_wrong" and f.source == "employment":   # prefer the same group
            grp = _group(f.attribute)
            same = [j for j in pool if _group(facts[j].attribute) == grp]
            pool = same or pool
        return qrng.choice(pool)

    # ---- queries
    qrng = rng_for("B", seed, "queries")
    by_split: Dict[str, List[int]] = defaultdict(list)
    for i in range(len(facts)):
        by_split[split_of[i]].append(i)
    is_train = lambda j: split_of[j] == "train"   # noqa: E731
    anything = lambda j: True   # noqa: E731
    for split in ("train", "val", "test_template", "test_date", "test_year", "test_masked"):
        chosen = cap(rng_for("B", seed, f"cap/{split}"), by_split[split], caps.get(split))
        for i in chosen:
            f = facts[i]
            tpls = HELD_OUT_TEMPLATES if split == "test_template" else tuple(
                t for t in range(N_QUERY_TEMPLATES) if t not in HELD_OUT_TEMPLATES)
            tpl = qrng.choice(tpls)
            fmt = _query_format(f, qrng)
            text, spans, expr = render(QUERY_TEMPLATES[f.source][tpl], fmt, f.date, f.values)
            twin = time_twin(i, is_train if split == "train" else anything)
            r = month_rank(FIRST_YEAR, f.date)
            qid = f"q:{f.rid[2:]}"
            b.query(qid, text, spans, interval=Interval(r, r), gold={f.rid: 1}, split=split, entity=f.entity,
                    attribute=f.attribute, date=f.date, template=tpl, kind="explicit", answer=f.value,
                    time_wrong_twin=facts[twin].rid if twin is not None else None, source=f.source,
                    date_format=fmt)
            if split != "train":
                continue
            negs, kinds = [], []
            if twin is not None:
                negs.append(facts[twin].rid)
                kinds.append("time_wrong")
            for kind in ("entity_wrong", "attribute_wrong"):
                j = sibling(i, kind, is_train)
                if j is not None:
                    negs.append(facts[j].rid)
                    kinds.append(kind)
            nq = []
            for j in [twin] + [time_twin(i, is_train)]:
                if j is not None:
                    t2, _, _ = render(QUERY_TEMPLATES[f.source][tpl], fmt, facts[j].date, f.values)
                    if t2 != text and t2 not in nq:
                        nq.append(t2)
            b.rows.append(TrainRow(qid, text, f.rid, negs, kinds, nq))
    # ---- time-less queries: every document of an (entity, attribute) is relevant
    groups: Dict[tuple, List[int]] = defaultdict(list)
    for i, f in enumerate(facts):
        groups[(f.source, f.entity, f.attribute)].append(i)
    for (src, ent, attr), members in sorted(groups.items()):
        f = facts[members[0]]
        for k, tpl in enumerate(TIMELESS_TEMPLATES[src]):
            text, spans = fill(tpl, f.values)
            b.query(f"q:timeless:{src}:{_slug(ent)}:{_slug(attr)}:{k}", text, spans, interval=None,
                    gold={facts[j].rid: 1 for j in members}, split="timeless", entity=ent, attribute=attr, date=None,
                    template=TIMELESS_TEMPLATE_BASE + k, kind="timeless", answer=None, source=src)
    info = {"calendar": CALENDAR, "unseen_year": UNSEEN_YEAR, "held_out_months": sorted(f"{y:04d}-{m:02d}" for y, m in held_months),
            "held_out_templates": list(HELD_OUT_TEMPLATES), "masked_fraction": MASKED_FRACTION,
            "sources": {"us-employment.csv": "vega-datasets", "stocks.csv": "vega-datasets",
                        "seattle-weather.csv": "vega-datasets"}}
    return b, info


def _query_format(f: Fact, rng) -> str:
    if f.gran == "day":
        return rng.choice(DAY_QUERY_FORMATS)
    if f.source == "stock" and rng.random() < 0.5:   # the price is quoted on the 1st: a day form fits too
        return rng.choice(DAY_QUERY_FORMATS)
    return rng.choice(MONTH_QUERY_FORMATS)


def _group(label: str) -> Optional[str]:
    for lab, grp in EMPLOYMENT.values():
        if lab == label:
            return grp
    return None


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s.lower()).strip("_")
