"""Perturbed copies of a synthetic set (tempokern.datasets.synth.perturb): a second, wrong year in front of a
seeded share of the documents, or no publication dates; what the rule parser then reads; and the suite running
the perturbed set under its name with the base set's methods."""
import datetime as dt

import pytest

from tempokern.datasets.synth.perturb import perturb, split_name
from tempokern.suite.runner import run_suite
from tempokern.text import parse_time
from test_suite import one_thread, tiny_backbone, tiny_synth  # noqa: F401  (fixtures)


def test_second_date_prefixes_another_year_and_keeps_the_rest():
    base = tiny_synth()
    p = perturb(base, "second_date", share=0.7, seed=0)
    assert p.name == "B-2date" and p.info["perturbation"]["kind"] == "second_date"
    assert p.dataset.queries == base.dataset.queries and p.train_rows is base.train_rows
    changed = 0
    for r0, r in zip(base.dataset.records, p.dataset.records):
        assert (r.id, r.interval, r.published) == (r0.id, r0.interval, r0.published)
        if r.text == r0.text:
            assert r.meta == r0.meta
            continue
        changed += 1
        assert r.text.endswith(r0.text)
        other = r.meta["second_date"]
        year = dt.date.fromisoformat(r0.meta["date"]).year
        assert other != year and abs(other - year) <= 6
        spans = r.meta["temporal_spans"]
        assert r.text[spans[0][0]:spans[0][1]] == str(other)
        shift = len(r.text) - len(r0.text)
        assert [[a - shift, b - shift] for a, b in spans[1:]] == r0.meta["temporal_spans"]
        # the first-date rule now reads the wrong year
        assert parse_time(r.text).year == other
    n = len(base.dataset.records)
    assert p.info["perturbation"]["records_changed"] == changed
    assert 0.55 * n <= changed <= 0.85 * n
    # deterministic, and the choice of a record depends on its id only
    again = perturb(base, "second_date", share=0.7, seed=0)
    assert [r.text for r in again.dataset.records] == [r.text for r in p.dataset.records]
    assert perturb(base, "second_date", seed=1).info["checksum"] != p.info["checksum"]
    assert all(r.text == r0.text for r, r0 in zip(perturb(base, "second_date", share=0.0).dataset.records,
                                                  base.dataset.records))


def test_no_pub_drops_every_publication_date():
    base = tiny_synth()
    base.dataset.records[0] = base.dataset.records[0].__class__(**{**base.dataset.records[0].__dict__,
                                                                    "published": dt.date(2010, 2, 1)})
    p = perturb(base, "no_pub")
    assert p.name == "B-nopub" and all(r.published is None for r in p.dataset.records)
    assert [r.text for r in p.dataset.records] == [r.text for r in base.dataset.records]
    assert p.info["perturbation"]["records_changed"] == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown perturbation"):
        perturb(tiny_synth(), "shuffle")
    with pytest.raises(ValueError, match="share"):
        perturb(tiny_synth(), "second_date", share=1.5)
    assert split_name("B-2date") == ("B", "second_date") and split_name("B") == ("B", None)
    with pytest.raises(ValueError, match="perturbed set"):
        split_name("B-x")


def test_suite_runs_a_perturbed_set_with_the_base_sets_methods(tmp_path, tiny_backbone):
    pytest.importorskip("bm25s")
    res = run_suite(tmp_path, quick=True, sets=["B", "B-2date"], methods=["bm25_ties_last", "minilm_zeroshot"],
                    synth_loader=tiny_synth, backbone_path=tiny_backbone, progress=False, log=lambda m: None,
                    n_resamples=50, plots=False)
    assert set(res["results"]) == {"B", "B-2date"}
    assert res["setup"]["set_info"]["B-2date"]["info"]["perturbation"]["kind"] == "second_date"
    assert set(res["results"]["B-2date"]["test_date"]) == {"bm25_ties_last", "minilm_zeroshot"}
