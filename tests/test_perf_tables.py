"""Performance evidence pinned to its sources: benchmarks/_sources.py (the file set and hash of each measured path),
the src_hash / commit columns of the results files, the generated performance blocks of README.md and docs/
(benchmarks/perf_table.py) and the comparison script's statistics (benchmarks/cpu_compare.py)."""
from __future__ import annotations

import csv
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _load(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"_perf_{name}", ROOT / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod   # dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.pop(0)


@pytest.fixture(scope="module")
def src():
    return _load("_sources")


@pytest.fixture(scope="module")
def pt():
    return _load("perf_table")


# ---- the file sets -----------------------------------------------------------------------------------------------

def test_every_default_path_maps_to_existing_files(src):
    d = src._dispatch()
    for p in d.DEFAULTS:
        op = src._suite_op(p.op)
        files = src.source_files(op, p.device)
        assert files, (op, p.device)
        missing = [f for f in files if not (ROOT / f).exists()]
        assert not missing, f"{op} {p.device}: {missing}"
        for f in src._FILE.findall(p.kernel):   # the kernel files the dispatch table names are in the set
            assert f in files, (op, p.device, f)
        for f in src.BINDINGS[op] + src.PYTHON[op]:
            assert f in files, (op, p.device, f)


def test_file_sets_follow_includes_and_candidates(src):
    files = src.source_files("multipos_infonce", "cuda")
    assert "csrc/multipos_infonce/multipos_block_cuda.cu" in files
    # included by the kernel (directly or through its headers)
    assert "csrc/common/cuda_utils.cuh" in files and "csrc/common/types.h" in files
    assert not any(f.endswith("_cpu.cpp") for f in files), files   # the CPU kernels are another path
    cand = src.source_files("multipos_infonce", "cuda", "tempokern:mpb_tc")
    assert "csrc/matryoshka_infonce/matryoshka_tc_cuda.cu" in cand and set(files) < set(cand)
    cpu = src.source_files("calendar_scalar", "cpu")
    assert "csrc/calendar/calendar_cpu.cpp" in cpu and "csrc/calendar/calendar_cuda.cu" not in cpu
    assert src.source_files("calendar_scalar", "cpu", "eager") == ["tempokern/reference/calendar.py"]
    assert src.source_hash("no_such_op", "cpu") == src.UNKNOWN


def test_hash_changes_with_a_file_of_the_set_only(src, tmp_path):
    files = src.source_files("calendar_scalar", "cuda")
    for f in files + ["csrc/offset_bias/offset_bias_cpu.cpp"]:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    h0 = src.hash_files(files, tmp_path)
    assert h0 == src.hash_files(files, ROOT) == src.source_hash("calendar_scalar", "cuda")
    with open(tmp_path / "csrc/offset_bias/offset_bias_cpu.cpp", "a") as fh:   # not in the set
        fh.write("\n// unrelated\n")
    assert src.hash_files(files, tmp_path) == h0
    header = next(f for f in files if f.startswith("csrc/common/"))   # reached through an #include
    with open(tmp_path / header, "a") as fh:
        fh.write("\n// changed\n")
    assert src.hash_files(files, tmp_path) != h0


def test_include_closure_on_a_small_tree(src, tmp_path):
    (tmp_path / "csrc" / "a").mkdir(parents=True)
    (tmp_path / "csrc" / "common").mkdir()
    (tmp_path / "csrc" / "a" / "k.cu").write_text('#include "a/k.h"\n#include <vector>\n')
    (tmp_path / "csrc" / "a" / "k.h").write_text('#include "common/t.h"\n')
    (tmp_path / "csrc" / "common" / "t.h").write_text("// leaf\n")
    (tmp_path / "csrc" / "common" / "u.h").write_text("// not included\n")
    assert src.include_closure(["csrc/a/k.cu"], tmp_path) == ["csrc/a/k.cu", "csrc/a/k.h", "csrc/common/t.h"]


def test_staleness(src):
    h = src.source_hash("ctd_topk", "cuda")
    assert not src.is_stale(h, "ctd_topk", "cuda", "tempokern")
    assert src.is_stale("unknown", "ctd_topk", "cuda", "tempokern")
    assert src.is_stale("", "ctd_topk", "cuda", "tempokern")
    assert src.is_stale(h, "ctd_topk", "cpu", "tempokern")   # another path's sources


# ---- the results files ---------------------------------------------------------------------------------------------

def test_results_rows_name_commit_and_sources():
    with open(RESULTS / "gpu.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["commit"] and r["src_hash"] for r in rows)
    for p in RESULTS.glob("*.csv"):
        if p.name in ("gpu.csv", "ab_offset_bias.csv"):
            continue
        with open(p, newline="") as f:
            rows = list(csv.DictReader(f))
        assert rows, p
        assert all(r.get("commit") and r.get("src_hash") for r in rows), p.name


def test_cpu_compare_rows_are_long_format():
    cc = _load("cpu_compare")
    with open(RESULTS / "cpu_compare.csv", newline="") as f:
        assert next(csv.reader(f)) == cc.FIELDS
    with open(RESULTS / "cpu_compare.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    timed = [r for r in rows if r["metric"] == "time_ms"]
    assert timed and all(float(r["p20"]) <= float(r["p50"]) <= float(r["p80"]) for r in timed)
    assert all(r["src_hash"] not in ("", "unknown") for r in timed)
    # Inf-CL on the CPU: a status row saying why, never a time
    inf = [r for r in rows if r["provider"] == "inf_cl"]
    assert inf and all(r["metric"] == "status" and "GPU only" in r["note"] for r in inf)


def test_quantiles():
    cc = _load("cpu_compare")
    assert cc.quantiles([3.0]) == (3.0, 3.0, 3.0)
    p50, p20, p80 = cc.quantiles([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (p50, p20, p80) == (3.0, pytest.approx(1.8), pytest.approx(4.2))


# ---- the generated blocks ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["README.md", "docs/performance.md", "docs/calendar.md"])
def test_generated_performance_blocks_are_current(pt, name):
    text = (ROOT / name).read_text(encoding="utf-8")
    made = pt.blocks()
    assert pt.render_all(text, made) == text, f"{name}: stale block; run python benchmarks/perf_table.py {name}"


def test_readme_table_marks_stale_figures_and_names_its_evidence(pt):
    tbl = pt.blocks()["perf-table"]
    assert "commit" in tbl and "GPU:" in tbl and "CPU:" in tbl
    assert "| CTD loss, no bias (B 8,192 / 2,048) |" in tbl
    gpu = pt.load(pt.GPU_CSV)
    unknown = [r for r in gpu if r["src_hash"] == "unknown" and r["metric"] == "time_ms"]
    if unknown:   # rows from before the column: their figures carry the mark
        assert pt.STALE in pt.blocks()["perf-gpu"]


def test_one_calendar_scalar_figure(pt):
    """calendar_scalar's GPU time appears once in the docs, from the generated sentence."""
    s = pt.blocks()["calendar-scalar-gpu"]
    fig = s.split(": ", 1)[1].split(" ms", 1)[0]
    for name in ("README.md", "docs/performance.md", "docs/calendar.md"):
        text = (ROOT / name).read_text(encoding="utf-8")
        for old in ("0.84-1.03", "1.34 ms fwd+bwd", "0.92 vs 1.08"):
            assert old not in text, (name, old)
    assert float(fig) > 0


def test_verdict(pt):
    F = pt.Fig
    assert pt.verdict(F(ms=1.0), F(ms=1.05), "compile", False) == "about even"
    assert pt.verdict(F(ms=1.0), F(ms=2.0), "compile", False) == "tempokern"
    assert pt.verdict(F(ms=2.0), F(ms=1.0), "compile_autochunk", False) == "compile + auto-chunk"
    assert pt.verdict(F(ms=2.0), None, None, True).startswith("tempokern")
    assert pt.verdict(F(status="out of memory"), None, None, True) == "—"


def test_gpu_newest_row_and_status(pt):
    rows = [
        {"date": "d1", "device": "GPU", "commit": "c1", "src_hash": "unknown", "op": "calendar_scalar", "case": "x",
         "B": "b", "impl": "compile", "metric": "time_ms", "value": "2.0", "note": ""},
        {"date": "d2", "device": "GPU", "commit": "c2", "src_hash": "unknown", "op": "calendar_scalar", "case": "x",
         "B": "b", "impl": "compile", "metric": "status", "value": "out of memory", "note": ""},
    ]
    f = pt._newest_gpu(rows, "calendar_scalar", "x", "b", {"compile"})
    assert f.ms is None and f.status == "out of memory"   # the newest run did not time it
    f = pt._newest_gpu(rows[:1], "calendar_scalar", "x", "b", {"compile"})
    assert f.ms == 2.0 and f.stale


def test_suite_stale_keys():
    suite = _load("gpu_suite")
    src = _load("_sources")
    Case = suite.Case
    c1 = Case("calendar_scalar", "x", "b", make=lambda s: {}, steps={})
    c2 = Case("calendar_context", "y", "b", make=lambda s: {}, steps={})
    cur = src.source_hash("calendar_scalar", "cuda", "tempokern")
    rows = [{"date": "d", "device": "NVIDIA H100", "op": "calendar_scalar", "case": "x", "B": "b", "impl": "tempokern",
             "metric": "time_ms", "value": "1", "src_hash": cur},
            {"date": "d", "device": "NVIDIA H100", "op": "calendar_context", "case": "y", "B": "b",
             "impl": "tempokern", "metric": "time_ms", "value": "1", "src_hash": "unknown"}]
    assert suite.stale_keys(rows, [c1, c2]) == {("calendar_context", "y", "b")}
    assert suite.stale_keys([], [c1]) == {("calendar_scalar", "x", "b")}   # never measured


def test_record_names_commit_and_sources(tmp_path, monkeypatch, src):
    rec = _load("_record")
    monkeypatch.setattr(rec, "RESULTS", tmp_path)
    rec.record("x.csv", op="calendar_scalar fwd+bwd", provider="tempokern", size="B=4", ms=1.0)
    rec.record("x.csv", op="Re3Loss fwd+bwd float32", provider="eager", size="B=4", ms=2.0)
    with open(tmp_path / "x.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == rec.FIELDS
    assert rows[0]["src_hash"] == src.source_hash("calendar_scalar", "cpu", "tempokern")
    assert rows[1]["src_hash"] == src.source_hash("re3_loss", "cpu", "eager")
    assert all(r["commit"] for r in rows)


# ---- no hand-written performance figures ---------------------------------------------------------------------------

import re  # noqa: E402

#: a generated part of a document (benchmarks/perf_table.py, tempokern/_ops/dispatch.py, benchmarks/quality_table.py)
_BLOCK = re.compile(r"<!-- ([\w-]+):begin -->.*?<!-- \1:end -->", re.S)
#: what a measured figure looks like: a time, a speed-up ratio, a memory size
_MEASURED = (
    re.compile(r"\d+(?:\.\d+)? ?(?:ms|µs|us|ns)\b"),
    re.compile(r"(?<![\w.])\d+(?:\.\d+)? ?s\b(?= ?(?:per|for|on|fwd|vs|against|of|in|\)|\|))"),
    re.compile(r"\d+(?:\.\d+)? ?[x×] (?:faster|slower|the|as fast|less|more)"),
    re.compile(r"\*\*\d+(?:\.\d+)?[x×]\*\*"),
    re.compile(r"\d+(?:\.\d+)?% (?:faster|slower)"),
)
#: a memory size is a measurement where its line speaks of a benchmark (a buffer's size computed from its shape is not)
_MEMORY = re.compile(r"\d+(?:\.\d+)? ?(?:GB|MB|GiB|MiB)\b")
_BENCH_WORDS = re.compile(r"peak|RSS|measured|benchmark|in all\b|memory", re.I)
#: an estimate computed from counts (flops, bytes, instructions over a rate) is arithmetic, not a measurement, and is
#: written as one: "~" / "≈" / "floor" / "by count" just before it, or "at <rate>" just after it
_ESTIMATE_BEFORE = re.compile(r"(?:~|≈|\bfloor|\bby count|\bestimated at)[\s\d.,–-]*$")
_ESTIMATE_AFTER = re.compile(r"^[^;,()]{0,20}? at (?:the (?:suite's )?(?:measured )?)?~?[\d.,]+ ?(?:[TPG]FLOP/s|TB/s|GB/s|GHz)")
#: (file, phrase, why it is not a measurement): a figure is allowed where it lies inside the phrase
_NOT_MEASURED = (
    ("docs/datasets-english.md", "json.gz`, 1.35 MB", "the size of a packaged data file, not a benchmark figure"),
    ("docs/datasets-english.md", "a 50 MB one-line document", "an input size in an example of the length cap"),
    ("docs/models.md", "about 7× the steps", "a count of training steps (pairs), not a time"),
    ("docs/re3.md", "One B x B float32 matrix is 256 MB", "arithmetic: 4,096^2 x 4 bytes"),
    ("docs/tmrl.md", "LoRA lr = 10 × the", "a learning-rate factor"),
    ("docs/re3.md", "weighs up to 5× more", "a ratio of embedding norms, not a speed"),
    ("docs/offset_bias.md", "`2·SMs·N·8` bytes: 8.7 MB", "arithmetic: the formula's value"),
    ("docs/offset_bias.md", "out and G: 268 MB each", "arithmetic: 8,192² float32"),
    ("docs/offset_bias.md", "would run at 4x the floor", "arithmetic: the load/store units issue 1/4 of the FMA rate"),
    ("docs/matryoshka_infonce.md", "half the 1 GiB budget", "a configured memory budget"),
    ("docs/ctd_topk.md", "the score block (≤ 256 MiB", "a configured cap on the score block"),
    ("docs/gpu-check.md", "less than 60 s of the budget left", "a configured threshold of the suite's time budget"),
    ("docs/calendar.md", "| 2,208 B | 2.32 GB | 0.77 ms |", "the byte-floor table: bytes over 3.0 TB/s"),
    ("docs/calendar.md", "| 680 B | 0.71 GB | 0.24 ms |", "the byte-floor table: bytes over 3.0 TB/s"),
    ("docs/matryoshka_infonce.md", "sized to >= 4x the SM count", "a launch-grid rule"),
    ("docs/matryoshka_infonce.md", "feed 4x more", "arithmetic: 256-row blocks against 64-row ones"),
    ("docs/matryoshka_infonce.md", "| 6H: 0.31 ms | 106 B: 7.1 GB = 2.12 ms | 2.12 ms | one block (6H, 18 B): "
     "max(0.31, 0.36) = 0.36 ms | 5.9x |", "the floors table: counts over the H100's datasheet rates"),
    ("docs/matryoshka_infonce.md", "| 6H: 19.8 ms | 106 B: 455 GB = 136 ms | 136 ms | 8H, 22 B: max(26.7, 28.2) = "
     "28.2 ms | 4.8x |", "the floors table: counts over the H100's datasheet rates"),
)
#: the documents checked: README.md and docs/*.md, but not the retrieval-quality reports (docs/benchmark-*.md: metrics,
#: not performance)
_DOCS = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")
                               if not p.name.startswith("benchmark-"))


def measured_figures(name: str, text: str):
    """(line number, figure, line) of each measured-looking figure of ``text`` outside its generated blocks and
    outside the allowlist's phrases."""
    text = _BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    allowed = [phrase for f, phrase, _ in _NOT_MEASURED if f == name]
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        ok = [(m.start(), m.end()) for ph in allowed for m in re.finditer(re.escape(ph), line)]
        for pat in _MEASURED + ((_MEMORY,) if _BENCH_WORDS.search(line) else ()):
            for m in pat.finditer(line):
                if any(a <= m.start() and m.end() <= b for a, b in ok):
                    continue
                if _ESTIMATE_BEFORE.search(line[max(0, m.start() - 14):m.start()]) or \
                        _ESTIMATE_AFTER.match(line[m.end():]):
                    continue
                out.append((i, m.group(0), line.strip()))
    return out


def test_measured_figure_patterns():
    hits = [h[1] for h in measured_figures("x.md", "1.77 ms; 322 µs; 5.34x faster; **5.28x**; 1.35 GB peak; 20.7 s per "
                                                    "step\na 4 MB buffer\n<!-- perf-gpu:begin -->\n9.9 ms\n<!-- perf-gpu:end -->\nB = "
                                                    "8,192, 2B^2H flops, 3 products; floor ~0.9 ms; 0.5 ms at 600 "
                                                    "TFLOP/s; by count 0.40-0.50 ms")]
    assert hits == ["1.77 ms", "322 µs", "20.7 s", "5.34x faster", "**5.28x**", "1.35 GB"], hits
    assert measured_figures("docs/re3.md", "One B x B float32 matrix is 256 MB, 3 MB peak") == [
        (1, "3 MB", "One B x B float32 matrix is 256 MB, 3 MB peak")]


@pytest.mark.parametrize("name", _DOCS)
def test_no_hand_written_performance_figures(name):
    """Every time, speed-up and memory figure of the docs comes from a results file through a generated block
    (benchmarks/perf_table.py) or is a pointer to a results row; none is typed into the text."""
    hits = measured_figures(name, (ROOT / name).read_text(encoding="utf-8"))
    assert not hits, f"{name}: hand-written performance figures (generate them, or point at the results row):\n" + \
        "\n".join(f"  line {i}: {fig!r} in {line[:120]}" for i, fig, line in hits)


def test_allowlist_entries_still_match():
    for f, phrase, why in _NOT_MEASURED:
        assert why and phrase in (ROOT / f).read_text(encoding="utf-8"), (f, phrase)
