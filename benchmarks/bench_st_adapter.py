"""The sentence-transformers adapter vs sentence-transformers' own Matryoshka loop, on embeddings (the
encoder is left out: it is the same for both), forward + backward.

Run: OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_st_adapter.py --benchmark-columns=median,min,max
d = 384 (all-MiniLM-L6-v2), dims (384, 256, 128, 64, 32), columns (anchor, positive, one hard negative):
B anchors, C = 2B candidates. "st" = what ``losses.MatryoshkaLoss(model, MultipleNegativesRankingLoss(model),
dims)`` computes once the embeddings exist (one MNRL per dim on shrunk embeddings); "tempokern" =
``tempokern.integrations.sentence_transformers.MatryoshkaLoss`` (one fused ``matryoshka_infonce`` pass)."""
import pytest
import torch

st = pytest.importorskip("sentence_transformers")
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss  # noqa: E402
from sentence_transformers.sentence_transformer.losses.matryoshka import shrink  # noqa: E402

from tempokern.integrations.sentence_transformers import MatryoshkaLoss  # noqa: E402

DIMS = [384, 256, 128, 64, 32]


class _Model(torch.nn.Module):
    def get_embedding_dimension(self):
        return 384


@pytest.mark.parametrize("B", [1024, 2048])
@pytest.mark.parametrize("impl", ["st", "tempokern"])
def test_matryoshka_mnrl(benchmark, B, impl):
    model = _Model()
    mnrl = MultipleNegativesRankingLoss(model)
    g = torch.Generator().manual_seed(0)
    embs = [torch.randn(B, 384, generator=g).requires_grad_(True) for _ in range(3)]
    if impl == "st":
        fn = lambda: sum(mnrl.compute_loss_from_embeddings([shrink(e, m) for e in embs], None)  # noqa: E731
                         for m in DIMS)
    else:
        fn = lambda: MatryoshkaLoss(model, mnrl, DIMS).compute_loss_from_embeddings(embs)  # noqa: E731

    def run():
        for e in embs:
            e.grad = None
        fn().backward()
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
