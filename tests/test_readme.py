"""README.md for users: every ```python block runs as it stands (so the quickstarts cannot rot), the set-up
commands keep the form CI extracts, and the tables point at things that exist."""
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README, flags=re.S | re.M)
#: the blocks of docs/ marked ``<!-- tested -->`` on the line before their fence run too
BLOCKS += [b for f in sorted((ROOT / "docs").glob("*.md"))
           for b in re.findall(r"^<!-- tested -->\n```python\n(.*?)^```$", f.read_text(encoding="utf-8"),
                               flags=re.S | re.M)]


def _block_id(i):
    first = BLOCKS[i].splitlines()
    names = re.findall(r"\b(CTDLoss|TMRLLoss|MatryoshkaLoss|Re3Loss)\b", BLOCKS[i])
    return f"block{i}-{names[0] if names else first[0][:20]}"


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("i", range(len(BLOCKS)), ids=_block_id)
def test_python_block_runs(i, one_thread, tmp_path, monkeypatch):
    code = BLOCKS[i]
    if "sentence_transformers import" in code:
        pytest.importorskip("sentence_transformers")
    if "tempokern.models" in code:
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md python block {i}", "exec"), {"__name__": f"readme_block_{i}"})


def test_one_quickstart_per_method():
    """CTD (bias + loss in a training step, then top-k / TemporalIndex), TMRL (TMRLLoss; the ST drop-in in
    docs/tmrl.md), Re³ (loss, encoder, recency filter): each API appears in an executed block."""
    code = "\n".join(BLOCKS)
    for api in ("OffsetBias(", "CTDLoss(", ".backward()", "ctd_topk(", "TemporalIndex(", "TMRLLoss(",
                "matryoshka_infonce(", "sentence_transformers import MatryoshkaLoss", "Re3Loss(", "Re3Encoder(",
                "RecencyFilter("):
        assert api in code, f"no README python block uses {api}"


def test_length_and_markers():
    lines = README.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200)"
    for name in ("perf-table", "quality-table"):
        b, e = README.find(f"<!-- {name}:begin -->"), README.find(f"<!-- {name}:end -->")
        assert 0 <= b < e, f"README.md lacks the {name} begin/end markers in order"
        assert README.count(f"<!-- {name}:begin -->") == 1 and README.count(f"<!-- {name}:end -->") == 1


def test_ci_commands_extractable():
    """.ci/run takes the test command with this sed expression; the main job is `tempokern demo`."""
    out = subprocess.run(["sed", "-n", r's/^    \(pip install "\.\[test\]".*\)$/\1/p', str(ROOT / "README.md")],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[:1] == ['pip install ".[test]" && pytest -n auto']
    assert '    pip install ".[minilm]" && tempokern demo --out demo-out' in README.splitlines()
    assert 'sed -n \'s/^    \\(pip install "\\.\\[test\\]".*\\)$/\\1/p\' README.md' in (ROOT / ".ci" / "run").read_text()


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11")
def test_extras_table_matches_pyproject():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cells = re.findall(r"^\| ((?:`[\w-]+`(?: / )?)+) \|", README.split("| extra |", 1)[1].split("\n\n", 1)[0],
                       flags=re.M)
    named = {n for cell in cells for n in re.findall(r"`([\w-]+)`", cell)}
    assert named == set(extras), f"README extras {sorted(named)} != pyproject extras {sorted(extras)}"


def test_build_switches_match_pyproject():
    toml = (ROOT / "pyproject.toml").read_text()
    for var in ("TEMPOKERN_CUDA", "TEMPOKERN_CUDA_ARCHS", "TEMPOKERN_NATIVE"):
        default = re.search(rf'^{var} = {{ env = "{var}", default = "(\w+)" }}', toml, flags=re.M).group(1)
        assert f"| `{var}` | `{default}` |" in README, f"README's row for {var} does not give default {default}"


def test_linked_paths_exist():
    paths = set(re.findall(r"`((?:docs|tools|benchmarks|tempokern|tests)/[\w./-]+)`", README))
    assert paths, "no repository paths found in README.md"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_quality_table_is_current():
    """The README's quality table is generated from the committed TimeQA comparison
    (benchmarks/quality_table.py README.md rewrites it)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("quality_table", ROOT / "benchmarks" / "quality_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.RESULTS.exists(), "benchmarks/results/timeqa/results.json (the committed TimeQA comparison) is missing"
    assert mod.render_into(README, mod.table(mod.load())) == README, (
        "README's quality table is stale: run python benchmarks/quality_table.py README.md")
    res = mod.load()
    assert res["setup"]["suite"] == "timeqa" and not res["setup"]["quick"]


def test_main_job_duration_is_the_committed_runs():
    """The README's duration of the full comparison is the committed run's: its units and their summed seconds."""
    units = [json.loads(p.read_text())["payload"]
             for p in sorted((ROOT / "benchmarks/results/timeqa/units").glob("*/*/seed*.json"))]
    hours = sum(u["wall_seconds"] for u in units) / 3600
    assert f"{len(units)} units, {hours:.1f} h of unit time on 2 CPU cores" in " ".join(README.split())
    # and the number of units the full run plans: every TimeQA row, seeded rows on 3 seeds
    from tempokern.suite.registry import registered
    from tempokern.suite.runner import load_methods
    load_methods()
    planned = sum(3 if m.seeded else 1 for m in registered() if "timeqa" in m.sets)
    assert f"`k/{planned}`" in README
