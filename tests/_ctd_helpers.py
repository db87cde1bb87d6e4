"""Small datasets and tiny models shared by the CTD model/training/CLI tests."""
from __future__ import annotations

import torch


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


def no_dropout(model):
    """Dropout off, so a run's losses are a function of weights and batch (comparable across processes)."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    return model


def ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One rank of the CPU gloo test: trains a few steps data-parallel and saves its weights."""
    import json
    import os
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from tempokern.training import CTDConfig, train_ctd
        ds = small_dataset()
        # different initial weights per rank: the trainer must broadcast rank 0's
        m = no_dropout(tiny_model(ds, seed=rank))
        cfg = CTDConfig(variant="full", epochs=1, batch_size=8, lr=3e-3, progress=False, seed=0, max_steps=4)
        res = train_ctd(m, ds, cfg, out_dir if rank == 0 else None, log=lambda *a: None)
        torch.save({k: v.detach().clone() for k, v in m.state_dict().items()}, os.path.join(out_dir, f"rank{rank}.pt"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"steps": res.steps, "losses": [h["loss"] for h in res.history if h["event"] == "step"]}, f)
    finally:
        dist.destroy_process_group()
