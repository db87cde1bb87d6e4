"""CTD trainer: hard negatives the data provides per query (meta["negatives"]) or per record group
(records sharing the gold's meta["group"], e.g. one page), CTDConfig.hard_negative_source."""
import dataclasses

import pytest
import torch

from _ctd_helpers import small_dataset, tiny_model

from tempokern.datasets import RetrievalDataset
from tempokern.nn import CTDLoss
from tempokern.training import CTDConfig, CTDTrainer
from tempokern.training.data import QueryNegatives


@pytest.fixture(scope="module")
def ds():
    return small_dataset()


def _with_lists(ds, every: int = 2):
    """Every `every`-th training query gets meta["negatives"]: three records of other months."""
    recs = ds.records
    qs, lists = [], {}
    for k, q in enumerate(ds.queries):
        if q.split == "train" and k % every == 0:
            negs = [r.id for r in recs if r.id not in q.gold][k % 7::11][:3]
            lists[q.id] = negs
            q = dataclasses.replace(q, meta={**q.meta, "negatives": negs})
        qs.append(q)
    return RetrievalDataset("with-lists", recs, qs, ds.calendar, ds.report), lists


def test_query_lists_are_the_negatives(ds):
    d2, lists = _with_lists(ds)
    m = tiny_model(d2).eval()
    tr = CTDTrainer(m, d2, CTDConfig(variant="full", batch_size=8, progress=False, hard_negative_source="query"))
    seen = 0
    for batch, negs, _ in tr._epoch_batches(0):
        listed = [(qi, di) for qi, di in batch if d2.queries[qi].id in lists]
        # only the queries with a list get a negative, drawn from their list, never a gold
        assert (negs is None and not listed) or len(negs) == len(listed)
        for (qi, di), n in zip(listed, negs or []):
            q = d2.queries[qi]
            assert d2.records[n].id in lists[q.id] and d2.records[n].id not in q.gold
            seen += 1
    assert seen > 0
    # the negatives enter the loss (extra denominators)
    batch, negs, off = next(b for b in tr._epoch_batches(0) if b[1])
    loss_fn = CTDLoss(temperature=0.05, offset_bias=m.offset_bias, normalize=False)
    with torch.no_grad():
        assert float(tr._loss(batch, negs, off, loss_fn)[1]) != float(tr._loss(batch, None, off, loss_fn)[1])


def test_group_negatives_share_the_gold_page(ds):
    # records grouped into "pages" of five consecutive records
    recs = [dataclasses.replace(r, meta={**r.meta, "group": f"page{i // 5}"}) for i, r in enumerate(ds.records)]
    d2 = RetrievalDataset("pages", recs, ds.queries, ds.calendar, ds.report)
    qn = QueryNegatives(d2, "train", source="group")
    assert len(qn) > 0
    page = {r.id: r.meta["group"] for r in recs}
    for qi, cands in qn.cands.items():
        q = d2.queries[qi]
        gold_pages = {page[g] for g in q.gold}
        assert all(page[recs[i].id] in gold_pages and recs[i].id not in q.gold for i in cands)
    m = tiny_model(d2).eval()
    tr = CTDTrainer(m, d2, CTDConfig(variant="full", batch_size=8, progress=False, hard_negative_source="group"))
    batch, negs, _ = tr._epoch_batches(0)[0]
    assert negs is not None
    for n in negs:
        assert any(page[recs[n].id] == page[g] for qi, _ in batch for g in d2.queries[qi].gold)


def test_auto_falls_back_and_bad_input_is_named(ds):
    d2, lists = _with_lists(ds)
    qn = QueryNegatives(d2, "train", source="auto")
    assert {d2.queries[qi].id for qi in qn.cands} == set(lists)      # no groups here: only the lists
    with pytest.raises(ValueError, match="hard_negative_source"):
        CTDConfig(hard_negative_source="page").validate()
    q0 = next(q for q in ds.queries if q.split == "train")
    bad = [dataclasses.replace(q0, meta={"negatives": ["no-such-record"]})]
    with pytest.raises(ValueError, match="no-such-record"):
        QueryNegatives(RetrievalDataset("bad", ds.records, bad, ds.calendar, ds.report), "train")
