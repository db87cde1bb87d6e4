import json
import math

import numpy as np
import pytest
import torch

from tempokern import Calendar
from tempokern.baselines import BM25Scorer, TimeKDEScorer, char_ngram_tokenize, time_kde_prior
from tempokern.calendar import Interval
from tempokern.datasets import Query, Record, RetrievalDataset, load_zztj_sample
from tempokern.eval import CHUNQIU_MODES, EvalTable, Mode, evaluate, parse_protocol, retrieval_metrics


@pytest.fixture(scope="module")
def toy():
    """A tiny ChunQiuTR-like set on the real calendar: one val month, one test month, a window."""
    cal = Calendar.chunqiu()
    val_m, test_m = (1, 11, 1), (1, 2, 1)          # Yin 11 is val, Yin 2 is test
    assert cal.split(val_m) == "val" and cal.split(test_m) == "test"

    def rec(i, key, typ):
        r = cal.rank(key)
        return Record(i, f"text {i}", key=key, interval=Interval(r, r), type=typ)
    recs = [rec("ev", val_m, "event"), rec("ne", (1, 11, 2), "no_event"), rec("neg", val_m, "neg_comment"),
            rec("et", test_m, "event"), rec("et2", (1, 2, 2), "event"), rec("other", (1, 3, 1), "event")]

    def q(i, target, fam, gold, pne=False):
        iv = cal.interval(*target)
        return Query(i, f"query {i}", interval=iv, family=fam, gold={g: 1 for g in gold}, pure_no_event=pne,
                     split=cal.split_of_interval(iv))
    qs = [q("vp", (val_m,), "point", ["ev"]), q("vne", ((1, 11, 2),), "point", ["ne"], True),
          q("vw", ((1, 11, 1), (1, 11, 2)), "window", ["ev", "ne"]),
          q("tp", (test_m,), "point", ["et"]), q("tg", ((1, 2, 1), (1, 2, 2)), "gap", ["et", "et2"])]
    return RetrievalDataset("toy", recs, qs, cal)


def oracle(queries, gallery):
    return np.asarray([[1.0 if r.id in q.gold else 0.0 for r in gallery] for q in queries])


def anti(queries, gallery):
    # gold last; "neg" first when present
    return np.asarray([[-1.0 if r.id in q.gold else (5.0 if r.type == "neg_comment" else 0.0) for r in gallery]
                       for q in queries])


def test_oracle_scores_one_everywhere(toy):
    tab = evaluate(oracle, toy, protocol="chunqiu")
    assert {r["mode"] for r in tab.rows} == {m.name for m in CHUNQIU_MODES}
    for r in tab.rows:
        for m in ("R@1", "R@5", "R@10", "MRR@10", "nDCG@10", "recall@10"):
            assert r[m] == pytest.approx(1.0), (r, m)
    assert tab.get("neg1_ne1_dq0", "test", "all")["TR@10"] < 1.0        # other docs fill the top 10


def test_protocol_switches(toy):
    tab = evaluate(oracle, toy, protocol=["neg0_ne0_dq1", "neg1_ne1_dq0", "neg1_ne1_dq1"])
    info = tab.info["modes"]
    assert info["neg0_ne0_dq1"]["gallery_size"] == 4 and info["neg1_ne1_dq0"]["gallery_size"] == 6
    # ne0: the pure no-event query loses its gold and drops; the window keeps only "ev"
    assert info["neg0_ne0_dq1"]["splits"]["val"] == {"queries": 2, "dropped_pure_no_event": 1,
                                                     "dropped_no_gold_in_gallery": 0}
    assert info["neg1_ne1_dq0"]["splits"]["val"]["queries"] == 3
    assert info["neg1_ne1_dq1"]["splits"]["val"] == {"queries": 2, "dropped_pure_no_event": 1,
                                                     "dropped_no_gold_in_gallery": 0}
    # families: val has point (vp, vne) and window (vw); test has point + gap ("window" row holds the gap)
    fams = {(r["mode"], r["split"], r["family"]): r["N"] for r in tab.rows}
    assert fams[("neg1_ne1_dq0", "val", "point")] == 2 and fams[("neg1_ne1_dq0", "val", "window")] == 1
    assert fams[("neg1_ne1_dq0", "test", "window")] == 1 and fams[("neg1_ne1_dq0", "test", "gap")] == 1
    assert fams[("neg1_ne1_dq0", "test", "all")] == 2


def test_gold_cut_to_gallery_changes_ideal(toy):
    # the anti scorer ranks gold last: with neg in the gallery the neg record goes first
    t0 = evaluate(anti, toy, protocol="neg0_ne1_dq0", splits=["val"]).get(family="point")
    t1 = evaluate(anti, toy, protocol="neg1_ne1_dq0", splits=["val"]).get(family="point")
    # val point queries vp, vne: gallery of 5 (neg0) / 6 (neg1); gold at the last rank
    assert t0["MRR@10"] == pytest.approx(1 / 5) and t1["MRR@10"] == pytest.approx(1 / 6)
    assert t0["R@1"] == 0.0


def test_runner_matches_retrieval_metrics(toy):
    rng = np.random.default_rng(0)
    fixed = {}

    def rand(queries, gallery):
        return np.asarray([[fixed.setdefault((q.id, r.id), float(rng.random())) for r in gallery] for q in queries])
    tab = evaluate(rand, toy, protocol="full", splits=["test"])
    gal = [r.id for r in toy.gallery()]
    run = {q.id: {d: fixed[(q.id, d)] for d in gal} for q in toy.queries if q.split == "test"}
    qrels = {q.id: q.gold for q in toy.queries if q.split == "test"}
    want = retrieval_metrics(run, qrels)
    row = tab.get(family="all")
    for m in ("R@1", "R@5", "MRR@10", "nDCG@10", "recall@5"):
        assert row[m] == pytest.approx(want[m])


def test_scorer_kinds_and_errors(toy):
    class Index:
        def score(self, queries, gallery):
            return torch.as_tensor(oracle(queries, gallery), dtype=torch.float16)
    assert evaluate(Index(), toy).get(split="val")["R@1"] == 1.0
    assert evaluate(lambda q, g: oracle(q, g).tolist(), toy).get(split="val")["R@1"] == 1.0
    with pytest.raises(ValueError, match="shape"):
        evaluate(lambda q, g: np.zeros((len(q), len(g) + 1)), toy)
    with pytest.raises(ValueError, match="NaN"):
        evaluate(lambda q, g: np.full((len(q), len(g)), np.nan), toy)
    with pytest.raises(TypeError, match="scorer"):
        evaluate(42, toy)
    with pytest.raises(TypeError, match="dataset"):
        evaluate(oracle, [1, 2])
    with pytest.raises(ValueError, match="neg1_ne1_dq0"):
        evaluate(oracle, toy, protocol="neg1_ne1")
    assert parse_protocol({"neg": 0, "ne": 1, "dq": 1}) == [Mode(False, True, True)]
    assert len(parse_protocol("chunqiu")) == 6


def test_table_outputs(toy, tmp_path):
    tab = evaluate(oracle, toy, protocol="neg1_ne1_dq0")
    md = tab.to_markdown()
    assert md.splitlines()[0].startswith("| mode | split | family | N | R@1") and "| neg1_ne1_dq0 | val | all |" in md
    p = tmp_path / "t.json"
    text = tab.to_json(str(p))
    assert json.loads(p.read_text(encoding="utf-8")) == json.loads(text)
    back = EvalTable.from_json(str(p))
    assert back.rows == tab.rows and back.metrics == tab.metrics
    assert not list(tmp_path.glob(".tmp-*"))
    with pytest.raises(ValueError, match="EvalTable"):
        EvalTable.from_json('{"rows": []}')


# ---- baselines ----------------------------------------------------------------------------------

def test_char_tokenizer():
    assert char_ngram_tokenize("公會戎") == ["公", "會", "戎", "公會", "會戎"]
    assert char_ngram_tokenize("Duke Yin, 722 BCE。元年") == ["duke", "yin", "722", "bce", "元", "年", "元年"]
    assert char_ngram_tokenize("元年", keep_unigram=False) == ["元年"]


def test_bm25_matches_lucene_formula():
    pytest.importorskip("bm25s")
    docs = ["公會戎于潛", "公及戎盟于唐", "秋七月", "冬十月"]
    gallery = [Record(str(i), t) for i, t in enumerate(docs)]
    scorer = BM25Scorer(k1=1.2, b=0.75, ngram=1)
    got = scorer([Query("q", "公戎")], gallery)[0]
    toks = [list(t) for t in docs]
    avg = sum(map(len, toks)) / len(toks)
    N = len(docs)
    want = []
    for t in toks:
        s = 0.0
        for term in "公戎":
            df = sum(term in d for d in toks)
            idf = math.log(1 + (N - df + 0.5) / (df + 0.5))
            tf = t.count(term)
            s += idf * tf / (tf + 1.2 * (1 - 0.75 + 0.75 * len(t) / avg))
        want.append(s)
    assert np.allclose(got, want, rtol=1e-5)


def test_time_kde_prior():
    scores = np.array([5.0, 4.0, 0.0, 0.0, 3.0])
    times = np.array([10, 10, 50, 90, -1])
    p = time_kde_prior(scores, times, num_bins=100, topk=2, sigma=2.0)
    assert p[0] == p[1] > 0 and p[2] == 0.0 and p[3] == 0.0       # bins 50, 90 are beyond 3 sigma of 10
    # density at the centre: kernel value 1 at 2 docs / total mass of 2 truncated-free kernels
    W = 6
    mass = 2 * np.exp(-(np.arange(-W, W + 1) ** 2) / 8.0).sum()
    assert p[0] == pytest.approx(2 / mass)
    assert p[4] == pytest.approx(1 / 100)                            # untimed doc: mean density
    assert np.allclose(time_kde_prior(np.zeros(5), times, 100), 1 / 100)


def test_baselines_on_zztj_sample():
    pytest.importorskip("bm25s")
    d = load_zztj_sample()
    bm = evaluate(BM25Scorer(), d, protocol="neg0_ne0_dq1").get(family="all")
    kde = evaluate(TimeKDEScorer(), d, protocol="neg0_ne0_dq1").get(family="all")
    # 92 month queries over 266 records: chance R@10 is about 10 * 2.9 / 266 ~ 0.11
    assert bm["N"] == kde["N"] == 92
    assert bm["R@10"] > 0.3 and kde["R@10"] > 0.3
    # the no_event records carry the month phrase the queries ask about, so they outrank events
    full = evaluate(BM25Scorer(), d, protocol="neg1_ne1_dq0").get(family="all")
    assert full["R@10"] < bm["R@10"]
