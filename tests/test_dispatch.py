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
