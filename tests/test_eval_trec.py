"""TREC run files (tempokern.eval.write_run / read_run): the written ranks are the order
tempokern.eval.rank_documents scores, a file read back is the run written (to the written precision), and a
malformed file is refused with file:line."""
import pytest

from tempokern.eval import TrecFormatError, rank_documents, read_run, retrieval_metrics, write_run


def test_round_trip_ranks_follow_rank_documents(tmp_path):
    run = {"q2": {"d1": 0.5, "d3": 0.5, "d2": 0.9, "d10": -1.25},   # a tie: doc id descending, as trec_eval
           "q1": {"a": 1.0}}
    path = tmp_path / "run.trec"
    assert write_run(run, path, tag="mine") == 5
    lines = [line.split() for line in path.read_text().splitlines()]
    assert [l[0] for l in lines] == ["q1", "q2", "q2", "q2", "q2"]
    assert [l[2] for l in lines[1:]] == rank_documents(run["q2"]) == ["d2", "d3", "d1", "d10"]
    assert [int(l[3]) for l in lines[1:]] == [1, 2, 3, 4]
    assert all(l[1] == "Q0" and l[5] == "mine" for l in lines)
    back = read_run(path)
    assert back == {q: {d: pytest.approx(s) for d, s in docs.items()} for q, docs in run.items()}
    qrels = {"q1": {"a": 1}, "q2": {"d1": 1}}
    assert retrieval_metrics(back, qrels) == pytest.approx(retrieval_metrics(run, qrels))


def test_depth_keeps_the_top_documents(tmp_path):
    run = {"q": {f"d{i}": float(i) for i in range(10)}}
    write_run(run, tmp_path / "r", depth=3)
    assert read_run(tmp_path / "r") == {"q": {"d9": 9.0, "d8": 8.0, "d7": 7.0}}
    with pytest.raises(ValueError, match="depth"):
        write_run(run, tmp_path / "r", depth=0)


@pytest.mark.parametrize("run, match", [
    ({"q 1": {"d": 1.0}}, "query id 'q 1'"),
    ({"q": {"": 1.0}}, "document id ''"),
    ({"q": {"d": float("nan")}}, "NaN"),
    ({"q": ["d"]}, "must be a dict"),
])
def test_write_refuses_what_a_run_file_cannot_hold(tmp_path, run, match):
    with pytest.raises((ValueError, TypeError), match=match):
        write_run(run, tmp_path / "r")
    assert not (tmp_path / "r").exists()      # nothing half-written


@pytest.mark.parametrize("text, match", [
    ("q Q0 d 1 0.5\n", r"r\.trec:1: expected 6 columns"),
    ("q Q0 d 1 0.5 t\nq Q0 e one 0.4 t\n", r"r\.trec:2: rank 'one' must be an integer"),
    ("q Q0 d 1 high t\n", r"r\.trec:1: .*score 'high'"),
    ("q Q0 d 1 nan t\n", r"r\.trec:1: score is NaN"),
    ("q Q0 d 1 0.5 t\n\nq Q0 d 2 0.4 t\n", r"r\.trec:3: document 'd' is listed twice"),
])
def test_read_names_file_and_line(tmp_path, text, match):
    (tmp_path / "r.trec").write_text(text)
    with pytest.raises(TrecFormatError, match=match):
        read_run(tmp_path / "r.trec")


def test_read_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_run(tmp_path / "none.trec")
