"""Bad checkpoint files, bad save targets and bad command lines: every case is one row of CASES with
the exception type (library calls) or exit status (`tempokern` invocations) it must give and a
fragment of its message. Checkpoints are tiny CTD, TMRL and Re3 models built from configs."""
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _ctd_helpers import small_dataset, tiny_model  # noqa: E402
from _tmrl_helpers import tiny_encoder, tiny_rows  # noqa: E402

from tempokern.cli import main  # noqa: E402

TINY = ["--tiny-hidden", "16", "--tiny-layers", "1", "--max-length", "16", "--no-progress", "--epochs", "1",
        "--max-steps", "1", "--batch-size", "4"]
TRAIN = ["train", "--dataset", "zztj", *TINY]
CONFIG = {"ctd": "tempokern_encoder.json", "tmrl": "tempokern_tmrl.json", "re3": "tempokern_re3.json"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One pristine checkpoint directory per model kind."""
    from tempokern.models import Re3Encoder, build_char_tokenizer, tiny_bert
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    tiny_model(small_dataset(), hidden=16).save(root / "ctd")
    tiny_encoder(tiny_rows(n_people=2), hidden=16, dims=(8, 16), t=8).save(root / "tmrl")
    texts = ["The level on March 7, 2014 was 5.", "In 2015 the index rose."]
    tok = build_char_tokenizer(texts + ["abcdefghijklmnopqrstuvwxyz0123456789"])
    bb = tiny_bert(len(tok), hidden=16, layers=1, heads=2, intermediate=32, max_position=64, seed=0)
    Re3Encoder(bb, tokenizer=tok, max_length=32, pooling="mean").save(root / "re3")
    return root


class Ctx:
    def __init__(self, saved, tmp):
        self.saved, self.tmp = saved, tmp

    def copy(self, kind):
        dst = self.tmp / kind
        shutil.copytree(self.saved / kind, dst)
        return dst

    def write(self, name, data):
        p = self.tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(data, bytes) else p.write_text)(data)
        return p


def _load(kind, path, **kw):
    from tempokern.models import CTDEncoder, Re3Encoder, TMRLEncoder
    return {"ctd": CTDEncoder, "tmrl": TMRLEncoder, "re3": Re3Encoder}[kind].load(path, **kw)


def _reseal(d):
    """Write checksums.json over the directory as it is now (a crafted but consistent checkpoint)."""
    files = {}
    for f in sorted(Path(d).rglob("*")):
        rel = f.relative_to(d).as_posix()
        if f.is_file() and rel != "checksums.json":
            files[rel] = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "size": f.stat().st_size}
    (Path(d) / "checksums.json").write_text(json.dumps({"format": "tempokern-checksums", "version": 1,
                                                        "algorithm": "sha256", "files": files}))


# ---- checkpoint file manipulations (library calls) -----------------------------------------------------

def edit_config(kind, key, value):
    def run(c):
        d = c.copy(kind)
        meta = json.loads((d / CONFIG[kind]).read_text())
        assert key in meta["encoder"]
        meta["encoder"][key] = value
        (d / CONFIG[kind]).write_text(json.dumps(meta, indent=1))
        _load(kind, d)
    return run


def edit_token_id(kind):
    def run(c):
        d = c.copy(kind)
        f = d / "tokenizer" / "tokenizer.json"
        tok = json.loads(f.read_text())
        vocab = tok["model"]["vocab"]
        a, b = list(vocab)[5:7]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        f.write_text(json.dumps(tok))
        _load(kind, d)
    return run


def add_tokenizer_file(c):
    d = c.copy("ctd")
    (d / "tokenizer" / "added_tokens.json").write_text('{"[NEW]": 0}')
    _load("ctd", d)


def drop_manifest(kind):
    def run(c):
        d = c.copy(kind)
        (d / "checksums.json").unlink(missing_ok=True)   # a checkpoint saved without one
        _load(kind, d)
    return run


def drop_manifest_opt_out(c):
    d = c.copy("ctd")
    (d / "checksums.json").unlink(missing_ok=True)   # a checkpoint saved without one
    m = _load("ctd", d, allow_missing_manifest=True)
    assert m is not None


def drop_config_key(kind, key):
    def run(c):
        d = c.copy(kind)
        meta = json.loads((d / CONFIG[kind]).read_text())
        del meta[key]
        (d / CONFIG[kind]).write_text(json.dumps(meta))
        _reseal(d)
        _load(kind, d)
    return run


def save_onto_file(c):
    f = c.write("model.bin", "precious")
    try:
        tiny_model(small_dataset(), hidden=16).save(f)
    finally:
        assert f.is_file() and f.read_text() == "precious"
        assert not [p for p in c.tmp.iterdir() if p.name.startswith(".")]


def save_onto_other_dir(c):
    d = c.tmp / "notes"
    d.mkdir()
    (d / "todo.txt").write_text("keep me")
    try:
        tiny_model(small_dataset(), hidden=16).save(d)
    finally:
        assert (d / "todo.txt").read_text() == "keep me"


# ---- `tempokern` invocations: each returns argv (after writing any files it needs) ----------------------

def argv(*a):
    return lambda c: [x.replace("{tmp}", str(c.tmp)) for x in a]


def with_config(cfg, *a):
    def run(c):
        c.write("c.json", json.dumps(cfg))
        return [x.replace("{tmp}", str(c.tmp)) for x in a] + ["--config", str(c.tmp / "c.json")]
    return run


def config_not_utf8(c):
    c.write("c.json", b'{"epochs": 1,\n "seed": "\xff"}')
    return [*TRAIN, "--out", str(c.tmp / "run"), "--config", str(c.tmp / "c.json")]


def crafted_index(meta_edit, model_kind="ctd"):
    def run(c):
        from tempokern.search._format import dump
        meta = {"dim": 16, "backend": "exact", "device": "cpu", "dtype": "float32", "count": 2,
                "options": {"nlist": 4, "nprobe": 2, "hnsw_m": 8, "ef_search": 8}}
        meta.update(meta_edit)
        dump(c.tmp / "x.idx", meta, torch.arange(2), torch.zeros(2), torch.randn(2, 16))
        return ["search", "--model", str(c.saved / model_kind), "--index", str(c.tmp / "x.idx"), "--query", "q"]
    return run


def bad_sidecar(text):
    def run(c):
        from tempokern.search import TemporalIndex
        from tempokern.models import CTDEncoder
        from tempokern.models.fingerprint import model_fingerprint
        idx = TemporalIndex(16)
        idx.add(torch.arange(2), torch.randn(2, 16), torch.zeros(2))
        idx.model = model_fingerprint(CTDEncoder.load(c.saved / "ctd"))   # built by that model: no warning
        idx.save(str(c.tmp / "x.idx"))
        c.write("x.idx.records.json", text)
        return ["search", "--model", str(c.saved / "ctd"), "--index", str(c.tmp / "x.idx"), "--query", "q"]
    return run


def queries_not_utf8(c):
    from tempokern.search import TemporalIndex
    TemporalIndex(16).save(str(c.tmp / "x.idx"))
    c.write("q.txt", b"first query\nsecond \xc3\x28 query\n")
    return ["search", "--model", str(c.saved / "ctd"), "--index", str(c.tmp / "x.idx"), "--queries",
            str(c.tmp / "q.txt")]


def data_not_utf8(c):
    row = {"id": "a", "description": "x", "time_meta": {"reign": "建元", "era_year": 1, "lunar_month": 1}}
    c.write("bad.jsonl", json.dumps(row, ensure_ascii=False).encode() + b"\n" + b'{"id": "b\xff"}\n')
    return ["train", "--data", str(c.tmp / "bad.jsonl"), "--out", str(c.tmp / "run"), *TINY]


def empty_beir(*command):
    def run(c):
        for n in ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv"):
            c.write(f"beir/{n}", "")
        return [x.replace("{tmp}", str(c.tmp)).replace("{ctd}", str(c.saved / "ctd")) for x in command] + [
            "--data", str(c.tmp / "beir"), "--format", "beir"]
    return run


def untimed_beir(c):
    c.write("beir/corpus.jsonl", "\n".join(json.dumps({"_id": f"d{i}", "text": f"doc {i}"}) for i in range(4)))
    c.write("beir/queries.jsonl", json.dumps({"_id": "q0", "text": "which doc"}))
    c.write("beir/qrels/test.tsv", "q0\td1\t1\n")
    return ["train", "--data", str(c.tmp / "beir"), "--format", "beir", "--out", str(c.tmp / "run"), *TINY]


OUT = ["--out", "{tmp}/run"]
E = ValueError   # CheckpointError and IndexFormatError are ValueErrors

# (id, action, expected: an exception type, a warning type, or an exit status; message fragment)
CASES = [
    # checkpoint files: every file is under checksums.json, verified on load
    ("ctd-config-calendar-tau", edit_config("ctd", "calendar_tau", 3.0), E,
     "tempokern_encoder.json does not match its checksum"),
    ("ctd-tokenizer-token-id", edit_token_id("ctd"), E, "tokenizer.json does not match its checksum"),
    ("ctd-tokenizer-added-file", add_tokenizer_file, E, "added_tokens.json is not listed in"),
    ("tmrl-config-temperature", edit_config("tmrl", "temperature", 0.5), E,
     "tempokern_tmrl.json does not match its checksum"),
    ("tmrl-tokenizer-token-id", edit_token_id("tmrl"), E, "tokenizer.json does not match its checksum"),
    ("re3-config-temperature", edit_config("re3", "temperature", 0.5), E,
     "tempokern_re3.json does not match its checksum"),
    ("re3-tokenizer-token-id", edit_token_id("re3"), E, "tokenizer.json does not match its checksum"),
    ("ctd-no-manifest", drop_manifest("ctd"), E, "checksums.json is missing"),
    ("tmrl-no-manifest", drop_manifest("tmrl"), E, "checksums.json is missing"),
    ("re3-no-manifest", drop_manifest("re3"), E, "checksums.json is missing"),
    ("ctd-no-manifest-opt-out", drop_manifest_opt_out, UserWarning, "not verified"),
    ("ctd-config-without-encoder", drop_config_key("ctd", "encoder"), E,
     "tempokern_encoder.json has no 'encoder' entry"),
    ("tmrl-config-without-encoder", drop_config_key("tmrl", "encoder"), E,
     "tempokern_tmrl.json has no 'encoder' entry"),
    ("re3-config-without-encoder", drop_config_key("re3", "encoder"), E,
     "tempokern_re3.json has no 'encoder' entry"),
    # save targets
    ("save-onto-regular-file", save_onto_file, FileExistsError, "exists and is not a directory"),
    ("save-onto-other-directory", save_onto_other_dir, FileExistsError, "not a tempokern checkpoint"),
    # numeric options: finite and in range, exit 2 before any work
    ("train-lr-inf", argv(*TRAIN, *OUT, "--lr", "inf"), 2, "--lr must be a finite number"),
    ("train-lambda-time-nan", argv(*TRAIN, *OUT, "--lambda-time", "nan"), 2, "--lambda-time must be a finite number"),
    ("train-weight-decay-negative", argv(*TRAIN, *OUT, "--weight-decay", "-1"), 2, "--weight-decay must be >= 0"),
    ("train-temporal-lr-negative", argv(*TRAIN, *OUT, "--temporal-lr", "-1"), 2, "--temporal-lr must be > 0"),
    ("train-temperature-inf", argv(*TRAIN, *OUT, "--temperature", "inf"), 2, "--temperature must be a finite number"),
    ("train-re3-weight-decay-negative", argv(*TRAIN, *OUT, "--method", "re3", "--weight-decay", "-1"), 2,
     "--weight-decay must be >= 0"),
    ("eval-dims-zero-ctd", lambda c: ["eval", "--model", str(c.saved / "ctd"), "--dataset", "zztj", "--dims", "0"], 2,
     "--dims must be >= 1"),
    ("eval-dims-ctd-model", lambda c: ["eval", "--model", str(c.saved / "ctd"), "--dataset", "zztj", "--dims", "8"], 2,
     "--dims applies to TMRL models"),
    ("train-device-bogus", argv(*TRAIN, *OUT, "--device", "bogus"), 2, "--device must be cpu, cuda or cuda:N"),
    ("train-resume-without-run", argv(*TRAIN, *OUT, "--resume"), 2, "cannot resume"),
    ("debug-shows-traceback", argv(*TRAIN, *OUT, "--lr", "inf"), 2, "Traceback"),   # TEMPOKERN_DEBUG=1
    # config files: every value's type before any work
    ("config-epochs-list", with_config({"epochs": [1]}, *TRAIN[:3], *OUT), 2, "--epochs must be an int"),
    ("config-epochs-null", with_config({"epochs": None}, *TRAIN[:3], *OUT), 2, "--epochs must be set"),
    ("config-epochs-float", with_config({"epochs": 2.5}, *TRAIN[:3], *OUT), 2, "--epochs must be an int, got 2.5"),
    ("config-lr-list", with_config({"lr": [0.1]}, *TRAIN[:3], *OUT), 2, "--lr must be a number"),
    ("config-device-dict", with_config({"device": {"kind": "cpu"}}, *TRAIN[:3], *OUT), 2,
     "--device must be a string"),
    ("config-scorer-not-a-choice", with_config({"scorer": "bm25"}, *TRAIN[:3], *OUT), 2,
     "--scorer must be one of encoder, ctd"),
    ("config-is-a-directory", argv(*TRAIN, *OUT, "--config", "{tmp}"), 2, "is not a file"),
    ("config-not-utf8", config_not_utf8, 2, "c.json:2: not valid UTF-8"),
    # files read while running: the file named (with its line for data files), exit 1
    ("index-options-null", crafted_index({"options": None}), 1, "'options' must be an object"),
    ("index-device-garbage", crafted_index({"device": "garbage:device"}), 1, "'device' 'garbage:device' is not a device"),
    ("index-sidecar-not-json", bad_sidecar("{not json"), 1, "x.idx.records.json:1: invalid JSON"),
    ("index-sidecar-wrong-length", bad_sidecar(json.dumps({"ids": ["a"], "texts": ["t"]})), 1,
     "x.idx.records.json: 'ids' must be a list with one entry per indexed record (2)"),
    ("queries-not-utf8", queries_not_utf8, 1, "q.txt:2: not valid UTF-8"),
    ("data-not-utf8", data_not_utf8, 1, "bad.jsonl:2: not valid UTF-8"),
    ("beir-empty-folder-eval", empty_beir("eval", "--model", "{ctd}"), 1, "corpus.jsonl holds no usable documents"),
    ("beir-empty-folder-train", empty_beir("train", *OUT, *TINY), 1, "corpus.jsonl holds no usable documents"),
    ("beir-untimed-train-ctd", untimed_beir, 1, "--method ctd needs times on a calendar"),
    ("beir-folder-without-files", lambda c: ["eval", "--model", str(c.saved / "ctd"), "--data", str(c.tmp),
                                             "--format", "beir"], 1, "corpus.jsonl does not exist (a BEIR set is"),
]


@pytest.mark.parametrize("name, action, expected, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, action, expected, fragment, saved, tmp_path, capsys, monkeypatch):
    ctx = Ctx(saved, tmp_path)
    monkeypatch.delenv("TEMPOKERN_DEBUG", raising=False)
    if name == "debug-shows-traceback":
        monkeypatch.setenv("TEMPOKERN_DEBUG", "1")
    if isinstance(expected, type) and issubclass(expected, Warning):
        with pytest.warns(expected, match=fragment):
            action(ctx)
    elif isinstance(expected, type):
        with pytest.raises(expected) as ei:
            action(ctx)
        assert fragment in str(ei.value)
    else:
        args = action(ctx)
        if expected == 2:   # usage errors come before any data is read
            import tempokern.cli as cli

            def no_work(*a, **k):
                pytest.fail("read data before rejecting the command line")
            for fn in ("_dataset", "_tmrl_rows", "_re3_data"):
                monkeypatch.setattr(cli, fn, no_work)
        rc = main(args)
        err = capsys.readouterr().err
        assert fragment in err, err
        assert rc == expected, err
        if name != "debug-shows-traceback":
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "run").exists()   # nothing was created


def test_current_checkpoints_round_trip(saved, tmp_path):
    """Checkpoints written now load, and saving onto an existing checkpoint replaces it."""
    for kind in ("ctd", "tmrl", "re3"):
        m = _load(kind, saved / kind)
        d = tmp_path / kind
        shutil.copytree(saved / kind, d)
        m.save(d)
        assert _load(kind, d) is not None
        assert json.loads((d / "checksums.json").read_text())["files"].keys() >= {CONFIG[kind]}
