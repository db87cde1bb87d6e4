"""tempokern.nn.Re3Loss (Re³'s Eqs. 10-13 on the fused kernel) against the eager reference
(tempokern.reference.re3_loss: materialised B x B, masked max, hinge) and against a literal transcription of
the paper's equations written with Python loops: loss, parts and gradients (q, d, d_tw) in float64,
duplicates, B = 1, no negatives, d_tw == d, temperatures, float32, bad input, gather=True over two gloo
processes."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import tempokern
from tempokern.nn import Re3Loss
from tempokern.reference import re3_loss

from test_ctd_loss import _run_workers


def batch(B, D, *, seed=0, dtype=torch.float64, ndocs=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    d = F.normalize(q + 0.8 * torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    tw = F.normalize(d + 0.5 * torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    ids = torch.randint(0, ndocs or 10 * B, (B,), generator=g)
    if ndocs:  # duplicated documents carry the same embedding
        base = F.normalize(torch.randn(ndocs, D, generator=g, dtype=torch.float64), dim=1)
        d = base[ids]
    t = lambda x: x.to(dtype).to(device).requires_grad_()  # noqa: E731
    return t(q), t(d), t(tw), ids.to(device)


def literal(q, d, d_tw, ids, *, temperature, margin, lambda_hard, lambda_tw, tw_in_nce, dedup):
    """Eqs. 10-13 term by term with Python loops (B9: lowest column among ties; B8: duplicates positive)."""
    B = q.shape[0]
    same = (lambda i, j: int(ids[i]) == int(ids[j])) if (dedup and ids is not None) else (lambda i, j: i == j)
    cos = [[torch.dot(q[i], d[j]) for j in range(B)] for i in range(B)]  # differentiable scalars
    tw = [torch.dot(q[i], d_tw[i]) for i in range(B)] if d_tw is not None else None
    l_qd, l_dq = 0.0, 0.0
    for i in range(B):
        alls = [c / temperature for c in cos[i]] + ([t / temperature for t in [torch.dot(q[i], x) for x in d_tw]]
                                                    if tw_in_nce and d_tw is not None else [])
        pos = [cos[i][j] / temperature for j in range(B) if same(i, j)]
        l_qd = l_qd + torch.logsumexp(torch.stack(alls), 0) - torch.logsumexp(torch.stack(pos), 0)
        col = [cos[k][i] / temperature for k in range(B)]
        cpos = [cos[k][i] / temperature for k in range(B) if same(k, i)]
        l_dq = l_dq + torch.logsumexp(torch.stack(col), 0) - torch.logsumexp(torch.stack(cpos), 0)
    l_nce = (l_qd / B + l_dq / B) / 2
    l_hard, hard = 0.0, []
    for i in range(B):
        bj = -1
        for j in range(B):
            if not same(i, j) and (bj < 0 or cos[i][j].item() > cos[i][bj].item()):
                bj = j
        hard.append(bj)
        if bj >= 0:
            l_hard = l_hard + torch.relu(margin + cos[i][bj] - cos[i][i])
    l_hard = l_hard / B
    l_tw = sum(torch.relu(margin + tw[i] - cos[i][i]) for i in range(B)) / B if tw is not None else 0.0
    return l_nce + lambda_hard * l_hard + lambda_tw * l_tw, l_nce, l_hard, l_tw, hard


CONFIGS = [  # tw_in_nce, dedup, with d_tw, with doc_ids, ndocs (duplicates when small)
    (False, True, True, True, 9),
    (True, True, True, True, 9),
    (False, False, True, True, 9),
    (True, True, True, False, None),
    (False, True, False, True, None),
]


@pytest.mark.parametrize("tw_in_nce,dedup,with_tw,with_ids,ndocs", CONFIGS)
def test_float64_parity_with_reference(tw_in_nce, dedup, with_tw, with_ids, ndocs):
    q, d, tw, ids = batch(37, 16, seed=3, ndocs=ndocs)
    tw = tw if with_tw else None
    ids = ids if with_ids else None
    kw = dict(temperature=0.07, margin=0.3, lambda_hard=0.7, lambda_tw=0.4, tw_in_nce=tw_in_nce, dedup=dedup)
    loss, parts = Re3Loss(**kw)(q, d, tw, ids)
    want, wparts = re3_loss(q, d, tw, ids, **kw)
    ins = [x for x in (q, d, tw) if x is not None]
    g = torch.autograd.grad(loss, ins)
    gw = torch.autograd.grad(want, ins)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    for k in ("nce", "hard", "tw", "total"):
        torch.testing.assert_close(parts[k], wparts[k].detach(), rtol=1e-12, atol=1e-12)
        assert not parts[k].requires_grad
    assert torch.equal(parts["hardest_col"], wparts["hardest_col"])
    for a, b in zip(g, gw):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert parts["hard"] > 0  # the margin is active for some rows (else L_hard's gradient is untested)
    if with_tw:
        assert parts["tw"] > 0


@pytest.mark.parametrize("tw_in_nce,dedup", [(False, True), (True, False)])
def test_literal_transcription(tw_in_nce, dedup):
    q, d, tw, ids = batch(11, 6, seed=5, ndocs=6)
    kw = dict(temperature=0.2, margin=0.4, lambda_hard=0.5, lambda_tw=0.3, tw_in_nce=tw_in_nce, dedup=dedup)
    loss, parts = Re3Loss(**kw)(q, d, tw, ids)
    tot, l_nce, l_hard, l_tw, hard = literal(q, d, tw, ids, **kw)
    assert parts["hardest_col"].tolist() == hard
    for got, want in ((loss, tot), (parts["nce"], l_nce), (parts["hard"], l_hard), (parts["tw"], l_tw)):
        torch.testing.assert_close(got.detach(), torch.as_tensor(want).detach().to(got.dtype), rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(loss, [q, d, tw])
    gw = torch.autograd.grad(tot, [q, d, tw])
    for a, b in zip(g, gw):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_duplicates_are_positives_not_negatives():
    q, d, tw, ids = batch(24, 8, seed=1, ndocs=5)  # 24 rows, at most 5 documents: many duplicates
    _, parts = Re3Loss(temperature=0.1)(q, d, tw, ids)
    hard = parts["hardest_col"]
    for i, j in enumerate(hard.tolist()):
        assert j == -1 or int(ids[j]) != int(ids[i])  # never the row's own document (which is a duplicate)
    _, parts_nd = Re3Loss(temperature=0.1, dedup=False)(q, d, tw, ids)
    # pure diagonal: a duplicate of the row's own document is a negative scoring exactly like the positive,
    # so the hardest negative scores at least the positive (hinge >= margin)
    cos = (q @ d.t()).detach()
    rows = [i for i in range(24) if (ids == ids[i]).sum() > 1]
    assert rows
    for i in rows:
        j = int(parts_nd["hardest_col"][i])
        assert j != i and cos[i, j] >= cos[i, i]
    assert any(int(ids[int(parts_nd["hardest_col"][i])]) == int(ids[i]) for i in rows)


def test_batch_of_one_and_no_negatives():
    q, d, tw, ids = batch(1, 8, seed=2)
    loss, parts = Re3Loss(temperature=0.05, lambda_tw=0.0)(q, d, tw, ids)
    assert parts["hardest_col"].tolist() == [-1]
    assert parts["hard"].item() == 0.0 and parts["nce"].item() == pytest.approx(0.0, abs=1e-12)
    loss.backward()  # finite, zero gradient from an empty hinge
    assert torch.isfinite(q.grad).all()
    # every row the same document: no row has a negative
    q, d, tw, _ = batch(6, 8, seed=2)
    ids = torch.full((6,), 4)
    loss, parts = Re3Loss(temperature=0.05)(q, d, tw, ids)
    want, wparts = re3_loss(q, d, tw, ids, temperature=0.05)
    assert (parts["hardest_col"] == -1).all() and parts["hard"].item() == 0.0
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)


def test_hard_mean_is_over_all_rows():
    # rows 0 and 1 share a document and the batch has one other: the mean divides by B = 3 even though
    # every row has a negative here; with all three the same document the hinge sum is 0
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=torch.float64)
    d = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    ids = torch.tensor([7, 7, 3])
    _, parts = Re3Loss(temperature=1.0, margin=0.5)(q, d, None, ids)
    # row 0: pos <q0, d0> = 0, neg col 2: <q0, d2> = 1 -> 1.5; row 1: pos 1, neg 0 -> 0; row 2: pos 0.6, negs
    # cols 0, 1 (both 0.8): lowest column 0 -> 0.7
    assert parts["hardest_col"].tolist() == [2, 2, 0]
    assert parts["hard"].item() == pytest.approx((1.5 + 0.0 + 0.7) / 3, abs=1e-15)


def test_time_wrong_equal_to_positive_warns_once():
    q, d, _, ids = batch(8, 4, seed=4)
    tw = d.detach().clone().requires_grad_()
    m = Re3Loss(temperature=0.1, margin=0.2)
    with pytest.warns(UserWarning, match="identical"):
        _, parts = m(q, d, tw, ids)
    assert parts["tw"].item() == pytest.approx(0.2, abs=1e-15)  # the hinge is the margin exactly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(q, d, tw, ids)  # once per module


def test_all_same_time_shift_is_finite():
    # every embedding shares one time: FiLM adds the same shift to every row before normalising
    q, d, tw, ids = batch(16, 8, seed=6)
    shift = torch.randn(8, dtype=torch.float64)
    q2, d2, tw2 = (F.normalize(x + 3 * shift, dim=1) for x in (q, d, tw))
    loss, parts = Re3Loss(temperature=0.05)(q2, d2, tw2, ids)
    want, _ = re3_loss(q2, d2, tw2, ids, temperature=0.05)
    assert all(torch.isfinite(v).all() for v in parts.values())
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("temperature", [0.01, 0.05, 0.3, 1.0])
def test_temperatures(temperature):
    q, d, tw, ids = batch(50, 12, seed=8, ndocs=30)
    loss, parts = Re3Loss(temperature=temperature, tw_in_nce=True)(q, d, tw, ids)
    want, wparts = re3_loss(q, d, tw, ids, temperature=temperature, tw_in_nce=True)
    torch.testing.assert_close(loss, want, rtol=1e-11, atol=1e-11)
    assert torch.equal(parts["hardest_col"], wparts["hardest_col"])
    g = torch.autograd.grad(loss, [q, d, tw])
    gw = torch.autograd.grad(want, [q, d, tw])
    for a, b in zip(g, gw):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_float32_within_twice_torch():
    q, d, tw, ids = batch(300, 32, seed=9, ndocs=200)
    kw = dict(temperature=0.05, tw_in_nce=True)
    exact, _ = re3_loss(q, d, tw, ids, **kw)
    ge = torch.autograd.grad(exact, [q, d, tw])
    q32, d32, tw32 = (x.detach().float().requires_grad_() for x in (q, d, tw))
    fused, _ = Re3Loss(**kw)(q32, d32, tw32, ids)
    gf = torch.autograd.grad(fused, [q32, d32, tw32])
    plain, _ = re3_loss(q32, d32, tw32, ids, **kw)
    gp = torch.autograd.grad(plain, [q32, d32, tw32])
    eps = torch.finfo(torch.float32).eps
    assert abs(fused.double() - exact).item() <= 2 * abs(plain.double() - exact).item() + 4 * eps * exact.abs().item()
    # duplicated documents have identical embeddings: exact ties between their copies, which float32 scores
    # computed at different tile positions may break differently (the hinge's value is the same up to
    # rounding, its gradient lands on another copy of the same document). Compare d's gradient per document.
    per_doc = lambda g: torch.zeros(200, g.shape[1], dtype=g.dtype).index_add_(0, ids, g)  # noqa: E731
    gf, gp, ge = list(gf), list(gp), list(ge)
    gf[1], gp[1], ge[1] = per_doc(gf[1]), per_doc(gp[1]), per_doc(ge[1])
    for a, b, e in zip(gf, gp, ge):
        ea, eb = (a.double() - e).abs().max().item(), (b.double() - e).abs().max().item()
        assert ea <= 2 * eb + 4 * eps * e.abs().max().item()


def test_under_torch_compile():
    q, d, tw, ids = batch(20, 8, seed=10, ndocs=12)
    m = Re3Loss(temperature=0.1, tw_in_nce=True)
    eager, pe = m(q, d, tw, ids)
    comp = torch.compile(lambda *a: m(*a), backend="aot_eager")
    got, pg = comp(q, d, tw, ids)
    torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-12)
    assert torch.equal(pg["hardest_col"], pe["hardest_col"])
    for a, b in zip(torch.autograd.grad(got, [q, d, tw]), torch.autograd.grad(eager, [q, d, tw])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_emulated_cuda_path_matches_reference(gpu):
    q, d, tw, ids = batch(40, 8, seed=12, ndocs=25, dtype=torch.float32, device=gpu)
    loss, parts = Re3Loss(temperature=0.05, tw_in_nce=True)(q, d, tw, ids)
    want, wparts = re3_loss(*(x.detach().double().requires_grad_() for x in (q, d, tw)), ids, temperature=0.05,
                            tw_in_nce=True)
    assert torch.equal(parts["hardest_col"].cpu(), wparts["hardest_col"].cpu())
    torch.testing.assert_close(loss.double().cpu(), want.detach().cpu(), rtol=1e-4, atol=1e-5)
    loss.backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(tw.grad).all()


def test_bad_input():
    q, d, tw, ids = batch(5, 4)
    m = Re3Loss()
    with pytest.raises(ValueError, match="d must have the shape"):
        m(q, d[:4], tw, ids)
    with pytest.raises(ValueError, match="d_tw must have the shape"):
        m(q, d, tw[:, :3], ids)
    with pytest.raises(TypeError, match="d_tw has dtype"):
        m(q, d, tw.float(), ids)
    with pytest.raises(TypeError, match="d has dtype"):
        m(q, d.float(), tw, ids)
    with pytest.raises(TypeError, match="doc_ids must be an integer"):
        m(q, d, tw, ids.float())
    with pytest.raises(ValueError, match="doc_ids has length"):
        m(q, d, tw, ids[:3])
    with pytest.raises(ValueError, match="q must be 2-D"):
        m(q[0], d, tw, ids)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        m(q.tolist(), d, tw, ids)
    with pytest.raises(ValueError, match="temperature"):
        Re3Loss(temperature=0.0)
    with pytest.raises(ValueError, match="lambda_hard"):
        Re3Loss(lambda_hard=-1.0)
    with pytest.raises(ValueError, match="margin"):
        Re3Loss(margin=math.nan)
    with pytest.raises(TypeError, match="dedup"):
        Re3Loss(dedup=1)
    with pytest.raises(TypeError, match="tw_in_nce"):
        Re3Loss(tw_in_nce="yes")


GATHER_WORKER = r'''
import sys, torch, torch.distributed as dist
rank, world, init, testdir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
sizes = [int(x) for x in sys.argv[6].split(",")]
sys.path.insert(0, testdir)
from test_re3_loss import batch
from tempokern.nn import Re3Loss
for tw_in_nce in (False, True):   # both settings through one interpreter, a process group each
    dist.init_process_group("gloo", init_method=f"{init}-{int(tw_in_nce)}", rank=rank, world_size=world)
    q, d, tw, ids = batch(sum(sizes), 8, seed=21, ndocs=7)
    sl = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    loc = [x[sl].detach().clone().requires_grad_() for x in (q, d, tw)]
    loss, parts = Re3Loss(temperature=0.1, margin=0.3, lambda_hard=0.5, lambda_tw=0.2, tw_in_nce=tw_in_nce,
                          gather=True)(*loc, ids[sl])
    torch.save({"loss": loss.detach(), "hard": parts["hardest_col"], "parts": parts}, f"{out}-{int(tw_in_nce)}")
    dist.destroy_process_group()
'''
GATHER_SIZES = [5, 8]


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    """Both tw_in_nce settings through one pair of gloo worker processes: {tw_in_nce: [rank 0's, rank 1's]}."""
    tmp = tmp_path_factory.mktemp("re3_gather")
    for rc, out in _run_workers(tmp, GATHER_WORKER, 2, ",".join(map(str, GATHER_SIZES))):
        assert rc == 0, out
    return {t: [torch.load(tmp / f"out{r}.pt-{int(t)}") for r in range(2)] for t in (False, True)}


@pytest.mark.parametrize("tw_in_nce", [False, True])
def test_gather_two_gloo_processes(gathered, tw_in_nce):
    sizes = GATHER_SIZES
    res = gathered[tw_in_nce]
    q, d, tw, ids = batch(sum(sizes), 8, seed=21, ndocs=7)
    kw = dict(temperature=0.1, margin=0.3, lambda_hard=0.5, lambda_tw=0.2, tw_in_nce=tw_in_nce)
    single, sparts = Re3Loss(**kw)(q, d, tw, ids)
    # the mean over ranks is the single-process loss on the concatenated batch, term by term
    mean = (res[0]["loss"] + res[1]["loss"]) / 2
    torch.testing.assert_close(mean, single.detach(), rtol=1e-12, atol=1e-12)
    for k in ("nce", "hard", "tw"):
        torch.testing.assert_close((res[0]["parts"][k] + res[1]["parts"][k]) / 2, sparts[k], rtol=1e-12,
                                   atol=1e-12)
    # hardest columns index the gathered documents (rank order), as in the single process
    assert torch.equal(torch.cat([res[0]["hard"], res[1]["hard"]]), sparts["hardest_col"])


@pytest.mark.parametrize("seed", range(8))
def test_reference_first_copies(seed):
    # tempokern.reference.re3's duplicate detection (exact ties among identical document embeddings) against a
    # literal loop: small integer rows (many duplicates, sign flips, rows that are permutations of each other) and
    # float rows with duplicates
    from tempokern.reference.re3 import first_copies
    g = torch.Generator().manual_seed(seed)
    for trial in range(25):
        n, H = int(torch.randint(1, 80, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        ints = trial % 2 == 0
        base = (torch.randint(-2, 3, (max(1, n // 3), H), generator=g).double() if ints
                else torch.randn(max(1, n // 3), H, generator=g, dtype=torch.float64))
        x = base[torch.randint(0, base.shape[0], (n,), generator=g)]
        want = torch.tensor([next(j for j in range(n) if torch.equal(x[j], x[i])) for i in range(n)])
        assert torch.equal(first_copies(x), want), (seed, trial)
        assert torch.equal(first_copies(x.float()), want), (seed, trial)
