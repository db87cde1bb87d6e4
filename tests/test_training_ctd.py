"""CTDTrainer end to end on a tiny random backbone: losses, learning, resume, evaluation, variants."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from _ctd_helpers import small_dataset, tiny_model

from tempokern.nn import CTDLoss
from tempokern.training import METRIC_KEYS, CTDConfig, CTDTrainer, calendar_ce, evaluate_model, train_ctd
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
    tr = CTDTrainer(m, ds, CTDConfig(variant="baseline", batch_size=8, progress=False))
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
    # every (query, gold) pair per epoch (pairs_per_query=None): 3 epochs (42 steps) see the loss halve
    cfg = CTDConfig(variant="full", epochs=3, batch_size=16, lr=3e-3, progress=False, seed=0, pairs_per_query=None)
    res = train_ctd(m, ds, cfg, tmp_path / "run", log=lambda *a: None)
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
    train_ctd(tiny_model(ds, seed=1), ds, CTDConfig(**cfg), tmp_path / "a", log=lambda *a: None)
    train_ctd(tiny_model(ds, seed=1), ds, CTDConfig(**cfg, stop_after_epochs=1), tmp_path / "b", log=lambda *a: None)
    # the resumed run is asked for 2 epochs in total and starts from b/last
    train_ctd(tiny_model(ds, seed=1), ds, CTDConfig(**cfg), tmp_path / "b", resume=True, log=lambda *a: None)
    a = load_file(str(tmp_path / "a" / "last" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "last" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with pytest.raises(FileNotFoundError, match="resume"):
        train_ctd(tiny_model(ds), ds, CTDConfig(**cfg), tmp_path / "none", resume=True, log=lambda *a: None)


def test_seed_reproducible(ds):
    cfg = CTDConfig(variant="bias", epochs=1, batch_size=16, lr=3e-3, progress=False, seed=5, max_steps=3)
    r1 = train_ctd(tiny_model(ds, seed=2), ds, cfg, log=lambda *a: None)
    r2 = train_ctd(tiny_model(ds, seed=2), ds, cfg, log=lambda *a: None)
    assert [h["loss"] for h in r1.history if h["event"] == "step"] == \
           [h["loss"] for h in r2.history if h["event"] == "step"]


def test_bad_config(ds):
    with pytest.raises(ValueError, match="variant"):
        CTDConfig(variant="nope").validate()
    with pytest.raises(ValueError, match="batch_size"):
        CTDConfig(batch_size=1).validate()
    with pytest.raises(ValueError, match="unknown training option"):
        CTDConfig.from_dict({"epochz": 3})
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
    tr = CTDTrainer(m, d2, CTDConfig(variant="full", batch_size=8, progress=False))
    (batch, extra, off), *_ = tr._epoch_batches(0)
    assert extra is not None and len(extra) == len(batch)
    assert all(d2.records[n].type == "neg_comment" for n in extra)
    loss_fn = CTDLoss(temperature=0.05, offset_bias=m.offset_bias, normalize=False)
    with torch.no_grad():
        with_neg = tr._loss(batch, extra, off, loss_fn)[1]
        without = tr._loss(batch, None, off, loss_fn)[1]
    assert float(with_neg) > float(without)      # more negatives in every q->d denominator
    tr2 = CTDTrainer(m, d2, CTDConfig(variant="full", batch_size=8, progress=False, hard_negatives=False))
    assert tr2._epoch_batches(0)[0][1] is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("amp", ["bf16", "fp16", "off"])
def test_cuda_mixed_precision_training(ds, amp):
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("bf16 not supported on this GPU")
    m = tiny_model(ds)
    cfg = CTDConfig(variant="full", epochs=2, batch_size=16, lr=3e-3, progress=False, amp=amp, seed=0)
    res = train_ctd(m, ds, cfg, device="cuda", log=lambda *a: None)
    losses = [h["loss"] for h in res.history if h["event"] == "step"]
    assert losses and all(math.isfinite(x) for x in losses)
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in m.parameters())
    table = evaluate_model(m, ds, "test")
    assert 0.0 <= table["all"]["R@1"] <= 1.0


# ---- hard negatives stay inside the training split's months ----------------------

def _reference_pick(local, all_train, pos, pool, rng):
    """ChunQiuTR's ChunqiuTrainDataset._sample_negative_sids + the collator's random.choice, as written
    there: up to `pool` shuffled local candidates, topped up from the training-month pool."""
    cand = [c for c in local if c != pos]
    rng.shuffle(cand)
    negs = cand[:pool]
    if len(negs) < pool:
        need = pool - len(negs)
        rest = [c for c in all_train if c != pos and c not in negs]
        negs += rest if len(rest) <= need else rng.sample(rest, need)
    return rng.choice(negs) if negs else None


def _time_split_with_negs(val_test_only: bool):
    """The time-split demo set cut to 36 months, with neg_comment records: one per month of the val/test
    blocks, and (unless val_test_only) one per training month too."""
    import dataclasses
    from tempokern.datasets import Record, RetrievalDataset
    from tempokern.training.data import train_units
    ds = small_dataset(units=36, split="time")
    units = train_units(ds)
    recs = list(ds.records)
    for u in range(36):
        if val_test_only and u in units:
            continue
        key = ds.calendar.key_at(u)
        recs.append(Record(f"neg{u}", f"注：{u}", key=key, interval=ds.calendar.span(key), type="neg_comment"))
    return RetrievalDataset("neg-split", recs, ds.queries, ds.calendar, ds.report), units


def test_hard_negatives_never_come_from_val_or_test_months():
    """Fails on a030c41: with no negative in a query's (training) months, _pick_neg fell back to any
    neg_comment record, val and test months included."""
    d2, units = _time_split_with_negs(val_test_only=False)
    assert units and len(units) < 36
    # leave the training months of the first half without negatives: their queries must use the pool
    keep = [r for r in d2.records if not (r.type == "neg_comment" and int(r.id[3:]) in units and int(r.id[3:]) < 18)]
    from tempokern.datasets import RetrievalDataset
    d2 = RetrievalDataset("neg-split", keep, d2.queries, d2.calendar, d2.report)
    m = tiny_model(d2).eval()
    tr = CTDTrainer(m, d2, CTDConfig(variant="full", batch_size=8, progress=False))
    seen = set()
    for epoch in range(4):
        for batch, negs, _ in tr._epoch_batches(epoch):
            assert negs is not None and len(negs) == len(batch)
            for n in negs:
                r = d2.records[n]
                assert r.type == "neg_comment" and set(r.interval.ranks()) <= units, r.id
                seen.add(n)
    assert len(seen) > 1
    # only val/test months have negatives: none is drawn at all
    d3, _ = _time_split_with_negs(val_test_only=True)
    tr3 = CTDTrainer(tiny_model(d3).eval(), d3, CTDConfig(variant="full", batch_size=8, progress=False))
    assert all(negs is None for _, negs, _ in tr3._epoch_batches(0))


def test_hard_negative_draw_matches_the_reference_sampler():
    """The O(1) draw has the distribution of the reference's pool-of-16-then-choice sampler."""
    import random
    from collections import Counter
    from tempokern.training.data import HardNegatives

    class Q:
        def __init__(self, iv):
            self.interval = iv

    from tempokern.calendar import Interval
    from tempokern.datasets import Record

    class D:
        pass
    d = D()
    # months 0..9 are training months; month 3 holds 3 negatives, the others 3 each too (30 in all)
    d.records = [Record(f"n{u}_{k}", "x", interval=Interval(u, u), type="neg_comment") for u in range(10)
                 for k in range(3)] + [Record("pos", "y", interval=Interval(3, 3))]
    d.queries = [Q(Interval(3, 3)), Q(Interval(2, 4))]
    hn = HardNegatives(d, set(range(10)), pool=16)
    for qi in (0, 1):
        local = hn.local(qi)[0]
        a, b = Counter(), Counter()
        r1, r2 = random.Random(1), random.Random(2)
        n = 20000
        for _ in range(n):
            a[hn.pick(qi, 30, r1) in local] += 1
            b[_reference_pick(local, hn.all, 30, 16, r2) in local] += 1
        assert abs(a[True] - b[True]) / n < 0.02, (qi, a, b)
        assert abs(a[True] / n - min(len(local), 16) / 16) < 0.02
    # local candidates are what the month -> negatives map says, built once per query
    assert sorted(hn.local(1)[0]) == list(range(6, 15))
    assert hn.local(1) is hn.local(1)


def test_fit_draws_each_epoch_once_and_counts_steps_without_drawing(ds, monkeypatch):
    """Fails on a030c41: fit() built epoch 0's batches an extra time just to count steps."""
    calls = []
    orig = CTDTrainer._epoch_batches

    def counting(self, epoch):
        calls.append(epoch)
        return orig(self, epoch)
    monkeypatch.setattr(CTDTrainer, "_epoch_batches", counting)
    m = tiny_model(ds)
    cfg = CTDConfig(variant="multipos", epochs=2, batch_size=8, lr=1e-3, progress=False, eval_every=10)
    tr = CTDTrainer(m, ds, cfg, log=lambda *a: None)
    for pp in (1, 2, None):
        for bs in (2, 3, 8, 16):
            t = CTDTrainer(m, ds, CTDConfig(batch_size=bs, pairs_per_query=pp, progress=False))
            assert t.num_batches() == len(orig(t, 0)), (pp, bs)
    calls.clear()
    res = tr.fit()
    assert calls == [0, 1]
    assert res.steps == 2 * tr.num_batches()


# ---- the reference's training defaults -----------------------------------------

def test_defaults_follow_the_reference(ds):
    """Fails on a030c41 (uniform smoothing, every (query, gold) pair): the reference trains with
    neighbour label smoothing and one sampled positive per query per epoch."""
    cfg = CTDConfig()
    assert cfg.neighbor_smoothing is True and cfg.label_smoothing == 0.2 and cfg.pairs_per_query == 1
    tr = CTDTrainer(tiny_model(ds), ds, CTDConfig(batch_size=4, progress=False))
    pairs = [p for b, _, _ in tr._epoch_batches(0) for p in b]
    train_q = [qi for qi, q in enumerate(ds.queries) if q.split == "train"]
    assert len(pairs) >= len(train_q) - 2 * 4 and len({qi for qi, _ in pairs}) == len(pairs)
    # different epochs draw different positives for multi-gold (window) queries
    multi = {qi for qi in train_q if len(ds.queries[qi].gold) > 1}
    assert multi
    e0 = dict(p for b, _, _ in tr._epoch_batches(0) for p in b)
    e1 = dict(p for b, _, _ in tr._epoch_batches(1) for p in b)
    assert any(e0.get(qi) != e1.get(qi) for qi in multi if qi in e0 and qi in e1)
    with pytest.raises(ValueError, match="pairs_per_query"):
        CTDConfig(pairs_per_query=0).validate()


def test_default_time_loss_is_neighbour_smoothing_mean_over_levels(ds):
    """L_time = mean over levels of the neighbour-smoothed CE (the code's average; the paper's formula
    sums), written here with the reference's loop."""
    m = tiny_model(ds).eval()
    tr = CTDTrainer(m, ds, CTDConfig(variant="bias", batch_size=8, progress=False))
    (batch, negs, off), *_ = tr._epoch_batches(0)
    loss_fn = CTDLoss(temperature=0.05, offset_bias=m.offset_bias, normalize=False)
    with torch.no_grad():
        _, _, lt = tr._loss(batch, negs, off, loss_fn)
        dd = [ds.records[ri].text for _, ri in batch]
        out = m(**m.tokenize([ds.queries[qi].text for qi, _ in batch] + dd))
    B = len(batch)
    labels = [ds.calendar.index(ds.records[ri].key) for _, ri in batch]
    per_level = [_chunqiu_neighbor_ce(x[B:2 * B], torch.tensor([l[k] for l in labels]), 0.2)
                 for k, x in enumerate(out.logits)]
    assert torch.allclose(lt, torch.stack(per_level).mean(), atol=1e-5)


# ---- the reference's evaluation protocol -----------------------------------------

def test_encoder_scorer_is_the_backbone_alone(ds):
    """scorer="encoder": the backbone's pooled vector, L2-normalised (no context, no bias), as the
    reference's evaluate.py (enc_only) and validation (base_model.encoder)."""
    from tempokern.models.encoder import pool
    m = tiny_model(ds, pooling="cls").eval()
    with torch.no_grad():
        m.ctx_gate.fill_(3.0)             # the context must not reach encoder-only vectors
    texts = [r.text for r in ds.records[:7]]
    enc = m.tokenize(texts)
    with torch.no_grad():
        h = m.backbone(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state[:, 0]
    got = m.encode(texts, scorer="encoder").embeddings
    torch.testing.assert_close(got, F.normalize(h, dim=-1))
    assert not torch.allclose(m.encode(texts).embeddings, got, atol=1e-3)   # ctd adds the context
    with pytest.raises(ValueError, match="scorer"):
        m.encode(texts, scorer="bm25")


def test_evaluate_model_encoder_scorer_matches_cosine_ranking(ds):
    m = tiny_model(ds).eval()
    with torch.no_grad():
        m.offset_bias.scale.fill_(5.0)    # a strong bias: must be ignored by the encoder scorer
    table = evaluate_model(m, ds, "test", scorer="encoder", drop_no_event=False)
    gallery = ds.gallery()
    qs = [q for q in ds.queries if q.split == "test" and any(g in {r.id for r in gallery} for g in q.gold)]
    from tempokern.models.encoder import pool
    def vecs(texts):
        enc = m.tokenize(texts)
        with torch.no_grad():
            h = m.backbone(**enc).last_hidden_state
        return F.normalize(pool(h, enc["attention_mask"], m.pooling), dim=-1)
    s = vecs([q.text for q in qs]) @ vecs([r.text for r in gallery]).T
    top1 = s.argmax(1).tolist()
    r1 = sum(gallery[j].id in q.gold for q, j in zip(qs, top1)) / len(qs)
    assert table["all"]["queries"] == len(qs)
    assert abs(table["all"]["R@1"] - r1) < 1e-9
    ctd = evaluate_model(m, ds, "test", scorer="ctd", drop_no_event=False)
    assert ctd["all"]["queries"] == len(qs)


def test_checkpoint_selection_follows_the_reference_by_default(ds, monkeypatch):
    """Fails on a030c41 (selected on neg1_ne1_dq1 with the full CTD score): the reference selects on
    validation R@1 of the encoder alone under neg1_ne1_dq0."""
    import tempokern.training.trainer as trainer_mod
    seen = []
    real = trainer_mod.evaluate_model

    def spy(*a, **kw):
        seen.append(kw)
        return real(*a, **kw)
    monkeypatch.setattr(trainer_mod, "evaluate_model", spy)
    m = tiny_model(ds)
    res = train_ctd(m, ds, CTDConfig(epochs=1, batch_size=8, lr=1e-3, progress=False, max_steps=2),
                    log=lambda *a: None)
    assert seen and all(kw["neg"] and kw["ne"] and not kw["drop_no_event"] and kw["scorer"] == "encoder"
                        for kw in seen)
    ev = [h for h in res.history if h["event"] == "eval"]
    assert ev and ev[0]["mode"] == "neg1_ne1_dq0" and ev[0]["scorer"] == "encoder"
    with pytest.raises(ValueError, match="scorer"):
        CTDConfig(eval_scorer="full").validate()
    with pytest.raises(ValueError, match="gather_mode"):
        CTDConfig(gather_mode="x").validate()


# ---- leap months in chronological order on u --------------------------------------

def test_leap_month_targets_put_u_in_chronological_order():
    """Fails on a030c41: the heads' target for an intercalary month was the month level's 13th slot, so the
    u they learn put 闰 (after month 3) after month 12; the targets now follow the rank axis."""
    import tempokern
    from tempokern.calendar import Calendar, LEAP_MONTH
    from tempokern.datasets import Record, RetrievalDataset
    from tempokern.training.data import record_labels
    cal = Calendar.reign([("甲", 2), ("乙", 2)], leap_months={("甲", 1): 3, ("乙", 2): 12})
    recs = [Record(f"r{r}", "x", key=cal.key_at(r)) for r in range(cal.num_units)]
    ds = RetrievalDataset("leap", recs, [], cal)
    labels = [record_labels(ds, r) for r in recs]
    assert labels[3] == [0.0, 0.0, 2.5]                      # 甲元年闰月 (after month 3): between months 3 and 4
    assert cal.key_at(3) == ("甲", 1, LEAP_MONTH)
    assert labels[-1][2] == 12.0                             # a leap month after month 12 keeps the 13th slot
    # the u the heads are trained towards (the target distribution's expectation, per level) is increasing in rank
    def target_logits(col, n):
        lo = torch.floor(torch.tensor(col)).long()
        f = torch.tensor(col) - lo
        p = torch.zeros(len(col), n, dtype=torch.float64)
        p[torch.arange(len(col)), lo] += 1 - f
        p[torch.arange(len(col)), (lo + 1).clamp_max(n - 1)] += f
        return torch.log(p.clamp_min(1e-300))
    logits = [target_logits([l[k] for l in labels], n) for k, n in enumerate(cal.sizes)]
    u = tempokern.calendar_scalar(logits)
    assert bool((u[1:] > u[:-1]).all()), u
    # calendar_ce with a half label is the mixture of the two neighbouring targets
    x = torch.randn(2, 13)
    half = calendar_ce([x], torch.tensor([[2.5], [7.0]]), smoothing=0.2, neighbor=True)
    want = (0.5 * _chunqiu_neighbor_ce(x[:1], torch.tensor([2]), 0.2) + 0.5 * _chunqiu_neighbor_ce(x[:1], torch.tensor([3]), 0.2)
            + _chunqiu_neighbor_ce(x[1:], torch.tensor([7]), 0.2)) / 2
    assert torch.allclose(half, want, atol=1e-6)
