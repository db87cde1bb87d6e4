"""sentence-transformers adapter: a drop-in for ``losses.MatryoshkaLoss(model, MultipleNegativesRankingLoss(model),
dims)`` that computes every Matryoshka level in one pass with ``tempokern.matryoshka_infonce``.

One-line swap in a ``SentenceTransformer`` training script::

    from sentence_transformers import losses
    from tempokern.integrations.sentence_transformers import MatryoshkaLoss     # instead of losses.MatryoshkaLoss

    loss = MatryoshkaLoss(model, losses.MultipleNegativesRankingLoss(model), [768, 512, 256, 128, 64])

Same loss value as sentence-transformers' own (its conventions: ``scale`` = 1 / temperature, so the default 20 is
temperature 0.05; candidates = the positive column, then every hard-negative column; dims sorted descending
with their weights; the prefix of every level L2-normalised, so ``cos_sim`` and ``dot_score`` both give cosine
logits; ``n_dims_per_step`` samples dims with Python's ``random`` exactly as ST does), and the same gradient;
no ``model.forward`` monkey-patching and no per-level B x C logit matrices.

Supported inner loss: ``MultipleNegativesRankingLoss`` with ``directions=("query_to_doc",)`` (the default), or
``("query_to_doc", "doc_to_query")`` with ``partition_mode="per_direction"`` (symmetric InfoNCE: the mean of the
two directions; hard negatives only in the query->doc denominators), ``similarity_fct`` cos_sim or dot_score,
no hardness weighting, no ``gather_across_devices``. Anything else raises ``ValueError`` / ``TypeError`` naming
the setting (use ST's own MatryoshkaLoss for it). sentence-transformers is imported only by this module."""
from __future__ import annotations

import logging
import random
import warnings
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from .._ops.routing import matryoshka_infonce

logger = logging.getLogger(__name__)

__all__ = ["MatryoshkaLoss", "FusedMatryoshkaLoss"]


def _st():
    try:
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
        from sentence_transformers import util
    except ImportError as e:                                   # pragma: no cover - exercised without ST only
        raise ImportError("tempokern.integrations.sentence_transformers needs sentence-transformers: "
                          "pip install 'tempokern[st]' (or pip install sentence-transformers)") from e
    return MultipleNegativesRankingLoss, util


def _embed(model, sentence_features) -> list:
    try:
        from sentence_transformers.base.losses.merged_forward import embed_columns
    except ImportError:                                        # older sentence-transformers
        return [model(f)["sentence_embedding"] for f in sentence_features]
    return embed_columns(model, sentence_features)


class FusedMatryoshkaLoss(nn.Module):
    """``FusedMatryoshkaLoss(model, loss, matryoshka_dims, matryoshka_weights=None, n_dims_per_step=-1)``:
    the signature of ``sentence_transformers.losses.MatryoshkaLoss``; ``loss`` must be a
    ``MultipleNegativesRankingLoss`` (see the module docstring for the supported settings). ``forward(
    sentence_features, labels)`` embeds the columns once (anchor, positive, negatives...) and returns
    ``sum_m w_m * MNRL(truncate(anchor, m), truncate(candidates, m))`` from one fused pass."""

    def __init__(self, model: nn.Module, loss: nn.Module, matryoshka_dims: Sequence[int],
                 matryoshka_weights: Optional[Sequence[float]] = None, n_dims_per_step: int = -1) -> None:
        super().__init__()
        MNRL, util = _st()
        if not isinstance(loss, MNRL):
            raise TypeError("loss must be a sentence_transformers MultipleNegativesRankingLoss (the fused "
                            f"Matryoshka InfoNCE replaces exactly that), got {type(loss).__name__}")
        if getattr(loss, "gather_across_devices", False):
            raise ValueError("loss.gather_across_devices=True is not supported by the fused adapter")
        directions = tuple(getattr(loss, "directions", ("query_to_doc",)))
        partition = getattr(loss, "partition_mode", "joint")
        if directions == ("query_to_doc",):
            symmetric = False
        elif set(directions) == {"query_to_doc", "doc_to_query"} and len(directions) == 2 \
                and partition == "per_direction":
            symmetric = True
        else:
            raise ValueError(f"loss.directions={directions} with partition_mode={partition!r} is not supported: "
                             "use ('query_to_doc',) or ('query_to_doc', 'doc_to_query') with "
                             "partition_mode='per_direction'")
        if getattr(loss, "hardness_mode", None) is not None and getattr(loss, "hardness_strength", 0.0) > 0:
            raise ValueError(f"loss.hardness_mode={loss.hardness_mode!r} is not supported by the fused adapter")
        sim = loss.similarity_fct
        if sim not in (util.cos_sim, util.dot_score):
            raise ValueError("loss.similarity_fct must be sentence_transformers.util.cos_sim or dot_score (the "
                             "Matryoshka levels are L2-normalised prefixes, so both give cosine logits), got "
                             f"{getattr(sim, '__name__', sim)!r}")
        scale = float(loss.scale)
        if not scale > 0 or scale == float("inf"):
            raise ValueError(f"loss.scale must be a finite number > 0, got {scale}")
        if isinstance(matryoshka_dims, (str, bytes)) or not isinstance(matryoshka_dims, Sequence):
            raise TypeError(f"matryoshka_dims must be a sequence of ints, got {type(matryoshka_dims).__name__}")
        if len(matryoshka_dims) == 0:
            raise ValueError("matryoshka_dims must not be empty")
        for m in matryoshka_dims:
            if isinstance(m, bool) or not isinstance(m, int):
                raise TypeError(f"matryoshka_dims must hold ints, got {m!r}")
            if m <= 0:
                raise ValueError(f"matryoshka_dims must be > 0, got {m}")
        if len(set(matryoshka_dims)) != len(matryoshka_dims):
            raise ValueError(f"matryoshka_dims must be unique, got {list(matryoshka_dims)}")
        if matryoshka_weights is None:
            matryoshka_weights = [1] * len(matryoshka_dims)
        elif len(matryoshka_weights) != len(matryoshka_dims):
            raise ValueError("matryoshka_weights must be the same length as matryoshka_dims")
        for w in matryoshka_weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w >= 0) or w == float("inf"):
                raise ValueError(f"matryoshka_weights must be finite numbers >= 0, got {w!r}")
        if isinstance(n_dims_per_step, bool) or not isinstance(n_dims_per_step, int):
            raise TypeError(f"n_dims_per_step must be an int, got {type(n_dims_per_step).__name__}")
        emb_dim = model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension") else None
        if emb_dim is not None:
            if any(m > emb_dim for m in matryoshka_dims):
                raise ValueError(f"matryoshka_dims cannot exceed the model's embedding dimension {emb_dim}, got "
                                 f"{list(matryoshka_dims)}")
            if emb_dim not in matryoshka_dims:
                logger.warning("The model's embedding dimension %d is not in matryoshka_dims %s: the full "
                               "dimension is not trained.", emb_dim, list(matryoshka_dims))
        self.model, self.loss = model, loss
        pairs = sorted(zip(matryoshka_dims, matryoshka_weights), key=lambda x: x[0], reverse=True)
        self.matryoshka_dims = tuple(int(m) for m, _ in pairs)          # descending, as ST
        self.matryoshka_weights = tuple(w for _, w in pairs)
        self.n_dims_per_step = n_dims_per_step
        self.symmetric = symmetric
        self.temperature = 1.0 / scale

    def _levels(self) -> list:
        idx = range(len(self.matryoshka_dims))
        if 0 < self.n_dims_per_step < len(idx):                     # the same draws as ST's MatryoshkaLoss
            idx = random.sample(idx, self.n_dims_per_step)
            idx.sort()
        return list(idx)

    def compute_loss_from_embeddings(self, embeddings: list, labels: Any = None) -> torch.Tensor:
        if len(embeddings) < 2:
            raise ValueError(f"expected at least 2 columns (anchor, positive[, negatives...]), got {len(embeddings)}")
        q, d = embeddings[0], embeddings[1]
        extra = torch.cat(list(embeddings[2:]), dim=0) if len(embeddings) > 2 else None
        idx = self._levels()
        dims = [self.matryoshka_dims[i] for i in idx]
        weights = [float(self.matryoshka_weights[i]) for i in idx]
        with warnings.catch_warnings():
            if len(idx) < len(self.matryoshka_dims):
                # n_dims_per_step left the largest dim out of this step: expected, not worth a warning per step
                warnings.filterwarnings("ignore", message="matryoshka_infonce: the largest dim")
            return matryoshka_infonce(q, d, dims, temperature=self.temperature, weights=weights, extra_neg=extra,
                                      symmetric=self.symmetric)

    def forward(self, sentence_features: Iterable[dict], labels: Any = None) -> torch.Tensor:
        return self.compute_loss_from_embeddings(_embed(self.model, list(sentence_features)), labels)

    def get_config_dict(self) -> dict:
        return {"loss": type(self.loss).__name__, "matryoshka_dims": self.matryoshka_dims,
                "matryoshka_weights": self.matryoshka_weights, "n_dims_per_step": self.n_dims_per_step,
                "fused": "tempokern.matryoshka_infonce"}

    @property
    def citation(self) -> str:
        return getattr(self.loss, "citation", "")


MatryoshkaLoss = FusedMatryoshkaLoss
