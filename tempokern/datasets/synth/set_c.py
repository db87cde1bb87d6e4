"""Set C — versioned Seattle forecasts (for the recency filter).

For each sampled target day of ``seattle-weather.csv`` (2012-2015) and metric, **synthetic** forecast
versions are published 1-7 days before the day (a seeded subset of 3-7 ahead times, always including
1 day), each value drawn around the observed value with noise whose spread shrinks as the publication
date nears (temperatures: normal noise of 0.5 °C per day ahead; precipitation: a multiplicative
log-normal error of 0.15 per day ahead), and the **observed** record (the real value) is the latest
version, published on the day itself. ``meta["version"]`` numbers the versions of a (day, metric) in
publication order (1 = oldest); ``meta["lead_days"]`` is the ahead (0 = observed).

Queries: *Type A* (``kind="explicit"``) name the target date ("What is the latest forecast high
temperature for Seattle on March 3, 2014?"); gold = the latest version (the observed record);
``meta["versions"]`` lists every version oldest first. *Type B* (``kind="latest"``) ask for "the latest
forecast" relative to a query time ("... for tomorrow", "... for next Friday", ``query_time`` set); gold =
the version with the latest publication date not after ``query_time``; ``meta["relative"]`` records how
the target day follows from ``query_time``.

Calendar: ``Calendar.gregorian(2012, 2015, resolution="day")``."""
from __future__ import annotations

import datetime as _dt
import math
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from ...calendar import Interval
from ...text.dates import expressible, format_date
from ._common import Builder, TrainRow, cap, day_rank, fill, iso, rng_for, vega_csv
from .set_b import DAY_DOC_FORMATS, DAY_QUERY_FORMATS, preposition, render

FIRST_YEAR, LAST_YEAR = 2012, 2015
UNSEEN_YEAR = 2015
CALENDAR = {"first_year": FIRST_YEAR, "last_year": LAST_YEAR, "resolution": "day"}
METRICS = {"temp_max": ("high temperature", "°C"), "precipitation": ("precipitation", "mm")}
DAYS = {"full": 520, "quick": 95}
DATE_HOLDOUT = 0.1
HELD_OUT_TEMPLATES = (3, 13)

FORECAST_TEMPLATES = (
    "Forecast for Seattle {when}: {metric} of {value} {unit} expected.",
    "Seattle weather outlook, {date}: the {metric} should reach {value} {unit}.",
    "Forecasters expect a {metric} of {value} {unit} in Seattle {when} (issued {issued}).",
    "{when}, Seattle's {metric} is forecast at {value} {unit}; this outlook was published {issued}.",
    "Weather forecast ({issued}) for {date}: Seattle {metric} {value} {unit}.",
)
OBSERVED_TEMPLATES = (
    "Observed in Seattle {when}: {metric} of {value} {unit}.",
    "Seattle weather station report for {date}: measured {metric} {value} {unit}.",
    "{when}, Seattle's {metric} came in at {value} {unit} (observed).",
)
QUERY_A = {0: "What is the latest forecast {metric} for Seattle {when}?",
           1: "Seattle {metric} forecast {when}",
           2: "What {metric} is expected in Seattle {when}?",
           3: "Most recent Seattle {metric} outlook for {date}?"}
QUERY_B = {10: "What is the latest forecast {metric} for Seattle {date}?",
           11: "Latest Seattle {metric} forecast for {date}",
           12: "What {metric} does the newest forecast give for Seattle {date}?",
           13: "Current Seattle outlook: {metric} {date}?"}
QUERY_B_FORMATS = ("tomorrow", "next_weekday")


def _forecast(rng, metric: str, observed: float, ahead: int) -> float:
    if metric == "temp_max":
        return round(observed + rng.gauss(0.0, 0.5 * ahead), 1)
    return round(max(0.0, (observed + 0.5) * math.exp(rng.gauss(0.0, 0.15 * ahead)) - 0.5), 1)


def generate(seed: int, size: str, caps: Dict[str, Optional[int]]) -> Tuple[Builder, dict]:
    b = Builder("C")
    rows = vega_csv("seattle-weather.csv")
    rng = rng_for("C", seed, "days")
    days = sorted(rng.sample(range(len(rows)), DAYS[size]))
    targets = [(_dt.datetime.strptime(rows[i]["date"], "%Y/%m/%d").date(), rows[i]) for i in days]
    seen_days = sorted({d for d, _ in targets if d.year != UNSEEN_YEAR})
    held = set(rng.sample(seen_days, int(len(seen_days) * DATE_HOLDOUT)))
    vrng = rng_for("C", seed, "versions")
    trng = rng_for("C", seed, "text")
    versions: Dict[tuple, List[str]] = {}     # (day, metric) -> record ids, oldest first
    pubs: Dict[str, _dt.date] = {}
    split_day: Dict[_dt.date, str] = {}
    for d, row in targets:
        if d.year == UNSEEN_YEAR:
            sp = "test_year"
        elif d in held:
            sp = "test_date"
        else:
            u = vrng.random()
            sp = "val" if u < 0.06 else "test_template" if u < 0.18 else "train"
        split_day[d] = sp
        for metric, (noun, unit) in METRICS.items():
            obs = float(row[metric])
            leads = sorted({1} | set(vrng.sample(range(2, 8), vrng.randint(2, 6))), reverse=True)
            ids = []
            for v, ahead in enumerate(leads + [0], start=1):
                pub = d - _dt.timedelta(days=ahead)
                value = obs if ahead == 0 else _forecast(vrng, metric, obs, ahead)
                fmt = trng.choice(DAY_DOC_FORMATS)
                issued = format_date(pub, trng.choice(("month_d_yyyy", "iso", "d_month_yyyy")))
                vals = {"metric": noun, "value": f"{value:.1f}", "unit": unit, "issued": issued}
                if ahead == 0:
                    tpl = trng.randrange(len(OBSERVED_TEMPLATES))
                    text, spans, _ = render(OBSERVED_TEMPLATES[tpl], fmt, d, vals)
                    tpl += 100
                else:
                    tpl = trng.randrange(len(FORECAST_TEMPLATES))
                    text, spans, _ = _render2(FORECAST_TEMPLATES[tpl], fmt, d, vals)
                rid = f"C:{metric}:{d.isoformat()}:v{v}"
                r = day_rank(FIRST_YEAR, d)
                b.record(rid, text, spans, interval=Interval(r, r), key=(d.year, d.month, d.day), published=pub,
                         entity="Seattle", attribute=noun, date=d, template=tpl, masked=False,
                         facts=[{"head": "Seattle", "relation": noun, "value": f"{value:.1f} {unit}"}],
                         version=v, lead_days=ahead, observed=ahead == 0, split=sp, date_format=fmt)
                ids.append(rid)
                pubs[rid] = pub
            versions[(d, metric)] = ids
    # ---- queries
    qrng = rng_for("C", seed, "queries")
    per_split: Dict[str, List[tuple]] = defaultdict(list)
    for (d, metric) in versions:
        per_split[split_day[d]].append((d, metric))
    train_keys = {k for k in versions if split_day[k[0]] == "train"}
    for split in ("train", "val", "test_template", "test_date", "test_year"):
        n = caps.get(split)   # two queries (Type A and B) per (day, metric)
        for d, metric in cap(rng_for("C", seed, f"cap/{split}"), per_split[split], None if n is None else n // 2):
            noun = METRICS[metric][0]
            ids = versions[(d, metric)]
            pool_a = [t for t in QUERY_A if (t in HELD_OUT_TEMPLATES) == (split == "test_template")]
            pool_b = [t for t in QUERY_B if (t in HELD_OUT_TEMPLATES) == (split == "test_template")]
            twin = _twin(d, metric, versions, qrng, train_keys if split == "train" else None)
            r = day_rank(FIRST_YEAR, d)
            # Type A: explicit target date -> the latest version (the observation)
            tpl = qrng.choice(pool_a)
            fmt = qrng.choice(DAY_QUERY_FORMATS)
            text, spans, _ = render(QUERY_A[tpl], fmt, d, {"metric": noun})
            qid = f"q:A:{metric}:{d.isoformat()}"
            b.query(qid, text, spans, interval=Interval(r, r), gold={ids[-1]: 1}, split=split, entity="Seattle",
                    attribute=noun, date=d, template=tpl, kind="explicit",
                    answer=b.records[_index(b, ids[-1])].meta["facts"][0]["value"], time_wrong_twin=twin,
                    versions=ids, date_format=fmt)
            if split == "train":
                _row(b, qid, text, ids[-1], ids[:-1], twin, d, metric, versions, split_day, qrng)
            # Type B: "the latest forecast" for a day relative to the query time
            fmt_b = qrng.choice(QUERY_B_FORMATS)
            ahead = 1 if fmt_b == "tomorrow" else qrng.randint(1, 7)
            qt = d - _dt.timedelta(days=ahead)
            assert expressible(d, fmt_b, ref=qt)
            avail = [i for i in ids if pubs[i] <= qt]
            if not avail:
                continue
            gold = avail[-1]
            tpl = qrng.choice(pool_b)
            text, spans, expr = render(QUERY_B[tpl], fmt_b, d, {"metric": noun}, ref=qt)
            qid = f"q:B:{metric}:{d.isoformat()}"
            b.query(qid, text, spans, interval=Interval(r, r), gold={gold: 1}, split=split, entity="Seattle",
                    attribute=noun, date=d, template=tpl, kind="latest", query_time=qt,
                    answer=b.records[_index(b, gold)].meta["facts"][0]["value"], time_wrong_twin=twin,
                    versions=ids, relative={"expr": expr, "format": fmt_b, "anchor": iso(qt), "resolves_to": iso(d)},
                    date_format=fmt_b)
            if split == "train":
                _row(b, qid, text, gold, [i for i in avail[:-1]], twin, d, metric, versions, split_day, qrng)
    for k, (metric, (noun, unit)) in enumerate(METRICS.items()):
        members = [i for (d, m), ids in sorted(versions.items()) if m == metric for i in ids]
        for j, tpl in enumerate(("What {metric} do Seattle weather forecasts give?", "Seattle {metric} forecasts")):
            text, spans = fill(tpl, {"metric": noun})
            b.query(f"q:timeless:{metric}:{j}", text, spans, interval=None, gold={i: 1 for i in members},
                    split="timeless", entity="Seattle", attribute=noun, date=None, template=100 + j, kind="timeless",
                    answer=None)
    info = {"calendar": CALENDAR, "unseen_year": UNSEEN_YEAR, "held_out_dates": len(held),
            "held_out_templates": list(HELD_OUT_TEMPLATES), "target_days": len(targets),
            "synthetic": "forecast versions are synthetic (noise around the observed value); observations are real",
            "sources": {"seattle-weather.csv": "vega-datasets"}}
    return b, info


def _render2(template, fmt, d, vals):
    """Forecast templates carry the issue date too: both dates are temporal spans."""
    expr = format_date(d, fmt)
    t = template.replace("{when}", preposition(fmt) + "{date}")
    text, spans = fill(t, {**vals, "date": expr}, temporal=("date", "issued"))
    return text, spans, expr


def _index(b: Builder, rid: str) -> int:
    idx = getattr(b, "_ridx", None)
    if idx is None or len(idx) != len(b.records):
        idx = b._ridx = {r.id: i for i, r in enumerate(b.records)}
    return idx[rid]


def _twin(d, metric, versions, rng, allowed) -> Optional[str]:
    """The latest version of the same metric on a nearby other day (±1, ±7 days, ±1 year)."""
    for k in rng.sample((1, -1, 7, -7, 365, -365), 6):
        key = (d + _dt.timedelta(days=k), metric)
        if key in versions and (allowed is None or key in allowed):
            return versions[key][-1]
    return None


def _row(b, qid, text, positive, outdated, twin, d, metric, versions, split_day, rng):
    negs, kinds = [], []
    for o in outdated[-2:]:
        negs.append(o)
        kinds.append("outdated")
    if twin is not None:
        negs.append(twin)
        kinds.append("time_wrong")
    other = [m for m in METRICS if m != metric and (d, m) in versions]
    if other:
        negs.append(versions[(d, rng.choice(other))][-1])
        kinds.append("attribute_wrong")
    b.rows.append(TrainRow(qid, text, positive, negs, kinds, []))
