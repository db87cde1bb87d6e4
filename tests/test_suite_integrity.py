"""The comparison suite on damaged inputs: rows skipped from a BEIR folder are reported (log and
results.json), and a unit file that does not fit the data (re-hashed with other query ids, a non-numeric
metric) is named and recomputed, not a failure while merging."""
import json

import pytest

from tempokern.suite import Method, register, unregister
from tempokern.suite.runner import _checksum, read_unit, run_suite, unit_path

from test_suite import CALLS, _fake_run, tiny_backbone, tiny_synth  # noqa: F401  (tiny_backbone: a fixture)


@pytest.fixture(autouse=True)
def one_thread():
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fake_everywhere():
    added = [register(Method("fake_any", "test", ("B", "data"), _fake_run))]
    yield added
    for m in added:
        unregister(m.name)


def _folder(d):
    (d / "qrels").mkdir(parents=True)
    docs = [{"_id": f"d{i}", "text": f"In {2000 + i} thing {i} happened.", "page": f"p{i % 2}"} for i in range(8)]
    docs.insert(2, {"_id": "bad", "text": "x", "time": "0000"})
    (d / "corpus.jsonl").write_text("\n".join(json.dumps(x) for x in docs) + "\n")
    (d / "queries.jsonl").write_text("\n".join(json.dumps({"_id": f"q{i}", "text": f"thing {i} in {2000 + i}?"})
                                               for i in range(8)) + "\n")
    (d / "qrels" / "train.tsv").write_text("q0\td0\t1\nq1\td1\t1\nq2\td2\t1\nq2\td2\t1\nq3\td3\t1\n")
    (d / "qrels" / "dev.tsv").write_text("q4\td4\t1\nq5\td5\t1\nq6\td6\t1\nq7\td7\t1\n")
    return d


def test_benchmark_data_reports_every_skipped_row(tmp_path, tiny_backbone, fake_everywhere):
    logs = []
    data = _folder(tmp_path / "beir")
    kw = dict(suite="data", data_dir=str(data), methods=["fake_any"], seeds=[0], backbone_path=tiny_backbone,
              plots=False, progress=False, log=logs.append, n_resamples=50)
    with pytest.raises(Exception, match=r"corpus.jsonl:3"):
        run_suite(tmp_path / "out", **kw)
    res = run_suite(tmp_path / "out", on_error="skip", **kw)
    want = [f"{data / 'corpus.jsonl'}:3", f"{data / 'qrels' / 'train.tsv'}:4"]
    got = res["setup"]["set_info"]["data"]["skipped"]
    assert [x.split(": ")[0] for x in got] == want
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["setup"]["set_info"]["data"]["skipped"] == got
    text = "\n".join(logs)
    assert "skipped 2 malformed row(s)" in text and all(w in text for w in want)


@pytest.mark.parametrize("damage", ["qids", "metric"])
def test_a_rehashed_unit_that_does_not_fit_is_named_and_recomputed(tmp_path, tiny_backbone, fake_everywhere, damage):
    logs = []
    kw = dict(quick=True, sets=["B"], methods=["fake_any"], seeds=[0], synth_loader=tiny_synth,
              backbone_path=tiny_backbone, plots=False, progress=False, log=logs.append, n_resamples=50)
    CALLS["n"] = 0
    res = run_suite(tmp_path, **kw)
    assert CALLS["n"] == 1
    p = unit_path(tmp_path, "fake_any", "B", 0)
    doc = json.loads(p.read_text())
    sp = doc["payload"]["splits"]["test_template"]
    if damage == "qids":
        sp["qids"] = ["other-" + q for q in sp["qids"]]
    else:
        sp["R@1"][0] = "high"
    doc["sha256"] = _checksum(doc["payload"])        # re-hashed: the checksum alone does not catch it
    p.write_text(json.dumps(doc))
    assert read_unit(p) is not None
    logs.clear()
    res2 = run_suite(tmp_path, **kw)
    assert CALLS["n"] == 2
    assert any(str(p) in m and "does not fit the data" in m and "recomputing" in m for m in logs)
    for sp, rows in res["results"]["B"].items():     # the same numbers again ("extra" counts the calls)
        assert res2["results"]["B"][sp]["fake_any"]["R@1"] == rows["fake_any"]["R@1"]
    logs.clear()
    run_suite(tmp_path, **kw)                       # recomputed once: the next run reuses it
    assert CALLS["n"] == 2
