"""The comparison on real data (tempokern.suite.realdata): TimeQA's suite set (pages never shared between
training and the ranked gallery, hard negatives and negative queries from the query's own page), a BEIR
folder of your own through `run_suite(suite="data")` and `tempokern benchmark --data DIR` end to end with a
tiny backbone, and every trained row of a table taking the same steps on the same rows."""
import json
from pathlib import Path

import pytest

from tempokern.cli import main
from tempokern.suite import Budget
from tempokern.suite.realdata import beir_set, timeqa_set
from tempokern.suite.runner import run_suite, unit_path

TEAMS = ("Rovers", "United", "City", "Athletic", "Wanderers", "Albion")
PEOPLE = ("Ann Lee", "Bo Chan", "Cy Dorn", "Di Ems", "Ed Fox", "Flo Gray")


def write_folder(root: Path, *, with_train=True, with_eval=True) -> Path:
    """Six people, a page each: five dated career paragraphs plus an undated one; a question per dated
    paragraph. People 0-3 train, 4 dev, 5 test."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "qrels").mkdir(exist_ok=True)
    corpus, queries, qrels = [], [], {"train": [], "dev": [], "test": []}
    for p, name in enumerate(PEOPLE):
        page = name.replace(" ", "_")
        corpus.append({"_id": f"{page}:0", "text": f"{name} is a footballer.", "page": page})
        for k in range(5):
            y = 1990 + 3 * k + p
            team = TEAMS[(p + k) % len(TEAMS)]
            did = f"{page}:{k + 1}"
            corpus.append({"_id": did, "text": f"In {y}, {name} joined {team} and played there until {y + 2}.",
                           "page": page})
            qid = f"{page}#team:q{k}"
            queries.append({"_id": qid, "text": f"Which team did {name} play for from {y} to {y + 1}?", "page": page})
            split = "train" if p < 4 else "dev" if p == 4 else "test"
            qrels[split].append((qid, did))
    with open(root / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in corpus)
    with open(root / "queries.jsonl", "w") as f:
        f.writelines(json.dumps(q) + "\n" for q in queries)
    for split, rows in qrels.items():
        if (split == "train" and not with_train) or (split != "train" and not with_eval):
            continue
        with open(root / "qrels" / f"{split}.tsv", "w") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            f.writelines(f"{q}\t{d}\t1\n" for q, d in rows)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("byod") / "data")


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory, folder):
    from tempokern.models import build_char_tokenizer, tiny_bert
    texts = [json.loads(l)["text"] for n in ("corpus.jsonl", "queries.jsonl") for l in open(folder / n)]
    tok = build_char_tokenizer(texts)
    model = tiny_bert(len(tok), hidden=32, layers=1, heads=2, intermediate=64, max_position=128, seed=0)
    path = tmp_path_factory.mktemp("bb")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def one_thread():
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_beir_set_rows_negatives_and_splits(folder):
    s = beir_set(str(folder), hard_negatives=2, negative_queries=2)
    assert s.eval_splits == ["dev", "test"] and s.gallery_ids is None
    assert len(s.train_rows) == 20
    ds = s.dataset
    for row in s.train_rows:
        q = next(x for x in ds.queries if x.id == row.query_id)
        page = q.meta["page"]
        assert row.positive in q.gold and row.query == q.text
        # the same page's other dated paragraphs: same entity, another time
        assert len(row.hard_negatives) == 2 and row.negative_kinds == ["time_wrong", "time_wrong"]
        for d in row.hard_negatives:
            assert ds.record(d).meta["page"] == page and d not in q.gold and ds.record(d).interval is not None
        # negative queries: the same page's other questions (another interval)
        assert len(row.negative_queries) == 2
        for t in row.negative_queries:
            o = next(x for x in ds.queries if x.text == t)
            assert o.meta["page"] == page and o.id != q.id and o.interval != q.interval
    # records and queries carry the page as the entity of the error kinds
    assert all(r.meta["entity"] == r.meta["page"] for r in ds.records)


def test_beir_set_needs_train_and_an_eval_split(tmp_path):
    with pytest.raises(ValueError, match="qrels/train.tsv"):
        beir_set(str(write_folder(tmp_path / "a", with_train=False)))
    with pytest.raises(ValueError, match="besides train"):
        beir_set(str(write_folder(tmp_path / "b", with_eval=False)))


def test_timeqa_quick_set_keeps_pages_apart():
    s = timeqa_set("quick")
    ds = s.dataset
    gal = set(s.gallery_ids)
    train_pages = {q.meta["page"] for q in ds.queries if q.split == "train"}
    eval_pages = {q.meta["page"] for q in ds.queries if q.split == "dev"}
    assert train_pages and eval_pages and not (train_pages & eval_pages)
    # the ranked gallery is exactly the held-out pages' paragraphs; every dev gold is in it
    assert gal == {r.id for r in ds.records if r.meta["page"] in eval_pages}
    assert all(d in gal for q in ds.queries if q.split == "dev" for d in q.gold)
    for row in s.train_rows:
        q = next(x for x in ds.queries if x.id == row.query_id)
        assert q.split == "train" and row.positive in q.gold and row.positive not in gal
        assert len(row.hard_negatives) == 1
        for d, kind in zip(row.hard_negatives, row.negative_kinds):
            assert d not in gal and d not in q.gold
            if kind == "time_wrong":
                assert ds.record(d).meta["page"] == q.meta["page"] and ds.record(d).interval is not None
    assert s.eval_splits == ["dev"] and s.info["checksum"] == timeqa_set("quick").info["checksum"]
    with pytest.raises(ValueError, match="eval_split"):
        timeqa_set("quick", eval_split="train")


ROWS = ["bm25_ties_last", "minilm_zeroshot", "minilm_ft", "ctd_full", "ctd_group", "tmrl_full", "re3-film_margins"]


def test_suite_on_your_folder_every_trained_row_same_steps(tmp_path, folder, tiny_backbone):
    pytest.importorskip("bm25s")
    budget = Budget(epochs=2, max_length=48, batch_size=8, lr=1e-3, hard_negatives=1)
    res = run_suite(tmp_path, suite="data", data_dir=str(folder), quick=True, methods=ROWS, backbone_path=tiny_backbone,
                    budget=budget, progress=False, log=lambda m: None, n_resamples=100, plots=False)
    for name in ROWS:
        assert res["methods"][name]["status"] == "done", (name, res["methods"][name])
    assert set(res["results"]["data"]) == {"dev", "test"}
    for sp in ("dev", "test"):
        # every row, and every row with the time prior fitted on the fit split on top
        assert set(res["results"]["data"][sp]) == set(ROWS) | {f"{r}+prior" for r in ROWS}
        assert res["results"]["data"][sp]["minilm_ft"]["R@1"]["n"] == 5
    steps = {}
    infos = {}
    for name in ("minilm_ft", "ctd_full", "ctd_group", "tmrl_full"):
        info = infos[name] = json.loads(unit_path(tmp_path, name, "data", 0).read_text())["payload"]["info"]
        steps[name] = info["steps"]
        assert info["hard_negatives"] == 1
    # 20 rows in batches of 8 (the last batch of 4 kept), 2 epochs, for every trained row
    assert steps == {"minilm_ft": 6, "ctd_full": 6, "ctd_group": 6, "tmrl_full": 6}
    # ctd_full keeps ChunQiuTR's positives; ctd_group scopes them to the folder's page field
    assert infos["ctd_full"]["loss_positives"] == "overlap" and infos["ctd_full"]["loss_calendar_labels"] == "key"
    assert infos["ctd_group"]["loss_positives"] == "overlap_group" and infos["ctd_group"]["loss_group_key"] == "page"
    assert infos["ctd_group"]["bias_max_abs_cosine_units"] >= 0
    md = (tmp_path / "results.md").read_text()
    assert md.startswith(f"# tempokern benchmark --data {folder}")
    assert "| steps |" in md and "1 hard negative(s) per row" in md


def test_cli_benchmark_on_your_folder(tmp_path, folder, tiny_backbone, capsys):
    pytest.importorskip("bm25s")
    out = tmp_path / "out"
    assert main(["benchmark", "--data", str(folder), "--quick", "--out", str(out), "--backbone", tiny_backbone,
                 "--methods", "bm25_ties_last,minilm_zeroshot", "--no-progress", "--bootstrap", "50"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["setup"]["suite"] == "data" and res["setup"]["data_dir"] == str(folder)
    assert set(res["results"]["data"]) == {"dev", "test"}
    assert f"# tempokern benchmark --data {folder} --quick" in capsys.readouterr().out


@pytest.mark.parametrize("args, msg", [
    (["--data", "/nonexistent/folder"], "not a folder"),
    (["--data", "{folder}", "--suite", "english"], "give one"),
    (["--data", "{folder}", "--sets", "A"], "--sets"),
    (["--suite", "timeqa", "--eval-split", "train"], "invalid choice"),
])
def test_cli_benchmark_data_errors(tmp_path, folder, args, msg, capsys):
    args = [a.replace("{folder}", str(folder)) for a in args]
    assert main(["benchmark", *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_cli_demo_rejects_seeds_outside_timeqa(tmp_path, capsys):
    assert main(["demo", "--suite", "english", "--seeds", "0,1", "--out", str(tmp_path / "o")]) == 2
    assert "--seeds" in capsys.readouterr().err


def test_cli_demo_report_only_is_for_the_comparison_suites(tmp_path, capsys):
    assert main(["demo", "--suite", "zztj", "--report-only", "--out", str(tmp_path / "o")]) == 2
    assert "--report-only" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
