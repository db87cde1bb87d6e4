"""Re³ on real text: ranges as intervals, several dates per document (the multi-time extension), the learned
time parser (TimeParserHeads on [CLS], trained on silver labels, saved with the checkpoint) and the base
fallback for queries without a time."""
import datetime as dt
import random
import re

import pytest
import torch
import torch.nn.functional as F

from tempokern.datasets import Query, Record, RetrievalDataset
from tempokern.models import tiny_bert
from tempokern.models.re3 import Re3Encoder, interval_batch, resolve_intervals
from tempokern.text.time import TimeTuple, find_times, parse_time
from tempokern.training.re3 import Re3Config, Re3Trainer, docs_from_dataset, examples_from_dataset, \
    fit_time_parser, re3_runs

P = TimeTuple.partial
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one torch thread for the module


def word_tokenizer(texts):
    """A word-level BERT tokenizer (every word and number one token) over the given texts."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(special)}
    for t in texts:
        for w in re.findall(r"\w+|[^\w\s]", t.lower()):
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


# ---- ranges and several dates --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("Sales ran March 3-5, 2014.", [(P(2014, 3, 3), P(2014, 3, 5))]),
    ("open 3 to 5 March 2014", [(P(2014, 3, 3), P(2014, 3, 5))]),
    ("from March 3 to April 5, 2014", [(P(2014, 3, 3), P(2014, 4, 5))]),
    ("the 2010-2015 plan", [(P(2010), P(2015))]),
    ("between 2010 and 2015 it grew", [(P(2010), P(2015))]),
    ("from 1999 to 2003 he lived there", [(P(1999), P(2003))]),
    ("March 2014 - June 2015", [(P(2014, 3), P(2015, 6))]),
    ("from 5 May to 7 June 2015", [(P(2015, 5, 5), P(2015, 6, 7))]),
    ("in the 1990s", [(P(1990), P(1999))]),
    ("In 2012 and again on 5 May 2015.", [(P(2012), P(2012)), (P(2015, 5, 5), P(2015, 5, 5))]),
    ("no date here", []),
])
def test_find_times_ranges_are_intervals(text, expected):
    got = [(s.start, s.end) for s in find_times(text)]
    assert got == expected
    if expected and "1990s" not in text:
        # parse_time reads the first expression's start (find_times may add a part the other end gives)
        pt, start = parse_time(text), expected[0][0]
        assert all(getattr(pt, f) == getattr(start, f) for f, on in zip(("year", "month", "day"), pt.mask) if on)


def _tiny_re3(texts, **kw):
    tok = word_tokenizer(texts)
    bb = tiny_bert(len(tok), hidden=64, layers=1, heads=2, intermediate=128, max_position=64, seed=0)
    torch.manual_seed(0)
    m = Re3Encoder(bb, tokenizer=tok, max_length=48, **kw)
    with torch.no_grad():                     # a non-trivial FiLM (its output layer starts at zero)
        for p in m.film.parameters():
            p.add_(0.3 * torch.randn_like(p))
        m.film.alpha.fill_(1.0)
    return m.eval()


def test_range_embeds_as_the_mean_of_its_ends():
    texts = ["sales from 2010 to 2015 rose", "sales in 2012 rose"]
    m = _tiny_re3(texts)
    e_sem = m.semantic(texts)
    e = m.encode(texts)
    # literal: e_time = (E(2010) + E(2015)) / 2 for the range, E(2012) for the point
    v0, m0 = TimeTuple.batch([P(2010), P(2012)])
    v1, m1 = TimeTuple.batch([P(2015), P(2012)])
    with torch.no_grad():
        e_time = (m.time_embed(v0, m0) + m.time_embed(v1, m1)) / 2
        ref = m.film(e_sem, e_time)
    torch.testing.assert_close(e, ref.float(), rtol=1e-6, atol=1e-6)
    start = _tiny_re3(texts, ranges="start")
    start.load_state_dict(m.state_dict())
    es = start.encode(texts)
    assert torch.equal(es[1], e[1]) and not torch.allclose(es[0], e[0])
    with torch.no_grad():
        assert torch.allclose(es[0], m.film(e_sem[:1], m.time_embed(v0[:1], m0[:1])).float(), atol=1e-6)


def test_multi_time_scores_a_document_by_its_best_matching_time():
    docs = ["Acme reported sales in 2012 and again on 5 May 2015.", "Bolt reported sales in 2013.",
            "Core reported sales."]
    qs = ["Acme sales on 5 May 2015?", "Acme sales in 2012?"]
    m = _tiny_re3(docs + qs, multi_time=True)
    emb, owner = m.encode_multi(docs)
    assert owner.tolist() == [0, 0, 1, 2]
    q = m.encode(qs)
    got = m.score_multi(q, emb, owner, len(docs))
    # literal: each document's score is the max over its times, each time encoded on its own
    per = [[P(2012), P(2015, 5, 5)], [P(2013)], [None]]
    for j, ts in enumerate(per):
        cand = torch.stack([m.encode([docs[j]], times=[t])[0] for t in ts])
        torch.testing.assert_close(got[:, j], (q @ cand.t()).amax(1), rtol=1e-6, atol=1e-6)
    assert resolve_intervals(docs[:1], every=True) == [[(P(2012), P(2012)), (P(2015, 5, 5), P(2015, 5, 5))]]
    assert resolve_intervals(docs[:1]) == [[(P(2012), P(2012))]]


# ---- the learned parser ---------------------------------------------------------------------------------------

TEMPLATES = ["{e} sales on {d} {M} {y} were high .", "how many {e} sales on {M} {d}, {y} ?",
             "{e} reported in {M} {y} .", "the {e} figure for {y} ."]
ENTS = ["acme", "bolt", "core", "dyna", "echo"]


def _parser_texts(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        y, mo, d = rng.randrange(2010, 2020), rng.randrange(1, 13), rng.randrange(1, 29)
        tpl = rng.choice(TEMPLATES)
        out.append(tpl.format(e=rng.choice(ENTS), d=d, M=MONTHS[mo - 1], y=y))
    return out


def test_learned_parser_fits_silver_labels_and_parses_held_out_text(tmp_path):
    train, held = _parser_texts(600, 0), _parser_texts(150, 1)
    held = [t for t in held if t not in set(train)]
    m = _tiny_re3(train + held + MONTHS, time_parser="learned", parser_years=(2005, 2025))
    assert m.parser is not None and not m.parser_fitted
    info = fit_time_parser(m, train, epochs=40, lr=2e-2, log=lambda *a: None)
    assert m.parser_fitted and info["train_exact"] > 0.8
    silver = [parse_time(t) for t in held]
    pred = m.parse_learned(held)
    acc = lambda f: sum(f(p) == f(s) for p, s in zip(pred, silver)) / len(held)  # noqa: E731
    year, month, mask = acc(lambda t: t.year), acc(lambda t: t.month), acc(lambda t: t.mask)
    assert year > 0.85 and month > 0.85 and mask > 0.9, (year, month, mask)
    # encode conditions on the learned parser's times
    ivs = m.intervals(held[:5])
    assert [iv[0][0] if iv else TimeTuple() for iv in ivs] == pred[:5]
    # saved and loaded with the checkpoint
    m.save(tmp_path / "re3")
    back = Re3Encoder.load(tmp_path / "re3")
    assert back.time_parser == "learned" and back.parser_fitted and back.parser.first_year == 2005
    assert back.parse_learned(held) == pred
    torch.testing.assert_close(back.encode(held[:8]), m.encode(held[:8]))


def test_trainer_fits_the_learned_parser_first():
    days = [dt.date(2012, 1, 1) + dt.timedelta(days=40 * i) for i in range(12)]
    recs = [Record(f"r{i}", f"acme sales on {d.day} {MONTHS[d.month - 1]} {d.year} were high .", published=d)
            for i, d in enumerate(days)]
    qs = [Query(f"q{i}", f"how many acme sales on {MONTHS[d.month - 1]} {d.day}, {d.year} ?", gold={f"r{i}": 1},
                split="train") for i, d in enumerate(days)]
    ds = RetrievalDataset("toy", recs, qs)
    m = _tiny_re3([r.text for r in recs] + [q.text for q in qs], time_parser="learned", parser_years=(2010, 2016))
    cfg = Re3Config(variant="film", epochs=1, batch_size=4, progress=False, parser_epochs=5)
    Re3Trainer(m, docs_from_dataset(ds), examples_from_dataset(ds), cfg, log=lambda *a: None).fit()
    assert m.parser_fitted


# ---- queries without a time -----------------------------------------------------------------------------------

def test_time_less_queries_score_with_the_base_relevance():
    recs = [Record(f"r{i}", f"{e} sales on {d} March 2014 were {i} units .", published=dt.date(2014, 3, d))
            for i, (e, d) in enumerate([("acme", 3), ("bolt", 5), ("core", 9), ("acme", 12), ("bolt", 20)])]
    qs = [Query("t1", "how many acme sales on 3 March 2014 ?", gold={"r0": 1}, split="test"),
          Query("n1", "how many acme sales ?", gold={"r0": 1}, split="test"),
          Query("n2", "bolt sales figures", gold={"r1": 1}, split="test")]
    ds = RetrievalDataset("toy", recs, qs)
    m = _tiny_re3([r.text for r in recs] + [q.text for q in qs])
    assert m.has_time([q.text for q in qs]) == [True, False, False]
    runs = re3_runs(m, ds, ["test"])["test"]
    base = re3_runs(m, ds, ["test"], base=True)["test"]
    film = re3_runs(m, ds, ["test"], no_time="film")["test"]
    for qid in ("n1", "n2"):
        assert runs[qid].keys() == base[qid].keys()
        for d, s in base[qid].items():
            assert abs(runs[qid][d] - s) < 1e-6
    assert runs["t1"] == film["t1"]                   # a query with a time keeps the time-conditioned score
    assert any(abs(film["n1"][d] - base["n1"][d]) > 1e-4 for d in base["n1"])   # the fallback matters here
    with pytest.raises(ValueError, match="no_time"):
        re3_runs(m, ds, ["test"], no_time="zero")


def test_cli_options_reach_the_saved_model(tmp_path, capsys):
    import json
    from tempokern.cli import main
    out = tmp_path / "run"
    rc = main(["train", "--method", "re3", "--dataset", "zztj", "--out", str(out), "--re3-variant", "base",
               "--time-parser", "learned", "--ranges", "start", "--multi-time", "--max-length", "24",
               "--tiny-hidden", "16", "--tiny-layers", "1", "--no-progress", "--splits", "val"])
    assert rc == 0
    enc = json.loads((out / "model" / "tempokern_re3.json").read_text())["encoder"]
    assert enc["time_parser"] == "learned" and enc["parser_fitted"] and enc["ranges"] == "start"
    assert enc["multi_time"] is True
    capsys.readouterr()
    assert main(["eval", "--method", "re3", "--dataset", "zztj", "--model", str(out), "--split", "val",
                 "--no-time", "film"]) == 0


def test_search_falls_back_to_the_base_index_for_time_less_queries():
    recs = [{"id": i, "text": f"{e} sales on {d} March 2014 were {i} units .", "published": dt.date(2014, 3, d)}
            for i, (e, d) in enumerate([("acme", 3), ("bolt", 5), ("core", 9), ("acme", 12)])]
    texts = ["how many acme sales on 3 March 2014 ?", "how many acme sales ?"]
    m = _tiny_re3([r["text"] for r in recs] + texts)
    index, base = m.to_index(recs), m.to_base_index(recs)
    ids, scores = m.search(index, texts, k=4, base_index=base)
    ids0, scores0 = m.search(index, texts, k=4)
    bq = m.base_embeddings(texts[1:])
    g = m.base_embeddings([r["text"] for r in recs])
    ref = (bq @ g.t())[0] / m.temperature
    assert torch.equal(ids[0], ids0[0]) and torch.equal(scores[0], scores0[0])
    torch.testing.assert_close(scores[1], ref[ids[1]], rtol=1e-5, atol=1e-5)
    assert torch.equal(ids[1], torch.argsort(ref, descending=True))


def test_multi_time_training_uses_the_time_closest_to_the_query():
    from tempokern.training.re3 import Re3Example, best_matching
    assert best_matching([(P(2012), P(2012)), (P(2015, 5, 5), P(2015, 5, 5))], [(P(2015, 5), P(2015, 5))]) \
        == [(P(2015, 5, 5), P(2015, 5, 5))]
    assert best_matching([(P(2012), P(2012)), (P(2015), P(2015))], []) == [(P(2012), P(2012))]
    docs = {"a": "Acme reported sales in 2012 and again on 5 May 2015.", "b": "Bolt reported sales in 2013."}
    ex = [Re3Example("Acme sales on 5 May 2015?", "a", "b"), Re3Example("Acme sales in 2012?", "a"),
          Re3Example("Bolt sales in 2013?", "b")]
    m = _tiny_re3(list(docs.values()) + [e.query for e in ex], multi_time=True)
    tr = Re3Trainer(m, docs, ex, Re3Config(variant="film", epochs=1, batch_size=3, progress=False),
                    log=lambda *a: None)
    tr._prepare()
    (pv, pm, _, _), (tv, _, _, _) = tr.ex_times
    assert pv[:, 0].tolist() == [2015, 2012, 2013] and pv[0, 1:3].tolist() == [5, 5]
    assert tv[0, 0].item() == 2013
    res = tr.fit()
    assert res.steps == 1 and res.final_loss is not None
