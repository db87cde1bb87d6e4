"""TMRLEncoder: pooling, per-role prefixes, temporal masks, truncated encodings, LoRA merge, save/load, index."""
import sys

import pytest
import torch
import torch.nn.functional as F

from _tmrl_helpers import tiny_encoder, tiny_rows

from tempokern.models.encoder import pool

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
    return tiny_rows(n_people=3, years=[1999, 2003, 2008])


def _randomize_lora(model, std=0.2, seed=0):
    """peft initialises lora_B to zero (the merged model equals the base); give the update a value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.backbone.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std)


def _backbone_pool(model, texts, how):
    enc = model.tokenizer(texts, padding=True, truncation=True, max_length=model.max_length, return_tensors="pt")
    h = model.backbone(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    return pool(h, enc["attention_mask"], how)


@pytest.mark.parametrize("how", ["cls", "mean", "last"])
def test_forward_pools_and_temporal(rows, how):
    m = tiny_encoder(rows, pooling=how, dropout=False).eval()
    texts = [rows[0].query, rows[1].positive, "no time here."]
    enc = m.tokenize(texts, role="query", temporal=True)
    out = m(**enc)
    H = m.hidden_size
    assert out.emb.shape == (3, H) and out.temporal.shape == (3, m.t) and out.has_temporal.dtype == torch.bool
    with torch.no_grad():
        want = _backbone_pool(m, texts, how)
    torch.testing.assert_close(out.emb, want, rtol=0, atol=1e-6)
    # [CLS] is a temporal token only for CLS pooling (T4): the time-less text has one only then
    assert out.has_temporal.tolist() == [True, True, how == "cls"]
    # the temporal tokens of "... in 1999?" are the pieces of the tagged span (WordPiece: 1 ##9 ##9 ##9)
    from tempokern.text import temporal_spans
    (a, z, *_), = temporal_spans(texts[0])
    assert "1999" in texts[0][a:z]
    tm = enc["temporal_mask"][0]
    toks = m.tokenizer.convert_ids_to_tokens(enc["input_ids"][0][tm].tolist())
    assert "".join(t.replace("##", "") for t in toks if t != "[CLS]") == texts[0][a:z].replace(" ", "")
    # no temporal mask -> no temporal representation
    out2 = m(enc["input_ids"], enc["attention_mask"])
    assert out2.temporal is None and out2.has_temporal is None


def test_prefixes_per_role_and_spans_shift(rows):
    m = tiny_encoder(rows, dropout=False, query_prefix="query: ", passage_prefix="passage: ").eval()
    plain = tiny_encoder(rows, dropout=False).eval()   # same seed: same weights, no prefixes
    text = rows[0].query
    with torch.no_grad():
        q = m.encode([text], role="query")
        p = m.encode([text], role="document")
        want_q = F.normalize(_backbone_pool(plain, ["query: " + text], "cls"), dim=-1)
        want_p = F.normalize(_backbone_pool(plain, ["passage: " + text], "cls"), dim=-1)
    torch.testing.assert_close(q, want_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(p, want_p, rtol=0, atol=1e-6)
    assert not torch.allclose(q, p)
    # spans are given on the unprefixed text; the mask still marks the year's tokens
    s = text.index("1999")
    for role in ("query", "document"):
        enc = m.tokenize([text], role=role, temporal=True, spans=[[(s, s + 4)]])
        toks = m.tokenizer.convert_ids_to_tokens(enc["input_ids"][0][enc["temporal_mask"][0]].tolist())
        assert "".join(t.replace("##", "") for t in toks if t != "[CLS]") == "1999"
    # data spans override the tagger: [] means no temporal token (besides [CLS])
    enc = m.tokenize([text], role="query", temporal=True, spans=[[]])
    assert enc["temporal_mask"][0].nonzero().flatten().tolist() == [0]
    with pytest.raises(ValueError, match="role must be one of"):
        m.encode([text], role="passage")


def test_encode_truncates_then_normalises(rows):
    m = tiny_encoder(rows, dropout=False).eval()
    texts = [r.positive for r in rows[:4]]
    with torch.no_grad():
        raw = _backbone_pool(m, texts, "cls")
    for d in (None, 8, 16, 32):
        got = m.encode(texts, role="document", dim=d)
        k = d or m.hidden_size
        assert got.shape == (4, k) and got.dtype == torch.float32
        torch.testing.assert_close(got, F.normalize(raw[:, :k], dim=-1), rtol=0, atol=1e-6)
    for bad in (0, 33, 2.5, True):
        with pytest.raises(ValueError, match="dim"):
            m.encode(texts, dim=bad)


def test_bad_construction(rows):
    with pytest.raises(ValueError, match="dims"):
        tiny_encoder(rows, dims=(16, 8))
    with pytest.raises(ValueError, match="dims"):
        tiny_encoder(rows, dims=(8, 64))
    with pytest.raises(ValueError, match="t must"):
        tiny_encoder(rows, t=0)
    with pytest.raises(ValueError, match="pooling"):
        tiny_encoder(rows, pooling="max")
    with pytest.raises(ValueError, match="lora"):
        tiny_encoder(rows, lora="half")
    with pytest.raises(ValueError, match="lora"):
        tiny_encoder(rows, lora={"rank": 4})
    with pytest.raises(TypeError, match="backbone"):
        from tempokern.models.tmrl import TMRLEncoder
        TMRLEncoder(torch.nn.Linear(2, 2), lora=False)


def test_lora_defaults_and_frozen_modes(rows):
    pytest.importorskip("peft")
    m = tiny_encoder(rows, lora=None)
    assert m.lora_mode == "lora" and m.lora_settings == dict(r=4, lora_alpha=16, lora_dropout=0.1,
                                                             target_modules="all-linear")
    # the paper's "scaling factor 4" (TMRL §A.2) is peft's scaling lora_alpha / r on every adapter
    scalings = [mod.scaling["default"] for mod in m.base_model.modules() if hasattr(mod, "lora_A")]
    assert scalings and all(sc == 4.0 for sc in scalings)
    # another rank keeps the scaling; an explicit lora_alpha is used as given (4 at r 4 = scaling 1)
    assert tiny_encoder(rows, lora={"r": 8}).lora_settings["lora_alpha"] == 32
    one = tiny_encoder(rows, lora={"lora_alpha": 4})
    assert {mod.scaling["default"] for mod in one.base_model.modules() if hasattr(mod, "lora_A")} == {1.0}
    names = [n for n, _ in m.trainable_parameters()]
    assert names and all("lora_" in n or n.startswith("projector.") for n in names)
    assert any(n.startswith("projector.") for n in names)
    # every Linear of the backbone got an adapter (all-linear)
    frozen = tiny_encoder(rows, lora=False)
    plain_linear = {n for n, mod in frozen.backbone.named_modules() if isinstance(mod, torch.nn.Linear)}
    adapted = {n for n, mod in m.base_model.named_modules() if hasattr(mod, "lora_A")}
    assert plain_linear and adapted == plain_linear
    assert all(n.startswith("projector.") for n, _ in frozen.trainable_parameters())
    full = tiny_encoder(rows, lora="full")
    assert sum(p.numel() for _, p in full.trainable_parameters()) == sum(p.numel() for p in full.parameters())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_lora_merge_gives_the_same_embeddings(rows, dtype, tol):
    pytest.importorskip("peft")
    m = tiny_encoder(rows, lora=None, dtype=dtype)
    _randomize_lora(m)
    texts = [r.query for r in rows] + [r.positive for r in rows]
    before = m.encode(texts, role="query").double()
    enc = m.tokenize(texts, role="query")
    m.eval()
    with torch.no_grad():
        raw_before = m(**enc).emb.double()
    m.merge_lora()
    assert m.lora_mode == "merged" and not any("lora_" in n for n, _ in m.named_parameters())
    after = m.encode(texts, role="query").double()
    with torch.no_grad():
        raw_after = m(**enc).emb.double()
    # the update was not zero: the merged model differs from the base model
    assert (raw_before - raw_after).abs().max() <= tol * raw_before.abs().max()
    assert (before - after).abs().max() <= tol


def test_save_load_round_trip(rows, tmp_path):
    pytest.importorskip("peft")
    m = tiny_encoder(rows, lora=None, query_prefix="q: ", passage_prefix="p: ", pooling="mean")
    _randomize_lora(m)
    m.eval()
    texts = [r.query for r in rows[:5]]
    enc = m.tokenize(texts, role="query", temporal=True)
    with torch.no_grad():
        want = m(**enc)
    m.save(tmp_path / "m")
    got_m = type(m).load(tmp_path / "m").eval()
    assert got_m.config_dict() == m.config_dict()
    with torch.no_grad():
        got = got_m(**got_m.tokenize(texts, role="query", temporal=True))
    assert torch.equal(got.emb, want.emb) and torch.equal(got.temporal, want.temporal)
    assert torch.equal(got_m.encode(texts, role="document", dim=16), m.encode(texts, role="document", dim=16))
    # the projector is optional at load
    np_m = type(m).load(tmp_path / "m", projector=False)
    assert np_m.projector is None
    assert torch.equal(np_m.encode(texts, role="query"), m.encode(texts, role="query"))
    # a corrupted weight file is refused
    f = tmp_path / "m" / "projector.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        type(m).load(tmp_path / "m")
    assert type(m).load(tmp_path / "m", projector=False) is not None   # not read, not checked
    with pytest.raises(FileNotFoundError, match="TMRLEncoder"):
        type(m).load(tmp_path / "nothing")


def test_merged_and_frozen_models_load_without_peft(rows, tmp_path, monkeypatch):
    pytest.importorskip("peft")
    m = tiny_encoder(rows, lora=None)
    _randomize_lora(m)
    m.save(tmp_path / "lora")
    want = m.encode([rows[0].query])
    m.merge_lora().save(tmp_path / "merged")
    tiny_encoder(rows, lora=False).save(tmp_path / "frozen")
    monkeypatch.setitem(sys.modules, "peft", None)   # import peft now fails
    from tempokern.models.tmrl import TMRLEncoder
    with pytest.raises(ImportError, match="pip install"):
        TMRLEncoder.load(tmp_path / "lora")
    got = TMRLEncoder.load(tmp_path / "merged")
    assert got.lora_mode == "merged"
    assert (got.encode([rows[0].query]) - want).abs().max() <= 1e-5
    assert TMRLEncoder.load(tmp_path / "frozen").lora_mode == "none"
    with pytest.raises(ImportError, match="pip install"):
        tiny_encoder(rows, lora=None)


def test_import_without_peft():
    code = ("import sys; sys.modules['peft'] = None\n"
            "import tempokern, tempokern.models, tempokern.training\n"
            "from tempokern.models import TMRLEncoder\nfrom tempokern.training.tmrl import TMRLConfig\nprint('ok')")
    from conftest import run_python   # the same tempokern as this process (installed or in-tree)
    r = run_python(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_to_index_and_search(rows):
    m = tiny_encoder(rows, dropout=False).eval()
    recs = [{"id": i, "text": r.positive} for i, r in enumerate(rows)]
    for dim in (8, 32):
        index = m.to_index(recs, dim=dim)
        assert index.dim == dim and len(index) == len(rows)
        qs = [r.query for r in rows[:4]]
        ids, scores = m.search(index, qs, k=3, dim=dim)
        qe = m.encode(qs, role="query", dim=dim)
        ge = m.encode([r["text"] for r in recs], role="document", dim=dim)
        sims = qe @ ge.T
        want_s, want_i = sims.topk(3, dim=1)
        assert torch.equal(ids[:, 0], want_i[:, 0])
        torch.testing.assert_close(scores, want_s, rtol=0, atol=1e-5)
        torch.testing.assert_close(sims.gather(1, ids), scores, rtol=0, atol=1e-5)   # near-ties may swap
    with pytest.raises(ValueError, match="dim"):
        m.search(m.to_index(recs, dim=8), ["x"], k=1, dim=16)
    with pytest.raises(ValueError, match="not an int"):
        m.to_index([{"id": "a", "text": "x"}])
