"""Index integrity: search refuses non-finite queries and names both dimensions on a mismatch; an index
stores its encoder's fingerprint and `tempokern search` with another encoder fails naming both."""
import json
import math

import pytest
import torch

from tempokern.cli import main
from tempokern.search import TemporalIndex

TINY = ["--tiny-hidden", "32", "--tiny-layers", "1", "--max-length", "32", "--no-progress"]


def _index(dim=4, n=5):
    ix = TemporalIndex(dim)
    ix.add(torch.arange(n), torch.randn(n, dim), torch.rand(n))
    return ix


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_search_refuses_non_finite_queries(bad):
    ix = _index()
    q = torch.randn(3, 4)
    q[2, 1] = bad
    with pytest.raises(ValueError, match=r"q must be finite: query row\(s\) \[2\]"):
        ix.search(q, torch.zeros(3), 2)
    u = torch.zeros(3)
    u[0] = bad
    with pytest.raises(ValueError, match=r"u_q must be finite: query row\(s\) \[0\]"):
        ix.search(torch.randn(3, 4), u, 2)
    ids, _ = ix.search(torch.randn(3, 4), torch.zeros(3), 2)
    assert bool((ids >= 0).all())


def test_dimension_mismatch_names_both():
    with pytest.raises(ValueError, match="q has dimension 16 but the index holds dimension-4 embeddings"):
        _index().search(torch.randn(2, 16), torch.zeros(2), 1)


def test_fingerprint_round_trip(tmp_path):
    ix = _index()
    assert ix.model is None
    ix.model = {"kind": "CTDEncoder", "config_sha256": "a" * 64, "weights_sha256": "b" * 64, "dim": None, "path": "m"}
    ix.save(tmp_path / "g.idx")
    assert TemporalIndex.load(tmp_path / "g.idx").model == ix.model
    ix.model = None
    ix.save(tmp_path / "h.idx")
    assert TemporalIndex.load(tmp_path / "h.idx").model is None


def test_weights_fingerprint_sees_one_changed_weight():
    from _ctd_helpers import small_dataset, tiny_model
    from tempokern.models.fingerprint import model_fingerprint, same_model
    m = tiny_model(small_dataset())
    a = model_fingerprint(m)
    with torch.no_grad():
        next(m.parameters()).view(-1)[0] += 1e-6
    b = model_fingerprint(m)
    assert a["config_sha256"] == b["config_sha256"] and a["weights_sha256"] != b["weights_sha256"]
    assert not same_model(a, b) and same_model(a, dict(a, path="elsewhere"))


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """run/best, other/best (same dimension, other weights) and wide/best (another dimension), and an index
    built with run/best."""
    from tempokern.models import CTDEncoder
    root = tmp_path_factory.mktemp("fp")
    assert main(["train", "--dataset", "zztj", "--epochs", "1", "--max-steps", "1", "--batch-size", "8",
                 "--out", str(root / "run"), *TINY]) == 0
    m = CTDEncoder.load(root / "run" / "best")
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01)
    m.save(root / "other" / "best")
    assert main(["train", "--dataset", "zztj", "--epochs", "1", "--max-steps", "1", "--batch-size", "8",
                 "--out", str(root / "wide"), *TINY, "--tiny-hidden", "48"]) == 0
    assert main(["index", "--model", str(root / "run" / "best"), "--dataset", "zztj", "--out", str(root / "z.idx"),
                 "--no-progress"]) == 0
    return root


def test_search_with_the_building_model(two_models, capsys):
    root = two_models
    assert TemporalIndex.load(root / "z.idx").model["path"] == str(root / "run" / "best")
    assert main(["search", "--model", str(root / "run" / "best"), "--index", str(root / "z.idx"),
                 "--query", "建元元年", "-k", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert len(json.loads(out.out.splitlines()[0])["hits"]) == 2 and "warning" not in out.err


def test_search_with_another_model_of_the_same_dimension_fails(two_models, capsys):
    root = two_models
    argv = ["search", "--model", str(root / "other" / "best"), "--index", str(root / "z.idx"), "--query", "建元元年",
            "-k", "2", "--json"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert str(root / "run" / "best") in err and str(root / "other" / "best") in err and "--allow-other-model" in err
    assert main(argv + ["--allow-other-model"]) == 0
    out = capsys.readouterr()
    assert "warning (--allow-other-model)" in out.err and json.loads(out.out.splitlines()[0])["hits"]


def test_search_with_another_dimension_names_both(two_models, capsys):
    root = two_models
    assert main(["search", "--model", str(root / "wide" / "best"), "--index", str(root / "z.idx"),
                 "--query", "建元元年", "--allow-other-model"]) == 1
    err = capsys.readouterr().err
    assert "embeds in dimension 48" in err and "holds dimension-32 embeddings" in err
