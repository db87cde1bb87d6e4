"""`tempokern` command line: every command's --help, a tiny train -> eval -> index -> search run,
bench, config files, and readable non-zero exits on bad input."""
import json
import os
import subprocess
import sys

import pytest
import torch

import tempokern

from _ctd_helpers import small_dataset  # noqa: F401

from tempokern.cli import main

COMMANDS = ["train", "eval", "index", "search", "bench", "demo"]
TINY = ["--tiny-hidden", "32", "--tiny-layers", "1", "--max-length", "32", "--no-progress"]


def _root():
    import tempokern
    return os.path.dirname(os.path.dirname(os.path.abspath(tempokern.__file__)))


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_exits_zero(cmd, capsys):
    assert main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"tempokern {cmd}" in out and "--config" in out


def test_python_dash_m_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=_root() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "tempokern", "--help"], capture_output=True, text=True, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0 and "train" in r.stdout and "demo" in r.stdout
    r = subprocess.run([sys.executable, "-m", "tempokern", "eval", "--model", str(tmp_path / "missing"),
                        "--dataset", "zztj"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode != 0
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    rc = main(["train", "--dataset", "zztj", "--variant", "full", "--epochs", "1", "--max-steps", "3",
               "--batch-size", "8", "--out", str(out), *TINY])
    assert rc == 0
    return out


def test_train_eval_index_search(trained, tmp_path, capsys):
    assert (trained / "best" / "tempokern_encoder.json").exists()
    res = tmp_path / "eval.json"
    assert main(["eval", "--model", str(trained / "best"), "--dataset", "zztj", "--split", "test",
                 "--out", str(res)]) == 0
    table = json.loads(res.read_text())
    assert table["split"] == "test"
    names = {r["name"] for r in table["rows"]}
    assert {"all", "point", "window"} <= names
    for r in table["rows"]:
        for k in ("R@1", "R@5", "R@10", "MRR@10", "nDCG@10", "recall@10"):
            assert 0.0 <= r[k] <= 1.0
    assert (tmp_path / "eval.md").read_text().startswith("| name |")
    assert table["scorer"] == "ctd" and table["mode"] == "neg1_ne1_dq1"
    # the reference's protocol: encoder-only scoring, pure no_event queries kept
    res2 = tmp_path / "eval_enc.json"
    assert main(["eval", "--model", str(trained / "best"), "--dataset", "zztj", "--split", "test", "--scorer", "encoder",
                 "--keep-no-event-queries", "--out", str(res2)]) == 0
    t2 = json.loads(res2.read_text())
    assert t2["scorer"] == "encoder" and t2["mode"] == "neg1_ne1_dq0"
    from tempokern.models import CTDEncoder
    from tempokern.training import evaluate_model, zztj_demo_dataset
    want = evaluate_model(CTDEncoder.load(trained / "best"), zztj_demo_dataset(), "test", scorer="encoder",
                          drop_no_event=False)
    assert {r["name"]: r["R@1"] for r in t2["rows"]} == {k: v["R@1"] for k, v in want.items()}
    idx = tmp_path / "zztj.idx"
    assert main(["index", "--model", str(trained / "best"), "--dataset", "zztj", "--out", str(idx)]) == 0
    assert idx.exists() and (tmp_path / "zztj.idx.records.json").exists()
    capsys.readouterr()
    assert main(["search", "--model", str(trained / "best"), "--index", str(idx), "--query", "建元元年正月，有何事？",
                 "-k", "3", "--json"]) == 0
    hit = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert hit["query"] == "建元元年正月，有何事？" and len(hit["hits"]) == 3
    assert all(h["id"] for h in hit["hits"])


def test_config_file_json_and_toml(tmp_path, capsys):
    cfg = tmp_path / "bench.toml"
    cfg.write_text('sizes = [32]\nrepeat = 1\nout = "%s"\nops = ["calendar_scalar"]\n' % (tmp_path / "b"))
    assert main(["bench", "--config", str(cfg)]) == 0
    assert (tmp_path / "b" / "bench.md").exists() and (tmp_path / "b" / "bench.json").exists()
    res = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert {r["provider"] for r in res["rows"]} == {"fused", "reference"}
    assert all(r["size"] == 32 for r in res["rows"])
    fused = [r for r in res["rows"] if r["provider"] == "fused"]
    assert all(0 <= r["max_rel_diff"] < 1e-4 for r in fused)  # fused and reference agree (float32)
    assert "agreement" in (tmp_path / "b" / "bench.md").read_text()
    # a flag on the command line wins over the file
    cj = tmp_path / "bench.json"
    cj.write_text(json.dumps({"sizes": [16], "repeat": 1, "ops": ["calendar_scalar"]}))
    assert main(["bench", "--config", str(cj), "--out", str(tmp_path / "c"), "--sizes", "24"]) == 0
    res = json.loads((tmp_path / "c" / "bench.json").read_text())
    assert {r["size"] for r in res["rows"]} == {24}


def test_bench_agreement_catches_a_wrong_op(monkeypatch):
    # the agreement column must flag a fused op that is off by 1% (and pass the real one)
    from tempokern.bench import max_rel_diff
    assert max_rel_diff("calendar_scalar", 40, 8, torch.device("cpu")) < 1e-5
    real = tempokern.calendar_scalar
    monkeypatch.setattr(tempokern, "calendar_scalar", lambda *a, **k: real(*a, **k) * 1.01)
    assert max_rel_diff("calendar_scalar", 40, 8, torch.device("cpu")) > 5e-3


def test_bench_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["bench", "--ops", "calendar_scalar", "calendar_context", "--sizes", "64", "--repeat", "1",
                 "--out", str(tmp_path)]) == 0
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["eval", "--model", "/nonexistent/model", "--dataset", "zztj"], "does not exist"),
    (["train", "--dataset", "zztj", "--out", "{tmp}/x", "--calendar", "mayan"], "unknown calendar"),
    (["train", "--dataset", "zztj", "--out", "{tmp}/x", "--calendar", "chunqiu"], "does not fit"),
    (["train", "--data", "{tmp}/missing.jsonl", "--out", "{tmp}/x"], "does not exist"),
    (["train", "--dataset", "zztj", "--out", "{tmp}/x", "--variant", "fancy"], "unknown variant"),
    (["train", "--dataset", "zztj", "--out", "{tmp}/x", "--resume"], "cannot resume"),
    (["train", "--dataset", "zztj"], "--out is required"),
    (["eval", "--model", "{tmp}", "--dataset", "zztj", "--scorer", "bm25"], "invalid choice"),
    (["train", "--dataset", "zztj", "--out", "{tmp}/x", "--pairs-per-query", "0"], "positive int or 'all'"),
    (["bench", "--ops", "warp_drive", "--out", "{tmp}/b"], "unknown op"),
    (["bench", "--config", "{tmp}/nope.toml"], "does not exist"),
    (["search", "--model", "{tmp}", "--index", "{tmp}/none.idx"], "at least one --query"),
    (["eval", "--model", "{tmp}", "--dataset", "zztj", "--run-out", "{tmp}"], "--run-out must name a file"),
    (["eval", "--method", "re3", "--model", "{tmp}", "--dataset", "zztj", "--run-out", ""], "--run-out must name a file"),
])
def test_bad_input_exits_nonzero_with_message(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_bad_split_and_unknown_config_key(trained, tmp_path, capsys):
    assert main(["eval", "--model", str(trained / "best"), "--dataset", "zztj", "--split", "devv"]) != 0
    assert "unknown split 'devv'" in capsys.readouterr().err
    # dev is a split name (BEIR folders, TimeQA), which the packaged zztj set does not have
    assert main(["eval", "--model", str(trained / "best"), "--dataset", "zztj", "--split", "dev"]) != 0
    assert "has no queries in split 'dev'" in capsys.readouterr().err
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"epochz": 2}))
    assert main(["train", "--config", str(bad)]) != 0
    assert "unknown option(s) ['epochz']" in capsys.readouterr().err
    broken = tmp_path / "d.toml"
    broken.write_text("sizes = [")
    assert main(["bench", "--config", str(broken)]) != 0
    assert "not valid TOML" in capsys.readouterr().err
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"id": "a", "description": "x", "time_meta": {"reign": "建元", "era_year": 1, "lunar_month": 1}}\nnot json\n')
    assert main(["train", "--data", str(bad_data), "--out", str(tmp_path / "o")]) != 0
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err


def test_train_and_eval_on_chunqiutr_format(tmp_path, capsys):
    """ChunQiuTR-format files keyed by the real Lu calendar: splits come from Calendar.chunqiu()."""
    from tempokern import Calendar
    cal = Calendar.chunqiu()
    recs, qs = [], []
    for split in ("train", "val", "test"):
        for i, key in enumerate(cal.split_keys(split)[:6]):
            ks = "-".join(map(str, key))
            for j in range(2):
                recs.append({"id": f"{split}{i}_{j}", "text": f"公{key[0]}年{key[1]}月{key[2]}事{j}{'甲乙丙丁'[i % 4]}",
                             "time": ks, "type": "event"})
            recs.append({"id": f"{split}{i}_neg", "text": f"传曰{key[1]}月之事不书", "time": ks, "type": "neg_comment"})
            qs.append({"id": f"q{split}{i}", "text": f"{key[0]}公{key[1]}年{key[2]}月何事", "target": ks, "family": "point"})
    rp, qp = tmp_path / "records.jsonl", tmp_path / "queries.jsonl"
    rp.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in recs))
    qp.write_text("\n".join(json.dumps(q, ensure_ascii=False) for q in qs))
    out = tmp_path / "run"
    base = ["--data", str(rp), "--format", "chunqiutr", "--data-queries", str(qp), "--calendar", "chunqiu"]
    assert main(["train", *base, "--epochs", "1", "--batch-size", "4", "--out", str(out), *TINY]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "best"), *base, "--split", "val"]) == 0
    assert "| all |" in capsys.readouterr().out
    assert main(["train", *base[:4], "--out", str(tmp_path / "run2")]) != 0
    assert "--data-queries" in capsys.readouterr().err
    assert main(["train", *base[:-2], "--calendar", "reign", "--out", str(tmp_path / "run2")]) != 0
    assert "does not fit" in capsys.readouterr().err


# ---- usage errors, --help, readable outputs ---------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["demo", "--epochs", "-3", "--out", "{tmp}/demo"], "--epochs must be >= 1"),
    (["demo", "--variants", "fancy", "--out", "{tmp}/demo"], "unknown variant"),
    (["eval", "--dataset", "zztj"], "--model is required"),
    (["train", "--dataset", "zztj", "--out", "{tmp}/demo", "--batch-size", "1"], "--batch-size must be >= 2"),
    (["train", "--dataset", "zztj", "--out", "{tmp}/demo", "--lr", "0"], "--lr must be > 0"),
    (["search", "--model", "{tmp}", "--index", "{tmp}/x", "-k", "0", "--query", "q"], "-k must be >= 1"),
    (["bench", "--sizes", "0", "--out", "{tmp}/demo"], "--sizes must be positive"),
])
def test_usage_errors_exit_2_before_any_work(argv, message, tmp_path, capsys, monkeypatch):
    """Fails on a030c41: usage errors exited 1 (docs/cli.md says 2), `demo --epochs -3` loaded the data
    first, and a rejected command left an empty output folder."""
    import tempokern.training.data as data_mod
    monkeypatch.setattr(data_mod, "zztj_demo_dataset", lambda *a, **k: pytest.fail("loaded data before checking"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "demo").exists()


def test_failed_command_removes_the_empty_output_folder_it_created(tmp_path, capsys):
    out = tmp_path / "new"
    assert main(["train", "--data", str(tmp_path / "missing.jsonl"), "--out", str(out), *TINY]) == 1
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert main(["train", "--data", str(tmp_path / "missing.jsonl"), "--out", str(kept), *TINY]) == 1
    assert kept.exists()                      # folders the user made are never removed


def test_cuda_device_without_cuda_is_said_in_words(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert main(["bench", "--device", "cuda", "--sizes", "8"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and ("no CUDA support" in err or "no CUDA device" in err)
    assert "AssertionError" not in err


def test_every_option_has_help():
    """Fails on a030c41: most options of bench, search (--model, --index, -k) and others had none."""
    import argparse
    from tempokern.cli import build_parser
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {'/'.join(a.option_strings)}" for name, sp in sub.choices.items() for a in sp._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction) and not a.help]
    assert not missing, missing


def test_markdown_durations_and_losses_are_readable():
    from tempokern.training import markdown_table
    md = markdown_table([{"name": "full", "R@1": 0.5, "final_loss": 1.234567, "train_seconds": 18.8}],
                        ["R@1", "final_loss", "train_seconds"])
    assert "| full | 0.500 | 1.235 | 18.8 s |" in md and "train time" in md and "18.800" not in md


def test_variants_text_says_what_rows_are():
    from tempokern.demo import variants_text
    t = variants_text(["baseline", "multipos", "bias", "context", "full"], 40)
    for v in ("baseline", "multipos", "bias", "context", "full"):
        assert f"- `{v}`:" in t
    assert "1/40" in t and "identical" in t


def test_progress_is_plain_lines_when_not_a_terminal():
    """Fails on a030c41: tqdm frames flooded log files. Off a terminal: a few plain lines."""
    import io
    from tempokern.training.trainer import _progress
    buf = io.StringIO()
    bar = _progress(range(50), True, "full epoch 1/3", stream=buf)
    for _ in bar:
        bar.set_postfix(loss="0.5")
    lines = buf.getvalue().splitlines()
    assert 2 <= len(lines) <= 11 and "\r" not in buf.getvalue()
    assert lines[-1].startswith("full epoch 1/3: 50/50 batches") and "loss=0.5" in lines[-1]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tempokern {tempokern.__version__}"


def _help_groups(argv, capsys):
    """The titles of the option groups of a --help text, in order."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    return [l[:-1] for l in out.splitlines() if l and not l.startswith(" ") and l.endswith(":")
            and not l.startswith("usage")]


@pytest.mark.parametrize("method,title", [("ctd", "CTD (--method ctd)"), ("tmrl", "TMRL (--method tmrl)"),
                                          ("re3", "Re³ (--method re3)")])
def test_train_method_help_lists_its_options_first(method, title, capsys):
    groups = _help_groups(["train", "--method", method, "--help"], capsys)
    assert groups[:2] == ["options", title], groups
    # every method's group is still there, after it
    assert {"CTD (--method ctd)", "TMRL (--method tmrl)", "Re³ (--method re3)"} <= set(groups)
    assert _help_groups(["train", f"--method={method}", "--help"], capsys)[1] == title
    if method == "ctd":    # the default method
        assert _help_groups(["train", "--help"], capsys)[1] == title


def test_method_cli_defaults_equal_config_defaults():
    """Each method's own options (its help group) default to its config class's defaults; --lora-r, which TMRL and
    Re³ share with different defaults, follows the method (was 4 for --method re3, Re3Config's is 16)."""
    import argparse
    import dataclasses
    from tempokern.cli import build_parser, parse_args
    from tempokern.training import CTDConfig
    from tempokern.training.re3 import Re3Config
    from tempokern.training.tmrl import TMRLConfig
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    rename = {"num_hard_negatives": "hard_negatives", "re3_variant": "variant", "scorer": "eval_scorer"}
    for method, cls, title in (("ctd", CTDConfig, "CTD (--method ctd)"), ("tmrl", TMRLConfig, "TMRL (--method tmrl)"),
                               ("re3", Re3Config, "Re³ (--method re3)")):
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        group = next(g for g in sub._action_groups if g.title == title)
        args = parse_args(["train", "--method", method, "--out", "x"])
        checked = 0
        for a in group._group_actions:
            name = rename.get(a.dest, a.dest)
            # (a default of None is decided at run time, e.g. --lora from the backbone: its help says how)
            if name in fields and fields[name] is not dataclasses.MISSING and getattr(args, a.dest) is not None:
                assert getattr(args, a.dest) == fields[name], (method, a.dest, getattr(args, a.dest), fields[name])
                checked += 1
        assert checked >= 4, (method, checked)
        if method in ("tmrl", "re3"):
            assert args.lora_r == cls.lora_r
    assert parse_args(["train", "--method", "re3", "--out", "x"]).lora_r == 16
    assert parse_args(["train", "--method", "re3", "--out", "x", "--lora-r", "8"]).lora_r == 8


def test_demo_budget_hint_names_a_command_that_takes_the_budget(tmp_path, capsys):
    assert main(["demo", "--epochs", "2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "tempokern train --method" in err and "benchmark" not in err
    from tempokern.cli import parse_args, validate_args
    for method in ("ctd", "tmrl", "re3"):   # the hint's flags are accepted (usage checks pass)
        args = parse_args(["train", "--method", method, "--epochs", "2", "--batch-size", "8", "--dataset",
                           "zztj" if method != "tmrl" else "synth-a", "--out", str(tmp_path / method)])
        validate_args(args)
        assert args.epochs == 2 and args.batch_size == 8


def test_files_are_written_with_plain_permissions(tmp_path):
    """Atomic writes go through mkstemp / mkdtemp (0600 / 0700): results, indexes and checkpoints get a plain
    write's permissions instead (0644 / 0755 under umask 022)."""
    from tempokern._util import atomic_write
    from tempokern.models import build_char_tokenizer, tiny_bert, Re3Encoder
    from tempokern.search import TemporalIndex
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "r.json", "{}")
        ix = TemporalIndex(4)
        ix.add(torch.arange(3), torch.randn(3, 4), torch.rand(3))
        ix.save(tmp_path / "i.tki")
        texts = ["a b c", "d e f"]
        tok = build_char_tokenizer(texts)
        Re3Encoder(tiny_bert(len(tok), hidden=16, layers=1, heads=2, intermediate=32, max_position=32, seed=0),
                   tokenizer=tok, pooling="mean").save(tmp_path / "m")
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "r.json").st_mode & 0o777) == oct(0o644)
    assert oct(os.stat(tmp_path / "i.tki").st_mode & 0o777) == oct(0o644)
    assert oct(os.stat(tmp_path / "m").st_mode & 0o777) == oct(0o755)
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in (tmp_path / "m").iterdir() if p.is_file())
