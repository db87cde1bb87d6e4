"""calendar_scalar / calendar_context / fourier_table vs tempokern.reference."""
import math

import pytest
import torch
from _emu_support import patch_kernels, patch_sm_count, real_kernels, real_sm_count  # noqa: F401

import tempokern
from tempokern import reference as ref

SHAPES = [  # (B, level sizes)
    (1, [1]),
    (7, [12, 32, 12]),
    (33, [5]),
    (129, [3, 1, 7, 2]),
    (65, [2] * 10),  # more levels than one kernel launch takes (8): exercises chunking
    (40, [300, 3]),  # a level wider than a warp several times
]


def make_logits(B, sizes, dtype=torch.float32, device="cpu", scale=3.0):
    return [(scale * torch.randn(B, n, dtype=torch.float64)).to(dtype).to(device).requires_grad_() for n in sizes]


def grads(out, xs, w):
    return torch.autograd.grad((out.double() * w).sum(), xs)


@pytest.mark.parametrize("B,sizes", SHAPES)
@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_scalar_matches_reference(B, sizes, tau, device):
    xs = make_logits(B, sizes, device=device)
    got, want = tempokern.calendar_scalar(xs, tau), ref.calendar_scalar(xs, tau)
    assert got.dtype == torch.float32 and got.shape == (B,)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    w = torch.randn(B, dtype=torch.float64, device=device)
    for g, r in zip(grads(got, xs, w), grads(want, xs, w)):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("B,sizes", SHAPES)
@pytest.mark.parametrize("dim", [1, 16, 33, 64])
def test_context_matches_reference(B, sizes, dim, device):
    xs = make_logits(B, sizes, device=device)
    got, want = tempokern.calendar_context(xs, dim, 0.7), ref.calendar_context(xs, dim, 0.7)
    assert got.shape == (B, len(sizes) * dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    w = torch.randn(B, len(sizes) * dim, dtype=torch.float64, device=device)
    for g, r in zip(grads(got, xs, w), grads(want, xs, w)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_chunqiu_formula():
    # Sharp logits pick (g, y, m); u must be the paper's (g*Y*M + y*M + m) / (G*Y*M - 1).
    G, Y, M = 12, 32, 12
    g, y, m = torch.tensor([0, 3, 11]), torch.tensor([0, 17, 31]), torch.tensor([0, 5, 11])
    xs = [torch.nn.functional.one_hot(i, n).double() * 100 for i, n in ((g, G), (y, Y), (m, M))]
    u = tempokern.calendar_scalar(xs)
    want = (g * Y * M + y * M + m).double() / (G * Y * M - 1)
    torch.testing.assert_close(u, want, atol=1e-12, rtol=0)
    assert abs(u[0]) < 1e-12 and abs(u[-1] - 1) < 1e-12


def test_single_slot_calendar_gives_zero():
    xs = [torch.randn(4, 1), torch.randn(4, 1)]
    assert torch.equal(tempokern.calendar_scalar(xs), torch.zeros(4))


def test_fourier_table_pinned_values():
    # Hand-written values (math.sin/cos of the positions times the frequencies 1, 1e-2, 1e-4), independent of
    # tempokern.reference: n = 3 -> positions 0, 1/2, 1; dim = 7 -> half = 3, freqs exp(-ln(1e4) i / 2), i < 3,
    # columns [sin x3, cos x3, 0].
    want = torch.tensor([
        [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0],
        [0.479425538604203, 0.004999979166692708, 4.999999997916667e-05,
         0.8775825618903728, 0.9999875000260416, 0.99999999875, 0.0],
        [0.8414709848078965, 0.009999833334166664, 9.999999983333334e-05,
         0.5403023058681398, 0.9999500004166653, 0.999999995, 0.0],
    ], dtype=torch.float64)
    for fn in (tempokern.fourier_table, ref.fourier_table):
        torch.testing.assert_close(fn(3, 7, dtype=torch.float64), want, atol=1e-15, rtol=0)
        torch.testing.assert_close(fn(3, 6, dtype=torch.float64), want[:, :6], atol=1e-15, rtol=0)
        # half = 1: one frequency, exp(0) = 1 (the max(1, half - 1) guard)
        torch.testing.assert_close(fn(3, 2, dtype=torch.float64), want[:, [0, 3]], atol=1e-15, rtol=0)
        # dim = 1: ChunQiuTR returns the position column c / (n - 1)
        torch.testing.assert_close(fn(5, 1, dtype=torch.float64),
                                   torch.tensor([[0.0], [0.25], [0.5], [0.75], [1.0]], dtype=torch.float64))
        assert torch.equal(fn(1, 1, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64))
        assert torch.equal(fn(1, 3, dtype=torch.float64), torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("sizes", [[5], [1, 7], [33]])
def test_context_dim_one_is_expected_position(sizes, device):
    # with the position column as codebook, calendar_context(dim=1) is each level's expected c / (n - 1)
    xs = make_logits(23, sizes, dtype=torch.float64, device=device)
    got = tempokern.calendar_context(xs, 1, 0.9)
    for l, x in enumerate(xs):
        n = x.shape[1]
        e = torch.softmax(x.detach() / 0.9, -1) @ torch.arange(n, dtype=torch.float64, device=device)
        torch.testing.assert_close(got[:, l], e / max(1, n - 1), atol=1e-12, rtol=0)


def test_fourier_table_definition():
    n, dim = 5, 9
    t = tempokern.fourier_table(n, dim)
    half = dim // 2
    pos = torch.arange(n, dtype=torch.float64) / (n - 1)
    f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / (half - 1))
    torch.testing.assert_close(t[:, :half].double(), torch.sin(pos[:, None] * f))
    torch.testing.assert_close(t[:, half:2 * half].double(), torch.cos(pos[:, None] * f))
    assert torch.all(t[:, 2 * half:] == 0)
    assert torch.all(tempokern.fourier_table(1, 4)[:, 2:] == 1)  # n == 1: position 0, cos = 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["scalar", "context"])
@pytest.mark.parametrize("sizes,dim", [([12, 32, 12], 32), ([70, 1, 7], 45)])
def test_low_precision_within_twice_torch_error(dtype, op, sizes, dim, device):
    # flash-attention's rule: error vs a float32 reference at most twice plain PyTorch's own error in that dtype.
    B, tau = 257, 0.5
    xs = make_logits(B, sizes, dtype=dtype, device=device)
    xs32 = [x.detach().float().requires_grad_() for x in xs]
    if op == "scalar":
        fused, exact = tempokern.calendar_scalar(xs, tau), ref.calendar_scalar(xs32, tau)
        w = ref.level_weights(sizes)
        plain = sum(wl * (torch.softmax(x / tau, -1) @ torch.arange(x.shape[1], device=device, dtype=dtype))
                    for wl, x in zip(w, xs))
    else:
        fused, exact = tempokern.calendar_context(xs, dim, tau), ref.calendar_context(xs32, dim, tau)
        plain = torch.cat([torch.softmax(x / tau, -1) @ ref.fourier_table(x.shape[1], dim, dtype=dtype, device=device)
                           for x in xs], -1)
    err_fused = (fused.float() - exact).abs().max().item()
    err_plain = (plain.float() - exact).abs().max().item()
    assert err_fused <= 2 * err_plain + 1e-6, (err_fused, err_plain)
    wt = torch.randn_like(exact)
    g_f = torch.autograd.grad((fused.float() * wt).sum(), xs)
    g_e = torch.autograd.grad((exact * wt).sum(), xs32)
    g_p = torch.autograd.grad((plain.float() * wt).sum(), xs)
    for a, e, p in zip(g_f, g_e, g_p):
        assert a.dtype == dtype
        ea, ep = (a.float() - e).abs().max().item(), (p.float() - e).abs().max().item()
        assert ea <= 2 * ep + 1e-6, (ea, ep)


def test_gradcheck_float64():
    xs = make_logits(6, [3, 4, 2], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda *a: tempokern.calendar_scalar(list(a), 0.8), xs)
    assert torch.autograd.gradcheck(lambda *a: tempokern.calendar_context(list(a), 6, 0.8), xs)


@pytest.mark.parametrize("op", ["scalar", "context"])
def test_double_backward_is_not_supported(op):
    # The ops are differentiable once (their backward is a custom op without a formula of its own):
    # a second derivative must fail loudly, not return zeros.
    xs = make_logits(4, [3, 5], dtype=torch.float64)
    out = tempokern.calendar_scalar(xs) if op == "scalar" else tempokern.calendar_context(xs, 4)
    g = torch.autograd.grad(out.square().sum(), xs, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.autograd.grad(sum(x.sum() for x in g), xs)


def test_opcheck(device):
    xs = [x.detach().requires_grad_() for x in make_logits(9, [4, 5, 3], device=device)]
    torch.library.opcheck(torch.ops.tempokern.calendar_scalar.default, (xs, 0.9))
    torch.library.opcheck(torch.ops.tempokern.calendar_context.default, (xs, 8, 0.9))


def test_under_torch_compile():
    xs = make_logits(11, [12, 32, 12])

    def f(a, b, c):
        return tempokern.calendar_scalar([a, b, c], 0.5).sum() + tempokern.calendar_context([a, b, c], 8).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out, want = compiled(*xs), f(*xs)
    torch.testing.assert_close(out, want)
    g1 = torch.autograd.grad(out, xs)
    g2 = torch.autograd.grad(f(*xs), xs)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_strided_rows_accepted():
    base = torch.randn(10, 40)
    xs = [base[:, :12], base[:, 12:44 - 4]]  # non-contiguous row views
    torch.testing.assert_close(tempokern.calendar_scalar(xs), ref.calendar_scalar(xs))
    t = torch.randn(12, 10).t()  # column stride != 1
    torch.testing.assert_close(tempokern.calendar_context([t], 8), ref.calendar_context([t], 8))


def test_empty_batch():
    xs = [torch.randn(0, 4, requires_grad=True), torch.randn(0, 3, requires_grad=True)]
    assert tempokern.calendar_scalar(xs).shape == (0,)
    out = tempokern.calendar_context(xs, 5)
    assert out.shape == (0, 10)
    out.sum().backward()
    assert xs[0].grad.shape == (0, 4)


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [lambda x, **k: tempokern.calendar_scalar(x, **k),
                                lambda x, **k: tempokern.calendar_context(x, 8, **k)])
def test_bad_inputs(fn):
    good = [torch.randn(4, 3), torch.randn(4, 5)]
    with pytest.raises(TypeError, match="logits"):
        fn(torch.randn(4, 3))
    with pytest.raises(ValueError, match="at least one level"):
        fn([])
    with pytest.raises(ValueError, match=r"logits\[1\].*batch size 5"):
        fn([torch.randn(4, 3), torch.randn(5, 3)])
    with pytest.raises(ValueError, match=r"logits\[0\] must be 2-D"):
        fn([torch.randn(4), torch.randn(4, 3)])
    with pytest.raises(TypeError, match=r"logits\[1\] must be float"):
        fn([torch.randn(4, 3), torch.ones(4, 3, dtype=torch.long)])
    with pytest.raises(TypeError, match=r"logits\[1\] has dtype"):
        fn([torch.randn(4, 3), torch.randn(4, 3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="at least one class"):
        fn([torch.randn(4, 0)])
    for tau in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tau"):
            fn(good, tau=tau)
    with pytest.raises(TypeError, match="tau"):
        fn(good, tau="1")
    with pytest.raises(ValueError, match="one device"):
        fn([torch.randn(4, 3), torch.randn(4, 3, device="meta")])


def test_context_bad_dim():
    with pytest.raises(ValueError, match="dim"):
        tempokern.calendar_context([torch.randn(2, 3)], 0)
    with pytest.raises(TypeError, match="dim"):
        tempokern.calendar_context([torch.randn(2, 3)], 4.0)
    with pytest.raises(ValueError, match="n must be"):
        tempokern.fourier_table(0, 4)


def test_non_finite_propagates_by_default_and_raises_in_debug():
    xs = [torch.randn(3, 4), torch.randn(3, 5)]
    xs[1][1, 2] = float("nan")
    u = tempokern.calendar_scalar(xs)
    assert torch.isnan(u[1]) and torch.isfinite(u[[0, 2]]).all()  # as torch would
    tempokern.set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match=r"logits\[1\] contains NaN"):
            tempokern.calendar_scalar(xs)
    finally:
        tempokern.set_debug_checks(False)


def test_debug_env_switch_in_subprocess():
    from conftest import run_python
    code = ("import torch, tempokern\nx=[torch.tensor([[float('inf'), 0.]])]\n"
            "try:\n tempokern.calendar_scalar(x)\nexcept ValueError as e:\n print('raised', e)\n")
    res = run_python(code, TEMPOKERN_CHECK="1")
    assert "raised" in res.stdout and "NaN or Inf" in res.stdout, res.stdout + res.stderr


def test_cuda_matches_cpu(gpu):
    # float32 on both: CUDA's error against the float64 truth within twice the CPU kernel's (+ 1e-6;
    # the two sum the context gradients in different orders, and either may be the closer one)
    from conftest import cpu_kernels
    xs = make_logits(1000, [12, 32, 12, 40])
    xc = [x.detach().to(gpu).requires_grad_() for x in xs]
    x64 = [x.detach().double().requires_grad_() for x in xs]
    err = lambda a, b: float((a.detach().cpu().double() - b.detach()).abs().max())  # noqa: E731
    for fn in (lambda a: tempokern.calendar_scalar(a, 0.6), lambda a: tempokern.calendar_context(a, 48, 0.6)):
        with cpu_kernels():
            a = fn(xs)
            w = torch.randn_like(a)
            g_cpu = torch.autograd.grad((a * w).sum(), xs)
            t = fn(x64)
            g_64 = torch.autograd.grad((t * w.double()).sum(), x64)
        b = fn(xc)
        assert err(b, t) <= 2 * err(a, t) + 1e-6
        for gc, gg, g64 in zip(g_cpu, torch.autograd.grad((b * w.to(gpu)).sum(), xc), g_64):
            assert err(gg, g64) <= 2 * err(gc, g64) + 1e-6


@pytest.mark.cuda
def test_cuda_on_nondefault_stream():
    xs = [torch.randn(300, 12, device="cuda"), torch.randn(300, 32, device="cuda")]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # xs were written on the default stream
    with torch.cuda.stream(s):
        u = tempokern.calendar_scalar(xs)
    s.synchronize()
    torch.testing.assert_close(u, ref.calendar_scalar(xs))


@pytest.mark.parametrize("kind", ["broadcast", "transposed"])
def test_context_backward_reads_strided_gradients(kind, device):
    # out.sum() hands backward an expanded (stride-0) gradient; it must be read, not copied or misread.
    xs = make_logits(37, [12, 32, 5], device=device)
    xr = [x.detach().clone().requires_grad_() for x in xs]
    if kind == "broadcast":
        tempokern.calendar_context(xs, 24, 0.8).sum().backward()
        ref.calendar_context(xr, 24, 0.8).sum().backward()
    else:
        w = torch.randn(3 * 24, 37, device=device).t()  # column stride != 1
        (tempokern.calendar_context(xs, 24, 0.8) * w).sum().backward()
        (ref.calendar_context(xr, 24, 0.8) * w).sum().backward()
    for a, b in zip(xs, xr):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


# ---- CUDA kernels: layout, chunking and grid-stride paths ---------------------------------------

ODD = [  # (B, level sizes, dim): levels of 1 and of more than 32 classes (several chunks), odd dims
    (1, [1], 1),
    (3, [1, 1], 5),
    (129, [33, 1, 12], 33),
    (130, [64, 65], 31),
    (67, [12, 32, 12], 100),
    (40, [97], 64),
]


@pytest.mark.parametrize("B,sizes,dim", ODD)
def test_float64_parity_odd_sizes(B, sizes, dim, device):
    # float64: fused forward and every gradient within 1e-9 of the reference (CPU kernels and CUDA kernels)
    xs = make_logits(B, sizes, dtype=torch.float64, device=device)
    for fused, plain in ((lambda a: tempokern.calendar_scalar(a, 0.7), lambda a: ref.calendar_scalar(a, 0.7)),
                         (lambda a: tempokern.calendar_context(a, dim, 0.7),
                          lambda a: ref.calendar_context(a, dim, 0.7))):
        got, want = fused(xs), plain(xs)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
        w = torch.randn_like(want)
        for g, r in zip(grads(got, xs, w), grads(want, xs, w)):
            torch.testing.assert_close(g, r, atol=1e-9, rtol=0)


@pytest.mark.parametrize("sms,per_sm", [(1, 2), (132, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_grid_stride_at_sm_counts(sms, per_sm, dtype, gpu, monkeypatch):
    # The CUDA grid is min(row tiles, _CTAS_PER_SM x SM count). With 1 SM and 2 CTAs per SM, 2 CTAs walk 17
    # tiles of 128 rows (33 of 64 in float64): every CTA loops. 132 (H100) SMs at the real factor give one tile
    # per CTA here (as 58 or 108 would: the same launch shape). Every row must come out right, forward and
    # backward, with levels of 1, 12 and 33 classes and dim 40.
    import tempokern._ops.common as common
    from tempokern._ops import calendar as cal
    # (the tile kernels: the scalar op and the context backward; the context forward's grid: test_calendar_cuda.py)
    seen = []
    real = real_sm_count

    def fake(device):
        seen.append(real(device))
        return sms

    patch_sm_count(monkeypatch, fake)
    if per_sm is not None:
        monkeypatch.setattr(cal, "_CTAS_PER_SM", per_sm)
    B, sizes, dim = 128 * 16 + 5, [1, 12, 33], 40
    xs = make_logits(B, sizes, dtype=dtype, device=gpu)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    tol = dict(atol=1e-9, rtol=0) if dtype == torch.float64 else dict(atol=2e-6, rtol=1e-5)
    gtol = dict(atol=1e-9, rtol=0) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-4)
    for fused, plain in ((lambda a: tempokern.calendar_scalar(a, 0.6), lambda a: ref.calendar_scalar(a, 0.6)),
                         (lambda a: tempokern.calendar_context(a, dim, 0.6),
                          lambda a: ref.calendar_context(a, dim, 0.6))):
        got, want = fused(xs), plain(x64)
        torch.testing.assert_close(got.double(), want, **tol)
        w = torch.randn_like(want)
        for g, r in zip(grads(got, xs, w), grads(want, x64, w)):
            torch.testing.assert_close(g.double(), r, **gtol)
    assert seen, "the CUDA launch did not ask sm_count for its grid"


def test_table_cache_is_bounded():
    from tempokern._ops import calendar as cal
    for n in range(1, 3 * cal._TABLE_CACHE_SIZE):
        cal._table(n, 8, torch.float32, torch.device("cpu"))
    assert len(cal._tables) == cal._TABLE_CACHE_SIZE
    # least recently used goes first: a table used again survives
    keep = cal._table(5, 3, torch.float32, torch.device("cpu"))
    for n in range(1, cal._TABLE_CACHE_SIZE):
        cal._table(n, 4, torch.float32, torch.device("cpu"))
        assert cal._table(5, 3, torch.float32, torch.device("cpu")) is keep
    assert len(cal._tables) == cal._TABLE_CACHE_SIZE


@pytest.mark.emu
def test_cuda_kernels_do_not_depend_on_thread_order(cuda_emu, monkeypatch):
    # The emulator runs each block's threads to their next barrier in a seeded random order: a missing
    # __syncthreads around the shared tiles changes results. Every output element is written by one thread
    # in a fixed order, so results must be bitwise equal. Multi-chunk levels, odd dim, grid-stride (1 SM).
    import tempokern._ops.common as common
    from _emu_support import cuda_emulator
    from tempokern._ops import calendar as cal
    patch_sm_count(monkeypatch, lambda device: 1)
    monkeypatch.setattr(cal, "_CTAS_PER_SM", 3)
    g = torch.Generator().manual_seed(5)

    def run():
        outs = []
        for dt in (torch.float32, torch.float64, torch.bfloat16):
            xs = [(3 * torch.randn(1100, n, generator=g)).to(dt).requires_grad_() for n in (70, 1, 12, 33)]
            u = tempokern.calendar_scalar(xs, 0.7)
            outs += [u, *torch.autograd.grad((u * torch.randn(u.shape, generator=g)).sum(), xs)]
            c = tempokern.calendar_context(xs, 37, 0.7)
            w = torch.randn(c.shape, generator=g).to(dt)
            outs += [c, *torch.autograd.grad((c * w).sum(), xs)]
        return outs

    try:
        with cuda_emulator(cuda_emu):
            cuda_emu.emu_set_seed(0)
            g.manual_seed(5)
            base = run()
            for s in (1, 2):
                cuda_emu.emu_set_seed(s)
                g.manual_seed(5)
                for i, (a, b) in enumerate(zip(base, run())):
                    assert torch.equal(a, b), (s, i)
    finally:
        cuda_emu.emu_set_seed(0)


def test_non_finite_logits_match_torch(device):
    # -inf masks classes (finite result, also when a whole 32-class chunk of a level is -inf: the online
    # softmax must not turn exp(-inf - -inf) into NaN); NaN, +inf and all -inf rows give NaN as in torch.
    xs = make_logits(6, [40, 5], dtype=torch.float64, device=device)
    with torch.no_grad():
        xs[0][0, :32] = float("-inf")   # first chunk of a row all -inf, the rest finite
        xs[0][1, 3] = float("-inf")
        xs[1][2, 1] = float("nan")
        xs[1][3, 4] = float("inf")
        xs[1][4, :] = float("-inf")     # whole row masked
    for fused, plain in ((lambda a: tempokern.calendar_scalar(a, 0.8), lambda a: ref.calendar_scalar(a, 0.8)),
                         (lambda a: tempokern.calendar_context(a, 7, 0.8),
                          lambda a: ref.calendar_context(a, 7, 0.8))):
        got, want = fused(xs), plain(xs)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0, equal_nan=True)
        assert torch.isfinite(got[[0, 1, 5]]).all()
        w = torch.randn_like(want)
        for g, r in zip(grads(got, xs, w), grads(want, xs, w)):
            torch.testing.assert_close(g, r, atol=1e-12, rtol=0, equal_nan=True)
