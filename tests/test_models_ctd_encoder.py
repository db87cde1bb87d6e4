"""CTDEncoder on a tiny random BERT: pooling, temporal parts, save/load, ChunQiuTR import, index."""
import json

import pytest
import torch
import torch.nn.functional as F

from _ctd_helpers import small_dataset, tiny_model  # noqa: E402

import tempokern  # noqa: E402
from tempokern.models import CTDEncoder, build_char_tokenizer, pool, tiny_bert  # noqa: E402
from tempokern.models.checkpoint import WEIGHTS_FILE  # noqa: E402


@pytest.fixture(scope="module")
def ds():
    return small_dataset()


def test_char_tokenizer_vocab_and_split():
    texts = ["齐纪本段时间", "以江州刺史萧嶷 abc"]
    tok = build_char_tokenizer(texts)
    chars = set("".join(texts).replace(" ", ""))
    assert len(tok) == len(chars) + 5                      # every character + 5 specials
    ids = tok("江州xyz", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5                                    # one token per character, unknown ones too
    assert ids[:2] == [tok.convert_tokens_to_ids("江"), tok.convert_tokens_to_ids("州")]
    assert ids[2:] == [tok.unk_token_id] * 3
    enc = tok(["齐纪"], return_tensors="pt")
    assert enc["input_ids"][0, 0] == tok.cls_token_id and enc["input_ids"][0, -1] == tok.sep_token_id


def test_pooling_last_handles_left_and_right_padding():
    torch.manual_seed(0)
    h = torch.randn(3, 5, 4)
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert torch.equal(pool(h, right, "last"), torch.stack([h[0, 2], h[1, 4], h[2, 0]]))
    assert torch.equal(pool(h, left, "last"), h[:, 4])
    assert torch.allclose(pool(h, right, "mean")[0], h[0, :3].mean(0))
    assert torch.equal(pool(h, right, "cls"), h[:, 0])


def test_last_pooling_same_vector_under_left_and_right_padding(ds):
    m = tiny_model(ds, pooling="last").eval()
    texts = ["建元元年正月", "江州"]
    tok = m.tokenizer
    outs = []
    for side in ("right", "left"):
        tok.padding_side = side
        outs.append(m.encode(texts).embeddings)
    tok.padding_side = "right"
    # position embeddings differ under left padding, so compare the unpadded row exactly and both rows finite
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-5)
    assert torch.isfinite(outs[1]).all()


def test_forward_parts_and_switches(ds):
    m = tiny_model(ds).eval()
    assert [h.out_features for h in m.time_heads] == list(ds.calendar.sizes)
    assert m.ctx_proj.in_features == len(ds.calendar.sizes) * 64
    assert float(m.ctx_gate.detach()) == 1.0 and float(m.offset_bias.scale.detach()) == 0.0
    batch = m.tokenize(["建元元年正月", "以江州刺史萧嶷为都督"])
    out = m(**batch)
    assert out.emb.shape == (2, m.hidden_size)
    assert torch.allclose(out.emb.norm(dim=-1), torch.ones(2), atol=1e-5)
    assert ((out.u >= 0) & (out.u <= 1)).all()
    assert torch.allclose(out.u, tempokern.reference.calendar_scalar([x.float() for x in out.logits]), atol=1e-5)
    ctx = tempokern.reference.calendar_context([x.float() for x in out.logits], 64)
    assert torch.allclose(out.emb, F.normalize(out.base + m.ctx_proj(ctx), dim=-1), atol=1e-5)
    m.use_context = False
    out2 = m(**batch)
    assert torch.allclose(out2.emb, F.normalize(out2.base, dim=-1), atol=1e-6)
    assert m.pair_bias(out.u, out.u).abs().max() == 0           # scale starts at 0
    m.use_bias = False
    assert m.pair_bias(out.u, out.u) is None


def test_checkpoint_round_trip_identical_embeddings(ds, tmp_path):
    m = tiny_model(ds, ctx_dim=16, bias_features=8, bias_hidden=8)
    with torch.no_grad():
        m.offset_bias.scale.fill_(0.7)
        m.ctx_gate.fill_(0.3)
    texts = [r.text for r in ds.records[:6]]
    before = m.encode(texts)
    m.save(tmp_path / "enc")
    m2 = CTDEncoder.load(tmp_path / "enc")
    after = m2.encode(texts)
    assert torch.equal(before.embeddings, after.embeddings)
    assert torch.equal(before.u, after.u)
    assert m2.config_dict() == m.config_dict()
    assert float(m2.offset_bias.scale) == pytest.approx(0.7)
    # saving over an existing checkpoint replaces it
    m.save(tmp_path / "enc")
    assert torch.equal(CTDEncoder.load(tmp_path / "enc").encode(texts).embeddings, before.embeddings)


def test_encode_role_keyword(ds):
    """role="query"|"document", the keyword every tempokern encoder takes: CTD encodes both roles alike."""
    m = tiny_model(ds, ctx_dim=16, bias_features=8, bias_hidden=8)
    texts = [r.text for r in ds.records[:4]]
    q, d = m.encode(texts, role="query"), m.encode(texts, role="document")
    assert torch.equal(q.embeddings, d.embeddings) and torch.equal(q.u, d.u)
    with pytest.raises(ValueError, match="role must be one of"):
        m.encode(texts, role="passage")


def test_checkpoint_corruption_and_missing_are_clear_errors(ds, tmp_path):
    m = tiny_model(ds)
    m.save(tmp_path / "enc")
    w = tmp_path / "enc" / WEIGHTS_FILE
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="checksum"):
        CTDEncoder.load(tmp_path / "enc")
    with pytest.raises(FileNotFoundError, match="not a saved CTDEncoder"):
        CTDEncoder.load(tmp_path / "nothing")
    cfg = tmp_path / "enc" / "tempokern_encoder.json"
    meta = json.loads(cfg.read_text())
    meta["version"] = 99
    cfg.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="version"):
        CTDEncoder.load(tmp_path / "enc")


def _chunqiu_state_dict(H, sizes, ctx_dim, D, hidden, seed=1):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, n in zip(("gong", "year", "month"), sizes):
        sd[f"module.time_head_{name}.weight"] = torch.randn(n, H, generator=g)
        sd[f"module.time_head_{name}.bias"] = torch.randn(n, generator=g)
    sd["module.time_ctx_proj.weight"] = torch.randn(H, 3 * ctx_dim, generator=g)
    sd["module.time_ctx_proj.bias"] = torch.randn(H, generator=g)
    sd["module.time_ctx_gate"] = torch.tensor(0.25)
    sd["module.time_rel_mlp.0.weight"] = torch.randn(hidden, D, generator=g)
    sd["module.time_rel_mlp.0.bias"] = torch.randn(hidden, generator=g)
    sd["module.time_rel_mlp.2.weight"] = torch.randn(1, hidden, generator=g)
    sd["module.time_rel_mlp.2.bias"] = torch.randn(1, generator=g)
    sd["module.time_rel_alpha"] = torch.tensor(0.5)
    sd["module.encoder.embeddings.word_embeddings.weight"] = torch.zeros(3, H)  # backbone: ignored by default
    return sd


def test_load_chunqiu_ctd_temporal_weights(ds, tmp_path):
    m = tiny_model(ds, ctx_dim=16, bias_features=8, bias_hidden=12)
    sd = _chunqiu_state_dict(m.hidden_size, ds.calendar.sizes, 16, 8, 12)
    torch.save({"model": sd}, tmp_path / "ckpt.pt")
    rep = m.load_chunqiu_state_dict(tmp_path / "ckpt.pt")
    assert not rep["missing"]
    assert "encoder.embeddings.word_embeddings.weight" in rep["ignored"]
    assert torch.equal(m.time_heads[0].weight, sd["module.time_head_gong.weight"])
    assert torch.equal(m.time_heads[2].bias, sd["module.time_head_month.bias"])
    assert torch.equal(m.ctx_proj.weight, sd["module.time_ctx_proj.weight"])
    assert float(m.ctx_gate) == 0.25 and float(m.offset_bias.scale) == 0.5
    assert torch.equal(m.offset_bias.mlp[0].weight, sd["module.time_rel_mlp.0.weight"])
    assert torch.equal(m.offset_bias.mlp[2].bias, sd["module.time_rel_mlp.2.bias"])
    # the loaded bias module is what scores pairs: compare with the ChunQiuTR formula
    u_q, u_d = torch.tensor([0.1, 0.5]), torch.tensor([0.2, 0.9, 0.4])
    delta = (u_d[None] - u_q[:, None]).clamp(-1, 1)
    K = 4
    f = torch.exp(torch.linspace(0, 1, K) * -torch.log(torch.tensor(10000.0)))
    feat = torch.cat([torch.sin(delta[..., None] * f), torch.cos(delta[..., None] * f)], -1)
    ref = 0.5 * (torch.relu(feat @ sd["module.time_rel_mlp.0.weight"].T + sd["module.time_rel_mlp.0.bias"])
                 @ sd["module.time_rel_mlp.2.weight"].T + sd["module.time_rel_mlp.2.bias"]).squeeze(-1)
    assert torch.allclose(m.pair_bias(u_q, u_d), ref, atol=1e-5)


def test_load_chunqiu_ctd_bad_shapes(ds):
    m = tiny_model(ds, ctx_dim=16, bias_features=8, bias_hidden=12)
    sd = _chunqiu_state_dict(m.hidden_size, (12, 32, 12), 16, 8, 12)
    with pytest.raises(ValueError, match="time_head_gong.weight.*shape"):
        m.load_chunqiu_state_dict(sd)
    with pytest.raises(ValueError, match="no ChunQiuTR temporal weights"):
        m.load_chunqiu_state_dict({"encoder.x": torch.zeros(1)})


def test_bad_arguments(ds):
    bb = tiny_bert(30, hidden=32, layers=1, heads=2, intermediate=64)
    with pytest.raises(ValueError, match="pooling"):
        CTDEncoder(bb, ds.calendar, pooling="max")
    with pytest.raises(TypeError, match="calendar"):
        CTDEncoder(bb, 42)
    with pytest.raises(ValueError, match="ctx_dim"):
        CTDEncoder(bb, ds.calendar, ctx_dim=0)
    with pytest.raises(TypeError, match="backbone"):
        CTDEncoder(torch.nn.Linear(2, 2), ds.calendar)
    m = CTDEncoder(bb, ds.calendar)
    with pytest.raises(ValueError, match="tokenizer"):
        m.encode(["x"])


def test_to_index_and_search_finds_the_record_itself(ds, tmp_path):
    m = tiny_model(ds).eval()
    recs = ds.records[:20]
    # string ids must not be silently replaced by positions
    with pytest.raises(ValueError, match="not an int"):
        m.to_index(recs)
    index = m.to_index(recs, ids=range(20))
    assert len(index) == 20
    dicts = [{"id": 100 + i, "text": r.text} for i, r in enumerate(recs)]
    ids2, _ = m.search(m.to_index(dicts), [recs[3].text], k=1)
    assert ids2.tolist() == [[103]]                  # integer ids are kept
    ids, scores = m.search(index, [recs[3].text, recs[11].text], k=5)
    assert ids.shape == (2, 5)
    assert ids[:, 0].tolist() == [3, 11]             # identical text, cosine 1, bias 0 at init
    assert (scores[:, :-1] >= scores[:, 1:]).all()


def test_backbone_from_a_local_path(ds, tmp_path):
    """A transformers name/path loads model and tokenizer (here a saved tiny model: no hub access)."""
    src = tiny_model(ds)
    src.backbone.save_pretrained(tmp_path / "bb")
    src.tokenizer.save_pretrained(tmp_path / "bb")
    m = CTDEncoder(str(tmp_path / "bb"), ds.calendar, pooling="mean", max_length=32)
    assert m.backbone_name == str(tmp_path / "bb")
    assert len(m.tokenizer) == len(src.tokenizer)
    src.eval()
    m.eval()
    with torch.no_grad():
        a = src.backbone(**src.tokenize(["建元元年"])).last_hidden_state
        b = m.backbone(**m.tokenize(["建元元年"])).last_hidden_state
    assert torch.equal(a, b)


# ---- atomic, durable checkpoints ---------------------------------------------------

def test_save_encoder_never_leaves_no_checkpoint(ds, tmp_path, monkeypatch):
    """Fails on a030c41: save_encoder renamed the old checkpoint away before moving the new one in, so a
    crash between the two renames left no checkpoint at `path`. Now the swap is atomic (Linux), and on
    the fallback path the old checkpoint is recovered on the next read."""
    import tempokern._util as fs
    import tempokern.models.checkpoint as ck
    m = tiny_model(ds).eval()
    path = tmp_path / "best"
    m.save(path)
    before = (path / "model.safetensors").read_bytes()
    with torch.no_grad():
        m.ctx_gate.fill_(7.0)
    calls = []
    real_replace = fs.os.replace

    def crash_on_second_rename(a, b):
        calls.append((str(a), str(b)))
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash between the two renames")
        return real_replace(a, b)
    # 1) the atomic exchange: `path` holds the new checkpoint, nothing else is renamed
    (tmp_path / "p1").mkdir()
    (tmp_path / "p2").mkdir()
    has_exchange = fs._exchange(tmp_path / "p1", tmp_path / "p2")
    monkeypatch.setattr(fs.os, "replace", crash_on_second_rename)
    m.save(path)
    if has_exchange:
        assert calls == []
    assert float(CTDEncoder.load(path).ctx_gate) == 7.0
    # 2) the fallback (no renameat2): a crash after moving the old one away is recovered on load
    monkeypatch.setattr(fs, "_exchange", lambda a, b: False)
    with torch.no_grad():
        m.ctx_gate.fill_(9.0)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        m.save(path)
    monkeypatch.setattr(ck.os, "replace", real_replace)
    assert not path.exists()                                  # the crash window
    assert float(CTDEncoder.load(path).ctx_gate) == 7.0       # recovered: the previous checkpoint
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".best.tmp-", ".best.old"))]
    m.save(path)
    assert float(CTDEncoder.load(path).ctx_gate) == 9.0
    assert before != (path / "model.safetensors").read_bytes()


def test_atomic_write_fsyncs(tmp_path, monkeypatch):
    import tempokern.models.checkpoint as ck
    synced = []
    real = ck.os.fsync
    monkeypatch.setattr(ck.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    ck.atomic_write(tmp_path / "a.json", '{"x": 1}')
    assert (tmp_path / "a.json").read_text() == '{"x": 1}'
    assert len(synced) >= 2                                    # the file and its directory
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_resume_with_missing_weights_raises(ds, tmp_path):
    """Fails on a030c41 (load_model(strict=False) ignored missing keys on resume)."""
    from safetensors.torch import load_file, save_file
    from tempokern.training import CTDConfig, train_ctd
    cfg = dict(variant="full", epochs=2, batch_size=16, lr=1e-3, progress=False, seed=0)
    train_ctd(tiny_model(ds), ds, CTDConfig(**cfg, stop_after_epochs=1), tmp_path / "run", log=lambda *a: None)
    w = tmp_path / "run" / "last" / "model.safetensors"
    sd = load_file(str(w))
    sd.pop(next(k for k in sd if k.startswith("offset_bias.")))
    save_file(sd, str(w))
    with pytest.raises(ValueError, match="missing"):
        train_ctd(tiny_model(ds), ds, CTDConfig(**cfg), tmp_path / "run", resume=True, log=lambda *a: None)
