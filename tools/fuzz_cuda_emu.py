"""Random-configuration fuzzing of the CUDA ctd_topk and offset_bias kernels on the CPU emulator
(tools/cuda_emu) against tempokern.reference. (multipos: tools/fuzz_multipos.py --cuda-emu.)

    python tools/fuzz_cuda_emu.py [--op topk|bias] [--seconds 240] [--seed 0]

Run from the repository root with the in-tree build importable (PYTHONPATH=.). Exits 1 on any mismatch."""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "cuda_emu"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def topk_case(rng, emu):
    from test_ctd_topk import check_against_reference, make_bias
    from emu_support import cuda_emulator  # tools/cuda_emu
    Q, N = rng.choice([1, 5, 63, 64, 65, 130]), rng.choice([1, 7, 128, 129, 1000, 2500])
    H, k = rng.choice([1, 4, 33, 64]), rng.randint(1, min(N, 256))
    dt = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    mode = rng.choice(["none", "exact", "table"])
    hidden, D = rng.choice([1, 7, 32, 33, 64]), rng.choice([1, 2, 16, 32, 63, 64])
    torch.manual_seed(rng.randrange(10 ** 6))
    q, g = torch.randn(Q, H).to(dt), torch.randn(N, H).to(dt)
    bias = None
    if mode == "exact":
        bias = make_bias(Q, N, scale=2.0, hidden=hidden, D=D, spread=rng.choice([1.0, 3.0]), seed=rng.randrange(1000))
    elif mode == "table":
        bias = (torch.rand(Q) * 3 - 1, torch.rand(N) * 3 - 1, torch.randn(rng.choice([2, 129, 1000])))
    ex = torch.randint(-1, N, (Q, rng.randint(1, 9))) if rng.random() < 0.3 and N - 9 >= k else None
    info = dict(Q=Q, N=N, H=H, k=k, dtype=str(dt), mode=mode, hidden=hidden, D=D, exclude=ex is not None)
    with cuda_emulator(emu):
        check_against_reference(q, g, k, atol=1e-3 if dt == torch.float32 else 3e-3, bias=bias, exclude=ex,
                                temperature=rng.choice([1.0, 0.3]))
    return info


def bias_case(rng, emu):
    import tempokern
    from tempokern import reference as ref
    from emu_support import cuda_emulator  # tools/cuda_emu
    Bq, Bd = rng.choice([1, 2, 31, 32, 33, 100, 257]), rng.choice([1, 5, 32, 33, 64, 65, 300])
    D, hid = rng.choice([1, 2, 3, 31, 32, 33, 64, 65, 128]), rng.choice([1, 5, 31, 32, 33, 64, 96, 128])
    lo, hi = rng.choice([(0, 1), (-3, 4), (0.4, 0.41), (2, 3)])
    g = torch.Generator().manual_seed(rng.randrange(10 ** 6))
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u = lambda n: torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo  # noqa: E731
    xs = [u(Bq), u(Bd), r(hid, D) * rng.choice([0.1, 1.0]), r(hid) + 0.01, r(1, hid), r(1),
          torch.tensor(0.7, dtype=torch.float64)]  # b1 off 0: no exact ReLU kinks
    xs = [x.requires_grad_() for x in xs]
    G = r(Bq, Bd)
    info = dict(Bq=Bq, Bd=Bd, D=D, hidden=hid, u=(lo, hi))
    with cuda_emulator(emu):
        o = tempokern.offset_bias(*xs)
        got = [o, *torch.autograd.grad((o * G).sum(), xs)]
    o = ref.offset_bias(*xs)
    want = [o, *torch.autograd.grad((o * G).sum(), xs)]
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.allclose(a, b, rtol=1e-8, atol=1e-9):
            raise AssertionError(f"tensor {i}: max diff {float((a - b).abs().max()):.3g}")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=["topk", "bias"], default="topk")
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay", type=int, default=None, help="run the one case a MISMATCH line names")
    args = ap.parse_args(argv)
    import build as emu_build
    emu = emu_build.load()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    run = topk_case if args.op == "topk" else bias_case
    end, n, fails = time.time() + args.seconds, 0, 0
    while time.time() < end:
        sub = rng.randrange(10 ** 9) if args.replay is None else args.replay
        try:
            run(random.Random(sub), emu)
        except Exception as e:  # noqa: BLE001 -- report the case (replay it with --replay) and go on
            fails += 1
            print(f"MISMATCH case {sub}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        n += 1
        if args.replay is not None:
            break
    print(f"{n} cases, {fails} mismatches")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
