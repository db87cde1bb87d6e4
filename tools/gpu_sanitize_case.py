"""Small calls of every CUDA op, for compute-sanitizer (memcheck / racecheck / synccheck):
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 tools/gpu_sanitize_case.py
Exits non-zero on a mismatch with the float64 reference (so a sanitizer run also checks the numbers). The calls
of the default paths run with no candidate enabled; the candidates' calls (tempokern/_ops/dispatch.py) run with
TEMPOKERN_EXPERIMENTAL naming them (candidate() below).

memcheck needs PyTorch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1): with it, tensors are carved out
of large cached segments, and an overrun past a tensor's end that stays inside its segment is invisible to
memcheck. The script sets the variable itself (before torch allocates) unless the caller set it.

The tensor-core Matryoshka kernels run with each of their tiles (64 x 64, whose backward's top-level score tile
overlays the operand stages; 128 x 64; 128 x 128), each also with one CUDA block per row block walking every column
tile (one column split), and the script checks that those launches happened. The offset bias has a nonzero scale,
so the bias values it checks are not all zero."""
import contextlib
import os

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

import tempokern  # noqa: E402
import tempokern._ops.matryoshka_blocked as mb  # noqa: E402
from tempokern import reference as ref  # noqa: E402

torch.manual_seed(0)
dev = "cuda"
os.environ.pop("TEMPOKERN_EXPERIMENTAL", None)   # the defaults, except inside candidate()


@contextlib.contextmanager
def candidate(names):
    """The block's calls with the candidates `names` (comma-separated) enabled."""
    os.environ["TEMPOKERN_EXPERIMENTAL"] = names
    try:
        yield
    finally:
        os.environ.pop("TEMPOKERN_EXPERIMENTAL", None)


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
with torch.no_grad():
    ob.scale.fill_(0.7)  # the module starts at scale 0: every bias value would be 0
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
assert ref.offset_bias(*b).abs().max().item() > 1e-3, "the offset bias checks need nonzero bias values"
check("offset_bias exact", tempokern.offset_bias(*bias32), ref.offset_bias(*b), 1e-4)
logits = [torch.randn(B, k, device=dev) for k in (12, 32, 12)]
check("calendar_context", tempokern.calendar_context(logits, 16), ref.calendar_context([x.double() for x in logits], 16), 1e-5)
# calendar_context forward and backward, the default and the calendar_v3 candidate (two launches of 3 + 1 levels)
cl = [torch.randn(B, k, device=dev).requires_grad_() for k in (12, 32, 17, 3)]
cw = torch.randn(B, 4 * 64, device=dev)
c64 = [x.detach().double().requires_grad_() for x in cl]
cr = torch.autograd.grad(ref.calendar_context(c64, 64), c64, grad_outputs=cw.double())
sw = torch.randn(B, device=dev)
sr = torch.autograd.grad(ref.calendar_scalar(c64), c64, grad_outputs=sw.double())
check("calendar_scalar", tempokern.calendar_scalar(logits), ref.calendar_scalar([x.double() for x in logits]), 1e-5)
for names in ("", "calendar_v3"):
    with candidate(names):
        cg = torch.autograd.grad(tempokern.calendar_context(cl, 64), cl, grad_outputs=cw)
        check(f"calendar_context grads {names or 'default'}", torch.cat([x.flatten() for x in cg]),
              torch.cat([x.flatten() for x in cr]), 1e-4)
        # calendar_scalar backward
        sg = torch.autograd.grad(tempokern.calendar_scalar(cl), cl, grad_outputs=sw)
        check(f"calendar_scalar grads {names or 'default'}", torch.cat([x.flatten() for x in sg]),
              torch.cat([x.flatten() for x in sr]), 1e-4)
g = torch.randn(5000, H, device=dev)
qq = torch.randn(9, H, device=dev)
v, i = tempokern.ctd_topk(qq, g, 10)
vr, ir = ref.ctd_topk(qq.double(), g.double(), 10)
check("ctd_topk none", v, vr, 1e-4)

# The blocked loss's fused glue (prep / finalize with its last-CTA counter / table-gradient kernels) on a batch
# large enough for several CTAs, the Matryoshka paths, the ctd_topk serve kernels (Q = 1 and 16), return_hardest.
SMALL = os.environ.get("SAN_SMALL") == "1"  # racecheck is slow: smaller sizes
B2, H2 = (600, 32) if SMALL else (1500, 64)
q2 = torch.randn(B2, H2, device=dev, dtype=torch.float64, requires_grad=True)
d2 = torch.randn(B2, H2, device=dev, dtype=torch.float64, requires_grad=True)
s2 = torch.randint(0, 300, (B2,), device=dev)
sp2 = ((s2, s2 + torch.randint(1, 9, (B2,), device=dev)), (torch.randint(0, 300, (B2,), device=dev),) * 2)
sp2 = (sp2[0], (sp2[1][0], sp2[1][0] + 2))
u_q2, u_d2 = torch.rand(B2, device=dev, dtype=torch.float64), torch.rand(B2, device=dev, dtype=torch.float64)
b2 = (u_q2, u_d2, *tempokern.nn.offset_bias.bias_params(ob))
for pts, bias in ((None, None), (257, b2), (None, b2)):
    lf = tempokern.multipos_infonce(q2, d2, *sp2, temperature=0.1, bias=bias, bias_table_points=pts)
    lr = ref.multipos_infonce(q2, d2, *sp2, temperature=0.1, bias=bias, bias_table_points=pts)
    gf = torch.autograd.grad(lf, [q2, d2])
    gr = torch.autograd.grad(lr, [q2, d2])
    check(f"blocked pts={pts} bias={bias is not None}", torch.stack([lf, *[x.sum() for x in gf]]),
          torch.stack([lr, *[x.sum() for x in gr]]), 1e-8)
# the blocked path in float32 (float accumulation: the float64 reference on the same rounded values)
q4, d4 = (t.detach().float().requires_grad_() for t in (q2, d2))
b4 = tuple(t.detach().float() for t in b2)
for pts, bias in ((None, None), (257, b4), (None, b4)):
    lf = tempokern.multipos_infonce(q4, d4, *sp2, temperature=0.1, bias=bias, bias_table_points=pts)
    q64, d64 = (t.detach().double().requires_grad_() for t in (q4, d4))
    lr = ref.multipos_infonce(q64, d64, *sp2, temperature=0.1, bias=None if bias is None else
                              tuple(t.double() for t in bias), bias_table_points=pts)
    gf = torch.autograd.grad(lf, [q4, d4])
    gr = torch.autograd.grad(lr, [q64, d64])
    check(f"blocked float32 pts={pts} bias={bias is not None}", torch.stack([lf.double(), *[x.double().sum() for x in gf]]),
          torch.stack([lr, *[x.sum() for x in gr]]), 1e-3)
lf, hf = tempokern.multipos_infonce(q2.detach(), d2.detach(), *sp2, temperature=0.1, return_hardest=True)
print("return_hardest", tuple(hf.shape), flush=True)
q3 = q2.detach().float().requires_grad_()
d3 = d2.detach().float().requires_grad_()
for sym in (False, True):
    lf = tempokern.matryoshka_infonce(q3, d3, (8, 20, H2), temperature=0.05, symmetric=sym)
    lr = ref.matryoshka_infonce(q3.double(), d3.double(), (8, 20, H2), temperature=0.05, symmetric=sym)
    gf = torch.autograd.grad(lf, [q3, d3])
    check(f"matryoshka sym={sym}", lf, lr, 1e-4)
    # bf16, dims multiples of 16: the default, and the mrl_tc / mpb_tc candidates (the tensor-core kernels)
    qb3, db3 = q2.detach().bfloat16().requires_grad_(), d2.detach().bfloat16().requires_grad_()
    tc_dims = sorted({16, 32, H2})
    for names in ("", "mrl_tc,mpb_tc"):
        with candidate(names):
            lf = tempokern.matryoshka_infonce(qb3, db3, tc_dims, temperature=0.05, symmetric=sym)
            lr = ref.matryoshka_infonce(qb3.double(), db3.double(), tc_dims, temperature=0.05, symmetric=sym)
            gf = torch.autograd.grad(lf, [qb3, db3])
            # the default's bf16 levels round as eager torch in bf16 does (~4e-3 here); the tensor-core kernels
            # keep the scores in float32
            check(f"matryoshka bf16 {names or 'default'} sym={sym}", lf, lr, 1e-4 if names else 1e-2)
            # the multipos loss without a bias and with the table bias (shared-memory histogram: 97 points;
            # global: 20,001)
            for pts in (None, 97, 20001):
                bb = None if pts is None else tuple(t.float() for t in b)
                lf = tempokern.multipos_infonce(qb3[:B], db3[:B], *sp, temperature=0.1, bias=bb,
                                                bias_table_points=pts, symmetric=sym)
                lr = ref.multipos_infonce(qb3[:B].double(), db3[:B].double(), *sp, temperature=0.1,
                                          bias=None if pts is None else b, bias_table_points=pts, symmetric=sym)
                torch.autograd.grad(lf, [qb3, db3])
                check(f"multipos bf16 {names or 'default'} table={pts} sym={sym}", lf, lr, 1e-4)
# every tensor-core tile, forward and backward, with the column tiles spread over splits (the default grid) and with
# one split per row block (TC_BLOCKS_PER_SM = 0: each CUDA block walks every column tile): K = 2 levels, K = 1 for
# 128 x 128 (whose 2-level backward exceeds an A100's 163 KB), and the table bias (K = 1, the tile where it fits)
tc_seen = set()
_tc_launch = mb._tc_launch


def _spy(F, op, i0, i1, K, splits, **outs):
    tc_seen.add((F.tr, F.tcl, op, splits[1] > 1))
    return _tc_launch(F, op, i0, i1, K, splits, **outs)


mb._tc_launch = _spy
blocks_per_sm = mb.TC_BLOCKS_PER_SM
qt, dt = q2.detach().bfloat16(), d2.detach().bfloat16()
tile_dims = {"64x64": (16, 32), "128x64": (16, 32), "128x128": (32,)}
_tc_tile = mb.tc_tile


def _forced(name):  # the named tile where the shared memory holds it, else the next smaller (the kernels take any)
    order = [(128, 128), (128, 64), (64, 64)]
    want = tuple(int(v) for v in name.split("x"))

    def tile(K, table, hist_points, optin):
        for t in order[order.index(want):]:
            if mb.kernels().mrl_tc_smem_bytes(K, True, table, hist_points, *t) <= optin:
                return t
        return 64, 64
    return tile


for tile, dims in tile_dims.items():
    mb.tc_tile = _forced(tile)
    for mb.TC_BLOCKS_PER_SM in (blocks_per_sm, 0):
        qa, da = qt.clone().requires_grad_(), dt.clone().requires_grad_()
        with candidate("mrl_tc,mpb_tc"):
            lf = tempokern.matryoshka_infonce(qa, da, dims, temperature=0.05, symmetric=True)
        lr = ref.matryoshka_infonce(qt.double(), dt.double(), dims, temperature=0.05, symmetric=True)
        gf = torch.autograd.grad(lf, [qa, da])
        check(f"matryoshka tc tile={tile} walk={mb.TC_BLOCKS_PER_SM == 0}", lf, lr, 1e-4)
        bb = tuple(t.float() for t in b2)
        with candidate("mrl_tc,mpb_tc"):
            lf = tempokern.multipos_infonce(qa, da, *sp2, temperature=0.1, bias=bb, bias_table_points=257)
        lr = ref.multipos_infonce(qt.double(), dt.double(), *sp2, temperature=0.1, bias=b2, bias_table_points=257)
        torch.autograd.grad(lf, [qa, da])
        check(f"multipos tc table tile={tile} walk={mb.TC_BLOCKS_PER_SM == 0}", lf, lr, 1e-4)
mb.TC_BLOCKS_PER_SM = blocks_per_sm
mb._tc_launch = _tc_launch
mb.tc_tile = _tc_tile
if mb.tc_supported(qt):  # each tile whose backward fits this device's shared memory
    optin = mb.kernels().mrl_tc_smem_optin(mb.launch_args(qt)[0])
    fits = [tuple(int(v) for v in t.split("x")) for t, dims in tile_dims.items()
            if mb.kernels().mrl_tc_smem_bytes(len(dims), True, False, 0, *(int(v) for v in t.split("x"))) <= optin]
    want = {(tr, tcl, op, walk) for tr, tcl in fits for op in ("fwd", "bwd") for walk in (False, True)}
    assert want <= tc_seen, f"tensor-core launches missing: {sorted(want - tc_seen)}"
    print(f"tensor-core tiles run: {sorted(tc_seen)}", flush=True)
NG = 9000 if SMALL else 70000
gg = torch.randn(NG, H, device=dev)
ugg = torch.rand(NG, device=dev)
for Q in (1, 16):
    qq = torch.randn(Q, H, device=dev)
    uq = torch.rand(Q, device=dev)
    for name, bias in (("none", None), ("exact", (uq, ugg, *[t.float() for t in tempokern.nn.offset_bias.bias_params(ob)]))):
        v, i = tempokern.ctd_topk(qq, gg, 10, bias=bias)
        bref = None if bias is None else tuple(t.double() for t in bias)
        vr, ir = ref.ctd_topk(qq.double(), gg.double(), 10, bias=bref)
        check(f"ctd_topk serve Q={Q} {name}", v, vr, 1e-3)
print("all ok", flush=True)
