"""Fused relative-offset bias vs the plain PyTorch reference: forward, every gradient, the clamp,
dtypes, bad input, the module and the lookup table."""
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from _emu_support import patch_sm_count  # noqa: E402

import tempokern
from tempokern import reference as ref
from tempokern.nn import BiasTable, OffsetBias
from tempokern.nn.offset_bias import DEFAULT_TABLE_POINTS, TABLE_ERROR_BOUND, bias_params

NAMES = ("u_q", "u_d", "w1", "b1", "w2", "b2", "scale")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make(Bq, Bd, D, H, dtype=torch.float64, lo=0.0, hi=1.0, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    xs = [torch.rand(Bq, generator=g, dtype=torch.float64) * (hi - lo) + lo,
          torch.rand(Bd, generator=g, dtype=torch.float64) * (hi - lo) + lo,
          r(H, D), r(H), r(1, H), r(1), torch.tensor(0.7, dtype=torch.float64)]
    return [x.to(dtype=dtype, device=device).requires_grad_() for x in xs]


def run(fn, xs, G):
    out = fn(*xs)
    grads = torch.autograd.grad((out * G).sum(), xs)
    return out, grads


def assert_parity(xs, rtol, atol, G=None):
    Bq, Bd = xs[0].shape[0], xs[1].shape[0]
    if G is None:
        G = torch.randn(Bq, Bd, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(xs[0])
    out, grads = run(tempokern.offset_bias, xs, G)
    rout, rgrads = run(ref.offset_bias, xs, G)
    assert out.shape == (Bq, Bd) and out.dtype == rout.dtype
    torch.testing.assert_close(out, rout, rtol=rtol, atol=atol)
    for name, a, b in zip(NAMES, grads, rgrads):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = max(1.0, float(b.abs().max()))
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale, msg=lambda m: f"grad {name}: {m}")


SIZES = [(1, 1, 32, 32), (5, 7, 32, 32), (37, 53, 32, 32), (64, 17, 7, 5), (19, 41, 1, 3), (23, 40, 33, 17),
         (3, 100, 16, 9), (50, 50, 2, 1)]


@pytest.mark.parametrize("Bq,Bd,D,H", SIZES)
def test_parity_float64(Bq, Bd, D, H):
    assert_parity(make(Bq, Bd, D, H, seed=Bq + Bd), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("Bq,Bd,D,H", SIZES[:5])
def test_parity_float32(Bq, Bd, D, H):
    assert_parity(make(Bq, Bd, D, H, torch.float32, seed=Bq), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lo,hi", [(-3.0, 4.0), (-10.0, 10.0), (0.5, 1.7), (100.0, 100.5)])
def test_u_outside_unit_interval(lo, hi):
    # clamp bites for many pairs; |u| > 4 or |u_d - u_q| > 1 forces the exact per-pair path
    assert_parity(make(29, 45, 32, 32, lo=lo, hi=hi, seed=3), rtol=1e-10, atol=1e-10)


def test_mixed_fast_and_exact_tiles():
    xs = make(40, 70, 16, 8, seed=5)
    with torch.no_grad():
        xs[1][::7] += 2.5   # some documents far away: their blocks take the exact path
        xs[0][::5] -= 6.0   # some queries beyond the fast range
    assert_parity(xs, rtol=1e-10, atol=1e-10)


def test_clamp_boundary_passes_gradient_like_torch():
    xs = make(3, 4, 8, 4)
    with torch.no_grad():
        xs[0].copy_(torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64))
        xs[1].copy_(torch.tensor([1.0, 0.0, -0.5, 1.5], dtype=torch.float64))  # deltas of exactly +-1
    assert_parity(xs, rtol=1e-10, atol=1e-10)
    _, grads = run(tempokern.offset_bias, xs, torch.ones(3, 4, dtype=torch.float64))
    assert grads[1][0].abs() > 0  # delta = +1 exactly still gets a gradient


def test_broadcast_gradient_and_sum():
    xs = make(33, 21, 32, 32, seed=7)
    a = torch.autograd.grad(tempokern.offset_bias(*xs).sum(), xs)
    b = torch.autograd.grad(ref.offset_bias(*xs).sum(), xs)
    for name, x, y in zip(NAMES, a, b):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=lambda m: f"grad {name}: {m}")


def test_noncontiguous_inputs():
    xs = make(20, 30, 8, 6, seed=2)
    w1t = xs[2].detach().t().contiguous().t().requires_grad_()  # column-major w1
    uq = torch.stack([xs[0].detach(), xs[0].detach()], 1)[:, 0].requires_grad_()  # strided u_q
    args = [uq, xs[1], w1t] + xs[3:]
    torch.testing.assert_close(tempokern.offset_bias(*args), ref.offset_bias(*args), rtol=1e-10, atol=1e-10)


def test_empty_batch():
    xs = make(0, 5, 8, 4)
    out = tempokern.offset_bias(*xs)
    assert out.shape == (0, 5)
    grads = torch.autograd.grad(out.sum(), xs, allow_unused=True)
    assert grads[2] is None or float(grads[2].abs().sum()) == 0.0


def test_gradcheck_float64():
    xs = make(4, 6, 6, 5, seed=11)
    assert torch.autograd.gradcheck(tempokern.offset_bias, xs, eps=1e-6, atol=1e-6)
    xs = make(3, 5, 4, 3, lo=-1.5, hi=2.0, seed=12)  # exact path with the clamp
    assert torch.autograd.gradcheck(tempokern.offset_bias, xs, eps=1e-6, atol=1e-6)


def test_opcheck():
    xs = make(9, 13, 8, 4, torch.float32, seed=4)
    torch.library.opcheck(torch.ops.tempokern.offset_bias.default, tuple(xs))
    G = torch.randn(9, 13)
    torch.library.opcheck(torch.ops.tempokern.offset_bias_backward.default, (G, *[x.detach() for x in xs]))
    torch.library.opcheck(torch.ops.tempokern.offset_bias_lookup.default,
                          (xs[0].detach(), xs[1].detach(), torch.randn(17)))


def _max_err(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_twice_plain_torch_error(dtype):
    xs32 = make(48, 40, 32, 32, torch.float32, seed=8)
    lo = [x.detach().to(dtype).requires_grad_() for x in xs32]
    # float32 reference on exactly the low-precision values
    up = [x.detach().float().requires_grad_() for x in lo]
    G = torch.randn(48, 40, generator=torch.Generator().manual_seed(2))
    r_out, r_grads = run(ref.offset_bias, up, G)
    p_out, p_grads = run(ref.offset_bias, lo, G.to(dtype))    # plain PyTorch in the low dtype
    f_out, f_grads = run(tempokern.offset_bias, lo, G.to(dtype))
    assert f_out.dtype == dtype
    assert _max_err(f_out, r_out) <= 2 * _max_err(p_out, r_out) + 1e-3
    for name, f, p, r in zip(NAMES, f_grads, p_grads, r_grads):
        assert f.dtype == dtype, name
        assert _max_err(f, r) <= 2 * _max_err(p, r) + 1e-3 * max(1.0, float(r.abs().max())), name


def test_mixed_dtypes_promote():
    xs = make(6, 9, 8, 4, torch.float32)
    uq = xs[0].detach().double().requires_grad_()
    out = tempokern.offset_bias(uq, *xs[1:])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref.offset_bias(uq, *xs[1:]), rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(out.sum(), [uq, xs[2]])
    assert g[0].dtype == torch.float64 and g[1].dtype == torch.float32


# ---- bad input -----------------------------------------------------------------------------------

def _args(**over):
    xs = [x.detach() for x in make(4, 5, 8, 6)]
    d = dict(zip(NAMES, xs))
    d.update(over)
    return [d[n] for n in NAMES]


@pytest.mark.parametrize("over,exc,match", [
    (dict(u_q=torch.rand(4, 1, dtype=torch.float64)), ValueError, "u_q must be 1-D"),
    (dict(u_d=torch.rand(()).double()), ValueError, "u_d must be 1-D"),
    (dict(u_q=torch.arange(4)), TypeError, "u_q must be float"),
    (dict(w1=torch.rand(6, dtype=torch.float64)), ValueError, "w1 must be 2-D"),
    (dict(w1=torch.rand(0, 8, dtype=torch.float64)), ValueError, "hidden >= 1"),
    (dict(b1=torch.rand(5, dtype=torch.float64)), ValueError, r"b1 must have shape \(hidden,\) = \(6,\)"),
    (dict(w2=torch.rand(1, 5, dtype=torch.float64)), ValueError, r"w2 must have shape \(1, hidden\) = \(1, 6\)"),
    (dict(w2=torch.rand(6, dtype=torch.float64)), ValueError, "w2 must have shape"),
    (dict(b2=torch.rand(2, dtype=torch.float64)), ValueError, r"b2 must have shape \(1,\)"),
    (dict(scale=torch.rand(1, dtype=torch.float64)), ValueError, "scale must be a 0-d"),
    (dict(scale=0.5), TypeError, "scale must be a torch.Tensor"),
    (dict(w1=torch.rand(6, 8, device="meta")), ValueError, "one device"),
])
def test_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        tempokern.offset_bias(*_args(**over))


def test_lookup_bad_input():
    u = torch.rand(3)
    with pytest.raises(ValueError, match="at least 2"):
        tempokern.offset_bias_lookup(u, u, torch.rand(1))
    with pytest.raises(TypeError, match="values must have dtype"):
        tempokern.offset_bias_lookup(u, u, torch.rand(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="u_d must be 1-D"):
        tempokern.offset_bias_lookup(u, u[None], torch.rand(5))


# ---- module and table -----------------------------------------------------------------------------

def test_module_matches_reference_and_checkpoint_names():
    torch.manual_seed(0)
    m = OffsetBias(32, 32)
    assert float(m.scale.detach()) == 0.0 and m.scale.dim() == 0
    assert set(m.state_dict()) == {"mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias", "scale"}
    ckpt = {"time_rel_mlp.0.weight": torch.randn(32, 32), "time_rel_mlp.0.bias": torch.randn(32),
            "time_rel_mlp.2.weight": torch.randn(1, 32), "time_rel_mlp.2.bias": torch.randn(1),
            "time_rel_alpha": torch.tensor(0.3)}
    m.load_state_dict({k.replace("time_rel_mlp", "mlp").replace("time_rel_alpha", "scale"): v
                       for k, v in ckpt.items()})
    uq, ud = torch.rand(10), torch.rand(12)
    want = ref.offset_bias(uq, ud, *[ckpt[k] for k in ("time_rel_mlp.0.weight", "time_rel_mlp.0.bias",
                                                       "time_rel_mlp.2.weight", "time_rel_mlp.2.bias",
                                                       "time_rel_alpha")])
    torch.testing.assert_close(m(uq, ud), want, rtol=1e-5, atol=1e-5)
    m(uq, ud).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_module_bad_args():
    with pytest.raises(ValueError, match="features must be >= 1"):
        OffsetBias(0, 4)
    with pytest.raises(TypeError, match="hidden must be an int"):
        OffsetBias(4, 2.0)
    with pytest.raises(ValueError, match="points must be >= 2"):
        OffsetBias().table(points=1)


def _trained_like(seed, dtype=torch.float64):
    torch.manual_seed(seed)
    m = OffsetBias(32, 32).to(dtype)
    with torch.no_grad():
        m.scale.fill_(1.0)
    return m


def test_table_error_bound_at_default_points():
    d = torch.linspace(-1, 1, 20001)
    uq = torch.zeros(1)
    for seed in range(8):
        m = _trained_like(seed)
        t = m.table()
        assert t.points == DEFAULT_TABLE_POINTS and t.values.dtype == torch.float32
        exact = m(uq.double(), d.double())[0].detach()
        err = float((t(uq, d)[0].double() - exact).abs().max())
        assert err <= TABLE_ERROR_BOUND, (seed, err)
    # and the bound is not vacuous: a coarse table is clearly worse
    coarse = float((m.table(65)(uq, d)[0].double() - exact).abs().max())
    assert coarse > TABLE_ERROR_BOUND


def test_table_lookup_matches_reference_lookup():
    m = _trained_like(3)
    t = m.table(257)
    uq = torch.rand(17) * 3 - 1
    ud = torch.rand(23) * 3 - 1
    torch.testing.assert_close(t(uq, ud), ref.offset_bias_lookup(uq, ud, t.values), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(t(uq.double(), ud.double()), ref.offset_bias_lookup(uq.double(), ud.double(), t.values),
                               rtol=1e-12, atol=1e-12)
    # the table includes scale and b2: at table points it equals the exact bias
    dp = ref.table_points_delta(257)
    exact = m(torch.zeros(1, dtype=torch.float64), dp)[0].detach()
    torch.testing.assert_close(t.values.double(), exact, rtol=1e-6, atol=1e-7)


def test_table_is_frozen():
    t = _trained_like(0).table(9)
    v = t.values
    v.add_(1.0)
    assert not torch.equal(t.values, v)
    with pytest.raises(AttributeError, match="frozen"):
        t.points = 3
    with pytest.raises(ValueError, match="at least 2"):
        BiasTable(torch.zeros(1))


def test_no_quadratic_buffers_cpu():
    """fwd + bwd at 1024 x 1024 (D = hidden = 32) stays near the output + gradient size (8 MiB);
    the reference's intermediates would be > 500 MiB."""
    code = r"""
import torch, tempokern, sys
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'): return int(line.split()[1]) * 1024
B = 1024
xs = [torch.rand(B), torch.rand(B), torch.randn(32, 32), torch.randn(32), torch.randn(1, 32), torch.randn(1),
      torch.tensor(0.5)]
xs = [x.requires_grad_() for x in xs]
G = torch.randn(B, B)
tempokern.offset_bias(*[x[:8] if x.dim() == 1 and x.shape[0] == B else x for x in xs]).sum().backward()
base = hwm()
tempokern.offset_bias(*xs).backward(G)
print((hwm() - base) / 2**20)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(tempokern.__file__)))  # installed or in-tree
    env = dict(os.environ, PYTHONPATH=root)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tempfile.gettempdir())
    assert res.returncode == 0, res.stderr
    extra_mb = float(res.stdout.strip().splitlines()[-1])
    assert extra_mb < 64, extra_mb


# ---- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Bq,Bd,D,H,lo,hi", [(37, 53, 32, 32, 0, 1), (300, 77, 7, 5, -2, 3), (5, 700, 64, 16, 0, 1),
                                              (64, 64, 1, 3, -6, 6), (129, 31, 128, 8, 0, 1),
                                              (33, 45, 64, 96, -1, 2)])  # float64 backward shrinks its block to fit smem
def test_cuda_parity(gpu, dtype, Bq, Bd, D, H, lo, hi):
    xs = make(Bq, Bd, D, H, dtype, lo, hi, device=gpu, seed=Bq)
    if dtype == torch.float64:
        assert_parity(xs, rtol=1e-9, atol=1e-9)
    else:  # gradients are sums over Bq * Bd pairs: judge float32 against float64 truth, like plain torch
        assert_float32_within_twice_torch(xs)


def assert_float32_within_twice_torch(xs):
    """Fused float32 output and gradients no further from a float64 reference than twice plain PyTorch's
    own float32 error, plus sqrt(pairs) float32 ulps of the tensor's scale: the weight and scalar
    gradients are sums over Bq * Bd pairs, whose float32 rounding torch's pairwise sums sometimes dodge."""
    slack = (xs[0].shape[0] * xs[1].shape[0]) ** 0.5 * torch.finfo(torch.float32).eps
    G = torch.randn(xs[0].shape[0], xs[1].shape[0], generator=torch.Generator().manual_seed(1)).to(xs[0].device)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    r_out, r_grads = run(ref.offset_bias, x64, G.double())
    p_out, p_grads = run(ref.offset_bias, xs, G)
    f_out, f_grads = run(tempokern.offset_bias, xs, G)
    for name, f, p, r in zip(("out",) + tuple(NAMES), (f_out,) + f_grads, (p_out,) + p_grads, (r_out,) + r_grads):
        assert _max_err(f, r) <= 2 * _max_err(p, r) + slack * max(1.0, float(r.detach().abs().max())), name


@pytest.mark.parametrize("Bq,Bd,D,H,lo,hi", [(300, 77, 7, 5, -2, 3), (37, 53, 32, 32, 0, 1)])
def test_float32_within_twice_torch_error(Bq, Bd, D, H, lo, hi):
    assert_float32_within_twice_torch(make(Bq, Bd, D, H, torch.float32, lo, hi, seed=Bq))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_low_precision(gpu, dtype):
    xs = make(64, 96, 32, 32, torch.float32, device=gpu, seed=9)
    lo = [x.detach().to(dtype).requires_grad_() for x in xs]
    up = [x.detach().float().requires_grad_() for x in lo]
    G = torch.randn(64, 96, device=gpu)
    r_out, r_grads = run(ref.offset_bias, up, G)
    p_out, p_grads = run(ref.offset_bias, lo, G.to(dtype))
    f_out, f_grads = run(tempokern.offset_bias, lo, G.to(dtype))
    assert _max_err(f_out, r_out) <= 2 * _max_err(p_out, r_out) + 1e-3
    for name, f, p, r in zip(NAMES, f_grads, p_grads, r_grads):
        assert _max_err(f, r) <= 2 * _max_err(p, r) + 1e-3 * max(1.0, float(r.abs().max())), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_table_lookup(gpu, dtype):
    m = _trained_like(1, dtype)
    t = m.table().to(gpu)
    uq, ud = torch.rand(100, device=gpu) * 3 - 1, torch.rand(90, device=gpu) * 3 - 1
    uq, ud = uq.to(dtype), ud.to(dtype)
    torch.testing.assert_close(t(uq, ud), ref.offset_bias_lookup(uq, ud, t.values), rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
@cuda
def test_cuda_devices_and_memory():
    m = _trained_like(1, torch.float32)
    xs = make(4, 5, 8, 6, torch.float32)
    with pytest.raises(ValueError, match="one device"):
        tempokern.offset_bias(xs[0].detach().cuda(), *[x.detach() for x in xs[1:]])
    B = 4096
    mc = m.cuda()
    uq, ud = torch.rand(B, device="cuda", requires_grad=True), torch.rand(B, device="cuda", requires_grad=True)
    G = torch.randn(B, B, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    mc(uq, ud).backward(G)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 3 * B * B * 4, extra  # output + a little; the reference needs B*B*(D + 2*hidden)*4


# ---- hidden-unit classification (CPU: provably always-on units merged, always-off dropped) -------------

def _with_b1(b1_values, D=16, H=6, lo=0.0, hi=1.0, seed=21):
    xs = make(23, 31, D, H, lo=lo, hi=hi, seed=seed)
    with torch.no_grad():
        xs[3].copy_(torch.as_tensor(b1_values, dtype=torch.float64))
    return xs


@pytest.mark.parametrize("b1", [[50.0] * 6, [-50.0] * 6, [50.0, -50.0, 0.0, 50.0, -50.0, 0.1]])
@pytest.mark.parametrize("lo,hi", [(0.0, 1.0), (-2.0, 3.0)])
def test_parity_with_always_on_and_off_units(b1, lo, hi):
    xs = _with_b1(b1, lo=lo, hi=hi)
    assert_parity(xs, rtol=1e-10, atol=1e-10)
    if b1[0] == -50.0 and b1[1] == -50.0:  # all off: only b2 and scale get gradients
        _, grads = run(tempokern.offset_bias, xs, torch.ones(23, 31, dtype=torch.float64))
        assert float(grads[2].abs().max()) == 0.0 and float(grads[0].abs().max()) == 0.0


def test_unit_classification_is_sound():
    from tempokern._ops.offset_bias import _unit_classes
    from tempokern.reference.offset_bias import offset_features
    d = torch.linspace(-1, 1, 50001, dtype=torch.float64)
    seen_on = seen_off = 0
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        w1 = torch.randn(32, 32, generator=g, dtype=torch.float64)
        b1 = torch.randn(32, generator=g, dtype=torch.float64) * 3
        # a few units cross zero right next to the ends of the clamp range
        h = offset_features(torch.tensor([0.9995, -0.9995], dtype=torch.float64), 32) @ w1.t()
        b1[:2] = -h[0, :2]
        b1[2:4] = -h[1, 2:4]
        on, off = _unit_classes(w1, b1)
        hv = offset_features(d, 32) @ w1.t() + b1
        assert bool((hv[:, on] > 0).all()) and bool((hv[:, off] < 0).all())
        assert not bool(on[:4].any() or off[:4].any())
        seen_on += int(on.sum())
        seen_off += int(off.sum())
    assert seen_on > 0 and seen_off > 0


def test_nan_positions_propagate_like_reference():
    xs = make(6, 7, 8, 4)
    with torch.no_grad():
        xs[0][2] = float("nan")
        xs[1][3] = float("nan")
    out = tempokern.offset_bias(*xs)
    want = ref.offset_bias(*xs)
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    torch.testing.assert_close(out[~torch.isnan(want)], want[~torch.isnan(want)], rtol=1e-10, atol=1e-10)
    t = _trained_like(0).table(33)
    look = t(xs[0].detach().float(), xs[1].detach().float())
    assert torch.equal(torch.isnan(look), torch.isnan(want))


# ---- training table mode (table_points=N): exact for the interpolated function ------------------------

def _run_table(fn, xs, G, N):
    out = fn(*xs, N) if fn is ref.offset_bias_tabulated else fn(*xs, table_points=N)
    return out, torch.autograd.grad((out * G).sum(), xs)


def assert_table_parity(xs, N, tol=1e-9, G=None):
    Bq, Bd = xs[0].shape[0], xs[1].shape[0]
    if G is None:
        G = torch.randn(Bq, Bd, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(xs[0])
    out, grads = _run_table(tempokern.offset_bias, xs, G, N)
    rout, rgrads = _run_table(ref.offset_bias_tabulated, xs, G, N)
    assert out.shape == (Bq, Bd) and out.dtype == rout.dtype
    torch.testing.assert_close(out, rout, rtol=tol, atol=tol)
    for name, a, b in zip(NAMES, grads, rgrads):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())),
                                   msg=lambda m: f"grad {name}: {m}")


def assert_table_float32_within_twice_torch(xs, N):
    """float32 table mode vs the float64 tabulated bias, against plain torch's float32 error on the same inputs."""
    Bq, Bd = xs[0].shape[0], xs[1].shape[0]
    G = torch.randn(Bq, Bd, generator=torch.Generator().manual_seed(5)).to(xs[0].device)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    r_out, r_grads = _run_table(ref.offset_bias_tabulated, x64, G.double(), N)
    p_out, p_grads = _run_table(ref.offset_bias_tabulated, xs, G, N)
    f_out, f_grads = _run_table(tempokern.offset_bias, xs, G, N)
    assert f_out.dtype == torch.float32
    for name, f, p, r in zip(("out",) + NAMES, (f_out,) + f_grads, (p_out,) + p_grads, (r_out,) + r_grads):
        tiny = 4 * torch.finfo(torch.float32).eps * max(1.0, float(r.detach().abs().max()))
        assert _max_err(f, r) <= 2 * _max_err(p, r) + tiny, (name, _max_err(f, r), _max_err(p, r))


TABLE_CASES = [(1, 1, 32, 32, 0.0, 1.0, 2), (37, 53, 32, 16, -0.7, 1.3, 17), (64, 300, 8, 5, 0.0, 1.0, 4097),
               (129, 77, 7, 3, -2.0, 3.0, 65537), (70, 260, 32, 32, 0.0, 1.0, 16385)]


@pytest.mark.parametrize("Bq,Bd,D,H,lo,hi,N", TABLE_CASES)
def test_table_mode_float64_matches_tabulated_autograd(Bq, Bd, D, H, lo, hi, N):
    assert_table_parity(make(Bq, Bd, D, H, lo=lo, hi=hi, seed=Bq + N), N)


@pytest.mark.parametrize("Bq,Bd,D,H,lo,hi,N", TABLE_CASES[1:4])
def test_table_mode_float32_within_twice_torch(Bq, Bd, D, H, lo, hi, N):
    assert_table_float32_within_twice_torch(make(Bq, Bd, D, H, torch.float32, lo=lo, hi=hi, seed=N), N)


def test_table_mode_float32_long_sums():
    # d u_q sums over 3000 columns, d u_d over 3000 rows, d values over 24k pairs
    assert_table_float32_within_twice_torch(make(8, 3000, 32, 32, torch.float32, seed=1), 4097)
    assert_table_float32_within_twice_torch(make(3000, 8, 32, 32, torch.float32, seed=2), 4097)


def test_table_mode_clamp_boundary_and_gradcheck():
    xs = make(3, 4, 8, 4)
    with torch.no_grad():
        xs[0].copy_(torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64))
        xs[1].copy_(torch.tensor([1.0, 0.0, -0.5, 1.5], dtype=torch.float64))  # deltas of exactly +-1 and beyond
    assert_table_parity(xs, 9)
    # away from the bin edges the interpolant is smooth in u and linear in the values
    xs = make(4, 5, 6, 5, lo=0.1, hi=0.9, seed=13)
    f = lambda *a: tempokern.offset_bias(*a, table_points=5)  # noqa: E731
    assert torch.autograd.gradcheck(f, xs, eps=1e-7, atol=1e-6)


def test_table_mode_matches_exact_bias_on_grid_points():
    # at delta on the grid the interpolant equals the exact MLP
    xs = make(1, 33, 16, 8, seed=4)
    with torch.no_grad():
        xs[0].zero_()
        xs[1].copy_(ref.table_points_delta(33))
    torch.testing.assert_close(tempokern.offset_bias(*xs, table_points=33), ref.offset_bias(*xs),
                               rtol=1e-12, atol=1e-12)


def test_table_mode_bad_points():
    xs = [x.detach() for x in make(4, 5, 8, 6)]
    with pytest.raises(ValueError, match="table_points must be >= 2"):
        tempokern.offset_bias(*xs, table_points=1)
    with pytest.raises(TypeError, match="table_points must be an int"):
        tempokern.offset_bias(*xs, table_points=4.0)
    with pytest.raises(TypeError, match="table_points must be an int"):
        tempokern.offset_bias(*xs, table_points=True)
    with pytest.raises(ValueError, match="b1 must have shape"):
        tempokern.offset_bias(*_args(b1=torch.rand(5, dtype=torch.float64)), table_points=9)


def test_table_mode_opcheck_and_empty():
    uq, ud = torch.rand(9), torch.rand(13)
    v = torch.randn(17, dtype=torch.float64)
    torch.library.opcheck(torch.ops.tempokern.offset_bias_interp.default, (uq, ud, v))
    torch.library.opcheck(torch.ops.tempokern.offset_bias_interp_backward.default, (torch.randn(9, 13), uq, ud, v))
    xs = make(0, 5, 8, 4)
    out = tempokern.offset_bias(*xs, table_points=9)
    assert out.shape == (0, 5)
    grads = torch.autograd.grad(out.sum(), xs, allow_unused=True)
    assert grads[2] is None or float(grads[2].abs().sum()) == 0.0


def test_module_table_points():
    m = _trained_like(2)
    assert m.table_points is None
    uq, ud = torch.rand(11, dtype=torch.float64), torch.rand(13, dtype=torch.float64)
    m.table_points = 257
    out = m(uq, ud)
    torch.testing.assert_close(out, ref.offset_bias_tabulated(uq, ud, *bias_params(m), 257), rtol=1e-12, atol=1e-12)
    out.sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in m.parameters())
    assert OffsetBias(8, 4, table_points=65).table_points == 65
    with pytest.raises(ValueError, match="table_points must be >= 2"):
        OffsetBias(8, 4, table_points=1)


_TCASES = [(70, 300, 0.0, 1.0, 4097), (130, 530, -2.0, 3.0, 65537), (65, 257, 0.45, 0.55, 16385), (3, 5, 0.0, 1.0, 2)]
_F32, _F64 = torch.float32, torch.float64


@pytest.mark.parametrize("sms,dtype,Bq,Bd,lo,hi,N", [
    (132, _F32, *_TCASES[0]), (108, _F64, *_TCASES[0]), (58, _F32, *_TCASES[1]), (132, _F64, *_TCASES[1]),
    (108, _F32, *_TCASES[2]), (58, _F64, *_TCASES[2]), (132, _F32, *_TCASES[3]), (58, _F64, *_TCASES[3])])
def test_cuda_table_mode(gpu, monkeypatch, sms, dtype, Bq, Bd, lo, hi, N):
    import tempokern._ops.offset_bias as ob
    patch_sm_count(monkeypatch, lambda device: sms)
    xs = make(Bq, Bd, 16, 8, dtype, lo, hi, device=gpu, seed=Bq + sms)
    if dtype == torch.float64:
        assert_table_parity(xs, N)
    else:
        assert_table_float32_within_twice_torch(xs, N)


def test_cuda_table_mode_long_sums_and_partials(gpu, monkeypatch):
    import tempokern._ops.offset_bias as ob
    patch_sm_count(monkeypatch, lambda device: 2)  # 4 CTAs: each walks many tiles into its own slot
    assert ob._table_parts(gpu, 3000, 8)[2] == 4
    assert_table_float32_within_twice_torch(make(8, 3000, 32, 32, torch.float32, device=gpu, seed=1), 4097)
    assert_table_float32_within_twice_torch(make(3000, 8, 32, 32, torch.float32, device=gpu, seed=2), 65537)
    # float64 against the CPU kernel (an independent implementation of the same spec)
    xs = make(200, 300, 8, 4, device=gpu, seed=3)
    G = torch.randn(200, 300, dtype=torch.float64).to(gpu)
    out, grads = _run_table(tempokern.offset_bias, xs, G, 1025)
    from conftest import cpu_kernels
    xs_cpu = tuple(t.detach().cpu().requires_grad_(t.requires_grad) for t in xs)  # (a real GPU: copies on the CPU)
    with cpu_kernels():
        cout, cgrads = _run_table(tempokern.offset_bias, xs_cpu, G.cpu(), 1025)
    out, grads = out.cpu(), [g.cpu() for g in grads]
    torch.testing.assert_close(out, cout, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, cgrads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# ---- float32 accuracy of the reduced gradients: long sums, tight bound ------------------------------------

def assert_reduced_grads_within_twice_torch(xs):
    """d u_q / d u_d / w1 / b1 / w2 / b2 no further from float64 than twice plain torch float32, plus only
    4 float32 ulps of the tensor's scale (no sqrt(pairs) slack). The output and d scale = sum G y inherit
    every pair's forward rounding (a random walk whose size varies between implementations of equal per-pair
    accuracy), so those two keep the sqrt(pairs) slack of assert_float32_within_twice_torch."""
    Bq, Bd = xs[0].shape[0], xs[1].shape[0]
    G = torch.randn(Bq, Bd, generator=torch.Generator().manual_seed(1)).to(xs[0].device)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    r_out, r_grads = run(ref.offset_bias, x64, G.double())
    p_out, p_grads = run(ref.offset_bias, xs, G)
    f_out, f_grads = run(tempokern.offset_bias, xs, G)
    slack = (Bq * Bd) ** 0.5 * torch.finfo(torch.float32).eps
    for name, f, p, r in zip(("out",) + NAMES, (f_out,) + f_grads, (p_out,) + p_grads, (r_out,) + r_grads):
        s = max(1.0, float(r.detach().abs().max()))
        extra = (slack if name in ("out", "scale") else 4 * torch.finfo(torch.float32).eps) * s
        assert _max_err(f, r) <= 2 * _max_err(p, r) + extra, (name, _max_err(f, r) / s, _max_err(p, r) / s)


@pytest.mark.parametrize("Bq,Bd", [(8, 3000), (3000, 8)])
def test_float32_reduced_gradients_long_sums(Bq, Bd):
    assert_reduced_grads_within_twice_torch(make(Bq, Bd, 32, 32, torch.float32, seed=Bq))


@pytest.mark.parametrize("Bq,Bd", [(8, 3000), (3000, 8)])
def test_cuda_float32_reduced_gradients_long_sums(gpu, monkeypatch, Bq, Bd):
    import tempokern._ops.offset_bias as ob
    patch_sm_count(monkeypatch, lambda device: 58)
    assert_reduced_grads_within_twice_torch(make(Bq, Bd, 32, 32, torch.float32, device=gpu, seed=Bq))


@pytest.mark.parametrize("sms", [132, 108, 58, 1])
def test_cuda_grid_sizes(gpu, monkeypatch, sms):
    """The exact kernels at the grids of an H100, A100, L4 (and one SM: a few blocks walking many rows)."""
    import tempokern._ops.offset_bias as ob
    patch_sm_count(monkeypatch, lambda device: sms)
    nparts = ob._num_parts(gpu, 300, 77)
    gx = 3
    assert nparts % gx == 0 and nparts // gx == max(1, min(-(-300 // 8), -(-8 * sms // gx)))
    assert_parity(make(300, 77, 7, 5, lo=-2, hi=3, device=gpu, seed=sms), rtol=1e-9, atol=1e-9)


# ---- formulas pinned by hand: independent of tempokern.reference -------------------------------------

def test_frequencies_and_phi_pinned_by_hand():
    import math
    # D = 8: K = 4, t = 0, 1/3, 2/3, 1, f = 10000^-t
    want_f = [1.0, 10000 ** (-1 / 3), 10000 ** (-2 / 3), 1e-4]
    assert want_f[1] == pytest.approx(0.046415888336127774, rel=1e-15)
    torch.testing.assert_close(ref.bias_frequencies(8, torch.float64),
                               torch.tensor(want_f, dtype=torch.float64), rtol=1e-14, atol=0)
    torch.testing.assert_close(ref.bias_frequencies(2, torch.float64), torch.tensor([1.0], dtype=torch.float64))
    delta = 0.5
    want_phi = [math.sin(delta * f) for f in want_f] + [math.cos(delta * f) for f in want_f]
    assert want_phi[0] == pytest.approx(0.479425538604203) and want_phi[4] == pytest.approx(0.8775825618903728)
    torch.testing.assert_close(ref.offset_features(torch.tensor(delta, dtype=torch.float64), 8),
                               torch.tensor(want_phi, dtype=torch.float64), rtol=1e-14, atol=1e-15)
    # the fused op with one hidden unit picking feature m: out = scale * (relu(phi_m(delta)) + b2)
    for m, want in ((0, want_phi[0]), (1, want_phi[1]), (5, want_phi[5]), (7, want_phi[7])):
        w1 = torch.zeros(1, 8, dtype=torch.float64)
        w1[0, m] = 1.0
        out = tempokern.offset_bias(torch.tensor([0.25], dtype=torch.float64), torch.tensor([0.75], dtype=torch.float64),
                                    w1, torch.zeros(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64),
                                    torch.tensor([0.125], dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64))
        assert float(out) == pytest.approx(2.0 * (want + 0.125), rel=1e-13), m
    # D = 5 (odd): K = 2, f = [1, 1e-4], phi = [sin d, sin 1e-4 d, cos d, cos 1e-4 d, 0]; the clamp: delta 3 -> 1
    want5 = [math.sin(1.0), math.sin(1e-4), math.cos(1.0), math.cos(1e-4), 0.0]
    torch.testing.assert_close(ref.offset_features(torch.tensor(3.0, dtype=torch.float64).clamp(-1, 1), 5),
                               torch.tensor(want5, dtype=torch.float64), rtol=1e-14, atol=1e-15)
    w1 = torch.tensor([[0.0, 0.0, 0.0, 1.0, 7.0]], dtype=torch.float64)  # cos(1e-4 * delta); the pad weight is inert
    out = tempokern.offset_bias(torch.tensor([0.0], dtype=torch.float64), torch.tensor([3.0], dtype=torch.float64), w1,
                                torch.zeros(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64),
                                torch.zeros(1, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    assert float(out) == pytest.approx(math.cos(1e-4), rel=1e-14)


def test_module_caches_are_bounded():
    import tempokern._ops.offset_bias as ob
    import importlib
    rob = importlib.import_module("tempokern.reference.offset_bias")  # the module (the package exports a function)
    for D in range(1, 3 * rob.CACHE_MAX):
        ob._frequencies(D, torch.float32, torch.device("cpu"))
        ob._grid(D)
        rob.table_features(D + 2, D)
    assert len(rob._FREQ_CACHE) <= rob.CACHE_MAX and len(ob._grids) <= rob.CACHE_MAX
    assert len(rob._TABLE_PHI) <= rob.CACHE_MAX
    assert (3 * rob.CACHE_MAX - 1, torch.device("cpu")) in ob._grids  # the newest stays
