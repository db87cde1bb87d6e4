"""benchmarks/gpu_suite.py in its --device cpu mode: tiny sizes on the CPU kernels, seconds. What runs on the
GPU is the same code with other sizes; these tests check the machinery: the CSV, agreement, unsupported
keywords, out-of-memory handling, skips, and the clear error without CUDA."""
from __future__ import annotations

import csv
import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tempokern
from tempokern import reference

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = mod   # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("gpu_suite", None)


def run(suite, tmp_path, *extra):
    csv_path, md_path = suite.main(["--device", "cpu", "--csv", str(tmp_path / "gpu.csv"), "--md",
                                    str(tmp_path / "gpu.md"), "--repeats", "1", "--measure-s", "0", *extra])
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    return rows, md_path.read_text()


def pick(rows, op=None, case=None, size=None, impl=None, metric=None):
    return [r for r in rows if (op is None or r["op"] == op) and (case is None or r["case"] == case)
            and (size is None or r["B"] == size) and (impl is None or r["impl"] == impl)
            and (metric is None or r["metric"] == metric)]


def one(rows, **kw):
    got = pick(rows, **kw)
    assert len(got) == 1, (kw, got)
    return got[0]


def test_end_to_end_csv_agreement_and_tables(suite, tmp_path):
    rows, md = run(suite, tmp_path, "--compile-backend", "aot_eager", "--only",
                   r"multipos_infonce/no bias/B=48|ctd_topk/exact bias/Q=8|calendar_scalar|offset_bias/exact fwd\+bwd")
    assert rows and list(rows[0]) == suite.FIELDS
    assert {r["impl"] for r in rows} <= set(suite.IMPLS)
    for r in rows:   # run metadata on every row
        assert r["device"] and r["date"] and r["commit"]
    assert len({(r["date"], r["device"], r["commit"]) for r in rows}) == 1
    # one row per (op, case, B, impl, metric)
    keys = [(r["op"], r["case"], r["B"], r["impl"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys))
    loss = dict(op="multipos_infonce", case="no bias", size="B=48")
    for impl in ("tempokern", "eager", "compile", "matmul"):
        assert one(rows, **loss, impl=impl, metric="status")["value"] == "ok"
        assert float(one(rows, **loss, impl=impl, metric="time_ms")["value"]) > 0
    assert float(one(rows, **loss, impl="compile", metric="compile_s")["value"]) > 0
    # torch.compile with the auto-chunker is a column of its own (the aot_eager backend here ignores the option)
    assert one(rows, **loss, impl="compile_autochunk", metric="status")["value"] == "ok"
    assert float(one(rows, **loss, impl="tempokern", metric="floor_ms")["value"]) == pytest.approx(
        4 * float(one(rows, **loss, impl="matmul", metric="time_ms")["value"]), rel=1e-4)
    # agreement of the loss and every gradient, for tempokern and eager torch; the ratio between them
    for impl in ("tempokern", "eager"):
        for q in ("loss", "grad q", "grad d"):
            a = float(one(rows, **loss, impl=impl, metric=f"agreement_abs:{q}")["value"])
            assert math.isfinite(a) and a >= 0
    eager_loss_err = float(one(rows, **loss, impl="eager", metric="agreement_rel:loss")["value"])
    assert 0 < eager_loss_err < 0.05   # bf16 vs float64: small but not zero
    assert math.isfinite(float(one(rows, **loss, impl="tempokern", metric="err_vs_torch")["value"]))
    # the bias case carries all seven bias gradients (offset_bias fwd+bwd, float32)
    ob = dict(op="offset_bias", case="exact fwd+bwd float32", size="80x80")
    for n in suite.BIAS_NAMES:
        assert float(one(rows, **ob, impl="tempokern", metric=f"agreement_rel:grad {n}")["value"]) < 1e-3
    assert float(one(rows, **ob, impl="tempokern", metric="agreement")["value"]) < 1e-3
    # top-k: indices against the float64 reference
    tk_rows = dict(op="ctd_topk", case="exact bias", size="Q=8 N=3000 k=10")
    assert float(one(rows, **tk_rows, impl="tempokern", metric="topk_index_match")["value"]) == 1.0
    assert float(one(rows, **tk_rows, impl="tempokern", metric="agreement_abs:values")["value"]) < 1e-3
    for impl in ("eager", "eager_chunked", "matmul"):
        assert one(rows, **tk_rows, impl=impl, metric="status")["value"] == "ok"
    assert one(rows, op="calendar_scalar", impl="compile", metric="status")["value"] == "ok"
    # markdown: one table per op and the Targets table
    for op in ("multipos_infonce", "ctd_topk", "calendar_scalar", "offset_bias"):
        assert f"## {op}" in md
    assert "## Targets" in md and "<= 1.5 ms" in md and "not measured" in md


def test_agreement_is_computed_not_assumed(suite, tmp_path, monkeypatch):
    """tempokern replaced by plain torch: the same error as eager (ratio 1); replaced by a 0.1% wrong
    result: an error far above float32's and a ratio far above the 2x rule."""
    monkeypatch.setattr(tempokern, "calendar_scalar", reference.calendar_scalar)
    rows, _ = run(suite, tmp_path / "same", "--no-compile", "--only", "calendar_scalar")
    assert float(one(rows, impl="tempokern", metric="err_vs_torch")["value"]) == 1.0
    monkeypatch.setattr(tempokern, "calendar_scalar", lambda logits, tau=1.0: reference.calendar_scalar(logits) * 1.001)
    rows, _ = run(suite, tmp_path / "wrong", "--no-compile", "--only", "calendar_scalar")
    assert float(one(rows, impl="tempokern", metric="agreement_rel:out")["value"]) > 5e-4
    assert float(one(rows, impl="eager", metric="agreement_rel:out")["value"]) < 1e-5
    assert float(one(rows, impl="tempokern", metric="err_vs_torch")["value"]) > 10


def test_unsupported_keyword_is_a_row_not_a_crash(suite, tmp_path, monkeypatch):
    """A multipos_infonce without bias_table_points (a build without the table mode) and an
    offset_bias without table_points: status 'unsupported: ...'; eager and the rest still run."""
    real = tempokern.multipos_infonce

    def old(q, d, q_span, d_span, *, temperature, bias=None, extra_neg=None, symmetric=True):
        return real(q, d, q_span, d_span, temperature=temperature, bias=bias, extra_neg=extra_neg, symmetric=symmetric)

    def old_bias(u_q, u_d, w1, b1, w2, b2, scale):
        return reference.offset_bias(u_q, u_d, w1, b1, w2, b2, scale)

    monkeypatch.setattr(tempokern, "multipos_infonce", old)
    monkeypatch.setattr(tempokern, "offset_bias", old_bias)
    rows, md = run(suite, tmp_path, "--no-compile", "--only", "multipos_infonce/table|offset_bias/table")
    st = one(rows, op="multipos_infonce", impl="tempokern", metric="status")["value"]
    assert st.startswith("unsupported:") and "bias_table_points" in st
    assert one(rows, op="multipos_infonce", impl="eager", metric="status")["value"] == "ok"
    assert "unsupported" in one(rows, op="multipos_infonce", impl="tempokern", metric="agreement")["note"]
    assert float(one(rows, op="multipos_infonce", impl="eager", metric="agreement_rel:loss")["value"]) < 0.05
    for case in ("table (4097) fwd float32", "table (4097) fwd+bwd float32"):
        st = one(rows, op="offset_bias", case=case, impl="tempokern", metric="status")["value"]
        assert st.startswith("unsupported:") and "table_points" in st
        assert one(rows, op="offset_bias", case=case, impl="eager", metric="status")["value"] == "ok"
    assert "unsupported" in md


def test_out_of_memory_is_reported_and_the_suite_goes_on(suite, tmp_path, monkeypatch):
    real = reference.multipos_infonce
    calls = []

    def oom(q, *a, **k):
        if q.dtype != torch.float64:   # the float64 agreement reference still runs
            calls.append(q.shape[0])
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB (simulated)")
        return real(q, *a, **k)

    monkeypatch.setattr(reference, "multipos_infonce", oom)
    freed = []
    monkeypatch.setattr(suite, "free_memory", lambda dev, collect=False: freed.append(collect))
    rows, _ = run(suite, tmp_path, "--no-compile", "--only", "multipos_infonce/no bias/|ctd_topk/no bias")
    assert calls
    for size in ("B=48", "B=96"):
        assert one(rows, case="no bias", size=size, impl="eager", metric="status")["value"] == "out of memory"
        assert one(rows, case="no bias", size=size, impl="tempokern", metric="status")["value"] == "ok"
        assert "out of memory" in one(rows, size=size, impl="eager", metric="agreement")["note"]
    assert any(freed)   # memory released, with the cycle collector, after the failure
    assert one(rows, op="ctd_topk", impl="tempokern", metric="status")["value"] == "ok"


def test_time_budget_and_predicted_step_skips(suite, tmp_path):
    rows, md = run(suite, tmp_path / "budget", "--no-compile", "--budget-s", "0", "--only", "calendar")
    assert rows and all(r["value"].startswith("skipped: suite time budget") for r in pick(rows, metric="status"))
    assert "calendar_context" in md
    # any step predicted above --max-step-s from the previous size of its series is skipped, not run
    rows, _ = run(suite, tmp_path / "pred", "--no-compile", "--max-step-s", "0", "--only", "multipos_infonce/no bias/")
    assert one(rows, size="B=48", impl="tempokern", metric="status")["value"] == "ok"
    st = one(rows, size="B=96", impl="tempokern", metric="status")["value"]
    assert st.startswith("skipped: one step predicted")


def test_time_step_rotates_inputs_and_respects_the_budget(suite):
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    t = suite.time_step(fns, torch.device("cpu"), repeats=5, budget_s=60)
    assert t.runs == 5 and calls == [0, 1, 2, 0, 1, 2]   # warm-up on set 0, then the sets in turn
    slow = [lambda: time.sleep(0.05)]
    assert suite.time_step(slow, torch.device("cpu"), repeats=50, budget_s=0.1).runs <= 2
    # a slow first call (torch.compile compiling) does not cut the timed runs of a fast step
    first = []
    compiling = [lambda: first.append(1) or (time.sleep(0.3) if len(first) == 1 else None)]
    t = suite.time_step(compiling, torch.device("cpu"), repeats=5, budget_s=0.1)
    assert t.runs == 5 and t.warm_s >= 0.3 and t.ms < 100


def test_compare_relative_floor_for_zero_gradients(suite):
    f64 = dict(dtype=torch.float64)
    want = [("loss", torch.tensor(2.0, **f64)), ("grad a", torch.tensor([1.0, -4.0], **f64)),
            ("grad b", torch.zeros(2, **f64))]
    got = [("loss", torch.tensor(2.002)), ("grad a", torch.tensor([1.0, -4.004])),
           ("grad b", torch.tensor([0.0, 4e-4]))]
    r = suite.compare(got, want)
    assert r["loss"][0] == pytest.approx(0.002, rel=1e-3) and r["loss"][1] == pytest.approx(0.001, rel=1e-3)
    assert r["grad a"][1] == pytest.approx(0.001, rel=1e-3)
    assert r["grad b"][1] == pytest.approx(4e-4 / 4e-3, rel=1e-3)   # floored at 1e-3 of the largest gradient


def test_cuda_mode_without_a_cuda_build_is_a_clear_error(suite, tmp_path, capsys):
    if torch.cuda.is_available() and tempokern.build_info()["cuda_compiled"]:
        pytest.skip("this machine can run the GPU suite")
    with pytest.raises(SystemExit) as e:
        suite.main(["--csv", str(tmp_path / "out" / "gpu.csv")])
    assert e.value.code == 2
    msg = capsys.readouterr().err
    assert msg.startswith("gpu_suite:") and "CUDA" in msg
    assert not (tmp_path / "out").exists()   # nothing written before the check
    with pytest.raises(SystemExit) as e:
        suite.main(["--device", "cpu", "--csv", str(tmp_path / "out" / "gpu.csv"), "--only", "no-such-op"])
    assert e.value.code == 2 and "matches no case" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_targets_name_cases_of_the_full_suite(suite):
    """Every row of the Targets table matches a case of the full-size (GPU) suite, so the table can
    say met or not (building the cases allocates nothing)."""
    args = suite.parse_args([])
    keys = {(c.op, c.case, c.size) for c, _ in suite.build_cases(args, torch.device("cuda"), 3e12, lambda f: f)}
    for label, op, case, size, *_ in suite.TARGETS:
        assert (op, case, size) in keys, label
    sizes = {c.size for c, _ in suite.build_cases(args, torch.device("cuda"), 3e12, lambda f: f)}
    for want in ("B=8192", "B=65536", "B=262144", "Q=1024 N=1000000 k=10", "Q=1 N=1000000 k=10",
                 "Q=16 N=1000000 k=10", "rows=1048576 levels=12x32x12", "8192x8192"):
        assert want in sizes


class FakeCuda:
    """Just enough of torch.cuda for the suite's CUDA-only bookkeeping (events, peak memory, free memory,
    L2 size) to run on a machine without a GPU."""

    def __init__(self, free_bytes=80 << 30, l2=50 << 20):
        self.free, self.l2, self.allocated, self.peak, self.syncs = free_bytes, l2, 1 << 30, 0, 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                self.t = __import__("time").perf_counter()

            def elapsed_time(self, other):
                return (other.t - self.t) * 1e3

        self.Event = Event

    def install(self, monkeypatch):
        c = torch.cuda
        monkeypatch.setattr(c, "Event", self.Event)
        monkeypatch.setattr(c, "synchronize", lambda *a: setattr(self, "syncs", self.syncs + 1))
        monkeypatch.setattr(c, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(c, "reset_peak_memory_stats", lambda *a: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(c, "max_memory_allocated", lambda *a: self.peak)
        monkeypatch.setattr(c, "mem_get_info", lambda *a: (self.free, 80 << 30))
        monkeypatch.setattr(c, "empty_cache", lambda: None)
        monkeypatch.setattr(c, "get_device_name", lambda *a: "Fake GPU")
        monkeypatch.setattr(c, "get_device_properties",
                            lambda *a: type("P", (), {"L2_cache_size": self.l2, "multi_processor_count": 132})())


def test_cuda_bookkeeping_with_a_fake_device(suite, tmp_path, monkeypatch):
    fake = FakeCuda(free_bytes=40 << 30)
    fake.install(monkeypatch)
    dev = torch.device("cuda")

    def step():   # "allocates" 5 MiB above what was there
        fake.peak = max(fake.peak, fake.allocated + (5 << 20))
    t = suite.time_step([step, step], dev, repeats=4, budget_s=60)
    assert t.runs == 4 and t.peak_mb == pytest.approx(5.0) and t.ms >= 0 and fake.syncs >= 2 * 4
    # a fast step is also timed back to back (no synchronize between the steps): 30 steps, 2 more syncs
    calls, syncs = [], fake.syncs
    t = suite.time_step([lambda: calls.append(1)] * 2, dev, repeats=4, budget_s=60)
    assert t.pipelined_runs == suite.PIPELINE_STEPS and t.pipelined_ms is not None and t.pipelined_ms >= 0
    assert len(calls) == 1 + 4 + suite.PIPELINE_STEPS and fake.syncs - syncs == 2 + 2 * 4 + 2
    slow = suite.time_step([lambda: __import__("time").sleep(0.06)], dev, repeats=2, budget_s=60)
    assert slow.pipelined_ms is None and slow.pipelined_runs == 0   # over PIPELINE_MAX_MS: single steps only
    out = str(tmp_path / "gpu.csv")
    s = suite.Suite(suite.parse_args(["--csv", out]), ["benchmarks/gpu_suite.py", "--csv", out])
    assert s.meta["device"] == "Fake GPU" and str(s.csv_path) == out and s.md_path is None
    case = suite.Case("op", "c", "n", make=lambda seed: {"x": torch.empty(30 << 20, dtype=torch.uint8)},
                      steps={}, mem_bytes={"eager": 100 << 30, "compile": 1 << 30})
    why = s.skip_reason(case, "eager", 0)
    assert why.startswith("skipped: known to run out of memory") and "40 GiB free" in why
    assert s.skip_reason(case, "compile", 0) is None and s.skip_reason(case, "tempokern", 0) is None
    s.args.budget_s = 30   # no compilation starts in the budget's last 60 s; the fused op still runs
    assert "left for a compilation" in s.skip_reason(case, "compile", 0)
    assert s.skip_reason(case, "tempokern", 0) is None
    assert len(s.n_sets(case)) == 4            # 30 MiB a set vs 2 x 50 MiB of L2: rotate 4 copies
    fake.l2 = 20 << 20
    assert len(s.n_sets(case)) == 2            # 2 x 20 MiB: two copies of 30 MiB
    fake.l2 = 10 << 20
    assert len(s.n_sets(case)) == 1
    s._csv.close()


def test_candidate_columns_come_from_the_dispatch_table(suite, tmp_path, monkeypatch):
    """The tempokern columns of a case are the default ("tempokern") and "tempokern:<name>" for every candidate of
    tempokern._ops.dispatch.CANDIDATES whose ops include the case's op; TEMPOKERN_EXPERIMENTAL names the candidate
    during its calls only, and is empty during the default's."""
    from tempokern._ops import dispatch
    assert suite.IMPLS[0] == "tempokern"
    assert [i for i in suite.IMPLS if i.startswith("tempokern:")] == [f"tempokern:{c.name}" for c in dispatch.CANDIDATES]
    for op in ("multipos_infonce", "matryoshka_infonce", "calendar_context", "calendar_scalar", "ctd_topk",
               "offset_bias", "re3_loss"):
        want = [c.name for c in dispatch.CANDIDATES if op in {o.split(" / ")[0] for o in c.ops}]
        assert suite.candidates_for(op) == want
    args = suite.parse_args([])
    for c, _ in suite.build_cases(args, torch.device("cuda"), 3e12, lambda f: f):
        cols = [i for i in c.steps if i.startswith("tempokern:")]
        assert cols == [f"tempokern:{n}" for n in suite.candidates_for(c.op)], c.key
    assert not suite.candidates_for("ctd_topk") and suite.candidates_for("calendar_scalar") == ["calendar_v3"]

    seen = []
    real = tempokern.calendar_scalar

    def spy(*a, **k):
        seen.append(os.environ.get(dispatch.ENV))
        return real(*a, **k)

    monkeypatch.setenv(dispatch.ENV, "mpb_tc")   # the environment of the caller does not leak into a column
    monkeypatch.setattr(tempokern, "calendar_scalar", spy)
    rows, md = run(suite, tmp_path, "--no-compile", "--only", "calendar_scalar")
    impls = {r["impl"] for r in rows}
    assert impls == {"tempokern", "tempokern:calendar_v3", "eager", "compile", "compile_autochunk"}
    for impl in ("tempokern", "tempokern:calendar_v3"):
        assert one(rows, impl=impl, metric="status")["value"] == "ok"
        assert math.isfinite(float(one(rows, impl=impl, metric="err_vs_torch")["value"]))
    assert "tempokern:calendar_v3" in md
    assert set(seen) == {"", "calendar_v3"}
    assert os.environ[dispatch.ENV] == "mpb_tc"   # restored after each call


def test_rows_are_appended_to_one_csv(suite, tmp_path):
    """Two runs append to the same file under one header; a file with other columns is refused."""
    run(suite, tmp_path, "--no-compile", "--only", "calendar_scalar")
    rows, _ = run(suite, tmp_path, "--no-compile", "--only", "calendar_context")
    text = (tmp_path / "gpu.csv").read_text().splitlines()
    assert text[0] == ",".join(suite.FIELDS) and text.count(text[0]) == 1
    assert {r["op"] for r in rows} == {"calendar_scalar", "calendar_context"}
    (tmp_path / "old.csv").write_text("date,device,git_commit,size\n")
    with pytest.raises(SystemExit) as e:
        suite.main(["--device", "cpu", "--csv", str(tmp_path / "old.csv"), "--only", "calendar_scalar"])
    assert e.value.code == 2


def test_decision_cases(suite):
    """--decision keeps the cases that decide the candidates: the CTD loss without a bias, with one positive per
    row and with the table bias at B = 8,192 and 65,536, Matryoshka at 8,192, both calendar ops at 1M rows, Re3Loss at 8,192."""
    args = suite.parse_args(["--decision"])
    keys = {(c.op, c.case, c.size) for c, _ in suite.build_cases(args, torch.device("cuda"), 3e12, lambda f: f)}
    assert keys == {("multipos_infonce", "no bias", "B=8192"), ("multipos_infonce", "no bias", "B=65536"),
                    ("multipos_infonce", "no bias, one positive", "B=8192"),
                    ("multipos_infonce", "no bias, one positive", "B=65536"),
                    ("multipos_infonce", "table bias (4097)", "B=8192"),
                    ("multipos_infonce", "table bias (4097)", "B=65536"),
                    ("matryoshka_infonce", "dims 64..768", "B=8192"),
                    ("calendar_context", "fwd+bwd float32 dim 64", "rows=1048576 levels=12x32x12"),
                    ("calendar_scalar", "fwd+bwd float32", "rows=1048576 levels=12x32x12"),
                    ("re3_loss", "Re3Loss (nce + hard + tw)", "B=8192")}


def test_one_positive_case_inf_cl_and_source_hashes(suite, tmp_path):
    """The one-positive case (the one Inf-CL takes) runs tempokern and eager; Inf-CL without a GPU (or not
    installed) is a status row saying why; every row names the hash of the sources it measured."""
    rows, _ = run(suite, tmp_path, "--no-compile", "--only", "no bias, one positive")
    case = dict(op="multipos_infonce", case="no bias, one positive", size="B=48")
    for impl in ("tempokern", "eager"):
        assert one(rows, **case, impl=impl, metric="status")["value"] == "ok"
    st = one(rows, **case, impl="inf_cl", metric="status")["value"]
    assert st.startswith("unsupported: Inf-CL is") and ("GPU only" in st or "not installed" in st), st
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _sources
    finally:
        sys.path.pop(0)
    assert {r["src_hash"] for r in rows if r["impl"] == "tempokern"} == {
        _sources.source_hash("multipos_infonce", "cuda", "tempokern")}
    assert {r["src_hash"] for r in rows if r["impl"] == "eager"} == {
        _sources.source_hash("multipos_infonce", "cuda", "eager")}


def test_stale_cases_follow_the_decision_cases(suite, tmp_path):
    """--stale adds every case whose default's newest row was measured on other sources (here: no row at all),
    after the decision cases; --plan lists them without running anything."""
    args = suite.parse_args(["--decision", "--stale", "--csv", str(tmp_path / "none.csv")])
    cases = suite.build_cases(args, torch.device("cuda"), 3e12, lambda f, autochunk=False: f)
    keys = [(c.op, c.case, c.size) for c, _ in cases]
    decision = suite.decision_keys(suite.suite_sizes("cuda", False))
    n = len(decision)
    assert set(keys[:n]) == decision and len(keys) > n
    assert ("multipos_infonce", "exact bias", "B=8192") in keys[n:]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--decision", "--stale",
                          "--plan", "--csv", str(tmp_path / "none.csv")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "multipos_infonce/exact bias/B=8192: stale" in out.stdout
    assert not (tmp_path / "none.csv").exists()
