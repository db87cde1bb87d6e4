"""The candidate tensor-core CUDA path of tempokern.matryoshka_infonce (csrc/matryoshka_infonce/matryoshka_tc_cuda.cu,
TEMPOKERN_EXPERIMENTAL=mrl_tc: bfloat16 embeddings without a bias or extra negatives whose dims are multiples
of 16) on the CUDA emulator (and a GPU where there is one), against tempokern.reference:

- the forward (loss, levels) against the float64 reference on the same bfloat16 values: the products are exact
  and summed in float32, so the loss agrees to float32 rounding (rtol 2e-6), with partial row and column
  tiles, several row blocks, symmetric, spans, B != B';
- the backward kernel's only per-pair output, the coefficient blocks Ho_l (suffix sums over the levels of
  inv_temp rho kap g, rounded once to bfloat16), element by element against a float64 computation from the
  kernel's own inputs: within one bfloat16 ulp; its dL/drho and dL/dkap partial sums to float32 rounding;
- the 2x-torch rule in bfloat16 for the loss, the levels and every gradient;
- grids at 132 / 108 / 58 / 1 SMs, three thread orders and two warp-serial orders, the levels up to the top
  weighted one, all weights zero, and which calls fall back (float32, dims not multiples of 16, extra negatives, a
  bias, the candidate not enabled, more levels than the shared memory holds: sm_86's 99 KB, a GPU below compute capability 8.0), and the
  kernel's own checks;
- every launch's tile against the rule computed from the device's shared-memory limit (expected_tile), so the
  tests pass on any card: TEMPOKERN_EMU_ARCH=80 / 86 / 90 runs them at the A100's, sm_86's and the H100's limits."""

import pytest
import torch
from _emu_support import patch_kernels, patch_sm_count, real_kernels, real_sm_count  # noqa: F401

import tempokern
import tempokern._ops.matryoshka_blocked as mb
import tempokern._ops.routing as routing
from _emu_support import force_blocked
from tempokern.reference import matryoshka_infonce as ref

from tempokern._ops import dispatch
from conftest import by_thread_order
from test_matryoshka_infonce import make, make_bias, run_both


TILE_ORDER = [(128, 128), (128, 64), (64, 64)]


def expected_tile(choice: str, K: int, table: bool, hist_points: int, optin: int):
    """The tile `choice` ("auto": the product's rule, mb.tc_tile; a named tile: force_tile) gives a call of K levels on a device with `optin` bytes of opt-in shared
    memory per block, from the kernels' shared-memory sizes: auto takes the largest tile whose backward leaves room
    for two blocks per SM (K <= 2; more levels: 64 x 64), a named tile itself or the next smaller that fits."""
    k = mb.kernels()
    size = lambda t: k.mrl_tc_smem_bytes(K, True, table, hist_points, *t)  # noqa: E731
    if choice == "auto":
        return next((t for t in TILE_ORDER if size(t) <= optin // 2), (64, 64)) if K <= 2 else (64, 64)
    named = tuple(int(v) for v in choice.split("x"))
    return next((t for t in TILE_ORDER[TILE_ORDER.index(named):] if size(t) <= optin), (64, 64))


_TILE_CHOICE = {"name": "auto"}  # the tile the current test forces (force_tile)


def force_tile(monkeypatch, name: str) -> None:
    """Makes the tensor-core kernels run the tile `name` ("128x64", "64x64", "128x128"; "auto": the product's rule)
    where the device's shared memory allows it, else the next smaller one (expected_tile's rule): the kernels take
    every tile, the product picks one by a fixed rule (mb.tc_tile), and these tests run the others too."""
    monkeypatch.setitem(_TILE_CHOICE, "name", name)
    if name != "auto":
        monkeypatch.setattr(mb, "tc_tile", lambda K, table, hist_points, optin:
                            expected_tile(name, K, table, hist_points, optin))


def launch_tile(F):
    """(tile rows, tile columns, the tile expected_tile's rule gives this launch's call on its device)."""
    P = 0 if F.tab is None else F.tab[2].numel()
    hist = P if 0 < P <= mb.TC_HIST_SMEM_POINTS else 0
    want = expected_tile(_TILE_CHOICE["name"], F.c.K, F.tab is not None, hist, mb.kernels().mrl_tc_smem_optin(F.dev))
    return F.tr, F.tcl, want


@pytest.fixture(params=["64x64", "128x64", "128x128"])
def tc(monkeypatch, request):
    """The mrl_tc candidate enabled, with every tensor-core launch recorded: (op, i0, i1, K, outputs) and the
    levels path's multipos_infonce calls; each test with the three tiles (the larger ones wherever the shared
    memory holds the backward's K score tiles, else the next smaller). mpb_tc stays off: the levels path's
    per-level multipos_infonce calls keep the blocked path (tests/test_multipos_tc.py has those)."""
    force_tile(monkeypatch, request.param)
    rec = {"launches": [], "levels": 0}
    real, real_mp = mb._tc_launch, routing.multipos_infonce_partial

    def spy(F, op, i0, i1, K, splits, **outs):
        real(F, op, i0, i1, K, splits, **outs)
        rec["launches"].append((op, i0, i1, K, splits, F, {k: (None if v is None else v.clone()) for k, v in outs.items()}))
        rec.setdefault("tiles", []).append(launch_tile(F))

    def mp(*a, **k):
        rec["levels"] += 1
        return real_mp(*a, **k)
    monkeypatch.setattr(mb, "_tc_launch", spy)
    monkeypatch.setattr(routing, "multipos_infonce_partial", mp)  # the levels path's per-level loss
    with dispatch.use("mrl_tc"):
        yield rec
    for tr, tcl, want in rec.get("tiles", []):  # the device's limits decide (an H100, an A100, sm_86 / sm_89)
        assert (tr, tcl) == want


def bf16_inputs(gpu, B, H, Bd=None, spans=None, seed=0):
    q, d, _, sp = make(B, H, Bd=Bd, spans=spans, seed=seed)
    mv = lambda t: t.to(torch.bfloat16).to(gpu)  # noqa: E731
    return mv(q), mv(d), {k: tuple(t.to(gpu) for t in v) for k, v in sp.items()}


DIMS = (16, 32, 64)
LW = torch.tensor([0.3, -0.2, 1.0])
CASES = [  # (B, Bd, spans, symmetric, block rows: 0 = one block)
    (70, 70, None, False, 0), (70, 70, "random", True, 0), (70, 130, "random", False, 0), (130, 130, None, True, 48),
    (5, 5, "random", True, 0), (200, 260, "random", False, 64),
]


@pytest.mark.parametrize("B,Bd,spans,symmetric,rows", CASES)
def test_forward_matches_reference(gpu, tc, B, Bd, spans, symmetric, rows):
    q, d, sp = bf16_inputs(gpu, B, 64, Bd=Bd, spans=spans, seed=B + Bd)
    with force_blocked(rows) if rows else torch.enable_grad():
        loss, levels = tempokern.matryoshka_infonce(q, d, DIMS, temperature=0.07, weights=(2.0, 0.0, 0.5),
                                                    symmetric=symmetric, return_levels=True, **sp)
    q64, d64 = q.double().cpu(), d.double().cpu()
    sp64 = {k: tuple(t.cpu() for t in v) for k, v in sp.items()}
    lr, vr = ref(q64, d64, DIMS, temperature=0.07, weights=(2.0, 0.0, 0.5), symmetric=symmetric, return_levels=True,
                 **sp64)
    torch.testing.assert_close(loss.double().cpu(), lr, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(levels.double().cpu(), vr, rtol=2e-6, atol=1e-6)
    if gpu.type == "cpu":
        fw = [x for x in tc["launches"] if x[0] == "fwd"]
        blocks = -(-B // rows) if rows else 1
        assert len(fw) == blocks and [x[1] for x in fw] == [i * (rows or B) for i in range(blocks)]
        assert tc["levels"] == 0


def _coefficients_float64(F, i0, i1, K, o):
    """Ho_l (float64) and the dL/drho, dL/dkap sums of rows i0..i1 from the launch's own inputs: the level
    scores from the bfloat16 operands in float64, the statistics and coefficients it read."""
    c = F.c
    q, d = F.qo[i0:i1].double(), F.do.double()
    it = c.it
    q_lo, q_hi, d_lo, d_hi = (t.long() for t in F.spans)
    ov = torch.maximum(q_lo[i0:i1, None], d_lo[None, :]) <= torch.minimum(q_hi[i0:i1, None], d_hi[None, :])
    dg = torch.arange(c.Bd)[None, :] == (torch.arange(i0, i1) + c.off)[:, None]
    rnone = F.row_none[i0:i1].bool()[:, None]
    rfb = (rnone if F.row_fb is None else F.row_fb[i0:i1].bool()[:, None])
    pos_r = ov | (dg & rnone)
    pos_c = ov | (dg & (rfb | F.col_none.bool()[None, :]))
    co = o["coef"].double()
    rl, cl = o["row_lse"].double(), None if o["col_lse"] is None else o["col_lse"].double()
    H = torch.zeros(i1 - i0, c.Bd, dtype=torch.float64)
    Hs, drho, dkap = [None] * K, [], []
    for l in range(K - 1, -1, -1):
        G = q[:, :c.seg[l + 1]] @ d[:, :c.seg[l + 1]].t()
        rs, ks = c.rho[l, i0:i1].double()[:, None], it * c.kap[l].double()[None, :]
        z = G * rs * ks
        g = co[l, 0] * (torch.exp(z - rl[l, 0, i0:i1, None]) - torch.where(pos_r, torch.exp(z - rl[l, 1, i0:i1, None]), 0))
        if cl is not None:
            g = g + co[l, 1] * (torch.exp(z - cl[l, 0][None, :]) - torch.where(pos_c, torch.exp(z - cl[l, 1][None, :]), 0))
        H = H + g * rs * ks
        Hs[l] = H.clone()
        drho.insert(0, (g * G * ks).sum(1))
        dkap.insert(0, (g * G * rs).sum(0) * it)
    return torch.stack(Hs), torch.stack(drho), torch.stack(dkap)


@pytest.mark.parametrize("dims", [DIMS, (32, 64)])  # K = 2: the 128-row tiles of the default rule, dL/dkap of each
@pytest.mark.parametrize("B,Bd,spans,symmetric,rows", [(70, 70, "random", True, 0), (130, 130, None, False, 48),
                                                       (70, 130, "random", False, 0)])
def test_backward_coefficients_within_one_bf16_ulp(cuda_emu, tc, B, Bd, spans, symmetric, rows, dims):
    from _emu_support import cuda_emulator
    q, d, sp = bf16_inputs("cpu", B, 64, Bd=Bd, spans=spans, seed=3 * B + Bd)
    q.requires_grad_()
    d.requires_grad_()
    K = len(dims)
    with cuda_emulator(cuda_emu), (force_blocked(rows) if rows else torch.enable_grad()):
        loss, levels = tempokern.matryoshka_infonce(q, d, dims, temperature=0.05, weights=(1.0, 0.5, 2.0)[-K:],
                                                    symmetric=symmetric, return_levels=True, **sp)
        (loss + (levels * LW[-K:]).sum()).backward()
    bw = [x for x in tc["launches"] if x[0] == "bwd"]
    assert bw
    for op, i0, i1, K, splits, F, o in bw:
        H, drho, dkap = _coefficients_float64(F, i0, i1, K, o)
        Ho = o["Ho"].double()
        ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(H.abs().clamp_min(1e-30))))
        err = (Ho - H).abs()
        assert bool((err <= ulp + 1e-30).all()), f"Ho off by {(err / ulp).max().item():.2f} bf16 ulps"
        torch.testing.assert_close(o["drho_part"].double().sum(2), drho, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(o["dkap_part"].double().sum(1), dkap, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dims", [DIMS, (32, 64)])
def test_two_x_torch_rule_bf16(gpu, tc, dims):
    # loss, levels and both gradients: tempokern's error against the float64 reference at most twice plain
    # torch's own error in bfloat16 (plus 4 eps for outputs torch happens to get exact)
    q, d, _, sp = make(96, 64, spans="random", seed=8)
    kw = dict(temperature=0.1, symmetric=True, level_w=LW[-len(dims):])
    exact = run_both(q, d, None, sp, dims, **kw)[1]
    low = [t.to(torch.bfloat16) for t in (q, d)]
    plain = run_both(*low, None, sp, dims, **kw)[1]
    got = run_both(low[0].to(gpu), low[1].to(gpu), None, {k: tuple(t.to(gpu) for t in v) for k, v in sp.items()},
                   dims, **kw)[0]
    eps = torch.finfo(torch.bfloat16).eps
    for k, (f, p, e) in enumerate(zip([got[0], got[1], *got[2]], [plain[0], plain[1], *plain[2]],
                                      [exact[0], exact[1], *exact[2]])):
        ef = (f.double().cpu() - e.double()).abs().max().item()
        et = (p.double() - e.double()).abs().max().item()
        assert ef <= 2 * et + 4 * eps, f"output {k}: tempokern {ef:.2e} vs torch {et:.2e}"
    if gpu.type == "cpu":
        assert {x[0] for x in tc["launches"]} == {"fwd", "bwd"}


@pytest.mark.parametrize("sms", [132, 108, 58, 1])
def test_grid_at_other_sm_counts(gpu, tc, monkeypatch, sms):
    patch_sm_count(monkeypatch, lambda device: sms)
    q, d, sp = bf16_inputs(gpu, 200, 64, Bd=200, spans="random", seed=sms)
    loss = tempokern.matryoshka_infonce(q, d, DIMS, temperature=0.1, **sp)
    lr = ref(q.double().cpu(), d.double().cpu(), DIMS, temperature=0.1,
             **{k: tuple(t.cpu() for t in v) for k, v in sp.items()})
    torch.testing.assert_close(loss.double().cpu(), lr, rtol=2e-6, atol=1e-6)
    if gpu.type == "cpu":
        nsplit, tps = tc["launches"][0][4]
        ntiles, nrb = -(-200 // 64), -(-200 // 64)
        assert nsplit * tps >= ntiles > (nsplit - 1) * tps
        assert nsplit * nrb >= min(mb.TC_BLOCKS_PER_SM * sms, ntiles * nrb)


@pytest.mark.parametrize("tile", ["64x64", "128x64", "128x128"])
def test_does_not_depend_on_thread_order(cuda_emu, monkeypatch, tile):
    # seeded thread orders: a missing barrier around the shared score tiles, the operand stages (which the
    # backward's top-level tile overlays at 64 rows) or the column vectors would change the results
    force_tile(monkeypatch, tile)
    monkeypatch.setenv("TEMPOKERN_EXPERIMENTAL", "mrl_tc")

    def run():
        q, d, sp = bf16_inputs("cpu", 70, 64, spans="random", seed=5)
        q.requires_grad_()
        d.requires_grad_()
        loss = tempokern.matryoshka_infonce(q, d, DIMS, temperature=0.1, symmetric=True, **sp)
        return [loss.detach(), *torch.autograd.grad(loss, (q, d))]
    outs = by_thread_order(cuda_emu, run)
    for o in outs[1:]:
        for a, b in zip(outs[0], o):
            assert torch.equal(a, b)


def test_levels_up_to_the_top_weighted_one_and_zero_weights(gpu, tc):
    q, d, sp = bf16_inputs(gpu, 70, 64, spans="random", seed=9)
    qa, da = q.clone().requires_grad_(), d.clone().requires_grad_()
    loss = tempokern.matryoshka_infonce(qa, da, DIMS, temperature=0.1, weights=(1.0, 0.5, 0.0), **sp)
    ga = torch.autograd.grad(loss, (qa, da))
    qr, dr = q.double().cpu().requires_grad_(), d.double().cpu().requires_grad_()
    lr = ref(qr, dr, DIMS, temperature=0.1, weights=(1.0, 0.5, 0.0), **{k: tuple(t.cpu() for t in v) for k, v in sp.items()})
    gr = torch.autograd.grad(lr, (qr, dr))
    torch.testing.assert_close(loss.double().cpu(), lr, rtol=2e-6, atol=1e-6)
    for a, b in zip(ga, gr):
        torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=2e-2 * b.abs().max().item())
    if gpu.type == "cpu":
        assert [x[3] for x in tc["launches"] if x[0] == "bwd"] == [2]  # the 64 level has weight 0: 2 levels
        tc["launches"].clear()
    qz = q.clone().requires_grad_()
    lz = tempokern.matryoshka_infonce(qz, d, DIMS, temperature=0.1, weights=(0.0, 0.0, 0.0), **sp)
    (gz,) = torch.autograd.grad(lz, (qz,))
    assert float(lz.detach()) == 0.0 and not bool(gz.any())
    if gpu.type == "cpu":
        assert [x[0] for x in tc["launches"]] == ["fwd"]


@pytest.mark.parametrize("case", ["float32", "dims", "extra_neg", "bias", "not enabled"])
def test_calls_the_tensor_cores_do_not_take(gpu, tc, monkeypatch, case):
    q, d, sp = bf16_inputs(gpu, 40, 64, spans="random", seed=11)
    dims, kw = DIMS, {}
    if case == "float32":
        q, d = q.float(), d.float()
    elif case == "dims":
        dims = (8, 64)
    elif case == "extra_neg":
        kw["extra_neg"] = d[:7].clone()
    elif case == "bias":
        kw["bias"] = tuple(t.to(gpu) for t in make_bias(40, 40, dtype=torch.float32))
    with dispatch.use() if case == "not enabled" else dispatch.use("mrl_tc"):
        loss = tempokern.matryoshka_infonce(q, d, dims, temperature=0.1, **sp, **kw)
    assert torch.isfinite(loss)
    if gpu.type == "cpu":
        assert not tc["launches"]


def test_shared_memory_limit_caps_the_levels(cuda_emu, tc, monkeypatch):
    # sm_86 / sm_89: 99 KB per block hold the backward of 4 levels; a 5-level call takes the levels path
    from _emu_support import cuda_emulator
    monkeypatch.setenv("TEMPOKERN_EMU_SMEM_OPTIN", "101376")
    q, d, sp = bf16_inputs("cpu", 40, 80, spans="random", seed=12)
    with cuda_emulator(cuda_emu):
        assert mb.tc_max_levels(q) == 4
        tempokern.matryoshka_infonce(q, d, (16, 32, 48, 64), temperature=0.1, **sp)
        assert len(tc["launches"]) == 1 and tc["levels"] == 0
        tempokern.matryoshka_infonce(q, d, (16, 32, 48, 64, 80), temperature=0.1, **sp)
        assert len(tc["launches"]) == 1 and tc["levels"] == 5
    monkeypatch.delenv("TEMPOKERN_EMU_SMEM_OPTIN")
    with cuda_emulator(cuda_emu):  # the emulated arch's own limit again: 8 levels on an H100 or A100, 4 on sm_86
        optin = mb.kernels().mrl_tc_smem_optin(0)
        assert mb.tc_max_levels(q) == (8 if optin >= 160 * 1024 else 4)


def test_pre_ampere_gpus_take_the_other_paths(cuda_emu, tc, monkeypatch):
    # sm_75 (a T4): no bf16 wmma; the kernels refuse the device and the calls take the levels path, never raising
    from _emu_support import cuda_emulator
    monkeypatch.setenv("TEMPOKERN_EMU_ARCH", "75")
    q, d, sp = bf16_inputs("cpu", 40, 64, spans="random", seed=13)
    with cuda_emulator(cuda_emu):
        assert not mb.tc_supported(q)
        loss = tempokern.matryoshka_infonce(q, d, DIMS, temperature=0.1, **sp)
    assert not tc["launches"] and tc["levels"] == len(DIMS)
    lr = ref(q.double(), d.double(), DIMS, temperature=0.1, **sp)
    torch.testing.assert_close(loss.double(), lr, rtol=0, atol=2e-2 * lr.abs().item())
    for arch, ok in (("80", True), ("86", True), ("89", True), ("90", True), ("75", False)):
        monkeypatch.setenv("TEMPOKERN_EMU_ARCH", arch)
        with cuda_emulator(cuda_emu):
            assert mb.tc_supported(q) == ok


def test_kernel_refuses_pre_ampere_devices(cuda_emu, monkeypatch):
    from _emu_support import cuda_emulator
    q = torch.zeros(64, 40, dtype=torch.bfloat16)
    f = torch.zeros(64, dtype=torch.float32)
    i = torch.zeros(64, dtype=torch.int32)
    u = torch.zeros(64, dtype=torch.uint8)
    out = torch.zeros(1, 64, 1, 2)
    p = {k: t.data_ptr() for k, t in dict(q=q, d=q, rho=f, kap=f, q_lo=i, q_hi=i, d_lo=i, d_hi=i, row_none=u,
                                          col_none=u, row_part=out).items()}
    sizes = [64, 64, 0, 64, 40, 40, 64, 64, 0, 0, 1, 1, 0, 64, 64]
    bf = mb.DTYPE_CODES[torch.bfloat16]
    monkeypatch.setenv("TEMPOKERN_EMU_ARCH", "75")
    with cuda_emulator(cuda_emu):
        with pytest.raises(RuntimeError, match="compute capability 8.0"):
            mb.kernels().mrl_tc_launch("fwd", 0, 0, bf, sizes, [0, 32], 1.0, p)
        monkeypatch.setenv("TEMPOKERN_EMU_ARCH", "80")
        mb.kernels().mrl_tc_launch("fwd", 0, 0, bf, sizes, [0, 32], 1.0, p)  # runs


def test_kernel_rejects_what_it_cannot_run(cuda_emu):
    from _emu_support import cuda_emulator
    q = torch.zeros(64, 40, dtype=torch.bfloat16)
    f = torch.zeros(64, dtype=torch.float32)
    i = torch.zeros(64, dtype=torch.int32)
    u = torch.zeros(64, dtype=torch.uint8)
    out = torch.zeros(1, 64, 1, 2)
    p = {k: t.data_ptr() for k, t in dict(q=q, d=q, rho=f, kap=f, q_lo=i, q_hi=i, d_lo=i, d_hi=i, row_none=u,
                                          col_none=u, row_part=out).items()}
    sizes = [64, 64, 0, 64, 40, 40, 64, 64, 0, 0, 1, 1, 0, 64, 64]
    bf = mb.DTYPE_CODES[torch.bfloat16]
    with cuda_emulator(cuda_emu):
        k = mb.kernels()
        k.mrl_tc_launch("fwd", 0, 0, bf, sizes, [0, 32], 1.0, p)  # runs
        for seg, msg in (([0, 24], "multiples of 16"), ([0, 48], "cover the top level"), ([0, 16, 16], "increase")):
            with pytest.raises(RuntimeError, match=msg):
                k.mrl_tc_launch("fwd", 0, 0, bf, sizes, seg, 1.0, p)
        with pytest.raises(RuntimeError, match="must be bf16"):
            k.mrl_tc_launch("fwd", 0, 0, mb.DTYPE_CODES[torch.float32], sizes, [0, 32], 1.0, p)
        with pytest.raises(RuntimeError, match="column splits"):
            k.mrl_tc_launch("fwd", 0, 0, bf, sizes[:10] + [2, 1, 0, 64, 64], [0, 32], 1.0, p)
        with pytest.raises(RuntimeError, match="tile_rows"):
            k.mrl_tc_launch("fwd", 0, 0, bf, sizes[:13] + [96, 64], [0, 32], 1.0, p)
        with pytest.raises(RuntimeError, match="tile_cols"):
            k.mrl_tc_launch("fwd", 0, 0, bf, sizes[:13] + [64, 128], [0, 32], 1.0, p)
        with pytest.raises(ValueError, match="15 or 17 sizes"):
            k.mrl_tc_launch("fwd", 0, 0, bf, sizes[:14], [0, 32], 1.0, p)
        with pytest.raises(ValueError, match="unknown mrl_tc op"):
            k.mrl_tc_launch("bwd_all", 0, 0, bf, sizes, [0, 32], 1.0, p)
        with pytest.raises(RuntimeError, match="backward"):
            k.mrl_tc_launch("bwd", 0, 0, bf, sizes, [0, 32], 1.0, p)


@pytest.mark.parametrize("row_w,col_w", [(0.5, 0.5), (1.0, 0.0)])
def test_opcheck_on_the_tensor_core_path(cuda_emu, tc, row_w, col_w):
    # the op with bf16_operands=True (float32 inputs holding bf16 values, as matryoshka_partial passes them)
    from _emu_support import cuda_emulator
    from tempokern._ops.matryoshka_infonce import inverse_prefix_norms
    q, d, _ = bf16_inputs("cpu", 40, 32, seed=21)
    q, d = q.float(), d.float()
    ids = torch.arange(40)
    dims = [16, 32]
    rho, kap = (inverse_prefix_norms(x, dims) for x in (q, d))
    args = (q.requires_grad_(), d.requires_grad_(), None, rho.requires_grad_(), kap.requires_grad_(), None, ids,
            ids, ids, ids, None, [0, 16, 32], [1.0, 0.5], 10.0, row_w, col_w, 0, True, True, True)
    with cuda_emulator(cuda_emu):
        torch.library.opcheck(torch.ops.tempokern.matryoshka_infonce.default, args)
    assert tc["launches"]


def test_bf16_inputs_skip_the_value_check_and_the_sorts(gpu, tc, monkeypatch):
    # bf16 callers: the op knows its float32 copies are bf16 values (no _exact_half pass and device sync), and
    # the spans / fallback flags come from the prep kernel (no torch.sort)
    seen = []
    monkeypatch.setattr(mb, "_exact_half", lambda ts: seen.append("check"))
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: seen.append("sort") or real_sort(*a, **k))
    q, d, sp = bf16_inputs(gpu, 70, 64, spans="random", seed=22)
    q.requires_grad_()
    d.requires_grad_()
    loss = tempokern.matryoshka_infonce(q, d, DIMS, temperature=0.1, symmetric=True, **sp)
    torch.autograd.grad(loss, (q, d))
    assert seen == []
    if gpu.type == "cpu":
        assert {x[0] for x in tc["launches"]} == {"fwd", "bwd"}
