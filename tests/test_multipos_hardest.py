"""multipos_infonce(..., return_hardest=True): each row's hardest in-batch negative, a by-product of the fused
forward, against tempokern.reference.hardest_negatives (a masked max over the materialised logits with the
lowest-index tie rule written out) and against hand-derived cases: CPU fused kernel (with and without the
u-sort of the bias path), CPU blocked kernel (table mode), CUDA blocked kernel on the emulator (several row
blocks, column tiles and SM counts), exact ties inside and across tiles, the diagonal fallback, gathered
shapes (Bq != Bd, diagonal offset), opcheck and torch.compile."""
import pytest
import torch
from _emu_support import patch_kernels, patch_sm_count, real_kernels, real_sm_count  # noqa: F401

import tempokern
import tempokern._ops.multipos_blocked as mpb
from tempokern._ops.loss_args import span_bounds
from tempokern._ops.routing import multipos_infonce_partial
from tempokern.reference import hardest_negatives
from tempokern.reference import multipos_infonce as ref
from tempokern.reference.multipos_infonce import multipos_infonce_partial as ref_partial
from tempokern.reference.offset_bias import offset_bias, offset_bias_tabulated

from test_multipos_infonce import make


def literal_hardest(q, d, q_lo, q_hi, d_lo, d_hi, temperature, bias_block=None, diag_offset=0):
    """Independent transcription with Python loops: for each row, the candidate columns are those that do
    not overlap it, minus its diagonal partner when it overlaps nothing; the answer is the first column
    (scanning left to right) whose logit is strictly larger than every earlier candidate's."""
    s = (q.double() @ d.double().t()) / temperature
    if bias_block is not None:
        s = s + bias_block.double()
    out = []
    for i in range(q.shape[0]):
        ov = [max(int(q_lo[i]), int(d_lo[j])) <= min(int(q_hi[i]), int(d_hi[j])) for j in range(d.shape[0])]
        none = not any(ov)
        best, bj = None, -1
        for j in range(d.shape[0]):
            if ov[j] or (none and j == i + diag_offset):
                continue
            if bj < 0 or float(s[i, j]) > best:
                best, bj = float(s[i, j]), j
        out.append(bj)
    return torch.tensor(out, dtype=torch.int64)


def ref_hardest(q, d, sp, temperature, b=None, pts=None):
    (qlo, qhi), (dlo, dhi) = span_bounds(sp[0]), span_bounds(sp[1])
    return ref_partial(q.detach(), d.detach(), qlo, qhi, dlo, dhi, temperature=temperature,
                       bias=None if b is None else tuple(x.detach() for x in b), bias_table_points=pts,
                       return_hardest=True)[1]


CASES = [  # B, H, N, bias, symmetric, spans
    (7, 5, 0, False, True, "random"),
    (197, 13, 5, False, True, "random"),     # several 64 x 96 CPU tiles, staggered walk
    (130, 9, 11, True, True, "random"),      # the bias path sorts rows and columns by u
    (161, 7, 3, True, False, "disjoint"),    # every row falls back to its diagonal: it is not a negative
    (101, 9, 0, True, True, "all"),          # every pair positive: no negative anywhere (-1)
    (1, 4, 2, False, True, "random"),        # B = 1: no negative
]


@pytest.mark.parametrize("B,H,N,bias,symmetric,spans", CASES)
def test_cpu_fused_matches_reference(B, H, N, bias, symmetric, spans):
    q, d, sp, neg, b = make(B, H, N=N, bias=bias, spans=spans, seed=B)
    loss, hard = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, extra_neg=neg, symmetric=symmetric,
                                            return_hardest=True)
    plain = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, extra_neg=neg, symmetric=symmetric)
    want_loss, want = ref(q, d, *sp, temperature=0.1, bias=b, extra_neg=neg, symmetric=symmetric,
                          return_hardest=True)
    assert hard.dtype == torch.int64 and hard.shape == (B,)
    assert torch.equal(hard, want)
    assert loss.item() == plain.item()  # the by-product changes nothing else
    torch.testing.assert_close(loss, want_loss, rtol=1e-11, atol=1e-11)
    if spans == "all" or B == 1:
        assert (hard == -1).all()
    else:
        assert (hard >= 0).all()  # every row of these batches has a negative
        assert hard.max() < B      # never an extra negative
    bb = None if b is None else offset_bias(*(x.detach() for x in b))
    (qlo, qhi), (dlo, dhi) = span_bounds(sp[0]), span_bounds(sp[1])
    assert torch.equal(hard, literal_hardest(q.detach(), d.detach(), qlo, qhi, dlo, dhi, 0.1, bb))
    # gradients still flow through the loss (hardest is an int64 by-product)
    torch.autograd.grad(loss, [q, d])


def test_hand_written_fallback_semantics():
    # rows 0, 1 overlap column 1; row 2 overlaps nothing (its diagonal, column 2, is its positive)
    q = torch.eye(3, dtype=torch.float64)
    d = torch.tensor([[0.0, 0, 5], [0, 0, 0], [1, 1, 0]], dtype=torch.float64)
    qs = (torch.tensor([0, 0, 50]), torch.tensor([1, 1, 51]))
    ds = (torch.tensor([10, 1, 30]), torch.tensor([11, 2, 31]))
    # s = q d^T / 1: row 0: [0, 0, 1] -> negatives {0, 2} (2 is the diagonal, a negative since row 0 has an
    # overlap) -> 2; row 1: [0, 0, 1] -> negatives {0, 2} -> 2; row 2: [5, 0, 0] -> negatives {0, 1} -> 0
    _, hard = tempokern.multipos_infonce(q, d, qs, ds, temperature=1.0, return_hardest=True)
    assert hard.tolist() == [2, 2, 0]
    # with every score equal, the lowest negative column wins
    _, hard = tempokern.multipos_infonce(q, torch.zeros(3, 3, dtype=torch.float64), qs, ds, temperature=1.0,
                                         return_hardest=True)
    assert hard.tolist() == [0, 0, 0]
    qs2 = (torch.tensor([0, 0, 1]), torch.tensor([1, 1, 2]))  # row 2 overlaps column 1 now: 0 and 2 negatives
    _, hard = tempokern.multipos_infonce(q, torch.zeros(3, 3, dtype=torch.float64), qs2, ds, temperature=1.0,
                                         return_hardest=True)
    assert hard.tolist() == [0, 0, 0]


def tie_batch(Bq, Bd, H=6, seed=0, device="cpu", dtype=torch.float64):
    """Exact ties: entries in {-1, 0, 1} and few distinct document rows, so every score is a small integer
    (exact in any summation order) and most rows have several tied maxima among their negatives."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (Bq, H), generator=g).to(dtype)
    protos = torch.randint(-1, 2, (5, H), generator=g).to(dtype)
    d = protos[torch.randint(0, 5, (Bd,), generator=g)]
    qs = torch.randint(0, 40, (Bq,), generator=g)
    ds = torch.randint(0, 40, (Bd,), generator=g)
    return (q.to(device), d.to(device), (qs.to(device), (qs + 1).to(device)), (ds.to(device), (ds + 2).to(device)))


def check_ties(got, q, d, sp, temperature, diag_offset=0):
    (qlo, qhi), (dlo, dhi) = span_bounds(sp[0]), span_bounds(sp[1])
    want = literal_hardest(q.cpu(), d.cpu(), qlo.cpu(), qhi.cpu(), dlo.cpu(), dhi.cpu(), temperature,
                           diag_offset=diag_offset)
    assert torch.equal(got.cpu(), want)
    # the batch really has ties at the maximum (else this test would not test the tie rule)
    s = q.cpu().double() @ d.cpu().double().t()
    rows = [i for i in range(q.shape[0]) if want[i] >= 0 and (s[i] == s[i, want[i]]).sum() > 1]
    assert len(rows) > q.shape[0] // 4


@pytest.mark.parametrize("bias", [False, True])
def test_ties_cpu_fused(bias):
    q, d, qs, ds = tie_batch(300, 300, seed=1)  # 4 x 4 CPU tiles, visited in a staggered order
    b = None
    if bias:
        # a bias that is exactly 0 for every pair (w2 = 0, b2 = 0) still takes the u-sorted path: the tie
        # rule must then hold in the caller's column order, not the sorted one
        g = torch.Generator().manual_seed(3)
        b = (torch.rand(300, generator=g, dtype=torch.float64), torch.rand(300, generator=g, dtype=torch.float64),
             torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64),
             torch.zeros(1, 4, dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
             torch.tensor(1.0, dtype=torch.float64))
    _, hard = tempokern.multipos_infonce(q, d, qs, ds, temperature=0.5, bias=b, return_hardest=True)
    check_ties(hard, q, d, (qs, ds), 0.5)


@pytest.mark.parametrize("rows", [0, 64, 37])
def test_ties_cpu_blocked_table_mode(rows, monkeypatch):
    # the table mode runs the blocked CPU kernel; a zero table keeps the scores exact integers
    q, d, qs, ds = tie_batch(150, 150, seed=2)
    u = torch.rand(150, dtype=torch.float64)
    b = (u, u.flip(0), torch.randn(4, 6, dtype=torch.float64), torch.randn(4, dtype=torch.float64),
         torch.zeros(1, 4, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    if rows:
        monkeypatch.setattr(mpb, "block_rows", lambda Bq, C, N, pe, dev, req=0: rows)
    _, hard = tempokern.multipos_infonce(q, d, qs, ds, temperature=0.5, bias=b, bias_table_points=33,
                                         return_hardest=True)
    check_ties(hard, q, d, (qs, ds), 0.5)


@pytest.mark.parametrize("sms", [132, 108, 58])
def test_ties_across_cuda_column_tiles(gpu, monkeypatch, sms):
    # 2,100 columns = 3 column tiles of 1,024: per-tile partial (max, column) merged with the lowest column
    patch_sm_count(monkeypatch, lambda device: sms)
    q, d, qs, ds = tie_batch(9, 2100, seed=sms, device=gpu, dtype=torch.float32)
    (qlo, qhi), (dlo, dhi) = span_bounds(qs), span_bounds(ds)
    # the maxima sit in the second and third tiles too: duplicate a high-scoring column across tiles
    _, hard = multipos_infonce_partial(q, d, qlo, qhi, dlo, dhi, temperature=0.5, row_weight=1.0,
                                       col_weight=0.0, return_hardest=True)
    check_ties(hard, q, d, (qs, ds), 0.5)
    assert len(set(hard.tolist())) > 1


def test_merge_hardest_rule():
    val = torch.tensor([[1.0, 3.0, 3.0], [float("-inf"), float("-inf"), float("-inf")], [2.0, 2.0, 1.0],
                        [float("-inf"), -5.0, float("-inf")]])
    idx = torch.tensor([[5, 2000, 1100], [-1, -1, -1], [900, 30, 2050], [-1, 1500, -1]])
    assert mpb.merge_hardest(val, idx).tolist() == [1100, -1, 30, 1500]


@pytest.mark.parametrize("mode", ["none", "table", "exact"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_device_paths_match_reference(device, mode, symmetric):
    # cpu: fused kernel (none / exact) or blocked kernel (table); emu: the CUDA blocked kernels
    B = 70
    q, d, sp, neg, b = make(B, 10, N=4, bias=mode != "none", device=device, seed=11)
    pts = 33 if mode == "table" else None
    loss, hard = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, extra_neg=neg, symmetric=symmetric,
                                            bias_table_points=pts, return_hardest=True)
    assert torch.equal(hard.cpu(), ref_hardest(q.cpu(), d.cpu(), sp, 0.1, b, pts).cpu())
    want = ref(q, d, *sp, temperature=0.1, bias=b, extra_neg=neg, symmetric=symmetric, bias_table_points=pts)
    torch.testing.assert_close(loss.double().cpu(), want.double().cpu(), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("rows", [1, 32, 50])
def test_several_row_blocks(gpu, rows):
    from tempokern._ops.multipos_infonce import blocked_multipos
    q, d, sp, neg, b = make(97, 12, N=7, bias=True, device=gpu, seed=rows)
    (qlo, qhi), (dlo, dhi) = span_bounds(sp[0]), span_bounds(sp[1])
    loss, hard = blocked_multipos(q, d, qlo, qhi, dlo, dhi, temperature=0.1, bias=b, extra_neg=neg, row_weight=0.5,
                                  col_weight=0.5, bias_table_points=97, block_rows=rows, return_hardest=True)
    assert torch.equal(hard.cpu(), ref_hardest(q, d, sp, 0.1, b, 97).cpu())
    loss.backward()  # the by-product leaves the gradient path intact


@pytest.mark.parametrize("path", ["fused", "fused_bias", "table"])
def test_gathered_shapes(device, path):
    # CTDLoss(gather=True)'s row pass: local queries vs all gathered documents, row i's partner i + offset
    Bq, Bd, off = 23, 61, 17
    q, d, sp, neg, b = make(Bq, 8, N=3, bias=path != "fused", Bd=Bd, device=device, seed=5)
    (qlo, qhi), (dlo, dhi) = span_bounds(sp[0]), span_bounds(sp[1])
    qlo[::3] = 1000  # some rows overlap nothing: their partner column is their positive
    qhi[::3] = 1001
    pts = 33 if path == "table" else None
    kw = dict(temperature=0.1, bias=b, extra_neg=neg, row_weight=1.0, col_weight=0.0, diag_offset=off,
              bias_table_points=pts, return_hardest=True)
    loss, hard = multipos_infonce_partial(q, d, qlo, qhi, dlo, dhi, **kw)
    want_loss, want = ref_partial(q, d, qlo, qhi, dlo, dhi, **kw)
    assert torch.equal(hard.cpu(), want.cpu())
    assert ((hard >= 0) & (hard < Bd)).all()
    bb = None if b is None else (offset_bias(*(x.detach() for x in b)) if pts is None
                                 else offset_bias_tabulated(*(x.detach() for x in b), pts))
    lit = literal_hardest(q.detach().cpu(), d.detach().cpu(), qlo.cpu(), qhi.cpu(), dlo.cpu(), dhi.cpu(), 0.1,
                          None if bb is None else bb.cpu(), diag_offset=off)
    assert torch.equal(hard.cpu(), lit)
    torch.testing.assert_close(loss.double().cpu(), want_loss.double().cpu(), rtol=1e-9, atol=1e-10)


def test_reference_helper_edge_cases():
    s = torch.tensor([[1.0, 1.0, 0.0], [2.0, 3.0, 3.0]])
    pos = torch.tensor([[False, False, True], [True, True, True]])
    assert hardest_negatives(s, pos).tolist() == [0, -1]
    assert hardest_negatives(torch.empty(2, 0), torch.empty(2, 0, dtype=torch.bool)).tolist() == [-1, -1]


@pytest.mark.parametrize("temperature", [0.01, 0.05, 1.0])
def test_temperatures(temperature):
    q, d, sp, neg, b = make(90, 12, seed=7)
    with torch.no_grad():
        _, hard = tempokern.multipos_infonce(q, d, *sp, temperature=temperature, return_hardest=True)
    assert torch.equal(hard, ref_hardest(q, d, sp, temperature))


def test_opcheck_with_hardest():
    from tempokern._ops.multipos_infonce import _sorted_by_u, bias_kernel_inputs, interval_bounds
    q, d, sp, neg, b = make(20, 6, N=4, bias=True, dtype=torch.float32, seed=2)
    spans = (*span_bounds(sp[0]), *span_bounds(sp[1]))
    q, d, *spans, b, diag = _sorted_by_u(q, d, *spans, b, 0)
    q, d = q.detach().requires_grad_(), d.detach().requires_grad_()
    extras = (*interval_bounds(b[2], b[3]), *diag)
    kb = tuple(x.detach().requires_grad_(x.dtype.is_floating_point and i < 7)
               for i, x in enumerate(bias_kernel_inputs(b, torch.float32)))
    col_map = torch.randperm(20)
    args = (q, d, *spans, neg, *kb, *extras, None, col_map, 10.0, 0.5, 0.5, 0, True)
    torch.library.opcheck(torch.ops.tempokern.multipos_infonce, args)
    out = torch.ops.tempokern.multipos_infonce(*args)
    assert out[3].shape == (20,) and out[3].dtype == torch.int64
    assert set(out[3].tolist()) <= set(col_map.tolist())  # written in the caller's column ids


def test_opcheck_blocked_with_hardest():
    q, d, sp, neg, b = make(20, 6, N=4, dtype=torch.float32, seed=2)
    spans = (*span_bounds(sp[0]), *span_bounds(sp[1]))
    args = (q, d, *spans, neg, *(None,) * 8, 10.0, 0.5, 0.5, 0, True, 0, None, True)
    torch.library.opcheck(torch.ops.tempokern.multipos_blocked, args)


@pytest.mark.parametrize("table", [False, True])
def test_torch_compile(table):
    q, d, sp, neg, b = make(40, 8, N=3, bias=True, seed=9)
    pts = 33 if table else None

    def fn(q, d, neg, *b):
        loss, hard = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=b, extra_neg=neg,
                                                bias_table_points=pts, return_hardest=True)
        return loss, hard

    eager = fn(q, d, neg, *b)
    comp = torch.compile(fn, backend="aot_eager", fullgraph=False)
    got = comp(q, d, neg, *b)
    assert torch.equal(got[1], eager[1])
    torch.testing.assert_close(got[0], eager[0], rtol=1e-12, atol=1e-12)
    g1 = torch.autograd.grad(eager[0], [q, d])
    g2 = torch.autograd.grad(got[0], [q, d])
    for x, y in zip(g1, g2):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_bad_return_hardest():
    q, d, sp, neg, b = make(5, 3)
    with pytest.raises(TypeError, match="return_hardest"):
        tempokern.multipos_infonce(q, d, *sp, temperature=0.1, return_hardest=1)


def test_cuda_hardest_does_not_depend_on_thread_order(cuda_emu):
    # the warps' (value, column) partials go through shared memory: a missing barrier shows as results that
    # change with the order in which the emulator runs a block's threads
    from _emu_support import cuda_emulator
    q, d, qs, ds = tie_batch(40, 1500, seed=4, dtype=torch.float32)
    (qlo, qhi), (dlo, dhi) = span_bounds(qs), span_bounds(ds)
    outs = []
    try:
        for s in (0, 1, 2):
            cuda_emu.emu_set_seed(s)
            with cuda_emulator(cuda_emu):
                outs.append(multipos_infonce_partial(q, d, qlo, qhi, dlo, dhi, temperature=0.5, return_hardest=True)[1])
    finally:
        cuda_emu.emu_set_seed(0)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    check_ties(outs[0], q, d, (qs, ds), 0.5)
