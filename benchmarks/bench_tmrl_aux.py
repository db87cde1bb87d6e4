"""TMRL's auxiliary losses (plain torch, design notes §2.3 K2) at the paper's batch, forward + backward.

Run: OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_tmrl_aux.py --benchmark-columns=median,min,max
(one thread: on a shared, overloaded machine two OpenMP threads spend most of their time waiting for each other)
Paper batch: B = 256 queries, 4 hard-negative passages and 4 negative queries per row, so the
self-distillation terms see N = B * (2 + 4 + 4) = 2,560 embeddings of d = 768, dims (64, 128, 256, 512, 768);
L_Temp has B = 256 passages, 1 + 4 query candidates, t = 64. Flops (per fwd): L_Dist teacher 2 N^2 d = 10.1 GFLOP
+ 2 N k m per level; L_CKA feature form 2 N d^2 = 3.0 GFLOP once + 2 N (d m + m^2) per level
(sum over the 4 student levels: 2 N * (768 * 960 + 348,160) = 5.6 GFLOP); Gram form 2 N^2 d = 10 GFLOP once
+ 2 N^2 m per level (12.7 GFLOP)."""
import pytest
import torch

from tempokern.nn import MatryoshkaCKALoss, MatryoshkaDistillLoss, TemporalSubspaceLoss

DIMS = (64, 128, 256, 512, 768)
B, K, KQ, D, T = 256, 4, 4, 768, 64
N = B * (2 + K + KQ)


def _x(n, d, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)


def _fwd_bwd(loss_fn, *xs):
    def run():
        for x in xs:
            x.grad = None
        loss_fn().backward()
    return run


@pytest.mark.parametrize("form", ["feature", "gram"])
def test_cka(benchmark, form):
    x = _x(N, D)
    mod = MatryoshkaCKALoss(DIMS, form=form)
    benchmark.pedantic(_fwd_bwd(lambda: mod(x), x), rounds=3, warmup_rounds=1)


def test_distill(benchmark):
    x = _x(N, D)
    mod = MatryoshkaDistillLoss(DIMS, k=10)
    benchmark.pedantic(_fwd_bwd(lambda: mod(x), x), rounds=3, warmup_rounds=1)


def test_temporal_subspace(benchmark):
    p, pT, qc, qcT = _x(B, D, 1), _x(B, T, 2), _x(B * (1 + KQ), D, 3), _x(B * (1 + KQ), T, 4)
    mod = TemporalSubspaceLoss(T, 0.05)
    run = lambda: mod(p, pT, None, qc.view(B, 1 + KQ, D), qcT.view(B, 1 + KQ, T), None)  # noqa: E731
    benchmark.pedantic(_fwd_bwd(run, p, pT, qc, qcT), rounds=3, warmup_rounds=1)
