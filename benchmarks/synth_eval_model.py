"""Evaluate saved CTD encoders (`tempokern train ... --out RUN` -> RUN/best) on every query split of an offline
English set, encoding the gallery once per model and scorer; prints a markdown table (R@1, R@5, MRR@10,
nDCG@10, share of top-1 documents that are time-wrong).

    PYTHONPATH=. python benchmarks/synth_eval_model.py --set B --size quick RUN1/best RUN2/best [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tempokern.datasets.synth import load_synth
from tempokern.models import CTDEncoder
from tempokern.training.evaluate import evaluate_model, score_topk

SPLITS = ("val", "test_template", "test_date", "test_year", "test_masked", "timeless")


def top1_time_wrong(model, ds, split, g_enc, scorer):
    qs = [q for q in ds.queries if q.split == split]
    _, idx = score_topk(model, [q.text for q in qs], g_enc, 1, scorer=scorer)
    n = 0
    for q, j in zip(qs, idx[:, 0].tolist()):
        top, gold = ds.records[j], ds.record(next(iter(q.gold)))
        if top.id not in q.gold and (top.meta["entity"], top.meta["attribute"]) == \
                (gold.meta["entity"], gold.meta["attribute"]) and top.meta["date"] != gold.meta["date"]:
            n += 1
    return n / len(qs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--set", default="B")
    ap.add_argument("--size", default="quick")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scorers", nargs="*", default=["encoder", "ctd"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ds = load_synth(a.set, seed=a.seed, size=a.size).dataset
    splits = [s for s in SPLITS if any(q.split == s for q in ds.queries)]
    res = []
    print("| model | scorer | split | queries | R@1 | R@5 | MRR@10 | nDCG@10 | top-1 time-wrong |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in a.models:
        model = CTDEncoder.load(path).eval()
        for scorer in a.scorers:
            t0 = time.perf_counter()
            g = model.encode([r.text for r in ds.records], batch_size=64, scorer=scorer)
            for split in splits:
                m = evaluate_model(model, ds, split, gallery_enc=g, scorer=scorer)["all"]
                tw = top1_time_wrong(model, ds, split, g, scorer) if split != "timeless" else None
                row = {"model": path, "scorer": scorer, "split": split, **m, "top1_time_wrong": tw}
                res.append(row)
                print(f"| {path} | {scorer} | {split} | {m['queries']} | {m['R@1']:.3f} | {m['R@5']:.3f} | "
                      f"{m['MRR@10']:.3f} | {m['nDCG@10']:.3f} | {'' if tw is None else f'{tw:.3f}'} |", flush=True)
            print(f"<!-- {path} {scorer}: {time.perf_counter() - t0:.0f} s -->", flush=True)
    if a.out:
        from tempokern.models.checkpoint import atomic_write
        atomic_write(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
