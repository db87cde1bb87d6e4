"""Fused CTD top-k: s_ij = q_i . g_j / temperature + bias_ij, exact top-k per query without
ever holding the (Q, N) score matrix. See :func:`tempokern.reference.ctd_topk` for the spec."""
from __future__ import annotations

import math
import operator
from typing import Optional, Tuple

import torch

from ..reference.ctd_topk import table_values
from ..reference.offset_bias import bias_frequencies
from .. import _C
from . import backend, dispatch
from .offset_bias import bias_params, offset_bias, offset_bias_lookup
from .common import (acc_dtype, check_finite, check_reciprocal, check_same_device, check_tensor, dtype_code,
                     ptr, rows_contiguous, scalar_value)

_BIAS_NONE, _BIAS_EXACT, _BIAS_TABLE = 0, 1, 2
_CPU_QBLOCK = 2048          # queries per CPU launch

# CUDA path (csrc/ctd_topk/, driver below). Beyond these limits a chunked torch path runs.
_CUDA_MAX_K = 1024          # candidate buffers of cap = pow2(k + 32) entries per (query, slice)
_CUDA_MAX_K2 = 64           # 2K features of the exact bias (a per-lane array in the kernel)
_SCAN_MAX_Q = 4             # Q <= this: one fused pass over the gallery (no cuBLAS)
_SCAN_SMEM = 48 * 1024      # the scan pass stages the queries in shared memory: Q * H * sizeof(acc)
_BLOCK_BYTES = 1 << 28      # score block Q_block x chunk in the accumulation dtype (256 MiB)
_QBLOCK = 4096              # queries per score block (bounds the per-query bias matrices and workspaces)
_MIN_CHUNK = 4096           # gallery columns per score block, at least
_MIN_SLICE = 256            # columns / rows per warp, at least (bounds the merge size)
_WS_ENTRIES = 1 << 22       # scan workspace entries (Q * slices * cap), at most: 48 MiB in float32
_SEL_WARPS, _SCAN_WARPS = 4, 8  # warps per CTA of the two kernels (ctd_topk_kernels.cuh)
_SEL_CTAS_PER_SM = 16       # select grid: 16 CTAs x 4 warps per SM (full occupancy: loads in flight)
_SCAN_CTAS_PER_SM = 4       # scan grid: 4 CTAs x 8 warps per SM
# Serve path (Q <= _SERVE_MAX_Q; ctd_topk_cuda_serve): no host sync, no torch op on the data. The serve kernels
# take 1 to _SERVE_KERNEL_MAX_Q queries; dispatch sends them Q <= _SERVE_MAX_Q, the measured crossover on the H100
# (N = 1M, bf16, k = 10; benchmarks/results/gpu.csv, case "... sweep"): serve vs the scan / select kernels, no bias
# / exact bias, ms: Q 1 0.74 / 1.21 vs 1.23 / 2.88, Q 4 0.93 / 2.86 vs 3.98 / 6.63, Q 8 2.94 / 6.14 vs 1.10 /
# 4.52 (cuBLAS + select from Q = 5 on), Q 16 3.37 / 9.21 vs 1.30 / 5.37. Queries whose serve tile does not fit
# its shared memory (a wide H) take scan_rows (Q <= 4) as before.
_SERVE_KERNEL_MAX_Q = 16
_SERVE_MAX_Q = 4
_SERVE_WARPS = 8            # warps per CTA of serve_scan
_SERVE_CTAS_PER_SM = 2      # serve grid: 2 CTAs x 8 warps per SM (>= 2 x SMs CTAs where N allows)
_SERVE_SMEM = 96 * 1024     # serve_scan's shared memory: queries (QM, H) in the input dtype + score tiles
_MERGE_ENTRIES = 2048       # list entries per CTA of the first merge stage
_BOUND_SAMPLES = 1025       # csrc/ctd_topk/ctd_topk_kernels.cuh BOUND_S


def _freqs(D: int, dtype: torch.dtype, device) -> torch.Tensor:
    return bias_frequencies(D, dtype, device).contiguous()  # exactly the reference's frequencies


@torch.library.custom_op("tempokern::ctd_topk", mutates_args=())
def _ctd_topk(q: torch.Tensor, g: torch.Tensor, k: int, temperature: float, mode: int,
              u_q: Optional[torch.Tensor], u_g: Optional[torch.Tensor], w1: Optional[torch.Tensor],
              b1: Optional[torch.Tensor], w2: Optional[torch.Tensor], b2: float, scale: float,
              table: Optional[torch.Tensor], exclude: Optional[torch.Tensor],
              cand: Optional[torch.Tensor] = None, b2_t: Optional[torch.Tensor] = None,
              scale_t: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    # b2_t / scale_t: the exact bias's b2 / scale as one-element float64 tensors on q's device (they then
    # replace b2 / scale): the serve path reads them in its kernels, every other path reads them here
    Q, H = q.shape
    N = g.shape[0]
    acc = acc_dtype(q.dtype)
    be = backend.resolve(q)
    path = dispatch.choose("ctd_topk", _TopkCall(q, k, cand is not None), be).name
    if path != "cpu":
        if Q == 0:
            return (torch.empty(0, k, dtype=acc, device=q.device), torch.empty(0, k, dtype=torch.int64, device=q.device))
        if path == "serve":
            return _serve_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, b2_t, scale_t, table,
                               exclude, be=be)
        b2, scale = _host_scalar(b2, b2_t), _host_scalar(scale, scale_t)
        return _cuda_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, exclude, be=be)
    b2, scale = _host_scalar(b2, b2_t), _host_scalar(scale, scale_t)
    values = torch.empty(Q, k, dtype=acc, device=q.device)
    indices = torch.empty(Q, k, dtype=torch.int64, device=q.device)
    if Q == 0:
        return values, indices
    if q.device.type != "cpu":
        raise ValueError("candidate rerank runs on CPU tensors only")
    hidden = D = K = 0
    freqs = None
    if mode == _BIAS_EXACT:
        hidden, D = w1.shape
        K = max(1, D // 2)
        freqs = _freqs(D, acc, q.device)
    # CPU: query blocks bound the per-thread candidate buffers and the per-query bias matrices
    sl = lambda t, a, b: None if t is None else t[a:b]  # noqa: E731
    for a in range(0, Q, _CPU_QBLOCK):
        b = min(Q, a + _CPU_QBLOCK)
        qa, ea, ca = q[a:b], sl(exclude, a, b), sl(cand, a, b)
        _C.ctd_topk_launch(
            -1, 0, dtype_code(q), (b - a, N, H, k, q.stride(0), g.stride(0)), ptr(qa), ptr(g),
            float(temperature), mode, ptr(sl(u_q, a, b)), ptr(u_g),
            (hidden, D, K, ptr(freqs), ptr(w1), ptr(b1), ptr(w2), float(b2), float(scale)),
            ptr(table), 0 if table is None else table.shape[0], ptr(ea), 0 if ea is None else ea.shape[1],
            ptr(ca), 0 if ca is None else ca.shape[1], ptr(values[a:b]), ptr(indices[a:b]))
    return values, indices


# ---------------------------------------------------------------------------------------------------
# CUDA driver. Per query block (<= _QBLOCK queries) and gallery chunk: cuBLAS writes the score block
# q_blk @ g_chunk.T (torch.mm; float32 output for fp16/bf16 operands), select_block adds the bias where
# it can still matter and keeps a top-k per (query, slice) in the workspace, and a stable sort merges
# those lists into the running top-k (ties to the lower index: the lists are concatenated in index
# order). Q <= _SCAN_MAX_Q skips cuBLAS: scan_rows streams the gallery once. Extra memory:
# score block <= _BLOCK_BYTES, workspace Q_blk x slices x cap, bias matrices Q_blk x hidden x 2K.

def _bias_setup(mode, w1, b1, w2, b2, scale, acc, device):
    """Per-call bias constants: (upper bound of every bias value, ends (bias(+1), bias(-1)) in acc,
    padded first layer (hidden, 2K) and frequencies (K,) in float64)."""
    if mode == _BIAS_NONE:
        return 0.0, None, None, None
    eps = float(torch.finfo(acc).eps)
    if mode == _BIAS_TABLE:
        return None, None, None, None   # the table's bound is computed from its values by the caller
    hidden, D = w1.shape
    K = max(1, D // 2)
    P = min(2 * K, D)
    f64 = torch.float64
    w1p = torch.zeros(hidden, 2 * K, dtype=f64, device=device)
    w1p[:, :P] = w1[:, :P].to(f64)
    fr = _freqs(D, acc, device).to(f64)
    b1d, w2d = b1.to(f64), w2.reshape(-1).to(f64)
    S = 1025
    delta = torch.linspace(-1.0, 1.0, S, dtype=f64, device=device)
    ang = delta[:, None] * fr[None, :]
    phi = torch.cat([torch.sin(ang), torch.cos(ang)], 1)                    # (S, 2K)
    vals = scale * (torch.relu(phi @ w1p.t() + b1d) @ w2d + b2)            # (S,)
    # the CPU kernel's rigorous margin (ctd_topk_cpu.cpp, upper_bound): Lipschitz x half the spacing
    # plus rounding of the angle-difference evaluation in the accumulation dtype
    aw = w1p.abs()
    lip = (w2d.abs() * (aw * torch.cat([fr, fr])[None, :]).sum(1)).sum()
    mag = (w2d.abs() * (b1d.abs() + aw.sum(1))).sum()
    best, lip, mag = torch.stack([vals.max(), lip, mag]).tolist()          # one host sync
    margin = (abs(scale) * (lip / (S - 1) + mag * 64.0 * eps * (2 * K + 8))
              + 8.0 * eps * (abs(best) + abs(scale) * abs(b2)))
    ub = best + margin
    ub = ub + 4 * eps * abs(ub) + 4 * eps
    ends = torch.stack([vals[-1], vals[0]]).to(acc).contiguous()         # delta = +1, -1
    return (ub if math.isfinite(ub) else math.inf), ends, w1p, fr


def _amat(u_q, w1p, fr, acc):
    """Per query i the first layer folded with its angles: (Q, hidden, 2K); columns [0, K) multiply
    sin(f u_g), [K, 2K) cos(f u_g) (angle-difference identities, as the CPU kernel)."""
    K = fr.shape[0]
    a = u_q.to(torch.float64)[:, None] * fr[None, :]
    sq, cq = torch.sin(a)[:, None, :], torch.cos(a)[:, None, :]          # (Q, 1, K)
    ws, wc = w1p[None, :, :K], w1p[None, :, K:]                           # (1, hidden, K)
    return torch.cat([ws * cq + wc * sq, wc * cq - ws * sq], 2).to(acc).contiguous()


def _feats(u_g, fr, acc):
    a = u_g.to(torch.float64)[:, None] * fr[None, :]
    return torch.cat([torch.sin(a), torch.cos(a)], 1).to(acc).contiguous()


_mm_out_dtype = [True]


def _score_block(qa: torch.Tensor, gc: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """q_blk @ g_chunk.T in the accumulation dtype through torch (cuBLAS on CUDA)."""
    if qa.dtype == acc:
        return torch.mm(qa, gc.to(acc).t())
    if qa.is_cuda and _mm_out_dtype[0]:
        try:  # bf16/fp16 operands, fp32 accumulation and output in one cuBLAS call
            return torch.mm(qa, gc.t(), out_dtype=acc)
        except (TypeError, RuntimeError, NotImplementedError):
            _mm_out_dtype[0] = False
    return torch.mm(qa.to(acc), gc.to(acc).t())


def _pass(be, kind, dev, stream, ints, ptrs, reals):
    be.kernels.ctd_topk_cuda_pass(dev, stream, kind, [int(x) for x in ints], [int(x) for x in ptrs],
                                 [float(x) for x in reals])


def _merge(parts_v, parts_i, k):
    """Stable merge of lists concatenated in gallery-index order: the k best, ties to the lower index."""
    v = torch.cat(parts_v, 1)
    i = torch.cat(parts_i, 1)
    o = torch.sort(v, dim=1, descending=True, stable=True).indices[:, :k]
    return v.gather(1, o), i.gather(1, o)


def _slices(cols: int, want: int) -> Tuple[int, int]:
    """(nslices, per_slice): about `want` slices of at least _MIN_SLICE columns covering cols, none empty."""
    n = max(1, min(want, -(-cols // _MIN_SLICE)))
    per = -(-cols // n)
    return -(-cols // per), per


def _cuda_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, ex, be=None):
    Q, H = q.shape
    N = g.shape[0]
    acc = acc_dtype(q.dtype)
    be = backend.resolve(q) if be is None else be
    dev, stream = be.launch
    sms = be.sm_count
    cap = _pow2(k + 32)
    es = torch.tensor([], dtype=acc).element_size()
    ub, ends, w1p, fr = _bias_setup(mode, w1, b1, w2, b2, scale, acc, q.device)
    if mode == _BIAS_TABLE:
        tv = table.to(torch.float64)
        e32 = float(torch.finfo(torch.float32).eps)
        tmax, tabs = torch.stack([tv.max(), tv.abs().max()]).tolist()      # one host sync
        ub = tmax + 8.0 * e32 * tabs
        ub = ub + 4 * e32 * abs(ub) + 4 * e32 if math.isfinite(ub) else math.inf
    hidden = w1.shape[0] if mode == _BIAS_EXACT else 0
    K = fr.shape[0] if mode == _BIAS_EXACT else 0
    P = table.shape[0] if mode == _BIAS_TABLE else 0
    m = 0 if ex is None else ex.shape[1]
    reals = (temperature, b2, scale, ub)

    if Q <= _SCAN_MAX_Q and Q * H * es <= _SCAN_SMEM:
        # one pass over the gallery: slices of rows, one warp each, >= 2 CTAs per SM where N allows
        want = max(1, min(_SCAN_CTAS_PER_SM * sms * _SCAN_WARPS, _WS_ENTRIES // (Q * cap)))
        ns, per = _slices(N, want)
        ws_v = torch.empty(Q, ns, cap, dtype=acc, device=q.device)
        ws_i = torch.empty(Q, ns, cap, dtype=torch.int64, device=q.device)
        amat = _amat(u_q, w1p, fr, acc) if mode == _BIAS_EXACT else None
        fr_a = fr.to(acc).contiguous() if mode == _BIAS_EXACT else None
        ints = (dtype_code(q), Q, N, H, k, q.stride(0), g.stride(0), 0, 0, mode, hidden, K, P, m, ns, per, cap)
        ptrs = (ptr(q), ptr(g), 0, ptr(u_q), ptr(u_g), ptr(fr_a), ptr(amat), 0, ptr(b1), ptr(w2), ptr(ends),
                ptr(table), ptr(ex), 0, ptr(ws_v), ptr(ws_i))
        _pass(be, 1, dev, stream, ints, ptrs, reals)
        v, i = _merge([ws_v[:, :, :k].reshape(Q, ns * k)], [ws_i[:, :, :k].reshape(Q, ns * k)], k)
        return _finish(v, i)

    out_v, out_i = [], []
    for a in range(0, Q, _QBLOCK):
        b = min(Q, a + _QBLOCK)
        Qb = b - a
        qa = q[a:b]
        if not qa.is_cuda and qa.dtype != acc:
            qa = qa.to(acc)        # emulator: CPU tensors, float32 products
        chunk = max(_MIN_CHUNK, _BLOCK_BYTES // (Qb * es))
        if q.is_cuda:               # leave room: at most a quarter of the free memory per score block
            free = torch.cuda.mem_get_info(q.device)[0]
            chunk = max(_MIN_CHUNK, min(chunk, free // 4 // (Qb * es)))
        chunk = min(N, chunk)
        want = max(1, -(-_SEL_CTAS_PER_SM * sms * _SEL_WARPS // Qb))  # >= 16 CTAs per SM
        uq_b = None if u_q is None else u_q[a:b]
        ex_b = None if ex is None else ex[a:b]
        amat = _amat(uq_b, w1p, fr, acc) if mode == _BIAS_EXACT else None
        best_v = torch.full((Qb, k), -math.inf, dtype=acc, device=q.device)
        best_i = torch.full((Qb, k), torch.iinfo(torch.int64).max, dtype=torch.int64, device=q.device)
        seed = None
        for c0 in range(0, N, chunk):
            c1 = min(N, c0 + chunk)
            C = c1 - c0
            s = _score_block(qa, g[c0:c1], acc)
            ns, per = _slices(C, want)
            ws_v = torch.empty(Qb, ns, cap, dtype=acc, device=q.device)
            ws_i = torch.empty(Qb, ns, cap, dtype=torch.int64, device=q.device)
            ug_c = None if u_g is None else u_g[c0:c1]
            feats = _feats(ug_c, fr, acc) if mode == _BIAS_EXACT else None
            ints = (dtype_code(s), Qb, C, H, k, 0, 0, s.stride(0), c0, mode, hidden, K, P, m, ns, per, cap)
            ptrs = (0, 0, ptr(s), ptr(uq_b), ptr(ug_c), 0, ptr(amat), ptr(feats), ptr(b1), ptr(w2), ptr(ends),
                    ptr(table), ptr(ex_b), ptr(seed), ptr(ws_v), ptr(ws_i))
            _pass(be, 0, dev, stream, ints, ptrs, reals)
            best_v, best_i = _merge([best_v, ws_v[:, :, :k].reshape(Qb, ns * k)],
                                    [best_i, ws_i[:, :, :k].reshape(Qb, ns * k)], k)
            seed = best_v[:, k - 1].contiguous()   # the running k-th score: later pairs must beat it
        out_v.append(best_v)
        out_i.append(best_i)
    return _finish(torch.cat(out_v), torch.cat(out_i))


def _host_scalar(value: float, t: Optional[torch.Tensor]) -> float:
    return value if t is None else float(t.reshape(()).item())   # a host sync where t is on a GPU


def _serve_qm(Q: int) -> int:
    return 1 if Q == 1 else 4 if Q <= 4 else 16


def _serve_smem(Q: int, H: int, dtype: torch.dtype) -> int:
    es = torch.tensor([], dtype=dtype).element_size()
    vw = 16 // es
    qm = _serve_qm(Q)
    acc_es = 8 if dtype == torch.float64 else 4
    return qm * (-(-H // vw) * vw) * es + _SERVE_WARPS * 32 * (qm + 1) * acc_es


class _TopkCall:
    """A ctd_topk call as the dispatch table sees it (tempokern/_ops/dispatch.py: serve takes 1 to _SERVE_MAX_Q
    queries whose tile fits serve_scan's shared memory)."""
    __slots__ = ("q", "k", "rerank", "queries")

    def __init__(self, q: torch.Tensor, k: int, rerank: bool):
        self.q, self.k, self.rerank, self.queries = q, k, rerank, q.shape[0]

    def serve_fits(self) -> bool:
        Q, H = self.q.shape
        return Q <= min(_SERVE_MAX_Q, _SERVE_KERNEL_MAX_Q) and _serve_smem(Q, H, self.q.dtype) <= _SERVE_SMEM


def _dev_scalar(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().reshape(1).to(torch.float64)


def _serve_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, b2_t, scale_t, table, ex, be=None):
    """Q <= 16: [prep], one scan of the gallery, two merges; allocations only, no host sync."""
    Q, H = q.shape
    N = g.shape[0]
    acc = acc_dtype(q.dtype)
    be = backend.resolve(q) if be is None else be
    dev, stream = be.launch
    sms = be.sm_count
    cap = _pow2(k + 32)
    want = max(1, min(_SERVE_CTAS_PER_SM * sms * _SERVE_WARPS, _WS_ENTRIES // (Q * cap)))
    ns, per = _slices(N, want)
    lpc = max(1, _MERGE_ENTRIES // k)
    groups = -(-ns // lpc)
    dv = q.device
    ws_v = torch.empty(Q, ns, cap, dtype=acc, device=dv)
    ws_i = torch.empty(Q, ns, cap, dtype=torch.int64, device=dv)
    mid_v = torch.empty(Q, groups, k, dtype=acc, device=dv) if groups > 1 else None
    mid_i = torch.empty(Q, groups, k, dtype=torch.int64, device=dv) if groups > 1 else None
    out_v = torch.empty(Q, k, dtype=acc, device=dv)
    out_i = torch.empty(Q, k, dtype=torch.int64, device=dv)
    hidden = D = K = 0
    fr = aux = amat = None
    if mode == _BIAS_EXACT:
        hidden, D = w1.shape
        K = max(1, D // 2)
        fr = _freqs(D, acc, dv)  # cached per device by reference.bias_frequencies: no copy, no sync
        aux = torch.empty(_BOUND_SAMPLES + 2 * hidden, dtype=torch.float64, device=dv)
        amat = torch.empty(Q, hidden, 2 * K, dtype=acc, device=dv)
    b2d, scd = _dev_scalar(b2_t), _dev_scalar(scale_t)
    P = table.shape[0] if mode == _BIAS_TABLE else 0
    m = 0 if ex is None else ex.shape[1]
    ints = (dtype_code(q), Q, N, H, k, q.stride(0), g.stride(0), mode, hidden, D, K, P, m, ns, per, cap, lpc, groups)
    ptrs = (ptr(q), ptr(g), ptr(u_q), ptr(u_g), ptr(w1), ptr(b1), ptr(w2), ptr(fr), ptr(table), ptr(ex), ptr(b2d),
            ptr(scd), ptr(aux), ptr(amat), ptr(ws_v), ptr(ws_i), ptr(mid_v), ptr(mid_i), ptr(out_v), ptr(out_i))
    be.kernels.ctd_topk_cuda_serve(dev, stream, [int(x) for x in ints], [int(x) for x in ptrs],
                                  [float(temperature), float(b2), float(scale)])
    return out_v, out_i


def _finish(v, i):
    i = i.masked_fill(v == -math.inf, -1)
    return v.contiguous(), i.contiguous()


@_ctd_topk.register_fake
def _(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, exclude, cand=None, b2_t=None,
      scale_t=None):
    acc = acc_dtype(q.dtype)
    return q.new_empty(q.shape[0], k, dtype=acc), q.new_empty(q.shape[0], k, dtype=torch.int64)


def _pow2(k: int) -> int:
    return 1 << max(0, (k - 1).bit_length())


def _vector(name: str, t, n: int, expect: str) -> torch.Tensor:
    check_tensor(name, t, floating=True)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) ({expect}), got {tuple(t.shape)}")
    return t


def parse_bias(bias, Q: int, N: int, acc: torch.dtype, device, keep_device_scalars: bool = False):
    """Validates a bias argument; returns (mode, u_q, u_g, w1, b1, w2, b2, scale, table) with
    tensors contiguous in the accumulation dtype (table: float32) on `device`. b2 / scale are floats, or with
    keep_device_scalars the given one-element tensors (not read on the host: no sync)."""
    none = (_BIAS_NONE, None, None, None, None, None, 0.0, 0.0, None)
    if bias is None:
        return none
    forms = ("bias must be None, (u_q, u_g, w1, b1, w2, b2, scale), (u_q, u_g, table) or (u_q, u_g, module) "
             "with module a tempokern.nn.OffsetBias")
    if isinstance(bias, torch.nn.Module):
        raise TypeError(f"{forms}; got the module alone: pass bias=(u_q, u_g, module)")
    if not isinstance(bias, (tuple, list)) or len(bias) not in (3, 7):
        raise TypeError(f"{forms}, got {type(bias).__name__}"
                        + (f" of length {len(bias)}" if isinstance(bias, (tuple, list)) else ""))
    if len(bias) == 3 and isinstance(bias[2], torch.nn.Module):
        if not (hasattr(bias[2], "mlp") and hasattr(bias[2], "scale")):
            raise TypeError(f"{forms}; got a 3-tuple whose third item is a {type(bias[2]).__name__} module")
        bias = (bias[0], bias[1], *bias_params(bias[2]))
    u_q = _vector("bias u_q", bias[0], Q, "one calendar position per query")
    u_g = _vector("bias u_g", bias[1], N, "one calendar position per gallery row")
    devs = {"q": device, "bias u_q": u_q.device, "bias u_g": u_g.device}
    if len(bias) == 3:
        values = table_values(bias[2])
        check_tensor("bias table values", values, ndim=1, floating=True)
        if values.shape[0] < 2:
            raise ValueError(f"bias table must hold at least 2 points, got {values.shape[0]}")
        devs["bias table"] = values.device
        _same(devs)
        check_finite("bias table", values)
        check_finite("bias u_q", u_q)
        check_finite("bias u_g", u_g)
        return (_BIAS_TABLE, u_q.to(acc).contiguous(), u_g.to(acc).contiguous(), None, None, None, 0.0, 0.0,
                values.to(torch.float32).contiguous())
    w1, b1, w2, b2, scale = bias[2:]
    check_tensor("bias w1", w1, ndim=2, floating=True)
    hidden, D = w1.shape
    if hidden < 1 or D < 1:
        raise ValueError(f"bias w1 must be (hidden, D) with both >= 1, got {tuple(w1.shape)}")
    b1 = _vector("bias b1", b1, hidden, "hidden = w1.shape[0]")
    check_tensor("bias w2", w2, floating=True)
    if w2.numel() != hidden or w2.dim() > 2 or (w2.dim() == 2 and w2.shape[0] != 1):
        raise ValueError(f"bias w2 must have shape (1, {hidden}) matching w1, got {tuple(w2.shape)}")
    b2v = _scalar_arg("bias b2", b2, keep_device_scalars)
    sv = _scalar_arg("bias scale", scale, keep_device_scalars)
    for name, t in (("bias w1", w1), ("bias b1", b1), ("bias w2", w2), ("bias b2", b2), ("bias scale", scale)):
        if isinstance(t, torch.Tensor):
            devs[name] = t.device
    _same(devs)
    for name, t in (("bias u_q", u_q), ("bias u_g", u_g), ("bias w1", w1), ("bias b1", b1), ("bias w2", w2),
                    ("bias b2", b2), ("bias scale", scale)):
        if isinstance(t, torch.Tensor):
            check_finite(name, t)
    cv = lambda t: t.detach().to(acc).contiguous()  # noqa: E731
    return (_BIAS_EXACT, cv(u_q), cv(u_g), cv(w1), cv(b1), cv(w2.reshape(-1)), b2v, sv, None)


def _scalar_arg(name: str, value, keep_tensor: bool):
    if keep_tensor and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one value, got a tensor of shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number, got a {value.dtype} tensor")
        return value
    return scalar_value(name, value)


def _same(devs: dict) -> None:
    first = next(iter(devs.values()))
    if any(d != first for d in devs.values()):
        raise ValueError("all tensors must be on one device, got " + ", ".join(f"{k} on {v}" for k, v in devs.items()))


def check_temperature(temperature, acc: torch.dtype) -> float:
    """A finite temperature > 0 whose reciprocal the accumulation dtype can hold (scores are s / T)."""
    return check_reciprocal("temperature", temperature, acc)


def prepare_exclude(exclude, Q: int, device, N: Optional[int] = None) -> Optional[torch.Tensor]:
    if exclude is None:
        return None
    check_tensor("exclude", exclude, ndim=2, integer=True)
    if exclude.shape[0] != Q:
        raise ValueError(f"exclude must have shape (Q={Q}, m), got {tuple(exclude.shape)}")
    if exclude.device != device:
        raise ValueError(f"exclude must be on {device} like q, got {exclude.device}")
    if exclude.shape[1] == 0:
        return None
    if bool((exclude < -1).any()):
        raise ValueError("exclude holds gallery row indices or -1 as padding; found a value < -1")
    if N is not None and bool((exclude >= N).any()):
        raise IndexError(f"exclude holds gallery row indices, which must be < N={N}; found "
                         f"{int(exclude.max())}")
    return exclude.to(torch.int64).sort(dim=1).values.contiguous()


def ctd_topk(q: torch.Tensor, g: torch.Tensor, k: int, *, temperature: float = 1.0, bias=None,
             exclude: Optional[torch.Tensor] = None, q_group: Optional[torch.Tensor] = None,
             g_group: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of ``s = q @ g.T / temperature + bias`` per query, streaming the gallery.

    q (Q, H), g (N, H): float32/float16/bfloat16/float64, same dtype and device.
    bias: None; ``(u_q, u_g, w1, b1, w2, b2, scale)`` (the exact offset bias, as
    :func:`tempokern.offset_bias`); or ``(u_q, u_g, table)`` with ``table = OffsetBias.table(...)``
    (linear interpolation over delta = clamp(u_g - u_q, -1, 1)).
    exclude: optional (Q, m) integer gallery row indices to skip per query, -1 = padding.
    Returns (values (Q, k) float32 [float64 for float64 input], indices (Q, k) int64), sorted by
    score descending with ties broken by the lower gallery index. If fewer than k rows remain
    after exclusion, the tail is (-inf, -1). Memory is O(Q k + Q H), never O(Q N).
    q_group (Q,), g_group (N,): optional integer group ids, both or neither: query i ranks only the gallery rows
    with g_group[j] == q_group[i] (for example the page or entity a question names); rows of other groups get
    no slot, as excluded ones. Runs the same kernels once per distinct query group on that group's gallery rows
    (gathered, in gallery order, so ties still go to the lower gallery index): one call per group, memory
    O(N H) for the gathered rows at most."""
    check_tensor("q", q, ndim=2, floating=True)
    check_tensor("g", g, ndim=2, floating=True)
    if q.dtype != g.dtype:
        raise TypeError(f"q and g must have the same dtype, got q {q.dtype} and g {g.dtype}")
    if q.shape[1] != g.shape[1]:
        raise ValueError(f"q and g must have the same embedding size H, got q {tuple(q.shape)} and g {tuple(g.shape)}")
    if q.shape[1] < 1:
        raise ValueError("embedding size H must be >= 1")
    check_same_device(q=q, g=g)
    if isinstance(k, bool) or not hasattr(k, "__index__") or isinstance(k, torch.Tensor) and k.numel() != 1:
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    k = operator.index(k)
    N = g.shape[0]
    if N < 1:
        raise ValueError("g must hold at least one gallery row")
    if k <= 0:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > N:
        raise ValueError(f"k must be <= the gallery size N={N}, got {k}")
    Q = q.shape[0]
    acc = acc_dtype(q.dtype)
    temperature = check_temperature(temperature, acc)
    cuda_path = backend.resolve(q).cuda_path
    # meta tensors: b2 / scale stay tensors (their values cannot be read; the fake implementation runs)
    mode, u_q, u_g, w1, b1, w2, b2, scale, table = parse_bias(bias, Q, N, acc, q.device,
                                                              keep_device_scalars=cuda_path or q.is_meta)
    ex = prepare_exclude(exclude, Q, q.device, N)
    check_finite("q", q)
    check_finite("g", g)
    if q_group is not None or g_group is not None:
        return _grouped_topk(q, g, k, temperature, bias, ex, *_check_topk_groups(q_group, g_group, Q, N, q.device))
    q, g = rows_contiguous(q), rows_contiguous(g)
    b2_t = b2 if isinstance(b2, torch.Tensor) else None
    scale_t = scale if isinstance(scale, torch.Tensor) else None
    if cuda_path and _cuda_unsupported(k, mode, w1):
        b2, scale = (scalar_value("bias b2", b2), scalar_value("bias scale", scale)) if mode == _BIAS_EXACT else (b2, scale)
        return _chunked_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, ex)
    b2f = 0.0 if b2_t is not None else b2
    scf = 0.0 if scale_t is not None else scale
    return torch.ops.tempokern.ctd_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2f, scf, table, ex, None,
                                        _dev_scalar(b2_t), _dev_scalar(scale_t))


def _check_topk_groups(q_group, g_group, Q: int, N: int, device):
    if q_group is None or g_group is None:
        given, missing = ("q_group", "g_group") if g_group is None else ("g_group", "q_group")
        raise ValueError(f"{given} was given without {missing}: pass both (one group id per query and per gallery "
                         "row) or neither")
    for name, t, n in (("q_group", q_group, Q), ("g_group", g_group, N)):
        check_tensor(name, t, ndim=1, integer=True)
        if t.shape[0] != n:
            raise ValueError(f"{name} has length {t.shape[0]}, expected {n} (one group id per row)")
        if t.device != device:
            raise ValueError(f"{name} must be on {device} like q, got {t.device}")
        if t.is_meta:
            raise ValueError(f"{name}: the group filter reads the group ids, which meta tensors do not have")
    return q_group.to(torch.int64), g_group.to(torch.int64)


def _grouped_topk(q, g, k, temperature, bias, ex, q_group, g_group):
    """ctd_topk with the group filter: per distinct query group, the unfiltered op on that group's gallery rows
    (exclude lists mapped to them), the indices mapped back; a group without gallery rows keeps (-inf, -1)."""
    Q, acc = q.shape[0], acc_dtype(q.dtype)
    values = torch.full((Q, k), float("-inf"), dtype=acc, device=q.device)
    indices = torch.full((Q, k), -1, dtype=torch.int64, device=q.device)
    where = torch.full((g.shape[0],), -1, dtype=torch.int64, device=q.device)
    for grp in torch.unique(q_group).tolist():
        qi = torch.nonzero(q_group == grp).flatten()
        gi = torch.nonzero(g_group == grp).flatten()
        if gi.numel() == 0:
            continue
        where[gi] = torch.arange(gi.numel(), device=q.device)
        sub_bias = None if bias is None else (bias[0][qi], bias[1][gi], *bias[2:])
        sub_ex = None
        if ex is not None:
            e = ex[qi]
            sub_ex = torch.where(e >= 0, where[e.clamp_min(0)], torch.full_like(e, -1))
        kk = min(k, gi.numel())
        v, i = ctd_topk(q[qi], g[gi], kk, temperature=temperature, bias=sub_bias, exclude=sub_ex)
        values[qi, :kk] = v.to(acc)
        indices[qi, :kk] = torch.where(i >= 0, gi[i.clamp_min(0)], torch.full_like(i, -1))
        where[gi] = -1
    return values, indices


def _cuda_unsupported(k: int, mode: int, w1) -> bool:
    if k > _CUDA_MAX_K:
        return True
    return mode == _BIAS_EXACT and 2 * max(1, w1.shape[1] // 2) > _CUDA_MAX_K2


def _chunked_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, ex):
    """Gallery-chunked torch path (CUDA with k > _CUDA_MAX_K or an MLP with 2K > 64): O(Q (k + chunk))
    memory; the bias comes from the fused offset_bias / offset_bias_lookup ops."""
    acc = acc_dtype(q.dtype)
    Q, N = q.shape[0], g.shape[0]
    width = w1.shape[0] + w1.shape[1] if mode == _BIAS_EXACT else 1
    chunk = max(256, min(65536, (1 << 26) // max(1, Q * width)))
    best_v = torch.full((Q, 0), float("-inf"), dtype=acc, device=q.device)
    best_i = torch.empty(Q, 0, dtype=torch.int64, device=q.device)
    for c0 in range(0, N, chunk):
        c1 = min(N, c0 + chunk)
        s = (q.to(acc) @ g[c0:c1].to(acc).t()) / temperature
        if mode == _BIAS_EXACT:
            s = s + offset_bias(u_q, u_g[c0:c1], w1, b1, w2.reshape(1, -1),
                                torch.tensor([b2], dtype=acc, device=q.device),
                                torch.tensor(scale, dtype=acc, device=q.device)).to(acc)
        elif mode == _BIAS_TABLE:
            s = s + offset_bias_lookup(u_q, u_g[c0:c1], table).to(acc)
        idx = torch.arange(c0, c1, device=q.device).expand(Q, -1)
        if ex is not None:
            sel = (ex >= c0) & (ex < c1)
            rows = torch.arange(Q, device=q.device)[:, None].expand_as(ex)
            s[rows[sel], ex[sel] - c0] = float("-inf")
        # candidates stay ordered by index within equal scores: old (lower) ids first, stable sort
        v = torch.cat([best_v, s], 1)
        i = torch.cat([best_i, idx], 1)
        o = torch.sort(v, dim=1, descending=True, stable=True).indices[:, :k]
        best_v, best_i = v.gather(1, o), i.gather(1, o)
    best_i = best_i.masked_fill(best_v == float("-inf"), -1)
    return best_v.contiguous(), best_i.contiguous()


def ctd_rerank(q: torch.Tensor, g: torch.Tensor, cand: torch.Tensor, k: int, *, temperature: float = 1.0,
               bias=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """CPU: like :func:`ctd_topk`, but query i scores only the gallery rows ``cand[i]`` ((Q, C) int64,
    -1 = no candidate; duplicates counted once). Slots beyond the valid candidates are (-inf, -1).
    Used by :class:`tempokern.search.TemporalIndex` to rerank a faiss first stage."""
    check_tensor("q", q, ndim=2, floating=True)
    check_tensor("g", g, ndim=2, floating=True)
    check_tensor("cand", cand, ndim=2, integer=True)
    if q.dtype != g.dtype or q.shape[1] != g.shape[1]:
        raise ValueError("q and g must share dtype and embedding size")
    if cand.shape[0] != q.shape[0]:
        raise ValueError(f"cand must have shape (Q={q.shape[0]}, C), got {tuple(cand.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if q.device.type != "cpu" or g.device.type != "cpu" or cand.device.type != "cpu":
        raise ValueError("ctd_rerank runs on CPU tensors")
    acc = acc_dtype(q.dtype)
    temperature = check_temperature(temperature, acc)
    mode, u_q, u_g, w1, b1, w2, b2, scale, table = parse_bias(bias, q.shape[0], g.shape[0], acc, q.device)
    if cand.numel() and bool((cand >= g.shape[0]).any()):
        raise IndexError(f"cand holds gallery row indices (negative: no candidate), which must be < "
                         f"N={g.shape[0]}; found {int(cand.max())}")
    big = torch.iinfo(torch.int64).max
    c = cand.to(torch.int64)
    c = torch.where(c < 0, torch.full_like(c, big), c).sort(dim=1).values   # ascending: ties -> lower row
    c = torch.where(c == big, torch.full_like(c, -1), c).contiguous()
    q, g = rows_contiguous(q), rows_contiguous(g)
    return torch.ops.tempokern.ctd_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, None, c)
