"""Re³: queries without a time scored by the base relevance score (re3_runs(no_time="base")) or by their
time-less e_final against the FiLM-modulated gallery (no_time="film").

Trains the film_margins row (frozen all-MiniLM-L6-v2, mean pooling, Re3Config defaults except epochs) on a
**synthetic** set's training rows (tempokern's load_synth, quick size by default) and reports R@1 / R@5 / MRR
per split under both settings plus the base retriever. Queries with a time are scored the same way under both;
only the time-less ones (the set's "timeless" split, and any other query the parser finds no date in) change.

    PYTHONPATH=$PWD python benchmarks/re3_no_time_fallback.py [--set B] [--size quick] [--epochs 10]
"""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="B")
    ap.add_argument("--size", default="quick")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--max-length", type=int, default=64)
    a = ap.parse_args()
    from tempokern.datasets.synth import load_synth
    from tempokern.models import minilm_path
    from tempokern.training.re3 import (Re3Config, build_re3_model, docs_from_dataset, examples_from_synth,
                                        re3_eval, re3_runs, train_re3)
    torch.manual_seed(0)
    synth = load_synth(a.set, seed=0, size=a.size)
    ds = synth.dataset
    splits = sorted({q.split for q in ds.queries if q.split and q.split != "train"})
    cfg = Re3Config(variant="film_margins", epochs=a.epochs, progress=False)
    model = build_re3_model(minilm_path(), cfg, pooling="mean", max_length=a.max_length)
    t0 = time.time()
    train_re3(model, docs_from_dataset(ds), examples_from_synth(synth), cfg, log=lambda *x: None)
    print(f"synthetic set {a.set} ({a.size}), film_margins {a.epochs} epochs, trained in {time.time() - t0:.0f} s; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    qs = [q for q in ds.queries if q.split in splits]
    has = model.has_time([q.text for q in qs], pub=[(q.meta or {}).get("query_time") for q in qs])
    n_less = {s: sum(1 for q, h in zip(qs, has) if q.split == s and not h) for s in splits}
    rows = {"base retriever": re3_eval(ds, re3_runs(model, ds, splits, base=True)),
            "film_margins, no_time=film": re3_eval(ds, re3_runs(model, ds, splits, no_time="film")),
            "film_margins, no_time=base": re3_eval(ds, re3_runs(model, ds, splits, no_time="base"))}
    print("| row | " + " | ".join(f"{s} (time-less {n_less[s]})" for s in splits) + " |")
    print("|---|" + "---|" * len(splits))
    for name, tab in rows.items():
        print(f"| {name} | " + " | ".join(f"{tab[s]['R@1']:.3f} / {tab[s]['R@5']:.3f} / {tab[s]['MRR']:.3f}"
                                          if s in tab else "-" for s in splits) + " |")


if __name__ == "__main__":
    main()
