"""The v3 gradient kernel of the blocked multi-positive InfoNCE (TEMPOKERN_MPB_GRAD=v3: four consecutive columns
per thread, vector loads of the score block and vector stores of dS, the next batch's loads in flight, no
per-element validity branches; float accumulation only, float64 calls run v1) on the CUDA emulator, against
tempokern.reference: float32 agreement with the float64 reference for the loss and every gradient (no bias /
table / exact bias, extra negatives, several row blocks, full and partial 1,024-column tiles, score rows that are
and are not 16-byte aligned, asymmetric loss), the 2x-torch rule in float32 / float16 / bfloat16 (dS stored in
the operands' dtype), the grid at 132 / 108 / 58 / 1 SMs, with the v3 statistics kernel, independence of the
thread order, and the switch (v1 stays the default)."""
import pytest
import torch

import tempokern
import tempokern._ops.multipos_blocked as mpb

from test_multipos_blocked import assert_all_close, assert_two_x_rule, launch_spy, run_pair
from test_multipos_infonce import make
from test_multipos_stats_v3 import V3_CASES, _f32_case


@pytest.fixture
def v3(monkeypatch):
    return launch_spy(monkeypatch, "TEMPOKERN_MPB_GRAD", "v3")


def test_switch(monkeypatch):
    monkeypatch.delenv("TEMPOKERN_MPB_GRAD", raising=False)
    assert mpb.grad_variant() == "v1"
    monkeypatch.setenv("TEMPOKERN_MPB_GRAD", "v3")
    assert mpb.grad_variant() == "v3"
    monkeypatch.setenv("TEMPOKERN_MPB_GRAD", "v2")
    with pytest.raises(ValueError, match="TEMPOKERN_MPB_GRAD"):
        mpb.grad_variant()


@pytest.mark.parametrize("mode,B,H,N,rows", V3_CASES)
def test_v3_float32_matches_reference(gpu, v3, mode, B, H, N, rows):
    got, want = _f32_case(gpu, mode, B, H, N, rows, seed=B + 2 * len(mode))
    assert_all_close(got, want, rtol=2e-4, atol=2e-5)
    assert "bwd3" in v3 and "bwd" not in v3


@pytest.mark.parametrize("spans", ["disjoint", "all"])
def test_v3_fallbacks_and_all_positive(gpu, v3, spans):
    # every row / column falls back to its diagonal (disjoint: the diagonal test dk), or every pair is positive
    got, want = _f32_case(gpu, "none", 1030, 6, 0, 0, seed=5, spans=spans)
    assert_all_close(got, want, rtol=2e-4, atol=2e-5)


def test_v3_with_v3_statistics(gpu, v3, monkeypatch):
    monkeypatch.setenv("TEMPOKERN_MPB_STATS", "v3")
    got, want = _f32_case(gpu, "table", 1100, 6, 3, 32, seed=9)
    assert_all_close(got, want, rtol=2e-4, atol=2e-5)
    assert "fwd3" in v3 and "bwd3" in v3


def test_v3_float64_runs_v1(gpu, v3):
    q, d, sp, neg, b = make(300, 8, N=5, bias=True, device=gpu, seed=2)
    got, want = run_pair(q, d, sp, neg, b, pts=33)
    assert_all_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("sms", [132, 108, 58, 1])
def test_v3_at_other_sm_counts(gpu, v3, monkeypatch, sms):
    monkeypatch.setattr(mpb, "sm_count", lambda device: sms)
    got, want = _f32_case(gpu, "table", 1100, 8, 5, 0, seed=sms + 1)
    assert_all_close(got, want, rtol=2e-4, atol=2e-5)


def test_v3_asymmetric_row_loss(gpu, v3):
    q, d, sp, neg, b = make(1100, 8, N=4, bias=False, device=gpu, seed=6)
    low = lambda t: t.detach().float().requires_grad_()  # noqa: E731
    got, _ = run_pair(low(q), low(d), sp, low(neg), None, symmetric=False)
    _, want = run_pair(q, d, sp, neg, None, symmetric=False)
    assert_all_close(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "table", "exact"])
def test_v3_two_x_torch_rule(gpu, v3, dtype, mode):
    # loss and every gradient within 2x plain torch's own error in that dtype (as test_multipos_blocked)
    assert_two_x_rule(gpu, dtype, mode, seeds=(11, 12, 13) if mode != "none" else (11,))
    assert "bwd3" in v3


@pytest.mark.parametrize("mode", ["none", "exact"])
def test_v3_does_not_depend_on_thread_order(cuda_emu, monkeypatch, mode):
    # without the table's histogram atomics the backward has no order-dependent sums: bit-identical gradients
    from tempokern._ops.common import cuda_emulator
    monkeypatch.setenv("TEMPOKERN_MPB_GRAD", "v3")
    outs = []
    try:
        for s in (0, 1, 2):
            cuda_emu.emu_set_seed(s)
            with cuda_emulator(cuda_emu):
                q, d, sp, neg, b = make(1040, 8, N=3, bias=mode == "exact", dtype=torch.float32, seed=4)
                q.requires_grad_()
                d.requires_grad_()
                loss = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, extra_neg=neg)
                outs.append(torch.autograd.grad(loss, (q, d)))
    finally:
        cuda_emu.emu_set_seed(0)
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0]))
