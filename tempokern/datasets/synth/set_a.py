"""Set A — TMRL-style explicit-time QA ("Holidays & records").

Facts (entity, event, date) from the ``holidays`` package (15 countries x 1990-2030; holidays a country
observes in at least 10 of those years, English names, no "observed"/"estimated" substitutes and no days
shared by two holidays) and from vega-datasets records (``la-riots.csv``: 63 dated deaths in the 1992 Los
Angeles riots; ``iowa-electricity.csv``: yearly net generation per source, 2001-2017). Each passage holds
exactly one temporal expression (TMRL's rule); its character span is known from generation.

Queries (TMRL's three types): *explicit* ("Which German holiday was on 22 April 2019?", gold = that
passage), *implicit* ("What holiday came after Good Friday in Germany in 2019?", an Allen-style relation to
another event of the same year) and *temporal_answer* ("When was Easter Monday in Germany in 2019?", the
answer is the date). Training rows carry negative queries per passage (TMRL's rules: the adjacent year, a
shifted non-overlapping date, the same date in another country). Time-less queries ("Which public holidays
does Germany observe?") have every passage of the entity as gold.

Calendar: ``Calendar.gregorian(1990, 2030, resolution="day")``."""
from __future__ import annotations

import datetime as _dt
import warnings
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from ...calendar import Interval
from ._common import Builder, TrainRow, cap, day_rank, fill, iso, rng_for, vega_csv
from .set_b import render

FIRST_YEAR, LAST_YEAR = 1990, 2030
UNSEEN_YEAR = 2030
CALENDAR = {"first_year": FIRST_YEAR, "last_year": LAST_YEAR, "resolution": "day"}
COUNTRIES = {"US": ("the United States", "American"), "GB": ("the United Kingdom", "British"),
             "DE": ("Germany", "German"), "FR": ("France", "French"), "IT": ("Italy", "Italian"),
             "ES": ("Spain", "Spanish"), "CA": ("Canada", "Canadian"), "AU": ("Australia", "Australian"),
             "JP": ("Japan", "Japanese"), "IN": ("India", "Indian"), "BR": ("Brazil", "Brazilian"),
             "MX": ("Mexico", "Mexican"), "NL": ("the Netherlands", "Dutch"), "SE": ("Sweden", "Swedish"),
             "IE": ("Ireland", "Irish")}
QUICK_COUNTRIES = ("US", "DE", "FR", "JP")
QUICK_FIRST_YEAR = 2012
SKIP_WORDS = (";", "observed", "estimated", "substitute", "day off", "bridge", "mourning", "jubilee",
              "millennium", "funeral", "coronation", "election", "wedding")
DATE_HOLDOUT = 0.08

PASSAGE_TEMPLATES = (
    "{holiday} was observed in {country} {when}.",
    "{when}, {country} celebrated {holiday}.",
    "{country_cap} marked {holiday} {when}.",
    "The {adj} public holiday {holiday} took place {when}.",
    "{when}, people in {country} had a day off for {holiday}.",
    "Holiday calendar of {country}: {holiday}, {date}.",
    "{holiday} in {country} was held {when}.",
    "Public holiday notice: {country} observes {holiday} {when}.",
    "{date} was {holiday} in {country}.",
)
# template ids: explicit 0-3, implicit 10-13, temporal_answer 20-23; the last of each kind is held out
QUERY_TEMPLATES = {
    "explicit": {0: "Which {adj} holiday was on {date}?", 1: "What public holiday did {country} observe {when}?",
                 2: "{adj} holiday {when}", 3: "Name the holiday {country} celebrated {when}."},
    "implicit": {10: "What holiday came after {other} in {country} in {year}?",
                 11: "Which {adj} holiday followed {other} in {year}?",
                 12: "What was the next public holiday in {country} after {other} in {year}?",
                 13: "In {year}, which holiday did {country} observe right after {other}?"},
    "temporal_answer": {20: "When was {holiday} in {country} in {year}?", 21: "On what date did {country} observe {holiday} in {year}?",
                        22: "{holiday} {country} {year} date", 23: "What day was {holiday} celebrated in {country} in {year}?"},
}
HELD_OUT_TEMPLATES = (3, 13, 23, 33, 43)
RIOT_PASSAGES = (
    "{name}, {age}, died {when} in {place}, Los Angeles ({cause}).",
    "{when}, {name} ({age}) was killed in {place} during the Los Angeles riots; cause: {cause}.",
    "Los Angeles riots victim {name}, aged {age}, died in {place} {when} ({cause}).",
)
RIOT_QUERIES = {"explicit": {30: "Who died in {place} {when} during the Los Angeles riots?",
                             31: "Which riot victim died in {place} on {date}?",
                             32: "Los Angeles riots death in {place} {when}",
                             33: "Name the person killed in {place}, Los Angeles, {when}."},
                "temporal_answer": {40: "When did {name} die in the Los Angeles riots?",
                                    41: "On what date was {name} killed in Los Angeles?",
                                    42: "{name} date of death Los Angeles riots",
                                    43: "What day did {name} die in {place}?"}}
IOWA_PASSAGES = ("Iowa generated {value} thousand MWh of electricity from {source} in {date}.",
                 "In {date}, {source} supplied {value} thousand MWh of Iowa's electricity.",
                 "Iowa net generation from {source}, {date}: {value} thousand MWh.")
IOWA_QUERIES = {"explicit": {30: "How much electricity did Iowa generate from {source} in {date}?",
                             31: "Iowa {source} generation in {date}",
                             32: "What was Iowa's net generation from {source} in {date}?",
                             33: "Give Iowa's {source} electricity output for {date}."},
                "temporal_answer": {40: "In which year did Iowa generate {value} thousand MWh from {source}?",
                                    41: "When did Iowa's {source} generation reach {value} thousand MWh?",
                                    42: "year Iowa {source} {value} thousand MWh",
                                    43: "What year saw {value} thousand MWh of Iowa electricity from {source}?"}}
TIMELESS = {"holiday": ("Which public holidays does {country} observe?", "{adj} public holidays"),
            "riot": ("Who died during the Los Angeles riots?", "Los Angeles riots victims"),
            "iowa": ("How much electricity does Iowa generate from {source}?", "Iowa {source} electricity generation")}
DAY_FORMATS = ("iso", "us_slash", "month_d_yyyy", "d_month_yyyy", "abbr_d_yyyy", "d_abbr_yyyy",
               "month_ordinal_yyyy", "ordinal_of_month_yyyy", "weekday_month_d_yyyy", "weekday_d_month_yyyy",
               "weekday_iso")


class Fact:
    __slots__ = ("source", "entity", "attribute", "date", "end", "values", "rid", "code")

    def __init__(self, source, entity, attribute, date, values, end=None, code=None):
        self.source, self.entity, self.attribute, self.date, self.values = source, entity, attribute, date, values
        self.end = end or date
        self.rid, self.code = None, code

    @property
    def date_key(self) -> str:
        return str(self.date.year) if self.source == "iowa" else self.date.isoformat()


def _holiday_facts(size: str) -> List[Fact]:
    import holidays
    quick = size == "quick"
    first = QUICK_FIRST_YEAR if quick else FIRST_YEAR
    codes = QUICK_COUNTRIES if quick else tuple(COUNTRIES)
    out = []
    for code in codes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                h = holidays.country_holidays(code, years=range(first, LAST_YEAR + 1), language="en_US")
            except (NotImplementedError, ValueError, KeyError):   # pragma: no cover - older holidays
                h = holidays.country_holidays(code, years=range(first, LAST_YEAR + 1))
            items = sorted(h.items())
        per_date: Dict[_dt.date, List[str]] = defaultdict(list)
        for d, name in items:
            per_date[d].append(name)
        years_of: Dict[str, set] = defaultdict(set)
        for d, names in per_date.items():
            if len(names) == 1:
                years_of[names[0]].add(d.year)
        country, adj = COUNTRIES[code]
        need = 5 if quick else 10
        for d, names in sorted(per_date.items()):
            if len(names) != 1:
                continue
            name = names[0]
            if any(w in name.lower() for w in SKIP_WORDS) or len(years_of[name]) < need:
                continue
            out.append(Fact("holiday", country, name, d, {"holiday": name, "country": country,
                                                          "country_cap": country[0].upper() + country[1:],
                                                          "adj": adj}, code=code))
    return out


def _vega_facts() -> List[Fact]:
    out = []
    for row in vega_csv("la-riots.csv"):
        d = _dt.date.fromisoformat(row["death_date"])
        name = f"{row['first_name']} {row['last_name']}".strip()
        out.append(Fact("riot", name, "death in the Los Angeles riots", d,
                        {"name": name, "age": row["age"] or "of unknown age", "place": row["neighborhood"],
                         "cause": row["type"].lower()}))
    for row in vega_csv("iowa-electricity.csv"):
        y = int(row["year"][:4])
        d = _dt.date(y, 1, 1)
        src = row["source"].lower()
        v = f"{int(float(row['net_generation'])):,}"
        out.append(Fact("iowa", "Iowa", f"electricity from {src}", d, {"source": src, "value": v},
                        end=_dt.date(y, 12, 31)))
    return out


def generate(seed: int, size: str, caps: Dict[str, Optional[int]]) -> Tuple[Builder, dict]:
    b = Builder("A")
    facts = _holiday_facts(size) + _vega_facts()
    rng = rng_for("A", seed, "facts")
    keys = sorted({f.date_key for f in facts if f.date.year != UNSEEN_YEAR})
    day_keys = [k for k in keys if len(k) > 4]
    year_keys = [k for k in keys if len(k) == 4]
    held = set(rng.sample(day_keys, int(len(day_keys) * DATE_HOLDOUT)))
    held.update(rng.sample(year_keys, max(1, len(year_keys) // 8)) if year_keys else ())
    split_of = {}
    group_split: Dict[tuple, str] = {}   # riot victims of one place and day answer the same query: one split
    for i, f in enumerate(facts):
        if f.date.year == UNSEEN_YEAR:
            split_of[i] = "test_year"
        elif f.date_key in held:
            split_of[i] = "test_date"
        else:
            g = ("riot", f.date, f.values["place"]) if f.source == "riot" else ("fact", i)
            if g not in group_split:
                u = rng.random()
                group_split[g] = "val" if u < 0.05 else "test_template" if u < 0.17 else "train"
            split_of[i] = group_split[g]
    trng = rng_for("A", seed, "text")
    for i, f in enumerate(facts):
        if f.source == "iowa":
            tpl = trng.randrange(len(IOWA_PASSAGES))
            text, spans, _ = render(IOWA_PASSAGES[tpl], "yyyy", f.date, f.values)
            fmt = "yyyy"
            key = (f.date.year,)
        else:
            pool = PASSAGE_TEMPLATES if f.source == "holiday" else RIOT_PASSAGES
            tpl = trng.randrange(len(pool))
            fmt = trng.choice(DAY_FORMATS)
            text, spans, _ = render(pool[tpl], fmt, f.date, f.values)
            key = (f.date.year, f.date.month, f.date.day)
        assert len(spans) == 1, text
        f.rid = f"A:{f.source}:{_slug(f.entity)}:{_slug(f.attribute)}:{f.date_key}"
        iv = Interval(day_rank(FIRST_YEAR, f.date), day_rank(FIRST_YEAR, f.end))
        b.record(f.rid, text, spans, interval=iv, key=key, published=None, entity=f.entity, attribute=f.attribute,
                 date=f.date, template=tpl, masked=False,
                 facts=[{"head": f.entity, "relation": f.attribute, "value": _value(f)}], source=f.source,
                 split=split_of[i], date_format=fmt)
    # ---- indexes
    by_key = {(f.source, f.entity, f.attribute, f.date.year): i for i, f in enumerate(facts)}
    country_year: Dict[tuple, List[int]] = defaultdict(list)
    by_attr_date: Dict[tuple, List[int]] = defaultdict(list)
    by_entity_date: Dict[tuple, List[int]] = defaultdict(list)
    same_day: Dict[tuple, List[int]] = defaultdict(list)
    for i, f in enumerate(facts):
        if f.source == "holiday":
            country_year[(f.entity, f.date.year)].append(i)
        by_attr_date[(f.source, f.attribute, f.date)].append(i)
        by_entity_date[(f.source, f.entity, f.date)].append(i)
        same_day[(f.source, f.date, f.values.get("place"))].append(i)
    for v in country_year.values():
        v.sort(key=lambda i: facts[i].date)
    qrng = rng_for("A", seed, "queries")
    is_train = lambda j: split_of[j] == "train"   # noqa: E731

    def time_twin(i, allowed) -> Optional[int]:
        f = facts[i]
        for dy in qrng.sample((1, -1, 2, -2), 4):
            j = by_key.get((f.source, f.entity, f.attribute, f.date.year + dy))
            if j is not None and allowed(j):
                return j
        return None

    by_split: Dict[str, List[int]] = defaultdict(list)
    for i in range(len(facts)):
        by_split[split_of[i]].append(i)
    for split in ("train", "val", "test_template", "test_date", "test_year"):
        for i in cap(rng_for("A", seed, f"cap/{split}"), by_split[split], caps.get(split)):
            f = facts[i]
            kind, tpl, text, spans, gold, iv, answer, qdate = _query(f, i, facts, split, qrng, country_year,
                                                                      same_day)
            twin = time_twin(i, is_train if split == "train" else (lambda j: True))
            qid = f"q:{f.rid[2:]}"
            b.query(qid, text, spans, interval=iv, gold=gold, split=split, entity=f.entity, attribute=f.attribute,
                    date=qdate, template=tpl, kind=kind, answer=answer,
                    time_wrong_twin=facts[twin].rid if twin is not None else None, source=f.source)
            if split != "train":
                continue
            negs, kinds = [], []
            if twin is not None:
                negs.append(facts[twin].rid)
                kinds.append("time_wrong")
            ew = [j for j in by_attr_date[(f.source, f.attribute, f.date)] if j != i and is_train(j)]
            if ew:
                negs.append(facts[qrng.choice(ew)].rid)
                kinds.append("entity_wrong")
            aw = [j for j in by_entity_date[(f.source, f.entity, f.date)] if j != i and is_train(j)]
            if aw:
                negs.append(facts[qrng.choice(aw)].rid)
                kinds.append("attribute_wrong")
            b.rows.append(TrainRow(qid, text, f.rid, negs, kinds, _negative_queries(f, twin, facts, qrng, held)))
    # ---- time-less
    groups: Dict[tuple, List[int]] = defaultdict(list)
    for i, f in enumerate(facts):
        gk = (f.source, f.entity) if f.source == "holiday" else (f.source, "") if f.source == "riot" \
            else (f.source, f.attribute)
        groups[gk].append(i)
    for (src, ent), members in sorted(groups.items()):
        f = facts[members[0]]
        for k, tpl in enumerate(TIMELESS[src]):
            text, spans = fill(tpl, f.values)
            b.query(f"q:timeless:{src}:{_slug(ent) or 'all'}:{k}", text, spans, interval=None,
                    gold={facts[j].rid: 1 for j in members}, split="timeless",
                    entity=f.entity if src != "riot" else "Los Angeles riots",
                    attribute=f.attribute if src != "holiday" else "public holidays", date=None,
                    template=100 + k, kind="timeless", answer=None, source=src)
    info = {"calendar": CALENDAR, "unseen_year": UNSEEN_YEAR, "held_out_dates": len(held),
            "held_out_templates": list(HELD_OUT_TEMPLATES),
            "countries": list(QUICK_COUNTRIES if size == "quick" else COUNTRIES),
            "sources": {"holidays": _holidays_version(), "la-riots.csv": "vega-datasets",
                        "iowa-electricity.csv": "vega-datasets"}}
    return b, info


def _value(f: Fact) -> str:
    if f.source == "holiday":
        return f.attribute
    if f.source == "riot":
        return f.values["cause"]
    return f.values["value"]


def _templates(f: Fact, kind: str) -> Dict[int, str]:
    if f.source == "holiday":
        return QUERY_TEMPLATES[kind]
    return (RIOT_QUERIES if f.source == "riot" else IOWA_QUERIES)[kind]


def _pick_template(pool: Dict[int, str], split: str, rng) -> int:
    ids = sorted(pool)
    if split == "test_template":
        ids = [t for t in ids if t in HELD_OUT_TEMPLATES]
    else:
        ids = [t for t in ids if t not in HELD_OUT_TEMPLATES]
    return rng.choice(ids)


def _query(f: Fact, i: int, facts, split, rng, country_year, same_day):
    """(kind, template, text, spans, gold, interval, answer, date) of one query whose gold includes fact i."""
    year_iv = Interval(day_rank(FIRST_YEAR, _dt.date(f.date.year, 1, 1)), day_rank(FIRST_YEAR, _dt.date(f.date.year, 12, 31)))
    day_iv = Interval(day_rank(FIRST_YEAR, f.date), day_rank(FIRST_YEAR, f.end))
    u = rng.random()
    if f.source == "holiday":
        seq = country_year[(f.entity, f.date.year)]
        pos = seq.index(i)
        if u < 0.2 and (pos > 0 or pos + 1 < len(seq)):
            kind = "implicit"
            tpl = _pick_template(QUERY_TEMPLATES[kind], split, rng)
            other = facts[seq[pos - 1]] if pos > 0 else None
            if other is None:   # only "after" templates: relate to the previous holiday
                kind = "temporal_answer"
            else:
                text, spans = fill(QUERY_TEMPLATES[kind][tpl], {**f.values, "other": other.attribute,
                                                                "year": str(f.date.year)}, temporal=("year",))
                return kind, tpl, text, spans, {f.rid: 1}, year_iv, f.attribute, f.date
        else:
            kind = "explicit" if u < 0.65 else "temporal_answer"
    else:
        kind = "explicit" if u < 0.6 else "temporal_answer"
    pool = _templates(f, kind)
    tpl = _pick_template(pool, split, rng)
    if kind == "explicit":
        fmt = "yyyy" if f.source == "iowa" else rng.choice(DAY_FORMATS)
        text, spans, _ = render(pool[tpl], fmt, f.date, f.values)
        gold = {f.rid: 1}
        if f.source == "riot":   # every victim of that place and day answers it
            gold = {facts[j].rid: 1 for j in same_day[(f.source, f.date, f.values.get("place"))]}
        return kind, tpl, text, spans, gold, day_iv, _value(f), f.date
    if f.source == "iowa":
        text, spans = fill(pool[tpl], f.values)
        return kind, tpl, text, spans, {f.rid: 1}, None, str(f.date.year), None
    if f.source == "riot":
        text, spans = fill(pool[tpl], f.values)
        return kind, tpl, text, spans, {f.rid: 1}, None, f.date.isoformat(), None
    text, spans = fill(pool[tpl], {**f.values, "year": str(f.date.year)}, temporal=("year",))
    return kind, tpl, text, spans, {f.rid: 1}, year_iv, f.date.isoformat(), f.date


def _negative_queries(f: Fact, twin, facts, rng, held) -> List[str]:
    """TMRL's negative-query rules for a passage: the same question about the adjacent year, about a
    shifted date that overlaps no passage of the entity, and about the same date in another country."""
    if f.source != "holiday":
        return []
    out = []
    fmt = rng.choice(DAY_FORMATS)
    tpl = QUERY_TEMPLATES["temporal_answer"][20]
    if twin is not None:
        out.append(fill(tpl, {**f.values, "year": str(facts[twin].date.year)})[0])
    shifted = f.date + _dt.timedelta(days=rng.choice((-1, 1)) * rng.randint(14, 60))
    if shifted.year != UNSEEN_YEAR and shifted.isoformat() not in held:
        out.append(render(QUERY_TEMPLATES["explicit"][1], fmt, shifted, f.values)[0])
    others = [c for c in COUNTRIES.values() if c[0] != f.entity]
    c, adj = rng.choice(others)
    out.append(render(QUERY_TEMPLATES["explicit"][0], fmt, f.date, {**f.values, "country": c, "adj": adj})[0])
    return out


def _holidays_version() -> str:
    try:
        from importlib.metadata import version
        return f"holidays {version('holidays')}"
    except Exception:   # pragma: no cover
        return "holidays"


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s.lower()).strip("_")
