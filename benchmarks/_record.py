"""Long-format benchmark rows (provider, op, size, ms, MB, device, date, version),
appended to benchmarks/results/<file>.csv so the tables in docs/ come from real runs."""
from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ["date", "device", "torch", "tempokern", "commit", "src_hash", "op", "provider", "size", "ms", "extra_peak_mb",
          "note"]
#: the first word of a row's op -> the op of benchmarks/_sources.py (the hash of the sources it measured)
_SRC_OP = {"re3loss": "re3_loss"}
#: provider -> the column of benchmarks/_sources.py (fused / tempokern: the op's default path; the rest: baselines)
_SRC_PROVIDER = {"fused": "tempokern", "tempokern": "tempokern"}


def git_commit() -> str:
    """HEAD of this checkout (``+dirty`` when csrc/ or tempokern/ differ from it), TEMPOKERN_GIT_COMMIT in a copy
    without .git, else ``unknown``."""
    import subprocess
    if os.environ.get("TEMPOKERN_GIT_COMMIT"):
        return os.environ["TEMPOKERN_GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        c = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                           timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "csrc",
                                "tempokern"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (c + ("+dirty" if dirty else "")) if c else "unknown"


def src_hash(op: str, provider: str, device: str = "cpu") -> str:
    """The hash of the sources of what a row measured (benchmarks/_sources.py); ``unknown`` for an op it does not
    map."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import _sources
    finally:
        sys.path.pop(0)
    first = op.split()[0].lower() if op.split() else ""
    dev = "cuda" if str(device).startswith("cuda") else "cpu"
    return _sources.source_hash(_SRC_OP.get(first, first), dev, _SRC_PROVIDER.get(provider, "eager"))


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform.processor() elsewhere): CPU rows from an Intel
    and an AMD machine differ (MKL's speed differs between them), so every row names the model."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str = "cpu") -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    threads = torch.get_num_threads()
    return f"{platform.machine()} {cpu_model()} cpu x{os.cpu_count()} (torch threads {threads})"


def record(file: str, *, op: str, provider: str, size: str, ms: float, extra_peak_mb: float | None = None,
           device: str = "cpu", note: str = "") -> None:
    import tempokern
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / file
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerow({
            "date": _dt.date.today().isoformat(), "device": device_name(device), "torch": torch.__version__,
            "tempokern": tempokern.__version__, "commit": git_commit(), "src_hash": src_hash(op, provider, device),
            "op": op, "provider": provider, "size": size,
            "ms": f"{ms:.3f}", "extra_peak_mb": "" if extra_peak_mb is None else f"{extra_peak_mb:.1f}",
            # the 1-minute load average says whether other work shared the machine during the run
            "note": "; ".join(x for x in (note, f"load avg {os.getloadavg()[0]:.1f}") if x),
        })


def cuda_median_ms(fn, reps: int = 10, warmup: int = 1, peak: bool = False):
    """Median CUDA-event time of fn() in ms after `warmup` calls; with peak=True also the peak memory it
    allocated above what was allocated before (bytes)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    ms = sorted(times)[len(times) // 2]
    return (ms, torch.cuda.max_memory_allocated() - base) if peak else ms
