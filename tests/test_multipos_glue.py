"""The fused glue of the blocked multi-positive InfoNCE (TEMPOKERN_MPB_GLUE=fused, the default): the prep kernel
(int32 spans + fallback flags) and the finalize kernel (row / column statistics, hardest negative, loss), on the
CUDA emulator and as CPU twins, against tempokern.reference (float64, loss and every gradient, <= 1e-9),
against the torch glue it replaces (float64, <= 1e-12), under SM counts 132 / 108 / 58 and thread-order
shuffles; the prep kernel's outputs against a brute-force overlap matrix, including the rank path for a span
range past int32."""
import pytest
import torch

import tempokern._ops.multipos_blocked as mpb
from tempokern._ops.common import kernels, launch_args, ptr
from tempokern._ops.multipos_infonce import _span_bounds, blocked_multipos
from tempokern.reference.multipos_infonce import multipos_infonce_partial as ref_partial

from test_multipos_infonce import leaves, make


def test_switch_default_and_validation(monkeypatch):
    monkeypatch.delenv("TEMPOKERN_MPB_GLUE", raising=False)
    assert mpb.glue_variant() == "fused"
    monkeypatch.setenv("TEMPOKERN_MPB_GLUE", "Torch")
    assert mpb.glue_variant() == "torch"
    monkeypatch.setenv("TEMPOKERN_MPB_GLUE", "graph")
    with pytest.raises(ValueError, match="TEMPOKERN_MPB_GLUE"):
        mpb.glue_variant()


def _step(q, d, bounds, neg, b, *, pts, rows, rw, cw, off=0, row_none=None, hardest=False):
    ins = leaves(q, d, neg, b)
    out = blocked_multipos(q, d, *bounds, temperature=0.1, bias=b, extra_neg=neg, row_weight=rw, col_weight=cw,
                           diag_offset=off, bias_table_points=pts, block_rows=rows, row_none=row_none,
                           return_hardest=hardest)
    loss, hard = out if hardest else (out, None)
    return loss, torch.autograd.grad(loss, ins), hard, ins


def _ref(q, d, bounds, neg, b, ins, *, pts, rw, cw, off=0, row_none=None, hardest=False):
    out = ref_partial(q, d, *bounds, temperature=0.1, bias=b, extra_neg=neg, row_weight=rw, col_weight=cw,
                      diag_offset=off, row_none=row_none, bias_table_points=pts, return_hardest=hardest)
    loss, hard = out if hardest else (out, None)
    return loss, torch.autograd.grad(loss, ins), hard


def _close(a, b, tol):
    torch.testing.assert_close(a[0].double(), b[0].double(), rtol=tol, atol=tol / 10)
    assert len(a[1]) == len(b[1])
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        torch.testing.assert_close(x.double(), y.double(), rtol=tol, atol=tol / 10, msg=lambda m: f"grad {i}: {m}")
    if a[2] is not None or b[2] is not None:
        assert torch.equal(a[2].cpu(), b[2].cpu())


# mode, B, Bd, H, N, rows, (row_weight, col_weight), diag_offset, spans
CASES = [
    ("none", 70, 70, 10, 0, 0, (0.5, 0.5), 0, "random"),
    ("none", 97, 97, 8, 5, 32, (0.5, 0.5), 0, "random"),      # several row blocks, extra negatives
    ("none", 60, 60, 8, 0, 0, (0.5, 0.5), 0, "disjoint"),    # every row / column falls back
    ("none", 40, 40, 8, 3, 16, (1.0, 0.0), 0, "all"),         # asymmetric (no column term)
    ("none", 23, 61, 8, 3, 0, (1.0, 0.0), 17, "random"),      # gathered shape: partner i + 17
    ("none", 50, 50, 8, 0, 0, (0.3, 0.7), 0, "random"),       # unequal weights
    ("table", 64, 64, 9, 4, 0, (0.5, 0.5), 0, "random"),
    ("table", 77, 77, 6, 0, 25, (0.5, 0.5), 0, "disjoint"),
    ("exact", 45, 45, 6, 2, 0, (0.5, 0.5), 0, "random"),
    ("exact", 45, 45, 6, 0, 20, (0.5, 0.5), 0, "random"),
]


@pytest.mark.parametrize("mode,B,Bd,H,N,rows,w,off,spans", CASES)
def test_fused_glue_matches_reference_and_torch_glue_float64(device, monkeypatch, mode, B, Bd, H, N, rows, w, off,
                                                             spans):
    # device: cpu (the C++ twins of the glue kernels), emu (the CUDA kernels), cuda
    q, d, sp, neg, b = make(B, H, N=N, bias=mode != "none", Bd=Bd, spans=spans, device=device, seed=B + N + rows)
    bounds = (*_span_bounds(sp[0]), *_span_bounds(sp[1]))
    pts = 97 if mode == "table" else None
    kw = dict(pts=pts, rw=w[0], cw=w[1], off=off, hardest=True)
    monkeypatch.setenv("TEMPOKERN_MPB_GLUE", "fused")
    loss, grads, hard, ins = _step(q, d, bounds, neg, b, rows=rows, **kw)
    want = _ref(q, d, bounds, neg, b, ins, **kw)
    _close((loss, grads, hard), want, 1e-9)
    monkeypatch.setenv("TEMPOKERN_MPB_GLUE", "torch")
    old = _step(q, d, bounds, neg, b, rows=rows, **kw)
    _close((loss, grads, hard), old[:3], 1e-12)


def test_fused_glue_with_external_row_none(gpu):
    # CTDLoss(gather=True): the caller's row_none (rows that overlap no document on any rank)
    q, d, sp, neg, b = make(30, 8, N=2, Bd=45, device=gpu, seed=3)
    lo_q, hi_q = _span_bounds(sp[0])
    bounds = (lo_q, hi_q, *_span_bounds(sp[1]))
    rn = torch.zeros(30, dtype=torch.uint8, device=q.device)
    rn[::4] = 1
    kw = dict(pts=None, rw=1.0, cw=0.0, off=5, hardest=True)
    loss, grads, hard, ins = _step(q, d, bounds, neg, b, rows=0, row_none=rn, **kw)
    want = _ref(q, d, bounds, neg, b, ins, row_none=rn, **kw)
    _close((loss, grads, hard), want, 1e-9)


@pytest.mark.parametrize("sms", [132, 108, 58])
def test_fused_glue_at_other_sm_counts(gpu, monkeypatch, sms):
    monkeypatch.setattr(mpb, "sm_count", lambda device: sms)
    # two column tiles, several row tiles and row blocks; the table bias: the tgrad kernel's histogram rows
    q, d, sp, neg, b = make(1100, 4, N=3, bias=True, device=gpu, seed=sms)
    bounds = (*_span_bounds(sp[0]), *_span_bounds(sp[1]))
    kw = dict(pts=33, rw=0.5, cw=0.5, hardest=True)
    loss, grads, hard, ins = _step(q, d, bounds, neg, b, rows=512, **kw)
    want = _ref(q, d, bounds, neg, b, ins, **kw)
    _close((loss, grads, hard), want, 1e-9)


@pytest.mark.emu
def test_fused_glue_does_not_depend_on_thread_order(cuda_emu):
    from tempokern._ops.common import cuda_emulator
    q, d, sp, neg, b = make(300, 6, N=4, bias=True, seed=9)
    bounds = (*_span_bounds(sp[0]), *_span_bounds(sp[1]))
    kw = dict(pts=33, rw=0.5, cw=0.5, hardest=True)
    outs = []
    try:
        with cuda_emulator(cuda_emu):
            for s in (1, 2, 3):
                cuda_emu.emu_set_seed(s)
                outs.append(_step(q, d, bounds, neg, b, rows=128, **kw)[:3])
    finally:
        cuda_emu.emu_set_seed(0)
    for o in outs[1:]:
        _close(o, outs[0], 1e-15)


def _prep(Bq, Bd, q_lo, q_hi, d_lo, d_hi, off=0):
    sp = torch.full((2 * (Bq + Bd),), -7, dtype=torch.int32, device=q_lo.device)
    fl = torch.full((Bq + Bd,), 9, dtype=torch.uint8, device=q_lo.device)
    cnt = torch.full((1,), 123, dtype=torch.int32, device=q_lo.device)
    dev, stream = launch_args(q_lo)
    kernels().multipos_block_prep(dev, stream, [Bq, Bd, off],
                                  dict(q_lo=ptr(q_lo), q_hi=ptr(q_hi), d_lo=ptr(d_lo), d_hi=ptr(d_hi), spans32=ptr(sp),
                                       row_none=ptr(fl), col_none=ptr(fl) + Bq, counter=ptr(cnt)))
    return sp, fl, cnt


@pytest.mark.parametrize("scale", [1, 2**40, 2**56])
@pytest.mark.parametrize("off", [0, 3, -5])
def test_prep_kernel_against_brute_force(device, scale, off):
    # scale 2^40 / 2^61: the bounds' range exceeds int32, the ranks path; the flags and every q-vs-d comparison
    # of the int32 bounds must equal the int64 ones
    g = torch.Generator().manual_seed(scale % 97 + off)
    Bq, Bd = 37, 300
    lo = torch.randint(-50, 50, (Bq + Bd,), generator=g)
    hi = lo + torch.randint(0, 6, (Bq + Bd,), generator=g)
    lo, hi = lo * scale, hi * scale
    lo[5], hi[5] = 60 * scale, 61 * scale  # a row overlapping nothing
    q_lo, q_hi, d_lo, d_hi = (t.contiguous().to(device) for t in (lo[:Bq], hi[:Bq], lo[Bq:], hi[Bq:]))
    sp, fl, cnt = _prep(Bq, Bd, q_lo, q_hi, d_lo, d_hi, off)
    ov = torch.maximum(q_lo[:, None], d_lo[None, :]) <= torch.minimum(q_hi[:, None], d_hi[None, :])
    assert torch.equal(fl[:Bq].bool().cpu(), ~ov.any(1).cpu())
    assert torch.equal(fl[Bq:].bool().cpu(), ~ov.any(0).cpu())
    assert fl[5].item() == 1 and int(cnt.item()) == 0
    s = sp.long()
    ql, qh, dl, dh = s[:Bq], s[Bq:2 * Bq], s[2 * Bq:2 * Bq + Bd], s[2 * Bq + Bd:]
    ov32 = torch.maximum(ql[:, None], dl[None, :]) <= torch.minimum(qh[:, None], dh[None, :])
    assert torch.equal(ov32.cpu(), ov.cpu())
    allb = torch.cat([q_lo, q_hi, d_lo, d_hi])
    a32 = torch.cat([ql, qh, dl, dh])
    assert torch.equal((allb[:, None] < allb[None, :]).cpu(), (a32[:, None] < a32[None, :]).cpu())  # order kept
    if scale == 1:
        assert torch.equal(a32.cpu(), (allb - allb.min()).cpu())  # the shift
    else:
        assert torch.equal(a32.cpu(), (allb[None, :] < allb[:, None]).sum(1).cpu())  # the ranks
