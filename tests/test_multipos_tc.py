"""multipos_infonce's candidate tensor-core path (TEMPOKERN_EXPERIMENTAL=mpb_tc): bfloat16 CUDA calls without a bias,
extra negatives or return_hardest, with a multiple of 16 features, run the one-level tensor-core kernels of
csrc/matryoshka_infonce/matryoshka_tc_cuda.cu (normalize=False). On the CUDA emulator (and a GPU where there is
one) against tempokern.reference: the forward to float32 rounding on the same bfloat16 values (rtol 2e-6), the
2x-torch rule in bfloat16 for the loss and both gradients, the partial entry with a diagonal offset and
caller-given row_none (CTDLoss's gathered column pass), and which calls take the blocked path instead."""
import pytest
import torch

import tempokern
import tempokern._ops.matryoshka_blocked as mb
import tempokern._ops.multipos_blocked as mpb
from tempokern._ops.routing import multipos_infonce_partial
from tempokern.reference import multipos_infonce as ref
from tempokern.reference.multipos_infonce import multipos_infonce_partial as ref_partial

from tempokern._ops import dispatch
from test_matryoshka_tc import force_tile, launch_tile


@pytest.fixture(params=["auto", "128x64", "64x64"])
def paths(monkeypatch, request):
    """Counts the tensor-core launches and the blocked path's kernel launches, with the candidates enabled; each
    test with the tile rule (the largest tile whose backward leaves room for two blocks per SM) and with 128 x 64
    and 64 x 64 tiles, every launch's tile checked against the rule computed from the device's limits."""
    force_tile(monkeypatch, request.param)
    seen = {"tc": 0, "blocked": 0, "rows": set()}
    real_tc, real_bl = mb._tc_launch, mpb._Launcher.launch

    def tc(F, *a, **k):
        seen["tc"] += 1
        seen["rows"].add(launch_tile(F))
        return real_tc(F, *a, **k)

    def bl(*a, **k):
        seen["blocked"] += 1
        return real_bl(*a, **k)
    monkeypatch.setattr(mb, "_tc_launch", tc)
    monkeypatch.setattr(mpb._Launcher, "launch", bl)
    with dispatch.use("mpb_tc", "mrl_tc"):
        yield seen
    # one-level calls (K = 1; the Matryoshka calls here have K = 2): the tile the device's shared memory gives
    # (test_matryoshka_tc.expected_tile; on an H100 auto takes 128 x 128 at K = 1 and 128 x 64 at K = 2 without a
    # table bias, 97 and 105 KB of its 227)
    for tr, tcl, want in seen["rows"]:
        assert (tr, tcl) == want


def inputs(B, H, *, Bd=None, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    Bd = B if Bd is None else Bd
    q = torch.randn(B, H, generator=g, dtype=torch.float64)
    d = torch.randn(Bd, H, generator=g, dtype=torch.float64)
    qs, ds = torch.randint(0, 30, (B,), generator=g), torch.randint(0, 30, (Bd,), generator=g)
    sp = ((qs, qs + torch.randint(0, 3, (B,), generator=g)), (ds, ds + torch.randint(0, 3, (Bd,), generator=g)))
    return q.to(dtype), d.to(dtype), sp


def on(gpu, q, d, sp):
    return q.to(gpu), d.to(gpu), tuple(tuple(t.to(gpu) for t in s) for s in sp)


@pytest.mark.parametrize("B,symmetric", [(70, False), (70, True), (200, True), (5, False)])
def test_forward_and_gradients_against_reference(gpu, paths, B, symmetric):
    q, d, sp = inputs(B, 64, seed=B)
    qg, dg, spg = on(gpu, q, d, sp)
    qg.requires_grad_()
    dg.requires_grad_()
    loss = tempokern.multipos_infonce(qg, dg, *spg, temperature=0.05, symmetric=symmetric)
    gq, gd = torch.autograd.grad(loss, (qg, dg))
    q64, d64 = q.double().requires_grad_(), d.double().requires_grad_()
    lr = ref(q64, d64, *sp, temperature=0.05, symmetric=symmetric)
    rq, rd = torch.autograd.grad(lr, (q64, d64))
    torch.testing.assert_close(loss.double().cpu(), lr, rtol=2e-6, atol=1e-6)
    for a, b in ((gq, rq), (gd, rd)):  # coefficients rounded once to bf16 (as the blocked path's dS)
        torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=1e-2 * b.abs().max().item())
    if gpu.type == "cpu":
        assert paths["tc"] >= 2 and paths["blocked"] == 0


def test_two_x_torch_rule_bf16(gpu, paths):
    q, d, sp = inputs(96, 32, seed=3, dtype=torch.float64)
    exact = _run(ref, q, d, sp)
    low = [t.to(torch.bfloat16) for t in (q, d)]
    plain = _run(ref, *low, sp)
    got = _run(tempokern.multipos_infonce, *on(gpu, *low, sp))
    eps = torch.finfo(torch.bfloat16).eps
    for k, (f, p, e) in enumerate(zip(got, plain, exact)):
        ef = (f.double().cpu() - e).abs().max().item()
        et = (p.double() - e).abs().max().item()
        assert ef <= 2 * et + 4 * eps, f"output {k}: tempokern {ef:.2e} vs torch {et:.2e}"
    if gpu.type == "cpu":
        assert paths["tc"] and not paths["blocked"]


def _run(fn, q, d, sp):
    q, d = q.clone().requires_grad_(), d.clone().requires_grad_()
    loss = fn(q, d, *sp, temperature=0.1, symmetric=True)
    return [loss.detach(), *torch.autograd.grad(loss, (q, d))]


def test_partial_with_diagonal_offset_and_row_none(gpu, paths):
    # CTDLoss's gathered passes: more columns than rows, row i's fallback at column i + 40, and a caller's
    # row_none flag (rows without an overlap among ALL documents) deciding the column fallback
    q, d, sp = inputs(40, 32, Bd=120, seed=7)
    (q_lo, q_hi), (d_lo, d_hi) = ((torch.minimum(*s), torch.maximum(*s)) for s in sp)
    row_none = torch.rand(40, generator=torch.Generator().manual_seed(1)) < 0.3
    kw = dict(temperature=0.1, row_weight=0.5, col_weight=0.5, diag_offset=40)
    got = multipos_infonce_partial(*on(gpu, q, d, ((q_lo, q_hi), (d_lo, d_hi)))[:2], q_lo.to(gpu), q_hi.to(gpu),
                                   d_lo.to(gpu), d_hi.to(gpu), row_none=row_none.to(gpu), **kw)
    want = ref_partial(q.double(), d.double(), q_lo, q_hi, d_lo, d_hi, row_none=row_none, **kw)
    torch.testing.assert_close(got.double().cpu(), want, rtol=2e-6, atol=1e-6)
    if gpu.type == "cpu":
        assert paths["tc"] == 1 and paths["blocked"] == 0


@pytest.mark.parametrize("case", ["float32", "H24", "extra_neg", "bias", "hardest", "switch"])  # bias: exact
def test_calls_that_keep_the_blocked_path(gpu, paths, monkeypatch, case):
    q, d, sp = inputs(40, 24 if case == "H24" else 32, seed=11, dtype=torch.float32 if case == "float32" else
                      torch.bfloat16)
    q, d, sp = on(gpu, q, d, sp)
    kw = {}
    if case == "extra_neg":
        kw["extra_neg"] = d[:5].clone()
    elif case == "bias":
        u = torch.rand(40, device=gpu)
        kw["bias"] = (u, u, torch.randn(4, 8, device=gpu), torch.randn(4, device=gpu), torch.randn(1, 4, device=gpu),
                      torch.randn(1, device=gpu), torch.tensor(1.0, device=gpu))  # the exact MLP bias
    elif case == "hardest":
        kw["return_hardest"] = True
    with dispatch.use() if case == "switch" else dispatch.use("mpb_tc"):  # "switch": the candidate not enabled
        out = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, **kw)
    assert torch.isfinite(out[0] if isinstance(out, tuple) else out)
    if gpu.type == "cpu":
        assert paths["tc"] == 0 and paths["blocked"] > 0


def test_under_torch_compile_fullgraph(gpu, paths):
    # the routing (dtype, the device's level limit: a constant for dynamo) traces without a graph break, and the
    # compiled calls of both losses equal the eager ones
    q, d, sp = on(gpu, *inputs(70, 32, seed=13))
    q.requires_grad_()
    d.requires_grad_()
    spans = dict(q_span=sp[0], d_span=sp[1])
    losses = (lambda q, d: tempokern.multipos_infonce(q, d, *sp, temperature=0.1),
              lambda q, d: tempokern.matryoshka_infonce(q, d, (16, 32), temperature=0.1, **spans))
    for fn in losses:
        eager = fn(q, d)
        ge = torch.autograd.grad(eager, (q, d))
        comp = torch.compile(fn, backend="aot_eager", fullgraph=True)
        got = comp(q, d)
        gc = torch.autograd.grad(got, (q, d))
        torch.testing.assert_close(got, eager, rtol=0, atol=0)
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    if gpu.type == "cpu":
        assert paths["tc"] >= 8 and paths["blocked"] == 0


@pytest.mark.parametrize("symmetric", [False, True])
def test_step_reads_no_device_value_on_the_host(gpu, paths, monkeypatch, symmetric):
    # a training step (forward + backward) on the tensor-core path never reads a device value on the host
    # (each read is a synchronisation that stalls a pipelined loop): level coefficients stay on the device,
    # and the unused levels output gets no zero gradient to inspect
    q, d, sp = on(gpu, *inputs(70, 32, seed=17))
    q.requires_grad_()
    d.requires_grad_()
    reads = []
    for name in ("tolist", "item", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real, **k: reads.append(_n) or _r(self, *a, **k))
    loss = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, symmetric=symmetric)
    loss.backward()
    monkeypatch.undo()
    assert reads == []
    if gpu.type == "cpu":
        assert paths["tc"] == 2


# ---- the table bias (bias_table_points=N) on the tensor-core path ------------------------------------------

@pytest.mark.parametrize("mode", ["none", "table"])
def test_two_x_torch_rule_as_the_blocked_path(gpu, paths, mode):
    # the blocked path's 2x-torch test (test_multipos_blocked.assert_two_x_rule: the loss and every gradient,
    # the seven bias inputs included, with its floors for the bias parameters' cancelling sums) without the
    # extra negatives, so that the calls take the tensor-core path
    from test_multipos_blocked import assert_two_x_rule
    assert_two_x_rule(gpu, torch.bfloat16, mode, N=0)
    if gpu.type == "cpu":
        assert paths["tc"] and not paths["blocked"]


@pytest.mark.parametrize("pts,symmetric", [(65, False), (65, True), (20001, True)])
def test_table_bias_forward_against_reference(gpu, paths, monkeypatch, pts, symmetric):
    # 20,001 points: the histogram of dL/dtable in global memory (atomics) instead of shared memory
    from test_matryoshka_infonce import make_bias
    seen = []
    real = mb._tc_launch
    monkeypatch.setattr(mb, "_tc_launch", lambda F, op, *a, **k: seen.append((op, F.tab[3])) or real(F, op, *a, **k))
    q, d, sp = inputs(130, 32, seed=pts)
    bias = tuple(t.float() for t in make_bias(130, 130, seed=4, u_lo=0.0, u_hi=1.0))
    qg, dg, spg = on(gpu, q, d, sp)
    ins = [qg.requires_grad_(), dg.requires_grad_()] + [t.to(gpu).requires_grad_() for t in bias]
    loss = tempokern.multipos_infonce(ins[0], ins[1], *spg, temperature=0.1, bias=tuple(ins[2:]),
                                      bias_table_points=pts, symmetric=symmetric)
    got = torch.autograd.grad(loss, ins)
    r_ins = [q.double().requires_grad_(), d.double().requires_grad_()] + [t.double().requires_grad_() for t in bias]
    lr = ref(r_ins[0], r_ins[1], *sp, temperature=0.1, bias=tuple(r_ins[2:]), bias_table_points=pts,
             symmetric=symmetric)
    want = torch.autograd.grad(lr, r_ins)
    torch.testing.assert_close(loss.double().cpu(), lr, rtol=2e-6, atol=1e-6)
    # u_q, u_d: float32 sums of g slope (the slope of a float32 table: (P - 1) / 2 times its rounding)
    for a, b in zip(got[2:4], want[2:4]):
        torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=2e-3 * b.abs().max().item())
    if gpu.type == "cpu":
        assert seen == [("fwd", pts <= mb.TC_HIST_SMEM_POINTS), ("bwd", pts <= mb.TC_HIST_SMEM_POINTS)]
        assert paths["blocked"] == 0


def test_matryoshka_with_a_table_bias(gpu, paths):
    from test_matryoshka_infonce import make_bias
    from tempokern.reference import matryoshka_infonce as mref
    q, d, sp = inputs(70, 64, seed=5)
    bias = tuple(t.float() for t in make_bias(70, 70, seed=6, u_lo=0.0, u_hi=1.0))
    qg, dg, spg = on(gpu, q, d, sp)
    kw = dict(temperature=0.1, bias_table_points=129, symmetric=True)
    ins = [qg.requires_grad_(), dg.requires_grad_()] + [t.to(gpu).requires_grad_() for t in bias]
    got = tempokern.matryoshka_infonce(ins[0], ins[1], (16, 64), q_span=spg[0], d_span=spg[1],
                                       bias=tuple(ins[2:]), **kw)
    g_got = torch.autograd.grad(got, ins)
    r_ins = [q.double().requires_grad_(), d.double().requires_grad_()] + [t.double().requires_grad_() for t in bias]
    want = mref(r_ins[0], r_ins[1], (16, 64), q_span=sp[0], d_span=sp[1], bias=tuple(r_ins[2:]), **kw)
    g_want = torch.autograd.grad(want, r_ins)
    torch.testing.assert_close(got.double().cpu(), want, rtol=2e-6, atol=1e-6)
    # q, d: the bf16-rounded coefficients; the bias inputs: float32 sums of the levels' g (both levels' terms)
    for k, (a, b) in enumerate(zip(g_got, g_want)):
        tol = (1e-2 if k < 2 else 2e-3) * b.abs().max().item()
        if k in (2, 3, 4, 6, 8):  # u_q, u_d, w1, w2, scale (b1 / b2 cancel to ~0: the softmax is shift-invariant)
            torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=tol, msg=lambda m: f"grad {k}: {m}")
    if gpu.type == "cpu":
        assert paths["tc"] == 2 and paths["blocked"] == 0  # forward, backward


# ---- no host synchronisation per training step --------------------------------------------------------------

@pytest.mark.parametrize("loss_fn,mode", [("multipos", "none"), ("multipos_sym", "none"), ("multipos", "table"),
                                          ("matryoshka", "none"), ("matryoshka", "table")])
def test_steady_step_makes_no_tensor_from_host_values(gpu, paths, monkeypatch, loss_fn, mode):
    # after the first step, a training step on the tensor-core path builds no tensor from host values: on a GPU
    # each torch.tensor(..., device=cuda) is a copy from pageable memory, which waits for the stream (a host
    # synchronisation per step); the small constants (level coefficients, scales, prefix ends) are cached per
    # device (common.device_constant). The bf16 table-bias call also skips the operand value check.
    from test_matryoshka_infonce import make_bias
    q, d, sp = on(gpu, *inputs(70, 32, seed=31))
    q.requires_grad_()
    d.requires_grad_()
    bias = tuple(t.float().to(gpu).requires_grad_() for t in make_bias(70, 70, seed=5, u_lo=0.0, u_hi=1.0))
    kw = {} if mode == "none" else dict(bias=bias, bias_table_points=65)

    def step():
        if loss_fn == "matryoshka":
            loss = tempokern.matryoshka_infonce(q, d, [16, 32], temperature=0.1, symmetric=True,
                                                q_span=sp[0], d_span=sp[1], **kw)
        else:
            loss = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, symmetric=loss_fn == "multipos_sym", **kw)
        loss.backward()
    step()
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a[0] if a else k) or real(*a, **k))
    monkeypatch.setattr(mb, "_exact_half", lambda ts: made.append("value check"))
    step()
    monkeypatch.undo()
    assert made == []
    if gpu.type == "cpu":
        assert paths["tc"] >= 4 and paths["blocked"] == 0
