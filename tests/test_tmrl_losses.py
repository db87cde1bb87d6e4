"""TMRL's losses and modules (tempokern.nn.tmrl) against literal float64 transcriptions of the paper's
equations (Eq. 9, 10, 11, 12-14, 15) with the design notes' choices A3-A6."""
import math

import pytest
import torch

from tempokern.nn import (MatryoshkaCKALoss, MatryoshkaDistillLoss, TemporalProjector, TemporalSubspaceLoss,
                          TMRLLoss, temporal_pool)

D64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small tensors: one intra-op thread is faster than two fighting over a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------------------
# literal transcriptions (element by element, float64)


def cos_literal(u, v):
    """sim(u, v) = <u, v> / (||u|| ||v||) with torch's F.normalize clamp (1e-12)."""
    return (u * v).sum() / (torch.clamp(u.norm(), min=1e-12) * torch.clamp(v.norm(), min=1e-12))


def eq10_literal(p_emb, p_T, p_has, qc_emb, qc_T, qc_has, t, tau):
    """Eq. 10 with A4: L^q over rows whose passage has temporal tokens, L^p over rows whose positive query has
    them, negatives without temporal tokens left out of L^p's denominator; each a mean over its kept rows."""
    B, n1 = qc_emb.shape[:2]
    lq, lp = [], []
    for i in range(B):
        if p_has[i]:
            pos = torch.exp(cos_literal(p_T[i], qc_emb[i, 0, :t]) / tau)
            den = pos + sum(torch.exp(cos_literal(p_T[i], qc_emb[i, j, :t]) / tau) for j in range(1, n1))
            lq.append(-torch.log(pos / den))
        if qc_has[i, 0]:
            pos = torch.exp(cos_literal(p_emb[i, :t], qc_T[i, 0]) / tau)
            den = pos + sum(torch.exp(cos_literal(p_emb[i, :t], qc_T[i, j]) / tau)
                            for j in range(1, n1) if qc_has[i, j])
            lp.append(-torch.log(pos / den))
    mean = lambda xs: sum(xs) / len(xs) if xs else torch.zeros((), dtype=p_emb.dtype)  # noqa: E731
    return mean(lq), mean(lp)


def eq11_literal(x, dims, k, detach_teacher=True):
    """Eq. 11 with A5, dense masked form: N_i = the k most similar other rows at full dim; per level the mean of
    |sim^(d) - sim^(m)| over the N*k pairs; summed over the levels m != d."""
    N, d = x.shape
    S = torch.stack([torch.stack([cos_literal(x[i], x[j]) for j in range(N)]) for i in range(N)])
    mask = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N):
        order = sorted((j for j in range(N) if j != i), key=lambda j: -float(S[i, j].detach()))
        mask[i, order[:k]] = True
    teacher = S.detach() if detach_teacher else S
    total = torch.zeros((), dtype=x.dtype)
    for m in dims:
        if m == d:
            continue
        Sm = torch.stack([torch.stack([cos_literal(x[i, :m], x[j, :m]) for j in range(N)]) for i in range(N)])
        total = total + ((teacher - Sm).abs() * mask).sum() / (N * k)
    return total


def cka_literal(X, Y):
    """Eqs. 12-13: centring by (1/N) 1 1^T, CKA = ||X~^T Y~||_F^2 / (||X~^T X~||_F ||Y~^T Y~||_F)."""
    N = X.shape[0]
    J = torch.ones(N, N, dtype=X.dtype) / N
    Xc, Yc = X - J @ X, Y - J @ Y
    fro = lambda A: torch.sqrt((A * A).sum())  # noqa: E731
    return fro(Xc.t() @ Yc) ** 2 / (fro(Xc.t() @ Xc) * fro(Yc.t() @ Yc))


def eq14_literal(x, dims):
    """Eq. 14 with A6: X^(m) = row-normalised prefixes."""
    d = x.shape[1]
    full = torch.stack([r / r.norm() for r in x])
    total = torch.zeros((), dtype=x.dtype)
    for m in dims:
        if m != d:
            total = total + 1 - cka_literal(full, torch.stack([r[:m] / r[:m].norm() for r in x]))
    return total


def mrl_literal(q, p, neg, dims, tau, weights=None):
    """Eqs. 3 and 5: per level, query anchors against [positives, hard negatives] (Tevatron layout)."""
    cand = p if neg is None else torch.cat([p, neg])
    levels = []
    for m in dims:
        terms = []
        for i in range(q.shape[0]):
            z = torch.stack([cos_literal(q[i, :m], cand[j, :m]) for j in range(cand.shape[0])]) / tau
            terms.append(-torch.log(torch.exp(z[i]) / torch.exp(z).sum()))
        levels.append(sum(terms) / len(terms))
    w = [1.0] * len(dims) if weights is None else weights
    return sum(wi * li for wi, li in zip(w, levels)), levels


def leaf(*shape, dtype=D64, seed=None, scale=1.0):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return (torch.randn(*shape, dtype=dtype, generator=g) * scale).requires_grad_(True)


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


def close(a, b, tol=1e-12):
    assert a is not None and b is not None
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a - b).abs().max()


# ---------------------------------------------------------------------------------------------------------
# TemporalSubspaceLoss (Eq. 10, A4)


def _eq10_inputs(B=5, n=3, d=12, t=6, seed=0):
    torch.manual_seed(seed)
    p_emb, p_T = leaf(B, d), leaf(B, t)
    qc_emb, qc_T = leaf(B, 1 + n, d), leaf(B, 1 + n, t)
    return p_emb, p_T, qc_emb, qc_T


@pytest.mark.parametrize("tau", [0.05, 0.2, 1.0])
def test_temporal_subspace_matches_eq10(tau):
    p_emb, p_T, qc_emb, qc_T = _eq10_inputs()
    B, n1 = qc_emb.shape[:2]
    p_has = torch.ones(B, dtype=torch.bool)
    qc_has = torch.ones(B, n1, dtype=torch.bool)
    mod = TemporalSubspaceLoss(6, tau)
    total, lq, lp = mod.terms(p_emb, p_T, p_has, qc_emb, qc_T, qc_has)
    rq, rp = eq10_literal(p_emb, p_T, p_has, qc_emb, qc_T, qc_has, 6, tau)
    close(lq, rq)
    close(lp, rp)
    close(total, mod(p_emb, p_T, None, qc_emb, qc_T, None))
    ins = (p_emb, p_T, qc_emb, qc_T)
    for g, r in zip(grads(total, ins), grads(rq + rp, ins)):
        close(g, r)


def test_temporal_subspace_a4_masking():
    """A passage without temporal tokens (anchor of L^q), negative queries without them (candidates of L^p)
    and a positive query without them (row dropped from L^p)."""
    p_emb, p_T, qc_emb, qc_T = _eq10_inputs(B=6, n=4, seed=1)
    p_has = torch.tensor([True, False, True, True, False, True])
    qc_has = torch.ones(6, 5, dtype=torch.bool)
    qc_has[0, 2] = qc_has[2, 1] = qc_has[2, 4] = False           # negatives without temporal tokens
    qc_has[3, 0] = False                                         # positive without: row 3 leaves L^p
    qc_has[5, 1:] = False                                        # only the positive left: that row's L^p is 0
    with torch.no_grad():                                        # what a masked entry holds must not matter
        qc_T[0, 2] = 1e3
        p_T[1] = float("nan")
    mod = TemporalSubspaceLoss(6, 0.1)
    total, lq, lp = mod.terms(p_emb, p_T, p_has, qc_emb, qc_T, qc_has)
    rq, rp = eq10_literal(p_emb, p_T, p_has, qc_emb, qc_T, qc_has, 6, 0.1)
    close(lq, rq)
    close(lp, rp)
    ins = (p_emb, p_T, qc_emb, qc_T)
    g = grads(total, ins)
    # row 1's p_T is NaN and dropped: its gradient is 0; compare the rest with the literal equation
    assert torch.isfinite(total) and torch.equal(g[1][1], torch.zeros(6, dtype=D64))
    assert torch.equal(g[3][0, 2], torch.zeros(6, dtype=D64))  # a masked candidate gets no gradient
    with torch.no_grad():
        p_T[1] = 0.0
    r = grads(sum(eq10_literal(p_emb, p_T, p_has, qc_emb, qc_T, qc_has, 6, 0.1)), ins)
    for a, b in zip(g, r):
        close(torch.nan_to_num(a), b)


def test_temporal_subspace_no_temporal_rows_is_zero_with_graph():
    p_emb, p_T, qc_emb, qc_T = _eq10_inputs(B=4, n=2)
    p_has = torch.zeros(4, dtype=torch.bool)
    qc_has = torch.zeros(4, 3, dtype=torch.bool)
    loss = TemporalSubspaceLoss(6, 0.05)(p_emb, p_T, p_has, qc_emb, qc_T, qc_has)
    assert loss.item() == 0.0 and loss.requires_grad
    for g in grads(loss, (p_emb, p_T, qc_emb, qc_T)):
        assert g is not None and torch.isfinite(g).all() and not g.any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_temporal_subspace_identical_candidates_is_log_1_plus_n(dtype):
    B, n, d, t = 3, 4, 10, 5
    torch.manual_seed(2)
    p_emb, p_T = torch.randn(B, d, dtype=dtype), torch.randn(B, t, dtype=dtype)
    qc_emb = torch.randn(B, 1, d, dtype=dtype).expand(B, 1 + n, d).clone().requires_grad_(True)
    qc_T = torch.randn(B, 1, t, dtype=dtype).expand(B, 1 + n, t).clone().requires_grad_(True)
    total, lq, lp = TemporalSubspaceLoss(t, 0.01).terms(p_emb, p_T, None, qc_emb, qc_T, None)
    expect = torch.tensor(math.log(1 + n), dtype=dtype)
    assert torch.equal(lq, expect) and torch.equal(lp, expect)
    g = grads(total, (qc_emb, qc_T))
    assert all(torch.isfinite(x).all() for x in g)


def test_temporal_subspace_half_inputs_computed_in_float32():
    p_emb, p_T, qc_emb, qc_T = (x.detach().float() for x in _eq10_inputs(B=8, n=4, d=16, t=8, seed=3))
    mod = TemporalSubspaceLoss(8, 0.05)
    ref = mod(p_emb, p_T, None, qc_emb, qc_T, None)
    bf = [x.bfloat16().requires_grad_(True) for x in (p_emb, p_T, qc_emb, qc_T)]
    got = mod(bf[0], bf[1], None, bf[2], bf[3], None)
    exact = mod(*(x.detach().float() for x in bf[:2]), None, *(x.detach().float() for x in bf[2:]), None)
    assert got.dtype == torch.float32 and got.item() == exact.item()     # same rounded inputs, float32 math
    assert abs(got.item() - ref.item()) < 0.05
    g = grads(got, bf)
    assert all(x.dtype == torch.bfloat16 and torch.isfinite(x).all() for x in g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ac = mod(p_emb, p_T, None, qc_emb, qc_T, None)
    assert ac.dtype == torch.float32 and abs(ac.item() - ref.item()) < 1e-6


# ---------------------------------------------------------------------------------------------------------
# TemporalProjector and temporal_pool (Eq. 9, A3)


def test_projector_is_the_a3_formula():
    torch.manual_seed(3)
    P = TemporalProjector(16, 4, act="gelu", layer_norm_eps=1e-7).double()
    assert P.proj_hidden == 16
    h = torch.randn(7, 16, dtype=D64)
    W1, b1, W2, b2 = P.dense.weight, P.dense.bias, P.out.weight, P.out.bias
    g, b = P.norm.weight, P.norm.bias
    with torch.no_grad():
        g.uniform_(0.5, 1.5)
        b.uniform_(-0.5, 0.5)
    u = h @ W1.t() + b1
    u = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))                   # exact GELU
    mu = u.mean(-1, keepdim=True)
    var = ((u - mu) ** 2).mean(-1, keepdim=True)
    u = (u - mu) / torch.sqrt(var + 1e-7) * g + b
    close(P(h), u @ W2.t() + b2)
    # any transformers activation name (a backbone config's hidden_act) works
    from transformers.activations import ACT2FN
    P3 = TemporalProjector(16, 4, act="quick_gelu").double()
    close(P3(h), P3.out(P3.norm(ACT2FN["quick_gelu"](P3.dense(h)))))
    assert not torch.allclose(P3(h), P3.out(P3.norm(torch.nn.functional.gelu(P3.dense(h)))))
    P2 = TemporalProjector(16, 4, act="relu", proj_hidden=8)
    assert P2.dense.out_features == 8 and P2.out.in_features == 8 and P2(torch.randn(2, 3, 16)).shape == (2, 3, 4)


def test_temporal_pool_projects_then_averages():
    torch.manual_seed(4)
    B, L, d, t = 3, 6, 8, 4
    P = TemporalProjector(d, t).double()
    h = leaf(B, L, d)
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    x_T, has = temporal_pool(h, mask, P)
    assert has.tolist() == [True, False, True]
    expect0 = (P(h[0, 0]) + P(h[0, 2]) + P(h[0, 3])) / 3
    close(x_T[0], expect0)
    close(x_T[2], P(h[2, 4]))
    assert torch.equal(x_T[1], torch.zeros(t, dtype=D64))
    # projection-then-mean, not mean-then-projection (they differ for a nonlinear P)
    mean_then_proj = P((h[0, 0] + h[0, 2] + h[0, 3]) / 3)
    assert (x_T[0] - mean_then_proj).abs().max() > 1e-3
    # only the temporal tokens receive gradient
    (gh,) = grads(x_T.sum(), (h,))
    assert torch.equal(gh[~mask], torch.zeros_like(gh[~mask])) and gh[mask].abs().sum(-1).gt(0).all()


def test_temporal_pool_bad_input():
    P = TemporalProjector(8, 4)
    h = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="token_states"):
        temporal_pool(h[0], torch.ones(2, 5, dtype=torch.bool), P)
    with pytest.raises(TypeError, match="temporal_mask"):
        temporal_pool(h, torch.ones(2, 5), P)
    with pytest.raises(ValueError, match="temporal_mask"):
        temporal_pool(h, torch.ones(2, 4, dtype=torch.bool), P)
    with pytest.raises(TypeError, match="token_states"):
        temporal_pool(h.long(), torch.ones(2, 5, dtype=torch.bool), P)
    with pytest.raises(TypeError, match="projector"):
        temporal_pool(h, torch.ones(2, 5, dtype=torch.bool), "P")
    with pytest.raises(ValueError, match="hidden_size"):
        TemporalProjector(0, 4)
    with pytest.raises(TypeError, match="t must"):
        TemporalProjector(8, 4.0)
    with pytest.raises(ValueError, match="act"):
        TemporalProjector(8, 4, act="nope")
    with pytest.raises(ValueError, match="layer_norm_eps"):
        TemporalProjector(8, 4, layer_norm_eps=0.0)
    with pytest.raises(ValueError, match="hidden_size"):
        P(torch.randn(3, 7))


# ---------------------------------------------------------------------------------------------------------
# MatryoshkaDistillLoss (Eq. 11, A5)


@pytest.mark.parametrize("detach", [True, False])
def test_distill_gather_form_equals_dense_masked_form(detach):
    x = leaf(9, 12, seed=5)
    dims = (3, 6, 12)
    mod = MatryoshkaDistillLoss(dims, k=4, detach_teacher=detach, block=4)   # several row blocks
    loss, ref = mod(x), eq11_literal(x, dims, 4, detach_teacher=detach)
    close(loss, ref)
    close(grads(loss, (x,))[0], grads(ref, (x,))[0])


def test_distill_detached_teacher():
    x = leaf(8, 10, seed=6)
    dims = (2, 5)                                  # students use at most 5 of the 10 columns
    gd = grads(MatryoshkaDistillLoss(dims, k=3)(x), (x,))[0]
    assert torch.equal(gd[:, 5:], torch.zeros(8, 5, dtype=D64))   # no gradient through the full-dim teacher
    gk = grads(MatryoshkaDistillLoss(dims, k=3, detach_teacher=False)(x), (x,))[0]
    assert gk[:, 5:].abs().max() > 1e-6


def test_distill_small_n():
    x = leaf(5, 8, seed=7)
    close(MatryoshkaDistillLoss((2, 4, 8), k=10)(x), eq11_literal(x, (2, 4, 8), 4))     # k_eff = N - 1
    one = leaf(1, 8)
    loss = MatryoshkaDistillLoss((2, 4, 8), k=10)(one)
    assert loss.item() == 0.0 and loss.requires_grad
    g = grads(loss, (one,))[0]
    assert torch.isfinite(g).all() and not g.any()
    # only the full dim: nothing to distil
    assert MatryoshkaDistillLoss((8,), k=2)(x).item() == 0.0


def test_distill_float32_and_autocast():
    torch.manual_seed(8)
    x = torch.randn(40, 32)
    ref = MatryoshkaDistillLoss((8, 16, 32), k=5)(x.double())
    got = MatryoshkaDistillLoss((8, 16, 32), k=5)(x)
    assert got.dtype == torch.float32 and abs(got.item() - ref.item()) < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_ac = MatryoshkaDistillLoss((8, 16, 32), k=5)(x)
    assert got_ac.dtype == torch.float32 and abs(got_ac.item() - ref.item()) < 1e-5


# ---------------------------------------------------------------------------------------------------------
# MatryoshkaCKALoss (Eqs. 12-14, A6)


@pytest.mark.parametrize("N,d", [(6, 16), (20, 8)])
def test_cka_feature_and_gram_forms_equal_eq14(N, d):
    x = leaf(N, d, seed=9)
    dims = (2, 5, d)
    ref = eq14_literal(x, dims)
    (gref,) = grads(ref, (x,))
    vals = {}
    for form in ("feature", "gram", "auto"):
        loss = MatryoshkaCKALoss(dims, form=form)(x)
        close(loss, ref, 1e-11)
        close(grads(loss, (x,))[0], gref, 1e-10)
        vals[form] = loss
    close(vals["feature"], vals["gram"], 1e-12)


def test_cka_invariant_to_isotropic_scaling():
    x = leaf(12, 10, seed=10)
    mod = MatryoshkaCKALoss((3, 7, 10))
    base = mod(x)
    assert base.item() > 1e-3
    for c in (1e-3, 7.3, 1e4):
        close(mod(x * c), base, 1e-11)
    # CKA itself (Eq. 13) is invariant to isotropic scaling of either argument
    X, Y = torch.randn(12, 10, dtype=D64), torch.randn(12, 4, dtype=D64)
    close(cka_literal(3.5 * X, 0.2 * Y), cka_literal(X, Y))


def test_cka_degenerate_inputs_are_zero_without_nan():
    mod = MatryoshkaCKALoss((2, 4, 8))
    one = leaf(1, 8)
    loss = mod(one)
    assert loss.item() == 0.0 and loss.requires_grad
    for dtype in (torch.float64, torch.float32):
        row = torch.randn(1, 8, dtype=dtype)
        const = row.expand(5, 8).clone().requires_grad_(True)
        for form in ("feature", "gram"):
            loss = MatryoshkaCKALoss((2, 4, 8), form=form)(const)
            assert loss.item() == 0.0
            g = grads(loss, (const,))[0]
            assert torch.isfinite(g).all() and not g.any()
    # rows that are all positive multiples of one row: normalised, they are identical
    row = torch.randn(1, 8, dtype=D64)
    scaled = (row * torch.tensor([[1.0], [2.0], [0.5], [9.0]], dtype=D64)).requires_grad_(True)
    assert mod(scaled).item() == 0.0


def test_cka_autocast_bfloat16_close_to_float32():
    torch.manual_seed(11)
    x = torch.randn(64, 48)
    mod = MatryoshkaCKALoss((8, 16, 32, 48))
    ref = mod(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mod(x)
    assert got.dtype == torch.float32 and abs(got.item() - ref.item()) <= 1e-3
    # bfloat16 inputs are computed in float32 too
    xb = x.bfloat16()
    assert abs(mod(xb).item() - mod(xb.float()).item()) <= 1e-6


# ---------------------------------------------------------------------------------------------------------
# TMRLLoss (Eq. 15)


def _tmrl_batch(B=4, K=2, n=3, d=16, t=4, seed=12):
    torch.manual_seed(seed)
    q, p, neg = leaf(B, d), leaf(B, d), leaf(B * K, d)
    qc = torch.cat([q.detach().unsqueeze(1), torch.randn(B, n, d, dtype=D64)], dim=1).requires_grad_(True)
    p_T, qc_T = leaf(B, t), leaf(B, 1 + n, t)
    p_has = torch.arange(B) % 4 != 2                            # row 2 (of every 4) has no temporal token
    qc_has = torch.ones(B, 1 + n, dtype=torch.bool)
    qc_has[1, 2] = False
    return q, p, neg, qc, p_T, p_has, qc_T, qc_has


def test_tmrl_loss_is_eq15():
    q, p, neg, qc, p_T, p_has, qc_T, qc_has = _tmrl_batch()
    dims, t, tau = (4, 8, 16), 4, 0.05
    alpha, beta, gamma = 0.25, 0.1, 0.1
    mod = TMRLLoss(dims, t, alpha=alpha, beta=beta, gamma=gamma, temperature=tau, k=3)
    loss, parts = mod(q, p, neg, p_T=p_T, p_has=p_has, qc=qc, qc_T=qc_T, qc_has=qc_has)
    mrl, levels = mrl_literal(q, p, neg, dims, tau)
    temp = sum(eq10_literal(p, p_T, p_has, qc, qc_T, qc_has, t, tau))
    X = torch.cat([q, p, neg, qc[:, 1:].reshape(-1, 16)])
    dist, cka = eq11_literal(X, dims, 3), eq14_literal(X, dims)
    ref = mrl + alpha * temp + beta * dist + gamma * cka
    close(loss, ref, 1e-10)
    assert set(parts) == {"mrl", "mrl@4", "mrl@8", "mrl@16", "temp", "dist", "cka", "total"}
    for key, val in (("mrl", mrl), ("temp", temp), ("dist", dist), ("cka", cka), ("total", ref)):
        assert not parts[key].requires_grad and parts[key].dtype == torch.float32
        assert abs(parts[key].item() - val.item()) < 1e-5 * max(1.0, abs(val.item()))
    for m, lv in zip(dims, levels):
        assert abs(parts[f"mrl@{m}"].item() - lv.item()) < 1e-5
    ins = (q, p, neg, qc, p_T, qc_T)
    for a, b in zip(grads(loss, ins), grads(ref, ins)):
        close(a, b, 1e-9)


def test_tmrl_loss_switches():
    q, p, neg, qc, p_T, p_has, qc_T, qc_has = _tmrl_batch(seed=13)
    dims, tau = (4, 8, 16), 0.05
    mrl, _ = mrl_literal(q, p, neg, dims, tau, weights=[0.5, 1.0, 2.0])
    # alpha = beta = gamma = 0: the MRL loss alone (weights follow their dims when given unsorted)
    loss, parts = TMRLLoss((16, 4, 8), 4, alpha=0.0, beta=0.0, gamma=0.0, weights=[2.0, 0.5, 1.0])(
        q, p, neg, p_T=p_T, p_has=p_has, qc=qc, qc_T=qc_T, qc_has=qc_has)
    close(loss, mrl, 1e-10)
    assert parts["temp"].item() == parts["dist"].item() == parts["cka"].item() == 0.0
    # p_T None skips L_Temp even with alpha > 0; no hard negatives
    mrl2, _ = mrl_literal(q, p, None, dims, tau)
    loss, parts = TMRLLoss(dims, 4, alpha=0.5, beta=0.0, gamma=0.0)(q, p)
    close(loss, mrl2, 1e-10)
    assert parts["temp"].item() == 0.0


def test_tmrl_loss_passes_spans_to_the_mrl_term():
    """Passage ids as spans (rows 0 and 1 share a passage): each is a positive of the other (Eq. 3 with the
    multi-positive numerator), at every level."""
    q, p, neg, *_ = _tmrl_batch(B=4, seed=15)
    ids = torch.tensor([0, 0, 1, 2])
    dims, tau = (4, 8, 16), 0.05
    loss, parts = TMRLLoss(dims, 4, alpha=0.0, beta=0.0, gamma=0.0)(q, p, neg, q_span=(ids, ids), d_span=(ids, ids))
    cand = torch.cat([p, neg])
    levels = []
    for m in dims:
        rows = []
        for i in range(4):
            z = torch.stack([cos_literal(q[i, :m], cand[j, :m]) for j in range(cand.shape[0])]) / tau
            pos = [j for j in range(4) if ids[j] == ids[i]]
            rows.append(-torch.log(torch.exp(z[pos]).sum() / torch.exp(z).sum()))
        levels.append(sum(rows) / 4)
    close(loss, sum(levels), 1e-10)
    plain, _ = TMRLLoss(dims, 4, alpha=0.0, beta=0.0, gamma=0.0)(q, p, neg)
    assert abs(plain.item() - loss.item()) > 1e-3


def test_tmrl_loss_mixed_precision():
    """bfloat16 embeddings (an autocast encoder's output): finite loss and gradients, every part present."""
    q, p, neg, qc, p_T, p_has, qc_T, qc_has = _tmrl_batch(B=6, seed=14)
    bf = [x.detach().bfloat16().requires_grad_(True) for x in (q, p, neg, qc, p_T, qc_T)]
    mod = TMRLLoss((4, 8, 16), 4, alpha=0.25, k=3)
    loss, parts = mod(bf[0], bf[1], bf[2], p_T=bf[4], p_has=p_has, qc=bf[3], qc_T=bf[5], qc_has=qc_has)
    ref, _ = mod(*(x.detach() for x in (q, p, neg)), p_T=p_T.detach(), p_has=p_has, qc=qc.detach(),
                 qc_T=qc_T.detach(), qc_has=qc_has)
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 0.05 * abs(ref.item())
    assert all(torch.isfinite(v) for v in parts.values())
    for g in grads(loss, bf):
        assert g is not None and g.dtype == torch.bfloat16 and torch.isfinite(g).all()


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="dims"):
        MatryoshkaDistillLoss([])
    with pytest.raises(ValueError, match="dims"):
        MatryoshkaCKALoss([4, 4])
    with pytest.raises(TypeError, match="dims"):
        MatryoshkaCKALoss([4, 8.0])
    with pytest.raises(ValueError, match="dims"):
        MatryoshkaCKALoss([0, 8])
    with pytest.raises(TypeError, match="dims"):
        MatryoshkaCKALoss(8)
    with pytest.raises(ValueError, match="form"):
        MatryoshkaCKALoss([4, 8], form="dense")
    with pytest.raises(ValueError, match="k must"):
        MatryoshkaDistillLoss([4, 8], k=0)
    with pytest.raises(TypeError, match="detach_teacher"):
        MatryoshkaDistillLoss([4, 8], detach_teacher=1)
    with pytest.raises(ValueError, match="dims"):
        MatryoshkaDistillLoss([4, 16])(torch.randn(5, 8))
    with pytest.raises(ValueError, match="x must be 2-D"):
        MatryoshkaCKALoss([4, 8])(torch.randn(5))
    with pytest.raises(TypeError, match="x must be a floating"):
        MatryoshkaCKALoss([4, 8])(torch.ones(5, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        TemporalSubspaceLoss(4, 0.0)
    with pytest.raises(ValueError, match="t must"):
        TemporalSubspaceLoss(0, 0.05)
    mod = TemporalSubspaceLoss(4, 0.05)
    p_emb, p_T, qc_emb, qc_T = _eq10_inputs(B=2, n=1, d=8, t=4)
    with pytest.raises(ValueError, match="p_T"):
        mod(p_emb, p_T[:, :3], None, qc_emb, qc_T, None)
    with pytest.raises(ValueError, match="qc_emb"):
        mod(p_emb, p_T, None, qc_emb[:1], qc_T, None)
    with pytest.raises(ValueError, match="qc_T"):
        mod(p_emb, p_T, None, qc_emb, qc_T[:, :1], None)
    with pytest.raises(TypeError, match="p_has"):
        mod(p_emb, p_T, torch.ones(2), qc_emb, qc_T, None)
    with pytest.raises(ValueError, match="qc_has"):
        mod(p_emb, p_T, None, qc_emb, qc_T, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="fewer than t"):
        TemporalSubspaceLoss(10, 0.05)(p_emb, leaf(2, 10), None, qc_emb, leaf(2, 2, 10), None)
    with pytest.raises(TypeError, match="alpha"):
        TMRLLoss([4, 8], 4)
    with pytest.raises(ValueError, match="alpha"):
        TMRLLoss([4, 8], 4, alpha=-0.1)
    with pytest.raises(ValueError, match="beta"):
        TMRLLoss([4, 8], 4, alpha=0.1, beta=float("nan"))
    with pytest.raises(ValueError, match="gamma"):
        TMRLLoss([4, 8], 4, alpha=0.1, gamma=float("inf"))
    with pytest.raises(ValueError, match="weights"):
        TMRLLoss([4, 8], 4, alpha=0.1, weights=[1.0])
    with pytest.raises(ValueError, match="weights"):
        TMRLLoss([4, 8], 4, alpha=0.1, weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="t=16"):
        TMRLLoss([4, 8], 16, alpha=0.1)
    with pytest.raises(ValueError, match="temperature"):
        TMRLLoss([4, 8], 4, alpha=0.1, temperature=-1)
    q = torch.randn(3, 8)
    with pytest.raises(ValueError, match="qc and qc_T"):
        TMRLLoss([4, 8], 4, alpha=0.1)(q, q, p_T=torch.randn(3, 4))


# ---------------------------------------------------------------------------------------------------------
# TMRLLoss(mrl_anchor="passage"): A1's other reading (passage anchors, negative queries as hard negatives)


def mrl_literal_passage(p, qc, dims, tau, weights=None, valid=None, ids=None):
    """Eqs. 3 and 5 with passage anchors: anchor p_i; candidates c = [qc[0, 0], ..., qc[B-1, 0]] (the in-batch
    positive queries) then every negative query qc[i, j], j >= 1 (row-major; only the slots valid[i, j] when
    given); positives of p_i: c_i, or with passage ids every c_j (j < B) with ids[j] == ids[i]."""
    B, n1 = qc.shape[:2]
    cand = [qc[i, 0] for i in range(B)]
    cand += [qc[i, j] for i in range(B) for j in range(1, n1) if valid is None or bool(valid[i, j])]
    levels = []
    for m in dims:
        terms = []
        for i in range(B):
            z = torch.stack([cos_literal(p[i, :m], c[:m]) for c in cand]) / tau
            pos = [i] if ids is None else [j for j in range(B) if int(ids[j]) == int(ids[i])]
            terms.append(-torch.log(sum(torch.exp(z[j]) for j in pos) / sum(torch.exp(zj) for zj in z)))
        levels.append(sum(terms) / len(terms))
    w = [1.0] * len(dims) if weights is None else weights
    return sum(wi * li for wi, li in zip(w, levels)), levels


def test_tmrl_loss_passage_anchor_mrl_is_eq3_5():
    """alpha = beta = gamma = 0: the loss is the passage-anchored L_MRL alone; loss, per-level parts and the
    gradients of p and qc equal the literal transcription (float64); q and the hard-negative passages get no
    gradient (they take no part in the passage-anchored L_MRL)."""
    q, p, neg, qc, *_ = _tmrl_batch(B=5, n=3, seed=21)
    dims, tau = (4, 8, 16), 0.05
    mod = TMRLLoss((16, 4, 8), 4, alpha=0.0, beta=0.0, gamma=0.0, temperature=tau, weights=[2.0, 0.5, 1.0],
                   mrl_anchor="passage")
    loss, parts = mod(q, p, neg, qc=qc)
    ref, levels = mrl_literal_passage(p, qc, dims, tau, weights=[0.5, 1.0, 2.0])
    close(loss, ref, 1e-10)
    for m, lv in zip(dims, levels):
        assert abs(parts[f"mrl@{m}"].item() - lv.item()) < 1e-5
    gq, gp, gneg, gqc = grads(loss, (q, p, neg, qc))
    assert gq is None and gneg is None
    rp, rqc = grads(ref, (p, qc))
    close(gp, rp, 1e-9)
    close(gqc, rqc, 1e-9)
    assert gqc[:, 1:].abs().sum() > 0                        # the negative queries are in the denominators
    # not the query reading: different value
    other, _ = TMRLLoss(dims, 4, alpha=0.0, beta=0.0, gamma=0.0, temperature=tau)(q, p, neg, qc=qc)
    assert abs(other.item() - TMRLLoss(dims, 4, alpha=0.0, beta=0.0, gamma=0.0, temperature=tau,
                                       mrl_anchor="passage")(q, p, neg, qc=qc)[0].item()) > 1e-3


def test_tmrl_loss_passage_anchor_full_eq15():
    """Every term on: total = passage-anchored L_MRL + alpha L_Temp + beta L_Dist + gamma L_CKA, with X of
    L_Dist / L_CKA unchanged (q, p, hard negatives, negative queries); gradients of every input (float64)."""
    q, p, neg, qc, p_T, p_has, qc_T, qc_has = _tmrl_batch(B=4, n=3, seed=22)
    dims, t, tau = (4, 8, 16), 4, 0.07
    alpha, beta, gamma = 0.25, 0.1, 0.1
    mod = TMRLLoss(dims, t, alpha=alpha, beta=beta, gamma=gamma, temperature=tau, k=3, mrl_anchor="passage")
    loss, parts = mod(q, p, neg, p_T=p_T, p_has=p_has, qc=qc, qc_T=qc_T, qc_has=qc_has)
    mrl, _ = mrl_literal_passage(p, qc, dims, tau)
    temp = sum(eq10_literal(p, p_T, p_has, qc, qc_T, qc_has, t, tau))
    X = torch.cat([q, p, neg, qc[:, 1:].reshape(-1, 16)])
    dist, cka = eq11_literal(X, dims, 3), eq14_literal(X, dims)
    ref = mrl + alpha * temp + beta * dist + gamma * cka
    close(loss, ref, 1e-10)
    for key, val in (("mrl", mrl), ("temp", temp), ("dist", dist), ("cka", cka), ("total", ref)):
        assert abs(parts[key].item() - val.item()) < 1e-5 * max(1.0, abs(val.item()))
    ins = (q, p, neg, qc, p_T, qc_T)
    for a, b in zip(grads(loss, ins), grads(ref, ins)):
        close(a, b, 1e-9)


def test_tmrl_loss_passage_anchor_padding_and_spans():
    """qc_valid drops padded negative-query slots from the denominators (a row with fewer negatives); passage
    ids as spans make rows sharing a passage positives of each other, as in the query reading."""
    q, p, neg, qc, *_ = _tmrl_batch(B=4, n=3, seed=23)
    dims, tau = (4, 8, 16), 0.05
    valid = torch.ones(4, 4, dtype=torch.bool)
    valid[1, 2:] = False                                        # row 1 has one real negative query
    valid[3, 3] = False
    mod = TMRLLoss(dims, 4, alpha=0.0, beta=0.0, gamma=0.0, temperature=tau, mrl_anchor="passage")
    loss, _ = mod(q, p, qc=qc, qc_valid=valid)
    ref, _ = mrl_literal_passage(p, qc, dims, tau, valid=valid)
    close(loss, ref, 1e-10)
    for a, b in zip(grads(loss, (p, qc)), grads(ref, (p, qc))):
        close(a, b, 1e-9)
    full, _ = mod(q, p, qc=qc)
    assert abs(full.item() - loss.item()) > 1e-4
    ids = torch.tensor([0, 0, 1, 2])
    loss, _ = mod(q, p, qc=qc, q_span=(ids, ids), d_span=(ids, ids))
    ref, _ = mrl_literal_passage(p, qc, dims, tau, ids=ids)
    close(loss, ref, 1e-10)
    for a, b in zip(grads(loss, (p, qc)), grads(ref, (p, qc))):
        close(a, b, 1e-9)
    # no negative query at all (n = 0): in-batch positive queries only
    loss, _ = mod(q, p, qc=qc[:, :1])
    ref, _ = mrl_literal_passage(p, qc[:, :1], dims, tau)
    close(loss, ref, 1e-10)


def test_tmrl_loss_passage_anchor_float32_within_twice_torch_error():
    """float32 inputs: the fused passage-anchored L_MRL's error vs the float64 reference is at most twice that
    of the eager reference op (tempokern.reference.matryoshka_infonce) run in float32, loss and gradients."""
    from tempokern.reference import matryoshka_infonce as ref_op
    q, p, neg, qc, *_ = _tmrl_batch(B=24, n=4, d=64, seed=24)
    dims, tau = (8, 16, 32, 64), 0.05
    mod = TMRLLoss(dims, 8, alpha=0.0, beta=0.0, gamma=0.0, temperature=tau, mrl_anchor="passage")

    def eager(p_, qc_):
        return ref_op(p_, qc_[:, 0], list(dims), temperature=tau, extra_neg=qc_[:, 1:].reshape(-1, 64))

    exact = eager(p, qc)
    ex_g = grads(exact, (p, qc))
    p32, qc32 = (x.detach().float().requires_grad_(True) for x in (p, qc))
    fused = mod(q.detach().float(), p32, qc=qc32)[0]
    f_g = grads(fused, (p32, qc32))
    p32b, qc32b = (x.detach().float().requires_grad_(True) for x in (p, qc))
    torch32 = eager(p32b, qc32b)
    t_g = grads(torch32, (p32b, qc32b))
    close(fused.double(), exact, 1e-4)
    for a, b, e in zip([fused, *f_g], [torch32, *t_g], [exact, *ex_g]):
        err_f = (a.double() - e).abs().max().item()
        err_t = (b.double() - e).abs().max().item()
        assert err_f <= 2 * err_t + 8 * torch.finfo(torch.float32).eps * e.abs().max().item(), (err_f, err_t)


def test_tmrl_loss_passage_anchor_bad_input():
    q, p, neg, qc, *_ = _tmrl_batch(B=4, n=2, seed=25)
    with pytest.raises(ValueError, match="mrl_anchor"):
        TMRLLoss([4, 8], 4, alpha=0.1, mrl_anchor="both")
    mod = TMRLLoss([4, 8, 16], 4, alpha=0.0, beta=0.0, gamma=0.0, mrl_anchor="passage")
    with pytest.raises(ValueError, match="needs qc"):
        mod(q, p, neg)
    with pytest.raises(ValueError, match="qc must have shape"):
        mod(q, p, qc=qc[:3])
    with pytest.raises(ValueError, match="qc must be 3-D"):
        mod(q, p, qc=qc[:, 0])
    with pytest.raises(TypeError, match="qc_valid"):
        mod(q, p, qc=qc, qc_valid=torch.ones(4, 3))
    with pytest.raises(ValueError, match="qc_valid"):
        mod(q, p, qc=qc, qc_valid=torch.ones(4, 2, dtype=torch.bool))
    bad = torch.ones(4, 3, dtype=torch.bool)
    bad[2, 0] = False
    with pytest.raises(ValueError, match=r"qc_valid\[:, 0\]"):
        mod(q, p, qc=qc, qc_valid=bad)
