"""Small calls of every CUDA op, for compute-sanitizer (memcheck / racecheck):
    compute-sanitizer --tool memcheck python3 tools/gpu_sanitize_case.py
Exits non-zero on a mismatch with the float64 reference (so a sanitizer run also checks the numbers)."""
import torch

import tempokern
from tempokern import reference as ref

torch.manual_seed(0)
dev = "cuda"


def check(name, got, want, tol):
    err = (got.double().cpu() - want.double().cpu()).abs().max().item()
    print(f"{name:40s} max err {err:.2e}", flush=True)
    assert err <= tol, name


B, H = 300, 40
q = torch.randn(B, H, device=dev, dtype=torch.float64, requires_grad=True)
d = torch.randn(B, H, device=dev, dtype=torch.float64, requires_grad=True)
n = torch.randn(7, H, device=dev, dtype=torch.float64, requires_grad=True)
s = torch.randint(0, 40, (B,), device=dev)
sp = ((s, s + 1), (torch.randint(0, 40, (B,), device=dev),) * 2)
ob = tempokern.nn.OffsetBias(features=8, hidden=6).to(dev).double()
u_q, u_d = torch.rand(B, device=dev, dtype=torch.float64), torch.rand(B, device=dev, dtype=torch.float64)
b = (u_q, u_d, *tempokern.nn.offset_bias.bias_params(ob))
for pts in (None, 97):
    for bias in (None, b):
        if bias is None and pts is not None:
            continue
        lf = tempokern.multipos_infonce(q, d, *sp, temperature=0.1, bias=bias, extra_neg=n, bias_table_points=pts)
        lr = ref.multipos_infonce(q, d, *sp, temperature=0.1, bias=bias, extra_neg=n, bias_table_points=pts)
        gf = torch.autograd.grad(lf, [q, d, n])
        gr = torch.autograd.grad(lr, [q, d, n])
        check(f"multipos bias={bias is not None} pts={pts}", torch.stack([lf, *[x.sum() for x in gf]]),
              torch.stack([lr, *[x.sum() for x in gr]]), 1e-8)
qb, db = q.detach().bfloat16().requires_grad_(), d.detach().bfloat16().requires_grad_()
tempokern.multipos_infonce(qb, db, *sp, temperature=0.1).backward()
bias32 = tuple(t.float() for t in b)
check("offset_bias exact", tempokern.offset_bias(*bias32), ref.offset_bias(*b), 1e-4)
logits = [torch.randn(B, k, device=dev) for k in (12, 32, 12)]
check("calendar_context", tempokern.calendar_context(logits, 16), ref.calendar_context([x.double() for x in logits], 16), 1e-5)
check("calendar_scalar", tempokern.calendar_scalar(logits), ref.calendar_scalar([x.double() for x in logits]), 1e-5)
g = torch.randn(5000, H, device=dev)
qq = torch.randn(9, H, device=dev)
v, i = tempokern.ctd_topk(qq, g, 10)
vr, ir = ref.ctd_topk(qq.double(), g.double(), 10)
check("ctd_topk none", v, vr, 1e-4)
print("all ok", flush=True)
