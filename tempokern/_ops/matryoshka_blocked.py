"""Blocked Matryoshka InfoNCE: the CUDA execution of tempokern.matryoshka_infonce and the CPU execution with a
bias. Two executions: the torch path below (CPU bias=, and CPU tensors on a backend with block rows installed by the tests) and the fused path at the end of
this file (CUDA and the emulator: cuBLAS segment products around the kernels of
csrc/matryoshka_infonce/matryoshka_block_cuda.cu, or the candidate tensor-core kernels of matryoshka_tc_cuda.cu
where TEMPOKERN_EXPERIMENTAL enables them, tempokern/_ops/dispatch.py).

The torch path: Rows are processed in blocks of R anchors against all candidates; per block the K
segment products are accumulated into one float32 block with ``addmm`` (cuBLAS on CUDA), snapshot after
each segment (the K level logit blocks), and reduced with torch: exact row log-sum-exps (a block holds
whole rows), column log-sum-exps merged across blocks with ``logaddexp``. Backward recomputes the block,
turns each level into its coefficient block, suffix-sums them from the top level down while running one
``addmm`` per segment for dq and dd.

Products: 2 B C H flops forward + 6 B C H backward, the same as one level. Memory: the block, about
(K + 4) x R x (C + N) float32 values (R chosen so that this fits min(1 GiB, free / 4) on CUDA,
TEMPOKERN_BLOCK_BYTES overrides), plus O((B + C + N) (H + K)); never B x C unless one block holds it.
The statistics and coefficient steps are ~10 torch element-wise ops per level and block (the fused path
replaces them).

Bias (offset_bias's per-pair bias, the same for every level): per row block the (R, C) bias block is
computed once (the exact MLP by tempokern's offset_bias kernel on the block's u_q against all u_d, or the
table interpolation) and added to each level's logit block; backward sums the per-pair coefficient blocks
over the levels (sum_l g_l, one (R, C) buffer) and feeds it to offset_bias_backward (or the table's
backward) once per block. Two more (R, C) blocks of memory; the MLP cost is that of one offset_bias
forward and backward over the B x C pairs, not K of them."""
from __future__ import annotations

from typing import List, Sequence

import torch

from .._util import trace_constant
from . import backend
from .common import DTYPE_CODES, device_constant, ptr
from .common import kernels, launch_args  # noqa: F401  (tests and tools/gpu_sanitize_case.py use them)
from .multipos_blocked import (ITEMSIZE, addmm_into, block_rows, mm_acc, mm_out_f32, none_flags, prep_spans, spans32,
                              tiling)


def _none_flags(q_lo, q_hi, d_lo, d_hi):
    """(row_none (Bq,), col_none (Bd,)) bool: rows (columns) overlapping no column (row)."""
    Bq, Bd = q_lo.shape[0], d_lo.shape[0]
    dlo, dhi = torch.sort(d_lo).values, torch.sort(d_hi).values
    qlo, qhi = torch.sort(q_lo).values, torch.sort(q_hi).values
    row = Bd - (Bd - torch.searchsorted(dlo, q_hi, right=True)) - torch.searchsorted(dhi, q_lo)
    col = Bq - (Bq - torch.searchsorted(qlo, d_hi, right=True)) - torch.searchsorted(qhi, d_lo)
    return row == 0, col == 0


class _Ctx:
    def __init__(self, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp, row_weight,
                 col_weight, diag_offset, block, bias=None, flags=None):
        self.acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.q, self.d, self.neg = q.to(self.acc), d.to(self.acc), None if extra_neg is None else extra_neg.to(self.acc)
        self.rho, self.kap = rho.to(self.acc), kap.to(self.acc)
        self.kneg = None if kneg is None else kneg.to(self.acc)
        self.seg, self.K = list(seg), len(seg) - 1
        self.it, self.rw, self.cw, self.off = inv_temp, row_weight, col_weight, diag_offset
        self.Bq, self.Bd = q.shape[0], d.shape[0]
        self.N = 0 if extra_neg is None else extra_neg.shape[0]
        self.q_lo, self.q_hi, self.d_lo, self.d_hi = q_lo, q_hi, d_lo, d_hi
        # flags: the (row_none, col_none) bool flags when the caller has them (the prep kernel), else sorts
        rn, self.col_none = _none_flags(q_lo, q_hi, d_lo, d_hi) if flags is None else flags
        self.row_none_local = rn
        self.row_fb_col = rn if row_none is None else row_none.bool()  # decides the column fallback
        # bias: None, or (u_q, u_d, table, w1, b1, w2, b2, scale) with table None (exact MLP) or w1..scale None
        self.bias = bias
        per_elem = 4 * (self.K + 4 + (2 if bias is not None else 0))
        self.R = block_rows(self.Bq, self.Bd, self.N, per_elem, q.device, block)
        self.cols_j = torch.arange(self.Bd, device=q.device)

    def blocks(self):
        for i0 in range(0, self.Bq, self.R):
            yield i0, min(self.Bq, i0 + self.R)

    def snapshots(self, i0, i1, X, scale_cols):
        """The K level logit blocks z_l (R x n) of rows i0..i1 against X, accumulated segment by segment."""
        G = torch.zeros(i1 - i0, X.shape[0], dtype=self.acc, device=X.device)
        out = []
        for l in range(self.K):
            a, b = self.seg[l], self.seg[l + 1]
            G.addmm_(self.q[i0:i1, a:b], X[:, a:b].t())
            out.append(G * (self.it * self.rho[l, i0:i1])[:, None] * scale_cols[l][None, :])
        return out

    def bias_block(self, i0, i1):
        """The (R, Bd) bias block of rows i0..i1 in the accumulation dtype, or None without a bias."""
        if self.bias is None:
            return None
        u_q, u_d, table, *exact = self.bias
        if table is not None:
            b = torch.ops.tempokern.offset_bias_interp(u_q[i0:i1], u_d, table)
        else:
            b = torch.ops.tempokern.offset_bias(u_q[i0:i1], u_d, *exact)
        return b.to(self.acc)

    def bias_backward(self, i0, i1, Gb, acc_grads):
        """Adds the bias inputs' gradients for the block's per-pair gradient Gb (R, Bd) into acc_grads
        (float64: u_q (Bq,), u_d (Bd,), table, w1, b1, w2, b2, scale; None where absent)."""
        u_q, u_d, table, *exact = self.bias
        if table is not None:
            g_uq, g_ud, g_t = torch.ops.tempokern.offset_bias_interp_backward(Gb, u_q[i0:i1], u_d, table)
            rest = [g_t] + [None] * 5
        else:
            g_uq, g_ud, *g_ex = torch.ops.tempokern.offset_bias_backward(Gb, u_q[i0:i1], u_d, *exact)
            rest = [None] + list(g_ex)
        acc_grads[0][i0:i1] += g_uq.double()
        acc_grads[1] += g_ud.double()
        for k, g in enumerate(rest):
            if g is not None:
                acc_grads[2 + k] += g.double().reshape(acc_grads[2 + k].shape)

    def masks(self, i0, i1):
        """(overlap, row positives, column positives) of the block, bool (R x Bd)."""
        ov = torch.maximum(self.q_lo[i0:i1, None], self.d_lo[None, :]) <= torch.minimum(self.q_hi[i0:i1, None],
                                                                                      self.d_hi[None, :])
        dg = self.cols_j[None, :] == (torch.arange(i0, i1, device=ov.device) + self.off)[:, None]
        pos_r = ov | (dg & self.row_none_local[i0:i1, None])
        pos_c = ov | (dg & (self.row_fb_col[i0:i1, None] | self.col_none[None, :]))
        return pos_r, pos_c


def _masked_lse(z, mask, dim):
    return torch.logsumexp(z.masked_fill(~mask, float("-inf")), dim=dim)


def _finish_levels(c, row_stats, col_stats, c_all, c_pos, cols: bool, coef, row_weight: float, col_weight: float):
    """Both forward executions' last step: the fallback flags and column statistics into their outputs, then
    the per-level losses (mean over rows / columns of lse_all - lse_pos, weighted by direction) and the loss
    (levels weighted by coef; a zero-weight level contributes exactly 0)."""
    K, acc, dev = row_stats.shape[0], row_stats.dtype, row_stats.device
    row_stats[:, 2] = c.row_none_local.to(acc)[None, :]
    if cols:
        col_stats[:, 0], col_stats[:, 1] = c_all, c_pos
    levels = torch.zeros(K, dtype=acc, device=dev)
    if row_weight != 0.0 and c.Bq:
        levels = levels + row_weight * (row_stats[:, 0] - row_stats[:, 1]).mean(dim=1)
    if cols and c.Bd:
        levels = levels + col_weight * (col_stats[:, 0] - col_stats[:, 1]).mean(dim=1)
    w = device_constant([float(x) for x in coef], acc, row_stats)
    return (torch.where(w != 0, levels, torch.zeros_like(levels)) * w).sum(), levels


def blocked_forward(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg: Sequence[int],
                    coef: Sequence[float], inv_temp: float, row_weight: float, col_weight: float, diag_offset: int,
                    block: int = 0, bias=None, want_grad: bool = False, known_half=None,
                    tensor_cores: bool = False, be=None) -> List[torch.Tensor]:
    """[loss, levels, row_stats, col_stats]; want_grad (the fused path without a column term only, see
    fused_forward): then also the gradients for a unit upstream gradient of the loss. known_half: the half
    dtype whose values the float32 q, d (and extra_neg) hold, when the caller knows it (see _Fused). be: the
    call's backend (None: q's)."""
    be = backend.resolve(q) if be is None else be
    if use_fused(be, d.shape[0]):
        return fused_forward(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, coef, inv_temp,
                             row_weight, col_weight, diag_offset, block, bias, want_grad, known_half, tensor_cores,
                             be)
    c = _Ctx(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp, row_weight,
             col_weight, diag_offset, block, bias)
    K, dev, acc = c.K, q.device, c.acc
    row_stats = torch.zeros(K, 3, c.Bq, dtype=acc, device=dev)
    col_stats = torch.zeros(K, 3, c.Bd, dtype=acc, device=dev)
    cols = col_weight != 0.0
    ninf = torch.full((K, c.Bd), float("-inf"), dtype=acc, device=dev)
    c_all, c_pos = ninf.clone(), ninf.clone()
    for i0, i1 in c.blocks():
        zs = c.snapshots(i0, i1, c.d, c.kap)
        zn = c.snapshots(i0, i1, c.neg, c.kneg) if c.N else None
        pos_r, pos_c = c.masks(i0, i1)
        bb = c.bias_block(i0, i1)
        for l in range(K):
            z = zs[l] if bb is None else zs[l] + bb
            za = z if zn is None else torch.cat([z, zn[l]], dim=1)
            row_stats[l, 0, i0:i1] = torch.logsumexp(za, dim=1)
            row_stats[l, 1, i0:i1] = _masked_lse(z, pos_r, 1)
            if cols:
                c_all[l] = torch.logaddexp(c_all[l], torch.logsumexp(z, dim=0))
                c_pos[l] = torch.logaddexp(c_pos[l], _masked_lse(z, pos_c, 0))
    loss, levels = _finish_levels(c, row_stats, col_stats, c_all, c_pos, cols, coef, row_weight, col_weight)
    return [loss, levels, row_stats, col_stats]


def blocked_backward(lcoef, row_stats, col_stats, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none,
                     seg: Sequence[int], inv_temp: float, row_weight: float, col_weight: float, diag_offset: int,
                     block: int = 0, bias=None, known_half=None, tensor_cores: bool = False,
                     be=None) -> List[torch.Tensor]:
    """[dq, dd, dneg, drho, dkap, dkneg] (empty where absent), then with a bias the float64 gradients of its
    eight inputs [du_q, du_d, dtable, dw1, db1, dw2, db2, dscale] (empty where absent)."""
    be = backend.resolve(q) if be is None else be
    if use_fused(be, d.shape[0]):
        return fused_backward(lcoef, row_stats, col_stats, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi,
                              row_none, seg, inv_temp, row_weight, col_weight, diag_offset, block, bias, known_half,
                              tensor_cores, be)
    c = _Ctx(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp, row_weight,
             col_weight, diag_offset, block, bias)
    K, acc = c.K, c.acc
    bgrads = None
    if bias is not None:
        bgrads = [None if t is None else torch.zeros(t.shape, dtype=torch.float64, device=q.device) for t in bias]
    coef = [float(x) for x in lcoef.detach().to("cpu", torch.float64).tolist()]
    cols = col_weight != 0.0
    rw = [x * row_weight / c.Bq if c.Bq else 0.0 for x in coef]
    cw = [x * col_weight / c.Bd if (cols and c.Bd) else 0.0 for x in coef]
    dq, dd = torch.zeros_like(c.q), torch.zeros_like(c.d)
    dneg = None if c.neg is None else torch.zeros_like(c.neg)
    drho, dkap = torch.zeros_like(c.rho), torch.zeros_like(c.kap)
    dkneg = None if c.kneg is None else torch.zeros_like(c.kneg)
    active = [rw[l] != 0.0 or cw[l] != 0.0 for l in range(K)]
    if any(active):
        for i0, i1 in c.blocks():
            zs = c.snapshots(i0, i1, c.d, c.kap)
            zn = c.snapshots(i0, i1, c.neg, c.kneg) if (c.N and row_weight != 0.0) else None
            pos_r, pos_c = c.masks(i0, i1)
            bb = c.bias_block(i0, i1)
            Gb = None  # sum over the levels of dL/dz_l: the per-pair bias gradient
            Hacc = Hn = None
            for l in range(K - 1, -1, -1):
                a, b = c.seg[l], c.seg[l + 1]
                if active[l]:
                    z = zs[l] if bb is None else zs[l] + bb
                    g = torch.zeros_like(z)
                    if row_weight != 0.0:
                        lse, lsep = row_stats[l, 0, i0:i1, None], row_stats[l, 1, i0:i1, None]
                        g = rw[l] * (torch.exp(z - lse) - torch.where(pos_r, torch.exp(z - lsep), 0.0))
                    if cols:
                        g = g + cw[l] * (torch.exp(z - col_stats[l, 0][None, :])
                                         - torch.where(pos_c, torch.exp(z - col_stats[l, 1][None, :]), 0.0))
                    if bb is not None:
                        Gb = g if Gb is None else Gb + g
                    u = g * zs[l]  # the product part of the logit: d z / d rho = zs / rho
                    drho[l, i0:i1] += u.sum(dim=1) / c.rho[l, i0:i1]
                    dkap[l] += u.sum(dim=0) / c.kap[l]
                    h = g * (c.it * c.rho[l, i0:i1])[:, None] * c.kap[l][None, :]
                    Hacc = h if Hacc is None else Hacc + h
                    if zn is not None:
                        gn = rw[l] * torch.exp(zn[l] - row_stats[l, 0, i0:i1, None])
                        un = gn * zn[l]
                        drho[l, i0:i1] += un.sum(dim=1) / c.rho[l, i0:i1]
                        dkneg[l] += un.sum(dim=0) / c.kneg[l]
                        hn = gn * (c.it * c.rho[l, i0:i1])[:, None] * c.kneg[l][None, :]
                        Hn = hn if Hn is None else Hn + hn
                if Hacc is not None:
                    dq[i0:i1, a:b] += Hacc @ c.d[:, a:b]
                    dd[:, a:b].addmm_(Hacc.t(), c.q[i0:i1, a:b])
                if Hn is not None:
                    dq[i0:i1, a:b] += Hn @ c.neg[:, a:b]
                    dneg[:, a:b].addmm_(Hn.t(), c.q[i0:i1, a:b])
            if Gb is not None:
                c.bias_backward(i0, i1, Gb, bgrads)
    e = lambda: q.new_empty(0, dtype=acc)  # noqa: E731
    out = [dq, dd, e() if dneg is None else dneg, drho, dkap, e() if dkneg is None else dkneg]
    if bgrads is not None:
        out += [q.new_empty(0, dtype=torch.float64) if g is None else g for g in bgrads]
    return out


# ---- the fused CUDA path (csrc/matryoshka_infonce/matryoshka_block_cuda.cu) ------------------------------
#
# Per block of R rows and per level l (ascending): G += q_blk[:, S_l] X[:, S_l]^T (one cuBLAS addmm into ONE
# float32 block, X = d, then the extra negatives), then one fused launch over G for level l (scales rho_l,
# kap_l, the bias block, positives, online row / column log-sum-exp partials). Backward, per block: the
# level snapshots G_l through a chain of addmm's (K blocks), then from the top active level down one fused
# launch per level: H (+)= inv_temp rho_l kap_l g_l in place (the suffix sum over levels), Gb (+)= g_l with a
# bias, dL/drho_l and dL/dkap_l partials; and torch: dq[:, S_l] = H X[:, S_l], dX[:, S_l] += H^T q_blk[:, S_l].
# Memory: forward R (C + N) accumulation values (+ the bias block), backward (K + 1) R (C + N) (+ 2 R C with a
# bias), plus O(K R C / 1024 + K C R / TR) partials; never B x C unless one block holds it.

def tc_tile(K: int, table: bool, hist_points: int, optin: int):
    """(rows, columns) of the tensor-core tile for a call of K levels (table: with the table bias, whose
    histogram of hist_points floats stays in shared memory where it fits) on a device with `optin` bytes of
    shared memory per block: for calls of <= 2 levels (the CTD loss: K = 1) the largest of 128x128, 128x64,
    64x64 whose backward leaves room for two blocks per SM (half the opt-in shared memory), else 64x64. Per pair
    and pass the tiles move 48 / 36 / 24 bytes of L2 operands and do 16 / 21 / 32 mma flops per shared-memory
    operand byte (docs/multipos_infonce.md, "Tensor-core kernels"); the backward keeps K float32 score tiles
    (17 / 34 / 68 KB each)."""
    if K > 2:
        return 64, 64
    k = backend.kernels_for(False)  # (the emulated build inside the tests' emulator, else _C)
    for tr, tcl in ((128, 128), (128, 64), (64, 64)):
        if k.mrl_tc_smem_bytes(K, True, table, hist_points, tr, tcl) <= optin // 2:
            return tr, tcl
    return 64, 64


def use_fused(t, Bd: int) -> bool:
    """Whether a call on backend t (or a tensor / device it is resolved from) with Bd candidates runs the fused
    kernels (the per-level fused kernels or the tensor-core candidate): the CUDA kernels' backends and a
    candidate."""
    return backend.of(t).cuda_path and Bd > 0


_TC_LEVELS: dict = {}


def tc_max_levels(t: torch.Tensor) -> int:
    """The most levels whose tensor-core backward fits the device's shared memory (8 on an H100 or A100 for the
    forward and backward together, 4 on sm_86 / sm_89's 99 KB)."""
    be = backend.of(t)
    return _tc_levels(be.kind == "cuda", be.index)


@trace_constant
def _tc_levels(cuda: bool, dev: int) -> int:
    """A device query torch.compile records as a constant (it cannot trace the extension's function)."""
    if not cuda:  # the emulator: its opt-in limit can change between tests
        return backend.kernels_for(False).mrl_tc_max_levels(dev)
    if dev not in _TC_LEVELS:
        _TC_LEVELS[dev] = backend.kernels_for(True).mrl_tc_max_levels(dev)
    return _TC_LEVELS[dev]


_TC_SUPPORTED: dict = {}


def tc_supported(t) -> bool:
    """Whether t's device runs the bfloat16 tensor-core kernels: compute capability 8.0 or newer (bf16 wmma; the
    kernels compile to a trap for sm_75 and refuse older devices at launch). The CUDA emulator answers for its
    configured arch (TEMPOKERN_EMU_ARCH, default 90). Calls on older GPUs (a T4's 7.5) take the other paths."""
    be = backend.of(t)
    return _tc_supported(be.kind == "cuda", be.index)


@trace_constant
def _tc_supported(cuda: bool, dev: int) -> bool:
    """A device query torch.compile records as a constant (it cannot trace the extension's function)."""
    if not cuda:  # the emulator: its arch can change between tests
        return bool(backend.kernels_for(False).mrl_tc_supported(dev))
    if dev not in _TC_SUPPORTED:
        _TC_SUPPORTED[dev] = bool(backend.kernels_for(True).mrl_tc_supported(dev))
    return _TC_SUPPORTED[dev]


def tc_eligible(half, H: int, seg: Sequence[int], N: int, bias_mode, t) -> bool:
    """Whether the tensor-core kernels can take a call (the caller decides whether they may): bfloat16 operands (half), no extra negatives,
    no bias or the table bias (bias_mode None / "table"; "exact" never), rows of a multiple of 8 features
    (16-byte loads), level boundaries increasing multiples of 16, and the backward's shared memory within the
    device's (tc_max_levels(t) levels without a bias)."""
    K = len(seg) - 1
    if not (half == torch.bfloat16 and N == 0 and bias_mode in (None, "table")
            and H % 8 == 0 and 1 <= K and all(b > a and b % 16 == 0 for a, b in zip(seg, seg[1:]))):
        return False
    be = backend.of(t)
    if not tc_supported(be):
        return False
    if bias_mode is None:
        return K <= tc_max_levels(be)
    return _tc_table_fits(be.kind == "cuda", be.index, K)


@trace_constant
def _tc_table_fits(cuda: bool, dev: int, K: int) -> bool:
    """Whether K levels with a table bias (its histogram in global memory at least) fit the device."""
    k = backend.kernels_for(cuda)
    return k.mrl_tc_smem_bytes(K, True, True, 0) <= k.mrl_tc_smem_optin(dev)


def tc_call(q, d, dims, extra_neg, bias, table_points=None, be=None) -> bool:
    """tc_eligible for a matryoshka_infonce / multipos_infonce call on backend ``be`` (None: q's) (before its op:
    bfloat16 q and d; a bias only in the table mode, table_points)."""
    be = backend.resolve(q) if be is None else be
    if not (be.cuda_path and q.dtype == torch.bfloat16 and d.dtype == torch.bfloat16 and d.shape[0] > 0):
        return False
    seg = [0] + sorted({int(m) for m in dims})
    mode = None if bias is None else ("table" if table_points is not None else "exact")
    return tc_eligible(torch.bfloat16, q.shape[-1], seg, 0 if extra_neg is None else 1, mode, be)


#: table points up to which the backward keeps dL/dtable in a shared-memory histogram per CUDA block (64 KB)
TC_HIST_SMEM_POINTS = 16385


def _exact_half(ts) -> "torch.dtype | None":
    """bfloat16 when every value of the float32 tensors ts (None entries ignored) is exactly a bfloat16 value,
    else None. One pass over the embeddings (O((B + C + N) H)), one device synchronisation. float16 is left
    out: the rounded coefficients H (~ weight / B per pair, times inv_temp rho kap) would fall into float16's
    subnormals at large B; bfloat16 has float32's range."""
    ts = [t for t in ts if t is not None]
    if ts and all(bool(torch.equal(t.to(torch.bfloat16).to(t.dtype), t)) for t in ts):
        return torch.bfloat16
    return None


class _Fused:
    """Shared set-up of the fused forward and backward."""

    def __init__(self, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp,
                 row_weight, col_weight, diag_offset, block, bias, backward, known_half=None, tensor_cores=False,
                 be=None):
        be = backend.resolve(q) if be is None else be
        # int32 spans and fallback flags: multipos's prep kernel (one launch; torch's sorts took 0.37 ms at
        # B = 8,192 on the H100), or torch where there is no row or no column
        if q.shape[0] and d.shape[0]:
            self.spans, self.row_none, self.col_none = prep_spans(q_lo, q_hi, d_lo, d_hi, diag_offset, q, be)
            flags = (self.row_none.bool(), self.col_none.bool())
        else:
            self.spans = spans32(q_lo, q_hi, d_lo, d_hi)
            self.row_none, self.col_none = none_flags(*self.spans)
            flags = None
        self.c = _Ctx(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp, row_weight,
                      col_weight, diag_offset, 1, bias, flags)  # for its tensors and bias helpers (R unused)
        c = self.c
        c.q, c.d = c.q.contiguous(), c.d.contiguous()
        c.neg = None if c.neg is None else c.neg.contiguous()
        c.rho, c.kap = c.rho.contiguous(), c.kap.contiguous()
        c.kneg = None if c.kneg is None else c.kneg.contiguous()
        self.row_fb = None if row_none is None else row_none.to(torch.uint8).contiguous()
        self.be = be
        self.dev, self.stream = be.launch
        self.kernels = be.kernels
        self.ad = DTYPE_CODES[c.acc]
        # half operands: float32 inputs whose values are all exactly bfloat16 values (as when the caller passed
        # bfloat16 tensors, which the wrapper upcasts) run their products on the bf16 tensor cores with float32
        # output: the same exact products, float32 sums. The gradient coefficients H are then rounded once to
        # bfloat16 (Ho), as multipos_blocked writes dS in the operand dtype.
        # known_half (the op's inputs were bf16 tensors) saves the check's pass and device synchronisation.
        self.half = None
        if c.acc == torch.float32 and (be.kind != "cuda" or mm_out_f32(q.device)):
            self.half = known_half if known_half is not None else _exact_half([c.q, c.d, c.neg])
        cast = (lambda t: None if t is None else t.to(self.half)) if self.half is not None else (lambda t: t)
        self.qo, self.do, self.no = cast(c.q), cast(c.d), cast(c.neg)
        # block bytes per (row, column): forward the running product G; backward the K snapshots, H (bwd per
        # level; bwd_all writes H over the snapshots) and the K bf16 Ho blocks; with a bias its block and Gb
        asz = ITEMSIZE[c.acc]
        per_elem = asz * ((c.K + 1) if backward else 1) + (2 * c.K if backward and self.half is not None else 0) + \
            (2 * asz if bias is not None else 0)
        bias_mode = None if bias is None else ("table" if bias[2] is not None else "exact")
        self.tc = bool(tensor_cores) and tc_eligible(self.half, c.q.shape[1], c.seg, c.N, bias_mode, be)
        self.tab = None  # the table bias of the tensor-core path: (u_q, u_d, table) float32, hist in shared memory
        self.tr, self.tcl = 64, 64  # the tensor-core tile: rows, columns per CUDA block (tc_tile)
        if self.tc:
            k = self.kernels
            optin = k.mrl_tc_smem_optin(self.dev)
            P = 0 if bias is None else bias[2].numel()
            hist = 0 < P <= TC_HIST_SMEM_POINTS  # the histogram in shared memory where it fits
            self.tr, self.tcl = tc_tile(c.K, bias is not None, P if hist else 0, optin)
            if bias is not None:
                u_q, u_d, table = (x.to(torch.float32).contiguous() for x in bias[:3])
                smem = k.mrl_tc_smem_bytes(c.K, True, True, P, self.tr, self.tcl) <= optin
                self.tab = (u_q, u_d, table, bool(smem and hist))
            # backward: the K bf16 coefficient blocks Ho (counted twice: half the budget, since this path also
            # holds float32 and bf16 copies of q and d, 0.6 GB at B = 65,536, H = 768); forward: partials
            per_elem = 4 * c.K if backward else max(1, c.K // 8)
        self.R = block_rows(c.Bq, c.Bd, c.N, per_elem, q.device, block)
        if self.tc and self.R < c.Bq and self.R > self.tr and not block:
            self.R = self.R // self.tr * self.tr  # whole tiles per launch

    def row_blocks(self, r: int) -> int:
        """CUDA row blocks of the tensor-core kernels over r rows (their column partials' leading size)."""
        return -(-r // self.tr)

    def blocks(self):
        for i0 in range(0, self.c.Bq, self.R):
            yield i0, min(self.c.Bq, i0 + self.R)

    def prod(self, out, a, b, c=None):
        """out (R, C) accumulation dtype = a @ b^T (+ c when given; c may be out itself) for operand rows a (R, k)
        and b (C, k): cuBLAS with float32 output for half operands on CUDA; in the accumulation dtype on the
        emulator (CPU tensors: exact products of the half values, as the tensor cores)."""
        acc = self.c.acc
        if self.be.kind != "cuda" or a.dtype == acc:
            a, b = a.to(acc), b.to(acc)
            if c is None:
                torch.mm(a, b.t(), out=out)
            else:
                torch.addmm(c, a, b.t(), out=out)
            return
        if c is not None and c is not out:
            try:
                torch.addmm(c, a, b.t(), out_dtype=torch.float32, out=out)
                return
            except (TypeError, RuntimeError, NotImplementedError):
                out.copy_(c)
        elif c is None:
            try:
                torch.mm(a, b.t(), out_dtype=torch.float32, out=out)
                return
            except (TypeError, RuntimeError, NotImplementedError):
                out.zero_()
        addmm_into(out, a, b.t())

    def grad_prod(self, Hx, X):
        """Hx @ X in the accumulation dtype (float32 output of half operands on CUDA)."""
        if self.be.kind != "cuda" or Hx.dtype == self.c.acc:
            return Hx.to(self.c.acc) @ X.to(self.c.acc)
        return mm_acc(Hx, X)

    def launch(self, op, G, i0, l, *, pos, tiling_, scale_cols, dense=None, nslots=1, slot0=0, gr=0.0, gc=0.0,
               H=None, accumulate=False, levels=0, **outs):
        """One launch for level l (G: its (R, C) block), or with levels = K > 0 ("bwd_all") for levels 0..K-1
        (G: the (K, R, C) snapshots; rho / kap / statistics of every level)."""
        c = self.c
        TR, nct, nrt = tiling_
        R, C = G.shape[-2:]
        q_lo, q_hi, d_lo, d_hi = self.spans
        if levels:
            p = dict(G=ptr(G), rho=ptr(c.rho), kap=ptr(scale_cols))
        else:
            p = dict(G=ptr(G), rho=ptr(c.rho[l]), kap=ptr(scale_cols[l]))
        if pos:
            p.update(q_lo=ptr(q_lo), q_hi=ptr(q_hi), d_lo=ptr(d_lo), d_hi=ptr(d_hi), row_none=ptr(self.row_none),
                     col_none=ptr(self.col_none))
            if self.row_fb is not None:
                p["row_fb"] = ptr(self.row_fb)
        if dense is not None:
            p["dense"] = ptr(dense)
        if H is not None:
            p["H"] = ptr(H)
        p.update({k: ptr(v) for k, v in outs.items() if v is not None})
        cols = pos and c.cw != 0.0
        Ho = outs.get("Ho")
        ldh = 0 if H is None else H.stride(-2)
        if levels and Ho is not None:
            ldh = Ho.stride(-2)
        sizes = [R, C, i0, G.stride(-2), int(pos), int(cols), c.off, 0 if dense is None else dense.stride(0), TR, nct,
                 nrt, nslots, slot0, c.Bq, ldh, int(accumulate), max(1, levels),
                 G.stride(0) if levels else 0, Ho.stride(0) if (levels and Ho is not None) else 0,
                 c.rho.stride(0), scale_cols.stride(0)]
        od = self.ad if outs.get("Ho") is None else DTYPE_CODES[outs["Ho"].dtype]
        self.kernels.mrl_block_launch(op, self.dev, self.stream, [self.ad, od, self.ad], sizes, [c.it, gr, gc], p)


class _Grads:
    """The gradient accumulators of the fused backward (accumulation dtype; the bias inputs' in float64)."""

    def __init__(self, F, bias):
        c = F.c
        self.dq, self.dd = torch.zeros_like(c.q), torch.zeros_like(c.d)
        self.dneg = None if c.neg is None else torch.zeros_like(c.neg)
        self.drho, self.dkap = torch.zeros_like(c.rho), torch.zeros_like(c.kap)
        self.dkneg = None if c.kneg is None else torch.zeros_like(c.kneg)
        self.bias = None if bias is None else [None if t is None else torch.zeros(t.shape, dtype=torch.float64,
                                                                                  device=c.q.device) for t in bias]

    def out(self, q, acc):
        e = lambda: q.new_empty(0, dtype=acc)  # noqa: E731
        out = [self.dq, self.dd, e() if self.dneg is None else self.dneg, self.drho, self.dkap,
               e() if self.dkneg is None else self.dkneg]
        if self.bias is not None:
            out += [q.new_empty(0, dtype=torch.float64) if g is None else g for g in self.bias]
        return out


def _snapshots(F, i0, i1, X, levels):
    """(levels, R, n) accumulation dtype: the raw prefix products G_l of rows i0..i1 against X (d or the extra
    negatives, in the operand dtype), l < levels, through a chain of (add)mm's."""
    c = F.c
    qo = F.qo[i0:i1]
    Gs = torch.empty(levels, i1 - i0, X.shape[0], dtype=c.acc, device=qo.device)
    for l in range(levels):
        a, b = c.seg[l], c.seg[l + 1]
        F.prod(Gs[l], qo[:, a:b], X[:, a:b], None if l == 0 else Gs[l - 1])
    return Gs


def _backward_block(F, i0, i1, Gs, Es, dense, rw, cw, row_stats, col_stats, gr: _Grads):
    """The gradient of rows i0..i1 for the level coefficients rw, cw (lists of K floats) from their snapshots Gs
    (at least up to the top level with a coefficient; Es for the extra negatives up to the top level with a row
    coefficient, or None): one bwd launch per weighted level from the top down, the segment products after
    each level, the bias gradient once."""
    c = F.c
    K, dev, acc = c.K, c.q.device, c.acc
    r = i1 - i0
    qo = F.qo[i0:i1]
    act = [l for l in range(K) if rw[l] != 0.0 or cw[l] != 0.0]
    if not act:
        return
    top = act[-1]
    tS = tiling(r, c.Bd, F.be)
    H = torch.empty(r, c.Bd, dtype=acc, device=dev)
    Ho = torch.empty(r, c.Bd, dtype=F.half, device=dev) if F.half is not None else None
    Gb = torch.empty(r, c.Bd, dtype=acc, device=dev) if dense is not None else None
    drp = torch.empty(r, tS[1], dtype=acc, device=dev)
    dkp = torch.empty(tS[2], c.Bd, dtype=acc, device=dev)
    if Es is not None:
        tE = tiling(r, c.N, F.be)
        Hn = torch.empty(r, c.N, dtype=acc, device=dev)
        Hno = torch.empty(r, c.N, dtype=F.half, device=dev) if F.half is not None else None
        drpn = torch.empty(r, tE[1], dtype=acc, device=dev)
        dkpn = torch.empty(tE[2], c.N, dtype=acc, device=dev)
    started = started_n = False
    for l in range(top, -1, -1):
        a, b = c.seg[l], c.seg[l + 1]
        if rw[l] != 0.0 or cw[l] != 0.0:
            F.launch("bwd", Gs[l], i0, l, pos=True, tiling_=tS, scale_cols=c.kap, dense=dense, gr=rw[l], gc=cw[l],
                     H=H, accumulate=started, row_lse=row_stats[l], col_lse=col_stats[l], Gb=Gb, drho_part=drp,
                     dkap_part=dkp, Ho=Ho)
            started = True
            gr.drho[l, i0:i1] += drp.sum(1)
            gr.dkap[l] += dkp.sum(0)
        Hx = H if Ho is None else Ho
        gr.dq[i0:i1, a:b] += F.grad_prod(Hx, F.do[:, a:b])
        gr.dd[:, a:b] += F.grad_prod(Hx.t(), qo[:, a:b])
        if Es is not None and l < Es.shape[0]:
            if rw[l] != 0.0:
                F.launch("bwd", Es[l], i0, l, pos=False, tiling_=tE, scale_cols=c.kneg, gr=rw[l], H=Hn,
                         accumulate=started_n, row_lse=row_stats[l], drho_part=drpn, dkap_part=dkpn, Ho=Hno)
                started_n = True
                gr.drho[l, i0:i1] += drpn.sum(1)
                gr.dkneg[l] += dkpn.sum(0)
            Hx = Hn if Hno is None else Hno
            gr.dq[i0:i1, a:b] += F.grad_prod(Hx, F.no[:, a:b])
            gr.dneg[:, a:b] += F.grad_prod(Hx.t(), qo[:, a:b])
    if Gb is not None:
        c.bias_backward(i0, i1, Gb, gr.bias)


#: levels per "bwd_all" launch (every level of a row block in one pass, the suffix sum in registers); more
#: levels, or too little shared memory for them, take one "bwd" launch per level
ALL_LEVELS_MAX = 32
_SMEM_ALL = 96 * 1024  # shared memory bwd_all may ask for (sm_86 / sm_89 allow 99 KB per block)


def _all_levels(F, K: int) -> bool:
    """Whether K levels fit one bwd_all launch: K x 1,024 dL/dkap sums + 32 x 32 row sums in shared memory."""
    return 1 <= K <= ALL_LEVELS_MAX and (K + 1) * 1024 * ITEMSIZE[F.c.acc] <= _SMEM_ALL


def _backward_block_all(F, i0, i1, Gs, Es, dense, rw, cw, row_stats, col_stats, gr: _Grads):
    """_backward_block with one "bwd_all" launch per block and candidate set: the snapshots Gs (levels >= the
    top weighted one) are overwritten by the coefficient suffix sums H_l (or H_l goes to Ho_l in bf16)."""
    c = F.c
    dev, acc = c.q.device, c.acc
    r = i1 - i0
    qo = F.qo[i0:i1]
    cols = c.cw != 0.0

    def one(Gs, X, pos, coefs, scale_cols, dx, dscale):
        K = len(coefs)
        Gs = Gs[:K]
        t = tiling(r, X.shape[0], F.be)
        co = device_constant(coefs, acc, c.q)
        Ho = torch.empty(Gs.shape, dtype=F.half, device=dev) if F.half is not None else None
        Gb = torch.empty(r, c.Bd, dtype=acc, device=dev) if (pos and dense is not None) else None
        drp = torch.empty(K, r, t[1], dtype=acc, device=dev)
        dkp = torch.empty(K, t[2], X.shape[0], dtype=acc, device=dev)
        F.launch("bwd_all", Gs, i0, 0, pos=pos, tiling_=t, scale_cols=scale_cols, dense=dense if pos else None,
                 H=Gs if Ho is None else None, levels=K, coef=co, row_lse=row_stats,
                 col_lse=col_stats if (pos and cols) else None, Gb=Gb, drho_part=drp, dkap_part=dkp, Ho=Ho)
        gr.drho[:K, i0:i1] += drp.sum(2)
        dscale[:K] += dkp.sum(1)
        Hs = Gs if Ho is None else Ho
        for l in range(K):
            a, b = c.seg[l], c.seg[l + 1]
            gr.dq[i0:i1, a:b] += F.grad_prod(Hs[l], X[:, a:b])
            dx[:, a:b] += F.grad_prod(Hs[l].t(), qo[:, a:b])
        return Gb

    top = _top([float(a != 0.0 or b != 0.0) for a, b in zip(rw, cw)])
    if not top:
        return
    Gb = one(Gs, F.do, True, [[rw[l], cw[l]] for l in range(top)], c.kap, gr.dd, gr.dkap)
    topn = _top(rw) if Es is not None else 0
    if topn:
        one(Es, F.no, False, [[rw[l], 0.0] for l in range(topn)], c.kneg, gr.dneg, gr.dkneg)
    if Gb is not None:
        c.bias_backward(i0, i1, Gb, gr.bias)


def _backward_any(F, i0, i1, Gs, Es, dense, rw, cw, row_stats, col_stats, gr: _Grads):
    top = _top([float(a != 0.0 or b != 0.0) for a, b in zip(rw, cw)])
    if _all_levels(F, top):
        _backward_block_all(F, i0, i1, Gs, Es, dense, rw, cw, row_stats, col_stats, gr)
    else:
        _backward_block(F, i0, i1, Gs, Es, dense, rw, cw, row_stats, col_stats, gr)


def _top(coefs) -> int:
    """Levels up to the highest one with a non-zero coefficient (0 when none)."""
    act = [l for l, x in enumerate(coefs) if x != 0.0]
    return act[-1] + 1 if act else 0


def _merge_block_stats(row_stats, i0, i1, row_part, col_part, c_all, c_pos):
    """A row block's partials into the statistics: its rows' (lse_all, lse_pos) from row_part (K, r, slots, 2)
    into row_stats[:, :2, i0:i1], and with a column term (col_part (K, tiles, C, 2)) the running column values;
    returns (c_all, c_pos)."""
    lse = torch.logsumexp(row_part, dim=2)  # (K, r, 2)
    row_stats[:, 0, i0:i1] = lse[..., 0]
    row_stats[:, 1, i0:i1] = lse[..., 1]
    if col_part is not None:
        cl = torch.logsumexp(col_part, dim=1)  # (K, C, 2)
        c_all = torch.logaddexp(c_all, cl[..., 0])
        c_pos = torch.logaddexp(c_pos, cl[..., 1])
    return c_all, c_pos


def _forward_state(F, coef, row_weight, col_weight, gif: bool, bias):
    """Both fused forwards' accumulators: (row_stats, col_stats, column lse_all / lse_pos running values or None
    without a column term, and with gif the gradient accumulators and the levels' row / column coefficients)."""
    c = F.c
    K, dev, acc = c.K, c.q.device, c.acc
    row_stats = torch.zeros(K, 3, c.Bq, dtype=acc, device=dev)
    col_stats = torch.zeros(K, 3, c.Bd, dtype=acc, device=dev)
    c_all = torch.full((K, c.Bd), float("-inf"), dtype=acc, device=dev) if col_weight != 0.0 else None
    c_pos = None if c_all is None else c_all.clone()
    if not gif:
        return row_stats, col_stats, c_all, c_pos, None, None, None
    rw = [float(x) * row_weight / c.Bq if c.Bq else 0.0 for x in coef]
    return row_stats, col_stats, c_all, c_pos, _Grads(F, bias), rw, [0.0] * K


def fused_forward(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, coef, inv_temp,
                  row_weight, col_weight, diag_offset, block=0, bias=None, want_grad=False,
                  known_half=None, tensor_cores=False, be=None) -> List[torch.Tensor]:
    """[loss, levels, row_stats, col_stats], then with want_grad (only without a column term: a block's row
    statistics are then final after its own pass) the gradients for a unit upstream gradient of the loss,
    [dq, dd, dneg, drho, dkap, dkneg]: the block's snapshots are kept for its backward launches, which saves
    the backward's recomputed products (6 instead of 8 B C H flops)."""
    gif = bool(want_grad) and col_weight == 0.0
    F = _Fused(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp, row_weight,
               col_weight, diag_offset, block, bias, backward=gif, known_half=known_half, tensor_cores=tensor_cores,
               be=be)
    if F.tc:
        return _tc_forward(F, coef, row_weight, col_weight, gif, bias)
    c = F.c
    K, dev, acc = c.K, q.device, c.acc
    cols = col_weight != 0.0
    row_stats, col_stats, c_all, c_pos, grads, rw, cw = _forward_state(F, coef, row_weight, col_weight, gif, bias)
    for i0, i1 in F.blocks():
        r = i1 - i0
        tS = tiling(r, c.Bd, F.be)
        tE = tiling(r, c.N, F.be) if c.N else (1, 0, 1)
        nslots = tS[1] + tE[1]
        row_part = torch.empty(K, r, nslots, 2, dtype=acc, device=dev)
        col_part = torch.empty(K, tS[2], c.Bd, 2, dtype=acc, device=dev) if cols else None
        dense = c.bias_block(i0, i1)
        dense = None if dense is None else dense.contiguous()
        qo = F.qo[i0:i1]
        if gif:  # the snapshots, kept for the block's backward
            Gs = _snapshots(F, i0, i1, F.do, K)
            Es = _snapshots(F, i0, i1, F.no, K) if c.N else None
        else:  # one running product
            Gs = torch.empty(1, r, c.Bd, dtype=acc, device=dev)
            Es = torch.empty(1, r, c.N, dtype=acc, device=dev) if c.N else None
        for l in range(K):
            a, b = c.seg[l], c.seg[l + 1]
            if not gif:
                F.prod(Gs[0], qo[:, a:b], F.do[:, a:b], None if l == 0 else Gs[0])
            G = Gs[l if gif else 0]
            F.launch("fwd", G, i0, l, pos=True, tiling_=tS, scale_cols=c.kap, dense=dense, nslots=nslots,
                     row_part=row_part[l], col_part=None if col_part is None else col_part[l])
            if Es is not None:
                if not gif:
                    F.prod(Es[0], qo[:, a:b], F.no[:, a:b], None if l == 0 else Es[0])
                F.launch("fwd", Es[l if gif else 0], i0, l, pos=False, tiling_=tE, scale_cols=c.kneg, nslots=nslots,
                         slot0=tS[1], row_part=row_part[l])
        c_all, c_pos = _merge_block_stats(row_stats, i0, i1, row_part, col_part, c_all, c_pos)
        if gif:
            _backward_any(F, i0, i1, Gs, Es, dense, rw, cw, row_stats, col_stats, grads)
        del Gs, Es, dense, row_part, col_part
    loss, levels = _finish_levels(c, row_stats, col_stats, c_all, c_pos, cols, coef, row_weight, col_weight)
    out = [loss, levels, row_stats, col_stats]
    if gif:
        out += grads.out(q, acc)
    return out


def fused_backward(lcoef, row_stats, col_stats, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none,
                   seg, inv_temp, row_weight, col_weight, diag_offset, block=0, bias=None,
                   known_half=None, tensor_cores=False, be=None) -> List[torch.Tensor]:
    F = _Fused(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp, row_weight,
               col_weight, diag_offset, block, bias, backward=True, known_half=known_half,
               tensor_cores=tensor_cores, be=be)
    c = F.c
    grads = _Grads(F, bias)
    cols = col_weight != 0.0
    if F.tc:  # the level coefficients stay on the device (no host synchronisation); every level is launched
        scale = device_constant([row_weight / c.Bq if c.Bq else 0.0, col_weight / c.Bd if (cols and c.Bd) else 0.0],
                                c.acc, c.q)
        co = (lcoef.detach().to(c.acc)[:, None] * scale[None, :]).contiguous()
        row_stats, col_stats = row_stats.contiguous(), col_stats.contiguous()
        for i0, i1 in F.blocks():
            _tc_backward_block(F, i0, i1, None, None, row_stats, col_stats, grads, co=co)
        return grads.out(q, c.acc)
    coef = [float(x) for x in lcoef.detach().to("cpu", torch.float64).tolist()]
    rw = [x * row_weight / c.Bq if c.Bq else 0.0 for x in coef]
    cw = [x * col_weight / c.Bd if cols else 0.0 for x in coef]
    row_stats, col_stats = row_stats.contiguous(), col_stats.contiguous()
    top = _top([float(a != 0.0 or b != 0.0) for a, b in zip(rw, cw)])
    topn = _top(rw) if c.N else 0
    if top:
        for i0, i1 in F.blocks():
            dense = c.bias_block(i0, i1)
            dense = None if dense is None else dense.contiguous()
            Gs = _snapshots(F, i0, i1, F.do, top)
            Es = _snapshots(F, i0, i1, F.no, topn) if topn else None
            _backward_any(F, i0, i1, Gs, Es, dense, rw, cw, row_stats, col_stats, grads)
            del Gs, Es, dense
    return grads.out(q, c.acc)


# ---- the tensor-core path (csrc/matryoshka_infonce/matryoshka_tc_cuda.cu) ----------------------------------
#
# Per block of R rows: ONE forward launch computes every level's score tiles on the tensor cores and reduces
# them on chip (row partials per column split, column partials per 64-row block); ONE backward launch
# recomputes them and writes only the K bfloat16 coefficient blocks Ho_l (the suffix sums of the levels'
# dL/dG), then cuBLAS runs dq[:, S_l] += Ho_l d[:, S_l] and dd[:, S_l] += Ho_l^T q[:, S_l] (one product's
# flops over the K segments). Per pair: forward 2 m_K flops and no bytes; backward 2 m_K flops on the tensor
# cores, 2 K bytes written and 4 K read by the 2 K products (2 x 2 m_K flops). Memory: 2 K R C bytes (Ho)
# in the backward, O(K (R C / 64 + R splits)) partials; R from the 1 GiB budget (block_rows).


#: CUDA blocks per SM the tensor-core grids aim at: ~8 waves of the forward's 4 resident blocks per SM (16 of
#: the backward's 2), so that the last, partial wave costs a few percent (a split adds only its row partials)
TC_BLOCKS_PER_SM = 32


def _tc_splits(F, r: int):
    """(nsplit, tiles_per_split): column splits so that the grid has TC_BLOCKS_PER_SM x SMs CUDA blocks where
    the tiles allow it."""
    ntiles = -(-F.c.Bd // F.tcl)
    nrb = F.row_blocks(r)
    want = max(1, -(-TC_BLOCKS_PER_SM * F.be.sm_count // nrb))
    nsplit = max(1, min(ntiles, want))
    tps = -(-ntiles // nsplit)
    return -(-ntiles // tps), tps


def _tc_launch(F, op: str, i0: int, i1: int, K: int, splits, **outs):
    c = F.c
    q_lo, q_hi, d_lo, d_hi = F.spans
    p = dict(q=ptr(F.qo), d=ptr(F.do), rho=ptr(c.rho), kap=ptr(c.kap), q_lo=ptr(q_lo), q_hi=ptr(q_hi),
             d_lo=ptr(d_lo), d_hi=ptr(d_hi), row_none=ptr(F.row_none), col_none=ptr(F.col_none))
    if F.row_fb is not None:
        p["row_fb"] = ptr(F.row_fb)
    p.update({k: ptr(v) for k, v in outs.items() if v is not None})
    Ho = outs.get("Ho")
    sizes = [i1 - i0, c.Bd, i0, c.Bq, F.qo.stride(0), F.do.stride(0), c.rho.stride(0), c.kap.stride(0), c.off,
             int(c.cw != 0.0), splits[0], splits[1], 0 if Ho is None else Ho.stride(0), F.tr, F.tcl]
    if F.tab is not None:
        u_q, u_d, table, hist_smem = F.tab
        p.update(u_q=ptr(u_q), u_d=ptr(u_d), table=ptr(table))
        sizes += [table.numel(), int(hist_smem)]
    F.kernels.mrl_tc_launch(op, F.dev, F.stream, DTYPE_CODES[F.half], sizes, [int(x) for x in c.seg[:K + 1]], c.it,
                            p)


def _tc_forward(F, coef, row_weight, col_weight, gif: bool, bias):
    c = F.c
    K, dev, acc = c.K, c.q.device, c.acc
    cols = col_weight != 0.0
    row_stats, col_stats, c_all, c_pos, grads, rw, cw = _forward_state(F, coef, row_weight, col_weight, gif, bias)
    for i0, i1 in F.blocks():
        r = i1 - i0
        splits = _tc_splits(F, r)
        row_part = torch.empty(K, r, splits[0], 2, dtype=acc, device=dev)
        col_part = torch.empty(K, F.row_blocks(r), c.Bd, 2, dtype=acc, device=dev) if cols else None
        _tc_launch(F, "fwd", i0, i1, K, splits, row_part=row_part, col_part=col_part)
        c_all, c_pos = _merge_block_stats(row_stats, i0, i1, row_part, col_part, c_all, c_pos)
        if gif:
            _tc_backward_block(F, i0, i1, rw, cw, row_stats, col_stats, grads)
        del row_part, col_part
    loss, levels = _finish_levels(c, row_stats, col_stats, c_all, c_pos, cols, coef, row_weight, col_weight)
    out = [loss, levels, row_stats, col_stats]
    if gif:
        out += grads.out(c.q, acc)
    return out


def _tc_backward_block(F, i0, i1, rw, cw, row_stats, col_stats, gr: _Grads, co=None):
    """The gradient of rows i0..i1 for the level coefficients rw, cw (host floats: the levels up to the top
    weighted one are launched) or co (a (K, 2) device tensor of (row, column) coefficients: every level): one
    backward launch (Ho_l, dL/drho_l and dL/dkap_l partials), then the 2 x top segment products."""
    c = F.c
    if co is None:
        top = _top([float(a != 0.0 or b != 0.0) for a, b in zip(rw, cw)])
        if not top:
            return
        co = device_constant([[float(rw[l]), float(cw[l])] for l in range(top)], c.acc, c.q)
    top = co.shape[0]
    dev, acc = c.q.device, c.acc
    r = i1 - i0
    splits = _tc_splits(F, r)
    Ho = torch.empty(top, r, c.Bd, dtype=F.half, device=dev)
    drp = torch.empty(top, r, splits[0], dtype=acc, device=dev)
    dkp = torch.empty(top, F.row_blocks(r), c.Bd, dtype=acc, device=dev)
    tab = {}
    if F.tab is not None:  # the table bias's gradient partials (float64 histogram: per CUDA block or one)
        P, nrb = F.tab[2].numel(), F.row_blocks(r)
        tab = dict(hist=torch.zeros(splits[0] * nrb if F.tab[3] else 1, P, dtype=torch.float64, device=dev),
                   duq_part=torch.empty(r, splits[0], dtype=acc, device=dev),
                   dud_part=torch.empty(nrb, c.Bd, dtype=acc, device=dev))
    _tc_launch(F, "bwd", i0, i1, top, splits, row_lse=row_stats, col_lse=col_stats if c.cw != 0.0 else None,
               coef=co, Ho=Ho, drho_part=drp, dkap_part=dkp, **tab)
    gr.drho[:top, i0:i1] += drp.sum(2)
    gr.dkap[:top] += dkp.sum(1)
    if tab:
        gr.bias[0][i0:i1] += tab["duq_part"].double().sum(1)
        gr.bias[1] += tab["dud_part"].double().sum(0)
        gr.bias[2] += tab["hist"].sum(0).reshape(gr.bias[2].shape)
    qo = F.qo[i0:i1]
    for l in range(top):
        a, b = c.seg[l], c.seg[l + 1]
        gr.dq[i0:i1, a:b] += F.grad_prod(Ho[l], F.do[:, a:b])
        gr.dd[:, a:b] += F.grad_prod(Ho[l].t(), qo[:, a:b])
