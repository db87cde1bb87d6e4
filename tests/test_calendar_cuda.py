"""The default CUDA calendar kernels (tempokern/_ops/dispatch.py: the context forward on warp-cooperative rows, the
context backward and the scalar op on thread-per-row tiles) against tempokern.reference on the CUDA emulator (and
a GPU); the candidate v3 kernels have tests/test_calendar_v3.py."""
import pytest
import torch
from _emu_support import patch_kernels, patch_sm_count, real_kernels, real_sm_count  # noqa: F401

import tempokern
from tempokern import reference as ref
from tempokern._ops import dispatch

DEFAULT_OPS = {"scalar_fwd", "scalar_bwd", "context_fwd", "context_bwd"}


def make_logits(B, sizes, dtype=torch.float64, device="cpu", scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(B, n, dtype=torch.float64, generator=g)).to(dtype).to(device).requires_grad_()
            for n in sizes]


class LaunchSpy:
    """kernels() of tempokern._ops.calendar, recording the op names it launches."""

    def __init__(self, real):
        self.real, self.ops = real, []

    def __call__(self):
        spy = self

        class M:
            def __getattr__(self, name):
                return getattr(spy.real(), name)

            def calendar_launch(self, op, *a, **k):
                spy.ops.append(op)
                return spy.real().calendar_launch(op, *a, **k)
        return M()


@pytest.fixture
def spy(monkeypatch):
    from tempokern._ops import calendar as cal
    s = LaunchSpy(real_kernels)
    patch_kernels(monkeypatch, s)
    return s


def both_ops(dim, tau):
    return ((lambda a: tempokern.calendar_scalar(a, tau), lambda a: ref.calendar_scalar(a, tau)),
            (lambda a: tempokern.calendar_context(a, dim, tau), lambda a: ref.calendar_context(a, dim, tau)))


SHAPES = [  # (B, level sizes, dim)
    (1, [1], 1),                # one row: a warp's group of 8 rows holds 1
    (5, [12, 32, 12], 64),      # the issue-14 levels, fewer rows than a group
    (13, [33, 70, 3], 37),      # levels of more than 32 classes (2 and 3 chunks), dim not a multiple of 4
    (67, [5, 1], 130),          # three column blocks of 64, dim % 4 == 2, a level of one class
    (300, [12, 32, 12], 30),    # several CTAs of 64 rows, the last one partial
]


@pytest.mark.parametrize("B,sizes,dim", SHAPES)
def test_parity(B, sizes, dim, gpu, spy):
    # float64 outputs and every gradient within 1e-9 of the reference, float32 within float32 tolerance; every
    # call on the default kernels (float64 and float32 alike, with or without candidates named)
    for dtype, tol in ((torch.float64, dict(atol=1e-9, rtol=0)), (torch.float32, dict(atol=1e-5, rtol=1e-4))):
        xs = make_logits(B, sizes, dtype=dtype, device=gpu, seed=B)
        x64 = [x.detach().double().requires_grad_() for x in xs]
        for fused, plain in both_ops(dim, 0.7):
            got, want = fused(xs), plain(x64)
            assert got.dtype == dtype and got.shape == want.shape
            torch.testing.assert_close(got.double(), want, **tol)
            w = torch.randn_like(want)
            for g, r in zip(torch.autograd.grad((got.double() * w).sum(), xs),
                            torch.autograd.grad((want * w).sum(), x64)):
                torch.testing.assert_close(g.double(), r, **tol)
    if gpu.type == "cpu":
        assert set(spy.ops) == DEFAULT_OPS


def assert_within_twice_torch(a, b, c):
    """a (fused) and c (plain torch in the same dtype) against b (float64): RMS error at most 2x torch's, max error
    at most 2x torch's + 1e-6."""
    d1, d2 = a.detach().double() - b.detach(), c.detach().double() - b.detach()
    rms1, rms2 = d1.pow(2).mean().sqrt().item(), d2.pow(2).mean().sqrt().item()
    assert rms1 <= 2 * rms2, (rms1, rms2)
    assert d1.abs().max().item() <= 2 * d2.abs().max().item() + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_twice_torch_error(dtype, gpu):
    # lower precision: error of the output and of every gradient vs float64 at most twice plain torch's own
    # error in that dtype (plain torch: the reference formula evaluated in the dtype). Root-mean-square errors, no
    # slack (the maximum of a few thousand float32 rounding errors is too noisy for a 2x bound on one seed: the
    # CPU kernel's max error on one float32 gradient here is 2.3x torch's, its RMS error 1.7x); the max error
    # with the project's +1e-6 slack as in test_calendar_ops.py
    B, sizes, dim, tau = 203, [12, 32, 12, 45], 36, 0.6
    xs = make_logits(B, sizes, dtype=dtype, device=gpu, seed=3)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    xp = [x.detach().clone().requires_grad_() for x in xs]
    tables = {n: ref.fourier_table(n, dim, dtype=dtype).to(xs[0].device) for n in sizes}
    w = ref.level_weights(sizes)

    def plain_scalar(a):
        return sum(wl * (torch.softmax(x / tau, -1) @ torch.arange(x.shape[1], dtype=dtype, device=x.device))
                   for wl, x in zip(w, a))

    def plain_context(a):
        return torch.cat([torch.softmax(x / tau, -1) @ tables[x.shape[1]] for x in a], -1)

    for fused, exact, plain in ((lambda a: tempokern.calendar_scalar(a, tau), lambda a: ref.calendar_scalar(a, tau),
                                 plain_scalar),
                                (lambda a: tempokern.calendar_context(a, dim, tau),
                                 lambda a: ref.calendar_context(a, dim, tau), plain_context)):
        f, e, p = fused(xs), exact(x64), plain(xp)
        assert_within_twice_torch(f, e, p)
        wt = torch.randn(e.shape, dtype=torch.float64).to(e.device)
        gf = torch.autograd.grad((f.double() * wt).sum(), xs)
        ge = torch.autograd.grad((e * wt).sum(), x64)
        gp = torch.autograd.grad((p.double() * wt).sum(), xp)
        for a, b, c in zip(gf, ge, gp):
            assert a.dtype == dtype
            assert_within_twice_torch(a, b, c)


@pytest.mark.parametrize("sms,per_sm", [(1, 2), (58, None), (108, None), (132, None)])
def test_context_forward_grid_at_sm_counts(sms, per_sm, gpu, monkeypatch):
    # the context forward's grid is min(row groups / 8 warps, _CTAS_PER_SM_GROUPS x SMs) CTAs of 8 warps. One SM
    # and 2 CTAs per SM: 16 warps walk 130 groups of 8 rows (260 of 4 rows in float64), every warp loops; at 58 /
    # 108 / 132 SMs with the real factor, 17 to 65 CTAs, the last partial.
    import tempokern._ops.common as common
    from tempokern._ops import calendar as cal
    patch_sm_count(monkeypatch, lambda device: sms)
    if per_sm is not None:
        monkeypatch.setattr(cal, "_CTAS_PER_SM_GROUPS", per_sm)
    B, sizes, dim = 1037, [1, 12, 33], 40
    for dtype in (torch.float32, torch.float64):
        xs = make_logits(B, sizes, dtype=dtype, device=gpu, seed=sms)
        x64 = [x.detach().double().requires_grad_() for x in xs]
        tol = dict(atol=1e-9, rtol=0) if dtype == torch.float64 else dict(atol=2e-6, rtol=1e-5)
        gtol = dict(atol=1e-9, rtol=0) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-4)
        for fused, plain in both_ops(dim, 0.6):
            got, want = fused(xs), plain(x64)
            torch.testing.assert_close(got.double(), want, **tol)
            w = torch.randn_like(want)
            for g, r in zip(torch.autograd.grad((got.double() * w).sum(), xs), torch.autograd.grad((want * w).sum(), x64)):
                torch.testing.assert_close(g.double(), r, **gtol)
    assert cal._max_ctas(xs[0], "context_fwd", "groups") == max(1, (per_sm or cal._CTAS_PER_SM_GROUPS) * sms)


@pytest.mark.emu
def test_thread_orders(cuda_emu, monkeypatch):
    # three seeded thread orders of the emulator: every result bitwise equal (a missing __syncwarp around the
    # warps' shared tiles, or a missing __syncthreads in the tile kernels, changes results). Multi-chunk levels,
    # odd dim, column blocks, strided (broadcast) upstream gradient, grid-stride (1 SM, 2 CTAs).
    import tempokern._ops.common as common
    from tempokern._ops import calendar as cal
    from conftest import by_thread_order
    patch_sm_count(monkeypatch, lambda device: 1)
    monkeypatch.setattr(cal, "_CTAS_PER_SM_GROUPS", 2)
    monkeypatch.setattr(cal, "_CTAS_PER_SM", 2)
    g = torch.Generator().manual_seed(5)

    def run():
        outs = []
        for dt in (torch.float32, torch.float64, torch.float16):
            xs = [(3 * torch.randn(301, n, generator=g)).to(dt).requires_grad_() for n in (70, 1, 12, 33)]
            u = tempokern.calendar_scalar(xs, 0.7)
            outs += [u, *torch.autograd.grad((u * torch.randn(u.shape, generator=g)).sum(), xs)]
            c = tempokern.calendar_context(xs, 75, 0.7)
            w = torch.randn(c.shape, generator=g).to(dt)
            outs += [c, *torch.autograd.grad((c * w).sum(), xs)]
            c = tempokern.calendar_context(xs, 9, 0.7)
            outs += [c, *torch.autograd.grad(c.sum(), xs)]
        return outs

    def seeded():
        g.manual_seed(5)
        return run()
    outs = by_thread_order(cuda_emu, seeded)   # three thread orders, then two warp-serial orders
    for s, o in enumerate(outs[1:], 1):
        for i, (a, b) in enumerate(zip(outs[0], o)):
            assert torch.equal(a, b), (s, i)


def test_kernel_choice(gpu, monkeypatch):
    # the default kernel per op and direction, the candidate only where it is enabled and takes the call, the CPU
    # kernels off the CUDA path
    from tempokern._ops import calendar as cal
    from conftest import expect_no_kernel
    expect_no_kernel()
    x32 = make_logits(4, [3, 5], dtype=torch.float32, device=gpu)
    x64 = make_logits(4, [3, 5], dtype=torch.float64, device=gpu)
    monkeypatch.delenv("TEMPOKERN_EXPERIMENTAL", raising=False)
    want = {"context_fwd": "groups", "context_bwd": "tiles", "scalar_fwd": "tiles", "scalar_bwd": "tiles"}
    for k, v in want.items():
        assert cal._kernel(k, x32, 64) == v
    with dispatch.use("calendar_v3"):
        for k in want:
            assert cal._kernel(k, x32, 64) == "v3"
            assert cal._kernel(k, x64, 64) == want[k]  # float64: not v3's
    monkeypatch.setenv("TEMPOKERN_EXPERIMENTAL", "calendar_v3")
    assert cal._kernel("context_fwd", x32, 64) == "v3"


def test_cpu_kernels_off_the_cuda_path():
    from tempokern._ops import calendar as cal
    with dispatch.use("calendar_v3"):
        assert cal._kernel("scalar_fwd", [torch.zeros(2, 3)]) == "cpu"


def test_bad_experimental_name_raises(gpu, monkeypatch):
    monkeypatch.setenv("TEMPOKERN_EXPERIMENTAL", "calendar_v9")
    from conftest import expect_no_kernel
    expect_no_kernel()
    with pytest.raises(ValueError, match="TEMPOKERN_EXPERIMENTAL.*calendar_v9"):
        tempokern.calendar_context(make_logits(4, [3], device=gpu), 8)
