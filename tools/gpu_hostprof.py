"""Host-side cost of one CUDA loss step (third GPU session): wall time per step with and without a sync,
CUDA time from events, cProfile's top functions and torch.profiler's CPU ops. `python3 tools/gpu_hostprof.py`."""
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import tempokern

dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
B = 8192
q = torch.nn.functional.normalize(torch.randn(B, 768, device=dev, generator=g), dim=1).bfloat16().requires_grad_()
d = torch.nn.functional.normalize(torch.randn(B, 768, device=dev, generator=g), dim=1).bfloat16().requires_grad_()
m = torch.randint(0, 4608, (B,), device=dev, generator=g)
ob = tempokern.nn.OffsetBias(features=32, hidden=32).to(dev)
u = m.float() / 4607
bp = (u, u, *tempokern.nn.offset_bias.bias_params(ob))

for name, kw in (("none", {}), ("table", dict(bias=bp, bias_table_points=4097))):
    def step():
        tempokern.multipos_infonce(q, d, (m, m + 1), (m, m + 2), temperature=0.05, **kw).backward()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    n = 50
    t = time.perf_counter()
    for _ in range(n):
        step()
    t_host = (time.perf_counter() - t) / n * 1e3
    torch.cuda.synchronize()
    t_all = (time.perf_counter() - t) / n * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        step()
    b.record(); torch.cuda.synchronize()
    print(f"{name}: host issue {t_host:.3f} ms/step, wall {t_all:.3f}, events over {n} steps {a.elapsed_time(b) / n:.3f}",
          flush=True)
    # host issue cost of small pieces
    x = torch.empty(10, device=dev)
    t = time.perf_counter()
    for _ in range(1000):
        x.add_(1)
    print(f"  one torch launch ~{(time.perf_counter() - t):.3f} us")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20):
        step()
    pr.disable(); torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(5):
            step()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=55))
print("hostprof done")
