"""The v2 statistics kernel of the blocked multi-positive InfoNCE (TEMPOKERN_MPB_STATS=v2: a shared-memory
score tile, a warp per row) on the CUDA emulator, against tempokern.reference: float64 parity of the loss and
every gradient (no bias / table / exact bias, extra negatives, several blocks, partial tiles), the grid at
132 / 108 / 58 / 1 SMs, the 2x-torch rule in float32 / float16 / bfloat16, the hardest-negative by-product with
its tie rule, and the switch itself (v1 stays the default; a bad value is a ValueError)."""
import pytest
import torch

import tempokern
import tempokern._ops.multipos_blocked as mpb
from tempokern.reference import multipos_infonce as ref

from test_multipos_blocked import assert_all_close, assert_two_x_rule, launch_spy, run_pair
from test_multipos_infonce import make


@pytest.fixture
def v2(monkeypatch):
    return launch_spy(monkeypatch, "TEMPOKERN_MPB_STATS", "v2")


def test_switch_default_and_validation(monkeypatch):
    monkeypatch.delenv("TEMPOKERN_MPB_STATS", raising=False)
    assert mpb.stats_variant() == "v1"  # the measured kernel stays the default
    monkeypatch.setenv("TEMPOKERN_MPB_STATS", "V2")
    assert mpb.stats_variant() == "v2"
    monkeypatch.setenv("TEMPOKERN_MPB_STATS", "v4")
    with pytest.raises(ValueError, match="TEMPOKERN_MPB_STATS"):
        mpb.stats_variant()


V2_CASES = [(m, 70, 10, 3, 0) for m in ("none", "table", "exact")] + \
    [(m, 1100, 6, 0, 0) for m in ("none", "table")] + [(m, 97, 12, 7, 32) for m in ("none", "table", "exact")]


@pytest.mark.parametrize("mode,B,H,N,rows", V2_CASES)
def test_v2_matches_reference_float64(gpu, v2, mode, B, H, N, rows):
    # B = 1,100: two column tiles (the second partial: 76 columns), a row tile not a multiple of 8;
    # rows = 32: several row blocks merged across blocks. (The exact bias's MLP at 1,100^2 pairs is slow on
    # the emulator: exact mode at B = 70 / 97.)
    q, d, sp, neg, b = make(B, H, N=N, bias=mode != "none", device=gpu, seed=B + len(mode))
    got, want = run_pair(q, d, sp, neg, b, pts=97 if mode == "table" else None, block_rows=rows)
    assert_all_close(got, want, rtol=1e-9, atol=1e-10)
    assert "fwd2" in v2 and "fwd" not in v2


@pytest.mark.parametrize("sms", [132, 108, 58, 1])
def test_v2_at_other_sm_counts(gpu, v2, monkeypatch, sms):
    monkeypatch.setattr(mpb, "sm_count", lambda device: sms)
    q, d, sp, neg, b = make(300, 8, N=5, bias=True, device=gpu, seed=sms)
    got, want = run_pair(q, d, sp, neg, b, pts=33)
    assert_all_close(got, want, rtol=1e-9, atol=1e-10)
    TR, nct, nrt = mpb.tiling(300, 300, gpu)
    assert nrt == -(-300 // TR) and TR % 32 == 0 and nct * nrt >= min(4 * sms, -(-300 // 32))
    assert "fwd2" in v2


def test_v2_asymmetric_row_loss(gpu, v2):
    # cols = False: the column phase is skipped
    q, d, sp, neg, b = make(90, 8, N=4, bias=False, device=gpu, seed=5)
    got, want = run_pair(q, d, sp, neg, b, symmetric=False)
    assert_all_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "table"])
def test_v2_two_x_torch_rule(gpu, v2, dtype, mode):
    # loss and every gradient within 2x plain torch's own error in that dtype (as test_multipos_blocked)
    assert_two_x_rule(gpu, dtype, mode, seeds=(11, 12, 13) if mode != "none" else (11,))
    assert "fwd2" in v2


def _hardest_literal(q, d, q_span, d_span, temperature):
    """The hardest negative written out: the largest q_i . d_j / tau over columns j that are not positives of
    row i (no interval overlap, and not the diagonal fallback of a row without any overlap), lowest j on ties,
    -1 for a row without negatives."""
    x = (q @ d.t()) / temperature
    (qlo, qhi), (dlo, dhi) = q_span, d_span
    ov = torch.maximum(qlo[:, None], dlo[None, :]) <= torch.minimum(qhi[:, None], dhi[None, :])
    none = ~ov.any(1)
    eye = torch.eye(q.shape[0], d.shape[0], dtype=torch.bool)
    neg = ~(ov | (none[:, None] & eye))
    best = x.masked_fill(~neg, -torch.inf).max(1, keepdim=True).values
    cols = torch.arange(d.shape[0]).expand_as(x)
    first = torch.where(neg & (x == best), cols, d.shape[0]).min(1).values
    return torch.where(neg.any(1), first, -1)


def check_hardest_ties(gpu, B, dtype):
    """Small integer embeddings: every score is an exact integer, so exact ties are everywhere (inside a thread's
    or lane's columns, across them and across the two column tiles at B = 1,030); the lowest column must win.
    Temperature 0.5: x = 2 s exactly in the kernel and in the literal (float32 or float64 alike)."""
    g = torch.Generator().manual_seed(B)
    H = 4
    q = torch.randint(-2, 3, (B, H), generator=g).to(dtype)
    d = torch.randint(-2, 3, (B, H), generator=g).to(dtype)
    lo = torch.randint(0, 80, (B,), generator=g)
    q_span = (lo, lo + torch.randint(0, 3, (B,), generator=g))
    lo2 = torch.randint(0, 80, (B,), generator=g)
    d_span = (lo2, lo2 + torch.randint(0, 3, (B,), generator=g))
    loss, hard = tempokern.multipos_infonce(q.to(gpu), d.to(gpu), tuple(t.to(gpu) for t in q_span),
                                            tuple(t.to(gpu) for t in d_span), temperature=0.5, return_hardest=True)
    want_loss = ref(q.double(), d.double(), q_span, d_span, temperature=0.5)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.cpu().double(), want_loss, **tol)
    want = _hardest_literal(q.double(), d.double(), q_span, d_span, 0.5)
    assert (want >= 0).all()
    assert torch.equal(hard.cpu(), want)


@pytest.mark.parametrize("B", [40, 1030])
def test_v2_hardest_negative_and_ties(gpu, v2, B):
    check_hardest_ties(gpu, B, torch.float64)
    assert "fwd2" in v2


def _v2_outputs(B, dtype, g_seed):
    g = torch.Generator().manual_seed(g_seed)
    q, d = (torch.randn(B, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(2))
    lo = torch.randint(0, 40, (B,), generator=g)
    u = tuple(torch.rand(B, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(2))
    mlp = tuple(torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
                for s in ((5, 7), (5,), (1, 5), (1,)))
    bias = (*u, *mlp, torch.tensor(0.5, dtype=dtype).requires_grad_())
    loss, hard = tempokern.multipos_infonce(q, d, (lo, lo + 2), (lo.flip(0), lo.flip(0) + 1), temperature=0.1,
                                            bias=bias, bias_table_points=65, return_hardest=True)
    return [loss.detach(), hard, *torch.autograd.grad(loss, [q, d, *bias])]


def test_v2_does_not_depend_on_thread_order(cuda_emu, monkeypatch):
    # every thread reaches each barrier in a seeded random order: a missing __syncthreads around the shared
    # tile (staging -> rows -> columns -> next stage) changes the statistics
    from tempokern._ops.common import cuda_emulator
    monkeypatch.setenv("TEMPOKERN_MPB_STATS", "v2")
    outs = []
    try:
        for s in (0, 1, 2):
            cuda_emu.emu_set_seed(s)
            with cuda_emulator(cuda_emu):
                outs.append(_v2_outputs(1040, torch.float64, 4))
    finally:
        cuda_emu.emu_set_seed(0)
    for o in outs[1:]:
        assert torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1])  # the forward has no atomics
        for a, b in zip(o[2:], outs[0][2:]):  # the backward's table histogram adds atomically: rounding only
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_v2_float64_fits_sm86_shared_memory(cuda_emu, monkeypatch):
    # float64 tile (64 KB) + column context + u_d: 81 KB, within the 99 KB an sm_86 / sm_89 block can opt into
    from tempokern._ops.common import cuda_emulator
    monkeypatch.setenv("TEMPOKERN_MPB_STATS", "v2")
    monkeypatch.setenv("TEMPOKERN_EMU_SMEM_OPTIN", str(99 * 1024))
    with cuda_emulator(cuda_emu):
        got = _v2_outputs(70, torch.float64, 9)
    monkeypatch.setenv("TEMPOKERN_MPB_STATS", "v1")
    want = _v2_outputs(70, torch.float64, 9)  # the CPU kernel (table mode)
    assert torch.equal(got[1], want[1])
    for a, b in zip([got[0], *got[2:]], [want[0], *want[2:]]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
