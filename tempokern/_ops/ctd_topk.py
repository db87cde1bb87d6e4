"""Fused CTD top-k: s_ij = q_i . g_j / temperature + bias_ij, exact top-k per query without
ever holding the (Q, N) score matrix. See :func:`tempokern.reference.ctd_topk` for the spec."""
from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch

from ..reference.ctd_topk import table_values
from ..reference.offset_bias import bias_frequencies
from .common import (check_finite, check_positive, check_same_device, check_tensor, dtype_code,
                     kernels, launch_args, on_cuda_path, ptr, rows_contiguous, scalar_value, sm_count)

_BIAS_NONE, _BIAS_EXACT, _BIAS_TABLE = 0, 1, 2
# CUDA kernel limits (csrc/ctd_topk/ctd_topk_cuda.cu); beyond them a chunked torch path runs.
_CUDA_MAX_K = 256
_CUDA_MAX_BIAS_MAT = 4096   # 2K * hidden floats of the per-query first-layer matrix in shared memory
_CUDA_MERGE = 2048          # nsplit * k candidates merged per query
_CPU_QBLOCK = 2048          # queries per CPU launch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _freqs(D: int, dtype: torch.dtype, device) -> torch.Tensor:
    return bias_frequencies(D, dtype, device).contiguous()  # exactly the reference's frequencies


def _cuda_nsplit(Q: int, N: int, k: int, device) -> int:
    sms = sm_count(device)
    qblocks = max(1, (Q + 63) // 64)
    want = max(1, (2 * sms + qblocks - 1) // qblocks)       # about two blocks per SM
    kpad = 1 << max(0, (k - 1).bit_length())
    return int(max(1, min(want, _CUDA_MERGE // kpad, (N + 127) // 128)))


@torch.library.custom_op("tempokern::ctd_topk", mutates_args=())
def _ctd_topk(q: torch.Tensor, g: torch.Tensor, k: int, temperature: float, mode: int,
              u_q: Optional[torch.Tensor], u_g: Optional[torch.Tensor], w1: Optional[torch.Tensor],
              b1: Optional[torch.Tensor], w2: Optional[torch.Tensor], b2: float, scale: float,
              table: Optional[torch.Tensor], exclude: Optional[torch.Tensor],
              cand: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    Q, H = q.shape
    N = g.shape[0]
    acc = _acc_dtype(q.dtype)
    values = torch.empty(Q, k, dtype=acc, device=q.device)
    indices = torch.empty(Q, k, dtype=torch.int64, device=q.device)
    if Q == 0:
        return values, indices
    dev, stream = launch_args(q) if cand is None else (-1, 0)  # rerank: CPU only (checked by ctd_rerank)
    hidden = D = K = 0
    freqs = None
    if mode == _BIAS_EXACT:
        hidden, D = w1.shape
        K = max(1, D // 2)
        freqs = _freqs(D, acc, q.device)
    ws_v = ws_i = ws_b = ends = None
    nsplit, cap = 1, 0
    if dev >= 0 and cand is not None:
        raise ValueError("candidate rerank runs on CPU tensors only")
    if dev >= 0:
        nsplit = _cuda_nsplit(Q, N, k, q.device)
        cap = _pow2(k + 32)
        ws_v = torch.empty(Q, nsplit, cap, dtype=acc, device=q.device)
        ws_i = torch.empty(Q, nsplit, cap, dtype=torch.int64, device=q.device)
        if mode == _BIAS_EXACT:
            from ..reference.ctd_topk import offset_bias
            ws_b = torch.empty(Q, 2 * K, hidden, dtype=acc, device=q.device)
            ends = offset_bias(torch.zeros(1, dtype=acc, device=q.device),
                               torch.tensor([1.0, -1.0], dtype=acc, device=q.device), w1, b1, w2.reshape(1, -1),
                               torch.tensor([b2], dtype=acc, device=q.device),
                               torch.tensor(scale, dtype=acc, device=q.device)).reshape(2).to(acc).contiguous()
    # CPU: query blocks bound the per-thread candidate buffers and the per-query bias matrices
    step = _CPU_QBLOCK if dev < 0 else Q
    sl = lambda t, a, b: None if t is None else t[a:b]  # noqa: E731
    for a in range(0, Q, step):
        b = min(Q, a + step)
        qa, ea, ca = q[a:b], sl(exclude, a, b), sl(cand, a, b)
        kernels().ctd_topk_launch(
            dev, stream, dtype_code(q), (b - a, N, H, k, q.stride(0), g.stride(0)), ptr(qa), ptr(g),
            float(temperature), mode, ptr(sl(u_q, a, b)), ptr(u_g),
            (hidden, D, K, ptr(freqs), ptr(w1), ptr(b1), ptr(w2), float(b2), float(scale)),
            ptr(table), 0 if table is None else table.shape[0], ptr(ea), 0 if ea is None else ea.shape[1],
            ptr(ca), 0 if ca is None else ca.shape[1], ptr(values[a:b]), ptr(indices[a:b]), ptr(ws_v), ptr(ws_i),
            nsplit, cap, ptr(ws_b), ptr(ends))
    return values, indices


@_ctd_topk.register_fake
def _(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, exclude, cand=None):
    acc = _acc_dtype(q.dtype)
    return q.new_empty(q.shape[0], k, dtype=acc), q.new_empty(q.shape[0], k, dtype=torch.int64)


def _pow2(k: int) -> int:
    return 1 << max(0, (k - 1).bit_length())


def _vector(name: str, t, n: int, expect: str) -> torch.Tensor:
    check_tensor(name, t, floating=True)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) ({expect}), got {tuple(t.shape)}")
    return t


def parse_bias(bias, Q: int, N: int, acc: torch.dtype, device):
    """Validates a bias argument; returns (mode, u_q, u_g, w1, b1, w2, b2, scale, table) with
    tensors contiguous in the accumulation dtype (table: float32) on `device`."""
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
        from ..nn.offset_bias import bias_params  # the exact bias of the module's current weights
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
    b2v = scalar_value("bias b2", b2)
    sv = scalar_value("bias scale", scale)
    for name, t in (("bias w1", w1), ("bias b1", b1), ("bias w2", w2), ("bias b2", b2), ("bias scale", scale)):
        if isinstance(t, torch.Tensor):
            devs[name] = t.device
    _same(devs)
    cv = lambda t: t.detach().to(acc).contiguous()  # noqa: E731
    return (_BIAS_EXACT, cv(u_q), cv(u_g), cv(w1), cv(b1), cv(w2.reshape(-1)), b2v, sv, None)


def _same(devs: dict) -> None:
    first = next(iter(devs.values()))
    if any(d != first for d in devs.values()):
        raise ValueError("all tensors must be on one device, got " + ", ".join(f"{k} on {v}" for k, v in devs.items()))


def prepare_exclude(exclude, Q: int, device) -> Optional[torch.Tensor]:
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
    return exclude.to(torch.int64).sort(dim=1).values.contiguous()


def ctd_topk(q: torch.Tensor, g: torch.Tensor, k: int, *, temperature: float = 1.0, bias=None,
             exclude: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of ``s = q @ g.T / temperature + bias`` per query, streaming the gallery.

    q (Q, H), g (N, H): float32/float16/bfloat16/float64, same dtype and device.
    bias: None; ``(u_q, u_g, w1, b1, w2, b2, scale)`` (the exact offset bias, as
    :func:`tempokern.offset_bias`); or ``(u_q, u_g, table)`` with ``table = OffsetBias.table(...)``
    (linear interpolation over delta = clamp(u_g - u_q, -1, 1)).
    exclude: optional (Q, m) integer gallery row indices to skip per query, -1 = padding.
    Returns (values (Q, k) float32 [float64 for float64 input], indices (Q, k) int64), sorted by
    score descending with ties broken by the lower gallery index. If fewer than k rows remain
    after exclusion, the tail is (-inf, -1). Memory is O(Q k + Q H), never O(Q N)."""
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
    temperature = check_positive("temperature", temperature)
    Q = q.shape[0]
    acc = _acc_dtype(q.dtype)
    mode, u_q, u_g, w1, b1, w2, b2, scale, table = parse_bias(bias, Q, N, acc, q.device)
    ex = prepare_exclude(exclude, Q, q.device)
    check_finite("q", q)
    check_finite("g", g)
    q, g = rows_contiguous(q), rows_contiguous(g)
    if on_cuda_path(q) and _cuda_unsupported(k, mode, w1):
        return _chunked_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, ex)
    return torch.ops.tempokern.ctd_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, ex)


def _cuda_unsupported(k: int, mode: int, w1) -> bool:
    if k > _CUDA_MAX_K:
        return True
    if mode == _BIAS_EXACT:
        hidden, D = w1.shape
        K2 = 2 * max(1, D // 2)
        # float64 exact bias would need more shared memory than sm_86/89 give a block
        return K2 > 64 or K2 * hidden > _CUDA_MAX_BIAS_MAT or w1.dtype == torch.float64
    return False


def _chunked_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, ex):
    """Gallery-chunked torch path (CUDA with k > 256 or a very large bias MLP): O(Q (k + chunk)) memory
    (the exact bias's reference holds Q x chunk x hidden, so its chunk shrinks accordingly)."""
    from ..reference.ctd_topk import offset_bias, table_bias
    acc = _acc_dtype(q.dtype)
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
            s = s + table_bias(u_q, u_g[c0:c1], table).to(acc)
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
    temperature = check_positive("temperature", temperature)
    acc = _acc_dtype(q.dtype)
    mode, u_q, u_g, w1, b1, w2, b2, scale, table = parse_bias(bias, q.shape[0], g.shape[0], acc, q.device)
    big = torch.iinfo(torch.int64).max
    c = cand.to(torch.int64)
    c = torch.where(c < 0, torch.full_like(c, big), c).sort(dim=1).values   # ascending: ties -> lower row
    c = torch.where(c == big, torch.full_like(c, -1), c).contiguous()
    q, g = rows_contiguous(q), rows_contiguous(g)
    return torch.ops.tempokern.ctd_topk(q, g, k, temperature, mode, u_q, u_g, w1, b1, w2, b2, scale, table, None, c)
