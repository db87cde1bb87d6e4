"""Trainer end to end on a tiny random backbone: losses, learning, resume, evaluation, variants."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from _ctd_helpers import small_dataset, tiny_model

from tempokern.nn import CTDLoss
from tempokern.training import METRIC_KEYS, TrainConfig, Trainer, calendar_ce, evaluate_model, train
from tempokern.training.data import block_split_of_rank, training_pairs, zztj_demo_dataset


@pytest.fixture(scope="module")
def ds():
    return small_dataset()


def _chunqiu_neighbor_ce(logits, targets, eps):
    """ChunQiuTR's time_ce_loss_with_neighbor_smoothing, written as its loop."""
    B, C = logits.shape
    t = torch.zeros_like(logits)
    for i in range(B):
        c = int(targets[i])
        t[i, c] = 1 - eps
        nb = [n for n in (c - 1, c + 1) if 0 <= n < C]
        for n in nb:
            t[i, n] += eps / len(nb)
    return -(t * F.log_softmax(logits, -1)).sum(-1).mean()


def test_calendar_ce_matches_definitions():
    torch.manual_seed(0)
    logits = [torch.randn(6, 4), torch.randn(6, 7)]
    labels = torch.tensor([[0, 6], [3, 0], [1, 3], [2, 2], [0, 5], [3, 1]])
    got = calendar_ce(logits, labels, smoothing=0.2)
    want = (F.cross_entropy(logits[0], labels[:, 0], label_smoothing=0.2)
            + F.cross_entropy(logits[1], labels[:, 1], label_smoothing=0.2)) / 2
    assert torch.allclose(got, want, atol=1e-6)
    got = calendar_ce(logits, labels, smoothing=0.2, neighbor=True)
    want = (_chunqiu_neighbor_ce(logits[0], labels[:, 0], 0.2) + _chunqiu_neighbor_ce(logits[1], labels[:, 1], 0.2)) / 2
    assert torch.allclose(got, want, atol=1e-6)
    # unknown labels (-1) are skipped, not treated as a class
    lab = labels.clone()
    lab[:3, 1] = -1
    got = calendar_ce(logits, lab, smoothing=0.0)
    want = (F.cross_entropy(logits[0], labels[:, 0]) + F.cross_entropy(logits[1][3:], labels[3:, 1])) / 2
    assert torch.allclose(got, want, atol=1e-6)


def test_demo_dataset_splits_and_pairs():
    d = zztj_demo_dataset()
    splits = {q.split for q in d.queries}
    assert splits == {"train", "val", "test"}
    for q in d.queries:
        assert q.gold and all(g in d for g in q.gold)
    # the time scheme keeps every month in one split
    dt = zztj_demo_dataset(split="time")
    for q in dt.queries:
        if q.split in ("train", "val", "test"):
            assert {block_split_of_rank(r) for r in q.interval.ranks()} == {q.split}
    pairs = training_pairs(d)
    assert pairs and all(d.queries[qi].split == "train" for qi, _ in pairs)
    assert all(d.records[ri].id in d.queries[qi].gold for qi, ri in pairs)
    with pytest.raises(ValueError, match="split scheme"):
        zztj_demo_dataset(split="random")


def test_baseline_batch_uses_single_positive_loss(ds):
    """The semantic baseline's loss is the in-batch InfoNCE with only the diagonal positive."""
    m = tiny_model(ds).eval()
    tr = Trainer(m, ds, TrainConfig(variant="baseline", batch_size=8, progress=False))
    (batch, negs, off), *_ = tr._epoch_batches(0)
    loss_fn = CTDLoss(temperature=0.05, normalize=False)
    torch.manual_seed(0)
    got, ret, tl = tr._loss(batch, negs, off, loss_fn)
    qs = [ds.queries[qi].text for qi, _ in batch]
    dd = [ds.records[ri].text for _, ri in batch]
    with torch.no_grad():
        out = m(**m.tokenize(qs + dd))
    B = len(batch)
    s = out.emb[:B] @ out.emb[B:].T / 0.05
    want = (F.cross_entropy(s, torch.arange(B)) + F.cross_entropy(s.T, torch.arange(B))) / 2
    assert float(tl) == 0.0
    assert torch.allclose(got.detach(), want, atol=1e-4)


def test_training_reduces_loss_and_eval_table_complete(ds, tmp_path):
    m = tiny_model(ds)
    cfg = TrainConfig(variant="full", epochs=6, batch_size=16, lr=3e-3, progress=False, seed=0)
    res = train(m, ds, cfg, tmp_path / "run", log=lambda *a: None)
    steps = [h["loss"] for h in res.history if h["event"] == "step"]
    assert len(steps) == res.steps >= 12
    assert all(math.isfinite(x) for x in steps)
    assert sum(steps[-3:]) / 3 < 0.8 * sum(steps[:3]) / 3
    assert (tmp_path / "run" / "best" / "model.safetensors").exists()
    log = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    assert any('"event": "eval"' in l for l in log) and any('"event": "step"' in l for l in log)
    table = evaluate_model(m, ds, "test")
    assert set(table) >= {"all", "point"}
    for row in table.values():
        for k in METRIC_KEYS:
            assert 0.0 <= row[k] <= 1.0
        assert row["queries"] > 0
    # the offset bias and the context gate trained (they start at 0 and 1)
    assert float(m.offset_bias.scale.detach()) != 0.0
    assert float(m.ctx_gate.detach()) != 1.0


def test_resume_continues_exactly(ds, tmp_path):
    from safetensors.torch import load_file
    cfg = dict(variant="full", epochs=2, batch_size=16, lr=3e-3, progress=False, seed=3)
    train(tiny_model(ds, seed=1), ds, TrainConfig(**cfg), tmp_path / "a", log=lambda *a: None)
    train(tiny_model(ds, seed=1), ds, TrainConfig(**cfg, stop_after_epochs=1), tmp_path / "b", log=lambda *a: None)
    # the resumed run is asked for 2 epochs in total and starts from b/last
    train(tiny_model(ds, seed=1), ds, TrainConfig(**cfg), tmp_path / "b", resume=True, log=lambda *a: None)
    a = load_file(str(tmp_path / "a" / "last" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "last" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with pytest.raises(FileNotFoundError, match="resume"):
        train(tiny_model(ds), ds, TrainConfig(**cfg), tmp_path / "none", resume=True, log=lambda *a: None)


def test_seed_reproducible(ds):
    cfg = TrainConfig(variant="bias", epochs=1, batch_size=16, lr=3e-3, progress=False, seed=5, max_steps=3)
    r1 = train(tiny_model(ds, seed=2), ds, cfg, log=lambda *a: None)
    r2 = train(tiny_model(ds, seed=2), ds, cfg, log=lambda *a: None)
    assert [h["loss"] for h in r1.history if h["event"] == "step"] == \
           [h["loss"] for h in r2.history if h["event"] == "step"]


def test_bad_config(ds):
    with pytest.raises(ValueError, match="variant"):
        TrainConfig(variant="nope").validate()
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=1).validate()
    with pytest.raises(ValueError, match="unknown training option"):
        TrainConfig.from_dict({"epochz": 3})
    with pytest.raises(ValueError, match="split"):
        evaluate_model(tiny_model(ds), ds, "dev")


def test_neg_comment_records_become_extra_negatives(ds):
    import dataclasses
    from tempokern.datasets import RetrievalDataset
    recs = list(ds.records)
    # turn every third no_event record into a neg_comment record (hard negatives of its month)
    negs = [i for i, r in enumerate(recs) if r.type == "no_event"][::3]
    for i in negs:
        recs[i] = dataclasses.replace(recs[i], type="neg_comment")
    neg_ids = {recs[i].id for i in negs}
    qs = [q for q in ds.queries if not set(q.gold) & neg_ids]
    d2 = RetrievalDataset("with-neg", recs, qs, ds.calendar, ds.report)
    m = tiny_model(d2).eval()
    tr = Trainer(m, d2, TrainConfig(variant="full", batch_size=8, progress=False))
    (batch, extra, off), *_ = tr._epoch_batches(0)
    assert extra is not None and len(extra) == len(batch)
    assert all(d2.records[n].type == "neg_comment" for n in extra)
    loss_fn = CTDLoss(temperature=0.05, offset_bias=m.offset_bias, normalize=False)
    with torch.no_grad():
        with_neg = tr._loss(batch, extra, off, loss_fn)[1]
        without = tr._loss(batch, None, off, loss_fn)[1]
    assert float(with_neg) > float(without)      # more negatives in every q->d denominator
    tr2 = Trainer(m, d2, TrainConfig(variant="full", batch_size=8, progress=False, hard_negatives=False))
    assert tr2._epoch_batches(0)[0][1] is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("amp", ["bf16", "fp16", "off"])
def test_cuda_mixed_precision_training(ds, amp):
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("bf16 not supported on this GPU")
    m = tiny_model(ds)
    cfg = TrainConfig(variant="full", epochs=2, batch_size=16, lr=3e-3, progress=False, amp=amp, seed=0)
    res = train(m, ds, cfg, device="cuda", log=lambda *a: None)
    losses = [h["loss"] for h in res.history if h["event"] == "step"]
    assert losses and all(math.isfinite(x) for x in losses)
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in m.parameters())
    table = evaluate_model(m, ds, "test")
    assert 0.0 <= table["all"]["R@1"] <= 1.0
