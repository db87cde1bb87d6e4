"""Re³ trainer: cached frozen-backbone training, variants, resume, logs, evaluation."""
import datetime as dt
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tempokern.datasets import Query, Record, RetrievalDataset
from tempokern.models import build_char_tokenizer, tiny_bert
from tempokern.text import format_date
from tempokern.training.re3 import (Re3Config, Re3Example, Re3Trainer, build_re3_model, docs_from_dataset,
                                    examples_from_dataset, re3_eval, re3_runs, train_re3)

try:
    from tempokern.nn import Re3Loss
except ImportError:      # shared interface 3 lands from another branch; until then an eager stand-in
    Re3Loss = None


class EagerRe3Loss(torch.nn.Module):
    """Eqs. 10-13 written out (B x B materialised): symmetric InfoNCE with same-doc-id positives,
    hardest in-batch negative margin and the time-wrong margin, both in cosine units."""

    def __init__(self, temperature=0.05, margin=0.1, lambda_hard=0.1, lambda_tw=0.1, tw_in_nce=False, dedup=True):
        super().__init__()
        self.t, self.d, self.lh, self.lt = temperature, margin, lambda_hard, lambda_tw
        self.calls = 0

    def forward(self, q, d, d_tw=None, doc_ids=None):
        self.calls += 1
        B = q.shape[0]
        cos = q @ d.T
        s = cos / self.t
        pos = doc_ids[:, None] == doc_ids[None, :] if doc_ids is not None else torch.eye(B, dtype=torch.bool)
        neg_inf = torch.finfo(s.dtype).min
        l_qd = -(torch.logsumexp(s.masked_fill(~pos, neg_inf), 1) - torch.logsumexp(s, 1)).mean()
        l_dq = -(torch.logsumexp(s.T.masked_fill(~pos.T, neg_inf), 1) - torch.logsumexp(s.T, 1)).mean()
        nce = 0.5 * (l_qd + l_dq)
        diag = cos.diagonal()
        hard = torch.relu(self.d + cos.masked_fill(pos, -10.0).amax(1) - diag).mean() if B > 1 else cos.new_zeros(())
        tw = torch.relu(self.d + (q * d_tw).sum(1) - diag).mean() if d_tw is not None else cos.new_zeros(())
        loss = nce + self.lh * hard + self.lt * tw
        return loss, {"nce": nce.detach(), "hard": hard.detach(), "tw": tw.detach(), "total": loss.detach()}


ENTITIES = ["Acme", "Bolt", "Core"]
DAYS = [dt.date(2014, 1, 1) + dt.timedelta(days=9 * i) for i in range(10)]
DOC_FMTS = ["month_d_yyyy", "iso", "d_month_yyyy"]
Q_FMTS = ["us_slash", "d_month_yyyy", "iso", "month_d_yyyy"]


def toy_dataset():
    recs, qs = [], []
    for e in ENTITIES:
        for i, d in enumerate(DAYS):
            rid = f"{e}-{d.isoformat()}"
            recs.append(Record(rid, f"{e} sales on {format_date(d, DOC_FMTS[i % 3])} were {(i * 7) % 10} units.",
                               meta={"entity": e, "attribute": "sales", "date": d.isoformat()}, published=d))
    for rep in range(2):
        for e in ENTITIES:
            for i, d in enumerate(DAYS):
                twin = f"{e}-{DAYS[(i + 1) % len(DAYS)].isoformat()}"
                split = "train" if rep == 0 or i % 2 else "test"
                qs.append(Query(f"q{rep}-{e}-{i}", f"How many {e} sales on {format_date(d, Q_FMTS[(i + rep) % 4])}?",
                                gold={f"{e}-{d.isoformat()}": 1}, split=split,
                                meta={"time_wrong_twin": twin, "query_time": None}))
    return RetrievalDataset("toy", recs, qs)


@pytest.fixture(scope="module")
def ds():
    return toy_dataset()


@pytest.fixture(scope="module")
def tokbb(ds):
    tok = build_char_tokenizer([r.text for r in ds.records] + [q.text for q in ds.queries])
    bb = tiny_bert(len(tok), hidden=32, layers=1, heads=2, intermediate=64, max_position=96, seed=0)
    return tok, bb


def _model(tokbb, cfg):
    tok, bb = tokbb
    import copy
    return build_re3_model(copy.deepcopy(bb), cfg, tokenizer=tok, pooling="mean", max_length=80)


def _loss(cfg):
    lh, lt = cfg.loss_weights()
    if Re3Loss is not None:
        return None       # the real one (tempokern.nn.Re3Loss) by default
    return EagerRe3Loss(cfg.temperature, cfg.margin, lh, lt)


def test_frozen_training_caches_and_improves(ds, tokbb, tmp_path):
    cfg = Re3Config(variant="film_margins", epochs=30, batch_size=16, lr=3e-3, progress=False, encode_batch_size=32)
    m = _model(tokbb, cfg)
    before_bb = {k: v.clone() for k, v in m.backbone.state_dict().items()}
    calls = []
    h = m.backbone.register_forward_hook(lambda *a: calls.append(1))
    docs, ex = docs_from_dataset(ds), examples_from_dataset(ds, "train")
    base = re3_eval(ds, re3_runs(m, ds, ["train"], base=True))["train"]
    calls.clear()
    res = train_re3(m, docs, ex, cfg, tmp_path / "run", loss_fn=_loss(cfg), log=lambda *a: None)
    h.remove()
    n_docs = len({e.positive for e in ex} | {e.tw_negative for e in ex})
    # one encoding pass: ceil(docs/32) + ceil(queries/32) backbone calls, however many epochs
    assert len(calls) == -(-n_docs // 32) + -(-len(ex) // 32)
    assert res.steps == 30 * -(-len(ex) // 16) - (30 if len(ex) % 16 == 1 else 0)
    assert all(torch.equal(v, before_bb[k]) for k, v in m.backbone.state_dict().items())
    after = re3_eval(ds, re3_runs(m, ds, ["train", "test"]))
    assert after["train"]["R@1"] >= base["R@1"] + 0.2, (base, after)
    assert after["train"]["MRR"] > base["MRR"]
    first, last = res.history[0]["loss"], res.history[-1]["loss"]
    assert last < first
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len(log) == res.steps and {"loss", "loss_nce", "loss_hard", "loss_tw", "alpha", "lr"} <= set(log[0])
    assert (tmp_path / "run" / "model" / "tempokern_re3.json").exists()
    # the error split sums to 1 - R@1
    row = after["train"]
    errs = sum(row[k] for k in ("err_time_wrong", "err_entity_wrong", "err_attribute_wrong", "err_other"))
    assert errs == pytest.approx(1 - row["R@1"])


def test_year_stats_fitted(ds, tokbb):
    cfg = Re3Config(variant="film", epochs=1, batch_size=16, progress=False)
    m = _model(tokbb, cfg)
    train_re3(m, docs_from_dataset(ds), examples_from_dataset(ds), cfg, loss_fn=_loss(cfg), log=lambda *a: None)
    assert float(m.time_embed.year_mean) == 2014.0 and float(m.time_embed.year_std) == 1.0


def test_variant_loss_weights():
    assert Re3Config(variant="film_margins").loss_weights() == (0.1, 0.1)
    assert Re3Config(variant="film").loss_weights() == (0.0, 0.0)
    assert Re3Config(variant="lora").loss_weights() == (0.0, 0.0)
    assert Re3Config(variant="lora").effective_lr == 1e-4 and Re3Config().effective_lr == 1e-3
    with pytest.raises(ValueError, match="variant"):
        Re3Config(variant="x").validate()
    with pytest.raises(ValueError, match="batch_size"):
        Re3Config(batch_size=1).validate()
    with pytest.raises(ValueError, match="unknown"):
        Re3Config.from_dict({"lr": 1e-3, "nope": 1})


def test_base_variant_does_not_train(ds, tokbb, tmp_path):
    cfg = Re3Config(variant="base", progress=False)
    m = _model(tokbb, cfg)
    before = {k: v.clone() for k, v in m.state_dict().items() if not k.startswith("time_embed.year")}
    res = train_re3(m, docs_from_dataset(ds), examples_from_dataset(ds), cfg, tmp_path / "b", log=lambda *a: None)
    assert res.steps == 0
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    texts = [r.text for r in ds.records]
    assert torch.equal(m.encode(texts, pub=[r.published for r in ds.records], role="document"),
                       m.base_embeddings(texts))      # zero-initialised FiLM = the base retriever


def test_resume_matches_uninterrupted(ds, tokbb, tmp_path):
    cfg = Re3Config(variant="film_margins", epochs=3, batch_size=16, lr=3e-3, progress=False)
    docs, ex = docs_from_dataset(ds), examples_from_dataset(ds)
    full = _model(tokbb, cfg)
    train_re3(full, docs, ex, cfg, tmp_path / "full", loss_fn=_loss(cfg), log=lambda *a: None)
    part = _model(tokbb, cfg)
    cfg1 = Re3Config(**{**cfg.__dict__, "stop_after_epochs": 1})
    r1 = train_re3(part, docs, ex, cfg1, tmp_path / "part", loss_fn=_loss(cfg), log=lambda *a: None)
    fresh = _model(tokbb, cfg)
    r2 = train_re3(fresh, docs, ex, cfg, tmp_path / "part", resume=True, loss_fn=_loss(cfg), log=lambda *a: None)
    assert r2.steps == 3 * r1.steps
    for (k, a), b in zip(full.film.state_dict().items(), fresh.film.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)
    for (k, a), b in zip(full.time_embed.state_dict().items(), fresh.time_embed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)
    with pytest.raises(FileNotFoundError):
        train_re3(_model(tokbb, cfg), docs, ex, cfg, tmp_path / "none", resume=True, loss_fn=_loss(cfg),
                  log=lambda *a: None)


def test_rows_without_time_wrong_negative(ds, tokbb):
    cfg = Re3Config(variant="film_margins", epochs=1, batch_size=8, progress=False, lambda_hard=0.0)
    docs, ex = docs_from_dataset(ds), examples_from_dataset(ds)
    ex = [e._replace(tw_negative=None) if i % 2 else e for i, e in enumerate(ex)]
    m = _model(tokbb, cfg)
    tr = Re3Trainer(m, docs, ex, cfg, loss_fn=EagerRe3Loss(lambda_hard=0.0, lambda_tw=0.1), log=lambda *a: None)
    tr._prepare()
    tr.cache = True
    tr._encode_cache()
    with torch.no_grad():
        m.film.proj[2].weight.normal_()
    idx = torch.arange(8)
    loss, parts = tr._loss(idx)
    # reference: nce on the batch + 0.1 * (1/B) sum over rows with a negative of the hinge
    sel = [e for e in ex[:8]]
    q = m.fuse(tr.q_sem[idx], tr.qv[idx], tr.qm[idx])
    pos = torch.tensor([tr.doc_row[e.positive] for e in sel])
    d = m.fuse(tr.d_sem[pos], tr.dv[pos], tr.dm[pos])
    nce = EagerRe3Loss(lambda_hard=0.0, lambda_tw=0.0)(q, d, None, pos)[0]
    hinge = 0.0
    for i, e in enumerate(sel):
        if e.tw_negative is not None:
            j = tr.doc_row[e.tw_negative]
            dt_ = m.fuse(tr.d_sem[j:j + 1], tr.dv[j:j + 1], tr.dm[j:j + 1])[0]
            hinge = hinge + torch.relu(0.1 + q[i] @ dt_ - q[i] @ d[i])
    torch.testing.assert_close(loss, nce + 0.1 * hinge / 8, rtol=1e-6, atol=1e-7)


def test_lora_variant_trains_adapters_only(ds, tokbb):
    pytest.importorskip("peft")
    cfg = Re3Config(variant="lora", epochs=1, batch_size=8, max_steps=2, lr=1e-2, progress=False, lora_r=2)
    m = _model(tokbb, cfg)
    assert m.lora_config is not None and not m.use_time
    base_w = {n: p.clone() for n, p in m.backbone.named_parameters() if "lora_" not in n}
    lora_w = {n: p.clone() for n, p in m.backbone.named_parameters() if "lora_B" in n}
    res = train_re3(m, docs_from_dataset(ds), examples_from_dataset(ds), cfg, loss_fn=_loss(cfg), log=lambda *a: None)
    assert res.steps == 2
    now = dict(m.backbone.named_parameters())
    assert all(torch.equal(now[n], w) for n, w in base_w.items())
    assert any(not torch.equal(now[n], w) for n, w in lora_w.items())
    with pytest.raises(ValueError, match="lora"):
        Re3Trainer(_model(tokbb, Re3Config()), {"d": "doc"}, [Re3Example("q", "d")], Re3Config(variant="lora"),
                   log=lambda *a: None)


def test_examples_validation(ds, tokbb):
    cfg = Re3Config(progress=False)
    with pytest.raises(KeyError, match="positive"):
        Re3Trainer(_model(tokbb, cfg), {}, [Re3Example("q", "missing")], cfg, log=lambda *a: None)
    with pytest.raises(ValueError, match="split"):
        examples_from_dataset(ds, "nope")


def test_re3_eval_error_split():
    recs = [Record("g", "x", meta={"entity": "A", "attribute": "s", "date": "2014-01-01"}),
            Record("t", "x", meta={"entity": "A", "attribute": "s", "date": "2014-01-02"}),
            Record("e", "x", meta={"entity": "B", "attribute": "s", "date": "2014-01-01"}),
            Record("a", "x", meta={"entity": "A", "attribute": "p", "date": "2014-01-01"})]
    qs = [Query(f"q{i}", "q", gold={"g": 1}, split="test") for i in range(4)]
    d = RetrievalDataset("e", recs, qs)
    runs = {"test": {"q0": {"g": 1.0, "t": 0.5}, "q1": {"t": 1.0, "g": 0.5}, "q2": {"e": 1.0, "g": 0.1},
                     "q3": {"a": 1.0, "e": 0.5, "g": 0.2}}}
    row = re3_eval(d, runs)["test"]
    assert row["R@1"] == 0.25 and row["err_time_wrong"] == 0.25 and row["err_entity_wrong"] == 0.25
    assert row["err_attribute_wrong"] == 0.25 and row["err_other"] == 0.0
    assert row["MRR"] == pytest.approx((1 + 0.5 + 0.5 + 1 / 3) / 4)
    # the metrics the other methods' evaluations report, by hand: the gold at ranks 1, 2, 2, 3
    assert row["MRR@10"] == pytest.approx((1 + 0.5 + 0.5 + 1 / 3) / 4)
    dcg = [1.0, 1 / math.log2(3), 1 / math.log2(3), 1 / math.log2(4)]
    assert row["nDCG@10"] == pytest.approx(sum(dcg) / 4)


def test_cli_train_and_eval(tmp_path, capsys):
    from tempokern.cli import main
    variant = "film" if Re3Loss is not None else "base"
    out = tmp_path / "run"
    rc = main(["train", "--method", "re3", "--dataset", "zztj", "--out", str(out), "--re3-variant", variant,
               "--epochs", "1", "--batch-size", "32", "--max-length", "24", "--tiny-hidden", "16", "--tiny-layers",
               "1", "--no-progress", "--splits", "val"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["variant"] == variant and set(summary["eval"]) == {"val"}
    assert {"R@1", "R@5", "MRR", "err_time_wrong"} <= set(summary["eval"]["val"])
    capsys.readouterr()
    rc = main(["eval", "--method", "re3", "--dataset", "zztj", "--model", str(out), "--split", "val",
               "--out", str(tmp_path / "t.json")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| val |" in printed
    table = json.loads((tmp_path / "t.json").read_text())["rows"]["val"]
    assert table["R@1"] == pytest.approx(summary["eval"]["val"]["R@1"])
    assert main(["train", "--method", "re3", "--dataset", "zztj", "--out", str(tmp_path / "x"),
                 "--re3-variant", "nope"]) == 2
    assert main(["eval", "--method", "re3", "--dataset", "zztj"]) == 2
    assert main(["train", "--method", "re3", "--dataset", "zztj", "--out", str(tmp_path / "y"), "--resume"]) != 0


def test_suite_rows(ds, tokbb, tmp_path):
    from tempokern.datasets.synth._common import SynthSet, TrainRow
    from tempokern.suite import SuiteContext, get_method
    import tempokern.suite.methods.re3  # noqa: F401  (registers the rows)
    tok, bb = tokbb
    bdir = tmp_path / "bb"
    bb.save_pretrained(str(bdir))
    tok.save_pretrained(str(bdir))
    # the toy set as a SynthSet: eval splits "test_date" (renamed from test) and "timeless"-free
    qs = [q if q.split == "train" else Query(q.id, q.text, gold=q.gold, split="test_date", meta=q.meta)
          for q in ds.queries]
    d2 = RetrievalDataset("toy", ds.records, qs)
    rows = [TrainRow(q.id, q.text, next(iter(q.gold)), [q.meta["time_wrong_twin"]], ["time_wrong"])
            for q in qs if q.split == "train"]
    synth = SynthSet("B", d2, None, rows, {"seed": 0})
    outs = {}
    for name in ("re3-base", "re3-film", "re3-film_margins"):
        m = get_method(name)
        assert m.family == "re3" and set(m.sets) == ({"B", "C", "timeqa", "data"} if name == "re3-film_margins"
                                                      else {"B", "C"})
        ctx = SuiteContext(synth=synth, backbone_path=str(bdir), seed=0, quick=True, work_dir=tmp_path / name,
                           log=lambda *a: None, progress_enabled=False, method_name=name)
        out = m.run(ctx).validate(ctx.eval_splits, name)
        assert ctx.eval_splits == ["test_date"]
        run = out.runs["test_date"]
        assert set(run) == {q.id for q in qs if q.split == "test_date"}
        assert all(len(v) == len(ds.records) for v in run.values())       # depth 100 > 30 documents: all
        assert out.embed(["a text"]).shape == (1, 32)
        outs[name] = out
    assert outs["re3-base"].info["steps"] == 0 and outs["re3-film"].info["steps"] > 0
    assert outs["re3-film_margins"].info["examples_with_time_wrong"] == len(rows)
    # the base row is the frozen backbone: its scores are plain cosines of normalised e_sem
    q0 = next(q for q in qs if q.split == "test_date")
    assert max(outs["re3-base"].runs["test_date"][q0.id].values()) <= 1.0 + 1e-6
