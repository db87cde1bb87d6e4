"""The offline English generators (tempokern.datasets.synth): determinism per seed, the cache, no split
leakage (asserted over the generated data), masked dates resolvable from `published`, negatives wrong in the
stated attribute, intervals and temporal spans, set C's version order; and CTD training on set B through the
CLI with a tiny backbone."""
import datetime as dt
import json
import os
from collections import defaultdict

import pytest

pytest.importorskip("holidays")
pytest.importorskip("vega_datasets")

from tempokern.calendar import Calendar
from tempokern.datasets import synth
from tempokern.datasets.synth import HELD_OUT, generate_synth, load_synth
from tempokern.text.dates import FORMAT_GRANULARITY, format_date

D = dt.date.fromisoformat


@pytest.fixture(scope="module")
def sets():
    return {n: generate_synth(n, seed=0, size="quick") for n in ("A", "B", "C")}


@pytest.fixture(scope="module")
def full_b():
    return generate_synth("B", seed=0, size="full")


def _all(sets, full_b):
    return list(sets.values()) + [full_b]


# ---- determinism and cache --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_same_seed_same_set_other_seed_other_set(sets, name):
    a = sets[name]
    again = generate_synth(name, seed=0, size="quick")
    assert again.info["checksum"] == a.info["checksum"]
    assert [(r.id, r.text, r.published, r.interval) for r in again.dataset.records] == \
        [(r.id, r.text, r.published, r.interval) for r in a.dataset.records]
    assert [(q.id, q.text, q.split, q.gold) for q in again.dataset.queries] == \
        [(q.id, q.text, q.split, q.gold) for q in a.dataset.queries]
    assert [vars(t) for t in again.train_rows] == [vars(t) for t in a.train_rows]
    other = generate_synth(name, seed=1, size="quick")
    assert other.info["checksum"] != a.info["checksum"]
    assert [r.text for r in other.dataset.records] != [r.text for r in a.dataset.records]
    assert {q.id: q.split for q in other.dataset.queries} != {q.id: q.split for q in a.dataset.queries}


def test_cache_is_written_once_verified_and_regenerated_when_damaged(tmp_path, monkeypatch, sets):
    s = load_synth("C", seed=0, size="quick", cache_dir=tmp_path)
    assert s.info["checksum"] == sets["C"].info["checksum"]
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and not any(p.name.startswith(".") for p in files)
    path = files[0]
    calls = []
    real = synth._payload
    monkeypatch.setattr(synth, "_payload", lambda *a: calls.append(a) or real(*a))
    s2 = load_synth("C", seed=0, size="quick", cache_dir=tmp_path)       # from the cache
    assert calls == [] and s2.info["checksum"] == s.info["checksum"]
    assert [r.text for r in s2.dataset.records] == [r.text for r in s.dataset.records]
    data = bytearray(path.read_bytes())
    i = data.index(b"Seattle", len(data) // 2)
    data[i] = ord("X")                                                   # one flipped byte
    path.write_bytes(bytes(data))
    s3 = load_synth("C", seed=0, size="quick", cache_dir=tmp_path)       # detected, regenerated
    assert len(calls) == 1 and s3.info["checksum"] == s.info["checksum"]
    assert b"SXattle" not in path.read_bytes()
    path.write_bytes(path.read_bytes()[:1000])                            # truncated
    assert load_synth("C", seed=0, size="quick", cache_dir=tmp_path).info["checksum"] == s.info["checksum"]
    assert len(calls) == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="name"):
        load_synth("D")
    with pytest.raises(ValueError, match="size"):
        load_synth("A", size="medium")
    with pytest.raises(TypeError, match="seed"):
        load_synth("A", seed="0")


# ---- structure ----------------------------------------------------------------------------------------

def test_every_record_has_its_interval_key_spans_and_meta(sets, full_b):
    for s in _all(sets, full_b):
        cal = s.calendar
        assert isinstance(cal, Calendar) and cal.name.startswith("gregorian")
        month = cal.name == "gregorian-month"
        for r in s.dataset.records:
            assert r.interval is not None, r.id
            key = tuple(r.key)
            assert r.interval == cal.span(key), r.id                    # the calendar's own arithmetic
            d = D(r.meta["date"])
            assert key[0] == d.year and (len(key) == 1 or key[1] == d.month)
            if not month and len(key) == 3:
                assert key[2] == d.day
            for k in ("entity", "attribute", "date", "template", "masked", "facts", "temporal_spans", "version"):
                assert k in r.meta, (r.id, k)
            assert r.meta["facts"] and set(r.meta["facts"][0]) == {"head", "relation", "value"}
            spans = r.meta["temporal_spans"]
            assert spans, r.id
            for a, b in spans:
                assert 0 <= a < b <= len(r.text) and r.text[a:b].strip() == r.text[a:b]
            if s.name == "A":
                assert len(spans) == 1, r.text                          # TMRL: one temporal expression
            if s.name in ("B", "C"):
                assert isinstance(r.published, dt.date)
        for q in s.dataset.queries:
            assert q.split in synth.QUERY_SPLITS
            assert q.gold and all(g in s.dataset for g in q.gold)
            for k in ("entity", "attribute", "date", "template", "kind", "query_time", "temporal_spans",
                      "time_wrong_twin", "answer"):
                assert k in q.meta, (q.id, k)
            assert q.family == q.meta["kind"]
            for a, b in q.meta["temporal_spans"]:
                assert 0 <= a < b <= len(q.text)
            if q.split == "timeless":
                assert q.interval is None and q.meta["temporal_spans"] == [] and q.meta["kind"] == "timeless"
                assert all(s.dataset.record(g).meta["attribute"] == q.meta["attribute"] for g in q.gold) \
                    or s.name == "A"
            elif q.interval is not None:
                assert all(s.dataset.record(g).interval.overlaps(q.interval) for g in q.gold), q.id


def test_splits_and_kinds_present(sets, full_b):
    want = {"A": {"train", "val", "test_template", "test_date", "test_year", "timeless"},
            "B": {"train", "val", "test_template", "test_date", "test_year", "test_masked", "timeless"},
            "C": {"train", "val", "test_template", "test_date", "test_year", "timeless"}}
    for s in _all(sets, full_b):
        assert set(s.dataset.splits()) == want[s.name]
    assert {q.family for q in sets["A"].dataset.queries} == {"explicit", "implicit", "temporal_answer", "timeless"}
    assert {q.family for q in sets["C"].dataset.queries} == {"explicit", "latest", "timeless"}
    # the documents of set B are written with >= 8 paraphrase templates per source, queries with 8
    for src in ("employment", "stock", "seattle"):
        used = {r.meta["template"] for r in full_b.dataset.records if r.meta["source"] == src}
        assert len(used) >= 8, src
    # query date forms vary independently of the document's (same fact, different surface forms)
    diff = [q for q in full_b.dataset.queries if q.split != "timeless"
            and q.meta["date_format"] != full_b.dataset.record(next(iter(q.gold))).meta["date_format"]]
    assert len(diff) > 0.5 * sum(1 for q in full_b.dataset.queries if q.split != "timeless")


# ---- leakage ------------------------------------------------------------------------------------------

def _date_unit(s, rec) -> str:
    """A record's date at the resolution its split is held out at: the month on set B's month calendar,
    the year for year-level records (set A's yearly electricity figures), else the day."""
    iso_date = rec.meta["date"]
    if len(rec.key) == 1:
        return iso_date[:4]
    return iso_date[:7] if s.calendar.name == "gregorian-month" else iso_date


def test_no_held_out_passage_template_or_date_in_training_rows(sets, full_b):
    for s in _all(sets, full_b):
        ds = s.dataset
        by_split = defaultdict(list)
        for q in ds.queries:
            by_split[q.split].append(q)
        train_q = {q.id: q for q in by_split["train"]}
        assert train_q and len(s.train_rows) == len(train_q)
        row_docs = set()
        for t in s.train_rows:
            assert t.query_id in train_q and train_q[t.query_id].text == t.query
            assert t.positive in train_q[t.query_id].gold
            row_docs.add(t.positive)
            row_docs.update(t.hard_negatives)
        row_dates = {_date_unit(s, ds.record(d)) for d in row_docs}
        row_years = {int(ds.record(d).meta["date"][:4]) for d in row_docs}
        row_years |= {int(q.meta["date"][:4]) for q in train_q.values() if q.meta["date"]}
        train_templates = {q.meta["template"] for q in train_q.values()}
        for split in HELD_OUT:
            held_docs = {g for q in by_split[split] for g in q.gold}
            assert not (held_docs & row_docs), (s.name, split, sorted(held_docs & row_docs)[:3])
        # gold passages of every held-out query are never a training query's gold either
        train_gold = {g for q in train_q.values() for g in q.gold}
        for split in HELD_OUT:
            assert not ({g for q in by_split[split] for g in q.gold} & train_gold), (s.name, split)
        held_t = {q.meta["template"] for q in by_split["test_template"]}
        assert held_t and not (held_t & train_templates), (s.name, held_t, train_templates)
        test_dates = {_date_unit(s, ds.record(g)) for q in by_split["test_date"] for g in q.gold}
        assert test_dates and not (test_dates & row_dates), (s.name, sorted(test_dates & row_dates)[:3])
        year = s.info["unseen_year"]
        assert by_split["test_year"] and all(int(q.meta["date"][:4]) == year for q in by_split["test_year"])
        assert year not in row_years, s.name
        # negative queries name no held-out date (at the set's resolution) and not the unseen year
        for t in s.train_rows:
            for nq in t.negative_queries:
                assert str(year) not in nq, nq


# ---- masked dates -------------------------------------------------------------------------------------

def test_masked_dates_resolve_from_published(sets, full_b):
    for s in (sets["B"], full_b):
        masked = [r for r in s.dataset.records if r.meta["masked"]]
        assert 0.25 < len(masked) / len(s.dataset.records) < 0.35
        fmts = set()
        for r in masked:
            rel = r.meta["relative"]
            fmts.add(rel["format"])
            assert rel["anchor"] == r.published.isoformat()
            target = D(rel["resolves_to"])
            assert rel["resolves_to"] == r.meta["date"]
            # the generator's rule, re-applied: the expression is exactly what the target is relative to
            # the publication date, and it is the text's temporal span
            assert format_date(target, rel["format"], ref=r.published) == rel["expr"]
            (a, b), = r.meta["temporal_spans"]
            assert r.text[a:b].lower() == rel["expr"].lower()
            assert r.interval == s.calendar.span((target.year, target.month))
            # the exact date is not in the text (a coarse form keeps at most the month)
            for f in ("iso", "month_d_yyyy", "d_month_yyyy", "us_slash", "abbr_d_yyyy", "d_abbr_yyyy"):
                assert format_date(target, f) not in r.text
            if FORMAT_GRANULARITY[rel["format"]] == "day":
                for f in ("yyyy_mm", "month_yyyy", "abbr_yyyy", "mm_yyyy"):
                    assert format_date(target, f) not in r.text
            if rel["format"] in ("yesterday", "days_ago", "last_weekday", "last_month", "today"):
                assert str(target.year) not in r.text, r.text       # nothing but `published` dates it
        assert {"last_month", "yesterday", "last_weekday", "days_ago", "nth_month_of_yyyy"} <= fmts
        # every masked document's queries are in test_masked (unless in the unseen year)
        for q in s.dataset.queries:
            if q.split in ("timeless",):
                continue
            rec = s.dataset.record(next(iter(q.gold)))
            if rec.meta["masked"] and q.split != "test_year":
                assert q.split == "test_masked"
            if q.split == "test_masked":
                assert rec.meta["masked"]


def test_masked_dates_through_parse_time(sets):
    from tempokern.text import parse_time
    for r in sets["B"].dataset.records:
        if not r.meta["masked"]:
            continue
        t = parse_time(r.text, ref=r.published)
        d = D(r.meta["date"])
        assert t is not None and (t.year, t.month) == (d.year, d.month), r.text
        if FORMAT_GRANULARITY[r.meta["relative"]["format"]] == "day":
            assert t.day == d.day, r.text


# ---- negatives ----------------------------------------------------------------------------------------

def test_negatives_are_wrong_in_the_stated_attribute(sets, full_b):
    for s in _all(sets, full_b):
        ds = s.dataset
        seen = set()
        for t in s.train_rows:
            p = ds.record(t.positive)
            assert len(t.hard_negatives) == len(t.negative_kinds)
            assert t.positive not in t.hard_negatives
            for nid, kind in zip(t.hard_negatives, t.negative_kinds):
                n = ds.record(nid)
                pm, nm = p.meta, n.meta
                seen.add(kind)
                same_e, same_a, same_d = (pm["entity"] == nm["entity"], pm["attribute"] == nm["attribute"],
                                          pm["date"] == nm["date"])
                if kind == "time_wrong":
                    assert same_e and same_a and not same_d, (t.query, n.text)
                elif kind == "entity_wrong":
                    assert same_a and same_d and not same_e, (t.query, n.text)
                elif kind == "attribute_wrong":
                    assert same_e and same_d and not same_a, (t.query, n.text)
                elif kind == "outdated":
                    assert same_e and same_a and same_d and n.published < p.published, (t.query, n.text)
                else:
                    raise AssertionError(kind)
            for nq in t.negative_queries:
                assert nq != t.query
        want = {"A": {"time_wrong", "entity_wrong"}, "B": {"time_wrong", "entity_wrong", "attribute_wrong"},
                "C": {"time_wrong", "attribute_wrong", "outdated"}}[s.name]
        assert want <= seen, (s.name, seen)
        if s.name in ("A", "B"):
            assert sum(bool(t.negative_queries) for t in s.train_rows) > 0.5 * len(s.train_rows)
        for q in ds.queries:
            tw = q.meta["time_wrong_twin"]
            if tw is None:
                continue
            g, n = ds.record(next(iter(q.gold))), ds.record(tw)
            assert (g.meta["entity"], g.meta["attribute"]) == (n.meta["entity"], n.meta["attribute"])
            assert g.meta["date"] != n.meta["date"]


# ---- set C --------------------------------------------------------------------------------------------

def test_set_c_versions_ordered_by_published_and_gold_is_latest(sets):
    s = sets["C"]
    ds = s.dataset
    groups = defaultdict(list)
    for r in ds.records:
        groups[(r.meta["attribute"], r.meta["date"])].append(r)
    for key, rs in groups.items():
        rs.sort(key=lambda r: r.meta["version"])
        assert [r.meta["version"] for r in rs] == list(range(1, len(rs) + 1))
        pubs = [r.published for r in rs]
        assert all(a < b for a, b in zip(pubs, pubs[1:])), key
        assert rs[-1].meta["observed"] and rs[-1].published == D(key[1])
        assert all(1 <= (D(key[1]) - r.published).days <= 7 for r in rs[:-1])
        assert len(rs) >= 4
    for q in ds.queries:
        if q.meta["kind"] == "explicit":
            vs = q.meta["versions"]
            assert list(q.gold) == [vs[-1]] and ds.record(vs[-1]).meta["observed"]
        elif q.meta["kind"] == "latest":
            qt = D(q.meta["query_time"])
            (g,) = q.gold
            ok = [v for v in q.meta["versions"] if ds.record(v).published <= qt]
            assert g == max(ok, key=lambda v: ds.record(v).published)
            rel = q.meta["relative"]
            assert format_date(D(rel["resolves_to"]), rel["format"], ref=qt) == rel["expr"]
            assert rel["resolves_to"] == q.meta["date"] and rel["expr"] in q.text


# ---- the training path --------------------------------------------------------------------------------

def test_ctd_trains_on_synth_b_through_the_cli(tmp_path, monkeypatch):
    from tempokern.cli import main
    monkeypatch.setenv("TEMPOKERN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    rc = main(["train", "--method", "ctd", "--dataset", "synth-b", "--synth-size", "quick", "--backbone", "tiny",
               "--epochs", "1", "--max-steps", "4", "--batch-size", "8", "--max-length", "48", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    logs = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines()]
    steps = [l for l in logs if l["event"] == "step"]
    evals = [l for l in logs if l["event"] == "eval"]
    assert len(steps) == 4 and all(l["loss"] == l["loss"] and l["loss"] > 0 for l in steps)
    assert evals and evals[-1]["split"] == "val" and 0 <= evals[-1]["R@1"] <= 1
    assert (out / "best").is_dir()
    assert any(p.name.startswith("synth-B-quick") for p in (tmp_path / "cache" / "synth").iterdir())
    assert main(["train", "--method", "nope", "--dataset", "synth-b", "--out", str(tmp_path / "x")]) == 2
    # the registry entry is the set itself, and `eval --split` accepts its splits
    from tempokern.training.data import check_split, load_dataset
    ds = load_dataset("synth-b", synth_size="quick")
    assert [r.id for r in ds.records] == [r.id for r in load_synth("B", size="quick").dataset.records]
    for split in ("test_template", "test_date", "test_year", "test_masked", "timeless", "val"):
        assert check_split(split, ds) == split
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("synth-d")
