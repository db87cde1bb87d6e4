"""Fourth GPU session's probe (2026-11-23): the loss passes with the base-2 statistics / gradient kernels and
with half-precision score blocks, the Matryoshka levels path. `python3 tools/gpu_probe8.py [part ...]`, parts:
loss, mrl (default both). CUDA-event medians; a CUDA-kernel profile per variant."""
import os
import sys

import torch

from gpu_timing import med, prof

import tempokern

dev = "cuda"
parts = sys.argv[1:] or ["loss", "mrl"]


def unit(B, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(B, 768, device=dev, generator=g), dim=1).bfloat16()
    return x.requires_grad_()


if "loss" in parts:
    for B in (8192, 65536):
        q, d = unit(B, 0), unit(B, 1)
        m = torch.randint(0, 4608, (B,), device=dev)
        for sc in ("f32", "half"):
            os.environ["TEMPOKERN_MPB_SCORES"] = sc
            step = lambda: tempokern.multipos_infonce(q, d, (m, m + 1), (m, m + 2), temperature=0.05).backward()
            print(f"loss B={B} scores {sc}: {med(step, reps=10 if B > 8192 else 30):.3f} ms", flush=True)
            prof(f"loss B={B} scores {sc}", step)
        os.environ.pop("TEMPOKERN_MPB_SCORES")
        del q, d

if "mrl" in parts:
    dims = (64, 128, 256, 512, 768)
    for B in (8192, 65536):
        q, d = unit(B, 0), unit(B, 1)
        for v in (("levels", "fused") if B == 8192 else ("levels",)):
            os.environ["TEMPOKERN_MRL_CUDA"] = v
            step = lambda: tempokern.matryoshka_infonce(q, d, dims, temperature=0.05).backward()
            print(f"matryoshka B={B} {v}: {med(step, reps=10 if B > 8192 else 20):.3f} ms", flush=True)
            if B == 8192:
                prof(f"matryoshka B={B} {v}", step, rows=8)
        os.environ.pop("TEMPOKERN_MRL_CUDA")
        del q, d
print("probe done", flush=True)
