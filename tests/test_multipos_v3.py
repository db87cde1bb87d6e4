"""The v3 kernels of the blocked multi-positive InfoNCE on the CUDA emulator: the statistics kernel
(TEMPOKERN_MPB_STATS=v3) and the gradient kernel (TEMPOKERN_MPB_GRAD=v3), both with four consecutive columns per
thread, vector loads (and the gradient's vector stores of dS), the next batch's loads in flight, no per-element
validity branches; float accumulation only, float64 calls run v1. Each kernel (the `v3k` fixture runs the shared
tests once per kernel) against tempokern.reference: float32 agreement with the float64 reference for the loss and
every gradient (no bias / table / exact bias, extra negatives, several row blocks, full and partial 1,024-column
tiles, rows that are and are not 16-byte aligned, fallbacks), the 2x-torch rule in float32 / float16 / bfloat16,
the grid at 132 / 108 / 58 / 1 SMs, the asymmetric loss; the statistics kernel's hardest-negative by-product with
its tie rule; both kernels together; independence of the thread order; the switches (v1 stays the default)."""
import pytest
import torch

import tempokern
import tempokern._ops.multipos_blocked as mpb

from test_multipos_blocked import assert_all_close, assert_two_x_rule, launch_spy, run_pair
from test_multipos_infonce import make
from test_multipos_stats_v2 import check_hardest_ties


# kernel -> (switch, the launch op it selects, the v1 op it replaces)
KERNELS = {"stats": ("TEMPOKERN_MPB_STATS", "fwd3", "fwd"), "grad": ("TEMPOKERN_MPB_GRAD", "bwd3", "bwd")}


@pytest.fixture
def v3(monkeypatch):
    return launch_spy(monkeypatch, "TEMPOKERN_MPB_STATS", "v3")


@pytest.fixture(params=sorted(KERNELS))
def v3k(request, monkeypatch):
    """Runs a test once per v3 kernel; yields the launches and asserts afterwards that the v3 op replaced v1's."""
    name, op, old = KERNELS[request.param]
    calls = launch_spy(monkeypatch, name, "v3")
    yield calls
    assert op in calls and old not in calls


def test_switches(monkeypatch):
    for name, variant in (("TEMPOKERN_MPB_STATS", mpb.stats_variant), ("TEMPOKERN_MPB_GRAD", mpb.grad_variant)):
        monkeypatch.delenv(name, raising=False)
        assert variant() == "v1"
        monkeypatch.setenv(name, "v3")
        assert variant() == "v3"
    monkeypatch.setenv("TEMPOKERN_MPB_GRAD", "v2")
    with pytest.raises(ValueError, match="TEMPOKERN_MPB_GRAD"):
        mpb.grad_variant()


def _f32_case(gpu, mode, B, H, N, rows, seed, spans="random"):
    q, d, sp, neg, b = make(B, H, N=N, bias=mode != "none", device=gpu, seed=seed, spans=spans)
    truth_pair = run_pair(q, d, sp, neg, b, pts=97 if mode == "table" else None, block_rows=rows)
    low = lambda t: None if t is None else t.detach().float().requires_grad_()  # noqa: E731
    b32 = None if b is None else tuple(low(t) for t in b)
    got, _ = run_pair(low(q), low(d), sp, low(neg), b32, pts=97 if mode == "table" else None, block_rows=rows)
    return got, truth_pair[1]


# B = 1,100: a full tile and a partial one (76 columns), rows 16-byte aligned (1,100 x 4 bytes); 1,101: rows not
# aligned (scalar loads); 70: only a partial tile; rows = 32: several row blocks (statistics merged across them)
V3_CASES = [("none", 1100, 6, 0, 0), ("table", 1101, 6, 3, 0), ("none", 1101, 6, 5, 32), ("none", 70, 10, 3, 0),
            ("table", 70, 10, 3, 0), ("exact", 70, 10, 3, 0), ("exact", 97, 12, 7, 32), ("none", 2048, 8, 0, 0)]


@pytest.mark.parametrize("mode,B,H,N,rows", V3_CASES)
def test_v3_float32_matches_reference(gpu, v3k, mode, B, H, N, rows):
    got, want = _f32_case(gpu, mode, B, H, N, rows, seed=B + len(mode))
    assert_all_close(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("spans", ["disjoint", "all"])
def test_v3_fallbacks_and_all_positive(gpu, v3k, spans):
    # every row / column falls back to its diagonal (disjoint), or every pair is a positive (all): the
    # diagonal test and the positive branches of the kernel
    got, want = _f32_case(gpu, "none", 1030, 6, 0, 0, seed=3, spans=spans)
    assert_all_close(got, want, rtol=2e-4, atol=2e-5)


def test_v3_float64_runs_v1(gpu, v3, monkeypatch):
    monkeypatch.setenv("TEMPOKERN_MPB_GRAD", "v3")
    q, d, sp, neg, b = make(300, 8, N=5, bias=True, device=gpu, seed=2)
    got, want = run_pair(q, d, sp, neg, b, pts=33)
    assert_all_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("sms", [132, 108, 58, 1])
def test_v3_at_other_sm_counts(gpu, v3k, monkeypatch, sms):
    monkeypatch.setattr(mpb, "sm_count", lambda device: sms)
    got, want = _f32_case(gpu, "table", 1100, 8, 5, 0, seed=sms)
    assert_all_close(got, want, rtol=2e-4, atol=2e-5)


def test_v3_asymmetric_row_loss(gpu, v3k):
    q, d, sp, neg, b = make(1100, 8, N=4, bias=False, device=gpu, seed=5)
    low = lambda t: t.detach().float().requires_grad_()  # noqa: E731
    got, _ = run_pair(low(q), low(d), sp, low(neg), None, symmetric=False)
    _, want = run_pair(q, d, sp, neg, None, symmetric=False)
    assert_all_close(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "table", "exact"])
def test_v3_two_x_torch_rule(gpu, v3k, dtype, mode):
    # loss and every gradient within 2x plain torch's own error in that dtype (as test_multipos_blocked)
    assert_two_x_rule(gpu, dtype, mode, seeds=(11, 12, 13) if mode != "none" else (11,))


@pytest.mark.parametrize("B", [40, 1030])
def test_v3_hardest_negative_and_ties(gpu, v3, B):
    check_hardest_ties(gpu, B, torch.float32)  # float32 (v3 takes float accumulation): integer scores stay exact
    assert "fwd3" in v3


def by_thread_order(cuda_emu, run, seeds=(0, 1, 2), warp_serial=(0, 1)):
    """run() on the CUDA emulator under each seeded thread order, then warp-serial (each warp runs alone up to its
    next __syncthreads, which catches a missing barrier between warps at different positions) last warp first (seed
    0) and in a seeded warp order: its outputs, one entry per seed of `seeds`, then of `warp_serial`."""
    from tempokern._ops.common import cuda_emulator
    outs = []
    try:
        for serial, ss in ((False, seeds), (True, warp_serial)):
            cuda_emu.emu_set_warp_serial(serial)
            for s in ss:
                cuda_emu.emu_set_seed(s)
                with cuda_emulator(cuda_emu):
                    outs.append(run())
    finally:
        cuda_emu.emu_set_seed(0)
        cuda_emu.emu_set_warp_serial(False)
    return outs


def test_v3_does_not_depend_on_thread_order(cuda_emu, monkeypatch):
    monkeypatch.setenv("TEMPOKERN_MPB_STATS", "v3")

    def run():
        q, d, sp, neg, b = make(1040, 8, N=3, bias=True, dtype=torch.float32, seed=4)
        return tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, extra_neg=neg,
                                          bias_table_points=65, return_hardest=True)
    outs = by_thread_order(cuda_emu, run)
    for o in outs[1:]:
        assert torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1])  # the forward has no atomics


def test_v3_statistics_and_gradients_together(gpu, v3, monkeypatch):
    monkeypatch.setenv("TEMPOKERN_MPB_GRAD", "v3")
    got, want = _f32_case(gpu, "table", 1100, 6, 3, 32, seed=9)
    assert_all_close(got, want, rtol=2e-4, atol=2e-5)
    assert "fwd3" in v3 and "bwd3" in v3


@pytest.mark.parametrize("mode", ["none", "exact"])
def test_v3_gradients_do_not_depend_on_thread_order(cuda_emu, monkeypatch, mode):
    # without the table's histogram atomics the backward has no order-dependent sums: bit-identical gradients
    monkeypatch.setenv("TEMPOKERN_MPB_GRAD", "v3")

    def run():
        q, d, sp, neg, b = make(1040, 8, N=3, bias=mode == "exact", dtype=torch.float32, seed=4)
        q.requires_grad_()
        d.requires_grad_()
        loss = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, extra_neg=neg)
        return torch.autograd.grad(loss, (q, d))
    outs = by_thread_order(cuda_emu, run)
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0]))
