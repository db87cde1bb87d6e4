"""Fused calendar ops vs tempokern.reference, forward + backward, Chunqiu levels 12 x 32 x 12.

Run: python -m pytest benchmarks/bench_calendar.py --benchmark-columns=median,min,max
Both ops are memory-bound: per row they read sum(n_l) logits and write 1 (scalar) or L*dim (context) values."""
import pytest
import torch

import tempokern
from tempokern import reference as ref
from _record import cuda_median_ms, record
from conftest import sync

LEVELS = [12, 32, 12]
DIM = 64
OPS = {
    "calendar_scalar": (tempokern.calendar_scalar, ref.calendar_scalar, ()),
    "calendar_context": (tempokern.calendar_context, ref.calendar_context, (DIM,)),
}


@pytest.mark.parametrize("B", [4096, 65536])
@pytest.mark.parametrize("provider", ["tempokern", "reference"])
@pytest.mark.parametrize("op", list(OPS))
def test_calendar_fwd_bwd(benchmark, op, provider, B, device):
    fused, plain, args = OPS[op]
    fn = fused if provider == "tempokern" else plain
    xs = [torch.randn(B, n, device=device, requires_grad=True) for n in LEVELS]

    def run():
        out = fn(xs, *args)
        torch.autograd.grad(out.sum(), xs)
        sync(device)

    benchmark.group = f"{op} fwd+bwd B={B} {device}"
    benchmark.pedantic(run, rounds=10, warmup_rounds=2, iterations=1)
    record("calendar.csv", op=f"{op} fwd+bwd", provider=provider, size=f"B={B} levels=12x32x12 dim={DIM}",
           ms=benchmark.stats.stats.median * 1e3, device=device)


# ---- CUDA at 1M rows: CUDA-event medians against the byte floor ---------------------------------
# Bytes per row (float32, levels 12 x 32 x 12 = 56 logits, dim 64, a dense incoming gradient):
#   calendar_context fwd: read 56 x 4 + write 192 x 4 = 992 B; bwd: read 224 + 768, write 224 = 1,216 B
#     -> 2,208 B/row, 2.32 GB at 1,048,576 rows: 0.77 ms at the H100's measured ~3 TB/s (copy, read + write).
#     Flops: 2 x 56 x 64 = 7,168 per row each way (+ 56 exp): 15 GFLOP in all, ~0.25 ms of fp32 FMA: memory-bound.
#   calendar_scalar fwd: read 224 + write 4 = 228 B; bwd: read 228, write 224 = 452 B
#     -> 680 B/row, 0.71 GB: 0.24 ms.
FLOOR_MS = {"calendar_scalar": 680 * 2**20 / 3e9 * 1e3, "calendar_context": 2208 * 2**20 / 3e9 * 1e3}


def _cuda_events_ms(fn, reps=20):
    return cuda_median_ms(fn, reps=reps, warmup=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", list(OPS))
def test_calendar_cuda_1m_rows(op):
    # fwd + bwd with a dense incoming gradient (not out.sum(), whose stride-0 gradient reads no memory)
    B = 1 << 20
    fused, plain, args = OPS[op]
    torch.manual_seed(0)
    xs = [(3 * torch.randn(B, n, device="cuda")).requires_grad_() for n in LEVELS]
    with torch.no_grad():
        g = torch.randn_like(fused(xs, *args))
    res = {}
    for provider, fn in (("tempokern", fused), ("reference", plain)):
        res[provider] = _cuda_events_ms(lambda: torch.autograd.grad(fn(xs, *args), xs, g))
    # agreement with float64 on the same inputs (forward and gradients)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    o64 = plain(x64, *args)
    g64 = torch.autograd.grad(o64, x64, g.double())
    o = fused(xs, *args)
    gf = torch.autograd.grad(o, xs, g)
    err = max([(o.double() - o64).abs().max().item()] + [(a.double() - b).abs().max().item() for a, b in zip(gf, g64)])
    for provider, ms in res.items():
        record("calendar.csv", op=f"{op} fwd+bwd", provider=provider, size=f"B={B} levels=12x32x12 dim={DIM} float32",
               ms=ms, device="cuda", note=f"CUDA events median; byte floor {FLOOR_MS[op]:.3f} ms at 3 TB/s")
    print(f"\n{op} fwd+bwd B={B}: tempokern {res['tempokern']:.3f} ms, eager {res['reference']:.3f} ms, "
          f"floor {FLOOR_MS[op]:.3f} ms, max |err| vs float64 {err:.2e}")
    assert err < 1e-4
