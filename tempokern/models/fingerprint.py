"""A model's fingerprint: what an index records about the encoder that built it, so that searching it with
another encoder (same dimension or not) is caught instead of returning meaningless neighbours."""
from __future__ import annotations

import hashlib
import json
from typing import Optional

import torch


def weights_sha256(model) -> str:
    """SHA-256 over the model's state dict: every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    sd = model.state_dict()
    for name in sorted(sd):
        t = sd[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode("utf-8"))
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_fingerprint(model, *, path: Optional[str] = None, dim: Optional[int] = None) -> dict:
    """``{"kind", "config_sha256", "weights_sha256", "dim", "path"}`` of an encoder (``path``: where it was
    loaded from, for messages only; ``dim``: a TMRL index's truncation)."""
    cfg = dict(model.config_dict()) if hasattr(model, "config_dict") else {}
    bb = getattr(getattr(model, "backbone", None), "config", None)
    if bb is not None and hasattr(bb, "to_dict"):
        cfg["backbone_config"] = bb.to_dict()
    cfg_s = json.dumps(cfg, sort_keys=True, default=str, ensure_ascii=False)
    return {"kind": type(model).__name__, "config_sha256": hashlib.sha256(cfg_s.encode("utf-8")).hexdigest(),
            "weights_sha256": weights_sha256(model), "dim": dim, "path": None if path is None else str(path)}


def same_model(a: dict, b: dict) -> bool:
    """Whether two fingerprints name the same encoder (kind, config and weights; the path is not compared)."""
    keys = ("kind", "config_sha256", "weights_sha256", "dim")
    return all(a.get(k) == b.get(k) for k in keys)


def describe(fp: dict) -> str:
    return (f"{fp.get('kind', '?')} {fp.get('path') or '(path not recorded)'} "
            f"[config {str(fp.get('config_sha256', '?'))[:12]}, weights {str(fp.get('weights_sha256', '?'))[:12]}"
            + (f", dim {fp['dim']}" if fp.get("dim") is not None else "") + "]")


def check_index_model(index, model, model_path, index_path, *, allow: bool = False, warn=None) -> None:
    """`tempokern search`: the index must have been built by `model` (its stored fingerprint), and the
    model's embedding dimension must be the index's. Raises ValueError naming both, unless ``allow``
    (then a warning); an index without a fingerprint (written before indexes stored one) gets a warning."""
    import sys
    warn = warn or (lambda m: print(m, file=sys.stderr))
    stored = getattr(index, "model", None)
    dim = stored.get("dim") if isinstance(stored, dict) else None
    mine = model_fingerprint(model, path=model_path, dim=dim)
    width = dim if dim is not None else getattr(model, "hidden_size", None)
    nested = hasattr(model, "check_dim")     # a TMRL encoder embeds in any dimension up to its width
    if isinstance(width, int) and (index.dim > width if nested and dim is None else width != index.dim):
        raise ValueError(f"--model {model_path} embeds in dimension {width} but {index_path} holds dimension-"
                         f"{index.dim} embeddings")
    if stored is None:
        warn(f"tempokern search: warning: {index_path} records no encoder fingerprint (written by an older "
             f"tempokern); it cannot be checked against --model {model_path}")
    elif not same_model(stored, mine):
        msg = (f"{index_path} was built by {describe(stored)}, not by --model {describe(mine)}: search it with "
               "the encoder that built it (or rebuild it with `tempokern index`; --allow-other-model searches anyway)")
        if not allow:
            raise ValueError(msg)
        warn(f"tempokern search: warning (--allow-other-model): {msg}")
