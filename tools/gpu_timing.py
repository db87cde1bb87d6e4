"""Timing helpers of the GPU probe scripts (tools/gpu_probe*.py): the CUDA-event median of the benchmarks
(benchmarks/_record.py's cuda_median_ms) and a one-call CUDA-kernel profile table."""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from _record import cuda_median_ms  # noqa: E402


def med(fn, reps=20, warm=3):
    """Median CUDA-event time of fn() in ms over `reps` calls after `warm` warm-up calls."""
    return cuda_median_ms(fn, reps=reps, warmup=warm)


def prof(name, fn, rows=10):
    """Prints the CUDA-kernel profile of one fn() call (after one warm-up call), sorted by CUDA time."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    print(f"--- profile {name}")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))
