"""Fused single-pass Matryoshka InfoNCE vs the fused single-level multipos_infonce and the
sentence-transformers-style eager loop (tempokern.reference.matryoshka_infonce: slice, normalise, one
cross-entropy per level), forward + backward, float32, H = 768, dims (64, 128, 256, 512, 768).

    python -m pytest benchmarks/bench_matryoshka_infonce.py --benchmark-only -q

B = C = 2,048 and 4,096: all three providers in the same run (targets: fused <= 1.15x single, >= 2.5x
faster than eager); B = C = 16,384: fused and single only (the eager loop's memory at that size is
extrapolated from its measured bytes per pair and printed in the note). Rows go to
benchmarks/results/matryoshka_infonce.csv; extra peak memory is sampled RSS above the inputs.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import tempokern
from tempokern.reference import matryoshka_infonce as eager_loop

try:
    from _record import record
    from bench_multipos_infonce import RssPeak
except ImportError:  # run from the repo root
    from benchmarks._record import record
    from benchmarks.bench_multipos_infonce import RssPeak

H = 768
DIMS = (64, 128, 256, 512, 768)
CSV = "matryoshka_infonce.csv"
ENV_NOTE = "; ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ)
_eager_bytes_per_pair = {}


def make(B, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, generator=g).requires_grad_()
    d = torch.randn(B, H, generator=g).requires_grad_()
    return q, d


def fused(q, d):
    return tempokern.matryoshka_infonce(q, d, DIMS, temperature=0.05)


def single(q, d):
    """One level at the full dim through the fused multipos_infonce (positives = the diagonal)."""
    ids = torch.arange(q.shape[0])
    return tempokern.multipos_infonce(F.normalize(q, dim=-1), F.normalize(d, dim=-1), (ids, ids), (ids, ids),
                                      temperature=0.05, symmetric=False)


def eager(q, d):
    return eager_loop(q, d, DIMS, temperature=0.05)


PROVIDERS = dict(fused=fused, single=single, eager=eager)


def step(fn, q, d):
    q.grad = d.grad = None
    loss = fn(q, d)
    loss.backward()
    return loss


def run(benchmark, provider, B, rounds):
    q, d = make(B)
    fn = PROVIDERS[provider]
    with RssPeak() as mem:  # also the warm-up
        step(fn, q, d)
    benchmark.pedantic(step, args=(fn, q, d), rounds=rounds, iterations=1)
    ms = benchmark.stats.stats.min * 1e3
    note = f"dims {DIMS}, float32, symmetric=False; torch threads {torch.get_num_threads()}"
    if provider == "eager":
        _eager_bytes_per_pair[B] = mem.extra_mb * 2**20 / (B * B)
    if B >= 16384 and _eager_bytes_per_pair:
        b0 = max(_eager_bytes_per_pair)
        bpp = _eager_bytes_per_pair[b0]
        note += (f"; eager loop not run: it would need about {bpp * B * B / 2**30:.1f} GiB "
                 f"({bpp:.1f} bytes per pair measured at B = {b0})")
    benchmark.extra_info.update(extra_peak_mb=mem.extra_mb)
    record(CSV, op="matryoshka_infonce fwd+bwd", provider=provider, size=f"B=C={B} H={H} K=5", ms=ms,
           extra_peak_mb=mem.extra_mb, note=note + (f"; {ENV_NOTE}" if ENV_NOTE else ""))


@pytest.mark.parametrize("provider", ["single", "fused", "eager"])
def test_cpu_b2048(benchmark, provider):
    run(benchmark, provider, 2048, 3)


@pytest.mark.parametrize("provider", ["single", "fused", "eager"])
def test_cpu_b4096(benchmark, provider):
    run(benchmark, provider, 4096, 2)


@pytest.mark.parametrize("provider", ["single", "fused"])
def test_cpu_b16384(benchmark, provider):
    run(benchmark, provider, 16384, 1)
