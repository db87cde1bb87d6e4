"""Quick timing probe of the CUDA multipos_infonce path (the lead's tuning tool; benchmarks/gpu_suite.py is the
full, committed measurement). Prints one line per case: median fwd+bwd time over repeats (CUDA events), extra
peak memory, and the agreement of the loss with a float64 evaluation where that fits."""
import argparse

import torch

from gpu_timing import med

import tempokern
from tempokern.reference import multipos_infonce as ref


def make(B, H=768, dtype=torch.bfloat16, bias=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, H, device="cuda", generator=g), dim=1).to(dtype)
    d = torch.nn.functional.normalize(torch.randn(B, H, device="cuda", generator=g), dim=1).to(dtype)
    months = torch.randint(0, 4608, (B,), device="cuda", generator=g)
    sp = ((months, months + torch.randint(0, 3, (B,), device="cuda", generator=g)),
          (months, months + 1))
    b = None
    if bias:
        ob = tempokern.nn.OffsetBias(features=32, hidden=32).cuda()
        with torch.no_grad():
            ob.scale.fill_(0.5)
        u = months.float() / 4607
        b = (u, u + 0.001, *tempokern.nn.offset_bias.bias_params(ob))
    q.requires_grad_(); d.requires_grad_()
    return q, d, sp, b


def run_case(name, B, impl, bias=None, pts=None, reps=5):
    q, d, sp, b = make(B, bias=bias is not None)
    def step():
        if impl == "tempokern":
            loss = tempokern.multipos_infonce(q, d, *sp, temperature=0.05, bias=b, bias_table_points=pts)
        else:
            loss = impl(q, d, sp, b)
        loss.backward()
        q.grad = d.grad = None
    try:
        torch.cuda.synchronize(); torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        t = med(step, reps=reps, warm=1)
        mem = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(f"{name:34s} B={B:7d} {t:10.3f} ms  extra {mem:9.0f} MiB", flush=True)
    except torch.cuda.OutOfMemoryError:
        print(f"{name:34s} B={B:7d} out of memory", flush=True)
    del q, d, sp, b
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="all")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    eager = lambda q, d, sp, b: ref(q, d, *sp, temperature=0.05, bias=b)  # noqa: E731
    comp = torch.compile(eager)
    # correctness at moderate size vs float64
    for bias, pts in ((None, None), (True, 4097), (True, None)):
        q, d, sp, b = make(4096, bias=bias is not None, seed=3)
        lf = tempokern.multipos_infonce(q, d, *sp, temperature=0.05, bias=b, bias_table_points=pts)
        b64 = None if b is None else tuple(t.double() for t in b)
        l64 = ref(q.double(), d.double(), *sp, temperature=0.05, bias=b64, bias_table_points=pts)
        l16 = ref(q, d, *sp, temperature=0.05, bias=b, bias_table_points=pts)
        print(f"agreement B=4096 bias={bias} pts={pts}: fused {abs(lf.item()-l64.item()):.2e} torch-bf16 {abs(l16.item()-l64.item()):.2e}", flush=True)
    for B in (8192, 65536, 262144):
        run_case("tempokern none", B, "tempokern")
    run_case("eager none", 8192, eager)
    run_case("compile none", 8192, comp)
    for B in (8192, 65536):
        run_case("tempokern table4097", B, "tempokern", bias=True, pts=4097)
    run_case("tempokern exact", 8192, "tempokern", bias=True)
    if a.cases == "all":
        run_case("compile exact", 8192, comp, bias=True, reps=3)
        run_case("compile none", 65536, comp, reps=3)
    from torch.profiler import ProfilerActivity, profile
    for B, bias, pts in ((8192, False, None), (65536, True, 4097), (8192, True, None)):
        q, d, sp, b = make(B, bias=bias)
        def step():
            loss = tempokern.multipos_infonce(q, d, *sp, temperature=0.05, bias=b, bias_table_points=pts)
            loss.backward()
        step(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(); torch.cuda.synchronize()
        print(f"--- profile B={B} bias={bias} pts={pts}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)
        del q, d, sp, b


if __name__ == "__main__":
    main()
