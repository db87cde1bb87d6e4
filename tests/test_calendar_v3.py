"""The candidate v3 CUDA calendar kernels (csrc/calendar/calendar_v3_cuda.cu, TEMPOKERN_EXPERIMENTAL=calendar_v3:
float32 / float16 / bfloat16 calls with levels of <= 32 classes, and for calendar_context dim a multiple of 4 up to
128) against tempokern.reference on the CUDA emulator (and a GPU): outputs and every gradient, the 2x-torch rule
in each dtype, partial and several tiles per CTA at the SM counts of an L4 / A100 / H100 and one SM, thread-order
independence, non-finite logits, strided logits, and which calls fall back to the default kernels."""
import pytest
import torch
from _emu_support import patch_kernels, patch_sm_count, real_kernels, real_sm_count  # noqa: F401

import tempokern
from tempokern import reference as ref
from tempokern._ops import dispatch
from conftest import by_thread_order
from test_calendar_cuda import LaunchSpy, assert_within_twice_torch, make_logits

V3_OPS = {"context_fwd_v3", "context_bwd_v3"}
V3_SCALAR = {"scalar_fwd_v3", "scalar_bwd_v3"}


@pytest.fixture
def spy(monkeypatch):
    from tempokern._ops import calendar as cal
    s = LaunchSpy(real_kernels)
    patch_kernels(monkeypatch, s)
    with dispatch.use("calendar_v3"):
        yield s


def check_context(xs, dim, tau, tol, gtol, w_dtype=None):
    """calendar_context(xs) and the gradients of <out, w> against the float64 reference."""
    x64 = [x.detach().double().requires_grad_() for x in xs]
    got, want = tempokern.calendar_context(xs, dim, tau), ref.calendar_context(x64, dim, tau)
    assert got.dtype == xs[0].dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **tol)
    w = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(want.device)
    gf = torch.autograd.grad(got, xs, grad_outputs=w.to(w_dtype or got.dtype))
    ge = torch.autograd.grad(want, x64, grad_outputs=w)
    for a, b in zip(gf, ge):
        assert a.dtype == xs[0].dtype and a.shape == b.shape
        torch.testing.assert_close(a.double(), b, **gtol)


SHAPES = [  # (B, level sizes, dim)
    (1, [12, 32, 12], 64),       # one row of a 64-row tile
    (64, [1], 4),                # one full tile, a level of one class, the smallest dim
    (65, [17, 3], 36),           # two tiles (the second one row), an odd level of > 16 classes (4-row products)
    (300, [12, 32, 12], 64),     # 1M-row benchmark levels, 5 tiles, the last partial
    (203, [32, 32, 32, 7], 128), # 4 levels: two launches (3 + 1), the largest dim
    (130, [16, 2, 5], 68),       # levels of <= 16 classes (2-row products), dim not a multiple of 16
]


@pytest.mark.parametrize("B,sizes,dim", SHAPES)
def test_float32_against_reference(B, sizes, dim, gpu, spy):
    xs = make_logits(B, sizes, dtype=torch.float32, device=gpu, seed=B)
    check_context(xs, dim, 0.7, dict(atol=2e-6, rtol=1e-5), dict(atol=1e-5, rtol=1e-4))
    if gpu.type == "cpu":
        assert set(spy.ops) == V3_OPS
        assert spy.ops.count("context_fwd_v3") == -(-len(sizes) // 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sizes,dim", [([12, 32, 12], 64), ([32, 5], 36)])
def test_twice_torch_error(dtype, sizes, dim, gpu, spy):
    # error of the output and of every gradient vs float64 at most twice plain torch's own error in that dtype
    # (the reference formula evaluated in the dtype): RMS without slack, max error with the +1e-6 of
    # test_calendar_cuda.py
    B, tau = 203, 0.6
    xs = make_logits(B, sizes, dtype=dtype, device=gpu, seed=7)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    xp = [x.detach().clone().requires_grad_() for x in xs]
    tables = {n: ref.fourier_table(n, dim, dtype=dtype).to(xs[0].device) for n in sizes}
    f = tempokern.calendar_context(xs, dim, tau)
    e = ref.calendar_context(x64, dim, tau)
    p = torch.cat([torch.softmax(x / tau, -1) @ tables[x.shape[1]] for x in xp], -1)

    assert_within_twice_torch(f, e, p)
    wt = torch.randn(e.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(e.device)
    for a, b, c in zip(torch.autograd.grad(f, xs, grad_outputs=wt.to(dtype)),
                       torch.autograd.grad(e, x64, grad_outputs=wt),
                       torch.autograd.grad(p, xp, grad_outputs=wt.to(dtype))):
        assert a.dtype == dtype
        assert_within_twice_torch(a, b, c)
    if gpu.type == "cpu":
        assert set(spy.ops) == V3_OPS


def test_non_finite_logits_match_torch(gpu, spy):
    # -inf masks classes; NaN, +inf and an all -inf row give NaN as in torch (the max skips NaN, the sum keeps it)
    xs = make_logits(70, [12, 5], dtype=torch.float32, device=gpu, seed=3)
    with torch.no_grad():
        xs[0][0, :8] = float("-inf")
        xs[0][1, 3] = float("-inf")
        xs[1][2, 1] = float("nan")
        xs[1][3, 4] = float("inf")
        xs[1][4, :] = float("-inf")
        xs[0][69, :] = float("-inf")
    x64 = [x.detach().double().requires_grad_() for x in xs]
    got, want = tempokern.calendar_context(xs, 8, 0.8), ref.calendar_context(x64, 8, 0.8)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5, equal_nan=True)
    assert torch.isfinite(got[[0, 1, 5, 68]]).all() and torch.isnan(got[[2, 3, 4, 69]]).any(dim=1).all()
    w = torch.randn(want.shape, dtype=torch.float64).to(want.device)
    for a, b in zip(torch.autograd.grad(got, xs, grad_outputs=w.float()), torch.autograd.grad(want, x64, grad_outputs=w)):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-4, equal_nan=True)
    if gpu.type == "cpu":
        assert set(spy.ops) == V3_OPS


def test_strided_logits(gpu, spy):
    # levels sliced out of one (B, 56) head output: row stride 56, not n (the loads take any row stride)
    g = torch.Generator().manual_seed(9)
    head = (3 * torch.randn(150, 56, generator=g)).to(gpu).requires_grad_()
    xs = [head[:, :12], head[:, 12:44], head[:, 44:]]
    got = tempokern.calendar_context(xs, 64, 0.5)
    h64 = head.detach().double().requires_grad_()
    want = ref.calendar_context([h64[:, :12], h64[:, 12:44], h64[:, 44:]], 64, 0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    w = torch.randn(want.shape, dtype=torch.float64, generator=g).to(want.device)
    (ga,), (gb,) = torch.autograd.grad(got, head, grad_outputs=w.float()), torch.autograd.grad(want, h64, grad_outputs=w)
    torch.testing.assert_close(ga.double(), gb, atol=1e-5, rtol=1e-4)
    if gpu.type == "cpu":
        assert set(spy.ops) == V3_OPS


@pytest.mark.parametrize("case", ["float64", "33 classes", "dim 30", "dim 132", "broadcast gradient",
                                  "transposed gradient"])
def test_fallbacks(case, gpu, spy):
    # calls v3 does not take run the default kernels (warp-cooperative forward, thread-per-row backward), with the same results
    dtype = torch.float64 if case == "float64" else torch.float32
    sizes = [12, 33] if case == "33 classes" else [12, 32]
    dim = {"dim 30": 30, "dim 132": 132}.get(case, 64)
    xs = make_logits(90, sizes, dtype=dtype, device=gpu, seed=4)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    got, want = tempokern.calendar_context(xs, dim, 0.7), ref.calendar_context(x64, dim, 0.7)
    tol = dict(atol=1e-9, rtol=0) if dtype == torch.float64 else dict(atol=5e-5, rtol=1e-4)  # (the tile kernel's float32 grads)
    torch.testing.assert_close(got.double(), want, **tol)
    if case == "broadcast gradient":
        ga, gb = torch.autograd.grad(got.sum(), xs), torch.autograd.grad(want.sum(), x64)
    elif case == "transposed gradient":
        w = torch.randn(want.shape[1], want.shape[0], dtype=torch.float64).to(want.device)
        ga = torch.autograd.grad(got, xs, grad_outputs=w.to(dtype).t())
        gb = torch.autograd.grad(want, x64, grad_outputs=w.t())
    else:
        w = torch.randn(want.shape, dtype=torch.float64).to(want.device)
        ga, gb = torch.autograd.grad(got, xs, grad_outputs=w.to(dtype)), torch.autograd.grad(want, x64, grad_outputs=w)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a.double(), b, **tol)
    if gpu.type == "cpu":
        gradient_only = case in ("broadcast gradient", "transposed gradient")
        assert set(spy.ops) == ({"context_fwd_v3", "context_bwd"} if gradient_only else {"context_fwd", "context_bwd"})


@pytest.mark.emu
def test_thread_orders(cuda_emu, monkeypatch):
    # three seeded thread orders of the emulator give bitwise equal results (a missing __syncthreads around the
    # shared P^T / G / dP^T tiles, or a prefetch overwriting registers still needed, changes them); one SM with
    # 2 CTAs walking 6 tiles each, 4 levels (two launches), float32 and bfloat16
    spy = _one_sm(monkeypatch)

    def run():
        g = torch.Generator().manual_seed(5)
        outs = []
        for dt in (torch.float32, torch.bfloat16):
            xs = [(3 * torch.randn(701, n, generator=g)).to(dt).requires_grad_() for n in (17, 1, 12, 32)]
            c = tempokern.calendar_context(xs, 44, 0.7)
            w = torch.randn(c.shape, generator=g).to(dt)
            outs += [c, *torch.autograd.grad(c, xs, grad_outputs=w)]
        return outs

    _assert_bitwise_equal(by_thread_order(cuda_emu, run))
    assert set(spy.ops) == V3_OPS


def _one_sm(monkeypatch):
    """The candidate on one emulated SM (every CTA walks several tiles), its launches recorded (enabled through
    TEMPOKERN_EXPERIMENTAL, as a user enables it)."""
    import tempokern._ops.common as common
    from tempokern._ops import calendar as cal
    monkeypatch.setenv("TEMPOKERN_EXPERIMENTAL", "calendar_v3")
    patch_sm_count(monkeypatch, lambda device: 1)
    spy = LaunchSpy(real_kernels)
    patch_kernels(monkeypatch, spy)
    return spy


def _assert_bitwise_equal(outs):
    for seed, o in enumerate(outs[1:], 1):
        for i, (a, b) in enumerate(zip(outs[0], o)):
            assert torch.equal(a, b), (seed, i)


def test_kernel_checks_its_inputs(gpu):
    # the launcher's own guards (Python routes only eligible calls to v3): float64, 4 levels, 33 classes, dim 6
    from tempokern._ops import calendar as cal
    from tempokern._ops.common import dtype_code, launch_args
    from conftest import expect_no_kernel
    expect_no_kernel()
    x = torch.zeros(8, 12, device=gpu)
    dev, stream = launch_args(x)
    out = torch.empty(8, 64, device=gpu)
    tab = cal._table(12, 16, torch.float32, x.device, "cuda_fwd")
    lv = (x.data_ptr(), 0, 12, 12, 1.0, tab.data_ptr(), 0)
    for levels, dim, dt, msg in (([lv], 16, torch.float64, "float64"), ([lv] * 4, 16, torch.float32, "1-3 levels"),
                                 ([(x.data_ptr(), 0, 33, 33, 1.0, tab.data_ptr(), 0)], 16, torch.float32, "1-32"),
                                 ([lv], 6, torch.float32, "multiple of 4")):
        with pytest.raises(ValueError, match=msg):
            real_kernels().calendar_launch("context_fwd_v3", dev, stream, dtype_code(torch.zeros(1, dtype=dt)), 8, 1.0,
                                          levels, out.data_ptr(), 0, 64, dim, False, 1, 1)


# ---- calendar_scalar v3 --------------------------------------------------------------------------------------------

def check_scalar(xs, tau, tol, gtol):
    x64 = [x.detach().double().requires_grad_() for x in xs]
    got, want = tempokern.calendar_scalar(xs, tau), ref.calendar_scalar(x64, tau)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **tol)
    w = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(want.device)
    for a, b in zip(torch.autograd.grad(got, xs, grad_outputs=w.float()), torch.autograd.grad(want, x64, grad_outputs=w)):
        assert a.dtype == xs[0].dtype and a.shape == b.shape
        torch.testing.assert_close(a.double(), b, **gtol)


@pytest.mark.parametrize("B,sizes,dim", SHAPES)
def test_scalar_float32_against_reference(B, sizes, dim, gpu, spy):
    # 1 to 33 row groups of 8 (the last partial), 4 levels: two launches, the second accumulating into the output
    xs = make_logits(B, sizes, dtype=torch.float32, device=gpu, seed=B + 1)
    check_scalar(xs, 0.7, dict(atol=2e-6, rtol=1e-5), dict(atol=1e-5, rtol=1e-4))
    if gpu.type == "cpu":
        assert set(spy.ops) == V3_SCALAR
        assert spy.ops.count("scalar_fwd_v3") == -(-len(sizes) // 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scalar_twice_torch_error(dtype, gpu, spy):
    B, sizes, tau = 203, [12, 32, 12, 5], 0.6
    xs = make_logits(B, sizes, dtype=dtype, device=gpu, seed=8)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    xp = [x.detach().clone().requires_grad_() for x in xs]
    w = ref.level_weights(sizes)
    f = tempokern.calendar_scalar(xs, tau)
    e = ref.calendar_scalar(x64, tau)
    p = sum(wl * (torch.softmax(x / tau, -1) @ torch.arange(x.shape[1], dtype=dtype, device=x.device))
            for wl, x in zip(w, xp))

    assert_within_twice_torch(f, e, p)
    wt = torch.randn(e.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).to(e.device)
    for a, b, c in zip(torch.autograd.grad(f, xs, grad_outputs=wt.float()),
                       torch.autograd.grad(e, x64, grad_outputs=wt),
                       torch.autograd.grad(p, xp, grad_outputs=wt.to(p.dtype))):
        assert a.dtype == dtype
        assert_within_twice_torch(a, b, c)
    if gpu.type == "cpu":
        assert set(spy.ops) == V3_SCALAR


# the grid: context min(64-row tiles, _CTAS_PER_SM_V3 x SMs) persistent CTAs, one SM with 1 or 2 CTAs walking all 33
# tiles (the next tile's loads overlap each tile, across level boundaries in the backward); scalar min(row groups /
# 8 warps, _CTAS_PER_SM_V3_SCALAR x SMs) CTAs of 8 warps, one SM with 1 CTA walking 261 groups of 8 rows (the next
# group's loads overlap each group); at 58 / 108 / 132 SMs every tile has its own CTA
GRID_OPS = {  # op: (its CTAs-per-SM constant, kernel, launched ops, seed offset, the check against the reference)
    "context": ("_CTAS_PER_SM_V3", "context_fwd", V3_OPS, 0,
                lambda xs: check_context(xs, 40, 0.6, dict(atol=2e-6, rtol=1e-5), dict(atol=1e-5, rtol=1e-4))),
    "scalar": ("_CTAS_PER_SM_V3_SCALAR", "scalar_fwd", V3_SCALAR, 1,
               lambda xs: check_scalar(xs, 0.6, dict(atol=2e-6, rtol=1e-5), dict(atol=1e-5, rtol=1e-4))),
}


@pytest.mark.parametrize("op,sms,per_sm", [("context", 1, 1), ("context", 1, 2), ("context", 58, None),
                                           ("context", 108, None), ("context", 132, None), ("scalar", 1, 1),
                                           ("scalar", 1, 3), ("scalar", 58, None), ("scalar", 132, None)])
def test_grid_at_sm_counts(op, sms, per_sm, gpu, spy, monkeypatch):
    import tempokern._ops.common as common
    from tempokern._ops import calendar as cal
    const, kernel, ops, seed, check = GRID_OPS[op]
    patch_sm_count(monkeypatch, lambda device: sms)
    if per_sm is not None:
        monkeypatch.setattr(cal, const, per_sm)
    xs = make_logits(2087, [12, 32, 9], dtype=torch.float32, device=gpu, seed=sms + seed)
    check(xs)
    assert cal._max_ctas(xs[0], kernel, "v3") == max(1, (per_sm or getattr(cal, const)) * sms)
    if gpu.type == "cpu":
        assert set(spy.ops) == ops


def test_scalar_non_finite_and_fallbacks(gpu, spy):
    # -inf masks classes; NaN, +inf and an all -inf row give NaN as in torch; float64 and a level of 33 classes run
    # the default kernels
    xs = make_logits(70, [12, 5], dtype=torch.float32, device=gpu, seed=5)
    with torch.no_grad():
        xs[0][0, :8] = float("-inf")
        xs[1][2, 1] = float("nan")
        xs[1][3, 4] = float("inf")
        xs[1][4, :] = float("-inf")
    x64 = [x.detach().double().requires_grad_() for x in xs]
    got, want = tempokern.calendar_scalar(xs, 0.8), ref.calendar_scalar(x64, 0.8)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5, equal_nan=True)
    assert torch.isfinite(got[[0, 1, 5]]).all() and torch.isnan(got[[2, 3, 4]]).all()
    if gpu.type == "cpu":
        assert set(spy.ops) == {"scalar_fwd_v3"}
        spy.ops.clear()
    for dtype, sizes in ((torch.float64, [12, 5]), (torch.float32, [33, 5])):
        xs = make_logits(40, sizes, dtype=dtype, device=gpu, seed=6)
        check_scalar(xs, 0.7, dict(atol=2e-6, rtol=1e-5), dict(atol=1e-5, rtol=1e-4)) if dtype == torch.float32 else \
            torch.testing.assert_close(tempokern.calendar_scalar(xs, 0.7), ref.calendar_scalar(xs, 0.7), atol=1e-9, rtol=0)
    if gpu.type == "cpu":
        assert set(spy.ops) == {"scalar_fwd", "scalar_bwd"}


@pytest.mark.emu
def test_scalar_thread_orders(cuda_emu, monkeypatch):
    # three seeded thread orders give bitwise equal results (the warps share nothing; a prefetch overwriting
    # registers still in use would show); one SM, one CTA, 4 levels (two launches), float32 and float16
    from tempokern._ops import calendar as cal
    spy = _one_sm(monkeypatch)
    monkeypatch.setattr(cal, "_CTAS_PER_SM_V3_SCALAR", 1)

    def run():
        g = torch.Generator().manual_seed(6)
        outs = []
        for dt in (torch.float32, torch.float16):
            xs = [(3 * torch.randn(301, n, generator=g)).to(dt).requires_grad_() for n in (17, 1, 12, 32)]
            u = tempokern.calendar_scalar(xs, 0.7)
            outs += [u, *torch.autograd.grad(u, xs, grad_outputs=torch.randn(u.shape, generator=g))]
        return outs

    _assert_bitwise_equal(by_thread_order(cuda_emu, run))
    assert set(spy.ops) == V3_SCALAR
