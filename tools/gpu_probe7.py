"""Third GPU session's probe (2026-11-23): where the time goes after session 6's changes.
`python3 tools/gpu_probe7.py [part ...]`, parts: topk, calendar, profile, mrl (default all). CUDA-event medians."""
import os
import sys

import torch

from gpu_timing import med, prof

import tempokern
import tempokern._ops.ctd_topk as tk

dev = "cuda"
parts = sys.argv[1:] or ["topk", "calendar", "profile", "mrl"]


g = torch.Generator(device=dev).manual_seed(0)
ob = tempokern.nn.OffsetBias(features=32, hidden=32).to(dev)
bp = [t.detach().float() for t in tempokern.nn.offset_bias.bias_params(ob)]

if "topk" in parts:
    N, H = 1_000_000, 768
    gal = torch.nn.functional.normalize(torch.randn(N, H, device=dev, generator=g), dim=1).bfloat16()
    ug = torch.rand(N, device=dev, generator=g)
    print("ctd_topk N=1M k=10 bf16: Q, bias, serve ms, prev ms")
    for Q in (1, 2, 4, 8, 16):
        qq = torch.nn.functional.normalize(torch.randn(Q, H, device=dev, generator=g), dim=1).bfloat16()
        uq = torch.rand(Q, device=dev, generator=g)
        for bname, bias in (("none", None), ("exact", (uq, ug, *bp))):
            r = []
            for serve in ("1", "0"):
                os.environ["TEMPOKERN_TOPK_SERVE"] = serve
                old = tk._SERVE_MAX_Q
                tk._SERVE_MAX_Q = tk._SERVE_KERNEL_MAX_Q
                r.append(med(lambda: tempokern.ctd_topk(qq, gal, 10, bias=bias)))
                tk._SERVE_MAX_Q = old
            print(f"topk Q={Q:3d} {bname:6s} serve {r[0]:7.3f} prev {r[1]:7.3f}", flush=True)
    os.environ["TEMPOKERN_TOPK_SERVE"] = "1"
    qq = torch.nn.functional.normalize(torch.randn(1, H, device=dev, generator=g), dim=1).bfloat16()
    prof("topk Q=1 exact serve", lambda: tempokern.ctd_topk(qq, gal, 10, bias=(torch.rand(1, device=dev), ug, *bp)))
    del gal, ug

if "calendar" in parts:
    R = 1 << 20
    logits = [torch.randn(R, k, device=dev, generator=g).requires_grad_() for k in (12, 32, 12)]
    for v in ("v1", "v2"):
        os.environ["TEMPOKERN_CALENDAR"] = v
        f_ctx = med(lambda: tempokern.calendar_context(logits, 64))
        fb_ctx = med(lambda: tempokern.calendar_context(logits, 64).sum().backward())
        f_sc = med(lambda: tempokern.calendar_scalar(logits))
        fb_sc = med(lambda: tempokern.calendar_scalar(logits).sum().backward())
        print(f"calendar {v}: context fwd {f_ctx:.3f} fwd+bwd {fb_ctx:.3f}; scalar fwd {f_sc:.3f} fwd+bwd {fb_sc:.3f}",
              flush=True)
        prof(f"calendar_context {v}", lambda: tempokern.calendar_context(logits, 64).sum().backward(), rows=8)
    os.environ.pop("TEMPOKERN_CALENDAR")
    del logits

if "profile" in parts:
    for B in (8192, 65536):
        q = torch.nn.functional.normalize(torch.randn(B, 768, device=dev, generator=g), dim=1).bfloat16().requires_grad_()
        d = torch.nn.functional.normalize(torch.randn(B, 768, device=dev, generator=g), dim=1).bfloat16().requires_grad_()
        m = torch.randint(0, 4608, (B,), device=dev, generator=g)
        for st in ("v1", "v2"):
            os.environ["TEMPOKERN_MPB_STATS"] = st
            step = lambda: tempokern.multipos_infonce(q, d, (m, m + 1), (m, m + 2), temperature=0.05).backward()
            print(f"loss B={B} stats {st}: {med(step, reps=10 if B > 8192 else 30):.3f} ms", flush=True)
            prof(f"loss B={B} stats {st}", step)
        os.environ.pop("TEMPOKERN_MPB_STATS")
        if B == 8192:
            def stepg():
                tempokern.multipos_infonce(q, d, (m, m + 1), (m, m + 2), temperature=0.05).backward()
            gr = torch.cuda.CUDAGraph()
            try:
                s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        q.grad = d.grad = None; stepg()
                torch.cuda.current_stream().wait_stream(s)
                q.grad = d.grad = None
                with torch.cuda.graph(gr):
                    stepg()
                print(f"loss B=8192 v1 as a CUDA graph replay: {med(gr.replay):.3f} ms (launch overhead bound)")
            except Exception as e:  # noqa: BLE001
                print("graph capture failed:", type(e).__name__, str(e)[:200])
        del q, d

if "mrl" in parts:
    B = 8192
    q = torch.nn.functional.normalize(torch.randn(B, 768, device=dev, generator=g), dim=1).bfloat16().requires_grad_()
    d = torch.nn.functional.normalize(torch.randn(B, 768, device=dev, generator=g), dim=1).bfloat16().requires_grad_()
    dims = (64, 128, 256, 512, 768)
    step = lambda: tempokern.matryoshka_infonce(q, d, dims, temperature=0.05).backward()
    print(f"matryoshka B=8192 fused: {med(step):.3f} ms", flush=True)
    prof("matryoshka B=8192 fused", step, rows=14)
print("probe done", flush=True)
