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
FIELDS = ["date", "device", "torch", "tempokern", "op", "provider", "size", "ms", "extra_peak_mb", "note"]


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
            "tempokern": tempokern.__version__, "op": op, "provider": provider, "size": size,
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
