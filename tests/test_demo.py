"""`tempokern demo`: the TimeQA comparison (the README's main job), the quick English comparison suite
behind `--suite english`, and the Zizhi Tongjian CTD demo behind `--suite zztj`."""
import json

from _ctd_helpers import small_dataset  # noqa: F401

from tempokern.cli import main
from test_suite import one_thread, tiny_backbone  # noqa: F401  (fixtures)


def test_zztj_demo_quick_mode(tmp_path, capsys):
    assert main(["demo", "--suite", "zztj", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    names = [r["name"] for r in res["rows"]]
    assert names == ["baseline", "full"]
    for r in res["rows"]:
        for k in ("R@1", "R@5", "R@10", "MRR@10", "nDCG@10"):
            assert 0.0 <= r[k] <= 1.0
        assert r["queries"] > 0
        assert r["final_loss"] < r["first_loss"]          # it trained
    assert "timing" in res and res["timing"]["op"].startswith("multipos_infonce")
    assert res["setup"]["quick"] is True and res["setup"]["vocab"] > 1000   # character vocabulary of the corpus
    md = (tmp_path / "results.md").read_text()
    assert "| baseline |" in md and "| full |" in md
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "| name |" in out
    # the plan, k/N on every row's lines and the time left
    assert "plan: 2 row(s) (baseline, full)" in out
    assert "[1/2] baseline: training" in out and "[2/2] full: training" in out
    assert "1 row(s) left, about" in out and "no row left" in out


def test_demo_with_a_backbone_given_by_path(tmp_path, capsys):
    """--backbone swaps the tiny model for any transformers model (here one saved to disk)."""
    from _ctd_helpers import small_dataset, tiny_model
    src = tiny_model(small_dataset())
    src.backbone.save_pretrained(tmp_path / "bb")
    src.tokenizer.save_pretrained(tmp_path / "bb")
    out = tmp_path / "out"
    assert main(["demo", "--suite", "zztj", "--quick", "--backbone", str(tmp_path / "bb"), "--variants", "baseline", "--epochs", "1",
                 "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["setup"]["backbone"] == str(tmp_path / "bb") and res["setup"]["pooling"] == "cls"
    assert [r["name"] for r in res["rows"]] == ["baseline"]
    assert res["setup"]["vocab"] == len(src.tokenizer)


def _fake_synth_module(monkeypatch):
    """tempokern.datasets.synth replaced by the tiny hand-made set of test_suite (fast, offline)."""
    import sys
    import types
    from test_suite import tiny_synth
    mod = types.ModuleType("tempokern.datasets.synth")
    mod.load_synth = lambda name, seed=0, size="full", cache_dir=None: tiny_synth(name, seed, size)
    monkeypatch.setitem(sys.modules, "tempokern.datasets.synth", mod)


def test_demo_is_the_timeqa_comparison(tmp_path, capsys, tiny_backbone, one_thread):
    """`tempokern demo --quick --out DIR` = `tempokern benchmark --suite timeqa --quick --out DIR`: TimeQA's
    quick set (held-out pages ranked over their own paragraphs), the real-data budget."""
    methods = "bm25_ties_last,minilm_zeroshot"
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--backbone", tiny_backbone, "--methods", methods,
                 "--no-progress", "--bootstrap", "100"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["setup"]["suite"] == "timeqa" and res["setup"]["seeds"] == [0]
    assert res["setup"]["budget"]["hard_negatives"] == 1
    info = res["setup"]["set_info"]["timeqa"]
    assert info["eval_splits"] == ["dev"] and 0 < info["gallery"] < info["records"]
    # the rows asked for and their time-prior twins (derived from the same units, no extra run)
    assert sorted(res["results"]["timeqa"]["dev"]) == sorted(m + x for m in methods.split(",") for x in ("", "+prior"))
    assert "# tempokern benchmark --suite timeqa --quick" in capsys.readouterr().out


def test_demo_english_is_the_quick_english_suite(tmp_path, capsys, monkeypatch, tiny_backbone, one_thread):
    """`tempokern demo --suite english --out DIR` = `tempokern benchmark --suite english --quick --out DIR`."""
    _fake_synth_module(monkeypatch)
    methods = "bm25_ties_gold,bm25_ties_last,minilm_zeroshot,minilm_ft"
    out = tmp_path / "demo"
    assert main(["demo", "--suite", "english", "--out", str(out), "--backbone", tiny_backbone, "--sets", "B",
                 "--methods", methods, "--no-progress", "--bootstrap", "100"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["setup"]["quick"] is True and res["setup"]["seeds"] == [0]
    assert res["setup"]["budget"]["max_train_rows"] == 300 and res["setup"]["budget"]["max_length"] == 48
    assert res["setup"]["budget"]["epochs"] == 1
    assert sorted(res["results"]["B"]["test_date"]) == sorted(methods.split(","))
    assert all(res["methods"][m]["status"] == "done" for m in methods.split(","))
    printed = capsys.readouterr().out
    assert "# tempokern benchmark --suite english --quick" in printed and "`minilm_ft`" in printed
    assert (out / "results.md").exists() and (out / "plot_setB.png").exists()
    # the same through `benchmark`, resumed from the demo's units: nothing is recomputed
    assert main(["benchmark", "--quick", "--out", str(out), "--backbone", tiny_backbone, "--sets", "B",
                 "--methods", methods, "--no-progress", "--bootstrap", "100"]) == 0
    res2 = json.loads((out / "results.json").read_text())
    assert res2["results"] == res["results"]
    assert "done earlier" in capsys.readouterr().err


def test_demo_usage_errors(tmp_path, capsys):
    assert main(["demo", "--epochs", "2", "--out", str(tmp_path / "x")]) == 2
    assert "only with --suite zztj" in capsys.readouterr().err
    assert main(["benchmark", "--quick"]) == 2
    assert "--out is required" in capsys.readouterr().err
    assert main(["benchmark", "--out", str(tmp_path / "y"), "--seeds", "a,b"]) == 2
    assert main(["benchmark", "--out", str(tmp_path / "y"), "--bootstrap", "0"]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
