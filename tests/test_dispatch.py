"""The dispatch table (tempokern/_ops/dispatch.py): the one variable that enables candidates, its validation, the
scoped override the tests use, and the generated tables of the README and docs/kernels.md."""
import pathlib
import re

import pytest
import torch

import tempokern
from tempokern._ops import dispatch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_nothing_experimental_by_default(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert dispatch.experimental() == frozenset()
    assert not any(dispatch.enabled(n) for n in dispatch.NAMES)


@pytest.mark.parametrize("value,want", [
    ("mpb_tc", {"mpb_tc"}),
    (" MPB_TC , calendar_v3 ,", {"mpb_tc", "calendar_v3"}),
    ("all", set(dispatch.NAMES)),
    ("", set()),
])
def test_variable_parsing(monkeypatch, value, want):
    monkeypatch.setenv(dispatch.ENV, value)
    assert dispatch.experimental() == want
    for n in dispatch.NAMES:
        assert dispatch.enabled(n) == (n in want)


@pytest.mark.parametrize("value", ["mpb_tc,stats_v2", "pair9", "tc", "all,mpb_tc"])
def test_unknown_name_is_a_value_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(dispatch.ENV, value)
    with pytest.raises(ValueError, match=dispatch.ENV):
        dispatch.experimental()
    with pytest.raises(ValueError, match=dispatch.ENV):
        dispatch.enabled("mpb_tc")


def test_use_overrides_the_environment_and_restores(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "all")
    with dispatch.use("mrl_tc"):
        assert dispatch.experimental() == {"mrl_tc"}
        with dispatch.use():
            assert dispatch.experimental() == frozenset()
        assert dispatch.enabled("mrl_tc") and not dispatch.enabled("mpb_tc")
    assert dispatch.experimental() == set(dispatch.NAMES)
    with pytest.raises(ValueError, match=dispatch.ENV):
        with dispatch.use("nope"):
            pass


def test_enabled_rejects_a_name_outside_the_table():
    with pytest.raises(ValueError, match="unknown candidate"):
        dispatch.enabled("stats_v2")


def test_one_candidate_per_kernel_file_and_op():
    # at most one candidate per kernel family: no two candidates share an op
    seen = {}
    for c in dispatch.CANDIDATES:
        for op in c.ops:
            assert op not in seen, (op, seen.get(op), c.name)
            seen[op] = c.name
        assert (ROOT / c.kernel).is_file(), c.kernel


def test_defaults_name_their_evidence():
    for p in dispatch.DEFAULTS:
        assert p.evidence, p
        path = p.evidence.split(":")[0].strip()
        assert (ROOT / path).is_file(), (p.op, p.name, path)
        if p.device == "cuda":
            assert path == dispatch.GPU_CSV, p


def test_no_kernel_switch_variables_remain():
    # exactly one kernel-variant variable: TEMPOKERN_EXPERIMENTAL
    pat = re.compile(r"TEMPOKERN_(MPB_\w+|MRL_\w+|CALENDAR|TOPK_SERVE|OB_PRUNE)\b")
    hits = []
    for sub in ("tempokern", "csrc", "benchmarks", "tools", "docs"):
        for f in (ROOT / sub).rglob("*"):
            if f.is_file() and f.suffix in (".py", ".cu", ".cuh", ".cpp", ".h", ".md", ".sh"):
                for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                    if pat.search(line):
                        hits.append(f"{f.relative_to(ROOT)}:{i}")
    assert not hits, hits


@pytest.mark.parametrize("doc", ["docs/kernels.md"])
def test_generated_tables_are_current(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    assert dispatch.render_into(text) == text, (
        f"{doc}'s table of paths is stale: run python -m tempokern._ops.dispatch {doc}")


def test_table_command_rewrites_a_file(tmp_path):
    from conftest import run_python
    f = tmp_path / "x.md"
    f.write_text("a\n<!-- paths-table:begin -->\nold\n<!-- paths-table:end -->\nb\n", encoding="utf-8")
    res = run_python(f"import sys; from tempokern._ops import dispatch; sys.exit(dispatch._main([{str(f)!r}]))")
    assert res.returncode == 0, res.stderr
    out = f.read_text(encoding="utf-8")
    assert "old" not in out and "mpb_tc" in out and out.startswith("a\n") and out.endswith("b\n")
    with pytest.raises(ValueError, match="markers"):
        dispatch.render_into("no markers here")


def test_trace_constant_marks_as_torch_does():
    # tempokern marks its trace-constant queries itself (importing torch._dynamo at import time costs seconds);
    # torch's own decorator must still mean the same attribute
    from tempokern._util import trace_constant

    def f():
        return 1

    def g():
        return 1
    assert getattr(torch.compiler.assume_constant_result(f), "_dynamo_marked_constant", False)
    assert trace_constant(g)._dynamo_marked_constant is True


def test_import_does_not_load_dynamo():
    from conftest import run_python
    res = run_python("import sys, tempokern; print('torch._dynamo' in sys.modules)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False", res.stdout


# ---- the table dispatches: predicates, choose, and nothing else choosing ------------------------------------

def _sample_calls():
    """(op, call) pairs over the shapes the predicates look at, built by the op modules' own call classes."""
    from tempokern._ops import calendar as cal
    from tempokern._ops import ctd_topk as topk
    from tempokern._ops.matryoshka_infonce import MatryoshkaCall
    from tempokern._ops.routing import MultiposCall
    out = []
    for dt in (torch.float32, torch.bfloat16):
        for B, Bd in ((4, 4), (4, 6), (0, 4)):
            q, d = torch.zeros(B, 32, dtype=dt), torch.zeros(Bd, 32, dtype=dt)
            u = torch.zeros(max(B, 1))
            bias = (u, u, torch.zeros(2, 4), torch.zeros(2), torch.zeros(1, 2), torch.zeros(1), torch.tensor(1.0))
            for b, pts in ((None, None), (bias, None), (bias, 4097)):
                for hardest in (False, True):
                    out.append((dispatch.MULTIPOS, MultiposCall(q, d, b, None, pts, hardest, False)))
                out.append((dispatch.MATRYOSHKA, MatryoshkaCall(q, d, [16, 32], b, None, pts)))
    for dt in (torch.float32, torch.float64):
        x = [torch.zeros(4, 3, dtype=dt), torch.zeros(4, 5, dtype=dt)]
        for role in ("context_fwd", "context_bwd", "scalar_fwd", "scalar_bwd"):
            out.append(("calendar_" + role.split("_")[0], cal._CalendarCall(role, x, 64, None)))
    for Q in (0, 1, 4, 5, 64):
        for rerank in (False, True):
            out.append(("ctd_topk", topk._TopkCall(torch.zeros(Q, 32), 10, rerank)))
    out.append(("offset_bias", None))
    return out


class _FakeCudaPath:
    """A backend on the CUDA path whose predicates are asked without a device (the tensor-core checks then
    see CPU tensors and decline)."""
    kind, cuda_path, emulated = "cuda", True, False


def test_every_path_has_a_predicate_whose_docstring_is_its_takes():
    for p in dispatch.DEFAULTS + dispatch.CANDIDATES:
        assert callable(p.predicate) and p.predicate.__doc__, p.name
        assert p.takes == " ".join(p.predicate.__doc__.split())
    table = dispatch.paths_markdown()
    for p in dispatch.DEFAULTS:
        assert f"| {p.op} | {p.device} | {p.name} | {p.takes} |" in table
    for c in dispatch.CANDIDATES:
        assert f"| `{c.name}` | {' / '.join(c.ops)} | {c.takes} |" in table


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_predicates_agree_with_the_table_device_and_choose_covers_every_call(kind):
    # a path's predicate never takes a call on the other device's backend, and choose finds a path of the
    # backend's device for every sample call (the table has no gap), candidates off and on
    from tempokern._ops import backend
    be = backend.resolve(torch.device("cpu")) if kind == "cpu" else _FakeCudaPath()
    ops = set()
    for op, call in _sample_calls():
        ops.add(op)
        for p in dispatch.DEFAULTS:
            if p.op == op and p.device != kind:
                assert not p.predicate(call, be), (p.op, p.name, kind)
        if kind == "cpu" or op != "ctd_topk" or not call.rerank:
            for names in ((), dispatch.NAMES):
                with dispatch.use(*names):
                    got = dispatch.choose(op, call, be)
                assert isinstance(got, dispatch.Candidate) or got.device == kind, (op, got.name, kind)
    assert ops == {p.op for p in dispatch.DEFAULTS}


def test_choose_prefers_an_enabled_candidate_that_takes_the_call():
    calls = []

    class Call:
        def v3_takes(self):
            calls.append(1)
            return True

    be = _FakeCudaPath()
    with dispatch.use():
        assert dispatch.choose("calendar_scalar", Call(), be).name == "v1" and not calls
    with dispatch.use("calendar_v3"):
        got = dispatch.choose("calendar_scalar", Call(), be)
    assert got.name == "calendar_v3" and got.kernel_for("fwd") == "v3" and calls


# the choosers the op modules had before the table: none may come back (dispatch.choose is the only one)
_OLD_CHOOSERS = ["dispatch.enabled(", "_tensor_core_call", "_per_level", "serve_path", "DEFAULT_KERNEL",
                 "force_blocked", "cuda_emulator", "_emulated", "emu_support"]


def test_choose_is_the_only_chooser():
    ops = ROOT / "tempokern" / "_ops"
    for path in sorted(ops.glob("**/*.py")):
        if path.name == "dispatch.py":
            continue
        text = path.read_text(encoding="utf-8")
        for name in _OLD_CHOOSERS:
            assert name not in text, f"{path.relative_to(ROOT)} uses {name}: paths are chosen by dispatch.choose"
        if path.name not in ("common.py", "backend.py"):  # the kernel layer asks the backend, not the device
            for name in ("on_cuda_path(", "launch_args(", "kernels()", "sm_count("):
                assert name not in text, f"{path.relative_to(ROOT)} calls {name}: ask the call's backend"
    for path in sorted((ROOT / "tempokern").glob("**/*.py")):
        text = path.read_text(encoding="utf-8")
        assert "emu_support" not in text and "cuda_emu" not in text.replace("tools/cuda_emu", ""), \
            f"{path.relative_to(ROOT)}: product code does not import the emulator's test support"
