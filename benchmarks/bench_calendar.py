"""Fused calendar ops vs tempokern.reference, forward + backward, Chunqiu levels 12 x 32 x 12.

Run: python -m pytest benchmarks/bench_calendar.py --benchmark-columns=median,min,max
Both ops are memory-bound: per row they read sum(n_l) logits and write 1 (scalar) or L*dim (context) values."""
import pytest
import torch

import tempokern
from tempokern import reference as ref
from _record import record
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
