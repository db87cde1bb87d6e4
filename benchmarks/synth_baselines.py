"""Zero-shot baselines on the offline English sets (tempokern.datasets.synth): frozen all-MiniLM-L6-v2 (mean
pooling, cosine) and BM25 (bm25s, lower-cased words; ties ordered for and against the gold), per query split,
with the top-1 error split and the encoding time of gallery + evaluation queries.

    PYTHONPATH=. python benchmarks/synth_baselines.py --sets A B C --size full --threads 2 --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import defaultdict

import numpy as np
import torch

from tempokern.datasets.synth import load_synth
from tempokern.eval.metrics import per_query_metrics
from tempokern.models import minilm_path

METRICS = ("R@1", "R@5", "MRR@10", "nDCG@10")


def encode(model, tok, texts, max_length=64, batch=128):
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i:i + batch], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            h = model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(out)


def error_kind(ds, top, gold):
    if top in gold:
        return "correct"
    t, g = ds.record(top).meta, ds.record(next(iter(gold))).meta
    if t["entity"] == g["entity"] and t["attribute"] == g["attribute"]:
        return "time_wrong" if t["date"] != g["date"] else "outdated"
    if t["attribute"] == g["attribute"] and t["date"] == g["date"]:
        return "entity_wrong"
    if t["entity"] == g["entity"] and t["date"] == g["date"]:
        return "attribute_wrong"
    return "other"


def summarize(ds, queries, rankings):
    by_split = defaultdict(list)
    for q in queries:
        by_split[q.split].append(q)
    out = {}
    for split, qs in sorted(by_split.items()):
        rows = [per_query_metrics(rankings[q.id], [d for d, r in q.gold.items() if r > 0]) for q in qs]
        m = {k: float(np.mean([r[k] for r in rows])) for k in METRICS}
        m["queries"] = len(qs)
        if split != "timeless":
            kinds = defaultdict(int)
            for q in qs:
                kinds[error_kind(ds, rankings[q.id][0], q.gold)] += 1
            m["top1"] = {k: v / len(qs) for k, v in sorted(kinds.items())}
        out[split] = m
    return out


def run_set(name, size, seed, model, tok, max_length):
    s = load_synth(name, seed=seed, size=size)
    ds = s.dataset
    gallery = ds.records
    gids = [r.id for r in gallery]
    queries = [q for q in ds.queries if q.split != "train"]
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    g = encode(model, tok, [r.text for r in gallery], max_length)
    qe = encode(model, tok, [q.text for q in queries], max_length)
    enc_s, enc_cpu = time.perf_counter() - t0, time.process_time() - c0
    sims = qe @ g.T
    top = torch.topk(sims, k=min(100, len(gids)), dim=1).indices.tolist()
    dense = {q.id: [gids[j] for j in top[i]] for i, q in enumerate(queries)}
    # BM25
    from tempokern.baselines.bm25 import BM25Scorer
    bm = BM25Scorer()
    t1 = time.perf_counter()
    scores = bm(queries, gallery)
    bm_s = time.perf_counter() - t1
    best, worst = {}, {}
    for i, q in enumerate(queries):
        sc = scores[i]
        gold = np.array([gid in q.gold for gid in gids])
        order_best = np.lexsort((~gold, -sc))[:100]    # ties: gold first
        order_worst = np.lexsort((gold, -sc))[:100]    # ties: gold last
        best[q.id] = [gids[j] for j in order_best]
        worst[q.id] = [gids[j] for j in order_worst]
    return {"set": name, "size": size, "seed": seed, "records": len(gallery), "eval_queries": len(queries),
            "encode_texts": len(gallery) + len(queries), "encode_seconds": round(enc_s, 1),
            "encode_cpu_seconds": round(enc_cpu, 1), "load_average_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "bm25_seconds": round(bm_s, 1), "checksum": s.info["checksum"],
            "minilm": summarize(ds, queries, dense), "bm25_ties_for_gold": summarize(ds, queries, best),
            "bm25_ties_against_gold": summarize(ds, queries, worst)}


def markdown(res):
    lines = []
    for r in res["sets"]:
        lines.append(f"\n### Set {r['set']} ({r['size']}, seed {r['seed']}): {r['records']} records, "
                     f"{r['eval_queries']} evaluation queries; MiniLM encodes the {r['encode_texts']} texts in "
                     f"{r['encode_seconds']} s wall, {r['encode_cpu_seconds']} s CPU (load average "
                     f"{r['load_average_1min'][0]} -> {r['load_average_1min'][1]})\n")
        lines.append("| split | queries | MiniLM R@1 | R@5 | MRR@10 | nDCG@10 | top-1 time-wrong | BM25 R@1 (ties for / against gold) | BM25 MRR@10 (for / against) |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for split, m in r["minilm"].items():
            b1, b2 = r["bm25_ties_for_gold"][split], r["bm25_ties_against_gold"][split]
            tw = m.get("top1", {}).get("time_wrong")
            lines.append(f"| {split} | {m['queries']} | {m['R@1']:.3f} | {m['R@5']:.3f} | {m['MRR@10']:.3f} | "
                         f"{m['nDCG@10']:.3f} | {'' if tw is None else f'{tw:.3f}'} | {b1['R@1']:.3f} / {b2['R@1']:.3f} | "
                         f"{b1['MRR@10']:.3f} / {b2['MRR@10']:.3f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", nargs="*", default=["A", "B", "C"])
    ap.add_argument("--size", default="full", choices=["full", "quick"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModel, AutoTokenizer
    p = minilm_path()
    tok = AutoTokenizer.from_pretrained(p)
    model = AutoModel.from_pretrained(p).eval()
    res = {"command": "PYTHONPATH=. python benchmarks/synth_baselines.py " + " ".join(
        [f"--sets {' '.join(a.sets)}", f"--size {a.size}", f"--seed {a.seed}", f"--threads {a.threads}"]),
           "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {a.threads} threads",
           "date": time.strftime("%Y-%m-%d"), "max_length": a.max_length, "sets": []}
    for name in a.sets:
        r = run_set(name, a.size, a.seed, model, tok, a.max_length)
        res["sets"].append(r)
        print(markdown({"sets": [r]}), flush=True)
    if a.out:
        from tempokern.models.checkpoint import atomic_write
        atomic_write(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
