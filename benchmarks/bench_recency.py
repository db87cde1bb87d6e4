"""Recency filter on a small versioned Seattle-forecast set (a stand-in for set C until
tempokern.datasets.synth lands): stale rate, version accuracy, answer proxy, evidence tokens before and
after the filter, over BM25 and zero-shot all-MiniLM-L6-v2 top-5 lists; zero removals on the same
gallery without outdated versions; filter time per query.

Data: the observed daily highs of vega-datasets' seattle-weather.csv (2014-01-01 .. 2014-04-30, 120 days)
are the latest versions (published on the day); three SYNTHETIC forecasts per day, published 3, 2 and 1
days before, carry the observed value plus Gaussian noise of sd 0.8·lag °C (rounded to 0.1). Queries ask
for the high on each day in one of four date surface forms; gold = the observation.

Run: PYTHONPATH=. python benchmarks/bench_recency.py [--out benchmarks/results/recency.json]
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import random
import sys
import time
import warnings

import numpy as np

from tempokern.datasets import Query, Record, RetrievalDataset
from tempokern.eval.recency import make_filter, recency_report

FORMATS = [lambda d: f"{d:%B} {d.day}, {d.year}", lambda d: d.isoformat(), lambda d: f"{d.day} {d:%B} {d.year}",
           lambda d: f"{d:%m}/{d:%d}/{d.year}"]
FC_TEMPLATES = ["Forecast issued {pub} for Seattle on {day}: a high of {v} °C is expected.",
                "Seattle outlook for {day} (published {pub}): highs near {v} °C."]
OBS_TEMPLATES = ["Seattle weather report for {day}: the high reached {v} °C.",
                 "On {day}, Seattle recorded a high of {v} °C."]


def build(seed: int = 0, versions: bool = True) -> RetrievalDataset:
    import vega_datasets
    path = os.path.join(os.path.dirname(vega_datasets.__file__), "_data", "seattle-weather.csv")
    if not os.path.exists(path):
        path = os.path.join(os.path.dirname(vega_datasets.__file__), "local_datasets", "seattle-weather.csv")
    rows = list(csv.DictReader(open(path)))
    rng = random.Random(seed)
    recs, qs = [], []
    for row in rows:
        day = dt.date.fromisoformat(row["date"][:10].replace("/", "-"))
        if not (dt.date(2014, 1, 1) <= day <= dt.date(2014, 4, 30)):
            continue
        obs = round(float(row["temp_max"]), 1)
        fact = lambda v: [{"head": "Seattle", "relation": f"temp_max {day}", "value": f"{v} °C"}]  # noqa: E731
        dstr = lambda d: f"{d:%B} {d.day}, {d.year}"                                           # noqa: E731
        recs.append(Record(f"obs-{day}", rng.choice(OBS_TEMPLATES).format(day=dstr(day), v=obs), published=day,
                           meta={"facts": fact(obs), "version": 4}))
        if versions:
            for lag in (3, 2, 1):
                v = round(obs + rng.gauss(0, 0.8 * lag), 1)
                pub = day - dt.timedelta(days=lag)
                recs.append(Record(f"fc-{day}-{lag}", rng.choice(FC_TEMPLATES).format(pub=dstr(pub), day=dstr(day), v=v),
                                   published=pub, meta={"facts": fact(v), "version": 4 - lag}))
        q = f"What was the high temperature in Seattle on {rng.choice(FORMATS)(day)}?"
        qs.append(Query(f"q-{day}", q, gold={f"obs-{day}": 1}, split="test", meta={"answer": f"{obs} °C"}))
    return RetrievalDataset("seattle-versions" if versions else "seattle-observations", recs, qs)


def bm25_run(ds, depth=100):
    from tempokern.baselines import BM25Scorer
    s = np.asarray(BM25Scorer(ngram=1)(ds.queries, ds.records))
    return _run(ds, s, depth)


def minilm_run(ds, depth=100):
    import all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = SentenceTransformer(str(all_minilm_l6_v2.get_model_path()), device="cpu")
    g = m.encode([r.text for r in ds.records], batch_size=64, normalize_embeddings=True)
    q = m.encode([x.text for x in ds.queries], batch_size=64, normalize_embeddings=True)
    return _run(ds, q @ g.T, depth)


def _run(ds, scores, depth):
    out = {}
    for i, q in enumerate(ds.queries):
        top = np.argsort(-scores[i], kind="stable")[:depth]
        out[q.id] = {ds.records[j].id: float(scores[i, j]) for j in top}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--k", type=int, default=5)
    a = ap.parse_args(argv)
    import all_minilm_l6_v2
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(all_minilm_l6_v2.get_model_path()))
    res = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus", "date": str(dt.date.today()),
           "command": "python " + " ".join(sys.argv), "k": a.k, "rows": []}
    for versions in (True, False):
        ds = build(versions=versions)
        for retr, fn in (("bm25", bm25_run), ("minilm", minilm_run)):
            run = fn(ds)
            for ext in ("metadata", "rule"):
                for pol in ("conflict", "latest_only"):
                    rf = make_filter(ext, policy=pol)
                    t0 = time.perf_counter()
                    rep = recency_report(run, ds, rf, k=a.k, tokenizer=tok)
                    sec = time.perf_counter() - t0
                    row = {"set": ds.name, "docs": len(ds.records), "queries": len(ds.queries), "retriever": retr,
                           "extractor": ext, "policy": pol, "ms_per_query_incl_metrics": 1000 * sec / len(ds.queries),
                           "removed": rep["removed"], "failures": rep["failures"]}
                    for side in ("before", "after"):
                        for key in ("stale_rate", "version_accuracy", "answer_proxy", "evidence_docs",
                                    "evidence_tokens"):
                            row[f"{key}_{side}"] = rep[side][key]
                        row[f"R@1_{side}"] = rep["retrieval"][side]["R@1"]
                    res["rows"].append(row)
                    print(json.dumps(row))
    # filter time alone (metadata / rule extractor), k = 5 candidates, 2,000 calls
    ds = build()
    run = bm25_run(ds)
    from tempokern.eval.recency import apply_recency
    qtext = {q.id: q.text for q in ds.queries}
    for ext in ("metadata", "rule"):
        rf = make_filter(ext)
        t0 = time.perf_counter()
        n = 0
        while n < 2000:
            apply_recency(run, ds, rf, qtext, k=a.k)
            n += len(run)
        res[f"filter_us_per_query_{ext}"] = 1e6 * (time.perf_counter() - t0) / n
    print({k: v for k, v in res.items() if k.startswith("filter_")})
    if a.out:
        from tempokern.models.checkpoint import atomic_write
        atomic_write(a.out, json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
