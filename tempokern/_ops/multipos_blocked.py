"""Blocked multi-positive InfoNCE: the CUDA execution of the CTD loss (and its table-bias mode on CPU).

Schedule (one step, B rows, H features, C = B columns, N extra negatives):
  pass 1, per block of R rows:  S = q_blk d^T through torch (cuBLAS on CUDA: bf16/fp16 operands with
      float32 output where torch offers ``mm(..., out_dtype=float32)``, float32 (TF32 as torch is set) or
      float64 otherwise), then one fused kernel over S: offset bias, span-overlap mask, online row and column
      log-sum-exp partials (merged with torch.logsumexp). Extra negatives: E = q_blk n^T, row partials only.
  pass 2 (in the forward when a gradient will be needed; reuses S when everything fits in one block):
      S again, one fused kernel writes dS = inv_temp * dL/dx once in the operand dtype (and the bias
      gradient: table histogram + dL/du partials, or dL/dbias for the exact MLP), then torch:
      dq_blk = dS d, dd += dS^T q_blk.
Products: 2 B C H flops (pass 1) + 6 B C H (pass 2; 4 when one block holds everything). Bytes per score
element: 4 written by cuBLAS + 4 read (pass 1), 4 + 4 + 2 written + 2 x 2 read (pass 2), float32 scores
and bf16 dS. Extra memory: R x (C + N) x (score bytes + dS bytes) for the block (plus 8 bytes per element
for the exact bias block and its gradient), O((B + N) H) for the gradients; never B x B unless one block
holds it within the budget. The loss's gradient with respect to its output scale is linear, so the
gradients are computed for d loss = 1 and scaled in backward.

Glue: one prep kernel (int32 spans, fallback flags) per step, one finalize kernel per row block (row /
column statistics, hardest negative, loss) and, for the table bias, one tgrad kernel per row block, with every
small array in one workspace allocation: 4 kernel launches and 8 launching torch ops per fwd+bwd step without
bias (one block). Counts: tests/test_multipos_launches.py.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional

import torch

from . import backend
from .common import DTYPE_CODES, acc_dtype, ptr

TILE_COLS = 1024  # columns per CUDA block of the fused passes (256 threads x 4)
_out_dtype_ok: dict = {}
ITEMSIZE = {torch.float64: 8, torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def mm_out_f32(device: torch.device) -> bool:
    """Whether torch.mm accepts out_dtype=float32 for half operands on this device (torch >= 2.10 on CUDA)."""
    key = str(device)
    ok = _out_dtype_ok.get(key)
    if ok is None:
        try:
            a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
            ok = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _out_dtype_ok[key] = ok
    return ok


_addmm_ok: dict = {}


def addmm_into(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c += a @ b with c float32 and a, b fp16/bf16 on CUDA: one cuBLAS call accumulating into c where torch
    offers addmm(..., out_dtype=float32, out=c), else a float32 product and an add."""
    key = str(c.device)
    if _addmm_ok.get(key, True) and c.dtype == torch.float32 and a.dtype != c.dtype:
        try:
            torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
            _addmm_ok[key] = True
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _addmm_ok[key] = False
    if a.dtype == c.dtype:
        c.addmm_(a, b)
    else:
        c += mm_acc(a, b)


def mm_acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for the fused passes: float32 output for fp16/bf16 operands on CUDA when torch can (cuBLAS
    accumulates in float32 either way), the operands' dtype otherwise. CPU operands are float32/float64."""
    if a.device.type == "cuda" and a.dtype in (torch.float16, torch.bfloat16) and mm_out_f32(a.device):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b)


def none_flags(q_lo, q_hi, d_lo, d_hi):
    """(row_none (Bq,), col_none (Bd,)) uint8: 1 where the row (column) overlaps no column (row).
    O((Bq + Bd) log) with sorted bounds: overlaps_i = Bd - #(d_lo > q_hi_i) - #(d_hi < q_lo_i) (disjoint)."""
    Bq, Bd = q_lo.shape[0], d_lo.shape[0]
    dlo, dhi = torch.sort(d_lo).values, torch.sort(d_hi).values
    qlo, qhi = torch.sort(q_lo).values, torch.sort(q_hi).values
    row = Bd - (Bd - torch.searchsorted(dlo, q_hi, right=True)) - torch.searchsorted(dhi, q_lo)
    col = Bq - (Bq - torch.searchsorted(qlo, d_hi, right=True)) - torch.searchsorted(qhi, d_lo)
    return (row == 0).to(torch.uint8).contiguous(), (col == 0).to(torch.uint8).contiguous()


def spans32(q_lo, q_hi, d_lo, d_hi):
    """The four span-bound arrays as int32 with every comparison between them kept: shifted by their common
    minimum, or replaced by their ranks among all bounds when the range does not fit int32."""
    allb = torch.cat([q_lo, q_hi, d_lo, d_hi])
    if allb.numel() == 0:
        return tuple(t.to(torch.int32) for t in (q_lo, q_hi, d_lo, d_hi))
    if allb.device.type == "cpu" and int(allb.max()) - int(allb.min()) < 2**31 - 1:
        out = (allb - allb.min()).to(torch.int32)
    else:  # ranks (number of smaller bounds): order-preserving, and no device synchronisation on CUDA
        out = torch.searchsorted(torch.sort(allb).values, allb).to(torch.int32)
    return tuple(t.contiguous() for t in torch.split(out, [q_lo.numel(), q_hi.numel(), d_lo.numel(), d_hi.numel()]))


class _Workspace:
    """The step's small arrays (int32 spans, fallback flags, the finalize counter, row / column statistics,
    per-block partials) in one byte buffer: one allocation, raw pointers at 256-byte aligned offsets."""

    def __init__(self):
        self.size, self.offs, self.base = 0, {}, 0

    def add(self, name: str, nbytes: int) -> None:
        self.offs[name] = self.size
        self.size += -(-max(int(nbytes), 1) // 256) * 256

    def alloc(self, device: torch.device) -> None:
        self.buf = torch.empty(self.size, dtype=torch.uint8, device=device)
        self.base = self.buf.data_ptr()

    def __getitem__(self, name: str) -> int:
        return self.base + self.offs[name]


def _budget(device: torch.device) -> int:
    env = os.environ.get("TEMPOKERN_BLOCK_BYTES")
    if env:
        return max(1, int(env))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(max(64 << 20, min(1 << 30, free // 4)))
    return 256 << 20


def prep_spans(q_lo, q_hi, d_lo, d_hi, diag_offset: int, like: torch.Tensor, be=None):
    """((q_lo, q_hi, d_lo, d_hi) int32, row_none, col_none uint8) by the prep kernel (CUDA or the
    emulator; Bq, Bd > 0): the spans shifted into int32 (ranks when their range does not fit) and the rows /
    columns without any overlapping partner, as spans32 + none_flags compute with sorts. For callers outside
    blocked_loss (which launches the prep kernel into its one workspace, with the table histogram's zeroing)."""
    Bq, Bd = q_lo.numel(), d_lo.numel()
    dev = like.device
    sp = torch.empty(2 * (Bq + Bd), dtype=torch.int32, device=dev)
    fl = torch.empty(Bq + Bd, dtype=torch.uint8, device=dev)
    counter = torch.empty(1, dtype=torch.int32, device=dev)
    b64 = [t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
           for t in (q_lo, q_hi, d_lo, d_hi)]
    be = backend.resolve(like) if be is None else be
    d_, stream = be.launch
    be.kernels.multipos_block_prep(d_, stream, [Bq, Bd, int(diag_offset), 0],
                                  dict(q_lo=ptr(b64[0]), q_hi=ptr(b64[1]), d_lo=ptr(b64[2]), d_hi=ptr(b64[3]),
                                       spans32=ptr(sp), row_none=ptr(fl), col_none=ptr(fl) + Bq,
                                       counter=ptr(counter), zero=0))
    spans = (sp[:Bq], sp[Bq:2 * Bq], sp[2 * Bq:2 * Bq + Bd], sp[2 * Bq + Bd:])
    return spans, fl[:Bq], fl[Bq:]


def block_rows(Bq: int, C: int, N: int, per_elem: int, device: torch.device, requested: int = 0) -> int:
    """Rows per block: the whole batch when its score block fits the budget (1 GiB on CUDA, at most a
    quarter of free memory; TEMPOKERN_BLOCK_BYTES overrides), else a multiple of 256 rows."""
    if requested > 0:
        return max(1, min(Bq, requested))
    per_row = max(1, (C + N) * per_elem)
    if Bq * per_row <= 64 << 20:  # small enough for one block whatever the budget (no memory query)
        return max(1, Bq)
    R = _budget(device) // per_row
    if R >= Bq:
        return max(1, Bq)
    return int(max(256, R // 256 * 256)) if R >= 256 else int(max(1, R))


def tiling(R: int, C: int, be):
    """(TR, nct, nrt) on backend ``be`` (a Backend, or a device it is resolved from): CUDA blocks of TR rows x
    1024 columns, at least 4 x SMs of them where the block has the work for it; CPU: nrt chunks of TR rows (4 per
    thread)."""
    be = be if isinstance(be, backend.Backend) else backend.resolve(be)
    if be.cuda_path:
        nct = max(1, -(-C // TILE_COLS))
        want = -(-4 * be.sm_count // nct)
        TR = max(32, -(-max(1, -(-R // want)) // 32) * 32, -(-R // 65535))
    else:
        nct = 1
        TR = max(1, -(-R // (4 * max(1, torch.get_num_threads()))))
    nrt = max(1, -(-R // TR))
    return TR, nct, nrt


def _p(x) -> int:
    """A kernel argument: a raw pointer (an int: workspace address) or a tensor's data pointer."""
    return x if isinstance(x, int) else ptr(x)


class _Launcher:
    """Common arguments of every kernel launch of one loss evaluation."""

    def __init__(self, be, q, acc, odtype, inv_temp, diag_offset, spans, flags, u_q, u_d, table):
        self.dev, self.stream = be.launch
        self.kernels = be.kernels
        self.inv_temp, self.diag_offset, self.Bq = inv_temp, diag_offset, q.shape[0]
        self.od, self.ad = DTYPE_CODES[odtype], DTYPE_CODES[acc]
        self.spans, self.flags = spans, flags
        self.u_q, self.u_d, self.table = u_q, u_d, table

    def _ptrs(self, S, pos, bias_mode, extra):
        q_lo, q_hi, d_lo, d_hi = self.spans
        p = dict(S=ptr(S))
        if pos:
            p.update(q_lo=_p(q_lo), q_hi=_p(q_hi), d_lo=_p(d_lo), d_hi=_p(d_hi), row_none=_p(self.flags[0]),
                     col_none=_p(self.flags[1]))
        if bias_mode == 1:
            p.update(u_q=ptr(self.u_q), u_d=ptr(self.u_d), table=ptr(self.table))
        p.update({k: _p(v) for k, v in extra.items() if v is not None})
        return p

    def launch(self, op, S, i0, *, pos, cols, bias_mode, dense=None, tiling_, nslots=1, slot0=0, gr=0.0, gc=0.0,
               dS=None, nhist=0, **outs):
        TR, nct, nrt = tiling_
        R, C = S.shape
        P = 0 if bias_mode != 1 else self.table.numel()
        sizes = [R, C, i0, S.stride(0), int(pos), int(cols), self.diag_offset, bias_mode, P,
                 0 if dense is None else dense.stride(0), TR, nct, nrt, nslots, slot0, self.Bq,
                 0 if dS is None else dS.stride(0), nhist]
        sd = DTYPE_CODES[S.dtype]
        od = self.od if dS is None else DTYPE_CODES[dS.dtype]
        ptrs = self._ptrs(S, pos, bias_mode, dict(dense=dense, dS=dS, **outs))
        self.kernels.multipos_block_launch(op, self.dev, self.stream, [sd, od, self.ad], sizes,
                                        [self.inv_temp, gr, gc], ptrs)


def blocked_loss(q, d, q_lo, q_hi, d_lo, d_hi, extra_neg, u_q, u_d, table, exact, inv_temp: float,
                 row_weight: float, col_weight: float, diag_offset: int, want_grad: bool,
                 requested_rows: int = 0, row_none: Optional[torch.Tensor] = None,
                 want_hardest: bool = False) -> List[Optional[torch.Tensor]]:
    """Loss and (for d loss = 1, when want_grad) the gradients [dq, dd, dneg, du_q, du_d, dtable, dexact...],
    then (when want_hardest, else None) the hardest in-batch negative per row (Bq,) int64: the column with
    the largest x = inv_temp * s + bias among those that are not positives of the row, the lowest among exact
    ties, -1 when none (by-product of the forward pass: per (row, column tile) partials, merged here).

    q (Bq, H), d (Bd, H), spans as int64 (lo, hi) bounds; bias: the table mode (u_q, u_d, table in the
    accumulation dtype) or the exact MLP (``exact`` = (w1, b1, w2, b2, scale), evaluated per block by
    tempokern's offset_bias kernels), or neither."""
    acc = acc_dtype(q.dtype)
    be = backend.resolve(q)
    cuda_path = be.cuda_path
    host = be.kind != "cuda"  # CPU tensors: the CPU kernels, or the CUDA emulator
    Bq, H = q.shape
    Bd = d.shape[0]
    N = 0 if extra_neg is None else extra_neg.shape[0]
    if not cuda_path:  # CPU: products in the accumulation dtype
        q, d = q.to(acc), d.to(acc)
        extra_neg = None if extra_neg is None else extra_neg.to(acc)
    elif host:  # the CUDA emulator: torch's CPU products, float32 scores
        q32, d32 = q.to(acc), d.to(acc)
    bias_mode = 1 if table is not None else (2 if exact is not None else 0)
    cols = col_weight != 0.0
    if Bq == 0 or Bd == 0:
        return _empty_pairs(q, d, extra_neg, acc, inv_temp, row_weight, col_weight, want_grad, want_hardest, exact,
                            table)

    def scores(a_rows, b):  # (R, H) x (C, H) -> (R, C)
        if cuda_path and host:  # the emulator: a float32 product, as cuBLAS's output
            return torch.mm(a_rows.to(acc), b.to(acc).t())
        return mm_acc(a_rows, b.t())

    def prod(a, b):  # gradient products, float32 output for half operands where torch can
        if host:
            return torch.mm(a.to(acc), b.to(acc))
        return mm_acc(a, b)

    def prod_into(c, a, b):  # c += a @ b
        if host:
            c.addmm_(a.to(acc), b.to(acc))
        else:
            addmm_into(c, a, b)

    sdtype = acc if (host or q.dtype == acc or mm_out_f32(q.device)) else q.dtype
    odtype = q.dtype if cuda_path else acc
    per_elem = ITEMSIZE[sdtype] + ITEMSIZE[odtype] + (2 * ITEMSIZE[acc] if bias_mode == 2 else 0)
    R = block_rows(Bq, Bd, N, per_elem, q.device, requested_rows)
    blocks = [(i0, min(R, Bq - i0)) for i0 in range(0, Bq, R)]
    # one workspace; the prep kernel writes the int32 spans and the fallback flags
    asz = ITEMSIZE[acc]
    tls = {r: (tiling(r, Bd, be), tiling(r, N, be) if N else (1, 0, 1)) for _, r in blocks}
    ws = _Workspace()
    ws.add("spans", 4 * 2 * (Bq + Bd))
    ws.add("flags", Bq + Bd)
    ws.add("counter", 4)
    ws.add("row_lse", 2 * Bq * asz)
    ws.add("col_lse", 2 * Bd * asz)
    ws.add("row_part", max(r * (tS[1] + tE[1]) * 2 for r, (tS, tE) in tls.items()) * asz)
    if cols:
        ws.add("col_part", max(tS[2] for tS, _ in tls.values()) * Bd * 2 * asz)
    if want_hardest:
        ws.add("hard_val", max(r * tS[1] for r, (tS, _) in tls.items()) * asz)
        ws.add("hard_idx", max(r * tS[1] for r, (tS, _) in tls.items()) * 8)
    nzero = 0
    if bias_mode == 1 and want_grad:  # the table gradient's histogram (zeroed by prep) and partials
        nh_t = max(1, max(tS[1] * tS[2] for tS, _ in tls.values()))
        nzero = nh_t * table.numel()
        ws.add("hist", nzero * 8)
        ws.add("dud_acc", Bd * 8)
        ws.add("duq_part", max(r * tS[1] for r, (tS, _) in tls.items()) * asz)
        ws.add("dud_part", max(tS[2] for tS, _ in tls.values()) * Bd * asz)
    ws.alloc(q.device)
    dev, stream = be.launch
    kern = be.kernels
    b64 = [t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
           for t in (q_lo, q_hi, d_lo, d_hi)]
    kern.multipos_block_prep(dev, stream, [Bq, Bd, diag_offset, nzero],
                                  dict(q_lo=ptr(b64[0]), q_hi=ptr(b64[1]), d_lo=ptr(b64[2]), d_hi=ptr(b64[3]),
                                       spans32=ws["spans"], row_none=ws["flags"], col_none=ws["flags"] + Bq,
                                       counter=ws["counter"], zero=ws["hist"] if nzero else 0))
    sp0 = ws["spans"]
    spans = (sp0, sp0 + 4 * Bq, sp0 + 8 * Bq, sp0 + 8 * Bq + 4 * Bd)
    flags = (ws["flags"], ws["flags"] + Bq)
    if row_none is not None:  # the caller knows more documents than this call's (CTDLoss's gathered column pass)
        flags = (row_none, flags[1])
    L = _Launcher(be, q, acc, odtype, inv_temp, diag_offset, spans, flags, u_q, u_d, table)
    w1 = b1 = w2 = b2 = scale = None
    if exact is not None:
        w1, b1, w2, b2, scale = exact

    def dense_block(i0, r):
        return torch.ops.tempokern.offset_bias(u_q[i0:i0 + r], u_d, w1, b1, w2, b2, scale).to(acc).contiguous()

    keep = None
    hardest = torch.empty(Bq, dtype=torch.int64, device=q.device) if want_hardest else None
    single = len(blocks) == 1
    loss = torch.empty((), dtype=acc, device=q.device)
    row_lse, col_lse = ws["row_lse"], ws["col_lse"]
    for b, (i0, r) in enumerate(blocks):
        qb = q[i0:i0 + r]
        S = scores(qb, d)
        tS, tE = tls[r]
        nslots = tS[1] + tE[1]
        dense = dense_block(i0, r) if bias_mode == 2 else None
        hv = hi = None
        if want_hardest:
            hv, hi = ws["hard_val"], ws["hard_idx"]
        L.launch("fwd", S, i0, pos=True, cols=cols, bias_mode=bias_mode, dense=dense, tiling_=tS,
                 nslots=nslots, slot0=0, row_part=ws["row_part"], col_part=ws["col_part"] if cols else None,
                 hard_val=hv, hard_idx=hi)
        E = None
        if N:
            E = scores(qb, extra_neg)
            L.launch("fwd", E, i0, pos=False, cols=False, bias_mode=0, tiling_=tE, nslots=nslots,
                     slot0=tS[1], row_part=ws["row_part"])
        kern.multipos_block_fin(
            L.dev, L.stream, L.ad, [Bq, Bd, i0, r, nslots, tS[2], tS[1], int(cols), int(b == 0),
                                    int(b == len(blocks) - 1)], [float(row_weight), float(col_weight)],
            dict(row_part=ws["row_part"], col_part=ws["col_part"] if cols else 0, row_lse=row_lse,
                 col_lse=col_lse, hard_val=hv or 0, hard_idx=hi or 0,
                 hardest=0 if hardest is None else ptr(hardest), loss=ptr(loss), counter=ws["counter"]))
        if single:
            keep = (S, E, dense)
        del S, E, dense
    if not want_grad:
        return [loss] + [None] * 11 + [hardest]

    gr = row_weight / Bq if Bq else 0.0
    gc = col_weight / Bd if Bd else 0.0
    # gradient accumulators: float32 (float64 for float64) unless half operands must give half products
    gdt = acc if (host or q.dtype == acc or mm_out_f32(q.device)) else q.dtype
    dq = torch.empty(Bq, H, dtype=gdt, device=q.device) if not single else None
    dd = torch.zeros(Bd, H, dtype=gdt, device=q.device) if not single else None
    dneg = torch.zeros(N, H, dtype=gdt, device=q.device) if N and not single else None
    du_q = du_d = dtable = None
    tgrad = bias_mode == 1  # the table gradient's sums in one kernel per block (multipos_block_tgrad)
    if tgrad:
        du_q = torch.empty(Bq, dtype=acc, device=q.device)
        du_d = torch.empty(Bd, dtype=acc, device=q.device)
        dtable = torch.empty(table.numel(), dtype=acc, device=q.device)
        nh = nh_t
    ex = None
    if bias_mode == 2:
        ex = [torch.zeros(Bq, dtype=torch.float64, device=q.device), torch.zeros(Bd, dtype=torch.float64, device=q.device)]
        ex += [torch.zeros(t.shape, dtype=torch.float64, device=q.device) for t in exact]
    qops = q if not (cuda_path and host) else q32
    dops = d if not (cuda_path and host) else d32
    for b, (i0, r) in enumerate(blocks):
        qb = q[i0:i0 + r]
        if keep is not None:
            S, E, dense = keep
        else:
            S = scores(qb, d)
            E = scores(qb, extra_neg) if N else None
            dense = dense_block(i0, r) if bias_mode == 2 else None
        tS = tiling(r, Bd, be)
        dS = torch.empty(r, Bd, dtype=odtype, device=q.device)
        G = torch.empty(r, Bd, dtype=acc, device=q.device) if bias_mode == 2 else None
        outs = dict(row_lse=row_lse, col_lse=col_lse if cols else None, G=G)
        if tgrad:
            outs.update(duq_part=ws["duq_part"], dud_part=ws["dud_part"], hist=ws["hist"])
        L.launch("bwd", S, i0, pos=True, cols=cols, bias_mode=bias_mode, dense=dense, tiling_=tS, gr=gr, gc=gc,
                 dS=dS, nhist=nh if bias_mode == 1 else 0, **outs)
        if tgrad:
            kern.multipos_block_tgrad(
                L.dev, L.stream, L.ad, [Bq, Bd, i0, r, tS[1], tS[2], table.numel(), nh, int(b == 0),
                                        int(b == len(blocks) - 1)],
                dict(duq_part=ws["duq_part"], dud_part=ws["dud_part"], hist=ws["hist"], dud_acc=ws["dud_acc"],
                     du_q=ptr(du_q), du_d=ptr(du_d), dtable=ptr(dtable)))
        del S, dense
        qbo = qops[i0:i0 + r]
        if single:  # one block: the products are the gradients, no accumulation
            dq, dd = prod(dS, dops), prod(dS.t(), qbo)
        else:
            dq[i0:i0 + r] = prod(dS, dops)
            prod_into(dd, dS.t(), qbo)
        if bias_mode == 2:
            g7 = torch.ops.tempokern.offset_bias_backward(G, u_q[i0:i0 + r], u_d, w1, b1, w2, b2, scale)
            ex[0][i0:i0 + r] += g7[0].double()
            for k in range(1, 7):
                ex[k] += g7[k].double().reshape(ex[k].shape)
        del dS, G
        if N:
            tE = tiling(r, N, be)
            dE = torch.empty(r, N, dtype=odtype, device=q.device)
            L.launch("bwd", E, i0, pos=False, cols=False, bias_mode=0, tiling_=tE, gr=gr, gc=0.0, dS=dE,
                     row_lse=row_lse)
            negops = extra_neg if not (cuda_path and host) else extra_neg.to(acc)
            prod_into(dq[i0:i0 + r], dE, negops)
            if single:
                dneg = prod(dE.t(), qbo)
            else:
                prod_into(dneg, dE.t(), qbo)
            del dE
        del E
        keep = None
    dexact = [None] * 5
    if ex is not None:
        du_q, du_d, dexact = ex[0], ex[1], ex[2:]
    return [loss, dq.to(acc), dd.to(acc), None if dneg is None else dneg.to(acc), du_q, du_d, dtable, *dexact,
            hardest]


def _empty_pairs(q, d, extra_neg, acc, inv_temp, row_weight, col_weight, want_grad, want_hardest, exact, table):
    """blocked_loss's result when there is no row or no column: every in-batch log-sum-exp is over an empty set
    (-inf), so a row's loss is -inf - -inf = NaN (or +inf when extra negatives give it a denominator) and the
    mean over no rows is NaN, as the reference computes it; the gradients are zero (no pair)."""
    Bq, H = q.shape
    Bd = d.shape[0]
    N = 0 if extra_neg is None else extra_neg.shape[0]
    ninf = torch.full((Bq,), -math.inf, dtype=acc, device=q.device)
    row_all = ninf
    if N and Bq:
        row_all = torch.logsumexp(torch.mm(q.to(acc), extra_neg.to(acc).t()) * inv_temp, dim=1)
    tot = None
    if row_weight != 0.0:
        tot = (row_all - ninf).double().mean() * row_weight
    if col_weight != 0.0:
        tc = torch.full((Bd,), math.nan, dtype=torch.float64, device=q.device).mean() * col_weight
        tot = tc if tot is None else tot + tc
    loss = torch.zeros((), dtype=acc, device=q.device) if tot is None else tot.to(acc)
    hardest = torch.full((Bq,), -1, dtype=torch.int64, device=q.device) if want_hardest else None
    if not want_grad:
        return [loss] + [None] * 11 + [hardest]
    z = lambda *shape, dt=acc: torch.zeros(*shape, dtype=dt, device=q.device)  # noqa: E731
    out = [loss, z(Bq, H), z(Bd, H), z(N, H) if N else None]
    if table is not None:
        out += [z(Bq), z(Bd), z(table.numel())]
    else:
        out += [None, None, None]
    if exact is not None:
        out[4:6] = [z(Bq, dt=torch.float64), z(Bd, dt=torch.float64)]
        out += [torch.zeros(t.shape, dtype=torch.float64, device=q.device) for t in exact]
    else:
        out += [None] * 5
    return out + [hardest]


def merge_hardest(val: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(R,) int64 from per (row, column tile) partials (R, nct): the largest value's column, the lowest column
    among tiles with an equal maximum, -1 where no tile has a negative. O(R * nct)."""
    if val.shape[1] == 1:
        return idx[:, 0]
    best = val.max(dim=1, keepdim=True).values
    big = torch.iinfo(torch.int64).max
    out = torch.where((val == best) & (idx >= 0), idx, big).min(dim=1).values
    return torch.where(out == big, -1, out)
