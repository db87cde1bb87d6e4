import datetime as dt
import json

import numpy as np
import pytest
from conftest import shared_data
import torch

import tempokern
from tempokern import Calendar
from tempokern.calendar import LEAP_MONTH, Interval

SPLITS = shared_data("chunqiu/time_splits_by_month_v1.json")


@pytest.fixture(scope="module")
def cq():
    return Calendar.chunqiu()


def test_chunqiu_shape_and_counts(cq):
    assert cq.names == ("duke", "year", "month")
    assert cq.sizes == (12, 32, 12)
    assert cq.num_slots == 4608 and cq.num_units == len(cq) == 3036
    counts = {s: len(cq.split_keys(s)) for s in ("train", "val", "test")}
    assert counts == {"train": 2424, "val": 295, "test": 317}
    # years per duke of the Lu timeline (253 reign years in all)
    years = [len(cq.valid_children((g,))) for g in range(1, 13)]
    assert years == [11, 18, 32, 2, 32, 18, 18, 18, 31, 32, 15, 26]
    assert cq.padding_mask().sum() == 3036


def test_chunqiu_matches_packaged_file_and_shared_copy(cq):
    import os
    from tempokern._resources import load_chunqiu_splits
    raw = load_chunqiu_splits()
    for k, s in raw.items():
        assert cq.split(k) == s
    if os.path.exists(SPLITS):  # the shared original, when present
        with open(SPLITS, encoding="utf-8") as f:
            assert json.load(f)["split_by_sort_key"] == raw


def test_chunqiu_splits_are_reign_aligned_blocks(cq):
    # every (duke, year) lies in one split except Duke Min (split by months), and no month is in two
    for g in range(1, 13):
        for y in cq.valid_children((g,)):
            s = {cq.split((g, y + 1, m)) for m in range(1, 13)}
            assert len(s) == 1 or g == 4


def test_grid_position_is_calendar_scalar_axis(cq):
    keys = [(1, 1, 1), (5, 3, 12), (12, 26, 12), (4, 2, 7)]
    for g, y, m in keys:
        want = ((g - 1) * 32 * 12 + (y - 1) * 12 + (m - 1)) / (12 * 32 * 12 - 1)
        assert cq.position((g, y, m)) == pytest.approx(want, abs=1e-15)
    # one-hot logits -> calendar_scalar gives the same u
    idx = cq.targets(keys)
    logits = [torch.full((len(keys), n), -1e4, dtype=torch.float64) for n in cq.sizes]
    for l in range(3):
        logits[l][torch.arange(len(keys)), torch.as_tensor(idx[:, l])] = 1e4
    u = tempokern.reference.calendar_scalar(logits)
    assert np.allclose(u.numpy(), cq.positions(keys), atol=1e-12)
    u2 = tempokern.calendar_scalar(logits)
    assert np.allclose(u2.numpy(), cq.positions(keys), atol=1e-12)


def test_key_index_rank_roundtrip(cq):
    for r in [0, 1, 131, 755, 3035]:
        k = cq.key_at(r)
        assert cq.rank(k) == r
        assert cq.key(cq.index(k)) == k
        assert cq.key(cq.flat(k)) == k
        assert cq.parse(cq.key_str(k)) == k
        assert cq.from_position(cq.position(k)) == k
        assert cq.from_position(cq.position(k, "rank"), "rank") == k
    assert cq.rank((1, 1, 1)) == 0 and cq.rank((12, 26, 12)) == 3035
    assert cq.position((12, 26, 12), "rank") == 1.0
    # names are aliases of dukes
    assert cq.parse(("Xi", 1, 1)) == cq.parse("僖公-1-1") == cq.parse("5-01-1") == (5, 1, 1)
    # ranks are chronological: sorted (g, y, m)
    keys = list(cq)
    assert keys == sorted(keys)


def test_padding_and_errors(cq):
    assert cq.is_real((4, 2, 12)) and not cq.is_real((4, 3, 1))
    assert (4, 3, 1) not in cq and (4, 2, 1) in cq
    with pytest.raises(KeyError, match="padding"):
        cq.rank((4, 3, 1))
    with pytest.raises(KeyError, match="not a label of level 'month'"):
        cq.index((1, 1, 13))
    with pytest.raises(KeyError, match="not a label of level 'duke'"):
        cq.index(("Nobody", 1, 1))
    with pytest.raises(ValueError, match="expects 3"):
        cq.index((1, 1))
    with pytest.raises(TypeError):
        cq.index(1.5)
    with pytest.raises(IndexError):
        cq.key_at(3036)
    with pytest.raises(ValueError, match="axis"):
        cq.position((1, 1, 1), axis="time")
    # the nearest real month to a padding slot's grid position is real
    pad_u = cq.position((4, 3, 1))
    assert cq.is_real(cq.from_position(pad_u))


def test_intervals(cq):
    xi = cq.span((5,))
    assert len(xi) == 32 * 12 and cq.key_at(xi.start) == (5, 1, 1) and cq.key_at(xi.end) == (5, 32, 12)
    iv = cq.interval((5, 3), (5, 4, 6))
    assert (iv.start, iv.end) == (cq.rank((5, 3, 1)), cq.rank((5, 4, 6))) and len(iv) == 18
    assert cq.span((4,)) == Interval(cq.rank((4, 1, 1)), cq.rank((4, 2, 12)))
    # interval across a duke boundary skips the padding years in between
    cross = cq.interval((4, 2, 12), (5, 1, 1))
    assert len(cross) == 2
    assert iv.overlaps(xi) and iv.overlap(xi) == 18 and not iv.overlaps(Interval(0, 5))
    assert cq.split_of_interval(cq.span((1, 1))) == "train"
    assert cq.split_of_interval(cq.interval((1, 1), (1, 2))) == "mixed"
    with pytest.raises(ValueError):
        Interval(3, 2)
    with pytest.raises(ValueError, match="before"):
        cq.interval((5, 4), (5, 3))
    with pytest.raises(KeyError, match="no real unit"):
        cq.span((4, 5))


def test_reign_calendar_with_leap_month():
    cal = Calendar.reign([("建元", 4, 479), ("永明", 11, 483)], leap_months={("建元", 2): 9})
    assert cal.sizes == (2, 11, 13)
    assert cal.num_units == 15 * 12 + 1
    r9 = cal.rank(("建元", 2, 9))
    assert cal.rank(("建元", 2, LEAP_MONTH)) == r9 + 1 == cal.rank(("建元", 2, "L"))
    assert cal.rank(("建元", 2, 10)) == r9 + 2
    assert cal.rank(("永明", 1, 1)) == cal.rank(("建元", 4, 12)) + 1
    assert not cal.is_real(("建元", 3, LEAP_MONTH))
    assert cal.ad_year(("永明", 2, 5)) == 484
    # grid: the leap month takes the year's last slot
    assert cal.index(("建元", 2, LEAP_MONTH)) == (0, 1, 12)
    # ranks chronological, round trip through to_dict / from_dict
    back = Calendar.from_dict(json.loads(json.dumps(cal.to_dict(), ensure_ascii=False)))
    assert list(back) == list(cal) and back.sizes == cal.sizes
    assert back.rank(("建元", 2, "L")) == r9 + 1 and back.ad_year(("永明", 2, 5)) == 484
    cq = Calendar.chunqiu()
    cq2 = Calendar.from_dict(json.loads(json.dumps(cq.to_dict())))
    assert cq2.split(("Xi", 10, 1)) == cq.split((5, 10, 1)) == "val" and len(cq2) == 3036
    with pytest.raises(ValueError, match="unknown era"):
        Calendar.reign([("建元", 4)], leap_months={("永明", 1): 3})
    with pytest.raises(ValueError, match="positive"):
        Calendar.reign([("建元", 0)])


def test_reign_without_leap_has_12_months():
    cal = Calendar.reign([("A", 2), ("B", 3)])
    assert cal.sizes == (2, 3, 12) and cal.num_units == 60
    assert cal.valid_children(("A",)) == [0, 1]


def test_gregorian():
    g = Calendar.gregorian(1999, 2001)
    assert g.sizes == (3, 12, 31)
    assert g.num_units == 365 + 366 + 365
    assert g.rank(dt.date(2000, 3, 1)) == 365 + 31 + 29
    assert g.rank("2000-03-01") == g.rank((2000, 3, 1))
    assert not g.is_real("2001-02-29") and g.is_real("2000-02-29")
    assert len(g.span("2000-02")) == 29 and len(g.span("2000")) == 366
    for d in [dt.date(1999, 1, 1), dt.date(2000, 12, 31), dt.date(2001, 7, 4)]:
        assert g.key_at(g.rank(d)) == (d.year, d.month, d.day)
        assert (d - dt.date(1999, 1, 1)).days == g.rank(d)
    m = Calendar.gregorian(2000, 2009, resolution="month")
    assert m.sizes == (10, 12) and m.num_units == 120 and m.rank("2003-02") == 3 * 12 + 1
    with pytest.raises(ValueError):
        Calendar.gregorian(2001, 2000)
    with pytest.raises(ValueError):
        Calendar.gregorian(2000, 2001, resolution="week")


def test_generic_calendar_validation():
    c = Calendar([("era", ["a", "b"]), ("step", 3)], units=[("a", 1), ("a", 2), ("b", 1)])
    assert c.num_units == 3 and c.num_slots == 6
    assert c.position(("b", 1)) == pytest.approx(3 / 5)
    assert c.position(("b", 1), "rank") == 1.0
    with pytest.raises(ValueError, match="twice"):
        Calendar([("x", 3)], units=[1, 1])
    with pytest.raises(ValueError, match="duplicate labels"):
        Calendar([("x", [1, "1"])])
    with pytest.raises(TypeError):
        Calendar("month")
    with pytest.raises(ValueError, match="every unit"):
        Calendar([("x", 3)], splits={1: "train"})


def test_packaged_data_is_verified(monkeypatch):
    from tempokern import _resources
    assert len(_resources.read_bytes(_resources.ZZTJ_QIJI)) == 156960
    monkeypatch.setitem(_resources._SHA256, _resources.ZZTJ_QIJI, "0" * 64)
    with pytest.raises(ValueError, match="corrupt"):
        _resources.read_bytes(_resources.ZZTJ_QIJI)
    with pytest.raises(FileNotFoundError, match="missing"):
        _resources.read_bytes("no_such_file.json")
