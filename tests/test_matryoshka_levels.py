"""tempokern.matryoshka_infonce's default CUDA execution (the levels path, tempokern/_ops/dispatch.py): for calls without a bias
and with B == B', one fused multipos_infonce per level on the truncated, normalised embeddings (the reference's
loop with tempokern's blocked CUDA loss per level); other calls take the fused Matryoshka kernels. Checked on
the CUDA emulator (and a GPU where there is one) against tempokern.reference.matryoshka_infonce: float64
parity of the loss, the levels and every gradient, the 2x-torch rule in float32 and bfloat16, and which path
each call takes."""
import pytest
import torch

import tempokern
import tempokern._ops.matryoshka_blocked as mb
import tempokern._ops.routing as routing
from tempokern.reference import matryoshka_infonce as ref

from test_matryoshka_infonce import make, make_bias, run_both


@pytest.fixture
def paths(monkeypatch):
    """Counts multipos_infonce calls made by the levels path and fused-kernel launches."""
    seen = {"levels": 0, "fused": 0}
    real_mp, real_launch = routing.multipos_infonce_partial, mb._Fused.launch

    def mp(*a, **k):
        seen["levels"] += 1
        return real_mp(*a, **k)

    def launch(self, *a, **k):
        seen["fused"] += 1
        return real_launch(self, *a, **k)
    monkeypatch.setattr(routing, "multipos_infonce_partial", mp)  # the levels path's per-level loss
    monkeypatch.setattr(mb._Fused, "launch", launch)
    return seen


def dev(gpu, q, d, neg, sp):
    mv = lambda t: None if t is None else t.to(gpu)  # noqa: E731
    return mv(q), mv(d), mv(neg), {k: tuple(t.to(gpu) for t in v) for k, v in sp.items()}


CASES = [  # (B, N, spans, symmetric, dims, weights, normalize)
    (70, 0, None, False, (33, 8, 50, 20), (2.0, 1.0, 0.0, 0.5), True),
    (64, 9, "random", True, (8, 50), None, True),
    (45, 5, None, True, (16, 32, 50), (1.0, 0.0, 3.0), False),
    (1, 0, "random", False, (4, 50), None, True),
    (300, 11, "random", False, (10, 25, 50), (0.5, 1.0, 1.0), True),
]


@pytest.mark.parametrize("B,N,spans,symmetric,dims,weights,normalize", CASES)
def test_levels_path_matches_reference_float64(gpu, paths, B, N, spans, symmetric, dims, weights, normalize):
    q, d, neg, sp = dev(gpu, *make(B, 50, N=N, spans=spans, seed=B + N))
    lw = torch.linspace(-0.5, 1.0, len(dims), dtype=torch.float64)  # upstream gradient of the returned levels
    res = run_both(q, d, neg, sp, dims, weights=weights, temperature=0.07, symmetric=symmetric, level_w=lw,
                   normalize=normalize)
    (lf, vf, gf), (lr, vr, gr) = res
    torch.testing.assert_close(lf.cpu(), lr.cpu(), rtol=0, atol=1e-9)
    torch.testing.assert_close(vf.cpu(), vr.cpu(), rtol=0, atol=1e-9)
    for a, b in zip(gf, gr):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=1e-9)
    assert paths["levels"] == len(dims) and paths["fused"] == 0   # every level (return_levels), no fused kernel


def test_zero_weight_level_is_skipped_without_return_levels(gpu, paths):
    q, d, neg, sp = dev(gpu, *make(40, 50, N=0, spans=None, seed=3))
    qa, da = q.clone().requires_grad_(), d.clone().requires_grad_()
    loss = tempokern.matryoshka_infonce(qa, da, (8, 20, 50), weights=(1.0, 0.0, 2.0), temperature=0.1)
    want = ref(q, d, (8, 20, 50), weights=(1.0, 0.0, 2.0), temperature=0.1)
    torch.testing.assert_close(loss.cpu(), want.cpu(), rtol=0, atol=1e-9)
    assert paths["levels"] == 2
    loss.backward()
    assert torch.isfinite(qa.grad).all() and torch.isfinite(da.grad).all()


def test_calls_the_levels_path_cannot_take_go_to_the_fused_kernels(gpu, paths):
    # a bias (evaluated once for all levels there) and B != B' (multipos_infonce is square)
    q, d, neg, sp = dev(gpu, *make(30, 50, N=0, spans="random", seed=4))
    bias = tuple(t.to(gpu) for t in make_bias(30, 30, seed=5))
    tempokern.matryoshka_infonce(q, d, (8, 50), temperature=0.1, bias=bias, **sp)
    assert paths == {"levels": 0, "fused": paths["fused"]} and paths["fused"] > 0
    n = paths["fused"]
    q2, d2, _, _ = dev(gpu, *make(20, 50, Bd=35, N=0, spans=None, seed=6))
    tempokern.matryoshka_infonce(q2, d2, (8, 50), temperature=0.1)
    assert paths["levels"] == 0 and paths["fused"] > n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_x_torch_rule(gpu, paths, dtype):
    # loss, levels and the q, d, extra_neg gradients within twice plain torch's own error in that dtype
    q, d, neg, sp = make(96, 48, N=7, spans="random", seed=8)
    dims, kw = (8, 24, 48), dict(temperature=0.1, symmetric=True, level_w=torch.tensor([0.5, 0.0, 1.0]))
    exact = run_both(q, d, neg, sp, dims, **kw)[1]
    low = [t.to(dtype) for t in (q, d, neg)]
    plain = run_both(*low, sp, dims, **kw)[1]
    n0 = paths["levels"]
    fused = run_both(*dev(gpu, *low, sp), dims, **kw)[0]
    eps = torch.finfo(dtype).eps
    for k, (f, p, e) in enumerate(zip([fused[0], fused[1], *fused[2]], [plain[0], plain[1], *plain[2]],
                                      [exact[0], exact[1], *exact[2]])):
        ef = (f.double().cpu() - e.double()).abs().max().item()
        et = (p.double() - e.double()).abs().max().item()
        assert ef <= 2 * et + 4 * eps, f"output {k}: fused {ef:.2e} vs torch {et:.2e}"
    assert paths["levels"] - n0 == len(dims)
