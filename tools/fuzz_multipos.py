"""Random-configuration fuzzing of tempokern.multipos_infonce against tempokern.reference (float64).

    python tools/fuzz_multipos.py [--seconds 120] [--seed 0] [--cuda-emu]

--cuda-emu runs the fused op's CUDA kernels on the CPU emulator (tools/cuda_emu) instead of the CPU
kernels, with hidden sizes past one warp and D up to the CUDA limit of 65.

Each case draws B, H, extra negatives, hidden/D of the bias, span layout (random, disjoint, all
overlapping, points), u ranges (inside [0, 1], narrow, wide enough to clamp, all clamped, ties),
weight scales and temperature, then compares the loss and all gradients. Prints every mismatch and
exits 1 if any. b1 is never exactly zero: with D = 1 and u_d == u_q a pre-activation is then exactly
0, the ReLU kink, where fused and reference pick different (equally valid) subgradients."""
from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time

import torch


def case(rng: random.Random, wide: bool = False):
    B = rng.choice([1, 2, 3, 17, 64, 65, 96, 97, 150, 200, 257])
    H = rng.choice([1, 3, 8, 33])
    N = rng.choice([0, 0, 1, 5, 97])
    hidden, D = rng.randint(1, 8), rng.randint(1, 9)
    if wide and rng.random() < 0.5:
        hidden, D = rng.choice([31, 32, 33, 64, 70]), rng.choice([2, 31, 32, 63, 64, 65])
    g = torch.Generator().manual_seed(rng.randrange(10 ** 9))
    f64 = dict(dtype=torch.float64)
    q, d = torch.randn(B, H, generator=g, **f64), torch.randn(B, H, generator=g, **f64)
    mode = rng.choice(["random", "disjoint", "all", "points"])
    if mode == "random":
        qs, ds = torch.randint(0, 40, (B,), generator=g), torch.randint(0, 40, (B,), generator=g)
        qe, de = qs + torch.randint(-3, 4, (B,), generator=g), ds + torch.randint(-3, 4, (B,), generator=g)
    elif mode == "disjoint":
        qs = torch.arange(B) * 10
        qe, ds = qs + 2, qs + 5
        de = ds + 3
    elif mode == "all":
        qs, qe = torch.zeros(B, dtype=torch.int64), torch.full((B,), 100)
        ds = de = torch.full((B,), 50)
    else:
        qs, ds = torch.randint(0, 400, (B,), generator=g), torch.randint(0, 400, (B,), generator=g)
        qe, de = qs, ds
    ranges = [(0.0, 1.0), (0.4, 0.45), (-3.0, 4.0), (0.0, 0.0), (5.0, 6.0)]
    rq = rng.choice(ranges)
    rd = rq if rng.random() < 0.7 else rng.choice([(0.0, 1.0), (-2.0, -1.5)])
    u_q = torch.empty(B, **f64).uniform_(*rq, generator=g)
    u_d = u_q.clone() if rng.random() < 0.2 else torch.empty(B, **f64).uniform_(*rd, generator=g)
    w1 = torch.randn(hidden, D, generator=g, **f64) * rng.choice([0.01, 0.3, 1.0, 10.0])
    b1 = torch.randn(hidden, generator=g, **f64) * rng.choice([0.01, 0.1, 1.0, 5.0])
    w2, b2 = torch.randn(1, hidden, generator=g, **f64), torch.randn(1, generator=g, **f64)
    scale = torch.tensor(rng.choice([0.0, 0.7, -2.0]), **f64)
    neg = torch.randn(N, H, generator=g, **f64) if N else None
    kw = dict(temperature=rng.choice([0.05, 0.3, 1.0]), symmetric=rng.random() < 0.6)
    info = dict(B=B, H=H, N=N, hidden=hidden, D=D, spans=mode, u_q=rq, u_d=rd, **kw)
    return (q, d, ((qs, qe), (ds, de)), (u_q, u_d, w1, b1, w2, b2, scale), neg, kw), info


def compare(inputs) -> list:
    import tempokern
    from tempokern.reference import multipos_infonce as ref
    q, d, spans, bias, neg, kw = inputs
    leaves = [q, d, *bias] + ([neg] if neg is not None else [])
    results = []
    for fn in (tempokern.multipos_infonce, ref):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        b = tuple(xs[2:9])
        loss = fn(xs[0], xs[1], *spans, bias=b, extra_neg=xs[9] if neg is not None else None, **kw)
        grads = torch.autograd.grad(loss, xs, allow_unused=True)
        results.append([loss] + [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, xs)])
    bad = []
    for i, (a, b) in enumerate(zip(*results)):
        if not torch.allclose(a, b, rtol=1e-8, atol=1e-9):
            bad.append((i, float((a - b).abs().max()), float(b.abs().max())))
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cuda-emu", action="store_true", help="test the CUDA kernels on the CPU emulator")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    ctx = contextlib.nullcontext
    if args.cuda_emu:
        import os
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu"))
        import build as emu_build
        from emu_support import cuda_emulator  # tools/cuda_emu
        emu = emu_build.load()
        ctx = lambda: cuda_emulator(emu)  # noqa: E731
    end, n, fails = time.time() + args.seconds, 0, 0
    while time.time() < end:
        inputs, info = case(rng, wide=args.cuda_emu)
        with ctx():
            bad = compare(inputs)
        n += 1
        if bad:
            fails += 1
            print("MISMATCH", info, "(tensor index, max diff, max |reference|):", bad, flush=True)
    print(f"{n} cases, {fails} mismatches")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
