"""Fused ctd_topk vs the reference (full matrix + stable sort): indices exactly, values to fp tolerance."""
import pytest
import torch
from _emu_support import patch_sm_count  # noqa: E402

import tempokern
from tempokern.reference import ctd_topk as ref_topk
from tempokern.reference.ctd_topk import ctd_scores

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_bias(Q, N, *, scale=0.7, hidden=32, D=32, spread=1.0, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    u_q = torch.rand(Q, generator=gen) * spread
    u_g = torch.rand(N, generator=gen) * spread
    w1 = torch.randn(hidden, D, generator=gen) * 0.3
    b1 = torch.randn(hidden, generator=gen) * 0.1
    w2 = torch.randn(1, hidden, generator=gen) * 0.3
    b2 = torch.randn(1, generator=gen)
    sc = torch.tensor(scale)
    return tuple(t.to(dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                 for t in (u_q, u_g, w1, b1, w2, b2, sc))


def check_against_reference(q, g, k, *, atol, **kw):
    """Values match the reference's; indices match exactly wherever the reference's scores are
    separated by more than the tolerance (elsewhere the fused scores must still be the top ones)."""
    v, i = tempokern.ctd_topk(q, g, k, **kw)
    rv, ri = ref_topk(q, g, k, **kw)
    assert v.shape == rv.shape == i.shape and i.dtype == torch.int64
    torch.testing.assert_close(v, rv, atol=atol, rtol=0)
    # sorted descending
    assert bool((v[:, :-1] >= v[:, 1:]).all())
    S = ctd_scores(q, g, temperature=kw.get("temperature", 1.0), bias=kw.get("bias"))
    valid = i >= 0
    torch.testing.assert_close(S.gather(1, i.clamp_min(0))[valid], v[valid], atol=atol, rtol=0)
    # positions whose reference score is clearly apart from both neighbours must agree exactly
    gaps = torch.full_like(rv, float("inf"))
    d = (rv[:, :-1] - rv[:, 1:]).abs()
    gaps[:, :-1] = torch.minimum(gaps[:, :-1], d)
    gaps[:, 1:] = torch.minimum(gaps[:, 1:], d)
    clear = gaps > 4 * atol
    if k < g.shape[0]:  # the last slot also needs a gap to the first excluded score
        nxt = torch.sort(S, dim=1, descending=True).values[:, k] if kw.get("exclude") is None else None
        if nxt is not None:
            clear[:, -1] &= (rv[:, -1] - nxt) > 4 * atol
    assert bool((i[clear] == ri[clear]).all())
    return v, i


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float64, 1e-9),
                                        (torch.float16, 1e-3), (torch.bfloat16, 1e-3)])
@pytest.mark.parametrize("Q,N,H,k", [(1, 1, 1, 1), (7, 97, 33, 5), (13, 1000, 64, 1), (5, 131, 20, 131)])
def test_no_bias(dtype, atol, Q, N, H, k):
    torch.manual_seed(Q * N + H)
    q, g = torch.randn(Q, H).to(dtype), torch.randn(N, H).to(dtype)
    check_against_reference(q, g, k, atol=atol, temperature=0.37)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [0.05, 40.0])  # small: most pairs pruned; large: bias decides
def test_exact_bias(dtype, scale):
    Q, N, H, k = 11, 777, 48, 9
    torch.manual_seed(1)
    q, g = torch.randn(Q, H).to(dtype), torch.randn(N, H).to(dtype)
    bias = make_bias(Q, N, scale=scale, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    check_against_reference(q, g, k, atol=1e-4 * max(1.0, scale), bias=bias, temperature=0.5)


@pytest.mark.parametrize("hidden,D", [(5, 7), (1, 1), (17, 2), (64, 16)])
def test_exact_bias_odd_mlp_sizes(hidden, D):
    Q, N, H = 6, 301, 16
    torch.manual_seed(2)
    q, g = torch.randn(Q, H), torch.randn(N, H)
    bias = make_bias(Q, N, scale=5.0, hidden=hidden, D=D, seed=3)
    check_against_reference(q, g, 4, atol=1e-3, bias=bias)


def test_exact_bias_u_outside_unit_interval():
    # |u_g - u_q| > 1 happens: the clamp must bite exactly like the reference's
    Q, N, H = 9, 400, 8
    torch.manual_seed(4)
    q, g = torch.randn(Q, H) * 0.01, torch.randn(N, H) * 0.01
    bias = make_bias(Q, N, scale=3.0, spread=4.0, seed=5)
    bias = (bias[0] - 1.5, bias[1] - 1.0) + bias[2:]
    check_against_reference(q, g, 25, atol=1e-4, bias=bias)


@pytest.mark.parametrize("P", [2, 3, 257])
def test_table_bias(P):
    Q, N, H = 10, 555, 24
    torch.manual_seed(P)
    q, g = torch.randn(Q, H), torch.randn(N, H)
    u_q, u_g = torch.rand(Q) * 3 - 1, torch.rand(N) * 3 - 1
    table = torch.randn(P) * 4
    check_against_reference(q, g, 12, atol=1e-4, bias=(u_q, u_g, table))


def test_table_object_with_values_attribute():
    class Table:  # duck-typed like tempokern.nn.BiasTable
        def __init__(self, v):
            self.values = v
    Q, N = 3, 50
    q, g = torch.randn(Q, 8), torch.randn(N, 8)
    u_q, u_g, vals = torch.rand(Q), torch.rand(N), torch.randn(33)
    a = tempokern.ctd_topk(q, g, 5, bias=(u_q, u_g, Table(vals)))
    b = tempokern.ctd_topk(q, g, 5, bias=(u_q, u_g, vals))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_duplicate_scores_break_ties_by_lower_index():
    # integer data: every dot product is exact, many equal scores
    torch.manual_seed(6)
    Q, N, H = 17, 1003, 4
    q = torch.randint(-1, 2, (Q, H)).float()
    g = torch.randint(-1, 2, (N, H)).float()
    for k in (1, 10, 200, N):
        v, i = tempokern.ctd_topk(q, g, k)
        rv, ri = ref_topk(q, g, k)
        assert torch.equal(v, rv) and torch.equal(i, ri)
        # the rule itself, independent of the reference: equal scores come with ascending ids
        same = v[:, 1:] == v[:, :-1]
        assert bool((i[:, 1:][same] > i[:, :-1][same]).all())


def test_all_equal_gallery():
    q = torch.ones(3, 5)
    g = torch.ones(300, 5)
    v, i = tempokern.ctd_topk(q, g, 7)
    assert torch.equal(i, torch.arange(7).expand(3, 7))


def test_ties_with_table_bias_are_by_index():
    q = torch.zeros(4, 3)
    g = torch.zeros(50, 3)
    u_q, u_g = torch.zeros(4), torch.zeros(50)
    u_g[10:20] = 0.5  # a higher bias plateau for ids 10..19
    table = torch.linspace(-1, 1, 5)  # monotone in delta
    v, i = tempokern.ctd_topk(q, g, 12, bias=(u_q, u_g, table))
    rv, ri = ref_topk(q, g, 12, bias=(u_q, u_g, table))
    assert torch.equal(i, ri)
    assert i[0].tolist() == list(range(10, 20)) + [0, 1]


@pytest.mark.parametrize("N", [1, 63, 64, 65, 1000, 4099])
def test_n_not_multiple_of_chunks(N):
    torch.manual_seed(N)
    q, g = torch.randn(8, 31), torch.randn(N, 31)
    check_against_reference(q, g, min(N, 6), atol=1e-4)
    check_against_reference(q, g, N, atol=1e-4)


def test_exclude():
    torch.manual_seed(7)
    Q, N = 6, 300
    q, g = torch.randn(Q, 16), torch.randn(N, 16)
    _, top = ref_topk(q, g, 5)
    ex = torch.full((Q, 4), -1, dtype=torch.int64)
    ex[:, 0] = top[:, 0]          # drop the best
    ex[:, 2] = top[:, 3]
    ex[1, 3] = N - 1
    ex[2, 1] = top[2, 0]          # duplicates are fine
    v, i = check_against_reference(q, g, 5, atol=1e-4, exclude=ex)
    for r in range(Q):
        assert not set(i[r].tolist()) & set(ex[r][ex[r] >= 0].tolist())
    # int32 exclude works too
    v2, i2 = tempokern.ctd_topk(q, g, 5, exclude=ex.int())
    assert torch.equal(i, i2)


def test_exclude_leaves_fewer_than_k():
    q, g = torch.randn(2, 4), torch.randn(5, 4)
    ex = torch.tensor([[0, 1, 2, -1], [-1, -1, -1, -1]])
    v, i = tempokern.ctd_topk(q, g, 5, exclude=ex)
    rv, ri = ref_topk(q, g, 5, exclude=ex)
    assert torch.equal(i, ri)
    assert i[0, 2:].tolist() == [-1, -1, -1] and bool(torch.isinf(v[0, 2:]).all())
    assert sorted(i[0, :2].tolist()) == [3, 4] and sorted(i[1].tolist()) == [0, 1, 2, 3, 4]


def test_many_queries_threads_merge():
    # more rows than one thread's slice: the per-thread lists merge with the tie rule
    torch.manual_seed(8)
    q = torch.randint(-2, 3, (40, 6)).float()
    g = torch.randint(-2, 3, (5000, 6)).float()
    v, i = tempokern.ctd_topk(q, g, 50)
    rv, ri = ref_topk(q, g, 50)
    assert torch.equal(v, rv) and torch.equal(i, ri)


def test_noncontiguous_and_empty_queries():
    torch.manual_seed(9)
    q = torch.randn(16, 10)[::2]
    g = torch.randn(40, 20)[:, ::2]
    check_against_reference(q, g, 3, atol=1e-4)
    v, i = tempokern.ctd_topk(torch.randn(0, 10), g, 3)
    assert v.shape == (0, 3) and i.shape == (0, 3)


def test_bad_inputs():
    q, g = torch.randn(3, 8), torch.randn(20, 8)
    with pytest.raises(ValueError, match="embedding size H"):
        tempokern.ctd_topk(q, torch.randn(20, 9), 2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        tempokern.ctd_topk(q, g, 0)
    with pytest.raises(ValueError, match="k must be >= 1"):
        tempokern.ctd_topk(q, g, -3)
    with pytest.raises(ValueError, match="k must be <= the gallery size"):
        tempokern.ctd_topk(q, g, 21)
    with pytest.raises(TypeError, match="k must be an int"):
        tempokern.ctd_topk(q, g, 2.0)
    with pytest.raises(TypeError, match="same dtype"):
        tempokern.ctd_topk(q, g.double(), 2)
    with pytest.raises(ValueError, match="temperature"):
        tempokern.ctd_topk(q, g, 2, temperature=0.0)
    with pytest.raises(ValueError, match="q must be 2-D"):
        tempokern.ctd_topk(q[0], g, 2)
    with pytest.raises(TypeError, match="q must be float32"):
        tempokern.ctd_topk(q.long(), g.long(), 2)
    u_q, u_g = torch.rand(3), torch.rand(20)
    with pytest.raises(ValueError, match=r"bias u_q must have shape \(3,\)"):
        tempokern.ctd_topk(q, g, 2, bias=(torch.rand(4), u_g, torch.randn(9)))
    with pytest.raises(ValueError, match=r"bias u_g must have shape \(20,\)"):
        tempokern.ctd_topk(q, g, 2, bias=(u_q, torch.rand(19), torch.randn(9)))
    with pytest.raises(TypeError, match="bias must be None"):
        tempokern.ctd_topk(q, g, 2, bias=(u_q, u_g))
    with pytest.raises(ValueError, match="at least 2 points"):
        tempokern.ctd_topk(q, g, 2, bias=(u_q, u_g, torch.randn(1)))
    b = make_bias(3, 20)
    with pytest.raises(ValueError, match="bias b1"):
        tempokern.ctd_topk(q, g, 2, bias=b[:3] + (torch.randn(5),) + b[4:])
    with pytest.raises(ValueError, match="bias w2"):
        tempokern.ctd_topk(q, g, 2, bias=b[:4] + (torch.randn(1, 7),) + b[5:])
    with pytest.raises(ValueError, match="bias scale"):
        tempokern.ctd_topk(q, g, 2, bias=b[:6] + (torch.ones(2),))
    with pytest.raises(ValueError, match=r"exclude must have shape \(Q=3"):
        tempokern.ctd_topk(q, g, 2, exclude=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="exclude must be an integer"):
        tempokern.ctd_topk(q, g, 2, exclude=torch.zeros(3, 1))
    with pytest.raises(ValueError, match="< -1"):
        tempokern.ctd_topk(q, g, 2, exclude=torch.full((3, 1), -2))


def test_memory_stays_linear_in_n():
    # Peak resident memory of a fresh process (ru_maxrss), which sees the kernel's own std::vector /
    # aligned buffers as well as torch's: the (Q, N) score matrix would be 51 MB here, the reference's
    # sort doubles that; the fused op's buffers are (Q, max(2k, k + 64)) candidates per thread plus one
    # gallery chunk per thread.
    from conftest import run_python
    code = """
import resource, torch, tempokern
torch.set_num_threads(2)
q, g = torch.randn(64, 16), torch.randn(200_000, 16)
tempokern.ctd_topk(q[:2], g[:100], 10)          # load and warm up everything but the big call
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
v, i = tempokern.ctd_topk(q, g, 10)
fused = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(fused)
"""
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    grew_kib = int(r.stdout.split()[-1])
    assert grew_kib * 1024 < 64 * 200_000 * 4 // 4, grew_kib   # < a quarter of the score matrix


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-3), (torch.float16, 2e-3), (torch.bfloat16, 2e-3),
                                        (torch.float64, 1e-9)])  # float64: the CUDA-core double tile path
@pytest.mark.parametrize("mode", ["none", "exact", "table"])
def test_cuda_matches_reference(gpu, dtype, atol, mode):
    torch.manual_seed(10)
    Q, N, H, k = 70, 3001, 96, 17
    q, g = torch.randn(Q, H, device=gpu).to(dtype), torch.randn(N, H, device=gpu).to(dtype)
    bias = None
    bdt = torch.float64 if dtype == torch.float64 else torch.float32  # the reference's bias follows u's dtype
    if mode == "exact":
        bias = make_bias(Q, N, scale=2.0, dtype=bdt, device=gpu)
    elif mode == "table":
        bias = (torch.rand(Q, device=gpu, dtype=bdt), torch.rand(N, device=gpu, dtype=bdt),
                torch.randn(129, device=gpu))
    check_against_reference(q, g, k, atol=atol, bias=bias, temperature=0.8)


def test_cuda_ties_exclude_and_large_k(gpu):
    q = torch.randint(-1, 2, (33, 4), device=gpu).float()
    g = torch.randint(-1, 2, (2000, 4), device=gpu).float()
    ex = torch.randint(-1, 2000, (33, 7), device=gpu)
    for k in (1, 64, 256, 300, 1024, 1025, 2000):  # > 1024 takes the chunked torch path
        v, i = tempokern.ctd_topk(q, g, k, exclude=ex)
        rv, ri = ref_topk(q, g, k, exclude=ex)
        assert torch.equal(i, ri) and torch.equal(v, rv)


def test_exact_bias_large_u():
    # far from [0, 1] the angle-difference features must keep their digits (computed in double)
    Q, N, H = 5, 300, 8
    torch.manual_seed(12)
    q, g = torch.randn(Q, H) * 0.01, torch.randn(N, H) * 0.01
    bias = make_bias(Q, N, scale=3.0, spread=1.5, seed=13)
    bias = (bias[0] + 100.0, bias[1] + 100.0) + bias[2:]
    check_against_reference(q, g, 20, atol=2e-4, bias=bias)


@pytest.mark.parametrize("bias_kind", ["none", "exact", "exact-clamped", "table"])
def test_rerank_matches_per_candidate_reference(bias_kind):
    # the faiss rerank: each query scores only its own candidate rows (-1 = none, duplicates once)
    from tempokern._ops.ctd_topk import ctd_rerank
    from tempokern.reference.ctd_topk import ctd_rerank as ref_rerank
    torch.manual_seed(14)
    Q, N, H, C = 9, 500, 20, 40
    q, g = torch.randn(Q, H), torch.randn(N, H)
    cand = torch.randint(-1, N, (Q, C))
    cand[:, 1] = cand[:, 0]
    cand[0] = -1  # a query with no candidate at all
    bias = None
    if bias_kind.startswith("exact"):
        bias = make_bias(Q, N, scale=4.0, spread=3.0 if bias_kind == "exact-clamped" else 1.0)
    elif bias_kind == "table":
        bias = (torch.rand(Q), torch.rand(N), torch.randn(65) * 3)
    v, i = ctd_rerank(q, g, cand, 12, temperature=0.5, bias=bias)
    rv, ri = ref_rerank(q, g, cand, 12, temperature=0.5, bias=bias)
    torch.testing.assert_close(v, rv, atol=1e-4, rtol=0)
    assert torch.equal(i, ri)
    assert i[0].tolist() == [-1] * 12
    for r in range(1, Q):
        got = set(i[r][i[r] >= 0].tolist())
        assert got <= set(cand[r].tolist())


def test_rerank_ties_by_lower_row():
    from tempokern._ops.ctd_topk import ctd_rerank
    q = torch.ones(2, 3)
    g = torch.ones(100, 3)
    cand = torch.tensor([[50, 7, 99, 3, 7], [1, 2, 3, 4, 5]])
    v, i = ctd_rerank(q, g, cand, 3)
    assert i.tolist() == [[3, 7, 50], [1, 2, 3]]


def test_opcheck_and_compile():
    q, g = torch.randn(5, 8), torch.randn(40, 8)
    ex = torch.tensor([[-1, 1], [2, 3], [-1, -1], [0, 0], [5, 6]])
    for args in [(q, g, 3, 1.0, 0, None, None, None, None, None, 0.0, 0.0, None, None),
                 (q, g, 3, 0.5, 2, torch.rand(5), torch.rand(40), None, None, None, 0.0, 0.0, torch.randn(9), ex)]:
        torch.library.opcheck(torch.ops.tempokern.ctd_topk.default, args)
    f = torch.compile(lambda a, b: tempokern.ctd_topk(a, b, 3), fullgraph=True)
    assert torch.equal(f(q, g)[1], tempokern.ctd_topk(q, g, 3)[1])


@pytest.mark.parametrize("bias_kind", ["none", "exact", "table"])
def test_chunked_torch_path_matches_reference(bias_kind):
    # the CUDA fallback (k > 1024, 2K > 64); it runs on any device, so it is tested here on CPU. Its bias
    # comes from the fused offset_bias ops, compared with tempokern.reference's full-matrix top-k.
    from tempokern._ops.ctd_topk import _chunked_topk, parse_bias, prepare_exclude
    torch.manual_seed(15)
    Q, N, H = 6, 700, 12
    q = torch.randint(-1, 2, (Q, H)).float()
    g = torch.randint(-1, 2, (N, H)).float()
    bias = None
    if bias_kind == "exact":
        bias = make_bias(Q, N, scale=0.5)
    elif bias_kind == "table":
        bias = (torch.rand(Q), torch.rand(N), torch.randint(-3, 4, (17,)).float())
    ex = torch.randint(-1, N, (Q, 9))
    parsed = parse_bias(bias, Q, N, torch.float32, q.device)
    for k in (1, 300, N):
        v, i = _chunked_topk(q, g, k, 1.0, *parsed, prepare_exclude(ex, Q, q.device))
        rv, ri = ref_topk(q, g, k, bias=bias, exclude=ex)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=0)
        if bias is None:
            assert torch.equal(i, ri)  # integer scores: exact, ties by the lower index
        else:  # the fused bias may differ from the reference's in the last bits: same rows where apart
            S = ctd_scores(q, g, bias=bias)
            S[torch.arange(Q)[:, None].expand_as(ex)[ex >= 0], ex[ex >= 0]] = float("-inf")
            valid = i >= 0
            assert torch.equal(valid, ri >= 0)
            torch.testing.assert_close(S.gather(1, i.clamp_min(0))[valid], rv[valid], atol=1e-5, rtol=0)
            gaps = torch.full_like(rv, float("inf"))
            d = (rv[:, :-1] - rv[:, 1:]).abs()
            gaps[:, :-1] = torch.minimum(gaps[:, :-1], d)
            gaps[:, 1:] = torch.minimum(gaps[:, 1:], d)
            clear = gaps > 1e-4
            assert bool((i[clear] == ri[clear]).all())


def test_query_blocks(monkeypatch):
    # CPU launches go in blocks of queries; a tiny block size exercises the slicing
    import tempokern._ops.ctd_topk as ops
    monkeypatch.setattr(ops, "_CPU_QBLOCK", 4)
    torch.manual_seed(16)
    Q, N = 11, 300
    q, g = torch.randn(Q, 16), torch.randn(N, 16)
    ex = torch.randint(-1, N, (Q, 3))
    check_against_reference(q, g, 7, atol=1e-4, bias=make_bias(Q, N, scale=3.0), exclude=ex)
    check_against_reference(q, g, 7, atol=1e-4, bias=(torch.rand(Q), torch.rand(N), torch.randn(9)))
    from tempokern.reference.ctd_topk import ctd_rerank as ref_rerank
    cand = torch.randint(0, N, (Q, 20))
    v, i = ops.ctd_rerank(q, g, cand, 5)
    rv, ri = ref_rerank(q, g, cand, 5)
    torch.testing.assert_close(v, rv, atol=1e-4, rtol=0)
    assert torch.equal(i, ri)


@cuda
@pytest.mark.cuda
def test_cuda_peak_memory_is_not_q_by_n():
    Q, N, H = 512, 4_000_000, 32  # a score matrix would be 8.2 GB; the design keeps two 256 MiB blocks alive
    q, g = torch.randn(Q, H, device="cuda"), torch.randn(N, H, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    tempokern.ctd_topk(q, g, 10, bias=(torch.rand(Q, device="cuda"), torch.rand(N, device="cuda"),
                                       torch.randn(65, device="cuda")))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 2 * (256 << 20) + (64 << 20), extra  # two score blocks + workspace
    assert extra < Q * N * 4 // 10, extra


@pytest.mark.parametrize("Q", [2, 7, 8, 20])  # < 8 queries: direct row-at-a-time path; else packed tiles
@pytest.mark.parametrize("bias_kind", ["none", "exact", "table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_and_packed_paths(Q, bias_kind, dtype):
    torch.manual_seed(Q)
    N, H = 517, 37
    q, g = torch.randn(Q, H).to(dtype), torch.randn(N, H).to(dtype)
    bias = None
    if bias_kind == "exact":
        bias = make_bias(Q, N, scale=5.0, spread=2.0, seed=Q)
    elif bias_kind == "table":
        bias = (torch.rand(Q) * 2, torch.rand(N) * 2, torch.randn(33) * 5)
    ex = torch.randint(-1, N, (Q, 4))
    check_against_reference(q, g, 13, atol=5e-4, bias=bias, exclude=ex, temperature=0.3)


def test_out_of_range_indices_and_tiny_temperature_raise():
    from tempokern._ops.ctd_topk import ctd_rerank
    q, g = torch.randn(3, 8), torch.randn(20, 8)
    with pytest.raises(IndexError, match=r"exclude .*< N=20"):
        tempokern.ctd_topk(q, g, 2, exclude=torch.tensor([[1], [20], [-1]]))
    with pytest.raises(IndexError, match=r"cand .*< N=20"):
        ctd_rerank(q, g, torch.tensor([[1, 2], [3, 25], [-1, -1]]), 2)
    from tempokern.reference.ctd_topk import ctd_rerank as ref_rerank
    with pytest.raises(IndexError, match="cand"):   # the spec agrees
        ref_rerank(q, g, torch.tensor([[1, 2], [3, 25], [-1, -1]]), 2)
    # 1 / T overflows float32 (the compute dtype of float32/16/bf16 input), not float64
    for dt in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match="temperature .*too small"):
            tempokern.ctd_topk(q.to(dt), g.to(dt), 2, temperature=1e-39)
    with pytest.raises(ValueError, match="temperature .*too small"):
        ctd_rerank(q, g, torch.tensor([[1, 2], [3, 4], [5, 6]]), 2, temperature=1e-39)
    tempokern.ctd_topk(q.double(), g.double(), 2, temperature=1e-39)
    with pytest.raises(ValueError, match="temperature .*too small"):
        tempokern.ctd_topk(q.double(), g.double(), 2, temperature=1e-310)


def test_rerank_reference_by_hand():
    # pin the rerank spec itself with hand-computed scores
    from tempokern.reference.ctd_topk import ctd_rerank as ref_rerank
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    g = torch.tensor([[3.0, 0.0], [1.0, 5.0], [2.0, 2.0], [3.0, -1.0]])
    v, i = ref_rerank(q, g, torch.tensor([[1, 3, 3, -1], [0, -1, -1, -1]]), 3, temperature=0.5)
    assert i.tolist() == [[3, 1, -1], [0, -1, -1]]
    assert v[0, :2].tolist() == [6.0, 2.0] and v[1, 0].item() == 0.0 and bool(torch.isinf(v[0, 2]))


# ---- the CUDA path (cuBLAS score blocks + select kernel, or the one-pass scan for Q <= 4) ----------

def _force_small_blocks(monkeypatch, sms=132, block_bytes=None, qblock=None):
    """Small score blocks, slices and query blocks, so that several chunks, slices, query blocks and the
    merges run on test-sized inputs; sm_count as on another GPU."""
    import tempokern._ops.ctd_topk as ops
    # these tests are about the cuBLAS + select_block and scan_rows kernels: Q <= 4 would take the serve
    # kernels (tested in test_ctd_topk_serve.py); scan_rows takes Q <= 4 where a serve tile does not fit
    monkeypatch.setattr(ops, "_SERVE_MAX_Q", 0)
    patch_sm_count(monkeypatch, lambda device: sms)
    monkeypatch.setattr(ops, "_MIN_CHUNK", 64)
    monkeypatch.setattr(ops, "_MIN_SLICE", 32)
    if block_bytes is not None:
        monkeypatch.setattr(ops, "_BLOCK_BYTES", block_bytes)
    if qblock is not None:
        monkeypatch.setattr(ops, "_QBLOCK", qblock)
    return ops


def _record_blocks(monkeypatch, ops):
    seen = []
    real = ops._score_block

    def rec(qa, gc, acc):
        s = real(qa, gc, acc)
        seen.append(tuple(s.shape))
        return s
    monkeypatch.setattr(ops, "_score_block", rec)
    return seen


# every bias mode at 132 SMs; the other SM counts (other slice boundaries over N) with one mode each: the bias
# reads u_d at each slice's own offset, which the 132-SM slices check in every mode
@pytest.mark.parametrize("sms,mode", [(132, "none"), (132, "exact"), (132, "table"), (108, "exact"), (58, "table")])
def test_cuda_chunks_slices_and_sm_counts(gpu, monkeypatch, sms, mode):
    ops = _force_small_blocks(monkeypatch, sms=sms, block_bytes=40 * 300 * 4, qblock=40)
    seen = _record_blocks(monkeypatch, ops)
    torch.manual_seed(sms)
    Q, N, H, k = 70, 2500, 24, 13
    q, g = torch.randn(Q, H, device=gpu), torch.randn(N, H, device=gpu)
    bias = None
    if mode == "exact":
        bias = make_bias(Q, N, scale=3.0, spread=1.5, device=gpu, seed=sms)
    elif mode == "table":
        bias = (torch.rand(Q, device=gpu) * 2, torch.rand(N, device=gpu) * 2, torch.randn(65, device=gpu) * 3)
    ex = torch.randint(-1, N, (Q, 5), device=gpu)
    check_against_reference(q, g, k, atol=2e-4, bias=bias, exclude=ex, temperature=0.7)
    # two query blocks (40 + 30 rows), each in several chunks, every block within the byte budget
    assert sorted({r for r, _ in seen}) == [30, 40] and len(seen) >= 2 * 7, seen
    assert all(r * c * 4 <= 40 * 300 * 4 for r, c in seen)


@pytest.mark.parametrize("Q", [1, 2, 4])
@pytest.mark.parametrize("mode", ["none", "exact", "table"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-3), (torch.float16, 1e-3),
                                        (torch.float64, 1e-9)])
def test_cuda_scan_path(gpu, monkeypatch, Q, mode, dtype, atol):
    # Q <= 4: one pass over the gallery, no cuBLAS (no score block is written)
    ops = _force_small_blocks(monkeypatch, sms=58)
    seen = _record_blocks(monkeypatch, ops)
    torch.manual_seed(Q)
    N, H = 1500, 56   # H * sizeof: 16-byte pieces for every dtype except a fp64 tail
    q, g = torch.randn(Q, H, device=gpu).to(dtype), torch.randn(N, H, device=gpu).to(dtype)
    bdt = torch.float64 if dtype == torch.float64 else torch.float32
    bias = None
    if mode == "exact":
        bias = make_bias(Q, N, scale=4.0, spread=1.5, dtype=bdt, device=gpu, seed=Q)
    elif mode == "table":
        bias = (torch.rand(Q, device=gpu, dtype=bdt), torch.rand(N, device=gpu, dtype=bdt),
                torch.randn(33, device=gpu))
    ex = torch.randint(-1, N, (Q, 3), device=gpu)
    check_against_reference(q, g, 9, atol=atol * 4 if mode != "none" else atol, bias=bias, exclude=ex,
                            temperature=0.3)
    assert seen == []


@pytest.mark.parametrize("H", [1, 7, 33])
def test_cuda_scan_unaligned_rows(gpu, monkeypatch, H):
    # row strides that are not a multiple of 16 bytes and H below one 16-byte piece: scalar loads
    _force_small_blocks(monkeypatch)
    torch.manual_seed(H)
    q = torch.randn(3, H, device=gpu)
    g = torch.randn(400, H + 1, device=gpu)[:, 1:]       # offset by 4 bytes, row stride (H + 1) * 4
    check_against_reference(q, g, 6, atol=1e-4)
    check_against_reference(q[:1], g, 400, atol=1e-4)  # k = N


@pytest.mark.parametrize("Q", [1, 3, 9])
def test_cuda_ties_across_chunks_and_slices(gpu, monkeypatch, Q):
    # integer data: exact scores with many ties, which must go to the lower gallery index across
    # slices, chunks and the merges; k up to N (within the kernel's limit) and past it
    ops = _force_small_blocks(monkeypatch, block_bytes=9 * 128 * 4)
    torch.manual_seed(Q)
    N = 1000
    q = torch.randint(-1, 2, (Q, 5), device=gpu).float()
    g = torch.randint(-1, 2, (N, 5), device=gpu).float()
    ex = torch.randint(-1, N, (Q, 6), device=gpu)
    for k in (1, 10, 100, N):
        v, i = tempokern.ctd_topk(q, g, k, exclude=ex)
        rv, ri = ref_topk(q, g, k, exclude=ex)
        assert torch.equal(v, rv) and torch.equal(i, ri), k
    assert ops._CUDA_MAX_K >= N  # k = N ran in the kernel, not the torch fallback


def test_cuda_pruning_is_exact(gpu, monkeypatch):
    # the bias is evaluated only where score + bound can beat the running k-th value; a bias that
    # reorders only near-ties (small scale) and one that decides everything (large scale) both match
    _force_small_blocks(monkeypatch, block_bytes=20 * 200 * 4)
    torch.manual_seed(21)
    Q, N, H = 20, 3000, 16
    q, g = torch.randn(Q, H, device=gpu), torch.randn(N, H, device=gpu)
    for scale in (0.02, 50.0):
        bias = make_bias(Q, N, scale=scale, device=gpu, seed=22)
        check_against_reference(q, g, 7, atol=1e-4 * max(1.0, scale), bias=bias, temperature=0.5)
        check_against_reference(q[:2], g, 7, atol=1e-4 * max(1.0, scale),
                                bias=(bias[0][:2],) + bias[1:], temperature=0.5)


def test_cuda_bias_bound_is_an_upper_bound():
    # the pruning bound of the CUDA driver: >= the exact bias everywhere on a fine grid, for weights
    # where units switch inside the range, and >= every value of a table
    from tempokern._ops.ctd_topk import _BIAS_EXACT, _bias_setup, parse_bias
    from tempokern.reference.ctd_topk import offset_bias as ref_bias
    for seed in range(5):
        b = make_bias(1, 20001, scale=3.0, hidden=17, D=10, seed=seed)
        mode, _, _, w1, b1, w2, b2, scale, _ = parse_bias(b, 1, 20001, torch.float32, torch.device("cpu"))
        ub, ends, _, _ = _bias_setup(mode, w1, b1, w2, b2, scale, torch.float32, torch.device("cpu"))
        assert mode == _BIAS_EXACT
        delta = torch.linspace(-1, 1, 20001, dtype=torch.float64)
        exact = ref_bias(torch.zeros(1, dtype=torch.float64), delta, *(t.double() for t in b[2:]))[0]
        assert float(exact.max()) <= ub and ub - float(exact.max()) < 0.05 * (1 + abs(float(exact.max())))
        torch.testing.assert_close(ends.double(), torch.stack([exact[-1], exact[0]]), atol=1e-5, rtol=0)


def test_cuda_large_k_falls_back_to_torch(gpu):
    from conftest import expect_no_kernel
    torch.manual_seed(23)
    q, g = torch.randn(5, 8, device=gpu), torch.randn(1200, 8, device=gpu)
    expect_no_kernel()
    check_against_reference(q, g, 1100, atol=1e-4)   # k > _CUDA_MAX_K
