"""The CTD trainer's loss options: positives ("overlap" / "overlap_group", per-dataset default) and calendar-CE
targets from record intervals (calendar_labels)."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from _ctd_helpers import small_dataset, tiny_model

from tempokern.calendar import Calendar
from tempokern.datasets import Record, RetrievalDataset
from tempokern.nn import CTDLoss
from tempokern.reference import multipos_infonce as ref
from tempokern.training import CTDConfig, CTDTrainer
from tempokern.training.data import (interval_key, record_labels, resolve_calendar_labels, resolve_positives)


@pytest.fixture(scope="module")
def ds():
    return small_dataset()


def paged(ds, pages=3):
    """The annals set with a page per record (its index modulo `pages`) and per query (its first gold's page)."""
    recs = [replace(r, meta={**(r.meta or {}), "page": f"p{i % pages}"}) for i, r in enumerate(ds.records)]
    page = {r.id: r.meta["page"] for r in recs}
    qs = [replace(q, meta={**(q.meta or {}), "page": page[next(iter(q.gold))]}) for q in ds.queries]
    return RetrievalDataset("paged", recs, qs, ds.calendar, ds.report)


def test_annals_default_is_overlap_and_calendar_keys(ds):
    assert resolve_positives(ds, "auto") == "overlap"
    assert resolve_calendar_labels(ds, "auto") == "key"
    tr = CTDTrainer(tiny_model(ds), ds, CTDConfig(batch_size=8, progress=False))
    assert tr.positives == "overlap" and tr.rec_group is None
    assert tr.labels == [record_labels(ds, r) for r in ds.records]
    info = tr.setup_info()
    assert info["positives"] == "overlap" and info["calendar_labels"] == "key" and info["calendar_ce"]
    assert all(v > 0 for v in info["calendar_labelled_records"].values())


def _spy_loss(tr, batch, negs, off):
    calls = []

    def loss_fn(q, d, q_span, d_span, **kw):
        calls.append(kw)
        return (q * 0).sum()

    tr._loss(batch, negs, off, loss_fn)
    return calls[0]


def test_annals_batches_pass_no_groups(ds):
    tr = CTDTrainer(tiny_model(ds), ds, CTDConfig(variant="multipos", batch_size=8, progress=False))
    (batch, negs, off), *_ = tr._epoch_batches(0)
    kw = _spy_loss(tr, batch, negs, off)
    assert "q_group" not in kw and "d_group" not in kw


def test_paged_data_default_is_group_scoped_and_loss_matches_reference(ds):
    pds = paged(ds)
    assert resolve_positives(pds, "auto") == "overlap_group"
    m = tiny_model(pds).eval()
    tr = CTDTrainer(m, pds, CTDConfig(variant="multipos", batch_size=8, progress=False, hard_negatives=False))
    assert tr.positives == "overlap_group"
    (batch, negs, off), *_ = tr._epoch_batches(0)
    kw = _spy_loss(tr, batch, negs, off)
    qp = [pds.queries[qi].meta["page"] for qi, _ in batch]
    dp = [pds.records[j].meta["page"] for _, j in batch]
    # equal pages <=> equal ids, for query and document rows alike
    for i in range(len(batch)):
        for j in range(len(batch)):
            assert (qp[i] == dp[j]) == bool(kw["q_group"][i] == kw["d_group"][j])
    # the loss the trainer computes is the reference's with those groups
    loss_fn = CTDLoss(temperature=0.05, normalize=False)
    torch.manual_seed(0)
    _, ret, _ = tr._loss(batch, None, off, loss_fn)
    qs = [pds.queries[qi] for qi, _ in batch]
    with torch.no_grad():
        out = m(**m.tokenize([q.text for q in qs] + [pds.records[j].text for _, j in batch]))
    B = len(batch)
    q_span = (torch.tensor([q.interval.start for q in qs]), torch.tensor([q.interval.end for q in qs]))
    d_span = tuple(torch.tensor([tr.spans[j][k] for _, j in batch]) for k in (0, 1))
    want = ref(out.emb[:B], out.emb[B:], q_span, d_span, temperature=0.05, q_group=kw["q_group"],
               d_group=kw["d_group"])
    torch.testing.assert_close(ret, want, rtol=1e-4, atol=1e-5)
    # and it is not the overlap loss on this batch (some overlap crosses pages)
    plain = ref(out.emb[:B], out.emb[B:], q_span, d_span, temperature=0.05)
    assert abs(float(plain) - float(want)) > 1e-3
    tr2 = CTDTrainer(m, pds, CTDConfig(variant="multipos", batch_size=8, progress=False, positives="overlap"))
    assert "q_group" not in _spy_loss(tr2, batch, negs, off)


def test_positives_options_are_checked(ds):
    with pytest.raises(ValueError, match="positives must be one of"):
        CTDConfig(positives="pages").validate()
    with pytest.raises(ValueError, match="calendar_labels must be one of"):
        CTDConfig(calendar_labels="first").validate()
    with pytest.raises(ValueError, match="group_key"):
        CTDConfig(group_key="").validate()
    with pytest.raises(ValueError, match=r"meta\['page'\]"):
        CTDTrainer(tiny_model(ds), ds, CTDConfig(positives="overlap_group", batch_size=8, progress=False))


def test_interval_labels_on_a_gregorian_month_calendar():
    cal = Calendar.gregorian(2000, 2003, resolution="month")
    mk = lambda a, b: Record("r", "t", interval=cal.interval(a, b))  # noqa: E731
    assert interval_key(cal, cal.interval((2001, 5), (2001, 5))) == (2001, 5)
    assert interval_key(cal, cal.interval((2001, 1), (2001, 12))) == (2001,)
    assert interval_key(cal, cal.interval((2001, 12), (2002, 1))) is None
    assert interval_key(cal, None) is None
    data = RetrievalDataset("g", [mk((2001, 5), (2001, 5))], [], cal)
    assert record_labels(data, mk((2001, 5), (2001, 5)), from_interval=True) == [1.0, 4.0]
    assert record_labels(data, mk((2002, 1), (2002, 12)), from_interval=True) == [2.0, -1]
    assert record_labels(data, mk((2001, 12), (2002, 1)), from_interval=True) == [-1, -1]
    assert record_labels(data, mk((2001, 5), (2001, 5))) == [-1, -1]  # keys only: none
    # a key wins over the interval
    keyed = Record("k", "t", interval=cal.interval((2001, 5), (2001, 5)), key=(2003, 2))
    assert record_labels(data, keyed, from_interval=True) == [3.0, 1.0]
    assert resolve_calendar_labels(data, "auto") == "interval"


def test_interval_labels_reach_the_calendar_ce(ds):
    """Records without keys (dated by intervals only): calendar_labels="key" leaves the calendar CE nothing (its
    loss is 0, and the setup says so); "interval" gives it the units that hold whole intervals."""
    nokey = RetrievalDataset("nokey", [replace(r, key=None) for r in ds.records], ds.queries, ds.calendar)
    m = tiny_model(nokey)
    by_key = CTDTrainer(m, nokey, CTDConfig(batch_size=8, progress=False, calendar_labels="key"))
    assert not any(by_key.setup_info()["calendar_labelled_records"].values())
    auto = CTDTrainer(m, nokey, CTDConfig(batch_size=8, progress=False))
    assert auto.calendar_labels == "interval"
    # the annals' records are one month each: the interval gives back exactly their keys
    assert auto.labels == [record_labels(ds, r) for r in ds.records]
    (batch, negs, off), *_ = auto._epoch_batches(0)
    torch.manual_seed(0)
    assert float(auto._loss(batch, negs, off, CTDLoss(temperature=0.05, normalize=False,
                                                      offset_bias=m.offset_bias))[2]) > 0
    torch.manual_seed(0)
    assert float(by_key._loss(batch, negs, off, CTDLoss(temperature=0.05, normalize=False,
                                                        offset_bias=m.offset_bias))[2]) == 0


def test_suite_rows():
    from tempokern.suite import registered
    from tempokern.suite.methods.ctd import LOSS_OPTIONS
    from tempokern.suite.registry import REAL_SETS
    rows = {m.name: m for m in registered()}
    assert rows["ctd_group"].sets == REAL_SETS and not rows["ctd_group"].in_quick
    assert LOSS_OPTIONS["overlap"] == {"positives": "overlap", "calendar_labels": "key"}


def test_cli_train_options(tmp_path, capsys):
    from tempokern.cli import main
    tiny = ["--tiny-hidden", "32", "--tiny-layers", "1", "--max-length", "32", "--no-progress", "--batch-size", "8",
            "--epochs", "1", "--max-steps", "1"]
    assert main(["train", "--dataset", "zztj", "--out", str(tmp_path / "a"), "--positives", "overlap_group",
                 *tiny]) != 0
    assert "meta['page']" in capsys.readouterr().err
    assert main(["train", "--dataset", "zztj", "--out", str(tmp_path / "b"), "--positives", "overlap",
                 "--calendar-labels", "interval", *tiny]) == 0
    out = capsys.readouterr()
    assert "positives: overlap" in out.out + out.err
    assert main(["train", "--dataset", "zztj", "--out", str(tmp_path / "c"), "--positives", "pages", *tiny]) == 2
