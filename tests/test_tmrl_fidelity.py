"""TMRL as the paper trains it: the repeat mask through every loss term, Eq. 11 as printed (aux_scale
"literal"), the encoder's temperature read by the trainer. Each reference is a literal float64 transcription
of the paper's equation, written here in plain torch (element by element, ragged rows as Python lists)."""
import pytest
import torch

from _tmrl_helpers import no_dropout, tiny_encoder, tiny_rows
from test_tmrl_losses import cos_literal, eq14_literal, mrl_literal

from tempokern.datasets.tmrl import TMRLRow
from tempokern.nn import TMRLLoss
from tempokern.nn.tmrl import MatryoshkaDistillLoss, TemporalSubspaceLoss
from tempokern.training.tmrl import TMRLConfig, TMRLTrainer

D64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one torch thread for the module


def eq10_ragged(p_emb, p_T, q_pos, q_pos_T, negs, negs_T, t, tau):
    """Eq. 10 on ragged rows (no padding anywhere): row i has its positive query and its own list of
    distinct negative queries. L^q_i = -log e^{s(p_T, q+)} / (e^{s(p_T, q+)} + sum_k e^{s(p_T, q-_k)}),
    L^p_i likewise with the passage's first t dims against the queries' temporal representations; each the
    mean over the rows."""
    lq, lp = [], []
    for i in range(p_emb.shape[0]):
        pos = torch.exp(cos_literal(p_T[i], q_pos[i, :t]) / tau)
        den = pos + sum(torch.exp(cos_literal(p_T[i], v[:t]) / tau) for v in negs[i])
        lq.append(-torch.log(pos / den))
        pos = torch.exp(cos_literal(p_emb[i, :t], q_pos_T[i]) / tau)
        den = pos + sum(torch.exp(cos_literal(p_emb[i, :t], v) / tau) for v in negs_T[i])
        lp.append(-torch.log(pos / den))
    return sum(lq) / len(lq) + sum(lp) / len(lp)


def eq11_printed(x, dims, k):
    """Eq. 11 as printed: L_Dist = sum_{m != d} sum_i sum_{j in N_i} |sim^(d)(x_i, x_j) - sim^(m)(x_i, x_j)|,
    N_i = the k most similar other rows at full dim (teacher detached)."""
    N, d = x.shape
    total = torch.zeros((), dtype=x.dtype)
    for i in range(N):
        full = [float(cos_literal(x[i], x[j])) if j != i else -float("inf") for j in range(N)]
        nbrs = sorted(range(N), key=lambda j: -full[j])[:k]
        for m in dims:
            if m == d:
                continue
            for j in nbrs:
                total = total + (full[j] - cos_literal(x[i, :m], x[j, :m])).abs()
    return total


def _ragged_batch(seed=3, B=4, d=16, t=4, counts=(3, 1, 2, 3)):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=D64, generator=g)  # noqa: E731
    q, p, neg = r(B, d), r(B, d), r(2 * B, d)
    p_T, q_T = r(B, t), r(B, t)
    negs = [[r(d) for _ in range(c)] for c in counts]
    negs_T = [[r(t) for _ in range(c)] for c in counts]
    return q, p, neg, p_T, q_T, negs, negs_T


def _padded(q, q_T, negs, negs_T):
    """The trainer's layout: each row's negatives repeated cyclically up to n, and the validity mask."""
    B, n = q.shape[0], max(len(x) for x in negs)
    qc = torch.stack([torch.stack([q[i]] + [negs[i][k % len(negs[i])] for k in range(n)]) for i in range(B)])
    qc_T = torch.stack([torch.stack([q_T[i]] + [negs_T[i][k % len(negs_T[i])] for k in range(n)])
                        for i in range(B)])
    valid = torch.tensor([[True] + [k < len(negs[i]) for k in range(n)] for i in range(B)])
    return qc, qc_T, valid


def test_repeats_masked_out_of_eq10():
    """A batch padded with repeats + qc_valid gives Eq. 10 on the ragged rows; without the mask it does not
    (the repeats count twice)."""
    q, p, _, p_T, q_T, negs, negs_T = _ragged_batch()
    qc, qc_T, valid = _padded(q, q_T, negs, negs_T)
    assert not bool(valid.all())
    mod = TemporalSubspaceLoss(4, 0.05)
    ref = eq10_ragged(p, p_T, q, q_T, negs, negs_T, 4, 0.05)
    got = mod(p, p_T, None, qc, qc_T, None, qc_valid=valid)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert abs(float(mod(p, p_T, None, qc, qc_T, None)) - float(ref)) > 1e-3


@pytest.mark.parametrize("aux_scale", ["mean", "literal"])
def test_tmrl_loss_with_repeats_is_the_loss_without_them(aux_scale):
    """Eq. 15 on a padded batch with the validity mask = Eq. 15 on the same rows without the repeats:
    L_MRL + alpha Eq.10(ragged) + beta Eq.11 + gamma Eq.14, X = q, p, hard negatives and the distinct
    negative queries. aux_scale="literal" is Eq. 11 summed over the pairs; "mean" divides it by N*k."""
    q, p, neg, p_T, q_T, negs, negs_T = _ragged_batch()
    qc, qc_T, valid = _padded(q, q_T, negs, negs_T)
    dims, t, tau, k = (4, 8, 16), 4, 0.05, 3
    alpha, beta, gamma = 0.25, 0.5, 0.5
    mod = TMRLLoss(dims, t, alpha=alpha, beta=beta, gamma=gamma, temperature=tau, k=k, aux_scale=aux_scale)
    loss, parts = mod(q, p, neg, p_T=p_T, qc=qc, qc_T=qc_T, qc_valid=valid)
    X = torch.cat([q, p, neg, torch.stack([v for row in negs for v in row])])
    assert X.shape[0] == 4 + 4 + 8 + 9
    dist = eq11_printed(X, dims, k)
    if aux_scale == "mean":
        dist = dist / (X.shape[0] * k)
    ref = (mrl_literal(q, p, neg, dims, tau)[0] + alpha * eq10_ragged(p, p_T, q, q_T, negs, negs_T, t, tau)
           + beta * dist + gamma * eq14_literal(X, dims))
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    assert abs(float(parts["dist"]) - float(dist)) < 1e-5 * max(1.0, float(dist))


def test_distill_sum_is_n_k_times_the_mean():
    x = torch.randn(20, 16, dtype=D64, generator=torch.Generator().manual_seed(1))
    mean = MatryoshkaDistillLoss((4, 8, 16), k=5)(x)
    total = MatryoshkaDistillLoss((4, 8, 16), k=5, reduction="sum")(x)
    torch.testing.assert_close(total, eq11_printed(x, (4, 8, 16), 5), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, mean * 20 * 5, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="reduction"):
        MatryoshkaDistillLoss((4, 16), reduction="avg")
    with pytest.raises(ValueError, match="aux_scale"):
        TMRLLoss((4, 16), 4, alpha=0.1, aux_scale="sum")


def test_qc_valid_column_zero_must_be_true():
    q, p, neg, p_T, q_T, negs, negs_T = _ragged_batch()
    qc, qc_T, valid = _padded(q, q_T, negs, negs_T)
    valid[0, 0] = False
    with pytest.raises(ValueError, match="qc_valid"):
        TMRLLoss((4, 16), 4, alpha=0.1)(q, p, neg, p_T=p_T, qc=qc, qc_T=qc_T, qc_valid=valid)


# ---- the trainer ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rows():
    return tiny_rows()


def _cfg(**kw):
    base = dict(batch_size=6, epochs=1, lr=3e-3, hard_negatives=2, negative_queries=3, t=8, alpha=0.25,
                beta=0.5, gamma=0.5, progress=False, warmup_ratio=0.0, seed=0)
    base.update(kw)
    return TMRLConfig(**base)


def test_trainer_step_with_repeats_is_the_loss_without_them(rows):
    """One real trainer step (float64, dropout off) on rows with 1, 2 or 3 negative queries: its loss equals
    the loss built from the batch's distinct texts encoded one at a time (Eq. 10 ragged, X without repeats)."""
    odd = [TMRLRow(r.query, r.positive, hard_negatives=r.hard_negatives[:1],
                   negative_queries=(r.negative_queries + [r.hard_negatives[0].replace("in", "during")])[:1 + i % 3])
           for i, r in enumerate(rows[:6])]
    m = no_dropout(tiny_encoder(rows, dtype=D64, dropout=False,
                                extra_texts=[t for r in odd for t in r.negative_queries]))
    tr = TMRLTrainer(m, odd, _cfg(distill_k=4))
    batch = tr.epoch_batches(0)[0]
    m.train()
    loss, _ = tr.backward_batch(batch)
    _, lay = tr.batch_items(batch)
    assert lay["n"] == 3 and not all(all(v) for v in lay["nq_valid"])

    def enc(text, role):
        with torch.no_grad():
            out = m(**m.tokenize([text], role=role, temporal=True))
        return out.emb[0], out.temporal[0]

    qs = [enc(odd[ri].query, "query") for ri, _, _ in batch]
    ps = [enc(odd[ri].positive, "document") for ri, _, _ in batch]
    hn = [enc(odd[ri].hard_negatives[j], "document")[0] for ri, hs, _ in batch for j in hs]
    negs = [[enc(odd[ri].negative_queries[j], "query") for j in nq] for ri, _, nq in batch]
    q, q_T = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])
    p, p_T = torch.stack([a for a, _ in ps]), torch.stack([b for _, b in ps])
    neg = torch.stack(hn)
    tau = tr.temperature
    X = torch.cat([q, p, neg, torch.stack([a for row in negs for a, _ in row])])
    k = min(4, X.shape[0] - 1)
    ref = (mrl_literal(q, p, neg, tr.dims, tau)[0]
           + 0.25 * eq10_ragged(p, p_T, q, q_T, [[a for a, _ in r] for r in negs], [[b for _, b in r] for r in negs],
                                8, tau)
           + 0.5 * eq11_printed(X, tr.dims, k) / (X.shape[0] * k) + 0.5 * eq14_literal(X, tr.dims))
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-8, atol=1e-8)


def test_trainer_reads_the_encoder_temperature(rows):
    m = tiny_encoder(rows, temperature=0.02)
    tr = TMRLTrainer(m, rows, _cfg())
    assert tr.temperature == 0.02 and tr.loss_fn.temperature == 0.02
    assert tr.loss_fn.temporal.temperature == 0.02
    tr2 = TMRLTrainer(m, rows, _cfg(temperature=0.07))     # an explicit value wins
    assert tr2.loss_fn.temperature == 0.07
    assert TMRLTrainer(m, rows, _cfg(aux_scale="literal")).loss_fn.distill.reduction == "sum"


def test_config_lora_alpha_follows_the_paper_scaling():
    assert TMRLConfig().lora_options()["lora_alpha"] == 16.0
    assert TMRLConfig(lora_r=8).lora_options()["lora_alpha"] == 32.0
    assert TMRLConfig(lora_alpha=4).lora_options()["lora_alpha"] == 4.0
    with pytest.raises(ValueError, match="aux_scale"):
        TMRLConfig(aux_scale="sum").validate()
