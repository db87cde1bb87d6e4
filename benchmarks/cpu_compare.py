#!/usr/bin/env python
"""CPU comparison of tempokern's ops with the providers the field compares against, interleaved in one process
per case, into one long-format CSV (benchmarks/results/cpu_compare.csv).

    python benchmarks/cpu_compare.py                      # every decision case and the batch-size sweep
    python benchmarks/cpu_compare.py --cases ctd_nobias,re3 --rounds 5
    python benchmarks/cpu_compare.py --list               # the cases and their providers

Providers (each a fwd+bwd step unless the case is inference):

- ``tempokern``: the op's default CPU path;
- ``eager``: ``tempokern.reference`` (the plain PyTorch formulation: materialised B x B scores), or the method's
  own loop (the sentence-transformers-style Matryoshka loop);
- ``compile``: ``torch.compile(reference, dynamic=False)`` (inductor, compiled once per shape; the compilation is
  the warm-up, not timed);
- ``compile_autochunk``: the same with inductor's auto-chunker on (``torch._inductor.config.auto_chunker.enable``,
  ``torch/_inductor/fx_passes/auto_chunker``), which splits large intermediates of the joint graph into chunks;
- ``inf_cl``: Inf-CL (``pip install inf-cl``), the published memory-efficient contrastive loss: Triton, GPU only,
  one positive per row and no bias; every CPU row says it was skipped and why;
- ``torch_topk`` (``torch.topk(q @ g.T)``) and ``faiss_flat`` (``faiss.IndexFlatIP``) for ``ctd_topk``.

Method: one child process per case (``OMP_NUM_THREADS`` = ``--threads``, default 1), a warm-up call of every
provider, then ``--rounds`` rounds in which every provider runs once, the order rotated each round, so that other
load on the machine falls on all providers alike; p20 / p50 / p80 of the wall times (``time_ms``) and of the
process CPU time of each call (``cpu_time_ms``: on a shared machine the time other jobs held the core is not in
it). Peak memory: the peak resident
set above the one before the call (sampled every millisecond) of one call after the timed rounds, with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB in the child, so every block of 128 KiB or more is returned to the
system when freed and each call starts from what a fresh process holds after its warm-up (no allocator cache).

Every row carries the commit and the hash of the sources of the path it measured (``benchmarks/_sources.py``).
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
if list(REPO.joinpath("tempokern").glob("_C*.so")) and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import _sources  # noqa: E402

CSV_PATH = HERE / "results" / "cpu_compare.csv"
#: Liger-style long format: one row per (case, x, provider, metric), p50 with p20 / p80
FIELDS = ["date", "device", "torch", "commit", "src_hash", "op", "case", "x_name", "x_value", "provider", "metric",
          "unit", "p50", "p20", "p80", "n", "note"]
TEMPERATURE = 0.05
H = 768
PROVIDERS_LOSS = ("tempokern", "eager", "compile", "compile_autochunk", "inf_cl")
INF_CL_CPU = "skipped: Inf-CL is Triton, GPU only"
INF_CL_NA = "not applicable: Inf-CL takes one positive per row and no bias"

# ---- cases -------------------------------------------------------------------------------------------------------
# name -> (op, case label, x_name, [x values], kind, rounds); kind names the builder below. "sweep" cases time every
# provider at every B (the log-log plot); the others are single decision cases.
CASES: Dict[str, tuple] = {
    "ctd_nobias": ("multipos_infonce", "CTD loss, no bias", "B", [1024, 2048, 4096], "loss", 3),
    "ctd_table": ("multipos_infonce", "CTD loss, table bias (4097)", "B", [1024, 2048, 4096], "loss_table", 3),
    "matryoshka": ("matryoshka_infonce", "Matryoshka, dims 64..768", "B", [1024, 2048, 4096], "mat", 3),
    "ctd_exact": ("multipos_infonce", "CTD loss, exact bias (hidden 32)", "B", [2048], "loss_exact", 3),
    "re3": ("re3_loss", "Re3Loss (nce + hard + tw), D 384", "B", [4096], "re3", 3),
    "calendar_scalar": ("calendar_scalar", "calendar_scalar, levels 12x32x12", "rows", [65536], "cal_scalar", 5),
    "calendar_context": ("calendar_context", "calendar_context, dim 64", "rows", [65536], "cal_context", 5),
    "ctd_topk": ("ctd_topk", "ctd_topk, no bias, N 100,000, k 10", "Q", [256], "topk", 3),
}


def _compile(fn, autochunk: bool):
    import torch
    opts = {"auto_chunker.enable": True} if autochunk else None
    return torch.compile(fn, dynamic=False, options=opts)


def _spans(B, g):
    import torch
    s = torch.randint(0, 2000, (B,), generator=g)
    return s, s + torch.randint(0, 30, (B,), generator=g)


def _bias(B, g, spans):
    import torch
    from tempokern.nn import OffsetBias
    from tempokern.nn.offset_bias import bias_params
    torch.manual_seed(0)
    m = OffsetBias(32, 32)
    with torch.no_grad():
        m.scale.fill_(0.5)
    (qs, qe), (ds, de) = spans
    u_q = ((qs + qe).float() / 4060).requires_grad_()
    u_d = ((ds + de).float() / 4060).requires_grad_()
    return (u_q, u_d) + tuple(p.detach().clone().requires_grad_() for p in bias_params(m))


def build_loss(kind: str, B: int) -> Tuple[Dict[str, Callable], Dict[str, str]]:
    """{provider: step} and {provider: why it is not run}."""
    import torch
    import tempokern
    from tempokern.reference import multipos_infonce as ref
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, H, generator=g), dim=1).requires_grad_()
    d = torch.nn.functional.normalize(torch.randn(B, H, generator=g), dim=1).requires_grad_()
    spans = (_spans(B, g), _spans(B, g))
    kw: dict = {"temperature": TEMPERATURE}
    leaves = [q, d]
    if kind != "loss":
        kw["bias"] = _bias(B, g, spans)
        leaves += list(kw["bias"])
    if kind == "loss_table":
        kw["bias_table_points"] = 4097

    def step(fn):
        return lambda: torch.autograd.grad(fn(q, d, *spans, **kw), leaves)
    steps = {"tempokern": step(tempokern.multipos_infonce), "eager": step(ref),
             "compile": step(_compile(ref, False)), "compile_autochunk": step(_compile(ref, True))}
    return steps, {"inf_cl": f"{INF_CL_CPU}; {INF_CL_NA}" if kind != "loss" else
                   f"{INF_CL_CPU}; and these spans give several positives per row"}


def build_mat(B: int):
    import torch
    import tempokern
    from tempokern.reference import matryoshka_infonce as ref
    dims = (64, 128, 256, 512, 768)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, generator=g).requires_grad_()
    d = torch.randn(B, H, generator=g).requires_grad_()

    def step(fn):
        return lambda: torch.autograd.grad(fn(q, d, dims, temperature=TEMPERATURE), [q, d])
    steps = {"tempokern": step(tempokern.matryoshka_infonce), "eager": step(ref),
             "compile": step(_compile(ref, False)), "compile_autochunk": step(_compile(ref, True))}
    return steps, {"inf_cl": f"{INF_CL_CPU} (one level per call: not a Matryoshka loss)",
                   "st_cached_mnrl": "not run: sentence-transformers' CachedMultipleNegativesRankingLoss re-encodes "
                   "mini-batches through a model (GradCache); it has no stage that takes precomputed embeddings"}


def build_re3(B: int):
    import torch
    import torch.nn.functional as F
    from tempokern.nn import Re3Loss
    from tempokern.reference import re3_loss
    D = 384
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, D, generator=g), dim=1)
    d = F.normalize(q + torch.randn(B, D, generator=g), dim=1)
    tw = F.normalize(d + 0.5 * torch.randn(B, D, generator=g), dim=1)
    q, d, tw = (t.requires_grad_() for t in (q, d, tw))
    ids = torch.arange(B)
    mod = Re3Loss(temperature=TEMPERATURE)

    def ref(*a):
        return re3_loss(*a, temperature=TEMPERATURE)

    def step(fn):
        return lambda: torch.autograd.grad(fn(q, d, tw, ids)[0], [q, d, tw])
    steps = {"tempokern": step(mod), "eager": step(ref), "compile": step(_compile(ref, False)),
             "compile_autochunk": step(_compile(ref, True))}
    return steps, {"inf_cl": f"{INF_CL_CPU}; no hardest-negative / time-wrong margins"}


def build_cal(op: str, rows: int):
    import torch
    import tempokern
    from tempokern import reference
    levels, dim = (12, 32, 12), 64
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, n, generator=g).requires_grad_() for n in levels]
    args = (dim,) if op == "calendar_context" else ()
    gout = torch.randn(rows, len(levels) * dim, generator=g) if args else torch.randn(rows, generator=g)
    ref = getattr(reference, op)

    def step(fn):
        return lambda: torch.autograd.grad(fn(xs, *args), xs, gout)
    steps = {"tempokern": step(getattr(tempokern, op)), "eager": step(ref), "compile": step(_compile(ref, False)),
             "compile_autochunk": step(_compile(ref, True))}
    return steps, {}


def build_topk(Q: int):
    import torch
    import tempokern
    N, k = 100_000, 10
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(Q, H, generator=g), dim=1)
    gal = torch.nn.functional.normalize(torch.randn(N, H, generator=g), dim=1)
    steps = {"tempokern": lambda: tempokern.ctd_topk(q, gal, k, temperature=TEMPERATURE),
             "torch_topk": lambda: torch.topk(q @ gal.t(), k, dim=1)}
    skip = {}
    try:
        import faiss
        index = faiss.IndexFlatIP(H)
        index.add(gal.numpy())
        qn = q.numpy()
        steps["faiss_flat"] = lambda: index.search(qn, k)
    except ImportError:
        skip["faiss_flat"] = "skipped: faiss not installed"
    return steps, skip


def build(kind: str, x: int):
    if kind.startswith("loss"):
        return build_loss(kind, x)
    if kind == "mat":
        return build_mat(x)
    if kind == "re3":
        return build_re3(x)
    if kind == "cal_scalar":
        return build_cal("calendar_scalar", x)
    if kind == "cal_context":
        return build_cal("calendar_context", x)
    if kind == "topk":
        return build_topk(x)
    raise ValueError(f"unknown case kind {kind!r}")


# ---- measurement (child) -----------------------------------------------------------------------------------------

def quantiles(xs: List[float]) -> Tuple[float, float, float]:
    """p50, p20, p80 (linear interpolation between order statistics)."""
    s = sorted(xs)

    def q(p):
        if len(s) == 1:
            return s[0]
        i = p * (len(s) - 1)
        lo = math.floor(i)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)
    return q(0.5), q(0.2), q(0.8)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_mb(fn) -> float:
    import threading
    base = peak = _rss()
    stop = []

    def sample():
        nonlocal peak
        while not stop:
            peak = max(peak, _rss())
            time.sleep(0.001)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out = fn()
        del out
    finally:
        stop.append(1)
        t.join()
    return (max(peak, _rss()) - base) / 2 ** 20


def run_child(name: str, x: int, rounds: int, max_call_s: float) -> List[dict]:
    import torch
    op, label, x_name, _, kind, _r = CASES[name]
    steps, skips = build(kind, x)
    out: List[dict] = []
    status: Dict[str, str] = dict(skips)
    alive = {}
    for p, fn in steps.items():   # warm-up (compile providers: the compilation)
        t = time.perf_counter()
        try:
            r = fn()
            del r
        except Exception as e:   # noqa: BLE001 -- reported as a row
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            status[p] = f"error: {type(e).__name__}: {' / '.join(lines[:3])[:300]}"
            continue
        w = time.perf_counter() - t
        alive[p] = fn
        out.append(dict(provider=p, metric="warmup_s", unit="s", p50=w, p20=w, p80=w, n=1,
                        note="first call (compile providers: dynamo + inductor compilation)"))
    times: Dict[str, List[float]] = {p: [] for p in alive}
    cpu: Dict[str, List[float]] = {p: [] for p in alive}
    order = list(alive)
    for r in range(rounds):
        rot = order[r % len(order):] + order[:r % len(order)] if order else []
        for p in rot:
            t, c = time.perf_counter(), time.process_time()
            res = alive[p]()
            times[p].append((time.perf_counter() - t) * 1e3)
            cpu[p].append((time.process_time() - c) * 1e3)
            del res
    for p in alive:
        p50, p20, p80 = quantiles(times[p])
        out.append(dict(provider=p, metric="time_ms", unit="ms", p50=p50, p20=p20, p80=p80, n=len(times[p]), note=""))
        p50, p20, p80 = quantiles(cpu[p])
        out.append(dict(provider=p, metric="cpu_time_ms", unit="ms", p50=p50, p20=p20, p80=p80, n=len(cpu[p]),
                        note="process CPU time of the call (all threads): what other jobs on the cores do not add"))
        mb = peak_rss_mb(alive[p])
        out.append(dict(provider=p, metric="extra_peak_mb", unit="MB", p50=mb, p20=mb, p80=mb, n=1,
                        note="peak RSS above the call's start, one call after the timed rounds"))
    for p, why in status.items():
        out.append(dict(provider=p, metric="status", unit="", p50="", p20="", p80="", n=0, note=why))
    for r in out:
        r.update(op=op, case=label, x_name=x_name, x_value=x)
    return out


# ---- parent ------------------------------------------------------------------------------------------------------

def commit() -> str:
    if os.environ.get("TEMPOKERN_GIT_COMMIT"):
        return os.environ["TEMPOKERN_GIT_COMMIT"]
    try:
        c = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                           timeout=10).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--",
                                "csrc", "tempokern"], capture_output=True, text=True, timeout=10).stdout.strip()
        return c + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device(threads: int) -> str:
    sys.path.insert(0, str(HERE))
    from _record import cpu_model
    import platform
    return f"{platform.machine()} {cpu_model()} cpu x{os.cpu_count()} (torch threads {threads})"


def fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (--list)")
    ap.add_argument("--x", default=None, help="comma-separated sizes overriding the cases' own")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per case (default: the case's own)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--csv", default=str(CSV_PATH))
    ap.add_argument("--max-call-s", type=float, default=20.0)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "X"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        for n, (op, label, xn, xs, kind, r) in CASES.items():
            print(f"{n}: {label} ({op}); {xn} in {xs}; {r} rounds")
        return 0
    if args.child:
        import torch
        torch.set_num_threads(args.threads)
        rows = run_child(args.child[0], int(args.child[1]), args.rounds or CASES[args.child[0]][5], args.max_call_s)
        print("ROWS " + json.dumps(rows))
        return 0
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    for n in names:
        if n not in CASES:
            ap.error(f"--cases: unknown case {n!r} (known: {', '.join(CASES)})")
    import torch
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "device": device(args.threads),
            "torch": torch.__version__, "commit": commit()}
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_="131072")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        for n in names:
            op, label, xn, xs, kind, r = CASES[n]
            for x in ([int(v) for v in args.x.split(",")] if args.x else xs):
                t0 = time.time()
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", n, str(x), "--threads",
                       str(args.threads)] + (["--rounds", str(args.rounds)] if args.rounds else [])
                res = subprocess.run(cmd, env=env, capture_output=True, text=True)
                line = [ln for ln in res.stdout.splitlines() if ln.startswith("ROWS ")]
                load = os.getloadavg()[0]
                if res.returncode != 0 or not line:
                    rows = [dict(op=op, case=label, x_name=xn, x_value=x, provider=p, metric="status", unit="",
                                 p50="", p20="", p80="", n=0,
                                 note=f"error: child exited {res.returncode}: {res.stderr.strip()[-300:]}")
                            for p in ("all",)]
                else:
                    rows = json.loads(line[-1][5:])
                for row in rows:
                    row.update(meta)
                    row["src_hash"] = _sources.source_hash(op, "cpu", row["provider"])
                    row["note"] = "; ".join(x for x in (row.get("note", ""), f"load avg {load:.1f}") if x)
                    w.writerow({k: fmt(row.get(k, "")) for k in FIELDS})
                f.flush()
                tm = {rw["provider"]: rw["p50"] for rw in rows if rw["metric"] == "time_ms"}
                print(f"{n} {xn}={x}: " + ", ".join(f"{p} {v:.1f} ms" for p, v in tm.items())
                      + f" ({time.time() - t0:.0f} s, load {load:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
