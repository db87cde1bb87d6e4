"""Re3Encoder: identity with the frozen backbone, save/load, index search, LoRA option (design notes §3.7)."""
import datetime as dt
import json

import pytest
import torch
import torch.nn.functional as F

from tempokern import ctd_topk
from tempokern.models import Re3Encoder, build_char_tokenizer, tiny_bert
from tempokern.text import TimeTuple

TEXTS = ["The level on March 7, 2014 was 5.", "No date is written here.", "In 2015 the index rose.",
         "Yesterday the river fell.", "Prices in May 2014 went up.", "the 1990s were calm"]
PUB = [None, dt.date(2014, 1, 1), None, dt.date(2014, 3, 10), None, None]


@pytest.fixture(scope="module")
def parts():
    tok = build_char_tokenizer(TEXTS + ["abcdefghijklmnopqrstuvwxyz0123456789"])
    bb = tiny_bert(len(tok), hidden=16, layers=1, heads=2, intermediate=32, max_position=64, seed=0)
    return bb, tok


def _model(parts, **kw):
    bb, tok = parts
    kw.setdefault("pooling", "mean")
    return Re3Encoder(bb, tokenizer=tok, max_length=48, **kw)


def _perturb(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.time_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def _backbone_direct(bb, tok, texts):
    """The frozen backbone's embedding written out here: mean pooling + L2 normalisation."""
    bb.eval()
    enc = tok(texts, padding=True, truncation=True, max_length=48, return_tensors="pt")
    with torch.no_grad():
        h = bb(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    return F.normalize((h * m).sum(1) / m.sum(1).clamp_min(1e-6), dim=-1)


def test_identity_all_masks_zero(parts):
    """No time: the encoder is the frozen backbone. Bit for bit at the same batch shape (the same backbone
    call); across batch shapes equal up to float32 rounding, because a batch of another shape may take
    another BLAS / vectorised path (on some CPUs the bare backbone's row already differs by ~1e-8)."""
    bb, tok = parts
    m = _perturb(_model(parts))   # trained-looking time modules: identity must come from the masks alone
    none = [None] * len(TEXTS)
    out = m.encode(TEXTS, times=none)
    assert torch.equal(out, _backbone_direct(bb, tok, TEXTS))
    assert torch.equal(m.base_embeddings(TEXTS), out)
    # empty tuples (mask 0) are the same as None
    assert torch.equal(m.encode(TEXTS, times=[TimeTuple()] * len(TEXTS)), out)
    # a time-less text parses to None -> identical to the backbone through the parser (same batch shape: 1)
    alone = ["No date is written here."]
    one = m.encode(alone)
    assert torch.equal(one, _backbone_direct(bb, tok, alone))
    assert torch.equal(one, m.base_embeddings(alone))
    # ... and to its row of the 6-text batch up to rounding, far below what the time modules move a text
    torch.testing.assert_close(one, out[1:2], rtol=0, atol=1e-6)
    timed = m.encode(alone, times=[TimeTuple.from_date(dt.date(2014, 3, 7))])
    assert (timed - one).abs().amax() > 1e-3


def test_timed_texts_move_and_untimed_stay(parts):
    m = _perturb(_model(parts))
    out = m.encode(TEXTS, pub=PUB, role="document")
    base = m.base_embeddings(TEXTS)
    moved = (out - base).abs().amax(1) > 1e-4
    assert moved.tolist() == [True, False, True, True, True, True]
    torch.testing.assert_close(out.norm(dim=1), torch.ones(len(TEXTS)))
    # "Yesterday" without its publication date is not resolved: base embedding
    q = m.encode(["Yesterday the river fell."])
    assert torch.equal(q, m.base_embeddings(["Yesterday the river fell."]))      # same batch shape: bit for bit
    torch.testing.assert_close(q, base[3:4], rtol=0, atol=1e-6)                  # another batch shape: rounding


def test_doc_time_options(parts):
    m = _perturb(_model(parts, doc_time="published"))
    pub = [dt.date(2014, 3, 7)] * 2
    a = m.encode(["no date", "The level on March 7, 2014 was 5."], pub=pub, role="document")
    b = m.encode(["no date", "The level on March 7, 2014 was 5."], times=[dt.date(2014, 3, 7)] * 2)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    m2 = _perturb(_model(parts, doc_time="content_or_published"))
    c = m2.encode(["no date"], pub=[dt.date(2014, 3, 7)], role="document")
    d = m2.encode(["no date"], times=[TimeTuple.from_date(dt.date(2014, 3, 7))])
    assert torch.equal(c, d)
    with pytest.raises(ValueError, match="doc_time"):
        _model(parts, doc_time="nope")


def test_explicit_times_equal_parsed(parts):
    m = _perturb(_model(parts))
    a = m.encode(["The level on March 7, 2014 was 5."])
    b = m.encode(["The level on March 7, 2014 was 5."], times=[TimeTuple.from_date(dt.date(2014, 3, 7))])
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="times"):
        m.encode(TEXTS, times=[None])
    with pytest.raises(ValueError, match="pub"):
        m.encode(TEXTS, pub=[None])


def test_semantic_cache(parts):
    m = _perturb(_model(parts))
    plain = m.encode(TEXTS, pub=PUB, role="document")
    calls = []
    h = m.backbone.register_forward_hook(lambda mod, a, kw=None: calls.append(a[0].shape[0] if a else 1))
    cache = m.enable_semantic_cache()
    first = m.encode(TEXTS + TEXTS[:2], pub=PUB + PUB[:2], role="document", batch_size=4)
    n_first = len(calls)
    assert n_first == 2 and len(cache) == len(TEXTS)        # 6 distinct texts in batches of 4
    again = m.encode(TEXTS, pub=PUB, role="document")
    assert len(calls) == n_first                             # nothing re-encoded
    torch.testing.assert_close(first[:len(TEXTS)], plain, rtol=1e-5, atol=1e-6)
    # the cached backbone outputs go through the time head again in batches of other sizes: equal up to rounding
    torch.testing.assert_close(first[:len(TEXTS)], again, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(first[len(TEXTS):], again[:2], rtol=1e-6, atol=1e-7)
    # a second encoder on the same backbone shares the cache; identity still holds through it
    m2 = _model(parts)
    m2.enable_semantic_cache(cache)
    # (equal up to rounding: F.normalize over a batch of a different size may take another vectorised path)
    torch.testing.assert_close(m2.encode(TEXTS, times=[None] * len(TEXTS)),
                               F.normalize(torch.stack([cache[t] for t in TEXTS]), dim=-1), rtol=1e-6, atol=1e-7)
    assert len(calls) == n_first
    h.remove()
    m.disable_semantic_cache()


def test_frozen_backbone_no_grad_and_eval(parts):
    m = _model(parts)
    assert all(not p.requires_grad for p in m.backbone.parameters())
    m.train()
    assert not m.backbone.training and m.film.training
    assert {id(p) for p in m.time_parameters()} == {id(p) for p in m.parameters() if p.requires_grad}


def test_index_search_equals_brute_force(parts):
    m = _perturb(_model(parts))
    recs = [{"id": 100 + i, "text": t, "published": p} for i, t, p in zip(range(len(TEXTS)), TEXTS, PUB)]
    index = m.to_index(recs)
    queries = ["What was the level on 7 March 2014?", "index in 2015", "calm decade"]
    ids, scores = m.search(index, queries, k=4)
    q = m.encode(queries)
    g = m.encode(TEXTS, pub=PUB, role="document")
    s = q @ g.T / m.temperature
    top = s.topk(4, dim=1)
    assert torch.equal(ids, top.indices + 100)
    torch.testing.assert_close(scores, top.values, rtol=1e-5, atol=1e-5)
    v, i = ctd_topk(q, g, 4)
    assert torch.equal(i, top.indices)
    with pytest.raises(ValueError, match="ids"):
        m.to_index([{"id": "a", "text": "x"}])


def test_save_load_embedded_backbone(parts, tmp_path):
    m = _perturb(_model(parts))
    m.time_embed.set_year_stats([1990, 2014, 2015])
    m.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "tempokern_re3.json").read_text())
    assert meta["backbone"]["kind"] == "embedded"
    m2 = Re3Encoder.load(tmp_path / "m")
    assert torch.equal(m2.encode(TEXTS, pub=PUB, role="document"), m.encode(TEXTS, pub=PUB, role="document"))
    assert float(m2.time_embed.year_mean) == float(m.time_embed.year_mean)
    assert m2.pooling == "mean" and m2.max_length == 48
    # corrupt the time modules: load refuses
    f = tmp_path / "m" / "time_modules.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        Re3Encoder.load(tmp_path / "m")
    with pytest.raises(FileNotFoundError):
        Re3Encoder.load(tmp_path / "nothing")


def test_save_load_backbone_by_reference(parts, tmp_path):
    bb, tok = parts
    src = tmp_path / "backbone"
    bb.save_pretrained(str(src))
    tok.save_pretrained(str(src))
    m = _perturb(Re3Encoder(str(src), pooling="mean", max_length=48))
    m.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "tempokern_re3.json").read_text())
    assert meta["backbone"]["kind"] == "path" and meta["backbone"]["path"] == str(src.resolve())
    assert not (tmp_path / "m" / "backbone.safetensors").exists()     # not duplicated
    m2 = Re3Encoder.load(tmp_path / "m")
    assert torch.equal(m2.encode(TEXTS), m.encode(TEXTS))
    # the referenced backbone changes: load refuses
    with torch.no_grad():
        bb2 = tiny_bert(len(tok), hidden=16, layers=1, heads=2, intermediate=32, max_position=64, seed=1)
    bb2.save_pretrained(str(src))
    with pytest.raises(ValueError, match="checksum"):
        Re3Encoder.load(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="backbone_path"):
        Re3Encoder.load(tmp_path / "m", backbone_path=str(tmp_path / "moved"))


def test_lora_option(parts, tmp_path):
    pytest.importorskip("peft")
    bb, tok = parts
    import copy
    m = Re3Encoder(copy.deepcopy(bb), tokenizer=tok, pooling="mean", max_length=48,
                   lora={"r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["query", "value"]},
                   use_time=False)
    assert not m.freeze_backbone
    trainable = [n for n, p in m.backbone.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # LoRA B starts at zero: the adapted backbone equals the plain one
    assert torch.equal(m.base_embeddings(TEXTS), _backbone_direct(bb, tok, TEXTS))
    with torch.no_grad():
        for n, p in m.backbone.named_parameters():
            if "lora_B" in n:
                p.normal_()
    e = m.encode(TEXTS)
    m.save(tmp_path / "lora")
    m2 = Re3Encoder.load(tmp_path / "lora")                  # merged backbone stored
    torch.testing.assert_close(m2.encode(TEXTS), e, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="lora"):
        Re3Encoder(copy.deepcopy(bb), tokenizer=tok, lora=3)
    with pytest.raises(ValueError, match="frozen"):
        m.enable_semantic_cache()


def test_constructor_validation(parts):
    with pytest.raises(ValueError, match="pooling"):
        _model(parts, pooling="max")
    with pytest.raises(TypeError, match="backbone"):
        Re3Encoder(torch.nn.Linear(2, 2))
    bb, _ = parts
    with pytest.raises(ValueError, match="tokenizer"):
        Re3Encoder(bb).encode(["x"])


def test_time_parser_heads_labels_and_learning():
    import random as _random

    from tempokern.calendar import Calendar
    from tempokern.models import TimeParserHeads
    heads = TimeParserHeads(64, Calendar.gregorian(2010, 2019, resolution="month"))
    assert (heads.first_year, heads.last_year) == (2010, 2019)
    lab, pres = heads.labels([TimeTuple.from_date(dt.date(2012, 3, 7)), TimeTuple.partial(2030, 5), None])
    assert lab.tolist() == [[2, 2, 6], [-1, 4, -1], [-1, -1, -1]]       # 2030 outside the classes: IGNORE
    assert pres.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
    # absent parts give their head no gradient
    h = torch.randn(2, 64)
    heads.loss(h, [TimeTuple.partial(2012, 3), TimeTuple.partial(2013)]).backward()
    g2 = heads.heads[2].weight.grad
    assert (g2 is None or g2.abs().sum() == 0) and heads.heads[1].weight.grad.abs().sum() > 0
    # learnable: features that carry the date in a random linear code -> exact predictions on held-out rows
    rng = _random.Random(0)
    torch.manual_seed(0)
    proj = torch.randn(10 + 12 + 31 + 3, 64)

    def sample():
        vy, vm, vd = rng.random() < 0.9, rng.random() < 0.8, rng.random() < 0.7
        t = TimeTuple.partial(rng.randint(2010, 2019) if vy else None, rng.randint(1, 12) if vm else None,
                              rng.randint(1, 28) if vd else None)
        f = torch.zeros(56)
        if vy: f[t.year - 2010] = 1
        if vm: f[10 + t.month - 1] = 1
        if vd: f[22 + t.day - 1] = 1
        f[53:] = torch.tensor([float(b) for b in t.mask])
        return t, f @ proj
    train = [sample() for _ in range(400)]
    test = [sample() for _ in range(100)]
    heads = TimeParserHeads(64, first_year=2010, last_year=2019)
    opt = torch.optim.Adam(heads.parameters(), lr=0.02)
    H = torch.stack([f for _, f in train])
    T = [t for t, _ in train]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # tiny ops: OpenMP fork/join dominates on a shared machine
    try:
        for _ in range(150):
            opt.zero_grad()
            heads.loss(H, T).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    pred = heads.predict(torch.stack([f for _, f in test]))
    em = sum(p == t for p, (t, _) in zip(pred, test)) / len(test)
    assert em >= 0.95, em
    with pytest.raises(ValueError, match="first_year"):
        TimeParserHeads(8)
