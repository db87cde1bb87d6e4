"""One writer per output folder (tempokern._lock), fresh runs into used folders (train --overwrite / refusal),
and the temporary files of interrupted saves (tempokern._files): through real processes where a second
process or a kill is involved."""
import json
import os
import signal
import subprocess
import tempfile
import sys
import time

import pytest

from tempokern._files import RUN_OUTPUTS, clear_run_outputs, host_name, sweep_tmp, tmp_prefix
from tempokern._lock import LOCK_NAME, OutputInUse, output_lock, read_lock

TINY = ["--tiny-hidden", "32", "--tiny-layers", "1", "--max-length", "32", "--no-progress", "--batch-size", "8"]


def _root():
    import tempokern
    return os.path.dirname(os.path.dirname(os.path.abspath(tempokern.__file__)))


#: the working directory of every child process: not the checkout, whose unbuilt tempokern/ would shadow the
#: installed package (`python -m` puts the working directory first on sys.path)
NEUTRAL = tempfile.gettempdir()


def _env():
    return dict(os.environ, PYTHONPATH=_root() + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _cli(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "tempokern", *argv], capture_output=True, text=True, env=_env(),
                          cwd=cwd or NEUTRAL, timeout=300)


def _dead_pid():
    """The id of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _holder(folder):
    """A second process holding `folder`'s lock until killed."""
    code = ("import sys, time\nfrom tempokern._lock import output_lock\n"
            f"with output_lock({str(folder)!r}, 'tempokern holder-test'):\n"
            "    print('held', flush=True)\n    time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env(), cwd=NEUTRAL)
    assert p.stdout.readline().strip() == "held"
    return p


# ---- the lock ------------------------------------------------------------------------------------------

def test_lock_in_process(tmp_path):
    d = tmp_path / "out"
    with output_lock(d, "tempokern train --out out") as lk:
        info = read_lock(d / LOCK_NAME)
        assert info["pid"] == os.getpid() and info["host"] == host_name()
        assert info["command"] == "tempokern train --out out" and info["started"]
        assert lk.held
    assert not (d / LOCK_NAME).exists()
    assert not [p for p in d.iterdir()]     # no temporary file of the lock left


def test_second_writer_fails_naming_the_holder(tmp_path, capsys):
    from tempokern.cli import main
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        with pytest.raises(OutputInUse, match=f"pid {holder.pid} on host"):
            output_lock(out, "x").acquire()
        r = _cli("train", "--dataset", "zztj", "--epochs", "1", "--max-steps", "1", "--out", str(out), *TINY)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        assert f"pid {holder.pid}" in r.stderr and "holder-test" in r.stderr and "in use" in r.stderr
        assert not (out / "best").exists() and not (out / "log.jsonl").exists()
        for argv in (["data", "timeqa", "--negatives", "0"], ["benchmark", "--report-only"],
                     ["demo", "--suite", "english", "--report-only"], ["bench", "--sizes", "8"]):      # the holder is another process
            capsys.readouterr()
            assert main(argv + ["--out", str(out)]) == 1
            assert f"pid {holder.pid}" in capsys.readouterr().err
        assert not (out / "corpus.jsonl").exists() and not (out / "results.json").exists()
        assert not (out / "bench.json").exists() and not (out / "bench.md").exists()
    finally:
        holder.kill()
        holder.wait()


def test_index_lock_is_next_to_the_index_file(tmp_path):
    idx = tmp_path / "g.idx"
    holder_code = ("import time\nfrom tempokern._lock import OutputLock\n"
                   f"with OutputLock({str(idx) + '.lock'!r}, 'tempokern index'):\n"
                   "    print('held', flush=True)\n    time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", holder_code], stdout=subprocess.PIPE, text=True, env=_env(),
                         cwd=NEUTRAL)
    try:
        assert p.stdout.readline().strip() == "held"
        r = _cli("index", "--model", str(tmp_path / "missing"), "--dataset", "zztj", "--out", str(idx))
        assert r.returncode == 1 and f"pid {p.pid}" in r.stderr
    finally:
        p.kill()
        p.wait()


def test_stale_lock_of_a_killed_run_is_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    pid = _dead_pid()
    (out / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host_name(), "started": "2026-01-01T00:00:00+00:00",
                                             "command": "tempokern train --out run"}))
    r = _cli("train", "--dataset", "zztj", "--epochs", "1", "--max-steps", "1", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    assert "taking over the stale lock" in r.stderr and f"pid {pid}" in r.stderr
    assert (out / "best").is_dir() and not (out / LOCK_NAME).exists()


def test_a_lock_from_another_host_is_not_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"pid": _dead_pid(), "host": "elsewhere", "started": "x",
                                             "command": "tempokern train"}))
    with pytest.raises(OutputInUse, match="on host elsewhere"):
        output_lock(out).acquire()
    assert (out / LOCK_NAME).exists()


def test_a_killed_train_leaves_a_lock_the_next_run_takes_over(tmp_path):
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "tempokern", "train", "--dataset", "zztj", "--epochs", "50",
                          "--out", str(out), *TINY], env=_env(), cwd=NEUTRAL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if (out / LOCK_NAME).exists():
                break
            time.sleep(0.1)
        assert read_lock(out / LOCK_NAME)["pid"] == p.pid
        r = _cli("train", "--dataset", "zztj", "--epochs", "1", "--out", str(out), *TINY)
        assert r.returncode == 1 and f"pid {p.pid}" in r.stderr
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert (out / LOCK_NAME).exists()     # SIGKILL: nothing removed it
    r = _cli("train", "--dataset", "zztj", "--epochs", "1", "--max-steps", "1", "--out", str(out), "--overwrite", *TINY)
    assert r.returncode == 0, r.stderr
    assert "taking over the stale lock" in r.stderr
    assert not (out / LOCK_NAME).exists()


# ---- a fresh run into a used folder --------------------------------------------------------------------

def _log_lines(out):
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if x.strip()]


def test_train_into_a_used_folder_refuses_or_starts_clean(tmp_path):
    from tempokern.cli import main
    out = tmp_path / "run"
    base = ["train", "--dataset", "zztj", "--epochs", "1", "--max-steps", "2", "--out", str(out), *TINY]
    assert main(base) == 0
    n_log = len(_log_lines(out))
    first = (out / "best" / "model.safetensors").read_bytes()
    assert main(base + ["--seed", "3"]) == 2        # refused before any work: the folder is untouched
    assert (out / "best" / "model.safetensors").read_bytes() == first and len(_log_lines(out)) == n_log
    assert main(base + ["--seed", "3", "--overwrite"]) == 0
    assert (out / "best" / "model.safetensors").read_bytes() != first
    assert len(_log_lines(out)) == n_log             # the log holds this run only
    assert main(base + ["--resume", "--overwrite"]) == 2


def test_cli_refusal_message(tmp_path):
    out = tmp_path / "run"
    (out / "best").mkdir(parents=True)
    (out / "log.jsonl").write_text("{}\n")
    r = _cli("train", "--dataset", "zztj", "--epochs", "1", "--out", str(out), *TINY)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "holds a previous run (best, log.jsonl)" in r.stderr and "--resume" in r.stderr \
        and "--overwrite" in r.stderr


def _untimed_dev_less_beir(d, shift=0):
    (d / "qrels").mkdir(parents=True)
    (d / "corpus.jsonl").write_text("\n".join(json.dumps({"_id": f"d{i}", "text": f"In {2000 + i} event {i + shift}"})
                                              for i in range(6)))
    (d / "queries.jsonl").write_text("\n".join(json.dumps({"_id": f"q{i}", "text": f"event {i} of {2000 + i}?"})
                                               for i in range(6)))
    (d / "qrels" / "train.tsv").write_text("".join(f"q{i}\td{i}\t1\n" for i in range(6)))


def test_no_dev_split_best_is_this_runs_final_model(tmp_path):
    """Without a dev split the final weights are the model: also after --overwrite of an older run and after
    --resume (never a previous run's best/)."""
    from tempokern.cli import main
    from tempokern.models import CTDEncoder
    import torch
    data = tmp_path / "beir"
    _untimed_dev_less_beir(data)
    out = tmp_path / "run"
    base = ["train", "--data", str(data), "--format", "beir", "--epochs", "1", "--batch-size", "2", "--out", str(out),
            "--tiny-hidden", "32", "--tiny-layers", "1", "--max-length", "32", "--no-progress"]
    assert main(base + ["--seed", "0"]) == 0
    assert main(base + ["--seed", "1", "--overwrite"]) == 0
    best, last = CTDEncoder.load(out / "best"), CTDEncoder.load(out / "last")
    for (k, a), (_, b) in zip(best.state_dict().items(), last.state_dict().items()):
        assert torch.equal(a, b), k
    assert main(base + ["--seed", "1", "--resume", "--epochs", "2"]) == 0
    best, last = CTDEncoder.load(out / "best"), CTDEncoder.load(out / "last")
    assert all(torch.equal(a, b) for a, b in zip(best.state_dict().values(), last.state_dict().values()))


def test_clear_run_outputs_touches_only_run_outputs(tmp_path):
    for n in ("best", "last", "model"):
        (tmp_path / n).mkdir()
    (tmp_path / ".last.tmp-h-1-x").mkdir()
    (tmp_path / ".best.old").mkdir()
    for n in ("log.jsonl", "summary.json", "notes.txt", ".tempokern.lock"):
        (tmp_path / n).write_text("x")
    gone = clear_run_outputs(tmp_path)
    assert set(gone) == set(RUN_OUTPUTS) | {".last.tmp-h-1-x", ".best.old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tempokern.lock", "notes.txt"]


# ---- no litter ----------------------------------------------------------------------------------------

def _killed_while_saving(parent, name, *, directory: bool):
    """A real process that creates the temporary sibling of `name` as a save does, then is SIGKILLed."""
    make = "tempfile.mkdtemp" if directory else "tempfile.mkstemp"
    code = (f"import os, signal, tempfile\nfrom tempokern._files import tmp_prefix\n"
            f"{make}(prefix=tmp_prefix({name!r}), dir={str(parent)!r})\nos.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=NEUTRAL)
    assert p.returncode == -signal.SIGKILL
    left = [x for x in parent.iterdir() if x.name.startswith(f".{name}.tmp-")]
    assert len(left) == 1
    return left[0]


def test_interrupted_checkpoint_save_is_removed_by_the_next_save_and_load(tmp_path):
    from tempokern.cli import main
    from tempokern.models import CTDEncoder
    out = tmp_path / "run"
    assert main(["train", "--dataset", "zztj", "--epochs", "1", "--max-steps", "1", "--out", str(out), *TINY]) == 0
    left = _killed_while_saving(out, "last", directory=True)
    live = out / (tmp_prefix("last") + "live")          # this (live) process's: left alone
    live.mkdir()
    m = CTDEncoder.load(out / "last")
    assert not left.exists() and live.exists()
    left = _killed_while_saving(out, "best", directory=True)
    m.save(out / "best")
    assert not left.exists()
    live.rmdir()


def test_interrupted_index_save_is_removed_by_the_next_save_and_load(tmp_path):
    import torch
    from tempokern.search import TemporalIndex
    ix = TemporalIndex(4)
    ix.add(torch.arange(3), torch.randn(3, 4), torch.rand(3))
    path = tmp_path / "g.idx"
    ix.save(path)
    left = _killed_while_saving(tmp_path, "g.idx", directory=False)
    TemporalIndex.load(path)
    assert not left.exists()
    left = _killed_while_saving(tmp_path, "g.idx", directory=False)
    ix.save(path)
    assert not left.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.idx"]


def test_sweep_leaves_other_hosts_and_unrelated_files(tmp_path):
    target = tmp_path / "best"
    other = tmp_path / f".best.tmp-otherhost-{_dead_pid()}-x"
    other.mkdir()
    unrelated = tmp_path / ".bestx.tmp-h-1-x"
    unrelated.mkdir()
    mine_dead = tmp_path / f".best.tmp-{host_name()}-{_dead_pid()}-y"
    mine_dead.write_text("x")
    assert sweep_tmp(target) == [mine_dead]
    assert other.exists() and unrelated.exists()
