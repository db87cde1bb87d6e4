"""ctd_topk's group filter (q_group / g_group): each query ranks only its group's gallery rows; against the
reference (the full matrix with other groups' rows masked, then a stable sort) on CPU and on the CUDA path
(emulator / GPU), with no, exact and table bias, exclude lists, float64 and float32."""
import pytest
import torch

import tempokern
from tempokern.nn import OffsetBias
from tempokern.reference import ctd_topk as ref_topk

from test_ctd_topk import make_bias


def case(Q, N, H, ngroups, dtype=torch.float64, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(Q, H, generator=gen, dtype=torch.float64).to(dtype).to(device)
    g = torch.randn(N, H, generator=gen, dtype=torch.float64).to(dtype).to(device)
    qg = torch.randint(0, ngroups, (Q,), generator=gen).to(device)
    gg = torch.randint(0, ngroups, (N,), generator=gen).to(device)
    return q, g, qg, gg


def bias_of(mode, Q, N, dtype, device):
    if mode == "none":
        return None
    b = make_bias(Q, N, dtype=dtype, device=device, hidden=8, D=8, seed=3)
    if mode == "exact":
        return b
    torch.manual_seed(0)
    ob = OffsetBias(features=8, hidden=8)
    with torch.no_grad():
        ob.scale.fill_(0.5)
    return (b[0], b[1], ob.table(257).to(device))


def check(q, g, k, qg, gg, **kw):
    v, i = tempokern.ctd_topk(q, g, k, q_group=qg, g_group=gg, **kw)
    rv, ri = ref_topk(q, g, k, q_group=qg, g_group=gg, **kw)
    torch.testing.assert_close(v.cpu(), rv.cpu(), atol=1e-9 if q.dtype == torch.float64 else 1e-4, rtol=0)
    if q.dtype == torch.float64:
        assert torch.equal(i.cpu(), ri.cpu())
    ok = i >= 0
    assert bool((gg[i.clamp_min(0)] == qg[:, None])[ok].all())   # only the query's own group
    return v, i


@pytest.mark.parametrize("mode", ["none", "exact", "table"])
@pytest.mark.parametrize("Q,N,k,ng", [(9, 60, 5, 3), (5, 40, 40, 4), (1, 1, 1, 1), (12, 90, 7, 30)])
def test_group_filter_matches_reference(mode, Q, N, k, ng):
    q, g, qg, gg = case(Q, N, 16, ng, seed=Q + N)
    v, i = check(q, g, k, qg, gg, temperature=0.3, bias=bias_of(mode, Q, N, torch.float64, "cpu"))
    # a group smaller than k: its tail is (-inf, -1)
    for r in range(Q):
        n = int((gg == qg[r]).sum())
        assert int((i[r] >= 0).sum()) == min(k, n)


def test_group_filter_with_exclude_and_float32():
    q, g, qg, gg = case(10, 70, 24, 3, dtype=torch.float32, seed=5)
    gen = torch.Generator().manual_seed(1)
    ex = torch.randint(-1, 70, (10, 6), generator=gen)
    check(q, g, 6, qg, gg, temperature=0.2, exclude=ex)
    check(q, g, 6, qg, gg, temperature=0.2, exclude=ex, bias=bias_of("exact", 10, 70, torch.float32, "cpu"))


def test_group_without_gallery_rows():
    q, g, _, _ = case(3, 8, 4, 1)
    v, i = tempokern.ctd_topk(q, g, 2, q_group=torch.tensor([0, 7, 0]), g_group=torch.zeros(8, dtype=torch.int64))
    assert torch.equal(i[1], torch.tensor([-1, -1])) and bool(torch.isinf(v[1]).all())
    assert bool((i[[0, 2]] >= 0).all())


def test_bad_group_inputs():
    q, g, qg, gg = case(4, 10, 4, 2)
    f = tempokern.ctd_topk
    with pytest.raises(ValueError, match="q_group was given without g_group"):
        f(q, g, 2, q_group=qg)
    with pytest.raises(ValueError, match="g_group was given without q_group"):
        f(q, g, 2, g_group=gg)
    with pytest.raises(ValueError, match="g_group has length 9"):
        f(q, g, 2, q_group=qg, g_group=gg[:9])
    with pytest.raises(TypeError, match="q_group must be an integer tensor"):
        f(q, g, 2, q_group=qg.double(), g_group=gg)
    with pytest.raises(ValueError, match="g_group must be on"):
        f(q, g, 2, q_group=qg, g_group=gg.to("meta"))


@pytest.mark.parametrize("mode", ["none", "exact", "table"])
def test_cuda_group_filter_matches_reference(gpu, mode):
    q, g, qg, gg = case(9, 120, 40, 3, seed=9, device=gpu)
    gen = torch.Generator().manual_seed(2)
    ex = torch.randint(-1, 120, (9, 4), generator=gen).to(gpu)
    check(q, g, 8, qg, gg, temperature=0.25, exclude=ex, bias=bias_of(mode, 9, 120, torch.float64, gpu))
    q32, g32 = q.float(), g.float()
    check(q32, g32, 8, qg, gg, temperature=0.25, bias=bias_of(mode, 9, 120, torch.float32, gpu))
