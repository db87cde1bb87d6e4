"""Fused multi-positive InfoNCE vs the plain PyTorch reference: loss and every gradient."""
import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import tempokern
from tempokern.reference import multipos_infonce as ref

# The tree holding the tempokern this process imported (installed or in-tree build), for subprocesses.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tempokern.__file__)))


def make(B, H, *, N=0, bias=False, dtype=torch.float64, spans="random", hidden=5, D=7, u_lo=-0.5, u_hi=1.5,
         seed=0, device="cpu", Bd=None):
    g = torch.Generator().manual_seed(seed)
    Bd = B if Bd is None else Bd
    q = torch.randn(B, H, generator=g, dtype=torch.float64).to(dtype)
    d = torch.randn(Bd, H, generator=g, dtype=torch.float64).to(dtype)
    if spans == "random":
        qs = torch.randint(0, 60, (B,), generator=g)
        qe = qs + torch.randint(-4, 5, (B,), generator=g)
        ds = torch.randint(0, 60, (Bd,), generator=g)
        de = ds + torch.randint(-4, 5, (Bd,), generator=g)
    elif spans == "disjoint":  # no pair overlaps: every row and column falls back to its diagonal
        qs = torch.arange(B) * 10
        qe = qs + 2
        ds = torch.arange(Bd) * 10 + 5
        de = ds + 3
    else:  # "all": every pair overlaps
        qs, qe = torch.zeros(B, dtype=torch.int64), torch.full((B,), 100)
        ds, de = torch.full((Bd,), 100), torch.full((Bd,), 50)
    neg = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype) if N else None
    b = None
    if bias:
        b = (torch.empty(B, dtype=torch.float64).uniform_(u_lo, u_hi, generator=g).to(dtype),
             torch.empty(Bd, dtype=torch.float64).uniform_(u_lo, u_hi, generator=g).to(dtype),
             torch.randn(hidden, D, generator=g, dtype=torch.float64).to(dtype),
             torch.randn(hidden, generator=g, dtype=torch.float64).to(dtype),
             torch.randn(1, hidden, generator=g, dtype=torch.float64).to(dtype),
             torch.randn(1, generator=g, dtype=torch.float64).to(dtype),
             torch.tensor(0.7, dtype=dtype))
    t = lambda x: None if x is None else x.to(device).requires_grad_()  # noqa: E731
    q, d, neg = t(q), t(d), t(neg)
    b = None if b is None else tuple(t(x) for x in b)
    spans_ = ((qs.to(device), qe.to(device)), (ds.to(device), de.to(device)))
    return q, d, spans_, neg, b


def leaves(q, d, neg, b):
    return [x for x in [q, d, neg] + list(b or ()) if x is not None]


def run(fn, q, d, spans, neg, b, temperature=0.1, symmetric=True):
    loss = fn(q, d, *spans, temperature=temperature, bias=b, extra_neg=neg, symmetric=symmetric)
    grads = torch.autograd.grad(loss, leaves(q, d, neg, b))
    return loss, grads


def assert_close_all(a, b, rtol, atol):
    la, ga = a
    lb, gb = b
    torch.testing.assert_close(la.to(lb.dtype), lb, rtol=rtol, atol=atol)
    for i, (x, y) in enumerate(zip(ga, gb)):
        torch.testing.assert_close(x.to(y.dtype), y, rtol=rtol, atol=atol, msg=lambda m: f"grad {i}: {m}")


CASES = [  # B, H, N, bias, symmetric, spans
    (7, 5, 0, False, True, "random"),
    (97, 33, 0, False, True, "random"),      # not a multiple of the 64 x 96 tiles
    (130, 33, 11, True, True, "random"),
    (200, 40, 100, True, False, "random"),
    (161, 17, 3, True, True, "disjoint"),    # every row/column uses its diagonal
    (101, 9, 0, True, True, "all"),          # every pair positive
    (65, 8, 130, False, False, "all"),
    (1, 4, 2, True, True, "random"),
]


@pytest.mark.parametrize("B,H,N,bias,symmetric,spans", CASES)
def test_parity_float64(B, H, N, bias, symmetric, spans):
    q, d, sp, neg, b = make(B, H, N=N, bias=bias, spans=spans)
    assert_close_all(run(tempokern.multipos_infonce, q, d, sp, neg, b, symmetric=symmetric),
                     run(ref, q, d, sp, neg, b, symmetric=symmetric), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_parity_float32(bias):
    q, d, sp, neg, b = make(300, 64, N=50, bias=bias, dtype=torch.float32)
    fused = run(tempokern.multipos_infonce, q, d, sp, neg, b, temperature=0.05)
    q64, d64, _, neg64, b64 = make(300, 64, N=50, bias=bias, dtype=torch.float64)
    exact = run(ref, q64, d64, sp, neg64, b64, temperature=0.05)
    assert fused[0].dtype == torch.float32
    assert_close_all(fused, exact, rtol=1e-4, atol=1e-5)


def test_bias_clamp_both_sides_and_inside():
    # u spread over [-3, 4]: many pairs clamp at +1 and -1, others are inside; u beyond +-1 too.
    q, d, sp, neg, b = make(150, 12, bias=True, u_lo=-3.0, u_hi=4.0, seed=3)
    delta = b[1].detach()[None, :] - b[0].detach()[:, None]
    assert (delta > 1).any() and (delta < -1).any() and (delta.abs() <= 1).any()
    assert_close_all(run(tempokern.multipos_infonce, q, d, sp, neg, b), run(ref, q, d, sp, neg, b),
                     rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("D", [1, 2, 5, 8])
def test_bias_feature_sizes(D):
    q, d, sp, neg, b = make(70, 6, bias=True, hidden=3, D=D, seed=D)
    assert_close_all(run(tempokern.multipos_infonce, q, d, sp, neg, b), run(ref, q, d, sp, neg, b),
                     rtol=1e-10, atol=1e-12)


def test_gradcheck():
    q, d, sp, neg, b = make(6, 4, N=3, bias=True, hidden=3, D=4, seed=1)
    ins = leaves(q, d, neg, b)

    def f(q, d, neg, *bias):
        return tempokern.multipos_infonce(q, d, *sp, temperature=0.3, bias=bias, extra_neg=neg)

    assert torch.autograd.gradcheck(f, tuple(ins), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("bias,bounds", [(False, False), (True, False), (True, True)])
def test_opcheck(bias, bounds):
    from tempokern._ops.loss_args import span_bounds
    from tempokern._ops.multipos_infonce import _sorted_by_u, bias_kernel_inputs, interval_bounds
    q, d, sp, neg, b = make(20, 6, N=4, bias=bias, dtype=torch.float32, seed=2)
    spans = (*span_bounds(sp[0]), *span_bounds(sp[1]))
    extras = (None,) * 4
    if bounds:  # the CPU path: rows/columns sorted by u, unit bounds and explicit diagonal partners
        q, d, *spans, b, diag = _sorted_by_u(q, d, *spans, b, 0)
        q, d = q.detach().requires_grad_(), d.detach().requires_grad_()
        extras = (*interval_bounds(b[2], b[3]), *diag)
    kb = (None,) * 9 if b is None else tuple(
        x.detach().requires_grad_(x.dtype.is_floating_point and i < 7) for i, x in
        enumerate(bias_kernel_inputs(b, torch.float32)))
    row_none = (torch.arange(20) % 3 == 0).to(torch.uint8)  # the optional global row-fallback flags
    args = (q, d, *spans, neg, *kb, *extras, row_none if bounds else None, None, 10.0, 0.5, 0.5, 0, False)
    torch.library.opcheck(torch.ops.tempokern.multipos_infonce, args)


@pytest.mark.parametrize("table", [False, True])
def test_opcheck_blocked(table):
    # the blocked op (every CUDA call, the table mode on CPU): schema, fake tensor, autograd registration
    from tempokern._ops.loss_args import span_bounds
    from tempokern.reference.offset_bias import offset_bias_table
    q, d, sp, neg, b = make(20, 6, N=4, bias=table, dtype=torch.float32, seed=2)
    spans = (*span_bounds(sp[0]), *span_bounds(sp[1]))
    bias = (None,) * 3
    if table:
        tab = offset_bias_table(*b[2:], 33).float().detach().requires_grad_()
        bias = (b[0].detach().requires_grad_(), b[1].detach().requires_grad_(), tab)
    args = (q, d, *spans, neg, *bias, None, None, None, None, None, 10.0, 0.5, 0.5, 0, True, 0, None, False)
    torch.library.opcheck(torch.ops.tempokern.multipos_blocked, args)


def forced_b1(b1, kind):
    """b1 making units always on (+50) / always off (-50) over every delta (|w1 phi| is far smaller)."""
    out = b1.detach().clone()
    if kind == "mixed":
        out[0], out[1] = 50.0, -50.0
    elif kind != "random":
        out.fill_(50.0 if kind == "all_on" else -50.0)
    return out.requires_grad_()


@pytest.mark.parametrize("kind", ["random", "mixed", "all_on", "all_off"])
def test_bias_unit_pruning(kind):
    # The CPU kernel sorts rows/columns by u and, per tile, sums provably always-on units into one
    # linear unit and skips always-off ones; loss and every gradient (w1/b1/w2 of summed and skipped
    # units included) must still match the reference. Many tiles (B = 333) and a narrow hidden layer
    # with roots inside [-1, 1] so tiles see on, off and ReLU units.
    q, d, sp, neg, b = make(333, 9, N=5, bias=True, hidden=6, D=8, seed=11, u_lo=0.0, u_hi=1.0)
    b = b[:3] + (forced_b1(b[3], kind),) + b[4:]
    fused = run(tempokern.multipos_infonce, q, d, sp, neg, b)
    exact = run(ref, q, d, sp, neg, b)
    assert_close_all(fused, exact, rtol=1e-10, atol=1e-12)
    if kind == "all_off":  # the bias is the constant scale * b2: no gradient reaches w1, b1, w2
        for g in fused[1][-5:-2]:
            assert torch.count_nonzero(g) == 0


@pytest.mark.parametrize("symmetric", [True, False])
def test_bias_sorted_rows_keep_diagonal_fallback(symmetric):
    # Disjoint spans: every row and column falls back to its own diagonal, which the CPU path must
    # find again after sorting rows and columns by u (u_q and u_d in opposite orders here).
    q, d, sp, neg, b = make(200, 8, bias=True, spans="disjoint", seed=4)
    with torch.no_grad():
        b[0].copy_(torch.linspace(1.2, -0.3, 200, dtype=b[0].dtype))
        b[1].copy_(torch.linspace(-0.4, 1.1, 200, dtype=b[1].dtype))
    assert_close_all(run(tempokern.multipos_infonce, q, d, sp, neg, b, symmetric=symmetric),
                     run(ref, q, d, sp, neg, b, symmetric=symmetric), rtol=1e-10, atol=1e-12)


def test_bias_unit_pruning_float32_and_clamp():
    q, d, sp, neg, b = make(260, 32, N=7, bias=True, hidden=8, D=6, u_lo=-2.0, u_hi=3.0, seed=5,
                            dtype=torch.float32)
    b = b[:3] + (forced_b1(b[3], "mixed"),) + b[4:]
    fused = run(tempokern.multipos_infonce, q, d, sp, neg, b, temperature=0.05)
    q64, d64, _, neg64, b64 = make(260, 32, N=7, bias=True, hidden=8, D=6, u_lo=-2.0, u_hi=3.0, seed=5)
    b64 = b64[:3] + (forced_b1(b64[3], "mixed"),) + b64[4:]
    exact = run(ref, q64, d64, sp, neg64, b64, temperature=0.05)
    assert_close_all(fused, exact, rtol=1e-4, atol=1e-5)


def test_loss_matches_hand_computation():
    # 2 x 2 with hand-picked spans: row 0 overlaps both docs, row 1 none (diagonal fallback).
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    d = torch.tensor([[0.5, 0.5], [1.0, -1.0]], dtype=torch.float64)
    sp_q = (torch.tensor([0, 10]), torch.tensor([5, 12]))
    sp_d = (torch.tensor([3, 4]), torch.tensor([4, 6]))
    s = q @ d.t()  # temperature 1
    row0 = torch.logsumexp(s[0], 0) - torch.logsumexp(s[0], 0)            # both positive -> 0
    row1 = torch.logsumexp(s[1], 0) - s[1, 1]                              # fallback: diagonal
    col0 = torch.logsumexp(s[:, 0], 0) - s[0, 0]                           # column 0: only row 0 overlaps
    # column 1: row 0 overlaps, and row 1's fallback (1, 1) is a positive too: ChunQiuTR's d->q mask is the
    # row-fallback mask transposed (a column-only fallback would give s[0, 1] alone)
    col1 = torch.logsumexp(s[:, 1], 0) - torch.logsumexp(torch.stack([s[0, 1], s[1, 1]]), 0)
    want = ((row0 + row1) / 2 + (col0 + col1) / 2) / 2
    got = tempokern.multipos_infonce(q, d, sp_q, sp_d, temperature=1.0)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("temperature", [0.01, 0.1, 1.0])
def test_numerics_large_scores(temperature):
    # |q.d| / temperature up to ~1e4: nothing overflows, and the result matches float64.
    q, d, sp, neg, b = make(90, 16, N=7, bias=True)
    with torch.no_grad():
        for x in (q, d, neg):
            x.mul_(25.0 / 4.0)  # |q.d| up to ~100 -> /0.01 = 1e4
    q32, d32, neg32 = (x.detach().float().requires_grad_() for x in (q, d, neg))
    b32 = tuple(x.detach().float().requires_grad_() for x in b)
    loss32, g32 = run(tempokern.multipos_infonce, q32, d32, sp, neg32, b32, temperature=temperature)
    s_max = (q.detach() @ d.detach().t()).abs().max().item() / temperature
    assert s_max > 5e3 or temperature > 0.01
    assert torch.isfinite(loss32) and all(torch.isfinite(g).all() for g in g32)
    loss64, g64 = run(ref, q, d, sp, neg, b, temperature=temperature)
    torch.testing.assert_close(loss32.double(), loss64, rtol=1e-4, atol=1e-2 if temperature == 0.01 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_tolerance_rule(dtype):
    # Fused error vs the float32 reference at most ~2x plain PyTorch's own error in that dtype.
    q, d, sp, neg, b = make(120, 32, N=10, dtype=torch.float32)
    with torch.no_grad():
        for x in (q, d, neg):
            x.mul_(0.2)
    exact = ref(q, d, *sp, temperature=0.1, extra_neg=neg).item()
    qh, dh, nh = (x.detach().to(dtype) for x in (q, d, neg))
    plain = ref(qh, dh, *sp, temperature=0.1, extra_neg=nh).float().item()
    fused_loss = tempokern.multipos_infonce(qh.requires_grad_(), dh, *sp, temperature=0.1, extra_neg=nh)
    fused_loss.backward()
    assert qh.grad.dtype == dtype and torch.isfinite(qh.grad.float()).all()
    err_plain = abs(plain - exact)
    assert abs(fused_loss.item() - exact) <= 2 * err_plain + 1e-5


def test_bad_inputs():
    q, d, sp, neg, b = make(8, 4, N=2, bias=True, dtype=torch.float32)
    f = tempokern.multipos_infonce
    with pytest.raises(TypeError, match="q_span start"):
        f(q, d, (sp[0][0].float(), sp[0][1]), sp[1], temperature=0.1)
    with pytest.raises(ValueError, match="d_span end has length 7"):
        f(q, d, sp[0], (sp[1][0], sp[1][1][:7]), temperature=0.1)
    with pytest.raises(TypeError, match="q_span"):
        f(q, d, sp[0][0], sp[1], temperature=0.1)
    with pytest.raises(ValueError, match="extra_neg has hidden size 5"):
        f(q, d, *sp, temperature=0.1, extra_neg=torch.randn(3, 5))
    with pytest.raises(ValueError, match="temperature"):
        f(q, d, *sp, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        f(q, d, *sp, temperature=-1.0)
    with pytest.raises(ValueError, match="same batch size"):
        f(q, d[:7], sp[0], (sp[1][0][:7], sp[1][1][:7]), temperature=0.1)
    with pytest.raises(ValueError, match="hidden size"):
        f(q, d[:, :3], *sp, temperature=0.1)
    with pytest.raises(TypeError, match="dtype"):
        f(q, d.double(), *sp, temperature=0.1)
    with pytest.raises(ValueError, match="one device"):
        f(q, d.to("meta"), *sp, temperature=0.1)
    with pytest.raises(TypeError, match="7-tuple"):
        f(q, d, *sp, temperature=0.1, bias=b[:6])
    with pytest.raises(ValueError, match="bias b1"):
        f(q, d, *sp, temperature=0.1, bias=(b[0], b[1], b[2], b[3][:-1], b[4], b[5], b[6]))
    with pytest.raises(ValueError, match="bias u_d"):
        f(q, d, *sp, temperature=0.1, bias=(b[0], b[1][:5], *b[2:]))
    with pytest.raises(ValueError, match="bias scale"):
        f(q, d, *sp, temperature=0.1, bias=(*b[:6], torch.ones(2)))
    with pytest.raises(TypeError, match="symmetric"):
        f(q, d, *sp, temperature=0.1, symmetric=1)


def test_memory_no_bxb_buffer():
    """Runs B = 9000 under an address-space limit 256 MiB above the inputs: a single B x B float32
    matrix (309 MiB) cannot be allocated, so the fused op passing proves it never builds one, forward
    or backward. The reference is run under the same limit to show the limit bites."""
    script = textwrap.dedent("""
        import resource, sys, torch, tempokern
        from tempokern.reference import multipos_infonce as ref
        torch.manual_seed(0)
        B, H = 9000, 16
        q = torch.randn(B, H, requires_grad=True); d = torch.randn(B, H, requires_grad=True)
        qs = torch.randint(0, 1000, (B,)); ds = torch.randint(0, 1000, (B,))
        bias = (torch.rand(B).requires_grad_(), torch.rand(B).requires_grad_(), torch.randn(4, 4, requires_grad=True),
                torch.randn(4, requires_grad=True), torch.randn(1, 4, requires_grad=True),
                torch.zeros(1, requires_grad=True), torch.tensor(0.5, requires_grad=True))
        neg = torch.randn(500, H, requires_grad=True)
        # warm the op (registration, thread pools) before the limit
        tempokern.multipos_infonce(q[:100], d[:100], (qs[:100], qs[:100] + 5), (ds[:100], ds[:100] + 5),
                                   temperature=0.05, bias=tuple(x[:100] if x.dim() == 1 and x.shape[0] == B else x
                                   for x in bias)).backward()
        vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024
        limit = vm + 256 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        loss = tempokern.multipos_infonce(q, d, (qs, qs + 5), (ds, ds + 5), temperature=0.05, bias=bias, extra_neg=neg)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(q.grad).all() and torch.isfinite(bias[2].grad).all()
        print("FUSED_OK", float(loss))
        try:
            ref(q, d, (qs, qs + 5), (ds, ds + 5), temperature=0.05, bias=bias, extra_neg=neg).backward()
            print("REF_OK")
        except (RuntimeError, MemoryError):
            print("REF_OOM")
    """)
    env = dict(os.environ, OMP_NUM_THREADS="2", MALLOC_ARENA_MAX="2", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                       cwd=tempfile.gettempdir())
    assert "FUSED_OK" in r.stdout, r.stdout + r.stderr
    assert "REF_OOM" in r.stdout, r.stdout + r.stderr


# ---- CUDA (runs only where a GPU exists) ---------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def matmul_tf32(on: bool):
    # the fp32_precision API: reading or mixing in the legacy allow_tf32 raises once it is in use
    m = torch.backends.cuda.matmul
    old = m.fp32_precision
    m.fp32_precision = "tf32" if on else "ieee"
    try:
        yield
    finally:
        m.fp32_precision = old


def emu_size(gpu, B):
    """The emulator runs a kernel thousands of times slower than a GPU: cap its batches (still several
    tiles, not a multiple of any)."""
    return B if gpu.type == "cuda" else min(B, 257)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("B,N,symmetric", [(300, 0, True), (129, 70, False), (1000, 33, True)])
def test_cuda_parity_float32(gpu, B, N, bias, symmetric):
    B = emu_size(gpu, B)
    q, d, sp, neg, b = make(B, 72, N=N, bias=bias, dtype=torch.float32, device=gpu)
    q64, d64, sp64, neg64, b64 = make(B, 72, N=N, bias=bias, dtype=torch.float64)
    with matmul_tf32(False):
        fused = run(tempokern.multipos_infonce, q, d, sp, neg, b, symmetric=symmetric)
    exact = run(ref, q64, d64, sp64, neg64, b64, symmetric=symmetric)
    fused = (fused[0].cpu(), [g.cpu() for g in fused[1]])
    assert_close_all(fused, exact, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_half_tolerance_rule(gpu, dtype, bias):
    q, d, sp, neg, b = make(emu_size(gpu, 777), 128, N=40, bias=bias, dtype=torch.float32, device=gpu)
    with torch.no_grad():
        for x in (q, d, neg):
            x.mul_(0.1)
    exact, gex = run(ref, q, d, sp, neg, b)
    qh, dh, nh = (x.detach().to(dtype).requires_grad_() for x in (q, d, neg))
    plain, gpl = run(ref, qh, dh, sp, nh, b)
    fused, gfu = run(tempokern.multipos_infonce, qh, dh, sp, nh, b)
    assert abs(fused.item() - exact.item()) <= 2 * abs(plain.float().item() - exact.item()) + 1e-4
    for gf, gp, ge in zip(gfu[:3], gpl[:3], gex[:3]):
        err_f = (gf.float() - ge).abs().max().item()
        err_p = (gp.float() - ge).abs().max().item()
        assert err_f <= 2 * err_p + 1e-6


def test_cuda_all_fallback_and_all_positive(gpu):
    for spans in ("disjoint", "all"):
        q, d, sp, neg, b = make(211, 40, N=5, bias=True, dtype=torch.float32, device=gpu, spans=spans)
        q64, d64, sp64, neg64, b64 = make(211, 40, N=5, bias=True, spans=spans)
        fused = run(tempokern.multipos_infonce, q, d, sp, neg, b)
        exact = run(ref, q64, d64, sp64, neg64, b64)
        assert_close_all((fused[0].cpu(), [g.cpu() for g in fused[1]]), exact, rtol=2e-4, atol=2e-5)


def test_non_contiguous_inputs():
    # strided rows (row stride 2H), a transposed view and a strided extra_neg give the same numbers
    q, d, sp, neg, b = make(77, 10, N=9, bias=True, seed=5)
    big_q = torch.zeros(77, 20, dtype=q.dtype)
    big_q[:, :10] = q.detach()
    qv = big_q[:, :10].requires_grad_()
    dt = d.detach().t().contiguous().t().requires_grad_()  # column-major storage
    negv = torch.stack([neg.detach(), neg.detach()], dim=2)[:, :, 0].requires_grad_()
    assert qv.stride(0) == 20 and dt.stride(1) != 1 and negv.stride(1) == 2
    got = run(tempokern.multipos_infonce, qv, dt, sp, negv, b)
    want = run(ref, q, d, sp, neg, b)
    assert_close_all(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_parity_random_configs(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    B, H, N = ri(1, 230), ri(1, 40), ri(0, 1) * ri(1, 120)
    bias, symmetric = bool(ri(0, 1)), bool(ri(0, 1))
    spans = ("random", "random", "disjoint", "all")[ri(0, 3)]
    spread = (0.2, 1.0, 3.0)[ri(0, 2)]
    q, d, sp, neg, b = make(B, H, N=N, bias=bias, spans=spans, hidden=ri(1, 9), D=ri(1, 12),
                            u_lo=-spread, u_hi=1 + spread, seed=seed)
    temperature = (0.02, 0.1, 0.7)[ri(0, 2)]
    assert_close_all(run(tempokern.multipos_infonce, q, d, sp, neg, b, temperature, symmetric),
                     run(ref, q, d, sp, neg, b, temperature, symmetric), rtol=1e-9, atol=1e-11)


def test_cuda_float32_tf32_allowed(gpu):
    # With TF32 allowed the float32 score tiles use TF32 tensor cores: compare with torch's own TF32 error.
    q, d, sp, neg, b = make(emu_size(gpu, 500), 96, N=20, bias=True, dtype=torch.float32, device=gpu)
    with torch.no_grad():
        for x in (q, d, neg):
            x.mul_(0.1)
    with matmul_tf32(False):
        exact = run(ref, q, d, sp, neg, b)[0].item()
    with matmul_tf32(True):
        plain = run(ref, q, d, sp, neg, b)[0].item()
        fused = run(tempokern.multipos_infonce, q, d, sp, neg, b)[0].item()
    assert abs(fused - exact) <= 2 * abs(plain - exact) + 1e-4
    # torch.set_float32_matmul_precision("high") is the usual switch; the kernel must read it without
    # tripping torch's legacy/new TF32 API check
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        again = run(tempokern.multipos_infonce, q, d, sp, neg, b)[0].item()
    finally:
        torch.set_float32_matmul_precision(old)
    assert abs(again - exact) <= 2 * abs(plain - exact) + 1e-4


@pytest.mark.parametrize("Bq,Bd,off,rw,cw", [(70, 210, 70, 1.0, 0.0), (210, 70, -70, 0.0, 1.0), (133, 133, 0, 0.5, 0.5)])
def test_cuda_float64_partial_matches_reference(gpu, Bq, Bd, off, rw, cw):
    from conftest import cpu_kernels
    # CTDLoss(gather=True)'s calls: Bq != Bd, a diagonal offset, one weight zero; float64, strided q rows,
    # bias, extra negatives; the CUDA path and the CPU kernel, each against the plain-torch reference of the
    # partial loss (the reference, not product code against product code).
    from tempokern._ops.routing import multipos_infonce_partial
    from tempokern.reference.multipos_infonce import multipos_infonce_partial as ref_partial
    g = torch.Generator().manual_seed(Bq + Bd)
    H, N, hidden, D = 40, 37, 6, 12
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q_big, d, neg = r(Bq, 2 * H), r(Bd, H), (r(N, H) if rw else None)
    q_lo, d_lo = torch.randint(0, 300, (Bq,), generator=g), torch.randint(0, 300, (Bd,), generator=g)
    q_hi, d_hi = q_lo + torch.randint(0, 4, (Bq,), generator=g), d_lo + torch.randint(0, 4, (Bd,), generator=g)
    bias = (torch.rand(Bq, generator=g, dtype=torch.float64) * 2 - 0.5,
            torch.rand(Bd, generator=g, dtype=torch.float64) * 2 - 0.5,
            r(hidden, D), r(hidden), r(1, hidden), r(1), torch.tensor(0.7, dtype=torch.float64))

    def go(device, fn=multipos_infonce_partial):
        qv = q_big.to(device)[:, :H].detach().requires_grad_()  # row stride 2H
        assert qv.stride(0) == 2 * H
        leaves = [qv] + [x.to(device).requires_grad_() for x in (d,) + ((neg,) if rw else ()) + bias]
        dv, nv = leaves[1], (leaves[2] if rw else None)
        bv = tuple(leaves[-7:])
        spans = [x.to(device) for x in (q_lo, q_hi, d_lo, d_hi)]
        loss = fn(qv, dv, *spans, temperature=0.2, bias=bv, extra_neg=nv, row_weight=rw, col_weight=cw,
                  diag_offset=off)
        return [loss] + list(torch.autograd.grad(loss, leaves))

    want = go("cpu", ref_partial)
    with cpu_kernels():
        cpu = go("cpu")
    for got in (go(gpu), cpu):
        for a, b in zip(got, want):
            assert torch.isfinite(b).all()
            torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-10)


def test_cuda_bias_with_many_features_matches_reference(gpu):
    # the old CUDA kernel stopped at D <= 65; the blocked path evaluates the bias with offset_bias's kernels
    q, d, sp, neg, b = make(10, 8, bias=True, D=70, dtype=torch.float64, device=gpu)
    got = run(tempokern.multipos_infonce, q, d, sp, None, b, temperature=0.1)
    want = run(ref, q, d, sp, None, b, temperature=0.1)
    assert_close_all(got, want, rtol=1e-9, atol=1e-10)
