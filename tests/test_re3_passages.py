"""Re³ options for long, many-dated documents (TimeQA): one-date passages, normalised e_sem, the multiscale
year encoding (an extension), same-group time-wrong twins, epoch selection on a dev split, the learned
parser's FiLM trained on its own times, and relevance meaning qrels score > 0."""
import datetime as dt
import hashlib

import pytest
import torch
import torch.nn.functional as F

from tempokern.datasets import Query, Record, RetrievalDataset
from tempokern.models.re3 import Re3Encoder
from tempokern.nn import TimeEmbedding
from tempokern.text.time import TimeTuple, date_passages, find_times, sentence_spans
from tempokern.training.re3 import (Re3Config, Re3Example, Re3Trainer, _trainable_state, dev_groups, dev_scorer,
                                    docs_from_dataset, examples_from_dataset, re3_runs, time_wrong_twins,
                                    train_re3)

from test_re3_fidelity import _tiny_re3

P = TimeTuple.partial
pytestmark = pytest.mark.usefixtures("single_thread")


# ---- passages -------------------------------------------------------------------------------------------------

def test_sentence_spans_keep_initials_and_split_tokenised_stops():
    text = ("Newton D . Baker House is a house in Washington , D.C. . Built in 1794 , it was home of Newton D . "
            "Baker . After 1963 , Jacqueline Kennedy lived here .")
    sents = [text[a:b] for a, b in sentence_spans(text)]
    assert sents == ["Newton D . Baker House is a house in Washington , D.C. .",
                     "Built in 1794 , it was home of Newton D . Baker .",
                     "After 1963 , Jacqueline Kennedy lived here ."]


def test_date_passages_one_per_date_with_context():
    text = "Acme was founded in 1990 . It grew . In 2001 it moved to Ohio . It closed on 3 May 2010 ."
    ps = date_passages(text, context=0)
    assert [p.text for p in ps] == ["Acme was founded in 1990 .", "In 2001 it moved to Ohio .",
                                    "It closed on 3 May 2010 ."]
    assert [p.time.start for p in ps] == [P(1990), P(2001), P(2010, 5, 3)]
    ps1 = date_passages(text, context=1)
    assert ps1[0].text == "Acme was founded in 1990 . It grew ."
    assert ps1[1].text == "It grew . In 2001 it moved to Ohio . It closed on 3 May 2010 ."
    assert [p.time for p in ps1] == [p.time for p in ps]
    none = date_passages("No date at all here .")
    assert len(none) == 1 and none[0].time is None and none[0].text == "No date at all here ."
    with pytest.raises(ValueError, match="context"):
        date_passages(text, context=-1)


DOCS = ["Acme was founded in 1990 . It grew fast . In 2001 Acme moved to Ohio .",
        "Bolt opened in 1995 . Bolt closed in 2008 .",
        "Core has no date ."]
QS = ["Where was Acme in 2001?", "What did Bolt do in 1995?", "What is Core?"]


def test_passages_score_a_document_by_its_best_passage():
    m = _tiny_re3(DOCS + QS, pooling="mean", passages="date_windows", passage_context=0, normalize_sem=True)
    emb, owner = m.encode_multi(DOCS)
    assert owner.tolist() == [0, 0, 1, 1, 2]
    q = m.encode(QS)
    got = m.score_multi(q, emb, owner, len(DOCS))
    # literal: each passage is its own text with its own date, fused from its own normalised e_sem
    per = [[("Acme was founded in 1990 .", P(1990)), ("In 2001 Acme moved to Ohio .", P(2001))],
           [("Bolt opened in 1995 .", P(1995)), ("Bolt closed in 2008 .", P(2008))],
           [("Core has no date .", None)]]
    for j, ps in enumerate(per):
        cand = torch.cat([m.encode([t], times=[tt]) for t, tt in ps])
        torch.testing.assert_close(got[:, j], (q @ cand.t()).amax(1), rtol=1e-6, atol=1e-6)
    # re3_runs ranks with the passages
    recs = [Record(f"d{i}", t) for i, t in enumerate(DOCS)]
    qs = [Query(f"q{i}", t, gold={f"d{i}": 1}, split="test") for i, t in enumerate(QS)]
    run = re3_runs(m, RetrievalDataset("toy", recs, qs), ["test"], depth=3)["test"]
    for i in range(2):   # dated queries: the passage scores (time-less "What is Core?" falls back to the base)
        for j in range(3):
            assert run[f"q{i}"][f"d{j}"] == pytest.approx(float(got[i, j]), abs=1e-5)


def test_passages_options_are_checked_and_saved(tmp_path):
    with pytest.raises(ValueError, match="passages"):
        _tiny_re3(DOCS, passages="sentences")
    with pytest.raises(ValueError, match="time_parser"):
        _tiny_re3(DOCS, passages="date_windows", time_parser="learned")
    with pytest.raises(ValueError, match="exclusive"):
        _tiny_re3(DOCS, passages="date_windows", multi_time=True)
    with pytest.raises(ValueError, match="year_encoding"):
        _tiny_re3(DOCS, year_encoding="fourier")
    m = _tiny_re3(DOCS + QS, passages="date_windows", passage_context=0, normalize_sem=True,
                  year_encoding="multiscale")
    m.save(tmp_path / "m")
    back = Re3Encoder.load(tmp_path / "m")
    assert (back.passages, back.passage_context, back.normalize_sem) == ("date_windows", 0, True)
    assert back.time_embed.year_encoding == "multiscale" and back.time_embed.year_periods == (10.0, 100.0, 1000.0)
    e0, o0 = m.encode_multi(DOCS)
    e1, o1 = back.encode_multi(DOCS)
    assert torch.equal(o0, o1)
    torch.testing.assert_close(e0, e1)
    # the paper's defaults write no new key, so a checkpoint reads as before
    assert "passages" not in _tiny_re3(DOCS).config_dict() and "year_encoding" not in _tiny_re3(DOCS).config_dict()


# ---- normalised e_sem ---------------------------------------------------------------------------------------

def test_normalize_sem_untrained_equals_base_and_time_term_is_norm_free():
    texts = DOCS + QS
    from test_re3_fidelity import word_tokenizer
    from tempokern.models import tiny_bert
    tok = word_tokenizer(texts)
    bb = tiny_bert(len(tok), hidden=64, layers=1, heads=2, intermediate=128, max_position=64, seed=0)
    m = Re3Encoder(bb, tokenizer=tok, max_length=48, normalize_sem=True, pooling="mean").eval()
    # zero-initialised FiLM: e_final = normalize(normalize(e_sem)) = the base embedding (to rounding)
    torch.testing.assert_close(m.encode(texts), m.base_embeddings(texts), rtol=0, atol=1e-6)
    with torch.no_grad():
        for p in m.film.parameters():
            p.add_(0.3 * torch.randn_like(p))
    # with FiLM trained, e_final no longer depends on the norm of e_sem (scaling e_sem changes nothing)
    e = m.semantic(texts)
    v, mk = TimeTuple.batch([P(2001)] * len(texts))
    torch.testing.assert_close(m.fuse(e, v, mk), m.fuse(7.0 * e, v, mk), rtol=1e-5, atol=1e-6)
    m.normalize_sem = False
    assert not torch.allclose(m.fuse(e, v, mk), m.fuse(7.0 * e, v, mk), atol=1e-3)


# ---- multiscale year --------------------------------------------------------------------------------------

def test_multiscale_year_encoding_reads_the_year_at_several_periods():
    torch.manual_seed(0)
    paper = TimeEmbedding(32, year_mean=1900, year_std=120)
    assert paper.mlp_y[0].in_features == 1 and paper.year_encoding == "scalar"
    ms = TimeEmbedding(32, year_mean=1900, year_std=120, year_encoding="multiscale")
    assert ms.mlp_y[0].in_features == 7
    years = [1988, 1989]
    v, mk = TimeTuple.batch([P(y) for y in years])
    with torch.no_grad():
        h = ms(v, mk)[:, :ms.block]
        yn = (torch.tensor(years, dtype=torch.float64) - 1900) / 120
        feats = [yn[:, None]] + [torch.stack([torch.sin(2 * torch.pi * torch.tensor(years, dtype=torch.float64) / t),
                                              torch.cos(2 * torch.pi * torch.tensor(years, dtype=torch.float64) / t)],
                                             1) for t in (10, 100, 1000)]
        ref = ms.mlp_y(torch.cat(feats, 1).float())
    torch.testing.assert_close(h, ref, rtol=1e-5, atol=1e-6)
    # one year apart: the 10-year pair turns 36 degrees, the scalar moves 1/120
    x = torch.cat(feats, 1)
    assert abs(float(x[0, 0] - x[1, 0])) < 0.01 and float((x[0, 1:3] - x[1, 1:3]).norm()) > 0.6
    # unobserved year: exact zero block
    v0, m0 = TimeTuple.batch([P(None, 5)])
    assert torch.equal(ms(v0, m0)[:, :ms.block], torch.zeros(1, ms.block))
    with pytest.raises(ValueError, match="year_periods"):
        TimeEmbedding(32, year_encoding="multiscale", year_periods=(1, 10))


# ---- twins, dev split, relevance -----------------------------------------------------------------------------

def _page_set():
    recs = [Record("A:0", "Acme", meta={"page": "A"}),
            Record("A:1", "Acme was led by Ann from 1990 to 1995 .", meta={"page": "A"}),
            Record("A:2", "Acme was led by Bob from 1996 to 2004 .", meta={"page": "A"}),
            Record("A:3", "Acme was led by Cid from 2005 to 2012 . In 1998 it moved .", meta={"page": "A"}),
            Record("B:0", "Bolt was led by Dan from 1980 to 1990 .", meta={"page": "B"}),
            Record("C:0", "Core was led by Eve in 2001 .", meta={"page": "C"})]
    qs = [Query("qa", "Who led Acme from 1997 to 1999?", gold={"A:2": 1, "A:1": 0}, split="train", meta={"page": "A"}),
          Query("qb", "Who led Bolt in 1985?", gold={"B:0": 1}, split="train", meta={"page": "B"}),
          Query("qc", "Who led Core?", gold={"C:0": 1}, split="train", meta={"page": "C"})]
    return RetrievalDataset("pages", recs, qs)


def test_time_wrong_twin_is_a_same_page_record_with_every_date_outside_the_interval():
    ds = _page_set()
    logs = []
    tw = time_wrong_twins(ds, ds.queries, group_key="page", log=logs.append)
    # A:3 names 1998 (inside 1997-1999): not a twin; A:1 (1990-1995) is, A:0 has no date; A:2 is the gold.
    # A:1 ends 1995, A:3 would start 2005: the nearest outside is A:1 (also a judged non-relevant record)
    assert tw == {"qa": "A:1", "qb": None, "qc": None}
    assert "1/3" in logs[0] and "1 without a dated interval" in logs[0]


def test_dev_groups_are_seeded_hash_shares():
    pages = [f"page{i}" for i in range(400)]
    a = dev_groups(pages, share=0.12, seed=0)
    assert a == dev_groups(list(reversed(pages)), share=0.12, seed=0)       # order-free
    assert a == {p for p in pages if int(hashlib.sha256(f"re3-dev:0:{p}".encode()).hexdigest(), 16) / 2 ** 256 < 0.12}
    assert 30 <= len(a) <= 70 and dev_groups(pages, share=0.12, seed=1) != a
    assert dev_groups(pages[:10], share=0.12, seed=0) == a & set(pages[:10]) or len(dev_groups(pages[:10])) == 1
    with pytest.raises(ValueError, match="share"):
        dev_groups(pages, share=1.0)


def test_examples_need_a_relevant_gold():
    recs = [Record("d0", "Acme in 2001 ."), Record("d1", "Acme in 2002 .")]
    qs = [Query("q0", "Acme in 2001?", gold={"d0": 0, "d1": 0}, split="train"),    # judged, none relevant
          Query("q1", "Acme in 2002?", gold={"d0": 0, "d1": 2}, split="train")]
    ex = examples_from_dataset(RetrievalDataset("r", recs, qs))
    assert [(e.query, e.positive) for e in ex] == [("Acme in 2002?", "d1")]
    with pytest.raises(ValueError, match="no query"):
        examples_from_dataset(RetrievalDataset("r", recs, qs[:1]))


def _train_toy():
    recs, qs = [], []
    for e in ("Acme", "Bolt", "Core", "Dune"):
        for y in (1990, 1995, 2000, 2005):
            recs.append(Record(f"{e}{y}", f"{e} sales in {y} were high . Other news in {y + 1} ."))
            qs.append(Query(f"q{e}{y}", f"{e} sales in {y}?", gold={f"{e}{y}": 1}, split="train"))
    return RetrievalDataset("toy", recs, qs)


def test_dev_eval_keeps_the_best_epoch_and_logs_it(tmp_path):
    ds = _train_toy()
    texts = [r.text for r in ds.records] + [q.text for q in ds.queries]
    m = _tiny_re3(texts, pooling="mean", passages="date_windows", passage_context=0)
    with torch.no_grad():
        m.film.proj[2].weight.zero_()       # start at the base
    start = {k: v.clone() for k, v in _trainable_state(m).items()}
    seen = []

    def dev(model):        # the untrained model is the best: the trained weights must be dropped
        seen.append(1)
        return 1.0 if len(seen) == 1 else 0.5 - 0.01 * len(seen)
    cfg = Re3Config(epochs=3, batch_size=8, progress=False)
    res = train_re3(m, docs_from_dataset(ds), examples_from_dataset(ds), cfg, tmp_path, dev_eval=dev,
                    log=lambda *a: None)
    assert res.best_epoch == 0 and [h["epoch"] for h in res.dev_history] == [0, 1, 2, 3] and res.steps > 0
    for k, v in _trainable_state(m).items():
        if not k.endswith(("year_mean", "year_std")):     # the year statistics are fitted before epoch 0
            assert torch.equal(v, start[k]), k
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert sum('"event": "dev"' in ln for ln in lines) == 4

    m2 = _tiny_re3(texts, pooling="mean", passages="date_windows", passage_context=0)
    vals = iter([0.1, 0.2, 0.9, 0.3])
    res2 = train_re3(m2, docs_from_dataset(ds), examples_from_dataset(ds), cfg, tmp_path / "b",
                     dev_eval=lambda model: next(vals), log=lambda *a: None)
    assert res2.best_epoch == 2


def test_dev_scorer_ranks_dev_queries_over_dev_records():
    ds = _train_toy()
    texts = [r.text for r in ds.records] + [q.text for q in ds.queries]
    m = _tiny_re3(texts, pooling="mean")
    sc = dev_scorer(ds, ds.queries)
    v = sc(m)
    assert 0 < v <= 1 and sc.queries == len(ds.queries) and sc.records == len(ds.records)


def test_trainer_trains_passages_on_the_passage_closest_to_the_query():
    ds = _train_toy()
    texts = [r.text for r in ds.records] + [q.text for q in ds.queries]
    m = _tiny_re3(texts, pooling="mean", passages="date_windows", passage_context=0)
    ex = [Re3Example("Acme sales in 1991?", "Acme1990", "Acme2005")]
    tr = Re3Trainer(m, docs_from_dataset(ds), ex + examples_from_dataset(ds)[:3], Re3Config(progress=False),
                    log=lambda *a: None)
    tr._prepare()
    pos_row, tw_row = int(tr.ex_rows[0][0]), int(tr.ex_rows[1][0])
    # 1991 is closer to "Other news in 1991" than to "sales in 1990": that passage, with its own date
    assert tr.dtexts[pos_row] == "Other news in 1991 ."
    assert tr.dtexts[tw_row] == "Acme sales in 2005 were high ."
    v, mk, _, _ = tr.ex_times[0]
    assert int(v[0, 0]) == 1991 and bool(mk[0, 0])


def test_learned_parser_film_trains_on_the_times_the_model_reads():
    from test_re3_fidelity import MONTHS
    days = [dt.date(2012, 1, 1) + dt.timedelta(days=40 * i) for i in range(12)]
    recs = [Record(f"r{i}", f"acme sales on {d.day} {MONTHS[d.month - 1]} {d.year} were high .", published=d)
            for i, d in enumerate(days)]
    qs = [Query(f"q{i}", f"how many acme sales on {MONTHS[d.month - 1]} {d.day}, {d.year} ?", gold={f"r{i}": 1},
                split="train") for i, d in enumerate(days)]
    ds = RetrievalDataset("toy", recs, qs)
    texts = [r.text for r in recs] + [q.text for q in qs]
    for film_times in ("model", "silver"):
        m = _tiny_re3(texts, time_parser="learned", parser_years=(2010, 2016))
        cfg = Re3Config(variant="film", epochs=1, batch_size=4, progress=False, parser_epochs=2,
                        film_times=film_times)
        tr = Re3Trainer(m, docs_from_dataset(ds), examples_from_dataset(ds), cfg, log=lambda *a: None)
        tr.fit()
        learned = m.intervals(tr.qtexts, role="query")
        from tempokern.models.re3 import resolve_intervals
        rules = resolve_intervals(tr.qtexts, role="query")
        assert learned != rules          # 2 epochs of heads: the learned parse differs from the rules somewhere
        assert tr.qtimes == (learned if film_times == "model" else rules)
    with pytest.raises(ValueError, match="film_times"):
        Re3Config(film_times="rules").validate()


# ---- the suite rows -------------------------------------------------------------------------------------------

from test_suite_realdata import folder, tiny_backbone  # noqa: E402,F401  (fixtures: a BEIR folder, a tiny BERT)


def test_suite_rows_run_with_twins_and_a_dev_split_of_the_training_pages(tmp_path, folder, tiny_backbone):  # noqa: F811
    import json

    from tempokern.suite import Budget
    from tempokern.suite.realdata import beir_set
    from tempokern.suite.runner import run_suite, unit_path
    rows = ["re3-passages", "re3-passages-multiscale"]
    budget = Budget(epochs=1, max_length=48, batch_size=8, lr=1e-3, hard_negatives=1)
    res = run_suite(tmp_path, suite="data", data_dir=str(folder), quick=True, methods=rows, backbone_path=tiny_backbone,
                    budget=budget, progress=False, log=lambda m: None, n_resamples=20, plots=False)
    s = beir_set(str(folder))
    qby = {q.id: q for q in s.dataset.queries}
    train_pages = {qby[r.query_id].meta["page"] for r in s.train_rows}
    dev = dev_groups(train_pages, share=0.12, seed=0)
    for name in rows:
        assert res["methods"][name]["status"] == "done", res["methods"][name]
        info = json.loads(unit_path(tmp_path, name, "data", 0).read_text())["payload"]["info"]
        # 4 training pages: one set apart for epoch selection (never an evaluated page), its 5 questions out of training
        assert info["dev_pages"] == len(dev) == 1 and info["dev_queries"] == 5
        assert info["examples"] == len(s.train_rows) - 5
        # every dated training question has a same-page twin outside its interval (the other career paragraphs)
        assert info["examples_with_time_wrong"] == info["examples"]
        assert [h["epoch"] for h in info["dev_history"]] == list(range(11)) and info["best_epoch"] in range(11)
        assert info["model"]["passages"] == "date_windows" and info["model"]["normalize_sem"] is True
