"""TMRL's ablation rows and diagnostics: the `mrl` variant is exactly the Matryoshka InfoNCE of the reference (no
L_Temp / L_Dist / L_CKA), the temporal-subspace size as a ratio of the full dim (`t_ratio`, the paper's TimeQA
ratio), the negative-query coverage and the per-term gradient ratios in the trainer's result and log, and the
`mrl`, `tmrl_noaux`, `tmrl_t17` suite rows on a BEIR folder with a tiny backbone."""
import json

import pytest
import torch

from _tmrl_helpers import no_dropout, tiny_encoder, tiny_rows, tiny_config

from tempokern.datasets.tmrl import TMRLRow
from tempokern.training.tmrl import (T_RATIOS, TMRLConfig, TMRLTrainer, negative_query_coverage, t_from_ratio,
                                     train_tmrl, variant_weights)

pytest.importorskip("transformers")

D64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def rows():
    return tiny_rows()


_cfg = tiny_config


# ---- t as a ratio of the full dim ----------------------------------------------------------------------------

def test_t_from_ratio_arithmetic():
    assert T_RATIOS["paper_timeqa"] == 128 / 768
    assert t_from_ratio("paper_timeqa", 768) == 128 and t_from_ratio("paper_timeqa", 384) == 64
    assert t_from_ratio("paper_timeqa", 1024) == 171          # 170.67 rounds up
    assert t_from_ratio(0.17, 384) == 65                      # 65.28
    assert t_from_ratio(0.25, 384) == 96 and t_from_ratio(1, 384) == 384 and t_from_ratio(1.0, 7) == 7
    assert t_from_ratio(0.5, 5) == 3                          # 2.5: halves round up (Python's round gives 2)
    assert t_from_ratio(0.1, 15) == 2                         # 1.5 -> 2


@pytest.mark.parametrize("ratio,msg", [(0, "t_ratio must be"), (-0.1, "t_ratio must be"), (1.5, "t_ratio must be"),
                                       (float("nan"), "t_ratio must be"), (True, "t_ratio must be"),
                                       ("paper_tnp", "paper_timeqa"), (0.001, "rounds to t = 0")])
def test_t_from_ratio_errors(ratio, msg):
    with pytest.raises(ValueError, match=msg):
        t_from_ratio(ratio, 384)


def test_t_ratio_in_the_config(rows):
    with pytest.raises(ValueError, match="t or t_ratio, not both"):
        _cfg(t=8, t_ratio=0.25).validate()
    with pytest.raises(ValueError, match="t_ratio must be"):
        _cfg(t=None, t_ratio=2.0).validate()
    with pytest.raises(ValueError, match="t_ratio must be"):
        TMRLConfig.from_dict({"t_ratio": "sixth"})
    # dims (8, 16, 32): 0.25 x 32 = 8, the model's t; paper_timeqa gives round(5.33) = 5, not the model's
    m = tiny_encoder(rows, t=8)
    assert variant_weights(_cfg(t=None, t_ratio=0.25), m)[1] == 8
    with pytest.raises(ValueError, match="t=5"):
        variant_weights(_cfg(t=None, t_ratio="paper_timeqa"), m)
    m5 = tiny_encoder(rows, t=5)
    tr = TMRLTrainer(m5, rows, _cfg(t=None, t_ratio="paper_timeqa"))
    assert tr.t == 5 and tr.loss_fn.t == 5


# ---- the mrl variant is the Matryoshka InfoNCE, nothing else ------------------------------------------------

def test_mrl_variant_is_exactly_the_reference_matryoshka_infonce(rows):
    """One real `mrl` step (float64, dropout off; the config's alpha, beta, gamma non-zero, the variant zeroes
    them): no negative query is encoded, the L_Temp / L_Dist / L_CKA parts are 0, and the loss and the gradient
    of every trainable parameter equal tempokern.reference.matryoshka_infonce on the same texts encoded one at a
    time. The same batch under the `tmrl` variant gives another loss."""
    from tempokern import reference
    m = no_dropout(tiny_encoder(rows, dtype=D64, dropout=False, lora="full"))
    cfg = _cfg(variant="mrl", alpha=0.25, beta=0.1, gamma=0.1, distill_k=4)
    tr = TMRLTrainer(m, rows, cfg)
    assert (tr.alpha, tr.beta, tr.gamma) == (0.0, 0.0, 0.0)
    batch = tr.epoch_batches(0)[0]
    items, lay = tr.batch_items(batch)
    B = len(batch)
    assert lay["n"] == 0 and len(items) == 2 * B + sum(len(hn) for _, hn, _ in batch)   # no negative query
    m.train()
    m.zero_grad(set_to_none=True)
    loss, parts = tr.backward_batch(batch)
    assert float(parts["temp"]) == 0.0 and float(parts["dist"]) == 0.0 and float(parts["cka"]) == 0.0
    assert float(parts["total"]) == float(parts["mrl"])
    params = {n: p for n, p in m.named_parameters() if p.requires_grad}
    got = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    m.zero_grad(set_to_none=True)

    def enc(text, role):
        return m(**m.tokenize([text], role=role)).emb[0]

    q = torch.stack([enc(rows[ri].query, "query") for ri, _, _ in batch])
    p = torch.stack([enc(rows[ri].positive, "document") for ri, _, _ in batch])
    neg = torch.stack([enc(rows[ri].hard_negatives[j], "document") for ri, hs, _ in batch for j in hs])
    ref = reference.matryoshka_infonce(q, p, tr.dims, temperature=tr.temperature, extra_neg=neg)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-10)
    ref.backward()
    assert got and got.keys() == {n for n, p in params.items() if p.grad is not None}
    for n, g in got.items():
        torch.testing.assert_close(g, params[n].grad, rtol=1e-8, atol=1e-10, msg=n)
    # the projector (L_Temp's) gets no gradient at all under mrl
    assert all(p.grad is None or not p.grad.any() for n, p in params.items() if n.startswith("projector."))
    full = TMRLTrainer(m, rows, _cfg(variant="tmrl", alpha=0.25, beta=0.1, gamma=0.1, distill_k=4))
    m.zero_grad(set_to_none=True)
    loss_full, parts_full = full.backward_batch(batch)
    assert float(parts_full["temp"]) > 0 and abs(float(loss_full) - float(loss)) > 1e-3


# ---- coverage and gradient ratios in the result and the log --------------------------------------------------

def _odd_rows(rows, counts):
    return [TMRLRow(r.query, r.positive, hard_negatives=r.hard_negatives,
                    negative_queries=[f"what prize did {w} win in 1990?" for w in ("alice", "bruno", "chen")][:c],
                    query_id=r.query_id) for r, c in zip(rows, counts)]


def test_negative_query_coverage_numbers(rows):
    counts = [0, 1, 3, 0, 2, 2, 0, 1, 0, 3]
    odd = _odd_rows(rows, counts)
    cov = negative_query_coverage(odd, per_step=2)
    assert cov == {"rows": 10, "with_negative_queries": 6, "share": 0.6, "mean": 1.2, "max": 3, "per_step": 2,
                   "mean_used": pytest.approx((1 + 2 + 2 + 2 + 1 + 2) / 10)}
    assert negative_query_coverage([]) == {"rows": 0, "with_negative_queries": 0, "share": 0.0, "mean": 0.0, "max": 0}
    assert "per_step" not in negative_query_coverage(odd)


def test_training_logs_coverage_and_first_step_gradients(rows, tmp_path):
    counts = [0, 1, 3, 0, 2, 2] * 5
    odd = _odd_rows(rows, counts)
    lines = []
    m = tiny_encoder(odd, lora="full", extra_texts=[t for r in odd for t in r.negative_queries])
    res = train_tmrl(m, odd, _cfg(variant="tmrl", beta=0.1, gamma=0.1, max_steps=2), tmp_path, log=lines.append)
    cov = res.coverage
    assert cov["rows"] == 30 and cov["with_negative_queries"] == 20 and cov["share"] == pytest.approx(2 / 3)
    assert cov["mean"] == pytest.approx(8 / 6) and cov["mean_used"] == pytest.approx(7 / 6) and cov["used"] is True
    assert lines[0].startswith("tmrl[tmrl] training rows: 30; with >= 1 negative query: 20 (66.7%); negative "
                               "queries per row: mean 1.33, max 3, used per step up to 2 (mean 1.17)")
    assert "skips the 10 rows without one" in lines[0]
    first, last = res.first_diagnostics, res.diagnostics
    assert first["step"] == 1 and last["step"] == 2
    for d in (first, last):
        assert set(d["grad_ratio"]) == {"mrl", "temp", "dist", "cka"}
        assert all(d["grad_ratio"][k] == pytest.approx(d["grad_norm"][k] / d["grad_norm_total"]) for k in d["grad_ratio"])
        assert 0 < d["grad_ratio"]["dist"] < 1 and 0 < d["grad_ratio"]["temp"]
    assert sum("gradient of each weighted term at step 1" in l for l in lines) == 1
    assert sum("gradient of each weighted term at step 2" in l for l in lines) == 1
    logged = [json.loads(l) for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [e["event"] for e in logged] == ["data", "grad_diagnostics", "step", "grad_diagnostics", "step"]
    assert logged[0]["negative_query_coverage"]["with_negative_queries"] == 20
    assert logged[1]["grad_ratio"] == pytest.approx(first["grad_ratio"])
    # a variant that reads no negative query says so
    lines.clear()
    res = train_tmrl(tiny_encoder(odd, lora="full", extra_texts=[t for r in odd for t in r.negative_queries]), odd,
                     _cfg(variant="mrl", max_steps=1), log=lines.append)
    assert res.coverage["used"] is False and "not used (alpha = 0: no L_Temp)" in lines[0]
    assert res.first_diagnostics["grad_ratio"]["temp"] == 0.0 and res.first_diagnostics["aux_grad_ratio"] == 0.0


def test_resume_keeps_the_first_step_diagnostics(rows, tmp_path):
    pytest.importorskip("peft")
    cfg = _cfg(epochs=2, batch_size=10, beta=0.1, gamma=0.1)
    m = tiny_encoder(rows, lora=None, seed=5)
    first = train_tmrl(m, rows, TMRLConfig(**{**cfg.__dict__, "stop_after_epochs": 1}), tmp_path, log=lambda *a: None)
    m2 = tiny_encoder(rows, lora=None, seed=5)
    res = train_tmrl(m2, rows, cfg, tmp_path, resume=True, log=lambda *a: None)
    assert res.first_diagnostics == first.first_diagnostics and res.first_diagnostics["step"] == 1
    assert res.diagnostics["step"] == res.steps


# ---- suite rows -----------------------------------------------------------------------------------------------

def test_ablation_rows_register_on_the_real_sets():
    import tempokern.suite.methods.tmrl  # noqa: F401  (registers the rows)
    from tempokern.suite import get_method
    for name in ("mrl", "tmrl_noaux", "tmrl_t17", "tmrl_1expr", "lora", "tmrl"):
        m = get_method(name)
        assert {"timeqa", "data"} <= set(m.sets), name
    assert not get_method("mrl").in_quick and not get_method("tmrl_t17").in_quick and get_method("tmrl").in_quick


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from test_suite_realdata import write_folder
    return write_folder(tmp_path_factory.mktemp("byod") / "data")


@pytest.fixture(scope="module")
def backbone64(tmp_path_factory, folder):
    from tempokern.models import build_char_tokenizer, tiny_bert
    texts = [json.loads(l)["text"] for n in ("corpus.jsonl", "queries.jsonl") for l in open(folder / n)]
    tok = build_char_tokenizer(texts)
    model = tiny_bert(len(tok), hidden=64, layers=1, heads=2, intermediate=64, max_position=128, seed=0)
    path = tmp_path_factory.mktemp("bb")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_ablation_rows_run_on_a_beir_folder(tmp_path, folder, backbone64):
    pytest.importorskip("peft")
    pytest.importorskip("bm25s")
    from tempokern.suite import Budget
    from tempokern.suite.runner import run_suite, unit_path
    names = ["mrl", "tmrl_noaux", "tmrl_t17", "tmrl_1expr"]
    budget = Budget(epochs=1, max_length=48, batch_size=8, lr=1e-3, hard_negatives=1)
    res = run_suite(tmp_path, suite="data", data_dir=str(folder), quick=True, methods=names, backbone_path=backbone64,
                    budget=budget, progress=False, log=lambda m: None, n_resamples=50, plots=False)
    info = {}
    for name in names:
        assert res["methods"][name]["status"] == "done", (name, res["methods"][name])
        info[name] = json.loads(unit_path(tmp_path, name, "data", 0).read_text())["payload"]["info"]
        assert set(res["results"]["data"]["dev"]) >= {name}
    for name, i in info.items():
        assert i["steps"] == 3 and i["rows"] == 20 and i["dims"] == [32, 64]       # 20 rows, batches of 8
        cov = i["negative_query_coverage"]
        assert cov["rows"] == 20 and cov["with_negative_queries"] == 20 and cov["per_step"] == 2
        assert cov["used"] is (name != "mrl")
        assert i["grad_diagnostics_first"]["step"] == 1 and i["grad_diagnostics"]["step"] == 3
    # mrl: no temporal, distillation or CKA term at all; tmrl_noaux: L_Temp only; tmrl_t17: t = round(64 / 6)
    for name in ("mrl", "tmrl_noaux"):
        fp, w = info[name]["final_parts"], info[name]["grad_diagnostics"]["weighted_terms"]
        assert fp["dist"] == fp["cka"] == 0.0 and w["dist"] == w["cka"] == 0.0
        assert info[name]["grad_diagnostics_first"]["grad_ratio"]["dist"] == 0.0
    assert info["mrl"]["final_parts"]["temp"] == 0.0 and info["mrl"]["final_parts"]["total"] == \
        info["mrl"]["final_parts"]["mrl"]
    assert info["tmrl_noaux"]["final_parts"]["temp"] > 0 and info["tmrl_noaux"]["t"] == 32
    assert info["tmrl_t17"]["t"] == 11 and info["tmrl_t17"]["t_ratio"] == "paper_timeqa"
    assert info["tmrl_t17"]["final_parts"]["dist"] > 0
    # tmrl_1expr: every positive of the folder is one sentence stating its own years ("whole"); the counts say so
    oe = info["tmrl_1expr"]["one_expression"]
    assert sum(oe["positives"].values()) == 20 and oe["positives"]["whole"] == 20
    assert info["mrl"]["one_expression"] is None


# ---- CLI ---------------------------------------------------------------------------------------------------

def test_cli_t_ratio_and_coverage_line(rows, tmp_path, capsys):
    from tempokern.cli import main
    from tempokern.models import TMRLEncoder
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"query": r.query, "positive_passages": [{"text": r.positive}],
                                          "negative_passages": [{"text": t} for t in r.hard_negatives],
                                          "negative_queries": r.negative_queries[:i % 2 * 2]})
                              for i, r in enumerate(rows)) + "\n")
    base = ["train", "--method", "tmrl", "--data", str(data), "--format", "tevatron", "--out", str(tmp_path / "run"),
            "--epochs", "1", "--batch-size", "6", "--max-steps", "2", "--tiny-hidden", "32", "--tiny-layers", "1",
            "--max-length", "48", "--no-progress", "--dims", "8", "16", "32", "--alpha", "0.25"]
    assert main(base + ["--t-ratio", "0.25"]) == 0
    cap = capsys.readouterr()
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["t"] == 8 and summary["t_ratio"] == 0.25
    assert TMRLEncoder.load(tmp_path / "run" / "best").t == 8
    cov = summary["negative_query_coverage"]
    assert cov["rows"] == 30 and cov["with_negative_queries"] == 15 and cov["share"] == 0.5 and cov["mean"] == 1.0
    assert set(summary["grad_ratio_first"]) == {"mrl", "temp", "dist", "cka"}
    assert "with >= 1 negative query: 15 (50.0%)" in cap.err and "gradient of each weighted term at step 1" in cap.err
    # paper_timeqa on 32 dims: round(5.33) = 5
    assert main(base[:base.index("--out") + 1] + [str(tmp_path / "run2")] + base[base.index("--out") + 2:]
                + ["--t-ratio", "paper_timeqa"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["t"] == 5
    for extra, msg in ((["--t-ratio", "0.25", "--t", "8"], "--t or --t-ratio"), (["--t-ratio", "2"], "--t-ratio"),
                       (["--t-ratio", "sixth"], "paper_timeqa"), (["--t-ratio", "0.001"], "rounds to t = 0")):
        bad = base[:base.index("--out") + 1] + [str(tmp_path / "bad")] + base[base.index("--out") + 2:]
        assert main(bad + extra) == 2, extra     # a fresh --out: the option error, not the used-folder one
        assert msg in capsys.readouterr().err, extra


# ---- one date expression per passage ---------------------------------------------------------------------------

PARA = ("Ann Lee is a footballer . In 1995 , she joined Rovers . She moved to City in 2001 and played there "
        "until 2004 . She retired .")


def test_one_expression_text_cases():
    from tempokern.datasets.tmrl import one_expression_text
    t, sp, how = one_expression_text(PARA, [(2001, 2002)])
    assert (t, how) == ("She moved to City in 2001 and played there until 2004 .", "cut") and t[sp[0]:sp[1]] == "in 2001"
    t, sp, how = one_expression_text(PARA, [(1995, 1995)])
    assert (t, how) == ("In 1995 , she joined Rovers .", "cut") and t[sp[0]:sp[1]] == "In 1995"
    # preference order: the first interval that any expression overlaps wins, not the first expression
    t, sp, _ = one_expression_text(PARA, [(2004, 2004), (1995, 1995)])
    assert t.startswith("She moved to City") and t[sp[0]:sp[1]] == "until 2004"
    assert one_expression_text(PARA, [(2003, 2003), (1995, 1995)])[0] == "In 1995 , she joined Rovers ."   # no 2003
    assert one_expression_text(PARA, None)[0] == "In 1995 , she joined Rovers ."        # the first dated one
    t, sp, how = one_expression_text(PARA, [(2001, 2001)], window=1)
    assert t == PARA[PARA.index("In 1995"):] and t[sp[0]:sp[1]] == "in 2001" and how == "cut"
    assert one_expression_text(PARA, [(1980, 1981)]) == (PARA, None, "no_match")
    assert one_expression_text("No dates here .", None) == ("No dates here .", None, "undated")
    assert one_expression_text("In 1995 she joined .", [(1995, 1995)]) == ("In 1995 she joined .", (0, 7), "whole")
    with pytest.raises(ValueError, match="window"):
        one_expression_text(PARA, None, window=-1)


def test_one_expression_rows_counts_and_spans():
    from tempokern.datasets.tmrl import TMRLData, one_expression_rows
    from tempokern.datasets.base import LoadReport
    rows = [TMRLRow("Which team did Ann Lee join from 2001 to 2003?", PARA, hard_negatives=[PARA, "Undated text ."],
                    negative_queries=["Which team did Ann Lee join in 1995?"], query_id="a"),
            TMRLRow("The player who joined Rovers in 1995 played for which team from 2002 to 2004?", PARA,
                    query_id="b"),
            TMRLRow("Which team did Ann Lee join in 1970?", PARA, query_id="c"),
            TMRLRow("Which team did Ann Lee join?", "She is a footballer .", query_id="d")]
    out, counts = one_expression_rows(TMRLData(rows, LoadReport()), window=0)
    assert isinstance(out, TMRLData) and len(out.rows) == 4
    a, b, c, d = out.rows
    assert a.positive == "She moved to City in 2001 and played there until 2004 ."
    assert [a.positive[s:e] for s, e in a.positive_spans] == ["in 2001"]
    assert b.positive == a.positive                         # the question's last time (2002-2004), not its 1995
    assert c.positive == PARA and c.positive_spans is None and c.meta["one_expression"] == "no_match"
    assert d.positive == "She is a footballer ." and d.meta["one_expression"] == "undated"
    assert a.hard_negatives == ["In 1995 , she joined Rovers .", "Undated text ."]
    assert a.hard_negative_spans[0] == [(0, 7)] and a.hard_negative_spans[1] is None
    assert a.query == rows[0].query and a.negative_queries == rows[0].negative_queries
    assert counts == {"positives": {"cut": 2, "whole": 0, "no_match": 1, "undated": 1},
                      "hard_negatives": {"cut": 1, "whole": 0, "no_match": 0, "undated": 1}}
    plain, _ = one_expression_rows(rows, negatives=False)
    assert isinstance(plain, list) and plain[0].hard_negatives == rows[0].hard_negatives
