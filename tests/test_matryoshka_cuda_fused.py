"""The fused CUDA path of tempokern.matryoshka_infonce (csrc/matryoshka_infonce/matryoshka_block_cuda.cu, one
launch per level around torch's segment products: the default for calls with a bias or B != B'; the tests send
square bias-free calls here too, which the levels path takes by default) on the CUDA
emulator, against tempokern.reference.matryoshka_infonce: float64 parity of the loss, the levels and every
gradient (q, d, extra_neg, the seven bias inputs) with several row blocks and partial column tiles, the grid at
132 / 108 / 58 SMs, three thread orders, the 2x-torch rule in float32 / bfloat16 / float16, one level equal to
multipos_infonce on the same path, zero weights, symmetric, bias table and exact, and agreement with the blocked
torch path (the CPU bias path, which launches none of these kernels)."""
import pytest
import torch
from _emu_support import patch_kernels, patch_sm_count, real_kernels, real_sm_count  # noqa: F401
import torch.nn.functional as F

import tempokern
import tempokern._ops.matryoshka_blocked as mb
from tempokern._ops import dispatch
import tempokern._ops.multipos_blocked as mpb
from _emu_support import force_blocked
from tempokern.reference import matryoshka_infonce as ref

from test_matryoshka_infonce import assert_parity, make, make_bias, run_both, run_both_bias


@pytest.fixture
def launches(monkeypatch):
    """The fused kernel launches of the test: (op, first row of the block, level, positive block, dtype of the
    rounded gradient coefficients Ho or None, levels of a "bwd_all" launch or 0). Sends every call to the fused
    kernels (the default sends bias-free square calls through the levels path's multipos_infonce)."""
    monkeypatch.setattr(dispatch, "DEFAULTS", tuple(p for p in dispatch.DEFAULTS  # no levels path: the fused one
                                                    if not (p.op == dispatch.MATRYOSHKA and p.name == "levels")))
    calls = []
    real = mb._Fused.launch

    def spy(self, op, G, i0, l, **k):
        calls.append((op, i0, l, k["pos"], None if k.get("Ho") is None else k["Ho"].dtype, k.get("levels", 0)))
        return real(self, op, G, i0, l, **k)

    monkeypatch.setattr(mb._Fused, "launch", spy)
    return calls


def on_device(gpu, q, d, neg, sp, bias=None):
    mv = lambda t: None if t is None else t.to(gpu)  # noqa: E731
    sp = {k: tuple(t.to(gpu) for t in v) for k, v in sp.items()}
    return mv(q), mv(d), mv(neg), sp, None if bias is None else tuple(t.to(gpu) for t in bias)


def test_plain_cpu_never_takes_the_fused_kernels():
    # plain CPU tensors never take the fused kernels (CPU bias= keeps the torch blocked path)
    assert not mb.use_fused(torch.zeros(3, 2), 3)


LW = torch.tensor([0.3, -0.2, 0.0, 1.5])  # upstream gradient of the returned levels (return_levels)
CASES = [  # (B, Bd, N, spans, symmetric, block rows): 0 = one block
    (70, 70, 0, None, False, 0), (70, 70, 13, "random", True, 32), (24, 1100, 9, None, False, 16),
    (16, 1030, 0, "random", False, 0), (5, 9, 3, "random", False, 2), (70, 70, 0, "random", True, 0),
]


@pytest.mark.parametrize("B,Bd,N,spans,symmetric,rows", CASES)
def test_fused_matches_reference_float64(gpu, launches, B, Bd, N, spans, symmetric, rows):
    # Bd = 1,100: two column tiles, the second partial (76 columns); rows = 2 / 16 / 32: several row blocks
    # (the last partial) merged across blocks; dims (33, 8, 50, 20) do not divide H = 50 nor each other, and a
    # zero level weight (its prefix still feeds the larger levels)
    q, d, neg, sp, _ = on_device(gpu, *make(B, 50, Bd=Bd, N=N, spans=spans, seed=B + Bd + N))
    with force_blocked(rows) if rows else torch.enable_grad():
        res = run_both(q, d, neg, sp, (33, 8, 50, 20), weights=(2.0, 1.0, 0.0, 0.5), temperature=0.07,
                       symmetric=symmetric, level_w=LW)
    assert_parity(*res, 1e-9)
    if gpu.type == "cpu":  # the emulator: every level forward, d blocks and extra-negative blocks
        blocks = -(-B // rows) if rows else 1
        assert sum(1 for c in launches if c[0] == "fwd") == 4 * blocks * (2 if N else 1)
        # backward: one bwd_all launch (every level up to the top weighted one) per block and candidate set and
        # backward pass; symmetric=False computes the loss's gradient in the forward (weights, top level 3 of
        # 4: level 50 has weight 0) and the backward adds the levels' (LW: top level 4)
        bwd = [c for c in launches if c[0] == "bwd_all"]
        assert not any(c[0] == "bwd" for c in launches)
        passes = [4] if symmetric else [3, 4]
        assert sorted(c[5] for c in bwd) == sorted(passes * blocks * (2 if N else 1))
        assert {c[2] for c in launches if c[0] == "fwd"} == {0, 1, 2, 3}


def test_fused_more_rows_than_one_column_tile(gpu, launches):
    # symmetric with B = Bd = 1,030: column statistics merged over two column tiles and 33 row blocks of 32
    q, d, neg, sp, _ = on_device(gpu, *make(1030, 12, N=0, spans="random", seed=3))
    with force_blocked(512):
        res = run_both(q, d, neg, sp, (5, 12), temperature=0.1, symmetric=True, level_w=torch.tensor([0.5, 0.0]))
    assert_parity(*res, 1e-9)
    assert launches


@pytest.mark.parametrize("sms", [132, 108, 58])
def test_fused_at_other_sm_counts(gpu, launches, monkeypatch, sms):
    patch_sm_count(monkeypatch, lambda device: sms)
    q, d, neg, sp, _ = on_device(gpu, *make(100, 8, N=5, spans="random", seed=sms))
    res = run_both(q, d, neg, sp, (3, 5, 8), temperature=0.05, symmetric=True, level_w=torch.tensor([1.0, 0.0, -1.0]))
    assert_parity(*res, 1e-9)
    if gpu.type == "cpu":
        TR, nct, nrt = mpb.tiling(100, 100, gpu)
        assert nrt == -(-100 // TR) and TR % 32 == 0 and nct * nrt >= min(4 * sms, -(-100 // 32))


def _fused_outputs(bias_mode):
    q, d, neg, sp = make(130, 20, N=6, spans="random", seed=21)
    bias = make_bias(130, 130, seed=22) if bias_mode else None
    ins = [x.clone().requires_grad_() for x in (q, d, neg)] + ([t.clone().requires_grad_() for t in bias]
                                                               if bias else [])
    extra = dict(bias=tuple(ins[3:])) if bias else {}
    if bias_mode == "table":
        extra["bias_table_points"] = 65
    with force_blocked(48):
        loss, levels = tempokern.matryoshka_infonce(ins[0], ins[1], (7, 20), extra_neg=ins[2], return_levels=True,
                                                    temperature=0.1, symmetric=True, **sp, **extra)
        grads = torch.autograd.grad(loss + levels[0], ins)
    return [loss.detach(), levels.detach(), *grads]


@pytest.mark.parametrize("bias_mode", [None, "exact"])
def test_fused_does_not_depend_on_thread_order(cuda_emu, monkeypatch, bias_mode):
    # every thread reaches each barrier in a seeded random order: a missing __syncthreads around the shared
    # row partials would change the result
    from _emu_support import cuda_emulator
    outs = []
    with cuda_emulator(cuda_emu):
        try:
            for s in (1, 2, 3):
                cuda_emu.emu_set_seed(s)
                outs.append(_fused_outputs(bias_mode))
        finally:
            cuda_emu.emu_set_seed(0)
    for o in outs[1:]:
        for a, b in zip(outs[0], o):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


def _errs(res, exact):
    (l, v, g) = res
    (le, ve, ge) = exact
    return [(x.double().cpu() - y.cpu()).abs().max().item() for x, y in zip([l, v, *g], [le, ve, *ge])]


TWO_X = [(dt, None) for dt in (torch.float32, torch.bfloat16, torch.float16)] + [(torch.bfloat16, "table"),
                                                                                (torch.float32, "exact")]


@pytest.mark.parametrize("dtype,bias_mode", TWO_X)
def test_two_x_torch_rule(gpu, launches, dtype, bias_mode):
    # loss, levels and every gradient (q, d, extra_neg, bias inputs): the fused path's error against the float64
    # reference at most twice the reference's own error computed in that dtype (plus a floor of a few ulps of
    # the dtype for outputs torch happens to get exact; the bias parameters' gradients are sums of B^2 terms
    # that cancel: sqrt(pairs) ulps, as tests/test_multipos_blocked.py)
    B = 64
    q, d, neg, sp = make(B, 32, N=9, spans="random", seed=31)
    bias = make_bias(B, B, seed=32, u_lo=0.0, u_hi=1.0) if bias_mode else None
    pts = 257 if bias_mode == "table" else None
    dims = (8, 20, 32)
    kw = dict(temperature=0.1, symmetric=True, level_w=torch.tensor([0.5, 0.0, 1.0]))

    def run(qq, dd, nn, bb, fused):
        qq, dd, nn, spp, bb = on_device(gpu, qq, dd, nn, sp, bb) if fused else (qq, dd, nn, sp, bb)
        with force_blocked(40) if fused else torch.enable_grad():
            if bb is None:
                r = run_both(qq, dd, nn, spp, dims, **kw)
            else:
                r = run_both_bias(qq, dd, nn, spp, dims, bb, table_points=pts, **kw)
        return r[0] if fused else r[1]

    exact = run(q, d, neg, bias, False)
    low = lambda t: t.to(dtype)  # noqa: E731
    lb = None if bias is None else tuple(low(t) for t in bias)
    launches.clear()
    fused = run(low(q), low(d), low(neg), lb, True)
    hos = {c[4] for c in launches if c[0].startswith("bwd")}
    plain = run(low(q), low(d), low(neg), lb, False)
    ef, et = _errs(fused, exact), _errs(plain, exact)
    eps = torch.finfo(dtype).eps
    for k, (a, b) in enumerate(zip(ef, et)):
        floor = B * eps if bias_mode and k >= 7 else 4 * eps
        assert a <= 2 * b + floor, f"output {k}: fused {a:.2e} vs torch {b:.2e} ({dtype}, {bias_mode})"
    if gpu.type == "cpu":
        # bfloat16 inputs: bf16 products (exact in float32) and coefficients rounded once to bf16 (Ho); float16
        # and float32 inputs (not bf16 values): float32 throughout
        assert hos == ({torch.bfloat16} if dtype == torch.bfloat16 else {None})


@pytest.mark.parametrize("symmetric", [False, True])
def test_single_level_equals_multipos_infonce_on_the_same_path(gpu, launches, symmetric):
    # one level (dims = (H,)) is multipos_infonce of the normalised embeddings, both on the CUDA path
    q, d, _, sp, _ = on_device(gpu, *make(70, 32, spans="random", seed=41))
    qa, da = q.clone().requires_grad_(), d.clone().requires_grad_()
    la = tempokern.matryoshka_infonce(qa, da, [32], temperature=0.1, symmetric=symmetric, **sp)
    ga = torch.autograd.grad(la, (qa, da))
    qb, db = q.clone().requires_grad_(), d.clone().requires_grad_()
    lb = tempokern.multipos_infonce(F.normalize(qb, dim=-1), F.normalize(db, dim=-1), sp["q_span"], sp["d_span"],
                                    temperature=0.1, symmetric=symmetric)
    gb = torch.autograd.grad(lb, (qb, db))
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-12)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    if gpu.type == "cpu":
        assert [c[0] for c in launches] == ["fwd", "bwd_all"]


def test_zero_weights(gpu, launches):
    # a zero-weight level adds nothing (and launches no backward pass of its own); the top level's weight 0:
    # the suffix sums start at the highest weighted level; all weights zero: loss 0 and zero gradients
    q, d, neg, sp, _ = on_device(gpu, *make(30, 24, N=4, spans="random", seed=51))
    res = run_both(q, d, neg, sp, (6, 12, 24), weights=(1.0, 0.0, 0.0), temperature=0.1, symmetric=True)
    assert_parity(*res, 1e-10)
    if gpu.type == "cpu":  # level 0 only: d block and negatives, one level each
        assert [c[5] for c in launches if c[0].startswith("bwd")] == [1, 1]
    qq = q.clone().requires_grad_()
    loss = tempokern.matryoshka_infonce(qq, d, (6, 24), weights=(0, 0), temperature=0.1, **sp)
    assert float(loss.detach()) == 0.0
    assert torch.all(torch.autograd.grad(loss, qq)[0] == 0)


@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("B,Bd,N,spans,symmetric,rows", [(70, 70, 13, "random", True, 16), (12, 1100, 0, None,
                                                                                             False, 0)])
def test_fused_bias_matches_reference_float64(gpu, launches, table, B, Bd, N, spans, symmetric, rows):
    # the bias (exact MLP or its table), the same on every level: loss, levels and the gradients of q, d,
    # extra_neg and all seven bias inputs (the per-pair bias gradient summed over the levels by the kernel)
    q, d, neg, sp, bias = on_device(gpu, *make(B, 50, Bd=Bd, N=N, spans=spans, seed=B + 7),
                                    make_bias(B, Bd, seed=B + 8))
    with force_blocked(rows) if rows else torch.enable_grad():
        res = run_both_bias(q, d, neg, sp, (33, 8, 50, 20), bias, weights=(2.0, 1.0, 0.0, 0.5), temperature=0.07,
                            symmetric=symmetric, level_w=LW, table_points=97 if table else None)
    assert_parity(*res, 1e-9)
    assert len(res[0][2]) == 2 + (N > 0) + 7
    if gpu.type == "cpu":
        assert any(c[0].startswith("bwd") for c in launches)


def test_agrees_with_the_blocked_torch_path(gpu, launches):
    # the blocked torch path (plain CPU, which launches none of the fused kernels): same results
    from _emu_support import cuda_emulator
    q, d, neg, sp, bias = on_device(gpu, *make(50, 20, N=5, spans="random", seed=61), make_bias(50, 50, seed=62))
    fused = run_both_bias(q, d, neg, sp, (5, 20), bias, temperature=0.1, symmetric=True)[0]
    n = len(launches)
    assert n > 0 or gpu.type != "cpu"
    cpu = on_device("cpu", q, d, neg, sp, bias)
    with cuda_emulator(None), force_blocked(16):
        plain = run_both_bias(*cpu[:4], (5, 20), cpu[4], temperature=0.1, symmetric=True)[0]
    assert len(launches) == n
    dev = fused[0].device
    plain = (plain[0].to(dev), plain[1].to(dev), [g.to(dev) for g in plain[2]])
    assert_parity(fused, plain, 1e-10)


def test_forward_only_and_no_grad(gpu, launches):
    q, d, neg, sp, _ = on_device(gpu, *make(40, 16, N=3, spans="random", seed=71))
    with torch.no_grad():
        loss, levels = tempokern.matryoshka_infonce(q, d, (4, 16), extra_neg=neg, temperature=0.1, symmetric=True,
                                                    return_levels=True, **sp)
    want, wl = ref(q, d, (4, 16), extra_neg=neg, temperature=0.1, symmetric=True, return_levels=True, **sp)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(levels, wl, rtol=1e-10, atol=1e-10)
    if gpu.type == "cpu":
        assert launches and all(c[0] == "fwd" for c in launches)


@pytest.mark.parametrize("symmetric", [False, True])
def test_gradient_in_forward_without_a_column_term(gpu, launches, symmetric):
    # symmetric=False: the forward keeps each block's snapshots and runs its backward launches (gradient for a
    # unit upstream gradient, scaled in backward): the backward recomputes nothing unless the levels get a
    # gradient; symmetric=True (a column term): the forward runs no backward launch
    q, d, neg, sp, _ = on_device(gpu, *make(50, 24, N=4, spans="random", seed=81))
    ins = [t.clone().requires_grad_() for t in (q, d, neg)]
    with force_blocked(16):
        loss = tempokern.matryoshka_infonce(ins[0], ins[1], (6, 24), weights=(1.0, 2.0), extra_neg=ins[2],
                                            temperature=0.1, symmetric=symmetric, **sp)
        n_fwd = len(launches)
        in_fwd = sum(1 for c in launches if c[0].startswith("bwd"))
        grads = torch.autograd.grad(3.0 * loss, ins)
    refs = [t.clone().requires_grad_() for t in (q, d, neg)]
    want = ref(refs[0], refs[1], (6, 24), weights=(1.0, 2.0), extra_neg=refs[2], temperature=0.1,
               symmetric=symmetric, **sp)
    wg = torch.autograd.grad(3.0 * want, refs)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)
    for x, y in zip(grads, wg):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-10)
    if gpu.type == "cpu":
        if symmetric:
            assert in_fwd == 0 and len(launches) > n_fwd
        else:
            assert in_fwd == 2 * 4 and len(launches) == n_fwd  # (d, negatives) x 4 blocks, both levels each


@pytest.mark.parametrize("temperature", [0.01, 1.0])
def test_extreme_logits_and_zero_prefix_rows(gpu, launches, temperature):
    # embeddings x 1e4 (the norms cancel) at temperature 0.01 (logits up to +-100: the online log-sum-exps must
    # rescale) and 1.0; a row and a column whose first 5 coordinates are 0 (inverse norm clamped at 1e12, logit 0)
    q, d, neg, sp = make(40, 24, N=6, spans="random", scale=1e4, seed=91)
    q[3, :5] = 0
    d[7, :5] = 0
    q, d, neg, sp, _ = on_device(gpu, q, d, neg, sp)
    res = run_both(q, d, neg, sp, (5, 24), temperature=temperature, symmetric=True, level_w=torch.tensor([1.0, -0.5]))
    assert torch.isfinite(res[0][0]) and all(torch.isfinite(g).all() for g in res[0][2])
    assert_parity(*res, 1e-9)


@pytest.fixture
def per_level(monkeypatch):
    """The one-launch-per-level backward ("bwd", used when the levels exceed bwd_all's shared memory)."""
    monkeypatch.setattr(mb, "ALL_LEVELS_MAX", 0)


@pytest.mark.parametrize("bias_mode", [None, "exact"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_per_level_backward_matches_reference_float64(gpu, launches, per_level, bias_mode, symmetric):
    q, d, neg, sp = make(70, 50, N=13, spans="random", seed=101)
    bias = make_bias(70, 70, seed=102) if bias_mode else None
    q, d, neg, sp, bias = on_device(gpu, q, d, neg, sp, bias)
    kw = dict(weights=(2.0, 1.0, 0.0, 0.5), temperature=0.07, symmetric=symmetric, level_w=LW)
    with force_blocked(32):
        if bias is None:
            res = run_both(q, d, neg, sp, (33, 8, 50, 20), **kw)
        else:
            res = run_both_bias(q, d, neg, sp, (33, 8, 50, 20), bias, **kw)
    assert_parity(*res, 1e-9)
    if gpu.type == "cpu":
        assert any(c[0] == "bwd" for c in launches) and not any(c[0] == "bwd_all" for c in launches)


def test_per_level_backward_bf16_two_x(gpu, launches, per_level):
    q, d, neg, sp = make(64, 32, N=9, spans="random", seed=111)
    dims, kw = (8, 20, 32), dict(temperature=0.1, symmetric=True, level_w=torch.tensor([0.5, 0.0, 1.0]))
    exact = run_both(q, d, neg, sp, dims, **kw)[1]
    low = [t.to(torch.bfloat16) for t in (q, d, neg)]
    plain = run_both(*low, sp, dims, **kw)[1]
    lq, ld, ln, lsp, _ = on_device(gpu, *low, sp)
    launches.clear()
    fused = run_both(lq, ld, ln, lsp, dims, **kw)[0]
    hos = {c[4] for c in launches if c[0] == "bwd"}
    eps = torch.finfo(torch.bfloat16).eps
    for k, (a, b) in enumerate(zip(_errs(fused, exact), _errs(plain, exact))):
        assert a <= 2 * b + 4 * eps, f"output {k}: fused {a:.2e} vs torch {b:.2e}"
    if gpu.type == "cpu":
        assert hos == {torch.bfloat16}
