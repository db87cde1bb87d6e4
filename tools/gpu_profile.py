"""Kernel-time breakdown of one CUDA loss step (torch.profiler): `python3 tools/gpu_profile.py B [table]`."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import tempokern

B = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
table = len(sys.argv) > 2
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.nn.functional.normalize(torch.randn(B, 768, device="cuda", generator=g), dim=1).bfloat16().requires_grad_()
d = torch.nn.functional.normalize(torch.randn(B, 768, device="cuda", generator=g), dim=1).bfloat16().requires_grad_()
m = torch.randint(0, 4608, (B,), device="cuda", generator=g)
b, pts = None, None
if table:
    ob = tempokern.nn.OffsetBias(features=32, hidden=32).cuda()
    b, pts = (m.float() / 4607, m.float() / 4607, *tempokern.nn.offset_bias.bias_params(ob)), 4097


def step():
    tempokern.multipos_infonce(q, d, (m, m + 1), (m, m + 2), temperature=0.05, bias=b, bias_table_points=pts).backward()


step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
