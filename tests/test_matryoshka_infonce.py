"""Fused single-pass Matryoshka InfoNCE (tempokern.matryoshka_infonce) vs the plain PyTorch reference (the
sentence-transformers MatryoshkaLoss loop): loss, levels and every gradient; spec tmrl-re3.md §2.6."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import tempokern
from tempokern.reference import matryoshka_infonce as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tempokern.__file__)))


def make(B, H, *, Bd=None, N=0, spans=None, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    Bd = B if Bd is None else Bd
    q = (torch.randn(B, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    d = (torch.randn(Bd, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    neg = (torch.randn(N, H, generator=g, dtype=torch.float64) * scale).to(dtype) if N else None
    sp = {}
    if spans == "random":  # multi-positive, some rows/columns with no overlap (diagonal fallback)
        qs = torch.randint(0, 40, (B,), generator=g)
        ds = torch.randint(0, 40, (Bd,), generator=g)
        sp = dict(q_span=(qs, qs + torch.randint(-2, 3, (B,), generator=g)),
                  d_span=(ds, ds + torch.randint(-2, 3, (Bd,), generator=g)))
    return q, d, neg, sp


def run_both(q, d, neg, sp, dims, *, level_w=None, **kw):
    """Loss, levels and gradients of q, d, extra_neg for the fused op and the reference; the backward
    seeds the loss with 1 and (optionally) the levels with level_w, so gradients through return_levels
    are checked too."""
    out = []
    for fn in (tempokern.matryoshka_infonce, ref):
        ins = [x.clone().requires_grad_() for x in (q, d) + ((neg,) if neg is not None else ())]
        loss, levels = fn(ins[0], ins[1], dims, extra_neg=ins[2] if neg is not None else None, return_levels=True,
                          **sp, **kw)
        total = loss if level_w is None else loss + (levels * level_w.to(levels)).sum()
        grads = torch.autograd.grad(total, ins)
        out.append((loss.detach(), levels.detach(), [g.detach() for g in grads]))
    return out


def assert_parity(a, b, tol):
    (la, va, ga), (lb, vb, gb) = a, b
    torch.testing.assert_close(la, lb.to(la.dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(va, vb.to(va.dtype), rtol=tol, atol=tol)
    for i, (x, y) in enumerate(zip(ga, gb)):
        torch.testing.assert_close(x, y.to(x.dtype), rtol=tol, atol=tol, msg=lambda m: f"grad {i}: {m}")


CASES = [  # (B, Bd, N, spans, symmetric): B and Bd past one 64 x 96 tile and not multiples of it
    (70, 70, 0, None, False), (70, 70, 0, None, True), (70, 101, 13, None, False), (70, 70, 13, "random", True),
    (70, 70, 0, "random", False), (5, 9, 3, "random", False),
]


@pytest.mark.parametrize("B,Bd,N,spans,symmetric", CASES)
def test_parity_float64_dims_not_dividing_H(B, Bd, N, spans, symmetric):
    q, d, neg, sp = make(B, 50, Bd=Bd, N=N, spans=spans)
    res = run_both(q, d, neg, sp, (33, 8, 50, 20), weights=(2.0, 1.0, 1.0, 0.5), temperature=0.07,
                   symmetric=symmetric, level_w=torch.tensor([0.3, -0.2, 0.0, 1.5]))
    assert_parity(*res, 1e-10)


@pytest.mark.parametrize("B,Bd,N,spans,symmetric", CASES[1:4])
def test_blocked_path_parity_float64(B, Bd, N, spans, symmetric):
    """The blocked torch path (the CUDA path's algorithm) on CPU, in blocks of 32 rows: same parity."""
    from _emu_support import force_blocked
    q, d, neg, sp = make(B, 50, Bd=Bd, N=N, spans=spans)
    with force_blocked(32):
        res = run_both(q, d, neg, sp, (33, 8, 50, 20), weights=(2.0, 1.0, 0.0, 0.5), temperature=0.07,
                       symmetric=symmetric, level_w=torch.tensor([0.3, -0.2, 0.0, 1.5]))
    assert_parity(*res, 1e-10)


def test_cuda_parity(gpu):
    """The CUDA path (on the emulator: the fused kernels of matryoshka_block_cuda.cu around torch's products on
    CPU tensors; tests/test_matryoshka_cuda_fused.py covers it in depth) vs the reference in float64, and
    float32 against float64 by the 2x rule."""
    q, d, neg, sp = make(150, 64, N=20, spans="random", seed=2)
    sp = {k: tuple(t.to(gpu) for t in v) for k, v in sp.items()}
    q, d, neg = q.to(gpu), d.to(gpu), neg.to(gpu)
    dims = (16, 40, 64)
    res = run_both(q, d, neg, sp, dims, temperature=0.05, symmetric=True)
    assert_parity(*res, 1e-9)
    exact = res[1]
    fused, torch32 = run_both(q.float(), d.float(), neg.float(), sp, dims, temperature=0.05, symmetric=True)
    for a, b, e in zip([fused[0], fused[1], *fused[2]], [torch32[0], torch32[1], *torch32[2]],
                       [exact[0], exact[1], *exact[2]]):
        err_f = (a.double() - e).abs().max().item()
        err_t = (b.double() - e).abs().max().item()
        assert err_f <= 2 * err_t + 64 * torch.finfo(torch.float32).eps * e.abs().max().item(), (err_f, err_t)


def test_appendix_a1_check():
    """The spec's Appendix A.1 configuration: B = 7, C = 19, H = 50, dims (8, 20, 33, 50), weights (1, .5, 2, 1)."""
    q, d, _, _ = make(7, 50, Bd=19, seed=3)
    res = run_both(q, d, None, {}, (8, 20, 33, 50), weights=(1.0, 0.5, 2.0, 1.0), temperature=0.07)
    assert_parity(*res, 1e-11)


def test_normalize_false_plain_prefix_products():
    q, d, neg, sp = make(40, 24, N=5, spans="random", scale=0.3)
    res = run_both(q, d, neg, sp, (4, 12, 24), temperature=0.5, normalize=False, symmetric=True)
    assert_parity(*res, 1e-10)


@pytest.mark.parametrize("symmetric", [False, True])
def test_single_level_equals_multipos_infonce(symmetric):
    q, d, _, sp = make(70, 32, spans="random")
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        qa = q.to(dtype).requires_grad_()
        da = d.to(dtype).requires_grad_()
        la = tempokern.matryoshka_infonce(qa, da, [32], temperature=0.1, symmetric=symmetric, **sp)
        ga = torch.autograd.grad(la, (qa, da))
        qb = q.to(dtype).requires_grad_()
        db = d.to(dtype).requires_grad_()
        lb = tempokern.multipos_infonce(F.normalize(qb, dim=-1), F.normalize(db, dim=-1), sp["q_span"], sp["d_span"],
                                        temperature=0.1, symmetric=symmetric)
        gb = torch.autograd.grad(lb, (qb, db))
        torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def test_trailing_dims_get_exactly_zero_gradient_and_a_warning():
    q, d, _, _ = make(20, 40)
    q.requires_grad_()
    d.requires_grad_()
    with pytest.warns(UserWarning, match="smaller than the embedding size"):
        loss = tempokern.matryoshka_infonce(q, d, (8, 30), temperature=0.1)
    gq, gd = torch.autograd.grad(loss, (q, d))
    assert torch.all(gq[:, 30:] == 0) and torch.all(gd[:, 30:] == 0)
    assert gq[:, :30].abs().sum() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tempokern.matryoshka_infonce(q, d, (8, 40), temperature=0.1)


def test_unsorted_dims_sorted_with_their_weights():
    q, d, _, _ = make(16, 30)
    a, la = tempokern.matryoshka_infonce(q, d, (30, 4, 16), weights=(1.0, 3.0, 0.5), temperature=0.1,
                                         return_levels=True)
    b, lb = tempokern.matryoshka_infonce(q, d, (4, 16, 30), weights=(3.0, 0.5, 1.0), temperature=0.1,
                                         return_levels=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    r, rl = ref(q, d, (4, 16, 30), weights=(3.0, 0.5, 1.0), temperature=0.1, return_levels=True)
    torch.testing.assert_close(la, rl, rtol=1e-12, atol=1e-12)


def test_zero_weight_skips_the_level():
    """A zero-weight level adds nothing to the loss nor to any gradient: the result equals the loss
    without that dim (its prefix products still feed the larger levels)."""
    q, d, neg, sp = make(30, 24, N=4, spans="random")
    res = run_both(q, d, neg, sp, (6, 12, 24), weights=(1.0, 0.0, 2.0), temperature=0.1, symmetric=True)
    assert_parity(*res, 1e-11)
    without = run_both(q, d, neg, sp, (6, 24), weights=(1.0, 2.0), temperature=0.1, symmetric=True)
    torch.testing.assert_close(res[0][0], without[0][0], rtol=1e-12, atol=1e-12)
    for x, y in zip(res[0][2], without[0][2]):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-12)
    # all weights zero: loss 0, gradients exactly 0
    qq = q.clone().requires_grad_()
    loss = tempokern.matryoshka_infonce(qq, d, (6, 24), weights=(0, 0), temperature=0.1)
    assert float(loss.detach()) == 0.0
    assert torch.all(torch.autograd.grad(loss, qq)[0] == 0)


def test_zero_weight_level_still_sees_a_nan_as_the_reference():
    """The reference adds 0 x a skipped level's loss: a NaN only in coordinates that level reads makes the loss
    NaN there, and so here (found by the fuzzer at B = 1, H = 1, weights [0])."""
    import tempokern.reference as ref
    q, d = torch.randn(1, 1, dtype=torch.float64), torch.tensor([[float("nan")]], dtype=torch.float64)
    for fn in (tempokern.matryoshka_infonce, ref.matryoshka_infonce):
        assert torch.isnan(fn(q, d, (1,), weights=(0.0,), temperature=0.1))
    q, d, neg, sp = make(8, 24, N=3)
    d[3, 20] = float("nan")             # read by the zero-weight level 24 only
    for extra in (None, neg):
        for fn in (tempokern.matryoshka_infonce, ref.matryoshka_infonce):
            assert torch.isnan(fn(q, d, (8, 24), weights=(1.0, 0.0), temperature=0.1, extra_neg=extra))
            assert torch.isfinite(fn(q, d, (8, 20), weights=(1.0, 0.0), temperature=0.1, extra_neg=extra))
    e = neg.clone()
    e[1, 22] = float("inf")
    d[3, 20] = 0.5
    for fn in (tempokern.matryoshka_infonce, ref.matryoshka_infonce):
        assert torch.isnan(fn(q, d, (8, 24), weights=(1.0, 0.0), temperature=0.1, extra_neg=e))


def test_all_zero_prefix_row():
    """A row whose first 8 coordinates are 0: its norm is clamped at 1e-12 as F.normalize does; finite loss
    and the same gradient as the reference."""
    q, d, neg, sp = make(12, 20, N=3)
    q[2, :8] = 0
    d[5, :8] = 0
    res = run_both(q, d, neg, sp, (8, 20), temperature=0.1, symmetric=True)
    assert torch.isfinite(res[0][0]) and all(torch.isfinite(g).all() for g in res[0][2])
    assert_parity(*res, 1e-9)


@pytest.mark.parametrize("temperature", [0.01, 0.05, 1.0])
def test_temperatures_and_large_embeddings(temperature):
    q, d, neg, sp = make(40, 24, N=6, spans="random", scale=1e4)
    res = run_both(q, d, neg, sp, (6, 24), temperature=temperature, symmetric=True)
    assert torch.isfinite(res[0][0]) and all(torch.isfinite(g).all() for g in res[0][2])
    assert_parity(*res, 1e-9)


def test_float32_within_twice_torch_error():
    """The 2x rule: the fused float32 result's error vs the float64 reference is at most twice the error of
    the reference itself computed in float32 (plus a few ulps for values near 0)."""
    q, d, neg, sp = make(150, 64, N=40, spans="random", seed=5)
    dims = (8, 16, 32, 64)
    exact = run_both(q, d, neg, sp, dims, temperature=0.05, symmetric=True)[1]
    fused, torch32 = run_both(q.float(), d.float(), neg.float(), sp, dims, temperature=0.05, symmetric=True)
    for a, b, e in zip([fused[0], fused[1], *fused[2]], [torch32[0], torch32[1], *torch32[2]],
                       [exact[0], exact[1], *exact[2]]):
        err_f = (a.double() - e).abs().max().item()
        err_t = (b.double() - e).abs().max().item()
        assert err_f <= 2 * err_t + 8 * torch.finfo(torch.float32).eps * e.abs().max().item(), (err_f, err_t)


@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0, 1.0), (1.0, 0.5, 0.0, 0.0)])
def test_float32_gradient_in_forward_within_twice_torch_error(weights):
    """The 2x rule on the gradient-in-forward path (symmetric=False: the CPU kernel's all-level gradient row
    pass with the 16-lane exps, and the one-sweep row statistics): several row blocks' worth of candidate
    panels, a partial panel whose width is not a multiple of 16, spans with fallbacks, extra negatives, and
    zero weights on the top levels (the pass then starts below them)."""
    q, d, neg, sp = make(150, 64, Bd=203, N=21, spans="random", seed=6, scale=3.0)
    dims = (8, 16, 32, 64)
    kw = dict(temperature=0.05, symmetric=False, weights=weights)
    exact = run_both(q, d, neg, sp, dims, **kw)[1]
    fused, torch32 = run_both(q.float(), d.float(), neg.float(), sp, dims, **kw)
    for a, b, e in zip([fused[0], fused[1], *fused[2]], [torch32[0], torch32[1], *torch32[2]],
                       [exact[0], exact[1], *exact[2]]):
        err_f = (a.double() - e).abs().max().item()
        err_t = (b.double() - e).abs().max().item()
        assert err_f <= 2 * err_t + 8 * torch.finfo(torch.float32).eps * e.abs().max().item(), (err_f, err_t)


def test_more_than_16_levels_parity_float64():
    """More levels than the CPU kernel's all-level gradient row pass takes (16): the per-level coefficient tiles
    and the suffix-sum pass, float64 parity with the reference (gradient in forward and through levels)."""
    q, d, neg, sp = make(70, 40, Bd=101, N=5, spans="random", seed=7)
    dims = tuple(range(2, 40, 2)) + (40,)  # 20 levels
    w = tuple(0.0 if k % 7 == 3 else 1.0 + 0.1 * k for k in range(len(dims)))
    level_w = torch.linspace(-0.5, 0.5, len(dims))
    res = run_both(q, d, neg, sp, dims, weights=w, temperature=0.1, symmetric=False, level_w=level_w)
    assert_parity(*res, 1e-10)


def test_half_inputs_run_in_float32():
    q, d, _, _ = make(33, 32, dtype=torch.bfloat16)
    qq = q.clone().requires_grad_()
    loss = tempokern.matryoshka_infonce(qq, d, (16, 32), temperature=0.05)
    assert loss.dtype == torch.float32
    (g,) = torch.autograd.grad(loss, qq)
    assert g.dtype == torch.bfloat16
    want = ref(q.float(), d.float(), (16, 32), temperature=0.05)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)


def test_gradcheck_float64():
    q, d, neg, sp = make(6, 10, Bd=8, N=3, spans="random")
    ins = tuple(x.clone().requires_grad_() for x in (q, d, neg))
    f = lambda a, b, c: tempokern.matryoshka_infonce(a, b, (3, 7, 10), weights=(1.0, 0.5, 2.0),  # noqa: E731
                                                     temperature=0.3, extra_neg=c, **sp)
    assert torch.autograd.gradcheck(f, ins)
    ins2 = tuple(x.clone().requires_grad_() for x in (q[:6], d[:6]))
    sp2 = dict(q_span=sp["q_span"], d_span=tuple(t[:6] for t in sp["d_span"]))
    f2 = lambda a, b: tempokern.matryoshka_infonce(a, b, (3, 10), temperature=0.3, symmetric=True,  # noqa: E731
                                                   return_levels=True, **sp2)[1]
    assert torch.autograd.gradcheck(f2, ins2)


@pytest.mark.parametrize("row_w,col_w,want_grad", [(0.5, 0.5, True), (1.0, 0.0, True), (1.0, 0.0, False)])
def test_opcheck(row_w, col_w, want_grad):
    """(1.0, 0.0, True): the forward also computes the gradient (row-only loss)."""
    from tempokern._ops.matryoshka_infonce import inverse_prefix_norms
    q, d, neg, _ = make(9, 12, N=4)
    ids = torch.arange(9)
    dims = [4, 12]
    rho, kap, kn = (inverse_prefix_norms(x, dims) for x in (q, d, neg))
    args = (q.requires_grad_(), d.requires_grad_(), neg.requires_grad_(), rho.requires_grad_(),
            kap.requires_grad_(), kn.requires_grad_(), ids, ids, ids, ids, None, [0, 4, 12], [1.0, 0.5], 10.0, row_w,
            col_w, 0, False, False, want_grad)
    torch.library.opcheck(torch.ops.tempokern.matryoshka_infonce.default, args)


def test_torch_compile_of_a_module():
    q, d, neg, _ = make(24, 16, N=5)
    mod = tempokern.nn.MatryoshkaInfoNCE((4, 8, 16), weights=(1.0, 1.0, 2.0), temperature=0.1)

    def step(a, b, c):
        return mod(a, b, extra_neg=c)

    compiled = torch.compile(step, fullgraph=False)
    ins = [x.clone().requires_grad_() for x in (q, d, neg)]
    loss = compiled(*ins)
    grads = torch.autograd.grad(loss, ins)
    ins2 = [x.clone().requires_grad_() for x in (q, d, neg)]
    want = ref(ins2[0], ins2[1], (4, 8, 16), weights=(1.0, 1.0, 2.0), temperature=0.1, extra_neg=ins2[2])
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, torch.autograd.grad(want, ins2)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_module_matches_functional_and_truncate():
    q, d, neg, sp = make(20, 16, N=3, spans="random", dtype=torch.float32)
    mod = tempokern.nn.MatryoshkaInfoNCE((16, 4), weights=(1.0, 0.5), temperature=0.07, symmetric=True)
    want = ref(q, d, (16, 4), weights=(1.0, 0.5), temperature=0.07, symmetric=True, extra_neg=neg, **sp)
    torch.testing.assert_close(mod(q, d, neg, **sp), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tempokern.truncate(q, 5), F.normalize(q[:, :5], dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(tempokern.reference.truncate(q, 5), F.normalize(q[:, :5], dim=-1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="m must"):
        tempokern.truncate(q, 17)
    with pytest.raises(TypeError, match="dims"):
        tempokern.nn.MatryoshkaInfoNCE((4, 8.5))


def test_memory_stays_linear_in_batch():
    """B = C = 4,000, H = 16: one float32 (B, C) matrix is 64 MB; the fused forward + backward must add far
    less than that to the process's peak resident memory (VmHWM, reset through /proc/self/clear_refs)."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to measure peak memory")
    code = textwrap.dedent("""
        import torch, tempokern
        B, H = 4000, 16
        q = torch.randn(B, H, requires_grad=True); d = torch.randn(B, H, requires_grad=True)
        tempokern.matryoshka_infonce(q[:70], d[:70], (4, 8, 16), temperature=0.05).backward()  # warm-up
        def hwm():
            return int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]) * 1024
        def rss():
            return int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) * 1024
        open('/proc/self/clear_refs', 'w').write('5')
        base = rss()
        tempokern.matryoshka_infonce(q, d, (4, 8, 16), temperature=0.05, symmetric=True).backward()
        print(hwm() - base)
    """)
    from conftest import run_python   # the same tempokern as this process (installed or in-tree)
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    extra = int(out.stdout.strip().splitlines()[-1])
    assert extra < 4000 * 4000 * 4 // 4, f"peak grew by {extra / 2**20:.1f} MiB"


def test_bad_inputs():
    q, d, neg, sp = make(6, 8)
    mi = tempokern.matryoshka_infonce
    with pytest.raises(ValueError, match="dims must not be empty"):
        mi(q, d, [], temperature=0.1)
    with pytest.raises(ValueError, match="dims must lie"):
        mi(q, d, [4, 9], temperature=0.1)
    with pytest.raises(ValueError, match="dims must lie"):
        mi(q, d, [0, 8], temperature=0.1)
    with pytest.raises(TypeError, match="dims must hold ints"):
        mi(q, d, [4.0, 8], temperature=0.1)
    with pytest.raises(TypeError, match="dims must hold ints"):
        mi(q, d, [True, 8], temperature=0.1)
    with pytest.raises(TypeError, match="dims must be a sequence"):
        mi(q, d, 8, temperature=0.1)
    with pytest.raises(ValueError, match="dims must be unique"):
        mi(q, d, [4, 8, 4], temperature=0.1)
    with pytest.raises(ValueError, match="weights has 1 entries"):
        mi(q, d, [4, 8], weights=[1.0], temperature=0.1)
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        mi(q, d, [4, 8], weights=[1.0, -1.0], temperature=0.1)
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        mi(q, d, [4, 8], weights=[1.0, float("nan")], temperature=0.1)
    for t in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            mi(q, d, [4, 8], temperature=t)
    with pytest.raises(ValueError, match="hidden size"):
        mi(q, d[:, :6], [4, 6], temperature=0.1)
    with pytest.raises(TypeError, match="d has dtype"):
        mi(q, d.float(), [4, 8], temperature=0.1)
    with pytest.raises(TypeError, match="extra_neg has dtype"):
        mi(q, d, [4, 8], temperature=0.1, extra_neg=torch.randn(3, 8))
    with pytest.raises(ValueError, match="extra_neg has hidden size"):
        mi(q, d, [4, 8], temperature=0.1, extra_neg=torch.randn(3, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="q_span and d_span go together"):
        mi(q, d, [4, 8], temperature=0.1, q_span=(torch.arange(6), torch.arange(6)))
    with pytest.raises(ValueError, match="symmetric=True needs"):
        mi(q, torch.randn(7, 8, dtype=torch.float64), [4, 8], temperature=0.1, symmetric=True)
    with pytest.raises(ValueError, match="at least as many rows"):
        mi(q, d[:4], [4, 8], temperature=0.1)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        mi(q.tolist(), d, [4, 8], temperature=0.1)
    with pytest.raises(TypeError, match="symmetric must be a bool"):
        mi(q, d, [4, 8], temperature=0.1, symmetric=1)
    with pytest.raises(TypeError, match="q_span"):
        mi(q, d, [4, 8], temperature=0.1, q_span=torch.arange(6), d_span=torch.arange(6))
    with pytest.raises(ValueError, match="device"):
        mi(q, d.to("meta"), [4, 8], temperature=0.1)


def test_reference_matches_sentence_transformers_formula():
    """The reference (the spec) against a literal transcription of MatryoshkaLoss(MultipleNegativesRankingLoss):
    dims descending, shrink = slice + normalize, scale 20 = temperature 0.05, candidates [positives, negatives],
    labels arange, weighted sum."""
    q, d, neg, _ = make(10, 32, N=10)
    dims, weights = [32, 16, 8], [1.0, 0.5, 0.25]
    total = 0.0
    for m, w in zip(dims, weights):
        a = F.normalize(q[:, :m], dim=-1)
        c = F.normalize(torch.cat([d, neg])[:, :m], dim=-1)
        total = total + w * F.cross_entropy(20.0 * a @ c.t(), torch.arange(10))
    got = ref(q, d, dims, weights=weights, temperature=0.05, extra_neg=neg)
    torch.testing.assert_close(got, total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tempokern.matryoshka_infonce(q, d, dims, weights=weights, temperature=0.05,
                                                            extra_neg=neg), total, rtol=1e-12, atol=1e-12)


# ---- gather=True over two gloo processes -------------------------------------------------------------

WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[5])
    from test_matryoshka_infonce import gather_batch, GATHER_CONFIGS
    from tempokern.nn import MatryoshkaInfoNCE
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    q, d, negs, kw, sizes = gather_batch(world)
    sl = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    res = []
    for sym, spans in GATHER_CONFIGS:
        loc = [q[sl].clone().requires_grad_(), d[sl].clone().requires_grad_(), negs[rank].clone().requires_grad_()]
        lkw = {k: tuple(t[sl] for t in v) for k, v in kw.items()} if spans else {}
        loss = MatryoshkaInfoNCE((4, 12), weights=(0.5, 1.0), temperature=0.2, symmetric=sym, gather=True)(
            loc[0], loc[1], loc[2], **lkw)
        grads = torch.autograd.grad(loss, loc)
        res.append({"loss": loss.detach(), "grads": [x.detach() for x in grads]})
    torch.save(res, out)
    dist.destroy_process_group()
""")

GATHER_CONFIGS = [(False, False), (True, True), (True, False)]


def gather_batch(world):
    g = torch.Generator().manual_seed(7)
    sizes = [9, 6][:world]
    T = sum(sizes)
    q = torch.randn(T, 12, generator=g, dtype=torch.float64)
    d = torch.randn(T, 12, generator=g, dtype=torch.float64)
    negs = [torch.randn(3 + r, 12, generator=g, dtype=torch.float64) for r in range(world)]
    qs, ds = torch.randint(0, 12, (T,), generator=g), torch.randint(0, 12, (T,), generator=g)
    return q, d, negs, dict(q_span=(qs, qs + 1), d_span=(ds, ds)), sizes


def test_gather_two_gloo_processes(tmp_path):
    """Rank r's loss is (W B_r / T) x its rows' (and columns') terms of the single-process loss on the whole
    batch, so the mean over ranks equals the reference loss; a local query's gradient (non-symmetric: it is
    only an anchor) is W x its gradient in the single-process loss (DDP averages over ranks)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    init = f"file://{tmp_path / 'rendezvous'}"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", init, str(tmp_path / f"out{r}.pt"),
                               os.path.dirname(os.path.abspath(__file__))], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    res = [torch.load(tmp_path / f"out{r}.pt") for r in range(2)]
    q, d, negs, kw, sizes = gather_batch(2)
    for c, (symmetric, spans) in enumerate(GATHER_CONFIGS):
        ins = [q.clone().requires_grad_(), d.clone().requires_grad_(), torch.cat(negs).requires_grad_()]
        want = ref(ins[0], ins[1], (4, 12), weights=(0.5, 1.0), temperature=0.2, symmetric=symmetric,
                   extra_neg=ins[2], **(kw if spans else {}))
        got = (res[0][c]["loss"] + res[1][c]["loss"]) / 2
        torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
        gq = torch.autograd.grad(want, ins)[0]
        if not symmetric:
            got_q = torch.cat([res[0][c]["grads"][0], res[1][c]["grads"][0]]) / 2
            torch.testing.assert_close(got_q, gq, rtol=1e-10, atol=1e-12)
        assert all(torch.isfinite(x).all() for r in res for x in r[c]["grads"])


# ---- bias: offset_bias's per-pair bias, the same on every level (blocked path on every device) ------------

def make_bias(B, Bd, *, hidden=5, D=7, seed=1, dtype=torch.float64, u_lo=-0.5, u_hi=1.5):
    """(u_q, u_d, w1, b1, w2, b2, scale): offsets reaching both clamp sides and the inside of [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.empty(B, dtype=torch.float64).uniform_(u_lo, u_hi, generator=g).to(dtype),
            torch.empty(Bd, dtype=torch.float64).uniform_(u_lo, u_hi, generator=g).to(dtype),
            torch.randn(hidden, D, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(hidden, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(1, hidden, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(1, generator=g, dtype=torch.float64).to(dtype),
            torch.tensor(1.7, dtype=torch.float64).to(dtype))


def run_both_bias(q, d, neg, sp, dims, bias, *, level_w=None, table_points=None, **kw):
    """Loss, levels and the gradients of q, d, [extra_neg], u_q, u_d, w1, b1, w2, b2, scale for the fused op
    and the reference (the reference's table mode when table_points is given)."""
    out = []
    for fused in (True, False):
        ins = [x.clone().requires_grad_() for x in (q, d) + ((neg,) if neg is not None else ())]
        bs = [t.clone().requires_grad_() for t in bias]
        extra = dict(bias_table_points=table_points) if table_points is not None else {}
        fn = tempokern.matryoshka_infonce if fused else ref
        loss, levels = fn(ins[0], ins[1], dims, extra_neg=ins[2] if neg is not None else None, return_levels=True,
                          bias=tuple(bs), **sp, **kw, **extra)
        total = loss if level_w is None else loss + (levels * level_w.to(levels)).sum()
        grads = torch.autograd.grad(total, ins + bs)
        out.append((loss.detach(), levels.detach(), [g.detach() for g in grads]))
    return out


BIAS_CASES = [  # (B, Bd, N, spans, symmetric)
    (70, 70, 0, None, False), (70, 70, 0, None, True), (70, 101, 13, None, False), (70, 70, 13, "random", True),
    (70, 70, 0, "random", False), (5, 9, 3, "random", False),
]


@pytest.mark.parametrize("block", [0, 16])
@pytest.mark.parametrize("B,Bd,N,spans,symmetric", BIAS_CASES)
def test_bias_parity_float64(B, Bd, N, spans, symmetric, block):
    """Loss, levels and all gradients (q, d, extra_neg and the seven bias inputs) against the reference in
    float64; block=16: several row blocks (the bias block and its gradient per block)."""
    from _emu_support import force_blocked
    q, d, neg, sp = make(B, 50, Bd=Bd, N=N, spans=spans)
    bias = make_bias(B, Bd)
    with force_blocked(block) if block else torch.enable_grad():
        res = run_both_bias(q, d, neg, sp, (33, 8, 50, 20), bias, weights=(2.0, 1.0, 0.0, 0.5), temperature=0.07,
                            symmetric=symmetric, level_w=torch.tensor([0.3, -0.2, 0.0, 1.5]))
    assert_parity(*res, 1e-10)
    assert len(res[0][2]) == 2 + (N > 0) + 7
    # the bias matters: without it the loss differs
    plain = tempokern.matryoshka_infonce(q, d, (33, 8, 50, 20), temperature=0.07, symmetric=symmetric, **sp,
                                         extra_neg=neg)
    assert abs(plain.item() - res[0][0].item()) > 1e-3


@pytest.mark.parametrize("symmetric", [False, True])
def test_bias_table_mode_matches_reference_table(symmetric):
    """bias_table_points=N against the reference's tabulated bias (the same interpolant), several blocks."""
    from _emu_support import force_blocked
    q, d, neg, sp = make(40, 24, N=7, spans="random", seed=3)
    bias = make_bias(40, 40, seed=4)
    with force_blocked(12):
        res = run_both_bias(q, d, neg, sp, (6, 24, 13), bias, temperature=0.1, symmetric=symmetric,
                            table_points=33, level_w=torch.tensor([0.5, 0.0, -1.0]))
    assert_parity(*res, 1e-10)
    exact = tempokern.matryoshka_infonce(q, d, (6, 24, 13), temperature=0.1, symmetric=symmetric, extra_neg=neg,
                                         bias=bias, **sp)
    assert abs(exact.item() - res[0][0].item()) > 1e-6  # 33 points: the interpolant is not the MLP


def test_bias_module_form_reaches_module_parameters():
    """bias=(u_q, u_d, OffsetBias) equals the 7-tuple of the module's parameters; gradients reach them."""
    from tempokern.nn.offset_bias import bias_params
    torch.manual_seed(0)
    m = tempokern.nn.OffsetBias(features=6, hidden=4).double()
    q, d, neg, sp = make(20, 16, seed=5)
    u_q, u_d = make_bias(20, 20, seed=6)[:2]
    loss = tempokern.matryoshka_infonce(q, d, (8, 16), temperature=0.1, bias=(u_q, u_d, m))
    loss.backward()
    grads = [p.grad.clone() for p in bias_params(m)]
    ps = [p.detach().clone().requires_grad_() for p in bias_params(m)]
    expect = ref(q, d, (8, 16), temperature=0.1, bias=(u_q, u_d, *ps))
    torch.testing.assert_close(loss.detach(), expect.detach(), rtol=1e-10, atol=1e-10)
    for g, e in zip(grads, torch.autograd.grad(expect, ps)):
        torch.testing.assert_close(g, e.reshape(g.shape), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("symmetric", [False, True])
def test_bias_single_level_equals_multipos_infonce(symmetric):
    """One level (dims = (H,)) with a bias is multipos_infonce with the same bias on the normalised inputs."""
    q, d, neg, sp = make(30, 12, N=5, spans="random", seed=7)
    bias = make_bias(30, 30, seed=8)
    a = tempokern.matryoshka_infonce(q, d, (12,), temperature=0.05, symmetric=symmetric, extra_neg=neg, bias=bias,
                                     **sp)
    b = tempokern.multipos_infonce(F.normalize(q, dim=-1), F.normalize(d, dim=-1), sp["q_span"], sp["d_span"],
                                   temperature=0.05, symmetric=symmetric, extra_neg=F.normalize(neg, dim=-1),
                                   bias=bias)
    torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_bias_cuda_parity(gpu):
    """The CUDA path with a bias (on the emulator: the offset_bias kernels launch) vs the reference in
    float64, several row blocks, and float32 against float64 by the 2x rule."""
    from _emu_support import force_blocked
    q, d, neg, sp = make(96, 48, N=11, spans="random", seed=9)
    bias = make_bias(96, 96, seed=10)
    sp = {k: tuple(t.to(gpu) for t in v) for k, v in sp.items()}
    q, d, neg = q.to(gpu), d.to(gpu), neg.to(gpu)
    bias = tuple(t.to(gpu) for t in bias)
    dims = (8, 48, 20)
    with force_blocked(40):
        res = run_both_bias(q, d, neg, sp, dims, bias, temperature=0.05, symmetric=True)
        assert_parity(*res, 1e-9)
        exact = res[1]
        b32 = tuple(t.float() for t in bias)
        fused, torch32 = run_both_bias(q.float(), d.float(), neg.float(), sp, dims, b32, temperature=0.05,
                                       symmetric=True)
    for a, b, e in zip([fused[0], fused[1], *fused[2]], [torch32[0], torch32[1], *torch32[2]],
                       [exact[0], exact[1], *exact[2]]):
        err_f = (a.double() - e).abs().max().item()
        err_t = (b.double() - e).abs().max().item()
        assert err_f <= 2 * err_t + 64 * torch.finfo(torch.float32).eps * e.abs().max().item(), (err_f, err_t)


def test_bias_bad_inputs():
    q, d, neg, sp = make(6, 8)
    b = make_bias(6, 6)
    mi = tempokern.matryoshka_infonce
    with pytest.raises(TypeError, match="bias must be None"):
        mi(q, d, [4, 8], temperature=0.1, bias=b[:5])
    with pytest.raises(TypeError, match="bias must be None"):
        mi(q, d, [4, 8], temperature=0.1, bias=torch.zeros(6))
    with pytest.raises(TypeError, match="module alone"):
        mi(q, d, [4, 8], temperature=0.1, bias=tempokern.nn.OffsetBias(features=4, hidden=3))
    with pytest.raises(ValueError, match="bias u_q must have shape"):
        mi(q, d, [4, 8], temperature=0.1, bias=(b[0][:5], *b[1:]))
    with pytest.raises(ValueError, match="bias u_d must have shape"):
        mi(q, d, [4, 8], temperature=0.1, bias=(b[0], b[1][:4], *b[2:]))
    with pytest.raises(ValueError, match="bias b1 must have shape"):
        mi(q, d, [4, 8], temperature=0.1, bias=(*b[:3], b[3][:2], *b[4:]))
    with pytest.raises(ValueError, match="bias w2 must have shape"):
        mi(q, d, [4, 8], temperature=0.1, bias=(*b[:4], b[4].t(), *b[5:]))
    with pytest.raises(TypeError, match="bias w1"):
        mi(q, d, [4, 8], temperature=0.1, bias=(*b[:2], b[2].long(), *b[3:]))
    with pytest.raises(ValueError, match="device"):
        mi(q, d, [4, 8], temperature=0.1, bias=(*b[:6], b[6].to("meta")))
    with pytest.raises(ValueError, match="bias_table_points must be >= 2"):
        mi(q, d, [4, 8], temperature=0.1, bias=b, bias_table_points=1)
    with pytest.raises(TypeError, match=r"bias_table_points must be an int \(or None\)"):
        mi(q, d, [4, 8], temperature=0.1, bias=b, bias_table_points=3.0)
    with pytest.raises(ValueError, match="without a bias"):
        mi(q, d, [4, 8], temperature=0.1, bias_table_points=9)


@pytest.mark.parametrize("table", [False, True])
def test_bias_opcheck_and_gradcheck(table):
    """torch.library.opcheck of tempokern::matryoshka_infonce_bias (exact MLP and table mode), and gradcheck
    of the public function (exact MLP) in every input, the bias's seven included."""
    from tempokern._ops.matryoshka_infonce import inverse_prefix_norms
    from tempokern.reference.offset_bias import offset_bias_table
    q, d, neg, _ = make(9, 12, N=4)
    u_q, u_d, w1, b1, w2, b2, scale = make_bias(9, 9, hidden=3, D=4, seed=11)
    ids = torch.arange(9)
    dims = [4, 12]
    rho, kap, kn = (inverse_prefix_norms(x, dims) for x in (q, d, neg))
    bk = ((u_q, u_d, offset_bias_table(w1, b1, w2, b2, scale, 9), None, None, None, None, None) if table else
          (u_q, u_d, None, w1, b1, w2, b2, scale))
    bk = tuple(None if t is None else t.clone().requires_grad_() for t in bk)
    args = (q.requires_grad_(), d.requires_grad_(), neg.requires_grad_(), rho.requires_grad_(),
            kap.requires_grad_(), kn.requires_grad_(), ids, ids, ids, ids, None, *bk, [0, 4, 12], [1.0, 0.5], 10.0,
            0.5, 0.5, 0, False, False)
    torch.library.opcheck(torch.ops.tempokern.matryoshka_infonce_bias.default, args)
    if table:  # the table mode's gradients: parity with the reference's interpolant above
        return
    q, d, neg, sp = make(4, 6, Bd=5, N=2, spans="random", seed=12)
    bias = make_bias(4, 5, hidden=3, D=4, seed=13)
    ins = tuple(x.clone().requires_grad_() for x in (q, d, neg) + bias)
    f = lambda a, b, c, *bs: tempokern.matryoshka_infonce(  # noqa: E731
        a, b, (2, 5, 6), weights=(1.0, 0.5, 2.0), temperature=0.3, extra_neg=c, bias=bs, **sp)
    assert torch.autograd.gradcheck(f, ins, fast_mode=True)  # each offset_bias launch costs ~20 ms here
