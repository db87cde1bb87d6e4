"""Glue between tempokern.datasets (RetrievalDataset: records, queries, calendar) and training:
time-ordered splits for corpora that come without them, window queries, the Zizhi Tongjian
demo set, and the tensors (spans, level labels) the losses need."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..calendar import LEAP_MONTH, Interval
from ..datasets import (ZZTJ_TEMPLATES, Query, RetrievalDataset, load_chunqiutr, load_chunqiutr_release, load_synth,
                        load_zztj, load_zztj_sample, zztj_time_text)

SPLITS = ("train", "val", "dev", "test")
#: the held-out rows of the offline English sets (tempokern.datasets.synth)
SYNTH_SPLITS = ("test_template", "test_date", "test_year", "test_masked", "timeless")
#: `load_dataset(dataset=...)` names of the offline English sets -> load_synth names
SYNTH_DATASETS = {"synth-a": "A", "synth-b": "B", "synth-c": "C"}
FORMATS = ("zztj", "chunqiutr", "chunqiutr-release")
#: where the CTD trainer's hard negatives come from (CTDConfig.hard_negative_source)
NEGATIVE_SOURCES = ("auto", "query", "group", "months")
#: the CTD loss's positives (CTDConfig.positives): "overlap" (ChunQiuTR: every in-batch document whose
#: interval overlaps the query's), "overlap_group" (those sharing the query's group as well, plus its own gold)
POSITIVES = ("auto", "overlap", "overlap_group")
#: where calendar-CE targets come from (CTDConfig.calendar_labels): "key" (a record's calendar key), "interval"
#: (the key, else the calendar unit holding the record's whole interval)
CALENDAR_LABELS = ("auto", "key", "interval")


def check_split(split: str, dataset=None, *, allow_all: bool = True) -> str:
    ok = SPLITS + SYNTH_SPLITS + (("all",) if allow_all else ())
    if split not in ok:
        raise ValueError(f"unknown split {split!r}: expected one of {', '.join(ok)}")
    if dataset is not None and split != "all" and not any(q.split == split for q in dataset.queries):
        have = sorted({str(q.split) for q in dataset.queries})
        raise ValueError(f"dataset {dataset.name!r} has no queries in split {split!r} (it has {have})")
    return split


def queries_of(dataset, split: str):
    check_split(split, dataset)
    return list(dataset.queries) if split == "all" else dataset.queries_in(split)


def block_split_of_rank(rank: int, block: int = 3, period: int = 6, val: int = 2, test: int = 5) -> str:
    """Contiguous time blocks of `block` units; in every `period` blocks, block `val` is
    validation and block `test` is test (so no unit is in two splits, and held-out months sit
    between training months as in ChunQiuTR's reign-aligned splits)."""
    b = (rank // block) % period
    return "val" if b == val else "test" if b == test else "train"


def with_block_splits(dataset, *, block: int = 3, period: int = 6, val: int = 2, test: int = 5):
    """A copy whose queries without a split get one from `block_split_of_rank`
    (a query whose interval crosses splits is marked "mixed" and used by no split)."""
    qs = []
    for q in dataset.queries:
        if q.split is None and q.interval is not None:
            s = {block_split_of_rank(r, block, period, val, test) for r in q.interval.ranks()}
            q = dataclasses.replace(q, split=s.pop() if len(s) == 1 else "mixed")
        qs.append(q)
    return RetrievalDataset(dataset.name, dataset.records, qs, dataset.calendar, dataset.report)


WINDOW_TEMPLATES = ("{start}至{end}，有何事？", "自{start}至{end}，所记何事？", "{start}到{end}之间发生了什么？",
                    "《通鉴》{start}至{end}之事。")


def add_window_queries(dataset, *, block: int = 3, templates: Sequence[str] = WINDOW_TEMPLATES[:1],
                       time_text=None):
    """Window-family queries over consecutive `block`-unit intervals of the rank axis that hold
    event records, one per template (meta["template_index"]); gold = those records."""
    cal = dataset.calendar
    if time_text is None:
        time_text = zztj_time_text
    events = [r for r in dataset.records if r.type == "event" and r.interval is not None]
    qs = list(dataset.queries)
    for start in range(0, cal.num_units, block):
        iv = Interval(start, min(cal.num_units, start + block) - 1)
        gold = {r.id: 1 for r in events if r.interval.overlaps(iv)}
        if not gold:
            continue
        for t, tpl in enumerate(templates):
            text = tpl.format(start=time_text(cal.key_at(iv.start)), end=time_text(cal.key_at(iv.end)))
            qid = f"w:{cal.key_str(cal.key_at(iv.start))}" + (f"#{t}" if t else "")
            qs.append(Query(qid, text, interval=iv, family="window", gold=gold, meta={"template_index": t}))
    return RetrievalDataset(dataset.name, dataset.records, qs, cal, dataset.report)


SPLIT_SCHEMES = ("template", "time")


def with_template_splits(dataset, *, val: int = 2, test: int = 3):
    """Split queries by phrasing: template `val` -> val, `test` -> test, the others train. Every
    month is in every split, so this measures mapping new phrasings of dates to the (seen)
    records, not generalisation to unseen months (use the time scheme for that)."""
    qs = []
    for q in dataset.queries:
        t = q.meta.get("template_index")
        if t is None:
            raise ValueError(f"query {q.id!r} has no template index; the template split needs generated queries")
        qs.append(dataclasses.replace(q, split="val" if t == val else "test" if t == test else "train"))
    return RetrievalDataset(dataset.name, dataset.records, qs, dataset.calendar, dataset.report)


def zztj_demo_dataset(path=None, *, templates_per_month: int = 4, no_event_queries: bool = True,
                      split: str = "template", on_error: str = "raise"):
    """The demo's Zizhi Tongjian set: the loader's records (with synthesized no_event records),
    point queries under `templates_per_month` templates (no_event_queries: also for the empty
    months, gold = their no_event record, as ChunQiuTR trains on them) and window queries over
    3-month blocks. split="template": queries split by phrasing (see with_template_splits);
    split="time": by 3-month blocks (held-out months, see with_block_splits)."""
    if split not in SPLIT_SCHEMES:
        raise ValueError(f"unknown split scheme {split!r}: expected one of {', '.join(SPLIT_SCHEMES)}")
    base_load = ((lambda **kw: load_zztj(str(path), on_error=on_error, **kw)) if path is not None
                 else load_zztj_sample)
    load = lambda **kw: base_load(no_event_queries=no_event_queries, **kw)  # noqa: E731
    base = load()
    n = min(templates_per_month, len(ZZTJ_TEMPLATES))
    qs = []
    for t in range(n):
        # one template for every month (the loader rotates templates by rank otherwise)
        for q in load(templates=(ZZTJ_TEMPLATES[t],)).queries:
            qs.append(dataclasses.replace(q, id=f"{q.id}#{t}" if t else q.id, meta={**q.meta, "template_index": t}))
    ds = RetrievalDataset(base.name, base.records, qs, base.calendar, base.report)
    ds = add_window_queries(ds, templates=WINDOW_TEMPLATES[:n])
    return with_template_splits(ds) if split == "template" else with_block_splits(ds)


def load_dataset(dataset: Optional[str] = None, data: Optional[str] = None, fmt: str = "zztj",
                 split: str = "template", queries: Optional[str] = None, *, synth_size: str = "full",
                 synth_seed: int = 0, on_error: str = "raise"):
    """`dataset="zztj"`: the packaged sample as the demo uses it; `data=PATH`: a file in format
    `fmt`: "zztj" (Zizhi Tongjian jsonl; queries generated, split by `split`), "chunqiutr"
    (records jsonl + `queries` jsonl, ChunQiuTR format) or "chunqiutr-release" (the release's meta
    JSON + `queries` jsonl); the ChunQiuTR formats take their splits from Calendar.chunqiu().
    `dataset="synth-a" | "synth-b" | "synth-c"`: the offline English sets
    (`tempokern.datasets.synth.load_synth`, generated at first use and cached; `synth_size`,
    `synth_seed`), with their own splits and calendars. `on_error`: "raise" or "skip" (malformed rows
    of a `data` file are left out and listed in the dataset's report)."""
    if (dataset is None) == (data is None):
        raise ValueError("give exactly one of --dataset (zztj) or --data PATH")
    if dataset is not None:
        if dataset in SYNTH_DATASETS:
            return load_synth(SYNTH_DATASETS[dataset], seed=synth_seed, size=synth_size).dataset
        if dataset != "zztj":
            raise ValueError(f"unknown dataset {dataset!r}: the packaged datasets are 'zztj', "
                             f"{', '.join(repr(k) for k in SYNTH_DATASETS)} (or pass --data PATH)")
        return zztj_demo_dataset(split=split)
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}: expected one of {', '.join(FORMATS)}")
    p = Path(data)
    if not p.exists():
        raise FileNotFoundError(f"data file {p} does not exist")
    if fmt == "zztj":
        return zztj_demo_dataset(p, split=split, on_error=on_error)
    if queries is None:
        raise ValueError(f"format {fmt!r} needs the queries file too (--data-queries PATH)")
    if not Path(queries).exists():
        raise FileNotFoundError(f"queries file {queries} does not exist")
    load = load_chunqiutr if fmt == "chunqiutr" else load_chunqiutr_release
    return load(str(p), str(queries), on_error=on_error)


# ---- what the losses see ------------------------------------------------------------------------

def record_span(rec, i: int) -> Tuple[int, int]:
    """A record's interval on the rank axis; an untimed record gets a private negative point so it
    overlaps nothing (its own diagonal is then its only positive)."""
    if rec.interval is None:
        return (-2 - i, -2 - i)
    return (rec.interval.start, rec.interval.end)


def resolve_positives(dataset, positives: str, group_key: str = "page") -> str:
    """``positives`` with "auto" resolved: "overlap_group" when records carry ``meta[group_key]`` (TimeQA, a BEIR
    folder with a page column: entity-keyed records, where overlap alone makes other entities' records
    positives), else "overlap" (the annals: ChunQiuTR, Zizhi Tongjian, whose records form one chronicle)."""
    if positives not in POSITIVES:
        raise ValueError(f"positives must be one of {POSITIVES}, got {positives!r}")
    has = any(group_key in (r.meta or {}) for r in dataset.records)
    if positives == "auto":
        return "overlap_group" if has else "overlap"
    if positives == "overlap_group" and not has:
        raise ValueError(f"positives='overlap_group' needs records with meta[{group_key!r}] (the group key); dataset "
                         f"{dataset.name!r} has none: use positives='overlap' or another group_key")
    return positives


def group_ids(items, group_key: str, ids: Dict) -> List[int]:
    """One int per record or query: its ``meta[group_key]`` numbered through ``ids`` (a dict shared by records
    and queries, so that equal values get equal ids); items without the key share one group (id 0)."""
    out = []
    for x in items:
        v = (x.meta or {}).get(group_key)
        out.append(0 if v is None else ids.setdefault(str(v), len(ids) + 1))
    return out


def resolve_calendar_labels(dataset, mode: str) -> str:
    """``calendar_labels`` with "auto" resolved: "interval" when no record carries a calendar key but some carry
    an interval (TimeQA: dated paragraphs without keys), else "key" (the annals: every event record has its
    month key; their labels stay exactly as they are)."""
    if mode not in CALENDAR_LABELS:
        raise ValueError(f"calendar_labels must be one of {CALENDAR_LABELS}, got {mode!r}")
    if mode != "auto":
        return mode
    keyed = any(r.key is not None for r in dataset.records)
    timed = any(r.interval is not None for r in dataset.records)
    return "interval" if not keyed and timed else "key"


def interval_key(cal, interval) -> Optional[Tuple]:
    """The calendar unit holding the whole interval, as a key prefix: the levels on which the keys of its first
    and last unit agree (a Gregorian year/month calendar: (year, month) for an interval inside one month,
    (year,) inside one year, None when it crosses a year boundary)."""
    if interval is None:
        return None
    try:
        a, b = tuple(cal.key_at(interval.start)), tuple(cal.key_at(interval.end))
    except (IndexError, KeyError, ValueError):
        return None
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n] or None


def record_labels(dataset, rec, *, from_interval: bool = False) -> List[float]:
    """Per-level class indices of a record's calendar key (-1 where unknown), the targets of the
    calendar heads. An intercalary month (reign calendars: the month level's last slot, 闰) placed
    after month m < 12 gets the month label (m - 1) + 0.5: half on month m, half on month m + 1,
    so the u the heads learn lies between them, in chronological order (the grid's 13th slot
    would put it after month 12). A leap month after month 12 keeps the slot: it is chronological.
    A record whose key has fewer components than the calendar has levels (e.g. a year-level record
    without a month) gets -1 on the missing levels. ``from_interval``: a record without a key takes
    :func:`interval_key` of its interval (the unit holding it: year and month, the year alone, or nothing)."""
    cal = dataset.calendar
    L = cal.num_levels
    key = rec.key
    if key is None and from_interval:
        key = interval_key(cal, rec.interval)
    if key is None:
        return [-1] * L
    key = tuple(key)
    try:
        if len(key) < L:
            return [float(cal._level_index(l, c, key)) for l, c in enumerate(key)] + [-1] * (L - len(key))
        out = [float(i) for i in cal.index(key)]
    except (KeyError, ValueError, TypeError):
        return [-1] * L
    after = _leap_after(cal, key)
    if after is not None and after < cal.sizes[-1] - 1:
        out[-1] = (after - 1) + 0.5
    return out


def _leap_after(cal, key) -> Optional[int]:
    """m when `key` is a reign calendar's intercalary month placed after month m, else None."""
    if key[-1] != LEAP_MONTH:
        return None
    for t, y, m in cal.meta.get("leap_months", ()):
        if (t, y) == (key[0], key[1]):
            return int(m)
    return None


def gold_indices(dataset, split: str = "train") -> List[Tuple[int, List[int]]]:
    """(query index, record indices of its gold records) for every query of `split` with at least
    one gold record in the dataset."""
    rid = {r.id: i for i, r in enumerate(dataset.records)}
    out = []
    for qi, q in enumerate(dataset.queries):
        if q.split != split:
            continue
        gold = [rid[d] for d in q.relevant_ids() if d in rid]   # score > 0 (is_relevant)
        if gold:
            out.append((qi, gold))
    return out


def training_pairs(dataset, split: str = "train", *, per_query: Optional[int] = None,
                   rng=None, gold=None) -> List[Tuple[int, int]]:
    """(query index, record index) for the gold records of every query of `split`; per_query caps
    how many of a query's gold records are used (a random subset drawn with `rng`; per_query=1 is
    ChunQiuTR's sampler: one positive drawn per query and epoch). `gold`: the output of
    :func:`gold_indices`, when the caller has it already."""
    pairs = []
    for qi, g in (gold if gold is not None else gold_indices(dataset, split)):
        if per_query is not None and len(g) > per_query:
            g = (rng.sample(g, per_query) if rng is not None else g[:per_query])
        pairs.extend((qi, x) for x in g)
    return pairs


def num_training_pairs(gold, per_query: Optional[int]) -> int:
    """len(training_pairs(...)) without drawing them."""
    return sum(len(g) if per_query is None else min(per_query, len(g)) for _, g in gold)


def train_units(dataset, split: str = "train") -> set:
    """Rank units of the training split: the calendar's `split` units when the calendar carries
    splits (ChunQiuTR's month splits), otherwise every unit some `split` query targets (under the
    time-block scheme those are the training blocks; under the template scheme every month)."""
    cal = dataset.calendar
    if cal is not None and getattr(cal, "has_splits", False):
        return {r for r in range(cal.num_units) if cal.split_of_interval(_unit(r)) == split}
    units = set()
    for q in dataset.queries:
        if q.split == split and q.interval is not None:
            units.update(q.interval.ranks())
    return units


def _unit(r: int):
    return Interval(r, r)


class HardNegatives:
    """ChunQiuTR's hard-negative sampler (``ChunqiuTrainDataset._sample_negative_sids`` and the
    collator's pick), restricted to the training split's months:

    * candidates of a query: the neg_comment records of the training months its interval covers,
      all of whose own months are training months;
    * the reference draws a pool of `pool` (16) negatives, the local candidates first, topped up
      with random training-month negatives, and the collator takes one at random from the pool;
      this draws the same distribution directly: a local candidate with probability
      min(n_local, pool) / min(pool, n_local + n_rest), otherwise a uniform other training-month
      negative.

    Lookups are O(1) per pair: a month -> negatives map, and each query's candidate list built
    once and cached."""

    def __init__(self, dataset, units: set, pool: int = 16):
        self.data, self.units, self.pool = dataset, units, pool
        self.by_unit: Dict[int, List[int]] = {}
        self.all: List[int] = []
        for i, r in enumerate(dataset.records):
            if r.type != "neg_comment" or r.interval is None:
                continue
            rs = r.interval.ranks()
            if not all(u in units for u in rs):
                continue
            self.all.append(i)
            for u in rs:
                self.by_unit.setdefault(u, []).append(i)
        self._local: Dict[int, Tuple[List[int], set]] = {}

    def __bool__(self) -> bool:
        return bool(self.all)

    def local(self, qi: int) -> Tuple[List[int], set]:
        got = self._local.get(qi)
        if got is None:
            q = self.data.queries[qi]
            seen, out = set(), []
            if q.interval is not None:
                for u in q.interval.ranks():
                    for i in self.by_unit.get(u, ()):
                        if i not in seen:
                            seen.add(i)
                            out.append(i)
            got = self._local[qi] = (out, seen)
        return got

    def pick(self, qi: int, pos: int, rng) -> Optional[int]:
        """One negative for query `qi` whose sampled positive is record `pos` (never `pos`)."""
        local, local_set = self.local(qi)
        if pos in local_set:
            local = [i for i in local if i != pos]
            local_set = set(local)
        n_local = len(local)
        n_rest = len(self.all) - n_local - (1 if pos not in local_set and pos in self._all_set else 0)
        total = min(self.pool, n_local + n_rest)
        if total <= 0:
            return None
        k = rng.randrange(total)
        if k < min(n_local, self.pool):
            return local[rng.randrange(n_local)]
        for _ in range(64):
            c = self.all[rng.randrange(len(self.all))]
            if c != pos and c not in local_set:
                return c
        rest = [c for c in self.all if c != pos and c not in local_set]
        return rest[rng.randrange(len(rest))]

    @property
    def _all_set(self) -> set:
        s = getattr(self, "_all_set_cache", None)
        if s is None:
            s = self._all_set_cache = set(self.all)
        return s


class QueryNegatives:
    """Hard negatives the data provides per training query, for the CTD trainer
    (``CTDConfig.hard_negative_source``); ChunQiuTR trains on negatives of the same record group / page
    as the positive when its data has them.

    * ``"query"``: the record ids in ``query.meta["negatives"]`` (a list, e.g. the other entries of the
      positive's page; written by a loader or by hand);
    * ``"group"``: the records that share the value of ``record.meta[group_key]`` (default ``"group"``,
      e.g. a page or chapter id) with one of the query's gold records;
    * ``"auto"``: the query's own list when it has one, else its gold records' group.

    A query's gold records are never its negatives; an id in ``meta["negatives"]`` that is not a record of the
    dataset raises a ValueError naming the query. :meth:`pick` draws one candidate uniformly (never the pair's
    positive); :meth:`has` says whether a query has any candidate (the trainer falls back to the month sampler
    for the others under ``"auto"``)."""

    def __init__(self, dataset, split: str = "train", *, source: str = "auto", group_key: str = "group"):
        if source not in ("auto", "query", "group"):
            raise ValueError(f"source must be one of 'auto', 'query', 'group', got {source!r}")
        rid = {r.id: i for i, r in enumerate(dataset.records)}
        by_group: Dict[object, List[int]] = {}
        if source in ("auto", "group"):
            for i, r in enumerate(dataset.records):
                g = (r.meta or {}).get(group_key)
                if g is not None:
                    by_group.setdefault(g, []).append(i)
        self.cands: Dict[int, List[int]] = {}
        for qi, q in enumerate(dataset.queries):
            if q.split != split:
                continue
            gold = {rid[d] for d in q.relevant_ids() if d in rid}
            out: List[int] = []
            given = (q.meta or {}).get("negatives") if source in ("auto", "query") else None
            if given is not None:
                if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
                    raise ValueError(f"query {q.id!r}: meta['negatives'] must be a list of record ids, "
                                     f"got {type(given).__name__}")
                for d in given:
                    if d not in rid:
                        raise ValueError(f"query {q.id!r}: meta['negatives'] names record {d!r}, which is not in "
                                         f"dataset {dataset.name!r}")
                    out.append(rid[d])
            if not out and source in ("auto", "group"):
                for gi in sorted(gold):
                    g = (dataset.records[gi].meta or {}).get(group_key)
                    out.extend(by_group.get(g, ()) if g is not None else ())
            seen, uniq = set(), []
            for i in out:
                if i not in gold and i not in seen:
                    seen.add(i)
                    uniq.append(i)
            if uniq:
                self.cands[qi] = uniq

    def __bool__(self) -> bool:
        return bool(self.cands)

    def __len__(self) -> int:
        return len(self.cands)

    def has(self, qi: int) -> bool:
        return qi in self.cands

    def pick(self, qi: int, pos: int, rng) -> Optional[int]:
        """One candidate of query ``qi`` (never ``pos``), uniformly; None when it has none."""
        c = [i for i in self.cands.get(qi, ()) if i != pos]
        return c[rng.randrange(len(c))] if c else None
