"""What the CTD loss takes as positives on the TimeQA suite's training batches, under positives="overlap" and
positives="overlap_group" (CTDConfig.positives): per row the number of positives, the share of positives from
another page than the question's, and the share of rows whose positives leave out their own gold paragraph (the
row's paired document, then trained as a negative). No model is run: the batches are the CTD trainer's
(CTDTrainer._epoch_batches, the suite's budget and seed) and the positive masks are the spec's
(tempokern.reference.multipos_infonce: overlaps, with the diagonal fallback / within the page plus the diagonal).
Also reports how many training records get a calendar-CE target under calendar_labels="key" and "interval".

    python benchmarks/timeqa_positives.py [--size full|quick] [--seed 0] [--out benchmarks/results/timeqa-positives.json]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from tempokern.reference.multipos_infonce import group_positives, overlap_positives


def _trainer(ds, budget, seed, positives, calendar_labels):
    from tempokern.models import CTDEncoder, build_char_tokenizer, tiny_bert
    from tempokern.training import CTDConfig
    from tempokern.training.trainer import CTDTrainer
    tok = build_char_tokenizer(["abc"])
    model = CTDEncoder(tiny_bert(len(tok), hidden=8, layers=1, heads=1, intermediate=8, max_position=16, seed=0),
                       ds.calendar, tokenizer=tok, max_length=8, pooling="mean")
    cfg = CTDConfig(variant="full", epochs=budget.epochs, batch_size=budget.batch_size, lr=budget.lr, seed=seed,
                    progress=False, hard_negatives=True, hard_negative_source="query", positives=positives,
                    calendar_labels=calendar_labels)
    return CTDTrainer(model, ds, cfg, None, device="cpu", log=lambda *a: None)


def measure(size: str = "full", seed: int = 0) -> dict:
    from tempokern.suite.methods.ctd import _train_subset
    from tempokern.suite.realdata import timeqa_set
    from tempokern.suite.registry import Budget
    real = timeqa_set(size)
    budget = Budget.real(size == "quick")
    ctx = SimpleNamespace(dataset=real.dataset, budget=budget, train_rows=lambda: list(real.train_rows))
    ds = _train_subset(ctx)
    out = {"size": size, "seed": seed, "epochs": budget.epochs, "batch_size": budget.batch_size,
           "train_queries": len(ds.queries), "records": len(ds.records)}
    tr = _trainer(ds, budget, seed, "overlap_group", "interval")
    page = {}
    rec_page = [page.setdefault((r.meta or {}).get("page"), len(page)) for r in ds.records]
    q_page = [page.setdefault((q.meta or {}).get("page"), len(page)) for q in ds.queries]
    stats = {m: {"rows": 0, "positives": 0, "other_page": 0, "own_gold_excluded": 0, "rows_with_overlap": 0}
             for m in ("overlap", "overlap_group")}
    batches = 0
    for epoch in range(budget.epochs):
        for batch, _negs, _off in tr._epoch_batches(epoch):
            batches += 1
            qs = [ds.queries[qi] for qi, _ in batch]
            dj = [di for _, di in batch]
            q_span = (torch.tensor([q.interval.start if q.interval is not None else -1 for q in qs]),
                      torch.tensor([q.interval.end if q.interval is not None else -1 for q in qs]))
            d_span = tuple(torch.tensor([tr.spans[j][k] for j in dj]) for k in (0, 1))
            ov = overlap_positives(q_span, d_span)
            B = len(batch)
            eye = torch.eye(B, dtype=torch.bool)
            same = group_positives(torch.tensor([q_page[qi] for qi, _ in batch]), torch.tensor([rec_page[j] for j in dj]))
            masks = {"overlap": ov | (eye & ~ov.any(1, keepdim=True)),
                     "overlap_group": (ov & group_positives(torch.tensor([tr.query_group[qi] for qi, _ in batch]),
                                                            torch.tensor([tr.rec_group[j] for j in dj]))) | eye}
            for m, pos in masks.items():
                st = stats[m]
                st["rows"] += B
                st["positives"] += int(pos.sum())
                st["other_page"] += int((pos & ~same).sum())
                st["own_gold_excluded"] += int((~pos.diagonal()).sum())
                st["rows_with_overlap"] += int(ov.any(1).sum())
    for m, st in stats.items():
        st["positives_per_row"] = round(st["positives"] / st["rows"], 3)
        st["other_page_share"] = round(st["other_page"] / st["positives"], 4)
        st["own_gold_excluded_share"] = round(st["own_gold_excluded"] / st["rows"], 4)
    out["batches"] = batches
    lens = sorted(len(r.interval) for r in ds.records if r.interval is not None)
    out["record_interval_months"] = {"dated_records": len(lens), "median": lens[len(lens) // 2] if lens else None,
                                     "share_ge_120": round(sum(n >= 120 for n in lens) / len(lens), 4) if lens else None}
    out["positives"] = stats
    labels = {}
    for mode in ("key", "interval"):
        t = _trainer(ds, budget, seed, "overlap", mode)
        labels[mode] = t.setup_info()["calendar_labelled_records"]
    train_ids = {j for q in ds.queries for j in (q.gold or {})}
    rid = {r.id: i for i, r in enumerate(ds.records)}
    gold = [rid[g] for g in train_ids if g in rid]
    t = _trainer(ds, budget, seed, "overlap", "interval")
    labels["interval_training_golds"] = {name: sum(1 for j in gold if t.labels[j][lv] >= 0)
                                         for lv, name in enumerate(ds.calendar.names)}
    labels["training_golds"] = len(gold)
    out["calendar_labelled_records"] = labels
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="full", choices=["full", "quick"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    res = measure(a.size, a.seed)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, out)


if __name__ == "__main__":
    main()
