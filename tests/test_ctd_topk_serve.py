"""ctd_topk's serve path (Q <= 16 on CUDA: prep + one scan of the gallery + two merge launches, no host
sync) against tempokern.reference.ctd_topk, on the CUDA emulator (and a GPU where there is one)."""
import pytest
import torch
from _emu_support import patch_sm_count  # noqa: E402

import tempokern
import tempokern._ops.ctd_topk as ops
from tempokern.reference import ctd_topk as ref_topk
from test_ctd_topk import check_against_reference, make_bias


@pytest.fixture
def paths(monkeypatch):
    """Records which CUDA driver ran: 'serve' (the new kernels) or 'old' (scan_rows / cuBLAS + select)."""
    seen = []
    real_serve, real_old = ops._serve_topk, ops._cuda_topk

    def serve(*a, **k):
        seen.append("serve")
        return real_serve(*a, **k)

    def old(*a, **k):
        seen.append("old")
        return real_old(*a, **k)
    monkeypatch.setattr(ops, "_serve_topk", serve)
    monkeypatch.setattr(ops, "_cuda_topk", old)
    monkeypatch.setattr(ops, "_SERVE_MAX_Q", ops._SERVE_KERNEL_MAX_Q)  # the kernels' whole range (dispatch: 4)
    return seen


def small_geometry(monkeypatch, sms=58, merge_entries=None):
    """Slices of >= 32 rows and small first-stage merges, so that test-sized galleries run several warps,
    CTAs and both merge stages; sm_count as on another GPU."""
    patch_sm_count(monkeypatch, lambda device: sms)
    monkeypatch.setattr(ops, "_MIN_SLICE", 32)
    if merge_entries is not None:
        monkeypatch.setattr(ops, "_MERGE_ENTRIES", merge_entries)


def bias_for(mode, Q, N, dtype, device, seed, scale=4.0):
    bdt = torch.float64 if dtype == torch.float64 else torch.float32
    if mode == "exact":
        return make_bias(Q, N, scale=scale, spread=1.5, dtype=bdt, device=device, seed=seed)
    if mode == "table":
        gen = torch.Generator().manual_seed(seed)
        return ((torch.rand(Q, generator=gen) * 1.5).to(bdt).to(device),
                (torch.rand(N, generator=gen) * 1.5).to(bdt).to(device),
                (torch.randn(33, generator=gen) * 3).to(device))
    return None


CASES = [(1, torch.float32, 1e-4), (1, torch.bfloat16, 1e-3), (1, torch.float16, 1e-3), (1, torch.float64, 1e-9),
         (2, torch.float32, 1e-4), (2, torch.bfloat16, 1e-3), (16, torch.float32, 1e-4), (16, torch.bfloat16, 1e-3),
         (7, torch.float16, 1e-3), (16, torch.float64, 1e-9)]


@pytest.mark.parametrize("mode", ["none", "exact", "table"])
@pytest.mark.parametrize("Q,dtype,atol", CASES)
def test_serve_matches_reference(gpu, paths, monkeypatch, Q, dtype, atol, mode):
    small_geometry(monkeypatch, merge_entries=64)
    torch.manual_seed(Q)
    N, H = 900, 56   # H * sizeof: 16-byte pieces for every dtype (a float64 row: 28 pieces)
    q, g = torch.randn(Q, H, device=gpu).to(dtype), torch.randn(N, H, device=gpu).to(dtype)
    bias = bias_for(mode, Q, N, dtype, gpu, seed=Q + len(mode))
    ex = torch.randint(-1, N, (Q, 3), device=gpu)
    check_against_reference(q, g, 9, atol=atol * 4 if mode != "none" else atol, bias=bias, exclude=ex,
                            temperature=0.3)
    assert paths == ["serve"]


@pytest.mark.parametrize("sms", [132, 108, 58])
def test_serve_at_sm_counts(gpu, paths, monkeypatch, sms):
    # the grid and the slices follow the SM count; several merge groups at every count
    small_geometry(monkeypatch, sms=sms, merge_entries=40)
    torch.manual_seed(sms)
    Q, N, H = 3, 2100, 24
    q, g = torch.randn(Q, H, device=gpu), torch.randn(N, H, device=gpu)
    bias = bias_for("exact", Q, N, torch.float32, gpu, seed=sms, scale=3.0)
    ex = torch.randint(-1, N, (Q, 5), device=gpu)
    check_against_reference(q, g, 13, atol=4e-4, bias=bias, exclude=ex, temperature=0.7)
    assert paths == ["serve"]


@pytest.mark.parametrize("Q", [1, 16])
def test_serve_ties_exclude_and_k_up_to_the_limit(gpu, paths, monkeypatch, Q):
    # integer data: exact scores, many ties, which go to the lower gallery index across lanes, warps,
    # slices and both merge stages; k up to N = 1,000 (within _CUDA_MAX_K) and exclusion leaving < k rows
    small_geometry(monkeypatch, merge_entries=64)
    torch.manual_seed(Q)
    N = 1000
    q = torch.randint(-1, 2, (Q, 5), device=gpu).float()
    g = torch.randint(-1, 2, (N, 5), device=gpu).float()
    ex = torch.randint(-1, N, (Q, 6), device=gpu)
    for k in ((1, 10, 100, N) if Q == 1 else (1, 10, 100)):
        v, i = tempokern.ctd_topk(q, g, k, exclude=ex)
        rv, ri = ref_topk(q, g, k, exclude=ex)
        assert torch.equal(v, rv) and torch.equal(i, ri), k
    if Q == 1:
        assert bool((i[:, -1] == -1).any())   # k = N with exclusions: missing slots are (-inf, -1)
        g2 = torch.randint(-1, 2, (ops._CUDA_MAX_K + 3, 5), device=gpu).float()
        v, i = tempokern.ctd_topk(q, g2, ops._CUDA_MAX_K)   # k at the kernels' limit
        rv, ri = ref_topk(q, g2, ops._CUDA_MAX_K)
        assert torch.equal(v, rv) and torch.equal(i, ri)
    assert set(paths) == {"serve"}


def test_serve_table_ties_by_index(gpu, paths):
    q = torch.zeros(2, 3, device=gpu)
    g = torch.zeros(300, 3, device=gpu)
    u_q, u_g = torch.zeros(2, device=gpu), torch.zeros(300, device=gpu)
    u_g[100:110] = 0.5
    table = torch.linspace(-1, 1, 5, device=gpu)
    v, i = tempokern.ctd_topk(q, g, 12, bias=(u_q, u_g, table))
    rv, ri = ref_topk(q, g, 12, bias=(u_q, u_g, table))
    assert torch.equal(i, ri) and torch.equal(v, rv)
    assert i[0].tolist() == list(range(100, 110)) + [0, 1]
    assert paths == ["serve"]


@pytest.mark.parametrize("Q", [1, 5])
def test_serve_pruning_is_exact(gpu, paths, monkeypatch, Q):
    # a bias that reorders only near-ties (small scale: most pairs pruned by the in-kernel bound) and one
    # that decides everything (large scale); u beyond [0, 1] so that the clamped ends are used too
    small_geometry(monkeypatch)
    torch.manual_seed(21 + Q)
    N, H = 1200, 16
    q, g = torch.randn(Q, H, device=gpu), torch.randn(N, H, device=gpu)
    for scale in (0.02, 50.0):
        bias = make_bias(Q, N, scale=scale, spread=2.5, device=gpu, seed=22 + Q)
        check_against_reference(q, g, 7, atol=1e-4 * max(1.0, scale), bias=bias, temperature=0.5)
    assert paths == ["serve", "serve"]


@pytest.mark.parametrize("hidden,D", [(5, 7), (1, 1), (17, 2), (8, 64)])
def test_serve_odd_mlp_sizes(gpu, paths, monkeypatch, hidden, D):
    small_geometry(monkeypatch)
    torch.manual_seed(hidden)
    Q, N, H = 2, 300, 16
    q, g = torch.randn(Q, H, device=gpu), torch.randn(N, H, device=gpu)
    bias = make_bias(Q, N, scale=5.0, hidden=hidden, D=D, seed=3, device=gpu)
    check_against_reference(q, g, 4, atol=1e-3, bias=bias)
    assert paths == ["serve"]


@pytest.mark.parametrize("H", [1, 7, 33])
def test_serve_unaligned_rows(gpu, paths, monkeypatch, H):
    # row strides that are not a multiple of 16 bytes, and H below one 16-byte piece: scalar loads
    small_geometry(monkeypatch)
    torch.manual_seed(H)
    q = torch.randn(3, H, device=gpu)
    g = torch.randn(400, H + 1, device=gpu)[:, 1:]
    check_against_reference(q, g, 6, atol=1e-4)
    check_against_reference(q[:1], g, 400, atol=1e-4)   # k = N
    assert paths == ["serve", "serve"]


def test_serve_reads_no_value_on_the_host(gpu, paths, monkeypatch):
    # no host sync: with b2 / scale as tensors nothing is read back (.item() / .tolist()) on the serve path
    small_geometry(monkeypatch)
    torch.manual_seed(5)
    Q, N, H = 4, 500, 16
    q, g = torch.randn(Q, H, device=gpu), torch.randn(N, H, device=gpu)
    bias = make_bias(Q, N, scale=2.0, device=gpu, seed=6)
    want = ref_topk(q, g, 5, bias=bias, temperature=0.5)

    def no_read(*a, **k):
        raise AssertionError("a value was read back on the host")
    monkeypatch.setattr(torch.Tensor, "item", no_read)
    monkeypatch.setattr(torch.Tensor, "tolist", no_read)
    got = tempokern.ctd_topk(q, g, 5, bias=bias, temperature=0.5)
    monkeypatch.undo()
    torch.testing.assert_close(got[0], want[0], atol=2e-4, rtol=0)
    assert torch.equal(got[1], want[1])
    assert paths == ["serve"]


def test_serve_thread_order_does_not_matter(gpu, paths, monkeypatch, request):
    if torch.device(gpu).type != "cpu":
        pytest.skip("thread-order shuffles are an emulator feature")
    emu = request.getfixturevalue("cuda_emu")
    small_geometry(monkeypatch, merge_entries=40)
    torch.manual_seed(9)
    Q, N, H = 6, 700, 12
    q, g = torch.randn(Q, H), torch.randn(N, H)
    q[:, :] = q.round()
    g[:, :] = g.round()      # many exact ties
    bias = bias_for("table", Q, N, torch.float32, "cpu", seed=9)
    ex = torch.randint(-1, N, (Q, 4))
    outs = []
    try:
        for s in (1, 2, 3):
            emu.emu_set_seed(s)
            outs.append(tempokern.ctd_topk(q, g, 20, bias=bias, exclude=ex))
    finally:
        emu.emu_set_seed(0)
    rv, ri = ref_topk(q, g, 20, bias=bias, exclude=ex)
    for v, i in outs:
        assert torch.equal(v, outs[0][0]) and torch.equal(i, outs[0][1])
    torch.testing.assert_close(outs[0][0], rv, atol=1e-5, rtol=0)
    assert paths == ["serve"] * 3


def test_large_q_and_wide_rows_keep_the_other_kernels(gpu, paths, monkeypatch):
    small_geometry(monkeypatch)
    torch.manual_seed(3)
    N, H = 600, 16
    q, g = torch.randn(17, H, device=gpu), torch.randn(N, H, device=gpu)
    bias = bias_for("exact", 17, N, torch.float32, gpu, seed=4)
    check_against_reference(q, g, 5, atol=4e-4, bias=bias)          # Q = 17: the old path
    assert paths == ["old"]
    b2 = (bias[0][:2],) + bias[1:]
    check_against_reference(q[:2], g, 5, atol=4e-4, bias=b2)        # Q = 2: serve
    assert paths == ["old", "serve"]
    monkeypatch.setattr(ops, "_SERVE_SMEM", 0)                      # a serve tile that does not fit: scan_rows
    check_against_reference(q[:2], g, 5, atol=4e-4, bias=b2)
    assert paths == ["old", "serve", "old"]


def test_default_dispatch_crossover(gpu, paths, monkeypatch):
    # without the fixture's widening: Q <= 4 on the serve kernels, Q = 5 on the previous path (cuBLAS + select),
    # the crossover measured on the H100
    monkeypatch.setattr(ops, "_SERVE_MAX_Q", 4)
    small_geometry(monkeypatch)
    torch.manual_seed(6)
    g = torch.randn(300, 16, device=gpu)
    for Q in (1, 4, 5):
        check_against_reference(torch.randn(Q, 16, device=gpu), g, 5, atol=1e-4)
    assert paths == ["serve", "serve", "old"]


def test_serve_falls_back_when_queries_do_not_fit(gpu, paths, monkeypatch):
    # Q * H beyond the serve kernel's shared memory: the old path
    monkeypatch.setattr(ops, "_SERVE_SMEM", 1024)
    torch.manual_seed(2)
    q, g = torch.randn(3, 64, device=gpu), torch.randn(200, 64, device=gpu)
    check_against_reference(q, g, 5, atol=1e-4)
    assert paths == ["old"]
