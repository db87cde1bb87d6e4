"""tempokern.nn.CTDLoss: single process vs the reference, and gather=True over two gloo processes."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import tempokern
from tempokern.nn import CTDLoss
from tempokern.reference import multipos_infonce as ref
from tempokern.reference import offset_bias, overlap_positives

# The tree holding the tempokern this process imported (installed or in-tree build), for subprocesses.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tempokern.__file__)))


def offset_bias_module(features=6, hidden=5, seed=0):
    torch.manual_seed(seed)
    m = tempokern.nn.OffsetBias(features=features, hidden=hidden)
    with torch.no_grad():
        m.scale.fill_(0.8)  # non-zero so the bias (and its gradients) matter
    return m.double()


def batch(B, H, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, d = torch.randn(B, H, generator=g, dtype=torch.float64), torch.randn(B, H, generator=g, dtype=torch.float64)
    qs = torch.randint(0, 40, (B,), generator=g)
    ds = torch.randint(0, 40, (B,), generator=g)
    qe, de = qs + torch.randint(0, 4, (B,), generator=g), ds + torch.randint(0, 4, (B,), generator=g)
    u_q = torch.rand(B, generator=g, dtype=torch.float64) * 1.6 - 0.3
    u_d = torch.rand(B, generator=g, dtype=torch.float64) * 1.6 - 0.3
    neg = torch.randn(N, H, generator=g, dtype=torch.float64) if N else None
    return q, d, (qs, qe), (ds, de), u_q, u_d, neg


@pytest.mark.parametrize("symmetric", [True, False])
def test_ctd_loss_matches_reference(symmetric):
    ob = offset_bias_module()
    q, d, qsp, dsp, u_q, u_d, neg = batch(70, 12, 9)
    leaves = [x.requires_grad_() for x in (q, d, u_q, u_d, neg)]
    params = list(ob.parameters())
    loss = CTDLoss(temperature=0.07, offset_bias=ob, symmetric=symmetric)(q, d, qsp, dsp, u_q, u_d, extra_neg=neg)
    got = torch.autograd.grad(loss, leaves + params)
    bias = (u_q, u_d, ob.mlp[0].weight, ob.mlp[0].bias, ob.mlp[2].weight, ob.mlp[2].bias, ob.scale)
    want_loss = ref(F.normalize(q, dim=-1), F.normalize(d, dim=-1), qsp, dsp, temperature=0.07, bias=bias,
                    extra_neg=F.normalize(neg, dim=-1), symmetric=symmetric)
    want = torch.autograd.grad(want_loss, leaves + params)
    torch.testing.assert_close(loss, want_loss)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_ctd_loss_without_bias_and_no_normalize():
    q, d, qsp, dsp, _, _, _ = batch(33, 8, 0, seed=4)
    got = CTDLoss(temperature=0.2, normalize=False)(q, d, qsp, dsp)
    torch.testing.assert_close(got, ref(q, d, qsp, dsp, temperature=0.2))


def test_ctd_loss_bad_inputs():
    q, d, qsp, dsp, u_q, u_d, _ = batch(5, 4, 0)
    with pytest.raises(ValueError, match="u_q and u_d"):
        CTDLoss(offset_bias=offset_bias_module(features=4))(q, d, qsp, dsp)
    with pytest.raises(ValueError, match="no offset_bias"):
        CTDLoss()(q, d, qsp, dsp, u_q, u_d)
    with pytest.raises(ValueError, match="temperature"):
        CTDLoss(temperature=0.0)
    with pytest.raises(TypeError, match="offset_bias"):
        CTDLoss(offset_bias=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="gather"):
        CTDLoss(gather="yes")


# ---- gather=True over two gloo processes -------------------------------------------------------

WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_ctd_loss import batch, offset_bias_module, paired_spans
    from tempokern.nn import CTDLoss
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[5]
    torch.set_num_threads(1)
    # one process group per case (a fresh rendezvous file each): the cases share the interpreter start only
    for i, (sym, sizes, mode, paired) in enumerate(json.loads(sys.argv[6])):
        dist.init_process_group("gloo", init_method=f"{init}-{i}", rank=rank, world_size=world)
        q, d, qsp, dsp, u_q, u_d, neg = batch(sum(sizes), 10, 0, seed=7)
        if paired:
            dsp = paired_spans(qsp)
        sl = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
        nn_ = 7 + 3 * rank if mode == "tempokern" else 7      # ragged extra negatives per rank (tempokern mode)
        negs = batch(nn_, 10, nn_, seed=100 + rank)[-1]
        loc = [x[sl].clone().requires_grad_() for x in (q, d, u_q, u_d)] + [negs.clone().requires_grad_()]
        ob = offset_bias_module()
        loss = CTDLoss(temperature=0.1, offset_bias=ob, symmetric=sym, gather=True, gather_mode=mode)(
            loc[0], loc[1], tuple(x[sl] for x in qsp), tuple(x[sl] for x in dsp), loc[2], loc[3], extra_neg=loc[4])
        leaves = loc + list(ob.parameters())
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)   # chunqiutr: extra_neg gets none
        grads = [torch.zeros_like(x) if g is None else g.detach() for g, x in zip(grads, leaves)]
        torch.save({"loss": loss.detach(), "grads": grads, "negs": negs}, f"{out}-{i}")
        dist.destroy_process_group()
""")


def paired_spans(qsp):
    """Document spans that overlap their own query's (as in training: the pair is a gold record), so no
    row needs the diagonal fallback."""
    return (qsp[1], qsp[1] + 2)


def expected_rank(r, sizes, sym, all_negs, paired=False):
    """Rank r's loss from the materialised reference formulas: local rows vs global documents (+ all
    extra negatives), local columns vs global queries, weighted by W B_r / T; other ranks' tensors
    detached."""
    world, total = len(sizes), sum(sizes)
    q, d, qsp, dsp, u_q, u_d, _ = batch(total, 10, 0, seed=7)
    if paired:
        dsp = paired_spans(qsp)
    sl = slice(sum(sizes[:r]), sum(sizes[:r + 1]))
    ob = offset_bias_module()
    loc = [x[sl].clone().requires_grad_() for x in (q, d, u_q, u_d)] + [all_negs[r].clone().requires_grad_()]

    def with_local(full, x):
        parts = list(full.detach().split(sizes))
        parts[r] = x
        return torch.cat(parts)

    qg, dg, uqg, udg = (with_local(f, x) for f, x in zip((q, d, u_q, u_d), loc[:4]))
    negs = [n.detach() for n in all_negs]
    negs[r] = loc[4]
    ng = F.normalize(torch.cat(negs), dim=-1)
    qn, dn = F.normalize(qg, dim=-1), F.normalize(dg, dim=-1)
    s = qn @ dn.t() / 0.1 + offset_bias(uqg, udg, ob.mlp[0].weight, ob.mlp[0].bias, ob.mlp[2].weight,
                                        ob.mlp[2].bias, ob.scale)
    pos = overlap_positives(qsp, dsp)
    eye = torch.eye(s.shape[0], dtype=torch.bool)
    pos_r = pos | (eye & ~pos.any(1, keepdim=True))
    pos_c = pos_r | (eye & ~pos_r.any(0, keepdim=True))    # the reference: row-fallback mask transposed, then diag
    fill = torch.finfo(s.dtype).min
    row = torch.logsumexp(torch.cat([s, qn @ ng.t() / 0.1], 1), 1) - torch.logsumexp(s.masked_fill(~pos_r, fill), 1)
    col = torch.logsumexp(s, 0) - torch.logsumexp(s.masked_fill(~pos_c, fill), 0)
    w = (0.5 if sym else 1.0) * world * sizes[r] / total
    loss = w * row[sl].mean() + (w * col[sl].mean() if sym else 0.0)
    grads = torch.autograd.grad(loss, loc + list(ob.parameters()))
    single = ref(F.normalize(q, dim=-1), F.normalize(d, dim=-1), qsp, dsp, temperature=0.1,
                 bias=(u_q, u_d, ob.mlp[0].weight, ob.mlp[0].bias, ob.mlp[2].weight, ob.mlp[2].bias, ob.scale),
                 extra_neg=ng.detach(), symmetric=sym)
    return loss.detach(), grads, single.detach()


def _run_workers(tmp_path, script_text, world, *args):
    script = tmp_path / "worker.py"
    script.write_text(script_text)
    init = f"file://{tmp_path / 'rendezvous'}"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), init,
                               os.path.dirname(os.path.abspath(__file__)), str(tmp_path / f"out{r}.pt"), *args],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outs.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


# Random spans, symmetric: some rows need the diagonal fallback, and the reference's column fallback is the
# row-fallback mask transposed. The gathered column pass sees q_all x d_local only, so CTDLoss
# passes which queries overlap no document on any rank (multipos_infonce_partial's row_none).


GATHER_CASES = [(True, (24, 24), False), (False, (24, 24), False), (True, (24, 17), False), (True, (24, 17), True),
                (False, (20, 13), True)]
CHUNQIUTR_B = 20
CHUNQIUTR_CASES = [(True, (CHUNQIUTR_B, CHUNQIUTR_B), False), (False, (CHUNQIUTR_B, CHUNQIUTR_B), False)]


ALL_GATHER_CASES = ([(s, sz, "tempokern", p) for s, sz, p in GATHER_CASES]
                    + [(s, sz, "chunqiutr", p) for s, sz, p in CHUNQIUTR_CASES])


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """Every gloo case of this file (WORKER's gather cases, then MISMATCH's disagreeing ranks) through one pair of
    worker processes: the interpreter and torch start once, each case has a process group of its own. (the folder
    of the results, [(exit code, output) of rank 0, of rank 1]); a run that times out (a rank hangs) reports that
    as its output, and the cases it did not reach have no results."""
    tmp = tmp_path_factory.mktemp("ctd_gloo")
    try:
        outs = _run_workers(tmp, WORKER + MISMATCH, 2, json.dumps(ALL_GATHER_CASES), json.dumps(MISMATCH_CASES))
    except subprocess.TimeoutExpired as e:
        outs = [(None, f"timed out: {e}")] * 2
    return tmp, outs


@pytest.fixture(scope="module")
def gathered(gloo_runs):
    """{(symmetric, sizes, mode, paired): [rank 0's results, rank 1's]} of the gather cases."""
    tmp, outs = gloo_runs
    res = {}
    for i, c in enumerate(ALL_GATHER_CASES):
        files = [tmp / f"out{r}.pt-{i}" for r in range(2)]
        res[c] = [torch.load(f) for f in files] if all(f.exists() for f in files) else outs
    return res


def _case(gathered, key):
    res = gathered[key]
    assert all(isinstance(x, dict) for x in res), f"no result for {key}: {res}"
    return res


@pytest.mark.parametrize("symmetric,sizes,paired", GATHER_CASES)
def test_gather_two_gloo_processes(gathered, symmetric, sizes, paired):
    """gather_mode="tempokern": each rank's loss and gradients are its rows/columns of the single-process
    reference on the concatenated batch (other ranks' tensors detached), and the mean over ranks is the
    single-process loss. With random spans some rows need the diagonal fallback; the column fallback of
    the reference is the row-fallback mask transposed."""
    world = len(sizes)
    res = _case(gathered, (symmetric, sizes, "tempokern", paired))
    all_negs = [x["negs"] for x in res]
    losses = []
    for r in range(world):
        want_loss, want_grads, single = expected_rank(r, list(sizes), symmetric, all_negs, paired)
        torch.testing.assert_close(res[r]["loss"], want_loss)
        for i, (a, b) in enumerate(zip(res[r]["grads"], want_grads)):
            torch.testing.assert_close(a, b, msg=lambda m: f"rank {r} grad {i}: {m}")
        losses.append(res[r]["loss"])
    # the mean over ranks is the single-process loss on the concatenated batch
    torch.testing.assert_close(torch.stack(losses).mean(), single)


def test_ctd_loss_under_torch_compile():
    # the CPU path sorts rows by u and computes unit bounds in the wrapper: all of it must trace
    torch.manual_seed(0)
    B, H = 70, 16
    q, d = torch.randn(B, H, requires_grad=True), torch.randn(B, H, requires_grad=True)
    s = torch.randint(0, 20, (B,))
    spans = ((s, s + 2), (s.flip(0), s.flip(0) + 1))
    ob = tempokern.nn.OffsetBias(8, 6)
    with torch.no_grad():
        ob.scale.fill_(0.7)
    u_q, u_d = torch.rand(B), torch.rand(B)
    loss_fn = CTDLoss(temperature=0.1, offset_bias=ob)

    def f(q, d, u_q, u_d):
        return loss_fn(q, d, *spans, u_q=u_q, u_d=u_d)

    leaves = [q, d, *ob.parameters()]
    eager = f(q, d, u_q, u_d)
    g_eager = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(f)(q, d, u_q, u_d)
    g_comp = torch.autograd.grad(compiled, leaves)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b)


# ---- gather_mode="chunqiutr": ChunQiuTR's contrastive_loss_global_inbatch, term for term ----------

def chunqiutr_rank(r, B, world, sym, all_negs):
    """Rank r's loss and gradients from the reference's formula as retrieval_utils.py writes it:
    normalise, gather everything detached, q_r vs [p_all, n_all] with the (B, B) time bias on the
    local block, overlap positives else the global diagonal; p_r vs q_all likewise."""
    q, d, qsp, dsp, u_q, u_d, _ = batch(B * world, 10, 0, seed=7)
    sl = slice(r * B, (r + 1) * B)
    ob = offset_bias_module()
    loc = [x[sl].clone().requires_grad_() for x in (q, d, u_q, u_d)] + [all_negs[r].clone().requires_grad_()]
    qn, pn = F.normalize(loc[0], p=2, dim=-1), F.normalize(loc[1], p=2, dim=-1)
    q_all = F.normalize(q, p=2, dim=-1).detach()
    p_all = F.normalize(d, p=2, dim=-1).detach()
    n_all = F.normalize(torch.cat(all_negs), p=2, dim=-1).detach()
    gallery_all = torch.cat([p_all, n_all], dim=0)
    time_bias = offset_bias(loc[2], loc[3], ob.mlp[0].weight, ob.mlp[0].bias, ob.mlp[2].weight, ob.mlp[2].bias,
                            ob.scale)
    logits_i2t = (qn @ gallery_all.t()) / 0.1
    logits_t2i = (pn @ q_all.t()) / 0.1
    c0 = r * B
    logits_i2t = logits_i2t.clone()
    logits_i2t[:, c0:c0 + B] = logits_i2t[:, c0:c0 + B] + time_bias
    logits_t2i = logits_t2i.clone()
    logits_t2i[:, c0:c0 + B] = logits_t2i[:, c0:c0 + B] + time_bias.t()
    qs, qe = qsp[0][sl], qsp[1][sl]
    ps_all, pe_all = dsp
    q_min, q_max = torch.minimum(qs, qe), torch.maximum(qs, qe)
    p_min_all, p_max_all = torch.minimum(ps_all, pe_all), torch.maximum(ps_all, pe_all)
    G = gallery_all.shape[0]
    mask = torch.zeros(B, G, dtype=torch.bool)
    mask[:, :B * world] = (q_min[:, None] <= p_max_all[None, :]) & (q_max[:, None] >= p_min_all[None, :])
    glob = torch.arange(B) + c0
    bad = torch.where(~mask.any(dim=1))[0]
    mask[bad, glob[bad]] = True
    lp = logits_i2t - torch.logsumexp(logits_i2t, dim=1, keepdim=True)
    loss = -torch.logsumexp(lp.masked_fill(~mask, float("-inf")), dim=1).mean()
    if sym:
        ps, pe = dsp[0][sl], dsp[1][sl]
        p_min, p_max = torch.minimum(ps, pe), torch.maximum(ps, pe)
        q_min_all, q_max_all = torch.minimum(*qsp), torch.maximum(*qsp)
        mt = (p_min[:, None] <= q_max_all[None, :]) & (p_max[:, None] >= q_min_all[None, :])
        bad = torch.where(~mt.any(dim=1))[0]
        mt[bad, glob[bad]] = True
        lp = logits_t2i - torch.logsumexp(logits_t2i, dim=1, keepdim=True)
        loss = 0.5 * (loss - torch.logsumexp(lp.masked_fill(~mt, float("-inf")), dim=1).mean())
    grads = torch.autograd.grad(loss, loc + list(ob.parameters()), allow_unused=True)
    return loss.detach(), grads


@pytest.mark.parametrize("symmetric", [True, False])
def test_gather_mode_chunqiutr_two_gloo_processes(gathered, symmetric):
    B, world = CHUNQIUTR_B, 2
    res = _case(gathered, (symmetric, (B, B), "chunqiutr", False))
    all_negs = [x["negs"] for x in res]
    for r in range(world):
        want_loss, want_grads = chunqiutr_rank(r, B, world, symmetric, all_negs)
        torch.testing.assert_close(res[r]["loss"], want_loss)
        for i, (a, b) in enumerate(zip(res[r]["grads"], want_grads)):
            b = torch.zeros_like(a) if b is None else b
            torch.testing.assert_close(a, b, msg=lambda m: f"rank {r} grad {i}: {m}")
    # extra negatives get no gradient (gathered detached), unlike the default mode
    assert all(float(x["grads"][4].abs().max()) == 0.0 for x in res)


MISMATCH = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_ctd_loss import batch, offset_bias_module
    from tempokern.nn import CTDLoss
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[5]
    for i, (what, mode) in enumerate(json.loads(sys.argv[7])):   # a process group per case
        dist.init_process_group("gloo", init_method=f"{init}-m{i}", rank=rank, world_size=world)
        q, d, qsp, dsp, u_q, u_d, neg = batch(12, 10, 5, seed=rank)
        ob = offset_bias_module()
        kw = dict(u_q=u_q, u_d=u_d, extra_neg=neg)
        loss_fn = CTDLoss(temperature=0.1, offset_bias=ob, gather=True, gather_mode=mode)
        if rank == 1 and what == "extra_neg":
            kw["extra_neg"] = None
        if rank == 1 and what == "bias":
            loss_fn = CTDLoss(temperature=0.1, gather=True, gather_mode=mode)
            kw.pop("u_q"), kw.pop("u_d")
        if rank == 1 and what == "size":
            q, d, qsp, dsp = q[:9], d[:9], tuple(x[:9] for x in qsp), tuple(x[:9] for x in dsp)
            kw["u_q"], kw["u_d"] = u_q[:9], u_d[:9]
        try:
            loss_fn(q, d, qsp, dsp, **kw)
            result = "NO ERROR"
        except ValueError as e:
            result = f"ValueError: {e}"
        with open(f"{out}-m{i}", "w") as f:
            f.write(result)
        dist.destroy_process_group()
""")

MISMATCH_CASES = [("extra_neg", "tempokern"), ("bias", "tempokern"), ("extra_neg", "chunqiutr"), ("size", "chunqiutr")]


@pytest.fixture(scope="module")
def mismatched(gloo_runs):
    """{case: [(exit code, what rank 0 printed, its result or None), (rank 1's)]} of the disagreeing-ranks cases."""
    tmp, outs = gloo_runs
    res = {}
    for i, c in enumerate(MISMATCH_CASES):
        res[c] = [(rc, out, (tmp / f"out{r}.pt-m{i}").read_text() if (tmp / f"out{r}.pt-m{i}").exists() else None)
                  for r, (rc, out) in enumerate(outs)]
    return res


@pytest.mark.parametrize("what,mode", MISMATCH_CASES)
def test_gather_ranks_that_disagree_raise_instead_of_hanging(mismatched, what, mode):
    """Fails on a030c41 (hangs: rank 0 enters an all_gather of extra negatives that rank 1 never joins)."""
    for rc, out, result in mismatched[(what, mode)]:
        assert rc == 0 and result is not None, out
        assert "ValueError: CTDLoss(gather=True): ranks disagree" in result, result
        key = {"extra_neg": "extra_neg", "bias": "offset bias", "size": "batch size"}[what]
        assert key in result, result


def test_gather_mode_is_checked():
    with pytest.raises(ValueError, match="gather_mode"):
        CTDLoss(gather=True, gather_mode="ddp")
