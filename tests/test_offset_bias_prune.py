"""The CUDA offset-bias kernels skip the hidden units proved always off and merge the always-on ones into one
linear unit (as the CPU kernels do), with the classification, the unit order and the count of evaluated units
kept on the device (no host sync): tempokern/_ops/offset_bias.py::_device_units, `active_units` in
csrc/offset_bias/offset_bias_kernels.cuh. Checked against tempokern.reference in float64 (output and all seven
gradients) and with poisoned weights in the slots the kernels must not read; the merged unit is evaluated in
float64, so that the exact-bias loss's d/d scale keeps the float32 2x-torch rule
(test_merged_unit_keeps_the_two_x_rule)."""
import pytest
import torch

import tempokern
import tempokern._ops.offset_bias as ob
from tempokern import reference as ref

NAMES = ("u_q", "u_d", "w1", "b1", "w2", "b2", "scale")


def weights(hidden, D, n_on, n_off, seed):
    """Random MLP weights with n_on units forced always on and n_off always off (large |b1|), at shuffled
    positions; the rest random (mostly sign-changing over delta in [-1, 1])."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(hidden, D, generator=g, dtype=torch.float64) * 0.8
    b1 = torch.randn(hidden, generator=g, dtype=torch.float64) * 0.05
    pos = torch.randperm(hidden, generator=g)
    b1[pos[:n_on]] = 20.0
    b1[pos[n_on:n_on + n_off]] = -20.0
    w2 = torch.randn(1, hidden, generator=g, dtype=torch.float64)
    b2 = torch.randn(1, generator=g, dtype=torch.float64)
    return w1, b1, w2, b2, torch.tensor(0.7, dtype=torch.float64)


def run(dev, uq, ud, params, gout):
    ins = [t.to(dev).clone().requires_grad_() for t in (uq, ud, *params)]
    out = tempokern.offset_bias(*ins)
    grads = torch.autograd.grad((out * gout.to(dev)).sum(), ins)
    return [out.detach().cpu()] + [x.cpu() for x in grads]


def reference(uq, ud, params, gout):
    ins = [t.clone().requires_grad_() for t in (uq, ud, *params)]
    out = ref.offset_bias(*ins)
    return [out.detach()] + list(torch.autograd.grad((out * gout).sum(), ins))


CASES = [(9, 8, 3, 3), (32, 32, 10, 12), (17, 33, 0, 0), (12, 7, 12, 0), (12, 7, 0, 12), (5, 1, 2, 2)]


@pytest.mark.parametrize("hidden,D,n_on,n_off", CASES)
def test_pruned_kernels_match_reference_float64(gpu, monkeypatch, hidden, D, n_on, n_off):
    params = weights(hidden, D, n_on, n_off, seed=hidden + D)
    g = torch.Generator().manual_seed(3)
    uq = torch.rand(37, generator=g, dtype=torch.float64) * 1.6 - 0.3   # deltas beyond +-1: the clamp too
    ud = torch.rand(70, generator=g, dtype=torch.float64) * 1.6 - 0.3
    gout = torch.randn(37, 70, generator=g, dtype=torch.float64)
    got, want = run(gpu, uq, ud, params, gout), reference(uq, ud, params, gout)
    for name, a, b in zip(("out",) + NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=name)
    on, off = ob._unit_classes(params[0].to(gpu), params[1].to(gpu), gpu)
    on_cpu, off_cpu = ob._unit_classes(params[0], params[1])
    assert torch.equal(on.cpu(), on_cpu) and torch.equal(off.cpu(), off_cpu)   # the CPU path's classes
    assert int(on.sum()) >= n_on and int(off.sum()) >= n_off
    *_, nact, mapping, _ = ob._prepared(*[t.to(gpu) for t in (uq, ud, *params)])
    assert int(nact) == ob.N_LINEAR_SLOTS + hidden - int(on.sum()) - int(off.sum()) and mapping[0] == "device"


def test_unevaluated_slots_are_not_read(gpu, monkeypatch):
    # slots past the device count get b1 = +inf, w2 = 1: read by the forward they make the output infinite,
    # by the backward they give the always-off units a gradient; neither may happen
    params = weights(16, 12, 5, 6, seed=5)
    real = ob._device_units

    def poisoned(*a):
        kw1, kb1, kw2, nact, mapping = real(*a)
        n = int(nact)
        assert n < kw1.shape[0]
        kb1, kw2 = kb1.clone(), kw2.clone()
        kb1[n:] = float("inf")
        kw2[n:] = 1.0
        return kw1, kb1, kw2, nact, mapping
    g = torch.Generator().manual_seed(4)
    uq, ud = torch.rand(21, generator=g, dtype=torch.float64), torch.rand(40, generator=g, dtype=torch.float64)
    gout = torch.randn(21, 40, generator=g, dtype=torch.float64)
    want = run(gpu, uq, ud, params, gout)
    monkeypatch.setattr(ob, "_device_units", poisoned)
    got = run(gpu, uq, ud, params, gout)
    for name, a, b in zip(("out",) + NAMES, got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    _, off = ob._unit_classes(params[0], params[1])
    assert off.any() and (got[3][off] == 0).all() and (got[5][0, off] == 0).all()   # d w1, d w2 of off units


def test_n_active_is_rejected_on_the_cpu_kernels():
    from tempokern._ops.common import kernels
    n = torch.ones(1, dtype=torch.int32)
    with pytest.raises(Exception, match="n_active"):
        kernels().offset_bias_launch("fwd", -1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0,
                                     1, 0, 0, 0, n.data_ptr())


def test_merged_unit_keeps_the_two_x_rule(gpu, monkeypatch):
    # the draw that kept merging opt-in (seed 11 of test_multipos_blocked's exact-bias 2x-rule test at B = 96:
    # all five units merge or drop, so the merged linear unit carries the whole MLP): d/d scale with the
    # uncentred float32 merged unit was 3.3e-5 against torch's 9.6e-6 (bound 2 x 9.6e-6 + sqrt(pairs) eps =
    # 3.05e-5) and 1.4e-5 without merging. The centred unit must keep the rule on that draw, and the bias itself
    # be no further from float64 than torch float32's own formula.
    from test_multipos_blocked import _two_x_errors
    from test_multipos_infonce import make
    eps = torch.finfo(torch.float32).eps
    fused, plain = _two_x_errors(gpu, torch.float32, "exact", 11, B=96)
    assert fused[10] <= 2 * plain[10] + 96 * eps, (fused[10], plain[10])
    q, d, sp, neg, b = make(96, 32, N=9, bias=True, dtype=torch.float64, seed=11, u_lo=0.0, u_hi=1.0)
    on, off = ob._unit_classes(b[2], b[3])
    assert bool((on | off).all())
    truth = tempokern.reference.offset_bias(*b)
    got = torch.ops.tempokern.offset_bias(*(t.float().to(gpu) for t in b)).double().cpu()
    plain32 = tempokern.reference.offset_bias(*(t.float() for t in b)).double()
    err = lambda y: (y - truth).pow(2).mean().sqrt().item()  # noqa: E731
    assert err(got) <= 1.5 * err(plain32), (err(got), err(plain32))
