"""Fused multi-positive InfoNCE (+ offset bias) vs the plain PyTorch reference, forward + backward.

    python -m pytest benchmarks/bench_multipos_infonce.py --benchmark-only -q

CPU: B = 2048, H = 768, bias hidden = D = 32 (fused and reference in the same run), and B = 16384 fused
only (the reference would need tens of GB). CUDA (when a GPU exists): B = 8192 fused vs reference in
bf16, and larger fused-only sizes. Rows go to benchmarks/results/multipos_infonce.csv; extra peak
memory is sampled RSS (CPU) or torch.cuda.max_memory_allocated (CUDA) above the inputs.
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import tempokern
from tempokern.reference import multipos_infonce as reference
from tempokern.reference.offset_bias import offset_features

try:
    from _record import record
except ImportError:  # run from the repo root
    from benchmarks._record import record

H, HIDDEN, D = 768, 32, 32
CSV = "multipos_infonce.csv"
# OpenMP waiting matters on a shared machine: spinning threads steal the oversubscribed cores.
ENV_NOTE = "; ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ)


def make(B, device="cpu", dtype=torch.float32, seed=0, weights="random"):
    """weights="random": w1 ~ 0.3 N(0, 1), b1 ~ N(0, 1) (most units provably on or off over a tile);
    "worst": b1 set so that every hidden unit changes sign at a random delta in (-0.9, 0.9), so no unit
    is on or off over the whole range (the kernel can only prune per tile)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, H, generator=g), dim=1).to(device, dtype).requires_grad_()
    d = torch.nn.functional.normalize(torch.randn(B, H, generator=g), dim=1).to(device, dtype).requires_grad_()
    qs = torch.randint(0, 2000, (B,), generator=g)
    ds = torch.randint(0, 2000, (B,), generator=g)
    spans = ((qs.to(device), (qs + torch.randint(0, 30, (B,), generator=g)).to(device)),
             (ds.to(device), (ds + torch.randint(0, 30, (B,), generator=g)).to(device)))
    f32 = dict(device=device, dtype=torch.float32)
    bias = (torch.rand(B, generator=g).to(**f32).requires_grad_(), torch.rand(B, generator=g).to(**f32).requires_grad_(),
            (0.3 * torch.randn(HIDDEN, D, generator=g)).to(**f32).requires_grad_(),
            torch.randn(HIDDEN, generator=g).to(**f32).requires_grad_(),
            (0.2 * torch.randn(1, HIDDEN, generator=g)).to(**f32).requires_grad_(),
            torch.zeros(1, **f32).requires_grad_(), torch.tensor(0.5, **f32).requires_grad_())
    if weights == "worst":
        cross = torch.rand(HIDDEN, generator=g, dtype=torch.float64) * 1.8 - 0.9
        b1 = -(offset_features(cross, D) * bias[2].detach().double().cpu()).sum(1)
        bias = bias[:3] + (b1.to(**f32).requires_grad_(),) + bias[4:]
    return q, d, spans, bias


def step(fn, q, d, spans, bias):
    for t in (q, d, *bias):
        t.grad = None
    loss = fn(q, d, *spans, temperature=0.05, bias=bias)
    loss.backward()
    return loss


class RssPeak:
    """Peak resident memory above the starting point, sampled every millisecond (CPU)."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    @staticmethod
    def _rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra_mb(self):
        return (self.peak - self.base) / 2**20


def flops(B, bias=True):
    """Dense-equivalent flops of fused forward + backward: 4 score products (fwd, recompute, dq, dd) of
    2 B^2 H, and with the bias 4 first-layer products (fwd, recompute, dA, dCt) of 2 B^2 hidden K2 (the
    CPU kernel skips most of the latter: units proven on/off per tile)."""
    return 4 * 2 * B * B * H + (4 * 2 * B * B * HIDDEN * D if bias else 0)


@pytest.mark.parametrize("provider,weights", [("fused", "random"), ("fused", "worst"), ("reference", "random")])
def test_cpu_b2048_bias(benchmark, provider, weights):
    torch.manual_seed(0)
    q, d, spans, bias = make(2048, weights=weights)
    fn = tempokern.multipos_infonce if provider == "fused" else reference
    step(fn, q, d, spans, bias)  # warm-up
    with RssPeak() as mem:
        step(fn, q, d, spans, bias)
    benchmark.pedantic(step, args=(fn, q, d, spans, bias), rounds=3 if provider == "fused" else 2, iterations=1)
    ms = benchmark.stats.stats.min * 1e3
    benchmark.extra_info.update(extra_peak_mb=mem.extra_mb, gflops=flops(2048) / ms / 1e6)
    record(CSV, op="multipos_infonce fwd+bwd (bias)", provider=provider, size="B=2048 H=768 hidden=D=32",
           ms=ms, extra_peak_mb=mem.extra_mb,
           note=f"{weights} bias weights; {flops(2048) / ms / 1e6:.1f} GFLOP/s dense-equivalent, "
           f"{flops(2048, bias=False) / ms / 1e6:.1f} GFLOP/s in the score products"
           + (f"; {ENV_NOTE}" if ENV_NOTE else ""))


def test_cpu_b16384_bias_fused(benchmark):
    q, d, spans, bias = make(16384)
    with RssPeak() as mem:
        benchmark.pedantic(step, args=(tempokern.multipos_infonce, q, d, spans, bias), rounds=1, iterations=1)
    ms = benchmark.stats.stats.min * 1e3
    record(CSV, op="multipos_infonce fwd+bwd (bias)", provider="fused", size="B=16384 H=768 hidden=D=32",
           ms=ms, extra_peak_mb=mem.extra_mb,
           note=f"{flops(16384) / ms / 1e6:.1f} GFLOP/s; reference infeasible (B x B x D intermediates)"
           + (f"; {ENV_NOTE}" if ENV_NOTE else ""))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_step_ms(fn, args, reps=5):
    step(fn, *args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        step(fn, *args)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


@cuda
@pytest.mark.parametrize("provider", ["fused", "reference"])
def test_cuda_b8192_bf16(benchmark, provider):
    args = make(8192, device="cuda", dtype=torch.bfloat16)
    fn = tempokern.multipos_infonce if provider == "fused" else reference
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = cuda_step_ms(fn, args)
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    benchmark.pedantic(step, args=(fn, *args), rounds=1, iterations=1)
    record(CSV, op="multipos_infonce fwd+bwd (bias) bf16", provider=provider, size="B=8192 H=768 hidden=D=32",
           ms=ms, extra_peak_mb=extra, device="cuda", note=f"{flops(8192) / ms / 1e9:.1f} TFLOP/s useful")


@cuda
@pytest.mark.parametrize("B", [65536, 262144])
def test_cuda_large_bf16_fused(benchmark, B):
    args = make(B, device="cuda", dtype=torch.bfloat16)
    ms = cuda_step_ms(tempokern.multipos_infonce, args, reps=2)
    benchmark.pedantic(step, args=(tempokern.multipos_infonce, *args), rounds=1, iterations=1)
    record(CSV, op="multipos_infonce fwd+bwd (bias) bf16", provider="fused", size=f"B={B} H=768 hidden=D=32",
           ms=ms, device="cuda", note=f"{flops(B) / ms / 1e9:.1f} TFLOP/s useful")
