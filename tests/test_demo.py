"""`tempokern demo --quick`: the README's main job in CI mode."""
import json
import time

from _ctd_helpers import small_dataset  # noqa: F401

from tempokern.cli import main


def test_demo_quick_mode(tmp_path, capsys):
    t = time.time()
    assert main(["demo", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    seconds = time.time() - t
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
    assert "| name |" in capsys.readouterr().out
    assert seconds < 300


def test_demo_with_a_backbone_given_by_path(tmp_path, capsys):
    """--backbone swaps the tiny model for any transformers model (here one saved to disk)."""
    from _ctd_helpers import small_dataset, tiny_model
    src = tiny_model(small_dataset())
    src.backbone.save_pretrained(tmp_path / "bb")
    src.tokenizer.save_pretrained(tmp_path / "bb")
    out = tmp_path / "out"
    assert main(["demo", "--quick", "--backbone", str(tmp_path / "bb"), "--variants", "baseline", "--epochs", "1",
                 "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["setup"]["backbone"] == str(tmp_path / "bb") and res["setup"]["pooling"] == "cls"
    assert [r["name"] for r in res["rows"]] == ["baseline"]
    assert res["setup"]["vocab"] == len(src.tokenizer)
