"""A CPU measurement for a shared machine: one process, the providers of a benchmark file
interleaved round by round, min wall time and min process CPU time of each (CPU time is what stays meaningful
when other jobs share the cores). Not a pytest-benchmark file and writes no CSV: the benchmark files stay the
record.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/cpu_interleaved.py re3 [B] [rounds] [threads]
    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/cpu_interleaved.py matryoshka [B] [rounds] [threads]

re3: Re3Loss fused vs reference.re3_loss (bench_re3_loss.make / step; default B = 8,192).
matryoshka: fused vs the ST-style eager loop vs the single level (bench_matryoshka_infonce; default B = 2,048).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv):
    what = argv[1] if len(argv) > 1 else "re3"
    torch.set_num_threads(int(argv[4]) if len(argv) > 4 else 1)
    rounds = int(argv[3]) if len(argv) > 3 else 2
    if what == "re3":
        import bench_re3_loss as b
        B = int(argv[2]) if len(argv) > 2 else 8192
        q, d, tw, ids = b.make(B)
        fns = {k: b.provider_fn(k) for k in ("fused", "eager")}
        run = lambda fn: b.step(fn, q, d, tw, ids)  # noqa: E731
    elif what == "matryoshka":
        import bench_matryoshka_infonce as b
        B = int(argv[2]) if len(argv) > 2 else 2048
        q, d = b.make(B)
        fns = {k: b.PROVIDERS[k] for k in ("fused", "eager", "single")}
        run = lambda fn: b.step(fn, q, d)  # noqa: E731
    else:
        raise SystemExit(__doc__)
    for fn in fns.values():  # warm-up
        run(fn)
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            run(fn)
            res[k].append((time.perf_counter() - w, time.process_time() - c))
    best = {k: (min(x[0] for x in v), min(x[1] for x in v)) for k, v in res.items()}
    print(f"{what} B={B} threads={torch.get_num_threads()} rounds={rounds} load={os.getloadavg()[0]:.1f}")
    for k, (w, c) in best.items():
        print(f"  {k:7s} wall {w * 1e3:9.1f} ms  cpu {c * 1e3:9.1f} ms")
    f = best["fused"]
    for k, (w, c) in best.items():
        if k != "fused":
            print(f"  {k}/fused: wall {w / f[0]:.2f}x  cpu {c / f[1]:.2f}x")


if __name__ == "__main__":
    main(sys.argv)
