"""Group-scoped positives of the multi-positive InfoNCE (q_group / d_group): the reference's rule written out by
hand, then the fused CPU kernel, the blocked path (table mode on CPU, every mode on the CUDA emulator / a GPU)
and CTDLoss against the extended reference, forward, every gradient and the hardest negatives."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tempokern
from tempokern._ops.loss_args import group_scoped_bounds, span_bounds
from tempokern._ops.routing import multipos_infonce_partial
from tempokern.nn import CTDLoss, OffsetBias
from tempokern.reference import multipos_infonce as ref
from tempokern.reference.multipos_infonce import multipos_infonce_partial as ref_partial

from test_multipos_infonce import assert_close_all, emu_size, leaves, make


def groups(B, Bd=None, n=3, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(100 + seed)
    Bd = B if Bd is None else Bd
    return (torch.randint(0, n, (B,), generator=g).to(device), torch.randint(0, n, (Bd,), generator=g).to(device))


def run_g(fn, q, d, sp, neg, b, qg, dg, *, temperature=0.1, symmetric=True, pts=None):
    loss, hard = fn(q, d, *sp, temperature=temperature, bias=b, extra_neg=neg, symmetric=symmetric,
                    bias_table_points=pts, q_group=qg, d_group=dg, return_hardest=True)
    return (loss, torch.autograd.grad(loss, leaves(q, d, neg, b))), hard


# ---- the rule, by hand ------------------------------------------------------------------------------------

def test_reference_rule_by_hand():
    _rule_by_hand()


def _rule_by_hand():
    """Three rows; row 0 overlaps documents 1 (same group) and 2 (other group) but not its own document 0:
    with groups its positives are {0, 1}; without, {1, 2} (its own document is a negative)."""
    q = torch.eye(3, dtype=torch.float64)
    d = torch.tensor([[1.0, 0.5, 0.0], [0.2, 1.0, 0.0], [0.0, 0.3, 1.0]], dtype=torch.float64)
    q_span = (torch.tensor([10, 0, 20]), torch.tensor([12, 0, 20]))
    d_span = (torch.tensor([0, 11, 11]), torch.tensor([0, 11, 30]))
    qg, dg = torch.tensor([7, 7, 8]), torch.tensor([7, 7, 8])
    s = q @ d.t() / 0.5

    def row_loss(i, pos):
        return torch.logsumexp(s[i], 0) - torch.logsumexp(s[i, pos], 0)

    def col_loss(j, pos):
        return torch.logsumexp(s[:, j], 0) - torch.logsumexp(s[pos, j], 0)

    # groups: row 0 -> {0, 1}; row 1 (span [0, 0]) overlaps document 0 only: {0, 1}; row 2 -> {2}
    rows = [row_loss(0, [0, 1]), row_loss(1, [0, 1]), row_loss(2, [2])]
    cols = [col_loss(0, [0, 1]), col_loss(1, [0, 1]), col_loss(2, [2])]
    want = (torch.stack(rows).mean() + torch.stack(cols).mean()) / 2
    got = ref(q, d, q_span, d_span, temperature=0.5, q_group=qg, d_group=dg)
    torch.testing.assert_close(got, want)
    # without groups: row 0 -> {1, 2} (overlaps), row 1 -> {0}, row 2 -> {2}
    rows = [row_loss(0, [1, 2]), row_loss(1, [0]), row_loss(2, [2])]
    cols = [col_loss(0, [1]), col_loss(1, [0]), col_loss(2, [0, 2])]
    want0 = (torch.stack(rows).mean() + torch.stack(cols).mean()) / 2
    torch.testing.assert_close(ref(q, d, q_span, d_span, temperature=0.5), want0)
    for fn in (tempokern.multipos_infonce,):
        torch.testing.assert_close(fn(q, d, q_span, d_span, temperature=0.5, q_group=qg, d_group=dg), want)
        torch.testing.assert_close(fn(q, d, q_span, d_span, temperature=0.5), want0)
    return (q, d, q_span, d_span, qg, dg), want, want0


def test_rule_by_hand_on_the_cuda_path(gpu):
    """The same three rows through the CUDA kernels (blocked path): row 0 counts its own document."""
    (q, d, q_span, d_span, qg, dg), want, want0 = _rule_by_hand()
    mv = lambda t: t.to(gpu)  # noqa: E731
    args = (mv(q), mv(d), tuple(map(mv, q_span)), tuple(map(mv, d_span)))
    got = tempokern.multipos_infonce(*args, temperature=0.5, q_group=mv(qg), d_group=mv(dg))
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(tempokern.multipos_infonce(*args, temperature=0.5).cpu(), want0)


def test_one_group_with_paired_overlaps_is_the_overlap_loss():
    """Annals: one group and every query overlapping its own document (a gold record) give ChunQiuTR's loss."""
    q, d, (qsp, _), neg, b = make(50, 6, N=4, bias=True, seed=3)
    dsp = (qsp[1], qsp[1] + 2)  # overlaps its own query's span
    one = torch.zeros(50, dtype=torch.int64)
    want = ref(q, d, qsp, dsp, temperature=0.1, bias=b, extra_neg=neg)
    for fn in (ref, tempokern.multipos_infonce):
        torch.testing.assert_close(fn(q, d, qsp, dsp, temperature=0.1, bias=b, extra_neg=neg, q_group=one,
                                      d_group=one), want, rtol=1e-12, atol=1e-12)


def test_group_scoped_bounds_overlap_is_overlap_within_a_group():
    g = torch.Generator().manual_seed(0)
    for Bq, Bd in ((40, 40), (7, 30), (1, 1), (0, 5)):
        lo = [torch.randint(-50, 50, (n,), generator=g) for n in (Bq, Bd)]
        hi = [x + torch.randint(0, 6, x.shape, generator=g) for x in lo]
        qg, dg = torch.randint(-2, 3, (Bq,), generator=g), torch.randint(-2, 3, (Bd,), generator=g)
        a = group_scoped_bounds(qg, dg, lo[0], hi[0], lo[1], hi[1])
        ov = torch.maximum(a[0][:, None], a[2][None, :]) <= torch.minimum(a[1][:, None], a[3][None, :])
        want = (torch.maximum(lo[0][:, None], lo[1][None, :]) <= torch.minimum(hi[0][:, None], hi[1][None, :])) \
            & (qg[:, None] == dg[None, :])
        assert torch.equal(ov, want)
        assert all(int(x.min()) >= 0 and int(x.max()) < 2 * (Bq + Bd) for x in a if x.numel())


# ---- fused CPU kernel and the blocked path vs the reference -----------------------------------------------

CASES = [  # B, H, N, bias, symmetric, spans, groups
    (7, 5, 0, False, True, "random", 2),
    (97, 33, 0, False, True, "random", 3),
    (130, 33, 11, True, True, "random", 4),
    (120, 20, 30, True, False, "random", 2),
    (61, 17, 3, True, True, "disjoint", 3),   # no overlap: every row and column has its diagonal only
    (71, 9, 0, True, True, "all", 3),         # every pair overlaps: positives = the group (and the diagonal)
    (65, 8, 13, False, False, "all", 65),     # a group per row: the diagonal where the groups agree
    (1, 4, 2, True, True, "random", 1),
]


@pytest.mark.parametrize("B,H,N,bias,symmetric,spans,ng", CASES)
def test_parity_float64(B, H, N, bias, symmetric, spans, ng):
    q, d, sp, neg, b = make(B, H, N=N, bias=bias, spans=spans, seed=B)
    qg, dg = groups(B, n=ng, seed=B)
    got, hg = run_g(tempokern.multipos_infonce, q, d, sp, neg, b, qg, dg, symmetric=symmetric)
    want, hw = run_g(ref, q, d, sp, neg, b, qg, dg, symmetric=symmetric)
    assert_close_all(got, want, rtol=1e-10, atol=1e-12)
    assert torch.equal(hg, hw)


@pytest.mark.parametrize("pts", [2, 97, 4097])
def test_table_mode_float64(pts):
    q, d, sp, neg, b = make(53, 9, N=5, bias=True, seed=pts, u_lo=-1.0, u_hi=2.0)
    qg, dg = groups(53, n=3, seed=pts)
    got, hg = run_g(tempokern.multipos_infonce, q, d, sp, neg, b, qg, dg, pts=pts)
    want, hw = run_g(ref, q, d, sp, neg, b, qg, dg, pts=pts)
    assert_close_all(got, want, rtol=1e-9, atol=1e-10)
    assert torch.equal(hg, hw)


@pytest.mark.parametrize("bias", [False, True])
def test_parity_float32(bias):
    q, d, sp, neg, b = make(300, 64, N=50, bias=bias, dtype=torch.float32)
    q64, d64, _, neg64, b64 = make(300, 64, N=50, bias=bias, dtype=torch.float64)
    qg, dg = groups(300, n=5)
    fused, _ = run_g(tempokern.multipos_infonce, q, d, sp, neg, b, qg, dg, temperature=0.05)
    exact, _ = run_g(ref, q64, d64, sp, neg64, b64, qg, dg, temperature=0.05)
    assert fused[0].dtype == torch.float32
    assert_close_all(fused, exact, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_tolerance_rule(dtype):
    """fp16/bf16 inputs: the fused loss and gradients within twice the plain reference's own error in that dtype
    (the repository's 2x-torch rule), both against float32."""
    q, d, sp, neg, b = make(90, 32, N=7, bias=True, dtype=torch.float32, seed=5)
    with torch.no_grad():
        for x in (q, d, neg):
            x.mul_(0.1)
    qg, dg = groups(90, n=3, seed=5)
    exact, _ = run_g(ref, q, d, sp, neg, b, qg, dg)
    qh, dh, nh = (x.detach().to(dtype).requires_grad_() for x in (q, d, neg))
    plain, _ = run_g(ref, qh, dh, sp, nh, b, qg, dg)
    fused, _ = run_g(tempokern.multipos_infonce, qh, dh, sp, nh, b, qg, dg)
    assert abs(fused[0].item() - exact[0].item()) <= 2 * abs(plain[0].float().item() - exact[0].item()) + 1e-4
    for gf, gp, ge in zip(fused[1][:3], plain[1][:3], exact[1][:3]):
        assert (gf.float() - ge).abs().max() <= 2 * (gp.float() - ge).abs().max() + 1e-6


def test_gradcheck():
    q, d, sp, neg, b = make(6, 4, N=3, bias=True, hidden=3, D=4, seed=1)
    qg, dg = groups(6, n=2, seed=1)

    def f(q, d, neg, *bias):
        return tempokern.multipos_infonce(q, d, *sp, temperature=0.3, bias=bias, extra_neg=neg, q_group=qg,
                                          d_group=dg)

    assert torch.autograd.gradcheck(f, tuple(leaves(q, d, neg, b)), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("Bq,Bd,off,rw,cw,pts", [(30, 90, 30, 1.0, 0.0, None), (90, 30, -30, 0.0, 1.0, None),
                                                 (41, 41, 0, 0.5, 0.5, None), (30, 90, 30, 1.0, 0.0, 33),
                                                 (90, 30, -30, 0.0, 1.0, 33)])
def test_partial_matches_reference(Bq, Bd, off, rw, cw, pts):
    """CTDLoss(gather=True)'s two calls: Bq != Bd, a diagonal offset, one weight zero, with groups."""
    got, want = _partial_pair("cpu", Bq, Bd, off, rw, cw, pts)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-10)


def _partial_pair(device, Bq, Bd, off, rw, cw, pts):
    g = torch.Generator().manual_seed(Bq + Bd)
    H, N, hidden, D = 12, 9, 4, 6
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, d, neg = r(Bq, H), r(Bd, H), (r(N, H) if rw else None)
    q_lo, d_lo = torch.randint(0, 40, (Bq,), generator=g), torch.randint(0, 40, (Bd,), generator=g)
    q_hi, d_hi = q_lo + torch.randint(0, 6, (Bq,), generator=g), d_lo + torch.randint(0, 6, (Bd,), generator=g)
    qg, dg = torch.randint(0, 3, (Bq,), generator=g), torch.randint(0, 3, (Bd,), generator=g)
    bias = (torch.rand(Bq, generator=g, dtype=torch.float64) * 2 - 0.5,
            torch.rand(Bd, generator=g, dtype=torch.float64) * 2 - 0.5,
            r(hidden, D), r(hidden), r(1, hidden), r(1), torch.tensor(0.7, dtype=torch.float64))

    def go(dev, fn):
        lv = [x.to(dev).requires_grad_() for x in (q, d) + ((neg,) if rw else ()) + bias]
        nv = lv[2] if rw else None
        loss, hard = fn(lv[0], lv[1], *(x.to(dev) for x in (q_lo, q_hi, d_lo, d_hi)), temperature=0.2,
                        bias=tuple(lv[-7:]), extra_neg=nv, row_weight=rw, col_weight=cw, diag_offset=off,
                        bias_table_points=pts, q_group=qg.to(dev), d_group=dg.to(dev), return_hardest=True)
        return [loss] + list(torch.autograd.grad(loss, lv)) + ([hard.double()] if rw else [])

    return go(device, multipos_infonce_partial), go("cpu", ref_partial)


def test_ctd_loss_with_groups_matches_reference():
    torch.manual_seed(0)
    q, d, sp, neg, _ = make(40, 8, N=3, seed=4)
    qg, dg = groups(40, n=3, seed=4)
    ob = OffsetBias(features=6, hidden=5).double()
    with torch.no_grad():
        ob.scale.fill_(0.4)
    u_q, u_d = torch.rand(40, dtype=torch.float64), torch.rand(40, dtype=torch.float64)
    loss = CTDLoss(temperature=0.1, offset_bias=ob)(q, d, *sp, u_q, u_d, extra_neg=neg, q_group=qg, d_group=dg)
    nq, nd, nn_ = (torch.nn.functional.normalize(x, dim=-1) for x in (q, d, neg))
    bias = (u_q, u_d, ob.mlp[0].weight, ob.mlp[0].bias, ob.mlp[2].weight, ob.mlp[2].bias, ob.scale)
    want = ref(nq, nd, *sp, temperature=0.1, bias=bias, extra_neg=nn_, q_group=qg, d_group=dg)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    g1 = torch.autograd.grad(loss, [q, d, neg, ob.scale])
    g2 = torch.autograd.grad(want, [q, d, neg, ob.scale])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_opcheck_with_group_scoped_bounds():
    """The custom ops see group-scoped bounds and row_none all ones: opcheck both the fused and the blocked op on
    exactly those inputs."""
    from tempokern._ops.multipos_infonce import bias_kernel_inputs
    q, d, sp, neg, b = make(20, 6, N=4, bias=True, dtype=torch.float32, seed=2)
    qg, dg = groups(20, n=3, seed=2)
    spans = group_scoped_bounds(qg, dg, *span_bounds(sp[0]), *span_bounds(sp[1]))
    rn = torch.ones(20, dtype=torch.uint8)
    kb = tuple(x.detach().requires_grad_(x.dtype.is_floating_point and i < 7)
               for i, x in enumerate(bias_kernel_inputs(b, torch.float32)))
    args = (q.detach().requires_grad_(), d.detach().requires_grad_(), *spans, neg.detach().requires_grad_(), *kb,
            None, None, None, None, rn, None, 10.0, 0.5, 0.5, 0, False)
    torch.library.opcheck(torch.ops.tempokern.multipos_infonce.default, args)
    w1, b1, w2, b2, scale = (x.detach().requires_grad_() for x in b[2:])
    args = (q.detach().requires_grad_(), d.detach().requires_grad_(), *spans, neg.detach().requires_grad_(),
            b[0].detach(), b[1].detach(), None, w1, b1, w2, b2, scale, 10.0, 0.5, 0.5, 0, True, 0, rn, False)
    torch.library.opcheck(torch.ops.tempokern.multipos_blocked.default, args)


def test_bad_group_inputs():
    q, d, sp, neg, b = make(8, 4, N=2, dtype=torch.float32)
    qg, dg = groups(8)
    f = tempokern.multipos_infonce
    with pytest.raises(ValueError, match="q_group was given without d_group"):
        f(q, d, *sp, temperature=0.1, q_group=qg)
    with pytest.raises(ValueError, match="d_group was given without q_group"):
        f(q, d, *sp, temperature=0.1, d_group=dg)
    with pytest.raises(ValueError, match="d_group has length 7"):
        f(q, d, *sp, temperature=0.1, q_group=qg, d_group=dg[:7])
    with pytest.raises(TypeError, match="q_group must be an integer tensor"):
        f(q, d, *sp, temperature=0.1, q_group=qg.float(), d_group=dg)
    with pytest.raises(ValueError, match="d_group must be 1-D"):
        f(q, d, *sp, temperature=0.1, q_group=qg, d_group=dg[:, None])
    with pytest.raises(TypeError, match="q_group must be a torch.Tensor"):
        f(q, d, *sp, temperature=0.1, q_group=[0] * 8, d_group=dg)
    with pytest.raises(ValueError, match="one device"):
        f(q, d, *sp, temperature=0.1, q_group=qg, d_group=dg.to("meta"))
    with pytest.raises(ValueError, match="row_none cannot be combined"):
        (lo, hi), (dlo, dhi) = span_bounds(sp[0]), span_bounds(sp[1])
        multipos_infonce_partial(q, d, lo, hi, dlo, dhi, temperature=0.1, row_none=torch.zeros(8, dtype=torch.bool),
                                 q_group=qg, d_group=dg)
    with pytest.raises(ValueError, match="q_group was given without d_group"):
        CTDLoss()(q, d, *sp, q_group=qg)


# ---- CUDA: the blocked path (GPU, or the emulator) ---------------------------------------------------------

@pytest.mark.parametrize("mode", ["none", "table", "exact"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_cuda_float64_matches_reference(gpu, mode, symmetric):
    B = emu_size(gpu, 70)
    q, d, sp, neg, b = make(B, 24, N=5, bias=mode != "none", device=gpu, seed=7, u_lo=-1.0, u_hi=2.0)
    qg, dg = groups(B, n=3, seed=7, device=gpu)
    pts = 65 if mode == "table" else None
    got, hg = run_g(tempokern.multipos_infonce, q, d, sp, neg, b, qg, dg, symmetric=symmetric, pts=pts)
    want, hw = run_g(ref, q, d, sp, neg, b, qg, dg, symmetric=symmetric, pts=pts)
    assert_close_all((got[0].cpu(), [x.cpu() for x in got[1]]), (want[0].cpu(), [x.cpu() for x in want[1]]),
                     rtol=1e-9, atol=1e-10)
    assert torch.equal(hg.cpu(), hw.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_dtypes_tolerance_rule(gpu, dtype):
    """float32 / fp16 / bf16 embeddings on the CUDA path with the exact bias (float32): within twice the plain
    reference's own error in that dtype, both against float64; float32 also within 2e-4 of float64."""
    from test_multipos_infonce import matmul_tf32
    B = emu_size(gpu, 90)
    q, d, sp, neg, b = make(B, 32, N=6, bias=True, dtype=torch.float64, seed=8, device=gpu)
    with torch.no_grad():
        for x in (q, d, neg):
            x.mul_(0.3)
    qg, dg = groups(B, n=3, seed=8, device=gpu)
    exact, _ = run_g(ref, q, d, sp, neg, b, qg, dg)
    qh, dh, nh = (x.detach().to(dtype).requires_grad_() for x in (q, d, neg))
    b32 = tuple(x.detach().float().requires_grad_() for x in b)
    plain, _ = run_g(ref, qh, dh, sp, nh, b32, qg, dg)
    with matmul_tf32(False):
        fused, _ = run_g(tempokern.multipos_infonce, qh, dh, sp, nh, b32, qg, dg)
    assert abs(fused[0].item() - exact[0].item()) <= 2 * abs(plain[0].double().item() - exact[0].item()) + 1e-4
    for gf, gp, ge in zip(fused[1][:3], plain[1][:3], exact[1][:3]):
        assert (gf.double() - ge).abs().max() <= 2 * (gp.double() - ge).abs().max() + 1e-6
    if dtype == torch.float32:
        assert_close_all((fused[0].double(), [x.double() for x in fused[1]]), exact, rtol=2e-4, atol=2e-5)


def test_cuda_partial_matches_reference(gpu):
    for case in ((30, 90, 30, 1.0, 0.0, None), (90, 30, -30, 0.0, 1.0, 33)):
        got, want = _partial_pair(gpu, *case)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-10)


# ---- CTDLoss(gather=True) with groups: two gloo processes ---------------------------------------------------

GLOO_WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_ctd_loss import batch, offset_bias_module
    from test_multipos_groups import gloo_groups
    from tempokern.nn import CTDLoss
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[5]
    torch.set_num_threads(1)
    for i, (mode, sizes, with_bias) in enumerate(CASES):
        dist.init_process_group("gloo", init_method=f"{init}-{i}", rank=rank, world_size=world)
        q, d, qsp, dsp, u_q, u_d, _ = batch(sum(sizes), 10, 0, seed=7)
        qg, dg = gloo_groups(sum(sizes))
        sl = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
        loc = [x[sl].clone().requires_grad_() for x in (q, d, u_q, u_d)]
        ob = offset_bias_module() if with_bias else None
        kw = dict(u_q=loc[2], u_d=loc[3]) if with_bias else {}
        loss = CTDLoss(temperature=0.1, offset_bias=ob, gather=True, gather_mode=mode)(
            loc[0], loc[1], tuple(x[sl] for x in qsp), tuple(x[sl] for x in dsp), q_group=qg[sl], d_group=dg[sl],
            **kw)
        grads = torch.autograd.grad(loss, loc[:2])
        torch.save({"loss": loss.detach(), "grads": [g.detach() for g in grads]}, f"{out}-{i}")
        dist.destroy_process_group()
""")
GLOO_CASES = [("tempokern", (24, 17), True), ("chunqiutr", (20, 20), False)]


def gloo_groups(B):
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 3, (B,), generator=g), torch.randint(0, 3, (B,), generator=g)


def _gloo_expected(r, sizes, with_bias):
    """Rank r's loss and gradients (local q, d) from the materialised formulas with groups: local rows vs all
    documents, local columns vs all queries, other ranks' tensors detached, weighted by W B_r / T."""
    from test_ctd_loss import batch, offset_bias_module
    from tempokern.reference import offset_bias
    world, total = len(sizes), sum(sizes)
    q, d, qsp, dsp, u_q, u_d, _ = batch(total, 10, 0, seed=7)
    qg, dg = gloo_groups(total)
    sl = slice(sum(sizes[:r]), sum(sizes[:r + 1]))
    loc = [x[sl].clone().requires_grad_() for x in (q, d)]

    def with_local(full, x):
        parts = list(full.detach().split(sizes))
        parts[r] = x
        return torch.cat(parts)

    qn, dn = (torch.nn.functional.normalize(with_local(f, x), dim=-1) for f, x in zip((q, d), loc))
    s = qn @ dn.t() / 0.1
    if with_bias:
        ob = offset_bias_module()
        s = s + offset_bias(u_q, u_d, ob.mlp[0].weight, ob.mlp[0].bias, ob.mlp[2].weight, ob.mlp[2].bias,
                            ob.scale).detach()
    pos = (overlap_positives_(qsp, dsp) & (qg[:, None] == dg[None, :])) | torch.eye(total, dtype=torch.bool)
    fill = torch.finfo(s.dtype).min
    row = torch.logsumexp(s, 1) - torch.logsumexp(s.masked_fill(~pos, fill), 1)
    col = torch.logsumexp(s, 0) - torch.logsumexp(s.masked_fill(~pos, fill), 0)
    w = 0.5 * world * sizes[r] / total
    loss = w * row[sl].mean() + w * col[sl].mean()
    return loss.detach(), torch.autograd.grad(loss, loc)


def overlap_positives_(qsp, dsp):
    from tempokern.reference import overlap_positives
    return overlap_positives(qsp, dsp)


def test_ctd_loss_gather_with_groups_two_gloo_processes(tmp_path):
    from test_ctd_loss import ROOT, batch
    script = tmp_path / "worker.py"
    script.write_text(f"CASES = {GLOO_CASES!r}\n" + GLOO_WORKER)
    init = f"file://{tmp_path / 'rendezvous'}"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", init, here, str(tmp_path / f"out{r}.pt")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (mode, sizes, with_bias) in enumerate(GLOO_CASES):
        files = [tmp_path / f"out{r}.pt-{i}" for r in range(2)]
        assert all(f.exists() for f in files), outs
        res = [torch.load(f) for f in files]
        total = sum(sizes)
        q, d, qsp, dsp, u_q, u_d, _ = batch(total, 10, 0, seed=7)
        qg, dg = gloo_groups(total)
        if mode == "tempokern":
            for r in range(2):
                want_loss, want_grads = _gloo_expected(r, list(sizes), with_bias)
                torch.testing.assert_close(res[r]["loss"], want_loss)
                for a, b in zip(res[r]["grads"], want_grads):
                    torch.testing.assert_close(a, b)
        # both modes: the mean over ranks is the single-process loss with groups (no bias in chunqiutr mode,
        # whose bias covers the local block only)
        bias = None
        if with_bias:
            from test_ctd_loss import offset_bias_module
            ob = offset_bias_module()
            bias = (u_q, u_d, ob.mlp[0].weight, ob.mlp[0].bias, ob.mlp[2].weight, ob.mlp[2].bias, ob.scale)
        single = ref(torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(d, dim=-1), qsp, dsp,
                     temperature=0.1, bias=bias, q_group=qg, d_group=dg)
        torch.testing.assert_close(torch.stack([x["loss"] for x in res]).mean(), single.detach())


def test_groups_under_torch_compile_fullgraph():
    """The group-scoped bounds (sorts, a cumulative sum, an index_copy: static shapes) trace with the op."""
    q, d, sp, neg, b = make(30, 8, N=3, bias=True, dtype=torch.float32, seed=1)
    qg, dg = groups(30, n=3, seed=1)

    def f(q, d, qs, qe, ds, de, qg, dg):
        return tempokern.multipos_infonce(q, d, (qs, qe), (ds, de), temperature=0.1, extra_neg=neg, q_group=qg,
                                          d_group=dg)

    got = torch.compile(f, fullgraph=True)(q, d, *sp[0], *sp[1], qg, dg)
    want = ref(q, d, *sp, temperature=0.1, extra_neg=neg, q_group=qg, d_group=dg)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(got, q)[0], torch.autograd.grad(want, q)[0], rtol=1e-4, atol=1e-5)


def test_memory_no_bxb_buffer_with_groups():
    """As test_multipos_infonce.test_memory_no_bxb_buffer, with groups: B = 9000 under an address-space limit
    256 MiB above the inputs (one B x B float32 matrix is 309 MiB), forward and backward with the bias."""
    script = textwrap.dedent("""
        import resource, torch, tempokern
        torch.manual_seed(0)
        B, H = 9000, 16
        q = torch.randn(B, H, requires_grad=True); d = torch.randn(B, H, requires_grad=True)
        qs = torch.randint(0, 1000, (B,)); ds = torch.randint(0, 1000, (B,))
        qg = torch.randint(0, 50, (B,)); dg = torch.randint(0, 50, (B,))
        bias = (torch.rand(B).requires_grad_(), torch.rand(B).requires_grad_(), torch.randn(4, 4, requires_grad=True),
                torch.randn(4, requires_grad=True), torch.randn(1, 4, requires_grad=True),
                torch.zeros(1, requires_grad=True), torch.tensor(0.5, requires_grad=True))
        w = 100
        tempokern.multipos_infonce(q[:w], d[:w], (qs[:w], qs[:w] + 5), (ds[:w], ds[:w] + 5), temperature=0.05,
                                   bias=tuple(x[:w] if x.dim() == 1 and x.shape[0] == B else x for x in bias),
                                   q_group=qg[:w], d_group=dg[:w]).backward()
        vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024
        limit = vm + 256 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        loss = tempokern.multipos_infonce(q, d, (qs, qs + 5), (ds, ds + 5), temperature=0.05, bias=bias, q_group=qg,
                                          d_group=dg)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(q.grad).all() and torch.isfinite(bias[2].grad).all()
        print("FUSED_OK", float(loss))
        try:
            torch.zeros(B, B)
            print("BXB_OK")
        except (RuntimeError, MemoryError):
            print("BXB_OOM")
    """)
    from test_multipos_infonce import ROOT
    import tempfile
    env = dict(os.environ, OMP_NUM_THREADS="2", MALLOC_ARENA_MAX="2", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                       cwd=tempfile.gettempdir())
    assert "FUSED_OK" in r.stdout, r.stdout + r.stderr
    assert "BXB_OOM" in r.stdout, r.stdout + r.stderr
