"""Where the encoder and trainer get the pieces other tempokern modules provide.

Kept as one indirection so the model/training code names its dependencies in one place;
every name resolves to the real tempokern implementation (no stand-ins)."""
from __future__ import annotations

from typing import Dict, Tuple

import torch.nn as nn


def bias_params(ob: nn.Module) -> Tuple:
    """(w1, b1, w2, b2, scale) of an OffsetBias, the tuple the fused ops take."""
    return ob.mlp[0].weight, ob.mlp[0].bias, ob.mlp[2].weight, ob.mlp[2].bias, ob.scale


def offset_bias_cls():
    from ..nn import OffsetBias
    return OffsetBias


def ctd_loss_cls():
    from ..nn import CTDLoss
    return CTDLoss


def ctd_topk_fn():
    from .. import ctd_topk
    return ctd_topk


def temporal_index_cls():
    from ..search import TemporalIndex
    return TemporalIndex


def retrieval_metrics_fn():
    from ..eval import retrieval_metrics
    return retrieval_metrics


def dependency_report() -> Dict[str, str]:
    """{name: module} of the implementations the encoder and trainer use."""
    out = {}
    for name, fn in (("OffsetBias", offset_bias_cls), ("CTDLoss", ctd_loss_cls), ("TemporalIndex", temporal_index_cls),
                     ("ctd_topk", ctd_topk_fn), ("retrieval_metrics", retrieval_metrics_fn)):
        obj = fn()
        out[name] = f"{obj.__module__}.{getattr(obj, '__qualname__', name)}"
    return out
