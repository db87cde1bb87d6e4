"""Re3Loss (fused: multipos_infonce with the hardest-negative by-product + O(B * D) margins) vs the eager
formulation (tempokern.reference.re3_loss: materialised B x B logits, masked max, hinge), forward + backward,
CPU float32, in the same pytest-benchmark run.

    python -m pytest benchmarks/bench_re3_loss.py --benchmark-only -q

B = 8,192, D = 384 (MiniLM), temperature 0.05, margin 0.1, lambda 0.1 / 0.1, time-wrong negatives given
(not in the InfoNCE), all documents distinct. Rows go to benchmarks/results/re3_loss.csv with the extra peak
RSS of one step in a fresh process above its inputs (sampled every millisecond) and the 1-minute load average (the machine is shared).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tempokern.nn import Re3Loss
from tempokern.reference import re3_loss

try:
    from _record import record
    from bench_multipos_infonce import RssPeak
except ImportError:  # run from the repo root
    from benchmarks._record import record
    from benchmarks.bench_multipos_infonce import RssPeak

B, D = int(os.environ.get("RE3_BENCH_B", 8192)), 384
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSV = "re3_loss.csv"


def make(B, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, D, generator=g), dim=1)
    d = F.normalize(q + torch.randn(B, D, generator=g), dim=1)
    tw = F.normalize(d + 0.5 * torch.randn(B, D, generator=g), dim=1)
    return q.requires_grad_(), d.requires_grad_(), tw.requires_grad_(), torch.arange(B)


def step(fn, q, d, tw, ids):
    for t in (q, d, tw):
        t.grad = None
    loss, _ = fn(q, d, tw, ids)
    loss.backward()
    return loss


def provider_fn(provider):
    return Re3Loss(temperature=0.05) if provider == "fused" else (lambda *a: re3_loss(*a, temperature=0.05))


def fresh_peak_mb(provider) -> float:
    """Extra peak RSS of one fwd+bwd step in a fresh process (no allocator cache from earlier runs), above
    the RSS after the inputs exist; sampled every millisecond."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            "import bench_re3_loss as b; q, d, tw, ids = b.make(b.B); fn = b.provider_fn(%r)\n"
            "with b.RssPeak() as m: b.step(fn, q, d, tw, ids)\nprint(m.extra_mb)" % provider)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("provider", ["fused", "eager"])
def test_re3_loss_cpu_float32(benchmark, provider):
    q, d, tw, ids = make(B)
    fn = provider_fn(provider)
    mem = type("Mem", (), {"extra_mb": fresh_peak_mb(provider)})()
    loss = step(fn, q, d, tw, ids)  # warm-up
    benchmark.pedantic(step, args=(fn, q, d, tw, ids), rounds=2, iterations=1)
    ms = benchmark.stats.stats.min * 1e3
    benchmark.extra_info.update(extra_peak_mb=mem.extra_mb, loss=float(loss))
    bxb_mb = B * B * 4 / 2**20
    record(CSV, op="Re3Loss fwd+bwd float32", provider=provider, size=f"B={B} D={D}", ms=ms,
           extra_peak_mb=mem.extra_mb,
           note=f"one B x B float32 buffer = {bxb_mb:.0f} MB; loss {float(loss):.6f}; "
           f"command: python -m pytest benchmarks/bench_re3_loss.py --benchmark-only -q")
