"""bias=(u_q, u_d, module): the fused ops accept the OffsetBias module users hold.

Checked against tempokern.reference (plain PyTorch) given the module's parameters as the 7-tuple, forward and
every gradient in float64; the gradients must land on the module's own parameters."""
import pytest
import torch

import tempokern
from tempokern.nn import OffsetBias
from tempokern.reference import ctd_topk as ref_topk
from tempokern.reference import multipos_infonce as ref_loss


def module(features=7, hidden=5, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    m = OffsetBias(features, hidden).to(dtype)
    with torch.no_grad():
        m.scale.fill_(0.8)  # the default 0 would give the MLP zero gradients, hiding a detached path
    return m


def batch(B=12, H=6, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, generator=g, dtype=dtype, requires_grad=True)
    d = torch.randn(B, H, generator=g, dtype=dtype, requires_grad=True)
    qs, ds = torch.randint(0, 40, (B,), generator=g), torch.randint(0, 40, (B,), generator=g)
    spans = ((qs, qs + torch.randint(0, 6, (B,), generator=g)), (ds, ds + torch.randint(0, 6, (B,), generator=g)))
    u_q = torch.empty(B, dtype=dtype).uniform_(-0.5, 1.5, generator=g).requires_grad_()
    u_d = torch.empty(B, dtype=dtype).uniform_(-0.5, 1.5, generator=g).requires_grad_()
    return q, d, spans, u_q, u_d


def params(m):
    return [m.mlp[0].weight, m.mlp[0].bias, m.mlp[2].weight, m.mlp[2].bias, m.scale]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("table_points", [None, 65])
def test_multipos_module_form_matches_reference_and_reaches_parameters(symmetric, table_points):
    m = module()
    q, d, spans, u_q, u_d = batch()
    loss = tempokern.multipos_infonce(q, d, *spans, temperature=0.1, bias=(u_q, u_d, m), symmetric=symmetric,
                                      bias_table_points=table_points)
    ins = [q, d, u_q, u_d, *params(m)]
    got = torch.autograd.grad(loss, ins)
    for name, g in zip(("q", "d", "u_q", "u_d", "w1", "b1", "w2", "b2", "scale"), got):
        assert g is not None and bool(torch.isfinite(g).all()), name
    for p, g in zip(params(m), got[4:]):
        assert g.shape == p.shape and float(g.abs().max()) > 0, "the module's parameters must get gradients"

    # the same call with the 7-tuple of the module's parameters: the same numbers
    seven = (u_q, u_d, *params(m))
    loss7 = tempokern.multipos_infonce(q, d, *spans, temperature=0.1, bias=seven, symmetric=symmetric,
                                       bias_table_points=table_points)
    assert torch.equal(loss, loss7)
    for a, b in zip(got, torch.autograd.grad(loss7, ins)):
        assert torch.equal(a, b)

    if table_points is None:  # the spec: plain PyTorch on independent leaf copies of the parameters
        leaves = [t.detach().clone().requires_grad_() for t in ins]
        rl = ref_loss(leaves[0], leaves[1], *spans, temperature=0.1, bias=tuple(leaves[2:]), symmetric=symmetric)
        torch.testing.assert_close(loss, rl, rtol=1e-10, atol=1e-12)
        for a, b in zip(got, torch.autograd.grad(rl, leaves)):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_multipos_module_form_backward_fills_module_grads():
    # what a training loop does: loss.backward() then an optimizer step over module.parameters()
    m = module()
    q, d, spans, u_q, u_d = batch()
    tempokern.multipos_infonce(q, d, *spans, temperature=0.1, bias=(u_q, u_d, m)).backward()
    assert all(p.grad is not None and float(p.grad.abs().max()) > 0 for p in m.parameters())


def test_multipos_module_form_float32():
    m = module(dtype=torch.float32)
    q, d, spans, u_q, u_d = batch(dtype=torch.float32)
    loss = tempokern.multipos_infonce(q, d, *spans, temperature=0.1, bias=(u_q, u_d, m))
    seven = tuple(t.detach().double() for t in (u_q, u_d, *params(m)))
    rl = ref_loss(q.detach().double(), d.detach().double(), *spans, temperature=0.1, bias=seven)
    torch.testing.assert_close(loss.double(), rl, rtol=1e-5, atol=1e-5)


def test_multipos_bad_bias_forms_are_type_errors():
    m = module()
    q, d, spans, u_q, u_d = batch()
    f = lambda bias: tempokern.multipos_infonce(q, d, *spans, temperature=0.1, bias=bias)  # noqa: E731
    with pytest.raises(TypeError, match=r"got the module alone: pass bias=\(u_q, u_d, module\)"):
        f(m)
    with pytest.raises(TypeError, match="third item is a BiasTable.*the loss needs the module"):
        f((u_q, u_d, m.table(17)))
    with pytest.raises(TypeError, match="third item is a Tensor"):
        f((u_q, u_d, torch.randn(9)))
    with pytest.raises(TypeError, match="third item is a Linear"):
        f((u_q, u_d, torch.nn.Linear(3, 3)))
    with pytest.raises(TypeError, match=r"\(u_q, u_d, module\).*7-tuple.*got tuple of length 2"):
        f((u_q, u_d))
    with pytest.raises(TypeError, match="got dict"):
        f({"u_q": u_q})
    with pytest.raises(ValueError, match=r"bias u_q must have shape \(12,\)"):
        f((u_q[:5], u_d, m))
    with pytest.raises(ValueError, match=r"bias w1 must be \(hidden, D\)"):  # the module's own shapes are checked
        bad = module()
        bad.mlp[0].weight = torch.nn.Parameter(torch.randn(5, 7, 1, dtype=torch.float64))
        f((u_q, u_d, bad))


def test_ctd_loss_still_takes_the_module():
    # CTDLoss holds the module itself and builds the 7-tuple: unchanged, and equal to the module form here
    m = module()
    q, d, spans, u_q, u_d = batch()
    crit = tempokern.nn.CTDLoss(temperature=0.1, offset_bias=m, normalize=False)
    a = crit(q, d, *spans, u_q, u_d)
    b = tempokern.multipos_infonce(q, d, *spans, temperature=0.1, bias=(u_q, u_d, m))
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ctd_topk_module_form_matches_reference(dtype):
    m = module(features=8, hidden=6, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    q, gal = torch.randn(5, 16, generator=g, dtype=dtype), torch.randn(300, 16, generator=g, dtype=dtype)
    u_q, u_g = torch.rand(5, generator=g, dtype=dtype), torch.rand(300, generator=g, dtype=dtype)
    v, i = tempokern.ctd_topk(q, gal, 7, temperature=0.5, bias=(u_q, u_g, m))
    seven = (u_q, u_g, *(p.detach() for p in params(m)))
    rv, ri = ref_topk(q, gal, 7, temperature=0.5, bias=seven)
    torch.testing.assert_close(v, rv, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-4)
    assert torch.equal(i, ri)
    v7, i7 = tempokern.ctd_topk(q, gal, 7, temperature=0.5, bias=seven)
    assert torch.equal(v, v7) and torch.equal(i, i7)


def test_ctd_topk_bad_module_forms():
    m = module()
    q, gal = torch.randn(2, 4, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
    u_q, u_g = torch.rand(2, dtype=torch.float64), torch.rand(9, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"got the module alone: pass bias=\(u_q, u_g, module\)"):
        tempokern.ctd_topk(q, gal, 2, bias=m)
    with pytest.raises(TypeError, match="third item is a Linear module"):
        tempokern.ctd_topk(q, gal, 2, bias=(u_q, u_g, torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"bias u_g must have shape \(9,\)"):
        tempokern.ctd_topk(q, gal, 2, bias=(u_q, u_g[:3], m))
