"""Small datasets and tiny models shared by the CTD model/training/CLI tests."""
from __future__ import annotations

import warnings

import torch

warnings.filterwarnings("ignore", message="tempokern: .* stand-in", category=RuntimeWarning)


def small_dataset(units: int = 15, split: str = "template"):
    """The demo's Zizhi Tongjian set cut to the first `units` months of its calendar."""
    from tempokern.datasets import RetrievalDataset
    from tempokern.training import zztj_demo_dataset
    ds = zztj_demo_dataset(split=split)
    recs = [r for r in ds.records if r.interval is not None and r.interval.end < units]
    keep = {r.id for r in recs}
    qs = [q for q in ds.queries if q.interval.end < units and all(g in keep for g in q.gold)]
    return RetrievalDataset("zztj-small", recs, qs, ds.calendar, ds.report)


def tiny_model(ds, *, hidden: int = 32, layers: int = 1, seed: int = 0, max_length: int = 32, **kw):
    from tempokern.models import CTDEncoder, build_char_tokenizer, tiny_bert
    tok = build_char_tokenizer([r.text for r in ds.records] + [q.text for q in ds.queries])
    torch.manual_seed(seed)
    bb = tiny_bert(len(tok), hidden=hidden, layers=layers, heads=2, intermediate=2 * hidden, max_position=64, seed=seed)
    kw.setdefault("pooling", "mean")
    return CTDEncoder(bb, ds.calendar, tokenizer=tok, max_length=max_length, **kw)
