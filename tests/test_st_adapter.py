"""tempokern.integrations.sentence_transformers.MatryoshkaLoss against sentence-transformers' own
MatryoshkaLoss(MultipleNegativesRankingLoss) on a tiny SentenceTransformer built from a config (no hub)."""
import copy
import logging
import random

import pytest
import torch

st = pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer  # noqa: E402

from tempokern.integrations.sentence_transformers import FusedMatryoshkaLoss, MatryoshkaLoss  # noqa: E402

WORDS = ("the a in of on to and was is it rain sun snow city river bridge market opened closed built storm "
         "march may june 1990 2001 2019 prices rose fell summer winter record").split()
HIDDEN = 48


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The model is tiny: one intra-op thread is faster than two fighting over a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    d = tmp_path_factory.mktemp("tiny_st")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(WORDS)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True).save_pretrained(str(d))
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(str(d))        # with its (unused) pooler: loads deterministically
    return str(d)


_BASE = {}


def make_model(model_dir, dtype=torch.float64):
    """A fresh copy of the tiny SentenceTransformer (loaded once per directory)."""
    if model_dir not in _BASE:
        _BASE[model_dir] = SentenceTransformer(modules=[Transformer(model_dir), Pooling(HIDDEN, "mean")],
                                               device="cpu")
    return copy.deepcopy(_BASE[model_dir]).to(dtype)


def text_columns(n_rows, n_cols, seed):
    rng = random.Random(seed)
    return [[" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(n_rows)]
            for _ in range(n_cols)]


def features(model, columns):
    return [model.tokenize(col) for col in columns]


def loss_and_grads(model, loss, columns):
    model.zero_grad()
    value = loss(features(model, columns), None)
    value.backward()
    return value.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model_dir, make_st, make_ours, columns, *, dtype=torch.float64, tol=1e-10, seed=None):
    model = make_model(model_dir, dtype)
    if seed is not None:
        random.seed(seed)
    v_st, g_st = loss_and_grads(model, make_st(model), columns)
    if seed is not None:
        random.seed(seed)
    v_ours, g_ours = loss_and_grads(model, make_ours(model), columns)
    assert torch.isfinite(v_st) and v_st.item() > 0
    assert abs(v_ours.item() - v_st.item()) <= tol * max(1.0, abs(v_st.item())), (v_ours.item(), v_st.item())
    assert g_st.keys() == g_ours.keys() and len(g_st) > 0
    for n in g_st:
        assert torch.allclose(g_ours[n], g_st[n], rtol=tol * 100, atol=tol), (n, (g_ours[n] - g_st[n]).abs().max())
    return v_st


DIMS = [48, 32, 16, 8]


@pytest.mark.parametrize("n_cols", [2, 4])
def test_same_loss_and_gradient_as_sentence_transformers(model_dir, n_cols):
    """Pairs, and (anchor, positive, 2 negatives): candidates = positives then negatives."""
    cols = text_columns(6, n_cols, seed=n_cols)
    compare(model_dir, lambda m: losses.MatryoshkaLoss(m, losses.MultipleNegativesRankingLoss(m), DIMS),
            lambda m: MatryoshkaLoss(m, losses.MultipleNegativesRankingLoss(m), DIMS), cols)


def test_weights_scale_unsorted_dims_dot_score(model_dir):
    cols = text_columns(5, 3, seed=7)
    dims, weights = [8, 48, 20], [0.5, 2.0, 1.0]            # 20 does not divide 48; any order
    mk = lambda m: losses.MultipleNegativesRankingLoss(m, scale=7.0, similarity_fct=st.util.dot_score)  # noqa
    compare(model_dir, lambda m: losses.MatryoshkaLoss(m, mk(m), dims, weights),
            lambda m: MatryoshkaLoss(m, mk(m), dims, weights), cols)


def test_symmetric_per_direction(model_dir):
    cols = text_columns(6, 3, seed=8)
    mk = lambda m: losses.MultipleNegativesRankingLoss(  # noqa: E731
        m, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")
    compare(model_dir, lambda m: losses.MatryoshkaLoss(m, mk(m), DIMS),
            lambda m: MatryoshkaLoss(m, mk(m), DIMS), cols)


def test_n_dims_per_step_draws_like_sentence_transformers(model_dir):
    cols = text_columns(5, 2, seed=9)
    for seed in (0, 3):
        compare(model_dir, lambda m: losses.MatryoshkaLoss(m, losses.MultipleNegativesRankingLoss(m), DIMS,
                                                           n_dims_per_step=2),
                lambda m: MatryoshkaLoss(m, losses.MultipleNegativesRankingLoss(m), DIMS, n_dims_per_step=2),
                cols, seed=seed)


def test_float32(model_dir):
    cols = text_columns(8, 3, seed=10)
    compare(model_dir, lambda m: losses.MatryoshkaLoss(m, losses.MultipleNegativesRankingLoss(m), DIMS),
            lambda m: MatryoshkaLoss(m, losses.MultipleNegativesRankingLoss(m), DIMS), cols,
            dtype=torch.float32, tol=2e-5)


def test_training_steps_match(model_dir):
    """A training script with the one-line swap follows the same trajectory (3 AdamW steps, float64)."""
    cols = [text_columns(4, 3, seed=20 + s) for s in range(3)]
    runs = []
    for which in ("st", "tempokern"):
        model = make_model(model_dir)
        mnrl = losses.MultipleNegativesRankingLoss(model)
        loss = (losses.MatryoshkaLoss if which == "st" else MatryoshkaLoss)(model, mnrl, DIMS)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        values = []
        for batch in cols:
            opt.zero_grad()
            v = loss(features(model, batch), None)
            v.backward()
            opt.step()
            values.append(v.item())
        runs.append((values, copy.deepcopy(model.state_dict())))
    (v1, s1), (v2, s2) = runs
    assert v1[-1] != v1[0]
    for a, b in zip(v1, v2):
        assert abs(a - b) < 1e-9
    for k in s1:
        assert torch.allclose(s1[k].double(), s2[k].double(), atol=1e-9), k
    # the model's forward was never patched
    assert "forward" not in vars(model)


def test_unsupported_settings_raise(model_dir, caplog):
    model = make_model(model_dir, torch.float32)
    MNRL = losses.MultipleNegativesRankingLoss
    assert MatryoshkaLoss is FusedMatryoshkaLoss
    with pytest.raises(TypeError, match="loss must be"):
        MatryoshkaLoss(model, losses.CachedMultipleNegativesRankingLoss(model), DIMS)
    with pytest.raises(TypeError, match="loss must be"):
        MatryoshkaLoss(model, losses.CoSENTLoss(model), DIMS)
    with pytest.raises(ValueError, match="directions"):
        MatryoshkaLoss(model, MNRL(model, directions=("query_to_doc", "doc_to_query")), DIMS)
    with pytest.raises(ValueError, match="directions"):
        MatryoshkaLoss(model, MNRL(model, directions=("query_to_doc", "query_to_query")), DIMS)
    with pytest.raises(ValueError, match="hardness_mode"):
        MatryoshkaLoss(model, MNRL(model, hardness_mode="hard_negatives", hardness_strength=5.0), DIMS)
    with pytest.raises(ValueError, match="gather_across_devices"):
        MatryoshkaLoss(model, MNRL(model, gather_across_devices=True), DIMS)
    with pytest.raises(ValueError, match="similarity_fct"):
        MatryoshkaLoss(model, MNRL(model, similarity_fct=st.util.manhattan_sim), DIMS)
    with pytest.raises(ValueError, match="matryoshka_dims"):
        MatryoshkaLoss(model, MNRL(model), [64, 8])
    with pytest.raises(ValueError, match="matryoshka_dims"):
        MatryoshkaLoss(model, MNRL(model), [])
    with pytest.raises(ValueError, match="matryoshka_dims"):
        MatryoshkaLoss(model, MNRL(model), [8, 8])
    with pytest.raises(TypeError, match="matryoshka_dims"):
        MatryoshkaLoss(model, MNRL(model), [8, 16.0])
    with pytest.raises(ValueError, match="matryoshka_weights"):
        MatryoshkaLoss(model, MNRL(model), [8, 16], [1.0])
    with pytest.raises(ValueError, match="matryoshka_weights"):
        MatryoshkaLoss(model, MNRL(model), [8, 16], [1.0, float("nan")])
    with caplog.at_level(logging.WARNING):
        MatryoshkaLoss(model, MNRL(model), [8, 16])
    assert "not in matryoshka_dims" in caplog.text
    loss = MatryoshkaLoss(model, MNRL(model), DIMS)
    with pytest.raises(ValueError, match="at least 2 columns"):
        loss(features(model, text_columns(3, 1, seed=1)), None)
