"""Resume that verifies (settings and data checked, every file under the checksum manifest, mid-epoch
checkpoints with --save-every, one log record per step) for CTD, TMRL and Re³, and the one relevance rule
(qrels score > 0) of every method's training data. Kills go through real processes."""
import dataclasses
import json
import os
import signal
import subprocess
import tempfile
import sys
import time

import pytest
import torch

from _ctd_helpers import small_dataset, tiny_model
from _tmrl_helpers import tiny_encoder, tiny_rows
from tempokern.datasets import Query, Record, RetrievalDataset
from tempokern.datasets.base import is_relevant
from tempokern.models.checkpoint import CheckpointError
from tempokern.training import CTDConfig, CTDTrainer, train_ctd
from tempokern.training.resume import ResumeMismatch, load_state, truncate_log
from tempokern.training.tmrl import TMRLConfig, TMRLTrainer, train_tmrl

pytest.importorskip("transformers")

TINY = ["--tiny-hidden", "32", "--tiny-layers", "1", "--max-length", "32", "--no-progress", "--batch-size", "8"]
QUIET = dict(log=lambda *a: None)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _root():
    import tempokern
    return os.path.dirname(os.path.dirname(os.path.abspath(tempokern.__file__)))


#: the working directory of every child process: not the checkout, whose unbuilt tempokern/ would shadow the
#: installed package (`python -m` puts the working directory first on sys.path)
NEUTRAL = tempfile.gettempdir()


def _env():
    return dict(os.environ, PYTHONPATH=_root() + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _steps(log_path):
    return [json.loads(l)["step"] for l in open(log_path) if l.strip() and json.loads(l).get("event") == "step"]


def _same_weights(a_dir, b_dir, name="model.safetensors"):
    from safetensors.torch import load_file
    a, b = load_file(str(a_dir / name)), load_file(str(b_dir / name))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- CLI: settings and data checked -------------------------------------------------------------------------

def _beir(d, n_docs=6):
    (d / "qrels").mkdir(parents=True, exist_ok=True)
    (d / "corpus.jsonl").write_text("\n".join(json.dumps({"_id": f"d{i}", "text": f"In {2000 + i} event {i}"})
                                              for i in range(n_docs)))
    (d / "queries.jsonl").write_text("\n".join(json.dumps({"_id": f"q{i}", "text": f"event {i} of {2000 + i}?"})
                                               for i in range(6)))
    (d / "qrels" / "train.tsv").write_text("".join(f"q{i}\td{i}\t1\n" for i in range(6)))


def test_cli_resume_with_other_settings_names_them(tmp_path, capsys):
    from tempokern.cli import main
    out = tmp_path / "run"
    base = ["train", "--dataset", "zztj", "--epochs", "1", "--max-steps", "2", "--out", str(out), *TINY]
    assert main(base) == 0
    before = (out / "last" / "model.safetensors").read_bytes()
    capsys.readouterr()
    argv = ["train", "--dataset", "zztj", "--epochs", "1", "--max-steps", "2", "--out", str(out),
            *[a if a != "8" else "4" for a in TINY], "--resume", "--variant", "baseline", "--lr", "0.9"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "cannot resume" in err and "variant: 'full' -> 'baseline'" in err and "lr: 0.003 -> 0.9" in err \
        and "batch_size: 8 -> 4" in err and "--resume-anyway" in err
    assert (out / "last" / "model.safetensors").read_bytes() == before      # nothing trained, nothing saved
    # settings that may change on resume: --no-progress (already given), --max-steps, --epochs, --save-every
    assert main(base[:-len(TINY)] + TINY + ["--resume", "--max-steps", "3", "--save-every", "5"]) == 0
    assert _steps(out / "log.jsonl") == [1, 2, 3]
    # the override continues, saying what differs
    assert main(argv[:-4] + ["--variant", "baseline", "--max-steps", "4", "--resume", "--resume-anyway"]) == 0
    cap = capsys.readouterr()
    assert "resuming anyway" in cap.out + cap.err and "variant: 'full' -> 'baseline'" in cap.out + cap.err
    assert main(base + ["--resume-anyway"]) == 2            # only with --resume


def test_cli_resume_after_adding_a_document_names_the_data_change(tmp_path, capsys):
    from tempokern.cli import main
    data = tmp_path / "beir"
    _beir(data)
    out = tmp_path / "run"
    base = ["train", "--data", str(data), "--format", "beir", "--epochs", "1", "--batch-size", "2", "--out", str(out),
            "--tiny-hidden", "32", "--tiny-layers", "1", "--max-length", "32", "--no-progress"]
    assert main(base) == 0
    tok_before = (out / "last" / "tokenizer").exists() and sorted(p.name for p in (out / "last").iterdir())
    with open(data / "corpus.jsonl", "a") as f:
        f.write("\n" + json.dumps({"_id": "d9", "text": "Quixotic zebra of 2031"}))
    capsys.readouterr()
    assert main(base + ["--resume", "--epochs", "2"]) == 1
    err = capsys.readouterr().err
    assert "data changed: 1 records added (6 -> 7)" in err and "tokenizer vocabulary changed" in err
    assert sorted(p.name for p in (out / "last").iterdir()) == tok_before
    assert load_state(out / "last" / "trainer_state.pt")["data"]["records"]["count"] == 6   # the old run's state


def test_cli_kill_mid_epoch_and_resume_is_bit_identical(tmp_path):
    """SIGKILL a real training process after some steps (mid-epoch, --save-every 4), resume: the same final
    weights as an uninterrupted run, and a log with one record per step."""
    from tempokern.cli import main
    args = ["train", "--dataset", "zztj", "--epochs", "2", "--save-every", "4", *TINY]
    assert main(args + ["--out", str(tmp_path / "full")]) == 0
    n = len(_steps(tmp_path / "full" / "log.jsonl"))
    assert n > 20
    out = tmp_path / "cut"
    p = subprocess.Popen([sys.executable, "-m", "tempokern", *args, "--out", str(out)], env=_env(), cwd=NEUTRAL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None:
            if (out / "log.jsonl").exists() and len(_steps(out / "log.jsonl")) >= 10:
                break
            time.sleep(0.005)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait()
    assert p.returncode == -signal.SIGKILL
    done = len(_steps(out / "log.jsonl"))
    st = load_state(out / "last" / "trainer_state.pt")
    assert not st["epoch_done"] and st["step"] % 4 == 0 and st["step"] < done < n   # a mid-epoch checkpoint
    (out / ".tempokern.lock").unlink(missing_ok=True)   # (a dead pid's lock is taken over anyway)
    r = subprocess.run([sys.executable, "-m", "tempokern", *args, "--out", str(out), "--resume"], env=_env(),
                       cwd=NEUTRAL, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"batch {st['batch']}, step {st['step']}" in r.stdout + r.stderr
    _same_weights(tmp_path / "full" / "last", out / "last")
    _same_weights(tmp_path / "full" / "best", out / "best")
    assert _steps(out / "log.jsonl") == list(range(1, n + 1))


def test_truncate_log_keeps_records_up_to_the_step(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"event": "step", "step": 1}\n{"event": "eval", "step": 1}\n{"event": "step", "step": 2}\n'
                   '{"event": "note"}\n{"event": "step", "st')
    assert truncate_log(log, 1) == 2
    assert [json.loads(l) for l in log.read_text().splitlines()] == [
        {"event": "step", "step": 1}, {"event": "eval", "step": 1}, {"event": "note"}]


# ---- CTD / TMRL in process: the check, and mid-epoch resume after a kill right after a checkpoint ------------

class _Killed(Exception):
    pass


def _kill_after_save(trainer, at_step):
    """Make `trainer` stop (as a kill would) right after its mid-epoch checkpoint at `at_step`."""
    orig = trainer._save_state

    def save(where, opt, sched, scaler, epoch, batch, epoch_done, step, *rest):
        orig(where, opt, sched, scaler, epoch, batch, epoch_done, step, *rest)
        if step == at_step:
            raise _Killed
    trainer._save_state = save


def test_ctd_mid_epoch_resume_bit_identical_and_checks(tmp_path):
    ds = small_dataset()
    cfg = CTDConfig(variant="full", epochs=2, batch_size=8, lr=3e-3, progress=False, seed=3, save_every=1)
    full = CTDTrainer(tiny_model(ds, seed=1), ds, cfg, tmp_path / "a", **QUIET)
    full.fit()
    nb = full.num_batches()
    assert nb > 4
    cut = CTDTrainer(tiny_model(ds, seed=1), ds, cfg, tmp_path / "b", **QUIET)
    _kill_after_save(cut, nb + 3)          # step nb + 3: batch 3 of epoch 2
    with pytest.raises(_Killed):
        cut.fit()
    with open(tmp_path / "b" / "log.jsonl", "a") as f:   # a step logged after the checkpoint, then the kill
        f.write(json.dumps({"event": "step", "step": nb + 4}) + "\n")
    with pytest.raises(ResumeMismatch, match=r"lr: 0\.003 -> 0\.01.*variant: 'full' -> 'baseline'"):
        train_ctd(tiny_model(ds, seed=1), ds, dataclasses.replace(cfg, lr=0.01, variant="baseline"), tmp_path / "b",
                  resume=True, **QUIET)
    fewer = RetrievalDataset(ds.name, ds.records[:-1], ds.queries, calendar=ds.calendar)
    with pytest.raises(ResumeMismatch, match="data changed: 1 records removed"):
        train_ctd(tiny_model(ds, seed=1), fewer, cfg, tmp_path / "b", resume=True, **QUIET)
    res = train_ctd(tiny_model(ds, seed=2), ds, dataclasses.replace(cfg, save_every=None), tmp_path / "b",
                    resume=True, **QUIET)
    assert res.steps == 2 * nb
    _same_weights(tmp_path / "a" / "last", tmp_path / "b" / "last")
    assert _steps(tmp_path / "b" / "log.jsonl") == list(range(1, 2 * nb + 1))
    # a flipped byte in the weights or the trainer state: a checksum error naming the file
    for name in ("model.safetensors", "trainer_state.pt"):
        f = tmp_path / "b" / "last" / name
        good = f.read_bytes()
        f.write_bytes(good[:-9] + bytes([good[-9] ^ 1]) + good[-8:])
        with pytest.raises(CheckpointError, match=f"{f} does not match its checksum"):
            train_ctd(tiny_model(ds, seed=1), ds, dataclasses.replace(cfg, epochs=3), tmp_path / "b", resume=True,
                      **QUIET)
        f.write_bytes(good)


def test_tmrl_mid_epoch_resume_bit_identical_and_checks(tmp_path):
    pytest.importorskip("peft")
    rows = tiny_rows()
    cfg = TMRLConfig(batch_size=6, epochs=2, lr=3e-3, hard_negatives=2, negative_queries=2, t=8, alpha=0.25,
                     progress=False, warmup_ratio=0.0, seed=0, save_every=2)
    m_full = tiny_encoder(rows, lora=None, seed=5)
    full = train_tmrl(m_full, rows, cfg, tmp_path / "a", **QUIET)
    nb = len(full.history) // 2
    assert nb >= 3
    cut = TMRLTrainer(tiny_encoder(rows, lora=None, seed=5), rows, cfg, tmp_path / "b", **QUIET)
    _kill_after_save(cut, 2)               # step 2 of epoch 1 (dropout on: the RNG state is resumed)
    with pytest.raises(_Killed):
        cut.fit()
    with pytest.raises(ResumeMismatch, match=r"batch_size: 6 -> 4"):
        train_tmrl(tiny_encoder(rows, lora=None, seed=5), rows, dataclasses.replace(cfg, batch_size=4),
                   tmp_path / "b", resume=True, **QUIET)
    with pytest.raises(ResumeMismatch, match="data changed: 1 rows removed"):
        train_tmrl(tiny_encoder(rows, lora=None, seed=5), rows[:-1], cfg, tmp_path / "b", resume=True, **QUIET)
    m_res = tiny_encoder(rows, lora=None, seed=6)
    res = train_tmrl(m_res, rows, cfg, tmp_path / "b", resume=True, **QUIET)
    assert [h["loss"] for h in res.history] == [h["loss"] for h in full.history]
    assert all(torch.equal(a, b) for a, b in zip(m_full.state_dict().values(), m_res.state_dict().values()))
    assert _steps(tmp_path / "b" / "log.jsonl") == list(range(1, 2 * nb + 1))


# ---- Re³: the trainer state under the manifest ---------------------------------------------------------------

def _re3_setup():
    from test_training_re3 import _loss, _model, toy_dataset
    from tempokern.models import build_char_tokenizer, tiny_bert
    from tempokern.training.re3 import Re3Config, docs_from_dataset, examples_from_dataset
    ds = toy_dataset()
    tok = build_char_tokenizer([r.text for r in ds.records] + [q.text for q in ds.queries])
    bb = tiny_bert(len(tok), hidden=32, layers=1, heads=2, intermediate=64, max_position=96, seed=0)
    cfg = Re3Config(variant="film_margins", epochs=2, batch_size=8, lr=3e-3, progress=False, save_every=2)

    def model(tokbb, cfg):
        torch.manual_seed(0)          # the time modules' initial weights come from the global RNG
        return _model(tokbb, cfg)
    return ds, (tok, bb), cfg, docs_from_dataset(ds), examples_from_dataset(ds), model, _loss


def test_re3_mid_epoch_resume_and_damaged_state(tmp_path):
    from tempokern.training.re3 import Re3Trainer, train_re3
    ds, tokbb, cfg, docs, ex, _model, _loss = _re3_setup()
    full = _model(tokbb, cfg)
    r_full = train_re3(full, docs, ex, cfg, tmp_path / "a", loss_fn=_loss(cfg), **QUIET)
    cut = Re3Trainer(_model(tokbb, cfg), docs, ex, cfg, tmp_path / "b", loss_fn=_loss(cfg), **QUIET)
    orig = cut._save_state

    def save(opt, sched, epoch, batch, epoch_done, step, *rest):
        orig(opt, sched, epoch, batch, epoch_done, step, *rest)
        if step == 2:
            raise _Killed
    cut._save_state = save
    with pytest.raises(_Killed):
        cut.fit()
    last = tmp_path / "b" / "last"
    assert sorted(p.name for p in last.iterdir()) == ["checksums.json", "trainer_state.pt"]
    with pytest.raises(ResumeMismatch, match=r"lr: 0\.003 -> 0\.01"):
        train_re3(_model(tokbb, cfg), docs, ex, dataclasses.replace(cfg, lr=0.01), tmp_path / "b",
                  loss_fn=_loss(cfg), resume=True, **QUIET)
    with pytest.raises(ResumeMismatch, match="data changed: 1 examples removed"):
        train_re3(_model(tokbb, cfg), docs, ex[:-1], cfg, tmp_path / "b", loss_fn=_loss(cfg), resume=True, **QUIET)
    fresh = _model(tokbb, cfg)
    with torch.no_grad():                # other initial time modules: the checkpoint must win
        for p in list(fresh.film.parameters()) + list(fresh.time_embed.parameters()):
            p.add_(0.5)
    r = train_re3(fresh, docs, ex, cfg, tmp_path / "b", loss_fn=_loss(cfg), resume=True, **QUIET)
    assert r.steps == r_full.steps and [h["loss"] for h in r.history] == [h["loss"] for h in r_full.history]
    for a, b in zip(full.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert _steps(tmp_path / "b" / "log.jsonl") == list(range(1, r_full.steps + 1))
    # a flipped byte, then a truncation, of the trainer state: a checksum error naming the file
    st = last / "trainer_state.pt"
    good = st.read_bytes()
    for bad in (good[:100] + bytes([good[100] ^ 1]) + good[101:], good[:len(good) // 2]):
        st.write_bytes(bad)
        with pytest.raises(CheckpointError, match=f"{st}.*(checksum|truncated)"):
            train_re3(_model(tokbb, cfg), docs, ex, cfg, tmp_path / "b", loss_fn=_loss(cfg), resume=True, **QUIET)
    # a state that passes its manifest but is not a tensor-only pickle: refused by weights_only, naming the file
    import io
    from tempokern.models.checkpoint import write_manifest
    buf = io.BytesIO()
    import datetime
    torch.save({"format": "tempokern-trainer-state", "x": datetime.date(2020, 1, 1)}, buf)
    st.write_bytes(buf.getvalue())
    write_manifest(last)
    with pytest.raises(CheckpointError, match=f"{st} cannot be read"):
        load_state(st)


# ---- relevance: score > 0, one rule ---------------------------------------------------------------------------

def test_is_relevant_and_relevant_ids():
    assert [is_relevant(s) for s in (2, 1, 0, -1)] == [True, True, False, False]
    assert Query("q", "t", gold={"a": 0, "b": 2, "c": -1, "d": 1}).relevant_ids() == ["b", "d"]


def _unjudged(ds, scores=(0, -1)):
    """`ds` with every train query's qrels scores replaced by 0 / -1 (judged not relevant)."""
    qs = [dataclasses.replace(q, gold={d: scores[i % len(scores)] for i, d in enumerate(q.gold)})
          if q.split == "train" else q for q in ds.queries]
    return RetrievalDataset(ds.name, ds.records, qs, calendar=ds.calendar)


def test_ctd_refuses_train_qrels_all_not_relevant():
    ds = _unjudged(small_dataset())
    with pytest.raises(ValueError, match="0 training"):
        CTDTrainer(tiny_model(ds), ds, CTDConfig(batch_size=8, progress=False), **QUIET)


def test_tmrl_refuses_train_qrels_all_not_relevant():
    from tempokern.datasets.tmrl import rows_from_dataset
    ds = _unjudged(small_dataset())
    with pytest.raises(ValueError, match="no query with gold records in split 'train'"):
        rows_from_dataset(ds, "train", hard_negatives=0, negative_queries=0)
    # a query with one relevant and one not-relevant record trains on the relevant one only
    good = small_dataset()
    q = next(q for q in good.queries if q.split == "train" and len(q.gold) == 1)
    other = next(r.id for r in good.records if r.id not in q.gold and r.text.strip())
    mixed = RetrievalDataset(good.name, good.records, [dataclasses.replace(q, gold={**q.gold, other: 0})],
                             calendar=good.calendar)
    rows = rows_from_dataset(mixed, "train", hard_negatives=0, negative_queries=0).rows
    assert [r.meta["doc_id"] for r in rows] == list(q.gold)


def test_re3_refuses_train_qrels_all_not_relevant():
    from test_training_re3 import toy_dataset
    from tempokern.training.re3 import examples_from_dataset
    ds = toy_dataset()
    with pytest.raises(ValueError, match=r"no query with a relevant document \(qrels score > 0\)"):
        examples_from_dataset(_unjudged(ds), "train")
    # a query whose best-scored gold is 0 is skipped, never trained on
    qs = [dataclasses.replace(q, gold={d: 0 for d in q.gold}) if i == 0 else q for i, q in enumerate(ds.queries)]
    ex = examples_from_dataset(RetrievalDataset(ds.name, ds.records, qs), "train")
    assert ds.queries[0].text not in [e.query for e in ex]
    assert len(ex) == len(examples_from_dataset(ds, "train")) - 1


def test_suite_unit_with_an_unusable_state_trains_from_the_start(tmp_path):
    from tempokern.training.resume import resume_or_restart
    ds = small_dataset()
    cfg = CTDConfig(variant="full", epochs=1, batch_size=8, lr=3e-3, progress=False, seed=3, max_steps=3)
    train_ctd(tiny_model(ds, seed=1), ds, cfg, tmp_path / "a", **QUIET)
    train_ctd(tiny_model(ds, seed=1), ds, dataclasses.replace(cfg, max_steps=1), tmp_path / "b", **QUIET)
    st = tmp_path / "b" / "last" / "trainer_state.pt"
    st.write_bytes(st.read_bytes()[:-1])                 # truncated
    lines = []
    res, resumed = resume_or_restart(lambda r: train_ctd(tiny_model(ds, seed=1), ds, cfg, tmp_path / "b", resume=r,
                                                         **QUIET), tmp_path / "b", lines.append)
    assert not resumed and res.steps == 3 and f"{st} does not match its checksum" in lines[0]
    _same_weights(tmp_path / "a" / "last", tmp_path / "b" / "last")
    assert _steps(tmp_path / "b" / "log.jsonl") == [1, 2, 3]
    res, resumed = resume_or_restart(lambda r: train_ctd(tiny_model(ds, seed=1), ds, cfg, tmp_path / "b", resume=r,
                                                         **QUIET), tmp_path / "b", lines.append)
    assert resumed and res.steps == 3 and len(lines) == 1
