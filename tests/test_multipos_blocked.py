"""The blocked multi-positive InfoNCE (CUDA path, and the table mode of the bias on CPU and CUDA) against the
plain PyTorch reference: loss and every gradient, several blocks, several SM counts, every dtype by the
2x-torch rule, and ChunQiuTR's column fallback written out independently of tempokern.reference."""
import pytest
import torch
from _emu_support import patch_kernels, patch_sm_count, real_kernels, real_sm_count  # noqa: F401

import tempokern
import tempokern._ops.multipos_blocked as mpb
from tempokern._ops.loss_args import span_bounds
from tempokern._ops.multipos_infonce import blocked_multipos
from tempokern.reference import multipos_infonce as ref
from tempokern.reference.offset_bias import offset_bias, offset_bias_tabulated

from test_multipos_infonce import leaves, make


def both(fn_loss, ins):
    loss = fn_loss()
    return loss, torch.autograd.grad(loss, ins)


def run_pair(q, d, sp, neg, b, *, pts=None, temperature=0.1, symmetric=True, block_rows=0):
    ins = leaves(q, d, neg, b)
    want = both(lambda: ref(q, d, *sp, temperature=temperature, bias=b, extra_neg=neg, symmetric=symmetric,
                            bias_table_points=pts), ins)
    if block_rows:
        (qlo, qhi), (dlo, dhi) = span_bounds(sp[0]), span_bounds(sp[1])
        w = 0.5 if symmetric else 1.0
        got = both(lambda: blocked_multipos(q, d, qlo, qhi, dlo, dhi, temperature=temperature, bias=b, extra_neg=neg,
                                            row_weight=w, col_weight=w if symmetric else 0.0,
                                            bias_table_points=pts, block_rows=block_rows), ins)
    else:
        got = both(lambda: tempokern.multipos_infonce(q, d, *sp, temperature=temperature, bias=b, extra_neg=neg,
                                                      symmetric=symmetric, bias_table_points=pts), ins)
    return got, want


def assert_all_close(got, want, rtol, atol):
    torch.testing.assert_close(got[0].to(want[0].dtype), want[0], rtol=rtol, atol=atol)
    assert len(got[1]) == len(want[1])
    for i, (x, y) in enumerate(zip(got[1], want[1])):
        torch.testing.assert_close(x.to(y.dtype), y, rtol=rtol, atol=atol, msg=lambda m: f"grad {i}: {m}")


TABLE_CASES = [  # B, H, N, symmetric, spans, points, u range
    (37, 9, 0, True, "random", 97, (-0.5, 1.5)),    # clamp bites for some pairs
    (64, 16, 5, False, "random", 2, (0.0, 1.0)),    # two points: the table is one line
    (51, 8, 0, True, "disjoint", 4097, (0.2, 0.4)),
    (40, 8, 3, True, "all", 1025, (-3.0, 3.0)),     # most pairs clamped
]


@pytest.mark.parametrize("B,H,N,symmetric,spans,pts,urange", TABLE_CASES)
def test_table_mode_matches_reference_float64(device, B, H, N, symmetric, spans, pts, urange):
    q, d, sp, neg, b = make(B, H, N=N, bias=True, spans=spans, u_lo=urange[0], u_hi=urange[1], device=device,
                            seed=B + pts)
    got, want = run_pair(q, d, sp, neg, b, pts=pts, symmetric=symmetric)
    assert_all_close(got, want, rtol=1e-9, atol=1e-10)


def test_table_reference_is_the_interpolated_mlp():
    # the spec of the table mode, pinned independently: at the grid points the table equals the exact bias,
    # between them it is the chord
    g = torch.Generator().manual_seed(3)
    w1, b1, w2 = (torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64),
                  torch.randn(1, 6, generator=g, dtype=torch.float64))
    b2, scale = torch.randn(1, generator=g, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)
    P = 17
    grid = torch.linspace(-1, 1, P, dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    at_grid = offset_bias_tabulated(zero, grid, w1, b1, w2, b2, scale, P)[0]
    exact = offset_bias(zero, grid, w1, b1, w2, b2, scale)[0]
    torch.testing.assert_close(at_grid, exact, rtol=1e-12, atol=1e-13)
    mid = (grid[3] + grid[4]) / 2
    chord = (exact[3] + exact[4]) / 2
    got = offset_bias_tabulated(zero, mid.reshape(1), w1, b1, w2, b2, scale, P)[0, 0]
    torch.testing.assert_close(got, chord, rtol=1e-12, atol=1e-13)
    out = offset_bias_tabulated(zero, torch.tensor([5.0], dtype=torch.float64), w1, b1, w2, b2, scale, P)[0, 0]
    torch.testing.assert_close(out, exact[-1])  # clamped to delta = 1


def test_table_mode_error_against_exact_bias():
    # documented bound (docs/multipos_infonce.md): with 4097 points the loss and the q/d gradients stay
    # within 1e-5 of the exact MLP bias at ChunQiuTR's month spacing, random nn.OffsetBias weights
    torch.manual_seed(0)
    ob = tempokern.nn.OffsetBias(features=32, hidden=32).double()
    with torch.no_grad():
        ob.scale.fill_(1.0)
    B = 96
    q, d, sp, neg, _ = make(B, 16, dtype=torch.float64, seed=5)
    months = torch.randint(0, 4608, (2, B), dtype=torch.float64) / 4607
    b = (months[0], months[1], *tempokern.nn.offset_bias.bias_params(ob))
    ins = [q, d]
    exact = both(lambda: ref(q, d, *sp, temperature=0.05, bias=b), ins)
    table = both(lambda: tempokern.multipos_infonce(q, d, *sp, temperature=0.05, bias=b, bias_table_points=4097), ins)
    assert abs(exact[0].item() - table[0].item()) < 1e-5
    for x, y in zip(table[1], exact[1]):
        assert (x - y).abs().max().item() < 1e-5
    assert abs(exact[0].item() - table[0].item()) > 0  # the table is an approximation, not the exact path


@pytest.mark.parametrize("mode", ["none", "table", "exact"])
@pytest.mark.parametrize("rows", [1, 32, 50])
def test_several_blocks_match_reference(gpu, mode, rows):
    # blocks of `rows` rows (the last one partial), the fused passes merged across blocks with torch
    B = 97 if gpu.type == "cpu" else 300
    q, d, sp, neg, b = make(B, 12, N=7, bias=mode != "none", device=gpu, seed=rows)
    got, want = run_pair(q, d, sp, neg, b, pts=97 if mode == "table" else None, block_rows=rows)
    assert_all_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("sms", [132, 108, 58, 1])
def test_tiling_at_other_sm_counts(gpu, monkeypatch, sms):
    patch_sm_count(monkeypatch, lambda device: sms)
    TR, nct, nrt = mpb.tiling(600, 3000, gpu)
    assert nct == -(-3000 // mpb.TILE_COLS) and TR % 32 == 0 and nrt == -(-600 // TR)
    assert nct * nrt >= min(4 * sms, nct * -(-600 // 32))  # at least 4 x SMs blocks where there are rows for it
    q, d, sp, neg, b = make(70, 10, N=3, bias=True, device=gpu, seed=sms)
    got, want = run_pair(q, d, sp, neg, b, pts=33)
    assert_all_close(got, want, rtol=1e-9, atol=1e-10)


def test_block_rows_budget(monkeypatch):
    dev = torch.device("cpu")
    monkeypatch.setenv("TEMPOKERN_BLOCK_BYTES", str(1 << 20))
    assert mpb.block_rows(100, 100, 0, 6, dev) == 100           # 60 KB fits: one block
    assert mpb.block_rows(100_000, 65536, 0, 6, dev) == 2      # 393 KB a row: 2 rows fit 1 MiB
    monkeypatch.setenv("TEMPOKERN_BLOCK_BYTES", str(1 << 30))
    R = mpb.block_rows(262144, 262144, 0, 6, dev)
    assert R % 256 == 0 and R * 262144 * 6 <= 1 << 30           # O(R x B) memory, never B x B


def _chunqiutr_loss(q, d, q_span, d_span, temperature):
    """ChunQiuTR's contrastive_loss_inbatch, written out as the reference code does it (mask algebra on the
    full B x B overlap matrix): row fallback first, the d->q mask is its transpose plus the diagonal for
    columns still without a positive."""
    s = q @ d.t() / temperature
    qs, qe = q_span
    ds, de = d_span
    ov = (torch.maximum(qs[:, None], ds[None, :]) <= torch.minimum(qe[:, None], de[None, :]))
    eye = torch.eye(s.shape[0], dtype=torch.bool)
    pos_mask_pos = ov.clone()
    no_pos = pos_mask_pos.sum(1) == 0
    pos_mask_pos[no_pos] = eye[no_pos]
    pos_mask_col = pos_mask_pos.t().clone()
    no_col = pos_mask_col.sum(1) == 0
    pos_mask_col[no_col] = eye[no_col]
    sd = s.t()
    lq = (torch.logsumexp(s, 1) - torch.logsumexp(s.masked_fill(~pos_mask_pos, float("-inf")), 1)).mean()
    ld = (torch.logsumexp(sd, 1) - torch.logsumexp(sd.masked_fill(~pos_mask_col, float("-inf")), 1)).mean()
    return (lq + ld) / 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_column_fallback_is_chunqiutr(device, seed):
    # many rows without an overlap whose columns do overlap: where the old column-only fallback differed
    g = torch.Generator().manual_seed(seed)
    B = 40
    q = torch.randn(B, 6, generator=g, dtype=torch.float64)
    d = torch.randn(B, 6, generator=g, dtype=torch.float64)
    qs = torch.randint(0, 80, (B,), generator=g)
    ds = torch.randint(0, 80, (B,), generator=g)
    q_span, d_span = (qs, qs + 1), (ds, ds + 2)
    want = _chunqiutr_loss(q, d, q_span, d_span, 0.2)
    on = lambda t: t.to(device)  # noqa: E731
    got = tempokern.multipos_infonce(on(q), on(d), tuple(map(on, q_span)), tuple(map(on, d_span)), temperature=0.2)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)
    got_ref = ref(q, d, q_span, d_span, temperature=0.2)
    torch.testing.assert_close(got_ref, want, rtol=1e-12, atol=1e-12)


def _errs(got, truth):
    return [((x.double() - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
            for x, y in zip([got[0], *got[1]], [truth[0], *truth[1]])]


def _bias_term_sums(q, d, sp, neg, b, pts):
    """Per bias parameter (w1, b1, w2, b2, scale), float64: the largest over its entries of
    sum_ij |dL/dbias_ij| d bias_ij / d theta, the size of the B^2 terms whose cancelling sum the gradient is
    (a lower bound of sum |term| where d bias / d theta changes sign: w1, b1)."""
    import importlib
    rm = importlib.import_module("tempokern.reference.multipos_infonce")
    bias_fn = (lambda *a: offset_bias(*a)) if pts is None else (lambda *a: offset_bias_tabulated(*a, pts))
    bb = [t.detach() for t in b]
    dense = bias_fn(*bb).detach().requires_grad_()
    name = "offset_bias" if pts is None else "offset_bias_tabulated"
    real = getattr(rm, name)
    setattr(rm, name, lambda *a, **k: dense)  # the reference with the bias as one leaf: G = dL/dbias
    try:
        loss = ref(q.detach(), d.detach(), *sp, temperature=0.1, bias=bb, extra_neg=None if neg is None else neg.detach(),
                   bias_table_points=pts)
    finally:
        setattr(rm, name, real)
    G, = torch.autograd.grad(loss, dense)
    params = [t.clone().requires_grad_() for t in bb[2:]]
    total = (G.abs() * bias_fn(bb[0], bb[1], *params)).sum()
    return [g.abs().max().item() for g in torch.autograd.grad(total, params)]


def _two_x_errors(gpu, dtype, mode, seed, B=None, floors=False, N=9):
    """(fused errors, torch errors) against float64 for the loss and every gradient, relative to the largest
    |value|; with floors=True also the conditioning floor of each output (0 except the bias parameters':
    eps * sum |terms| / sqrt(B) relative to the largest |value|, see assert_two_x_rule). N extra negatives
    (N = 0: none, the calls the tensor-core path takes in bfloat16)."""
    B = B or (96 if gpu.type == "cpu" else 256)
    q, d, sp, neg, b = make(B, 32, N=N, bias=mode != "none", dtype=torch.float64, device=gpu, seed=seed,
                            u_lo=0.0, u_hi=1.0)
    with torch.no_grad():
        q /= q.norm(dim=1, keepdim=True)
        d /= d.norm(dim=1, keepdim=True)
        if neg is not None:
            neg /= neg.norm(dim=1, keepdim=True)
    pts = 1025 if mode == "table" else None
    truth_in = (q, d, neg, b)
    truth = both(lambda: ref(q, d, *sp, temperature=0.1, bias=b, extra_neg=neg, bias_table_points=pts),
                 leaves(*truth_in))
    low = lambda t: None if t is None else t.detach().to(dtype).requires_grad_()  # noqa: E731
    ql, dl, nl = low(q), low(d), low(neg)
    bl = None if b is None else tuple(low(t) for t in b)
    ins = leaves(ql, dl, nl, bl)
    plain = both(lambda: ref(ql, dl, *sp, temperature=0.1, bias=bl, extra_neg=nl, bias_table_points=pts), ins)
    fused = both(lambda: tempokern.multipos_infonce(ql, dl, *sp, temperature=0.1, bias=bl, extra_neg=nl,
                                                    bias_table_points=pts), ins)
    if not floors:
        return _errs(fused, truth), _errs(plain, truth)
    fl = [0.0] * (1 + len(truth[1]))
    if b is not None:
        eps = torch.finfo(dtype).eps
        sums = _bias_term_sums(q, d, sp, neg, b, pts)
        for k, (m, t) in enumerate(zip(sums, truth[1][-5:]), start=len(fl) - 5):
            fl[k] = eps * m / B ** 0.5 / max(t.abs().max().item(), 1e-30)
    return _errs(fused, truth), _errs(plain, truth), fl


def assert_two_x_rule(gpu, dtype, mode, seeds=None, N=9):
    """Loss and every gradient: the fused op's error against float64 at most twice plain torch's own error in
    that dtype (plus a floor of a few ulps of the dtype for gradients that torch happens to get exact). The
    bias's parameter gradients (w1, b1, w2, b2, scale; exact or tabulated) are sums of B^2 terms that cancel
    (each softmax row of dL/dx sums to 0): torch's own error there varies 100x between draws, so both errors
    are the largest over three draws, with a floor for such sums: the larger of sqrt(pairs) ulps of the value
    (the slack test_offset_bias gives them) and the conditioning floor eps * sum|terms| / sqrt(B) (each row's
    log-sum-exp carries its own rounding, which scales all of that row's terms alike: B independent row errors
    of eps times the row's share of sum|terms|). The second matters on ill-conditioned draws: on the CPU at
    B = 96, seed 13's d/d w2 is 8.7e-4 from terms summing to 2.75 in magnitude (condition 3,200); tempokern's
    error there is 4.0e-8 (0.12 eps * sum|terms|) and torch's 9.3e-9 on one machine (AMD EPYC: the draw failed
    the sqrt(pairs) floor there) while the other draws' conditions are 40-120."""
    seeds = seeds or ((11, 12, 13) if mode != "none" else (11,))
    runs = [_two_x_errors(gpu, dtype, mode, sd, floors=True, N=N) for sd in seeds]
    eps = torch.finfo(dtype).eps
    pairs = (96 if gpu.type == "cpu" else 256) ** 2
    for k in range(len(runs[0][0])):
        ef = max(r[0][k] for r in runs)
        et = max(r[1][k] for r in runs)
        nb = len(runs[0][0]) - 5  # the bias parameters' gradients (w1, b1, w2, b2, scale) are the last five
        floor = max(pairs ** 0.5 * eps, max(r[2][k] for r in runs)) if mode != "none" and k >= nb else 4 * eps
        assert ef <= 2 * et + floor, f"output {k}: fused {ef:.2e} vs torch {et:.2e} ({dtype}, {mode})"


def launch_spy(monkeypatch, name, value, record=lambda op, S: op):
    """Sets the switch `name` = `value` and records record(op, S) for every fused-pass launch of the blocked
    path (the list is returned)."""
    monkeypatch.setenv(name, value)
    calls = []
    real = mpb._Launcher.launch

    def spy(self, op, S, *a, **k):
        calls.append(record(op, S))
        return real(self, op, S, *a, **k)

    monkeypatch.setattr(mpb._Launcher, "launch", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "table", "exact"])
def test_two_x_torch_rule(device, dtype, mode):
    # CPU kernel, CUDA emulator and GPU alike (every gradient, every dtype)
    assert_two_x_rule(device, dtype, mode)


def test_table_points_validation():
    q, d, sp, neg, b = make(8, 4, bias=True)
    with pytest.raises(TypeError, match="bias_table_points"):
        tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, bias_table_points=True)
    with pytest.raises(TypeError, match="bias_table_points"):
        tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, bias_table_points=4097.0)
    with pytest.raises(ValueError, match="bias_table_points"):
        tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, bias_table_points=1)
    with pytest.raises(ValueError, match="bias_table_points"):
        tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias_table_points=4097)


def test_forward_without_grad_then_backward_is_a_clear_error():
    q, d, sp, neg, b = make(8, 4, bias=True)
    with torch.no_grad():
        loss = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, bias_table_points=33)
    assert loss.grad_fn is None and torch.isfinite(loss)


def test_table_mode_under_torch_compile():
    q, d, sp, neg, b = make(24, 8, N=3, bias=True, seed=4)
    fn = lambda *a: tempokern.multipos_infonce(a[0], a[1], *sp, temperature=0.1, bias=a[3:], extra_neg=a[2],  # noqa: E731
                                              bias_table_points=65)
    ins = leaves(q, d, neg, b)
    eager = both(lambda: fn(q, d, neg, *b), ins)
    comp = torch.compile(fn, backend="aot_eager", fullgraph=False)
    got = both(lambda: comp(q, d, neg, *b), ins)
    assert_all_close(got, eager, rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a CUDA device's memory")
def test_cuda_memory_grows_with_block_not_b_squared():
    gpu = torch.device("cuda")
    B, H = 32768, 128  # a float32 B x B would be 4.3 GB, 4x the block budget
    q, d, sp, neg, b = make(B, H, dtype=torch.bfloat16, device=gpu, seed=1)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = tempokern.multipos_infonce(q, d, *sp, temperature=0.05)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < (1 << 30) + 8 * B * H * 4 + (64 << 20), extra  # the 1 GiB block budget + O(B H) gradients
    assert extra < B * B * 4                                   # never a float32 B x B


def test_ctdloss_table_mode_matches_reference():
    torch.manual_seed(1)
    ob = tempokern.nn.OffsetBias(features=8, hidden=6).double()
    crit = tempokern.nn.CTDLoss(temperature=0.1, offset_bias=ob, bias_table_points=129)
    q, d, sp, neg, _ = make(30, 8, N=4, seed=9)
    u_q, u_d = torch.rand(30, dtype=torch.float64), torch.rand(30, dtype=torch.float64)
    params = list(ob.parameters())
    got = both(lambda: crit(q, d, *sp, u_q=u_q, u_d=u_d, extra_neg=neg), [q, d, neg] + params)
    import torch.nn.functional as F
    b = (u_q, u_d, *tempokern.nn.offset_bias.bias_params(ob))
    want = both(lambda: ref(F.normalize(q, dim=-1), F.normalize(d, dim=-1), *sp, temperature=0.1, bias=b,
                            extra_neg=F.normalize(neg, dim=-1), bias_table_points=129), [q, d, neg] + params)
    assert_all_close(got, want, rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match="bias_table_points"):
        tempokern.nn.CTDLoss(bias_table_points=129)
