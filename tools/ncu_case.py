"""One multipos_infonce fwd+bwd on CUDA for Nsight Compute (`ncu --kernel-name regex:mpb_ python3 tools/ncu_case.py`)."""
import sys

import torch

import tempokern

B = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.nn.functional.normalize(torch.randn(B, 768, device="cuda", generator=g), dim=1).bfloat16().requires_grad_()
d = torch.nn.functional.normalize(torch.randn(B, 768, device="cuda", generator=g), dim=1).bfloat16().requires_grad_()
m = torch.randint(0, 4608, (B,), device="cuda", generator=g)
loss = tempokern.multipos_infonce(q, d, (m, m + 1), (m, m + 2), temperature=0.05)
loss.backward()
torch.cuda.synchronize()
print("loss", loss.item())
