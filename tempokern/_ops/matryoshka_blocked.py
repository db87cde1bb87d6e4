"""Blocked Matryoshka InfoNCE in torch: the CUDA execution of tempokern.matryoshka_infonce (and a CPU twin
used by the tests). Rows are processed in blocks of R anchors against all candidates; per block the K
segment products are accumulated into one float32 block with ``addmm`` (cuBLAS on CUDA), snapshot after
each segment (the K level logit blocks), and reduced with torch: exact row log-sum-exps (a block holds
whole rows), column log-sum-exps merged across blocks with ``logaddexp``. Backward recomputes the block,
turns each level into its coefficient block, suffix-sums them from the top level down while running one
``addmm`` per segment for dq and dd.

Products: 2 B C H flops forward + 6 B C H backward, the same as one level. Memory: the block, about
(K + 4) x R x (C + N) float32 values (R chosen so that this fits min(1 GiB, free / 4) on CUDA,
TEMPOKERN_BLOCK_BYTES overrides), plus O((B + C + N) (H + K)); never B x C unless one block holds it.
Not yet fused into custom CUDA kernels (the statistics and coefficient steps are ~10 torch element-wise
ops per level and block); bias is not supported on this path."""
from __future__ import annotations

from typing import List, Sequence

import torch

from .multipos_blocked import block_rows


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
                 col_weight, diag_offset, block):
        self.acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.q, self.d, self.neg = q.to(self.acc), d.to(self.acc), None if extra_neg is None else extra_neg.to(self.acc)
        self.rho, self.kap = rho.to(self.acc), kap.to(self.acc)
        self.kneg = None if kneg is None else kneg.to(self.acc)
        self.seg, self.K = list(seg), len(seg) - 1
        self.it, self.rw, self.cw, self.off = inv_temp, row_weight, col_weight, diag_offset
        self.Bq, self.Bd = q.shape[0], d.shape[0]
        self.N = 0 if extra_neg is None else extra_neg.shape[0]
        self.q_lo, self.q_hi, self.d_lo, self.d_hi = q_lo, q_hi, d_lo, d_hi
        rn, self.col_none = _none_flags(q_lo, q_hi, d_lo, d_hi)
        self.row_none_local = rn
        self.row_fb_col = rn if row_none is None else row_none.bool()  # decides the column fallback
        per_elem = 4 * (self.K + 4)
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


def blocked_forward(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg: Sequence[int],
                    coef: Sequence[float], inv_temp: float, row_weight: float, col_weight: float, diag_offset: int,
                    block: int = 0) -> List[torch.Tensor]:
    c = _Ctx(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp, row_weight,
             col_weight, diag_offset, block)
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
        for l in range(K):
            z = zs[l]
            za = z if zn is None else torch.cat([z, zn[l]], dim=1)
            row_stats[l, 0, i0:i1] = torch.logsumexp(za, dim=1)
            row_stats[l, 1, i0:i1] = _masked_lse(z, pos_r, 1)
            if cols:
                c_all[l] = torch.logaddexp(c_all[l], torch.logsumexp(z, dim=0))
                c_pos[l] = torch.logaddexp(c_pos[l], _masked_lse(z, pos_c, 0))
    row_stats[:, 2] = c.row_none_local.to(acc)[None, :]
    if cols:
        col_stats[:, 0], col_stats[:, 1] = c_all, c_pos
    levels = torch.zeros(K, dtype=acc, device=dev)
    if row_weight != 0.0 and c.Bq:
        levels = levels + row_weight * (row_stats[:, 0] - row_stats[:, 1]).mean(dim=1)
    if cols and c.Bd:
        levels = levels + col_weight * (col_stats[:, 0] - col_stats[:, 1]).mean(dim=1)
    w = torch.tensor(list(coef), dtype=acc, device=dev)
    loss = (torch.where(w != 0, levels, torch.zeros_like(levels)) * w).sum()
    return [loss, levels, row_stats, col_stats]


def blocked_backward(lcoef, row_stats, col_stats, q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none,
                     seg: Sequence[int], inv_temp: float, row_weight: float, col_weight: float, diag_offset: int,
                     block: int = 0) -> List[torch.Tensor]:
    c = _Ctx(q, d, extra_neg, rho, kap, kneg, q_lo, q_hi, d_lo, d_hi, row_none, seg, inv_temp, row_weight,
             col_weight, diag_offset, block)
    K, acc = c.K, c.acc
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
            Hacc = Hn = None
            for l in range(K - 1, -1, -1):
                a, b = c.seg[l], c.seg[l + 1]
                if active[l]:
                    z = zs[l]
                    g = torch.zeros_like(z)
                    if row_weight != 0.0:
                        lse, lsep = row_stats[l, 0, i0:i1, None], row_stats[l, 1, i0:i1, None]
                        g = rw[l] * (torch.exp(z - lse) - torch.where(pos_r, torch.exp(z - lsep), 0.0))
                    if cols:
                        g = g + cw[l] * (torch.exp(z - col_stats[l, 0][None, :])
                                         - torch.where(pos_c, torch.exp(z - col_stats[l, 1][None, :]), 0.0))
                    u = g * z
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
    e = lambda: q.new_empty(0, dtype=acc)  # noqa: E731
    return [dq, dd, e() if dneg is None else dneg, drho, dkap, e() if dkneg is None else dkneg]
