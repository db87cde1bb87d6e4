"""tempokern.nn.CTDLoss: single process vs the reference, and gather=True over two gloo processes."""
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
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_ctd_loss import batch, offset_bias_module
    from tempokern.nn import CTDLoss
    rank, world, init, out, sym = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[5], sys.argv[6] == "1"
    sizes = [int(x) for x in sys.argv[7].split(",")]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    q, d, qsp, dsp, u_q, u_d, neg = batch(sum(sizes), 10, 0, seed=7)
    sl = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    negs = batch(7 + 3 * rank, 10, 7 + 3 * rank, seed=100 + rank)[-1]   # ragged extra negatives per rank
    loc = [x[sl].clone().requires_grad_() for x in (q, d, u_q, u_d)] + [negs.clone().requires_grad_()]
    ob = offset_bias_module()
    loss = CTDLoss(temperature=0.1, offset_bias=ob, symmetric=sym, gather=True)(
        loc[0], loc[1], tuple(x[sl] for x in qsp), tuple(x[sl] for x in dsp), loc[2], loc[3], extra_neg=loc[4])
    grads = torch.autograd.grad(loss, loc + list(ob.parameters()))
    torch.save({"loss": loss.detach(), "grads": [g.detach() for g in grads], "negs": negs}, out)
    dist.destroy_process_group()
""")


def expected_rank(r, sizes, sym, all_negs):
    """Rank r's loss from the materialised reference formulas: local rows vs global documents (+ all
    extra negatives), local columns vs global queries, weighted by W B_r / T; other ranks' tensors
    detached."""
    world, total = len(sizes), sum(sizes)
    q, d, qsp, dsp, u_q, u_d, _ = batch(total, 10, 0, seed=7)
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
    pos_c = pos | (eye & ~pos.any(0, keepdim=True))
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


@pytest.mark.parametrize("symmetric,sizes", [(True, (24, 24)), (False, (24, 24)), (True, (24, 17))])
def test_gather_two_gloo_processes(tmp_path, symmetric, sizes):
    world = len(sizes)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    init = f"file://{tmp_path / 'rendezvous'}"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), init,
                               os.path.dirname(os.path.abspath(__file__)), str(tmp_path / f"out{r}.pt"),
                               "1" if symmetric else "0", ",".join(map(str, sizes))], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    res = [torch.load(tmp_path / f"out{r}.pt") for r in range(world)]
    all_negs = [x["negs"] for x in res]
    losses = []
    for r in range(world):
        want_loss, want_grads, single = expected_rank(r, list(sizes), symmetric, all_negs)
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
