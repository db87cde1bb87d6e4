"""TMRL trainer (variants, GradCache, resume, logs, config checks) and the TMRL row loaders."""
import json

import pytest
import torch

from _tmrl_helpers import no_dropout, tiny_encoder, tiny_rows, tiny_config

from tempokern.datasets import DataFormatError
from tempokern.datasets.tmrl import TMRLRow, load_temporal_contrastive, load_tevatron_jsonl, rows_from_synth
from tempokern.training.tmrl import TMRLConfig, TMRLTrainer, train_tmrl

pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster than two fighting over a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def rows():
    return tiny_rows()


_cfg = tiny_config


def _params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


# ---- config ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("alpha", -0.1), ("beta", float("nan")), ("gamma", "x"),
                                         ("variant", "tmrl2"), ("batch_size", 1), ("dims", (16, 8)),
                                         ("lr", 0.0), ("t", 0), ("temperature", -1.0), ("mrl_anchor", "both"),
                                         ("mini_batch_size", 0), ("hard_negatives", -1), ("lora", "partial"),
                                         ("warmup_ratio", 1.0), ("amp", "fp8"), ("epochs", 1.5),
                                         ("max_steps", 0), ("lora_dropout", 1.0), ("distill_k", 0)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TMRLConfig(**{field: value}).validate()


def test_from_dict_and_model_checks(rows):
    with pytest.raises(ValueError, match="unknown TMRL training option"):
        TMRLConfig.from_dict({"alpha": 0.1, "alhpa": 0.2})
    assert TMRLConfig.from_dict({"dims": [8, 16], "t": 8}).dims == (8, 16)
    m = tiny_encoder(rows, t=None)
    with pytest.raises(ValueError, match="t"):
        TMRLTrainer(m, rows, _cfg(t=None))       # alpha > 0 without a temporal subspace
    with pytest.raises(ValueError, match="hidden size"):
        TMRLTrainer(tiny_encoder(rows), rows, _cfg(dims=(8, 64)))
    with pytest.raises(ValueError, match="rows"):
        TMRLTrainer(tiny_encoder(rows), rows[:1], _cfg())


def test_variants_set_the_terms(rows):
    m = tiny_encoder(rows)
    got = {}
    for v in ("lora", "mrl", "tmrl_noaux", "tmrl"):
        tr = TMRLTrainer(m, rows, _cfg(variant=v, beta=0.1, gamma=0.2))
        got[v] = (tr.dims, tr.alpha, tr.beta, tr.gamma)
    assert got == {"lora": ((32,), 0.0, 0.0, 0.0), "mrl": ((8, 16, 32), 0.0, 0.0, 0.0),
                   "tmrl_noaux": ((8, 16, 32), 0.25, 0.0, 0.0), "tmrl": ((8, 16, 32), 0.25, 0.1, 0.2)}
    before = _params(m)
    res = train_tmrl(m, rows, _cfg(variant="zero_shot"), log=lambda *a: None)
    assert res.steps == 0 and all(torch.equal(p, before[n]) for n, p in m.named_parameters())


# ---- batches ---------------------------------------------------------------------------------------------

def test_batch_layout(rows):
    m = tiny_encoder(rows)
    tr = TMRLTrainer(m, rows, _cfg())
    batches = tr.epoch_batches(0)
    assert len(batches) == tr.num_batches() == 5
    assert sorted(ri for b in batches for ri, _, _ in b) == list(range(len(rows)))
    assert batches == tr.epoch_batches(0) and batches != tr.epoch_batches(1)
    items, lay = tr.batch_items(batches[0])
    B = len(batches[0])
    assert lay["B"] == B and lay["E"] == 2 * B and lay["n"] == 2 and len(items) == 2 * B + 2 * B + 2 * B
    assert [s for _, s, _, _ in items] == ["query"] * B + ["document"] * 3 * B + ["query"] * 2 * B
    assert [w for *_, w in items] == [True] * 2 * B + [False] * 2 * B + [True] * 2 * B
    # alpha = 0: negative queries are not encoded and no temporal representation is asked for
    tr0 = TMRLTrainer(m, rows, _cfg(variant="mrl"))
    items0, lay0 = tr0.batch_items(batches[0])
    assert len(items0) == 4 * B and lay0["n"] == 0 and not any(w for *_, w in items0)
    # a row without negative queries is masked out of L_Temp; rows sharing a passage become positives
    odd = [TMRLRow("q a 1999", "p 1999", negative_queries=["q a 2003"]), TMRLRow("q b 1999", "p 1999")]
    tr2 = TMRLTrainer(tiny_encoder(rows, extra_texts=["q a b p"]), odd, _cfg(batch_size=2))
    items2, lay2 = tr2.batch_items([(0, [], [0]), (1, [], [])])
    assert lay2["row_ok"] == [True, False] and lay2["pid"] == [0, 0] and len(items2) == 4 + 2


@pytest.mark.parametrize("anchor", ["query", "passage"])
def test_gradcache_gives_the_plain_gradients(rows, anchor):
    """cache_embeddings=True: same loss and parameter gradients as one big graph (dropout off, float64), with
    either reading of A1."""
    pytest.importorskip("peft")
    torch.manual_seed(0)
    m = no_dropout(tiny_encoder(rows, lora={"lora_dropout": 0.0}, dtype=torch.float64, dropout=False))
    with torch.no_grad():   # a non-zero LoRA update, so every adapter gets a gradient through both factors
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    grads = {}
    for cache in (False, True):
        tr = TMRLTrainer(m, rows, _cfg(cache_embeddings=cache, mini_batch_size=5, beta=0.1, gamma=0.1,
                                       mrl_anchor=anchor))
        m.train()
        m.zero_grad(set_to_none=True)
        loss, parts = tr.backward_batch(tr.epoch_batches(0)[0])
        grads[cache] = (loss, parts, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    (l0, p0, g0), (l1, p1, g1) = grads[False], grads[True]
    assert g0.keys() == g1.keys() and any(n.startswith("projector.") for n in g0) and any("lora_A" in n for n in g0)
    torch.testing.assert_close(l1, l0, rtol=1e-11, atol=1e-11)
    assert float(p0["temp"]) > 0
    for n in g0:
        assert g0[n].abs().max() > 0, n
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-9, atol=1e-11, msg=n)


# ---- runs ------------------------------------------------------------------------------------------------

def test_twenty_steps_decrease_every_loss_term(rows, tmp_path):
    m = tiny_encoder(rows, seed=1)
    cfg = _cfg(epochs=4, batch_size=6, beta=0.1, gamma=0.1, max_steps=20, lr=2e-3)
    res = train_tmrl(m, rows, cfg, tmp_path, log=lambda *a: None)
    assert res.steps == 20
    steps = [h for h in res.history if h["event"] == "step"]
    keys = ["mrl", "mrl@8", "mrl@16", "mrl@32", "temp", "dist", "cka", "loss"]
    for k in keys:
        first = sum(h[k] for h in steps[:5]) / 5
        last = sum(h[k] for h in steps[-5:]) / 5
        assert last < first, (k, first, last)
    logged = [json.loads(l) for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    logged_steps = [e for e in logged if e["event"] == "step"]
    assert len(logged_steps) == 20 and set(keys) <= set(logged_steps[0])
    # besides the steps: the data's negative-query coverage, and the gradient diagnostics of steps 1 and 20
    assert [e["event"] for e in logged if e["event"] != "step"] == ["data", "grad_diagnostics", "grad_diagnostics"]
    assert (tmp_path / "last" / "trainer_state.pt").exists()


def test_alpha_beta_gamma_zero_is_the_mrl_variant_bit_for_bit(rows):
    pytest.importorskip("peft")
    runs = []
    for v, kw in (("mrl", {}), ("tmrl", dict(alpha=0.0, beta=0.0, gamma=0.0))):
        m = tiny_encoder(rows, lora=None, seed=3)
        res = train_tmrl(m, rows, _cfg(variant=v, max_steps=3, **kw), log=lambda *a: None)
        runs.append((res, _params(m)))
    (r0, p0), (r1, p1) = runs
    assert [h["loss"] for h in r0.history] == [h["loss"] for h in r1.history]
    assert p0.keys() == p1.keys() and all(torch.equal(p0[n], p1[n]) for n in p0)
    # and a non-zero alpha changes the run
    m = tiny_encoder(rows, lora=None, seed=3)
    r2 = train_tmrl(m, rows, _cfg(variant="tmrl", alpha=0.25, beta=0.0, gamma=0.0, max_steps=3), log=lambda *a: None)
    assert [h["loss"] for h in r2.history] != [h["loss"] for h in r0.history]


def test_resume_reproduces_the_same_steps(rows, tmp_path):
    pytest.importorskip("peft")
    cfg = dict(epochs=2, batch_size=10, beta=0.1, gamma=0.1)   # dropout on: the RNG state is part of the resume
    m_full = tiny_encoder(rows, lora=None, seed=5)
    full = train_tmrl(m_full, rows, _cfg(**cfg), tmp_path / "a", log=lambda *a: None)
    m_half = tiny_encoder(rows, lora=None, seed=5)
    half = train_tmrl(m_half, rows, _cfg(stop_after_epochs=1, **cfg), tmp_path / "b", log=lambda *a: None)
    assert half.steps == full.steps // 2
    m_res = tiny_encoder(rows, lora=None, seed=6)        # other initial weights: the checkpoint must win
    res = train_tmrl(m_res, rows, _cfg(**cfg), tmp_path / "b", resume=True, log=lambda *a: None)
    assert res.steps == full.steps
    assert [h["loss"] for h in res.history] == [h["loss"] for h in full.history]
    pf, pr = _params(m_full), _params(m_res)
    assert all(torch.equal(pf[n], pr[n]) for n in pf)
    with pytest.raises(FileNotFoundError, match="resume"):
        train_tmrl(tiny_encoder(rows), rows, _cfg(), tmp_path / "none", resume=True, log=lambda *a: None)


# ---- loaders ---------------------------------------------------------------------------------------------

TABLE13 = [
    {"query_id": "p1", "query": "In 1906 the prize went to Curie.", "temporal": ["In 1906"],
     "positive_passages": [
         {"docid": "q1", "text": "Who won the prize in 1906?", "temporal": ["in 1906"],
          "temporal_query_type": "Explicit", "allen_relation": "Equals"},
         {"docid": "q2", "text": "Who won it the year after 1905?", "temporal": [[11, 30]],
          "temporal_query_type": "Implicit", "allen_relation": "met-by"}],
     "negative_passages": [
         {"docid": "n1", "text": "Who won the prize in 1907?", "temporal": ["in 1907"],
          "temporal_query_type": "Explicit", "allen_relation": "After"},
         {"docid": "n2", "text": "Which prize did she win?", "temporal": [],
          "temporal_query_type": "TemporalAnswer", "allen_relation": "Empty"}]},
    {"query_id": "p2", "query": "The 2012 games were held in London.",
     "positive_passages": [{"docid": "q3", "text": "Where were the games of 2012?"}], "negative_passages": []},
]


def test_table13_loader(tmp_path):
    f = tmp_path / "t13.json"
    f.write_text(json.dumps(TABLE13, indent=1))
    data = load_temporal_contrastive(f)
    assert len(data) == 3 and data.report.queries == 3
    r = data.rows[0]
    assert r.query == "Who won the prize in 1906?" and r.positive == TABLE13[0]["query"]
    assert r.negative_queries == ["Who won the prize in 1907?", "Which prize did she win?"]
    assert r.query_spans == [(18, 25)] and r.query[18:25] == "in 1906"
    assert r.positive_spans == [(0, 7)] and r.negative_query_spans == [[(18, 25)], []]
    assert data.rows[1].query_spans == [(11, 30)] and data.rows[1].meta["allen_relation"] == "MetBy"
    assert r.meta["temporal_query_type"] == "Explicit" and r.hard_negatives == []
    assert data.rows[2].query_spans is None and data.rows[2].negative_queries == []   # tagger at training time
    # jsonl holds the same
    g = tmp_path / "t13.jsonl"
    g.write_text("\n".join(json.dumps(o) for o in TABLE13) + "\n")
    assert [x.query for x in load_temporal_contrastive(g).rows] == [x.query for x in data.rows]


@pytest.mark.parametrize("bad,msg", [
    ({"query": "x", "positive_passages": []}, "positive_passages is empty"),
    ({"query": "", "positive_passages": [{"text": "a"}]}, "'query'"),
    ({"query": "x 1999", "positive_passages": [{"text": "a", "temporal": ["in 2001"]}]}, "does not occur"),
    ({"query": "x", "positive_passages": [{"text": "a", "temporal": [[0, 9]]}]}, "outside the text"),
    ({"query": "x", "positive_passages": [{"text": "a", "allen_relation": "Near"}]}, "allen_relation"),
    ({"query": "x", "positive_passages": [{"text": "a", "temporal_query_type": "Vague"}]}, "temporal_query_type"),
    ({"query": "x", "positive_passages": "a"}, "must be a list"),
])
def test_table13_errors_name_file_and_line(tmp_path, bad, msg):
    f = tmp_path / "bad.json"
    good = {"query": "ok", "positive_passages": [{"text": "fine"}]}
    f.write_text("[\n" + json.dumps(good) + ",\n" + json.dumps(bad) + "\n]\n")
    with pytest.raises(DataFormatError, match=msg) as e:
        load_temporal_contrastive(f)
    assert e.value.line == 3 and str(e.value).startswith(f"{f}:3:")
    skipped = load_temporal_contrastive(f, on_error="skip")
    assert len(skipped) == 1 and skipped.report.num_skipped == 1


def test_tevatron_loader(tmp_path):
    f = tmp_path / "train.jsonl"
    objs = [{"query_id": "1", "query": "who won in 1999?", "query_temporal": ["1999"],
             "positive_passages": [{"docid": "d1", "title": "Prize", "text": "In 1999 Ann won.", "temporal": ["In 1999"]},
                                   {"docid": "d9", "text": "second positive"}],
             "negative_passages": [{"docid": "d2", "title": "", "text": "In 2003 Ann won."}],
             "negative_queries": ["who won in 2003?"]},
            {"query": "plain question", "positive_passages": [{"text": "plain answer"}]}]
    f.write_text("\n".join(json.dumps(o) for o in objs) + "\n\nnot json\n")
    with pytest.raises(DataFormatError, match="invalid JSON") as e:
        load_tevatron_jsonl(f)
    assert e.value.line == 4
    data = load_tevatron_jsonl(f, on_error="skip")
    assert len(data) == 2 and data.report.num_skipped == 1
    r = data.rows[0]
    assert r.positive == "Prize In 1999 Ann won." and r.positive[r.positive_spans[0][0]:r.positive_spans[0][1]] == "In 1999"
    assert r.query_spans == [(11, 15)] and r.hard_negatives == ["In 2003 Ann won."]
    assert r.negative_queries == ["who won in 2003?"] and r.query_id == "1"
    assert data.rows[1].query_id == "line2" and data.rows[1].negative_queries == []


def test_rows_from_synth_interface():
    """The adapter for tempokern.datasets.synth (shared interface 4), on a hand-made set of that shape."""
    from types import SimpleNamespace as NS
    from tempokern.datasets import Query, Record, RetrievalDataset
    recs = [Record("d1", "In May 2019 the lake was full.", meta={"temporal_spans": [[3, 11]]}),
            Record("d2", "In May 2020 the lake was dry.", meta={"temporal_spans": [[3, 11]]})]
    qs = [Query("q1", "How full was the lake in May 2019?", gold={"d1": 1}, split="train",
                meta={"temporal_spans": [[24, 32]]})]
    tr = NS(query_id="q1", query=qs[0].text, positive="d1", hard_negatives=["d2"], negative_kinds=["time_wrong"],
            negative_queries=["How full was the lake in May 2020?"])
    synth = NS(name="B", dataset=RetrievalDataset("b", recs, qs), train_rows=[tr])
    data = rows_from_synth(synth)
    r = data.rows[0]
    assert (r.query, r.positive, r.hard_negatives) == (qs[0].text, recs[0].text, [recs[1].text])
    assert r.query_spans == [(24, 32)] and r.positive_spans == [(3, 11)] and r.hard_negative_spans == [[(3, 11)]]
    assert r.meta["negative_kinds"] == ["time_wrong"]


# ---- CLI -------------------------------------------------------------------------------------------------

def _write_beir(folder, rows):
    (folder / "qrels").mkdir(parents=True)
    docs = {r.positive: f"d{i}" for i, r in enumerate(rows)}
    (folder / "corpus.jsonl").write_text("\n".join(json.dumps({"_id": d, "text": t}) for t, d in docs.items()) + "\n")
    (folder / "queries.jsonl").write_text("\n".join(json.dumps({"_id": f"q{i}", "text": r.query})
                                                    for i, r in enumerate(rows)) + "\n")
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\t{docs[r.positive]}\t1\n" for i, r in enumerate(rows)))


def test_cli_train_eval_index_tmrl(rows, tmp_path, capsys):
    from tempokern.cli import default_dims, main
    from tempokern.models import TMRLEncoder
    from tempokern.search import TemporalIndex
    assert default_dims(384) == (32, 64, 128, 256, 384) and default_dims(768) == (64, 128, 256, 512, 768)
    assert default_dims(64) == (8, 16, 32, 64)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"query": r.query, "positive_passages": [{"text": r.positive}],
                                          "negative_passages": [{"text": t} for t in r.hard_negatives],
                                          "negative_queries": r.negative_queries}) for r in rows) + "\n")
    out = tmp_path / "run"
    base = ["train", "--method", "tmrl", "--data", str(data), "--format", "tevatron", "--out", str(out),
            "--epochs", "1", "--batch-size", "6", "--max-steps", "3", "--tiny-hidden", "32", "--tiny-layers", "1",
            "--max-length", "48", "--no-progress", "--dims", "8", "16", "32", "--t", "8", "--alpha", "0.25"]
    assert main(base + ["--mine-negatives", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["variant"] == "tmrl" and summary["dims"] == [8, 16, 32]
    m = TMRLEncoder.load(out / "best")
    assert m.dims == (8, 16, 32) and m.t == 8 and m.lora_mode == "full"
    beir = tmp_path / "beir"
    _write_beir(beir, rows)
    assert main(["eval", "--model", str(out / "best"), "--data", str(beir), "--format", "beir", "--dims", "8", "32",
                 "--out", str(tmp_path / "ev.json")]) == 0
    text = capsys.readouterr().out
    lines = [l for l in text.splitlines() if l.startswith("| ")]
    assert lines[0].startswith("| dim | nDCG@10 | recall@10 | recall@100 |")
    assert [l.split("|")[1].strip() for l in lines[1:]] == ["8", "32"]
    ev = json.loads((tmp_path / "ev.json").read_text())
    assert [r["dim"] for r in ev["rows"]] == [8, 32] and ev["rows"][0]["queries"] == len(rows)
    assert ev["rows"][0]["recall@100"] == 1.0   # 30 documents: every gold is in the top 100
    assert main(["index", "--model", str(out / "best"), "--data", str(beir), "--format", "beir", "--dim", "16",
                 "--out", str(tmp_path / "ix.bin")]) == 0
    assert TemporalIndex.load(str(tmp_path / "ix.bin")).dim == 16
    # usage errors: exit 2, one line naming the flag
    capsys.readouterr()
    assert main(base[:-2] + ["--alpha", "-1"]) == 2
    assert "--alpha" in capsys.readouterr().err
    assert main(base + ["--variant", "full"]) == 2
    assert "TMRL variant" in capsys.readouterr().err
    bad = list(base)
    bad[bad.index("tevatron")] = "zztj"
    assert main(bad) == 2
    # --mrl-anchor passage (A1's other reading): trains, and the option reaches the saved config
    out2 = tmp_path / "run-passage"
    pas = base[:base.index("--out")] + ["--out", str(out2)] + base[base.index("--out") + 2:] + ["--mrl-anchor", "passage"]
    assert main(pas + ["--max-steps", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2
    st = torch.load(out2 / "last" / "trainer_state.pt", map_location="cpu", weights_only=True)   # tensors, plain containers
    assert st["config"]["mrl_anchor"] == "passage"
    assert main(pas + ["--negative-queries", "0"]) == 2
    assert "--mrl-anchor passage needs --negative-queries" in capsys.readouterr().err
    assert main(base + ["--mrl-anchor", "doc"]) == 2


# ---- suite rows --------------------------------------------------------------------------------------------

def test_suite_rows_return_per_dim_runs(rows, tmp_path):
    """tempokern/suite/methods/tmrl.py on a hand-made set of the synth shape and a tiny saved backbone."""
    pytest.importorskip("peft")
    from types import SimpleNamespace as NS
    from tempokern.datasets import Query, Record, RetrievalDataset
    from tempokern.models import tiny_bert
    from tempokern.suite import Budget, SuiteContext, get_method
    from _tmrl_helpers import rows_texts, wordpiece_tokenizer
    import tempokern.suite.methods.tmrl as tm   # registers the rows
    recs = [Record(f"d{i}", r.positive) for i, r in enumerate(rows)]
    by_text = {r.text: r.id for r in recs}
    qs = [Query(f"q{i}", r.query, gold={f"d{i}": 1}, split="train" if i % 3 else "test_date")
          for i, r in enumerate(rows)]
    train = [NS(query_id=q.id, query=q.text, positive=f"d{i}",
                hard_negatives=[by_text[t] for t in rows[i].hard_negatives if t in by_text],
                negative_kinds=[], negative_queries=rows[i].negative_queries)
             for i, q in enumerate(qs) if q.split == "train"]
    synth = NS(name="A", dataset=RetrievalDataset("a", recs, qs), train_rows=train)
    tok = wordpiece_tokenizer(rows_texts(rows))
    bb = tiny_bert(len(tok), hidden=64, layers=1, heads=2, intermediate=64, max_position=64, seed=0)
    bb.save_pretrained(tmp_path / "bb")
    tok.save_pretrained(tmp_path / "bb")
    assert [m.name for m in (get_method(v) for v in ("lora", "mrl", "tmrl_noaux", "tmrl"))] == \
        ["lora", "mrl", "tmrl_noaux", "tmrl"]
    ctx = SuiteContext(synth=synth, backbone_path=str(tmp_path / "bb"), seed=0, quick=True,
                       work_dir=tmp_path / "w", budget=Budget(max_train_rows=12, epochs=1, max_length=32,
                                                              batch_size=6), log=lambda m: None,
                       progress_enabled=False, method_name="tmrl")
    out = get_method("tmrl").run(ctx).validate(ctx.eval_splits, "tmrl")
    dims = (32, 64)   # H = 64: 32, then H
    assert tuple(out.dim_runs) == dims and out.runs is out.dim_runs[64]
    assert out.info["steps"] == 2 and out.info["rows"] == 12
    run = out.dim_runs[32]["test_date"]
    assert set(run) == {q.id for q in qs if q.split == "test_date"}
    assert all(len(v) == len(recs) for v in run.values())   # fewer than 100 records: all of them
    assert out.embed(["x y"]).shape == (1, 64)
    assert tm.RECIPE["t"] == 32
    # diagnostics: the last step's parts and the gradient ratio of the auxiliary terms
    last = out.info["last_step"]
    assert out.info["final_parts"] == {k: last[k] for k in ("mrl", "temp", "dist", "cka", "total")}
    assert all(v > 0 for v in out.info["final_parts"].values())
    g = out.info["grad_diagnostics"]
    assert g["step"] == 2 and g["space"] == "embeddings" and g["seconds"] < 1.0
    w = g["weighted_terms"]
    assert w["dist"] == pytest.approx(tm.RECIPE["beta"] * last["dist"], rel=1e-5)
    assert w["cka"] == pytest.approx(tm.RECIPE["gamma"] * last["cka"], rel=1e-5)
    assert 0 < g["aux_grad_ratio"] < 1 and -1 <= g["aux_grad_cos"] <= 1
    assert g["grad_norm_aux"] == pytest.approx(g["aux_grad_ratio"] * g["grad_norm_total"])
    json.dumps(out.info)                                          # results.json-safe
    noaux = get_method("tmrl_noaux").run(SuiteContext(
        synth=synth, backbone_path=str(tmp_path / "bb"), seed=0, quick=True, work_dir=tmp_path / "w2",
        budget=Budget(max_train_rows=12, epochs=1, max_length=32, batch_size=6), log=lambda m: None,
        progress_enabled=False, method_name="tmrl_noaux"))
    gn = noaux.info["grad_diagnostics"]
    assert gn["aux_grad_ratio"] == 0.0 and gn["weighted_terms"]["dist"] == gn["weighted_terms"]["cka"] == 0.0


def test_mine_hard_negatives(rows):
    pytest.importorskip("bm25s")
    from tempokern.baselines import BM25Scorer
    from tempokern.datasets.tmrl import mine_hard_negatives
    bare = [TMRLRow(r.query, r.positive, query_id=r.query_id, positive_spans=[(3, 7)]) for r in rows]
    bare.append(TMRLRow(rows[0].query, rows[1].positive))          # a second gold for the same query text
    mined = mine_hard_negatives(bare, k=3)
    pool = list(dict.fromkeys(r.positive for r in bare))
    from types import SimpleNamespace as NS
    scores = BM25Scorer()([NS(text=r.query) for r in bare], [NS(id=str(i), text=t) for i, t in enumerate(pool)])
    for i, (r, m) in enumerate(zip(bare, mined)):
        gold = {x.positive for x in bare if x.query == r.query}
        assert len(m.hard_negatives) == 3 and not gold & set(m.hard_negatives)
        best = max(s for t, s in zip(pool, scores[i]) if t not in gold)
        assert scores[i][pool.index(m.hard_negatives[0])] == best
        assert m.hard_negative_spans == [[(3, 7)]] * 3   # the passages keep their spans (first row's)
    assert rows[0].positive not in mined[0].hard_negatives and rows[1].positive not in mined[0].hard_negatives
    kept = mine_hard_negatives([rows[0], bare[1]], k=1)
    assert kept[0].hard_negatives == rows[0].hard_negatives          # rows with negatives keep them
    with pytest.raises(ValueError, match="k must"):
        mine_hard_negatives(bare, k=0)


def test_two_process_gloo_keeps_ranks_in_sync(tmp_path):
    """torchrun's data parallelism on two CPU processes: parameters broadcast from rank 0, gradients
    averaged, every rank ends with the same weights while scoring its own rows."""
    import math
    import torch.multiprocessing as mp
    from _tmrl_helpers import tmrl_ddp_worker
    mp.spawn(tmrl_ddp_worker, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2, join=True)
    s0, s1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["steps"] == r1["steps"] == 3
    assert all(math.isfinite(x) for x in r0["losses"] + r1["losses"]) and r0["losses"] != r1["losses"]
    assert (tmp_path / "last" / "trainer_state.pt").exists()


# ---- mrl_anchor="passage" (A1's other reading) ------------------------------------------------------------

def test_passage_anchor_config_and_rows(rows):
    with pytest.raises(ValueError, match="negative_queries"):
        TMRLConfig(mrl_anchor="passage", negative_queries=0).validate()
    odd = [TMRLRow("q a 1999", "p 1999", negative_queries=["q a 2003"]),
           TMRLRow("q b 1999", "p b 1999", query_id="b-1999")]
    m = tiny_encoder(rows, extra_texts=["q a b p"])
    with pytest.raises(ValueError, match=r"row 1 \(query_id 'b-1999'\) has no negative queries"):
        TMRLTrainer(m, odd, _cfg(batch_size=2, mrl_anchor="passage"))
    TMRLTrainer(m, odd, _cfg(batch_size=2))                      # the query reading trains on such rows


def test_passage_anchor_batch_layout(rows):
    """Passage anchors: no hard-negative passage is encoded, the negative queries are (even with alpha = 0,
    then without temporal representations), and cyclic repeats of a row's negatives are marked invalid."""
    m = tiny_encoder(rows)
    tr = TMRLTrainer(m, rows, _cfg(variant="mrl", mrl_anchor="passage"))
    batch = tr.epoch_batches(0)[0]
    B = len(batch)
    items, lay = tr.batch_items(batch)
    assert lay["E"] == 0 and lay["n"] == 2 and len(items) == 2 * B + 2 * B
    assert [s for _, s, _, _ in items] == ["query"] * B + ["document"] * B + ["query"] * 2 * B
    assert not any(w for *_, w in items) and lay["nq_valid"] == [[True, True]] * B
    odd = [TMRLRow("q a 1999", "p 1999", negative_queries=["q a 2003", "q a 2008"]),
           TMRLRow("q b 1999", "p b 1999", negative_queries=["q b 2003"])]
    tr2 = TMRLTrainer(tiny_encoder(rows, extra_texts=["q a b p"]), odd, _cfg(batch_size=2, mrl_anchor="passage"))
    items2, lay2 = tr2.batch_items([(0, [], [0, 1]), (1, [], [0])])
    assert lay2["nq_valid"] == [[True, True], [True, False]] and len(items2) == 4 + 4
    assert [t for t, *_ in items2[4:]] == ["q a 2003", "q a 2008", "q b 2003", "q b 2003"]


def test_passage_anchor_step_loss_is_eq3_5_on_the_rows(rows):
    """The trainer's loss of one batch (variant mrl, passage anchors, float64, dropout off) equals the literal
    Eq. 3/5 transcription on embeddings of the batch's texts encoded one at a time: anchors = the rows'
    positive passages, candidates = the rows' queries then their drawn negative queries (no repeats)."""
    from test_tmrl_losses import mrl_literal_passage
    torch.manual_seed(0)
    m = no_dropout(tiny_encoder(rows, lora=None, dtype=torch.float64, dropout=False))
    odd = [TMRLRow(r.query, r.positive, negative_queries=r.negative_queries[:1 + (i % 2)]) for i, r in enumerate(rows)]
    tr = TMRLTrainer(m, odd, _cfg(variant="mrl", mrl_anchor="passage", negative_queries=2, batch_size=7))
    batch = tr.epoch_batches(0)[0]
    m.train()
    loss, parts = tr.backward_batch(batch)

    def emb(text, role):
        with torch.no_grad():
            return m(**m.tokenize([text], role=role)).emb[0]

    B = len(batch)
    P = torch.stack([emb(odd[ri].positive, "document") for ri, _, _ in batch])
    n = max(len(nq) for _, _, nq in batch)
    assert n == 2 and any(len(nq) == 1 for _, _, nq in batch)
    qc = torch.zeros(B, 1 + n, P.shape[1], dtype=torch.float64)
    valid = torch.zeros(B, 1 + n, dtype=torch.bool)
    for i, (ri, _, nq) in enumerate(batch):
        qc[i, 0], valid[i, 0] = emb(odd[ri].query, "query"), True
        for k, j in enumerate(nq):
            qc[i, 1 + k], valid[i, 1 + k] = emb(odd[ri].negative_queries[j], "query"), True
    ref, levels = mrl_literal_passage(P, qc, tr.dims, tr.temperature, valid=valid)
    torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-9)
    for mm, lv in zip(tr.dims, levels):
        assert abs(float(parts[f"mrl@{mm}"]) - float(lv)) < 1e-5


def test_passage_anchor_trains_and_resumes(rows, tmp_path):
    """tmrl with every term and passage anchors: twenty steps lower L_MRL and the total; stopping after one
    epoch and resuming gives the same steps and weights as the uninterrupted run."""
    pytest.importorskip("peft")
    m = tiny_encoder(rows, seed=1)
    res = train_tmrl(m, rows, _cfg(epochs=4, batch_size=6, beta=0.1, gamma=0.1, max_steps=20, lr=2e-3,
                                   mrl_anchor="passage"), log=lambda *a: None)
    for k in ("mrl", "loss"):
        first = sum(h[k] for h in res.history[:5]) / 5
        last = sum(h[k] for h in res.history[-5:]) / 5
        assert last < first, (k, first, last)
    cfg = dict(epochs=2, batch_size=10, beta=0.1, gamma=0.1, mrl_anchor="passage", lr=3e-3)
    m_full = tiny_encoder(rows, lora=None, seed=7)
    full = train_tmrl(m_full, rows, _cfg(**cfg), tmp_path / "a", log=lambda *a: None)
    assert full.steps == 6 and all(h["mrl"] > 0 and h["temp"] > 0 for h in full.history)
    m_half = tiny_encoder(rows, lora=None, seed=7)
    half = train_tmrl(m_half, rows, _cfg(stop_after_epochs=1, **cfg), tmp_path / "b", log=lambda *a: None)
    assert half.steps == 3
    m_res = tiny_encoder(rows, lora=None, seed=8)
    res = train_tmrl(m_res, rows, _cfg(**cfg), tmp_path / "b", resume=True, log=lambda *a: None)
    assert [h["loss"] for h in res.history] == [h["loss"] for h in full.history]
    pf, pr = _params(m_full), _params(m_res)
    assert all(torch.equal(pf[n], pr[n]) for n in pf)
    # the query reading of the same run differs
    m_q = tiny_encoder(rows, lora=None, seed=7)
    q = train_tmrl(m_q, rows, _cfg(**{**cfg, "mrl_anchor": "query"}, max_steps=1), log=lambda *a: None)
    assert q.history[0]["mrl"] != full.history[0]["mrl"]


# ---- gradient diagnostics (suite info) -----------------------------------------------------------------------

def test_grad_diagnostics_against_hand_gradients():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    frozen = torch.randn(2, 2, dtype=torch.float64)                  # no grad: left out
    terms = {"mrl": (x ** 2).sum(), "temp": 3 * y.sum(), "dist": 2 * x.sum(), "cka": torch.zeros((), dtype=torch.float64)}
    d = TMRLTrainer.grad_diagnostics(terms, (x, y, frozen, None))
    gx_tot, gy_tot = 2 * x.detach() + 2, torch.full_like(y, 3.0)
    tot = torch.cat([gx_tot.reshape(-1), gy_tot.reshape(-1)])
    aux = torch.cat([torch.full((12,), 2.0, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)])
    assert d["grad_norm"]["mrl"] == pytest.approx(float((2 * x.detach()).norm()))
    assert d["grad_norm"]["temp"] == pytest.approx(float(gy_tot.norm()))
    assert d["grad_norm"]["dist"] == pytest.approx(float(aux.norm())) and d["grad_norm"]["cka"] == 0.0
    assert d["grad_norm_total"] == pytest.approx(float(tot.norm()))
    assert d["aux_grad_ratio"] == pytest.approx(float(aux.norm() / tot.norm()))
    assert d["aux_grad_cos"] == pytest.approx(float(aux @ tot / (aux.norm() * tot.norm())))
    assert d["grad_ratio"]["temp"] == pytest.approx(float(gy_tot.norm() / tot.norm()))
    assert d["grad_ratio"]["dist"] == pytest.approx(float(aux.norm() / tot.norm())) and d["grad_ratio"]["cka"] == 0.0
    assert d["weighted_terms"]["temp"] == pytest.approx(float(3 * y.detach().sum()))
    assert x.grad is None and y.grad is None                         # nothing accumulated


def test_diagnostics_do_not_change_the_run(rows, monkeypatch):
    """The last step's diagnostics are read-only: the same run with them switched off gives the same losses
    and weights bit for bit; with grad_accum=2 they describe the last micro-batch of the last step."""
    cfg = _cfg(batch_size=5, beta=0.1, gamma=0.1, max_steps=3, grad_accum=2, epochs=2)
    m1 = tiny_encoder(rows, lora=None, seed=4)
    r1 = train_tmrl(m1, rows, cfg, log=lambda *a: None)
    assert r1.steps == 3 and r1.diagnostics["step"] == 3 and r1.diagnostics["aux_grad_ratio"] > 0
    monkeypatch.setattr(TMRLTrainer, "can_diagnose", lambda self: False)
    m2 = tiny_encoder(rows, lora=None, seed=4)
    r2 = train_tmrl(m2, rows, cfg, log=lambda *a: None)
    assert r2.diagnostics is None
    assert [h["loss"] for h in r1.history] == [h["loss"] for h in r2.history]
    p1, p2 = _params(m1), _params(m2)
    assert all(torch.equal(p1[n], p2[n]) for n in p1)


@pytest.mark.parametrize("cache", [False, True])
def test_exact_parameter_ratio(rows, cache):
    """diagnose_params: the exact ||grad(beta L_Dist + gamma L_CKA)|| / ||grad L_total|| on the backbone's
    trainable parameters equals the one from two separate backward passes (float64, dropout off); the
    embedding-space proxy is reported next to it. GradCache mode reports the proxy only."""
    from tempokern.nn import TMRLLoss
    torch.manual_seed(0)
    m = no_dropout(tiny_encoder(rows, lora=None, dtype=torch.float64, dropout=False))
    cfg = _cfg(beta=0.1, gamma=0.1, cache_embeddings=cache, mini_batch_size=7)
    tr = TMRLTrainer(m, rows, cfg)
    tr.diagnose_params = True
    batch = tr.epoch_batches(0)[0]
    m.train()
    m.zero_grad(set_to_none=True)
    tr.backward_batch(batch, diagnose=True)
    d = tr.last_diagnostics
    assert 0 < d["aux_grad_ratio"] < 1
    if cache:
        assert "params" not in d
        return
    bb = [(n, p) for n, p in m.named_parameters() if p.requires_grad and not n.startswith("projector.")]
    g_tot = torch.cat([p.grad.reshape(-1) for _, p in bb])
    full = tr.loss_fn

    def aux_only(*a, **kw):
        loss, parts, terms = full(*a, **kw, return_terms=True)
        return terms["dist"] + terms["cka"], parts
    m.zero_grad(set_to_none=True)
    tr2 = TMRLTrainer(m, rows, cfg, loss_fn=aux_only)
    tr2.backward_batch(batch)
    g_aux = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in bb])
    exact = float(g_aux.norm() / g_tot.norm())
    assert d["params"]["aux_grad_ratio"] == pytest.approx(exact, rel=1e-9)
    assert d["params"]["tensors"] == len(bb)
    assert isinstance(full, TMRLLoss)
