"""TMRL's losses and modules (Huynh et al., "Efficient Temporal-aware Matryoshka Adaptation for Temporal
Information Retrieval"): the temporal projector and pooling (Eq. 9), the temporal subspace loss (Eq. 10),
the local self-distillation (Eq. 11), the structural (CKA) self-distillation (Eqs. 12-14) and the total
objective (Eq. 15) with the Matryoshka InfoNCE term on ``tempokern.matryoshka_infonce``.

Everything here is plain torch (the costs are O(B*n*t) for L_Temp, O(N*k*m) per level for L_Dist after one
O(N^2*d) teacher top-k, O(N*d*m) or O(N^2*m) per level for L_CKA); the Matryoshka InfoNCE term is the fused op."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .._ops.common import check_positive, check_reciprocal, device_constant, scalar_value
from .._ops.routing import matryoshka_infonce

__all__ = ["TemporalProjector", "temporal_pool", "TemporalSubspaceLoss", "MatryoshkaDistillLoss",
           "MatryoshkaCKALoss", "TMRLLoss"]

_ACTS = {
    "gelu": lambda: nn.GELU(),
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "gelu_fast": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
    "silu": lambda: nn.SiLU(),
    "swish": lambda: nn.SiLU(),
    "tanh": lambda: nn.Tanh(),
}


def _activation(name: str) -> nn.Module:
    """A named activation: torch's for the common names, else transformers' ``ACT2FN`` (every ``hidden_act`` a
    transformers config can name) when transformers is installed."""
    if name in _ACTS:
        return _ACTS[name]()
    try:
        from transformers.activations import ACT2FN
    except ImportError:
        ACT2FN = {}
    if name in ACT2FN:
        return ACT2FN[name]
    raise ValueError(f"act must be one of {sorted(_ACTS)}, a transformers activation name, or a callable, "
                     f"got {name!r}")


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {v}")
    return v


def _nonneg(name: str, v) -> float:
    v = scalar_value(name, v)
    if not (v >= 0) or v == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {v}")
    return v


def _check_dims(dims) -> tuple:
    """Nested prefix sizes: positive ints, unique, any order; returned ascending."""
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
        raise TypeError(f"dims must be a sequence of ints, got {type(dims).__name__}")
    if len(dims) == 0:
        raise ValueError("dims must not be empty")
    for m in dims:
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"dims must hold ints, got {m!r} ({type(m).__name__})")
        if m <= 0:
            raise ValueError(f"dims must be > 0, got {m}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"dims must be unique, got {list(dims)}")
    return tuple(sorted(dims))


def _float_tensor(name: str, t, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def _bool_tensor(name: str, t, shape) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def _check_valid(qc_valid, shape) -> torch.Tensor:
    """A (B, 1+n) validity mask of candidate slots; column 0 (each row's positive) must be True."""
    _bool_tensor("qc_valid", qc_valid, shape)
    if shape[1] and not bool(qc_valid[:, 0].all()):
        raise ValueError("qc_valid[:, 0] must be True: column 0 holds each passage's positive query")
    return qc_valid


def _same_device(**tensors) -> None:
    devs = {k: v.device for k, v in tensors.items() if v is not None}
    if len(set(devs.values())) > 1:
        raise ValueError("all tensors must be on one device, got " + ", ".join(f"{k} on {d}" for k, d in devs.items()))


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half inputs (A6: the similarity statistics are computed in float32 even under autocast),
    float64 for float64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------------
# T5 / A3: projector and pooling


class TemporalProjector(nn.Module):
    """Eq. 9's projector P: R^d -> R^t, "a two-layer feed-forward network that follows the TEM's activation
    and layer-normalisation configuration" (A3): ``P(h) = W2 LN(act(W1 h + b1)) + b2`` with W1: d -> h
    (h = ``proj_hidden``, default d), LN with ``layer_norm_eps``, W2: h -> t (BERT's prediction-head transform
    plus decoder). ``act``: "gelu" (exact erf), "gelu_new" / "gelu_pytorch_tanh" / "gelu_fast" (tanh),
    "relu", "silu" / "swish", "tanh", any other name of transformers' ``ACT2FN`` (when transformers is
    installed), or an ``nn.Module`` / callable (pass a transformers config's ``hidden_act`` and
    ``layer_norm_eps`` to follow the backbone). Trained with LoRA, discarded after
    training (TMRL §A.2)."""

    def __init__(self, hidden_size: int, t: int, *, act: Union[str, Callable] = "gelu",
                 layer_norm_eps: float = 1e-12, proj_hidden: Optional[int] = None):
        super().__init__()
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.t = _positive_int("t", t)
        self.proj_hidden = self.hidden_size if proj_hidden is None else _positive_int("proj_hidden", proj_hidden)
        self.layer_norm_eps = check_positive("layer_norm_eps", layer_norm_eps)
        if isinstance(act, str):
            self.act_name = act
            self.act = _activation(act)
        elif callable(act):
            self.act_name = getattr(act, "__name__", type(act).__name__)
            self.act = act
        else:
            raise TypeError(f"act must be a str or a callable, got {type(act).__name__}")
        self.dense = nn.Linear(self.hidden_size, self.proj_hidden)
        self.norm = nn.LayerNorm(self.proj_hidden, eps=self.layer_norm_eps)
        self.out = nn.Linear(self.proj_hidden, self.t)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, t={self.t}, proj_hidden={self.proj_hidden}, act={self.act_name!r}"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not isinstance(h, torch.Tensor):
            raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
        if h.dim() < 1 or h.shape[-1] != self.hidden_size:
            raise ValueError(f"h must end in hidden_size={self.hidden_size}, got shape {tuple(h.shape)}")
        return self.out(self.norm(self.act(self.dense(h))))


def temporal_pool(token_states: torch.Tensor, temporal_mask: torch.Tensor,
                  projector: Callable[[torch.Tensor], torch.Tensor]):
    """Eq. 9: ``x_T = (1/|T|) sum_{i in T} P(h_i)`` — project, then average (not the projection of the mean;
    with a nonlinear P they differ). Only the temporal tokens are gathered and projected (O(|T| d h) flops).

    token_states (B, L, d), temporal_mask (B, L) bool (from ``tempokern.text.temporal_token_mask``; [CLS] in
    it for CLS-pooling backbones), projector: a ``TemporalProjector`` (any callable (n, d) -> (n, t)).
    Returns ``(x_T (B, t), has (B,) bool)``; rows with no temporal token get zeros and ``has = False``."""
    _float_tensor("token_states", token_states, 3)
    B, L, _ = token_states.shape
    _bool_tensor("temporal_mask", temporal_mask, (B, L))
    _same_device(token_states=token_states, temporal_mask=temporal_mask)
    if not callable(projector):
        raise TypeError(f"projector must be callable (a TemporalProjector), got {type(projector).__name__}")
    rows = temporal_mask.nonzero(as_tuple=True)[0]                 # (n,) row of each temporal token
    proj = projector(token_states[temporal_mask])                 # (n, t)
    if not isinstance(proj, torch.Tensor) or proj.dim() != 2 or proj.shape[0] != rows.shape[0]:
        raise ValueError("projector must map (n, d) token states to an (n, t) tensor")
    count = temporal_mask.sum(dim=1)                              # (B,)
    total = proj.new_zeros((B, proj.shape[1])).index_add(0, rows, proj)
    x_T = total / count.clamp_min(1).to(proj.dtype).unsqueeze(1)
    return x_T, count > 0


# ---------------------------------------------------------------------------------------------------------
# T6 / A4: temporal subspace loss


def _masked_row_mean(loss: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of loss over the kept rows; 0 (times the inputs: graph kept, no NaN) when none is kept."""
    kept = torch.where(keep, loss, torch.zeros_like(loss))
    return kept.sum() / keep.sum().clamp_min(1).to(loss.dtype)


class TemporalSubspaceLoss(nn.Module):
    """Eq. 10, ``L_Temp = L^q_Temp + L^p_Temp`` on the first ``t`` dims, with the A4 masking.

    ``forward(p_emb (B, d), p_T (B, t), p_has (B,) bool, qc_emb (B, 1+n, d), qc_T (B, 1+n, t),
    qc_has (B, 1+n) bool)``: passage embeddings, the passages' pooled projected temporal tokens, the pooled
    embeddings of each passage's positive query (index 0) and n negative queries, and their projected
    temporal tokens. With ``z = sim^(t)(u, v) / tau = cos(u, v[:t]) / tau``:

    * ``L^q``: anchor p_T[i], candidates qc_emb[i, j, :t] (j = 0..n), positive j = 0; rows with
      ``p_has = False`` are dropped.
    * ``L^p``: anchor p_emb[i, :t], candidates qc_T[i, j]; a candidate with ``qc_has = False`` has logit -inf;
      rows whose positive query has no temporal token (``qc_has[i, 0] = False``) are dropped.

    ``qc_valid`` (B, 1+n) bool, optional: which candidate slots are real (False = padding, e.g. the repeats
    that fill a row with fewer than n negative queries); a padded slot's logit is -inf in both directions, so
    a row's loss is the one over its own distinct candidates (a repeated negative would count twice).
    Column 0 must be True. Each term is the mean over its kept rows (0 with the graph kept when none is).
    ``p_has`` / ``qc_has`` / ``qc_valid`` may be None (all True). Computed in float32 with autocast off for
    half inputs (float64 for float64). A row's loss is computed as ``logsumexp_j (z_j - z_0)``, so a group of
    identical candidates gives exactly ``log(1 + n)``."""

    def __init__(self, t: int, temperature: float):
        super().__init__()
        self.t = _positive_int("t", t)
        self.temperature = check_reciprocal("temperature", temperature, torch.float64)  # forward: its dtype

    def extra_repr(self) -> str:
        return f"t={self.t}, temperature={self.temperature}"

    def forward(self, p_emb, p_T, p_has, qc_emb, qc_T, qc_has, qc_valid=None) -> torch.Tensor:
        return self.terms(p_emb, p_T, p_has, qc_emb, qc_T, qc_has, qc_valid)[0]

    def terms(self, p_emb, p_T, p_has, qc_emb, qc_T, qc_has, qc_valid=None):
        """``(L^q + L^p, L^q, L^p)``."""
        t = self.t
        _float_tensor("p_emb", p_emb, 2)
        _float_tensor("p_T", p_T, 2)
        _float_tensor("qc_emb", qc_emb, 3)
        _float_tensor("qc_T", qc_T, 3)
        B, d = p_emb.shape
        if d < t:
            raise ValueError(f"p_emb has {d} dims, fewer than t={t}")
        if tuple(p_T.shape) != (B, t):
            raise ValueError(f"p_T must have shape (B, t) = {(B, t)}, got {tuple(p_T.shape)}")
        if qc_emb.shape[0] != B or qc_emb.shape[2] != d or qc_emb.shape[1] < 1:
            raise ValueError(f"qc_emb must have shape (B, 1+n, d) = ({B}, 1+n, {d}) with 1+n >= 1, "
                             f"got {tuple(qc_emb.shape)}")
        n1 = qc_emb.shape[1]
        if tuple(qc_T.shape) != (B, n1, t):
            raise ValueError(f"qc_T must have shape (B, 1+n, t) = {(B, n1, t)}, got {tuple(qc_T.shape)}")
        p_has = torch.ones(B, dtype=torch.bool, device=p_emb.device) if p_has is None else \
            _bool_tensor("p_has", p_has, (B,))
        qc_has = torch.ones(B, n1, dtype=torch.bool, device=p_emb.device) if qc_has is None else \
            _bool_tensor("qc_has", qc_has, (B, n1))
        if qc_valid is not None:
            _check_valid(qc_valid, (B, n1))
        _same_device(p_emb=p_emb, p_T=p_T, p_has=p_has, qc_emb=qc_emb, qc_T=qc_T, qc_has=qc_has, qc_valid=qc_valid)
        wd = _work_dtype(p_emb)
        with torch.autocast(p_emb.device.type, enabled=False):
            return self._terms(p_emb.to(wd), p_T.to(wd), p_has, qc_emb.to(wd), qc_T.to(wd), qc_has, qc_valid)

    def _terms(self, p_emb, p_T, p_has, qc_emb, qc_T, qc_has, qc_valid=None):
        t, inv_tau = self.t, 1.0 / self.temperature

        # Entries that are masked out never enter the arithmetic (torch.where to zeros: whatever they hold,
        # NaN included, they get an exact 0 gradient); dropped rows stay finite and leave the means.
        # L^q: the passage's projected temporal tokens against the queries' first t dims
        a = F.normalize(torch.where(p_has.unsqueeze(1), p_T, torch.zeros_like(p_T)), dim=-1)      # (B, t)
        c = F.normalize(qc_emb[..., :t], dim=-1)                                                   # (B, 1+n, t)
        z = torch.einsum("bt,bnt->bn", a, c) * inv_tau
        if qc_valid is not None:
            z = z.masked_fill(~qc_valid, float("-inf"))
        loss_q = _masked_row_mean(torch.logsumexp(z - z[:, :1], dim=1), p_has)

        # L^p: the passage's first t dims against the queries' projected temporal tokens
        keep_p = qc_has[:, 0]
        pt = p_emb[:, :t]
        a = F.normalize(torch.where(keep_p.unsqueeze(1), pt, torch.zeros_like(pt)), dim=-1)
        c = F.normalize(torch.where(qc_has.unsqueeze(2), qc_T, torch.zeros_like(qc_T)), dim=-1)
        z = torch.einsum("bt,bnt->bn", a, c) * inv_tau
        cand = qc_has | ~keep_p.unsqueeze(1)          # a dropped row keeps its (zero) logits: finite, unused
        if qc_valid is not None:
            cand = cand & qc_valid
        z = z.masked_fill(~cand, float("-inf"))
        loss_p = _masked_row_mean(torch.logsumexp(z - z[:, :1], dim=1), keep_p)
        return loss_q + loss_p, loss_q, loss_p


# ---------------------------------------------------------------------------------------------------------
# T7 / A5: local self-distillation


def _student_levels(dims: tuple, d: int) -> tuple:
    if dims[-1] > d:
        raise ValueError(f"dims must be <= the embedding size {d}, got {list(dims)}")
    return tuple(m for m in dims if m != d)


def _pair_prefix_cosines(x: torch.Tensor, idx: torch.Tensor, levels: Sequence[int]) -> torch.Tensor:
    """``out[i, j, l] = cos(x[i, :m_l], x[idx[i, j], :m_l])`` for ascending levels m_l, from one gather at the
    largest level: the raw prefix dot products of every level in one batched product with the 0/1 prefix
    matrix ``cum[c, l] = [c < m_l]`` (``raw[i] = x[idx[i]] @ (x[i, :, None] * cum)``), scaled by the inverse
    prefix norms (clamped at 1e-12 like ``F.normalize``). One (N, k, m_L) gather instead of one per level;
    no N x N matrix. Measured 1.8x faster than the per-level gathers at N = 2,560, d = 768, k = 10."""
    M = levels[-1]
    xs = x[:, :M]
    ends = device_constant([int(m) for m in levels], torch.int64, x)  # cached: no host-to-device copy per step
    cum = (torch.arange(M, device=x.device).unsqueeze(1) < ends.unsqueeze(0)).to(x.dtype)  # (M, L)
    raw = torch.bmm(xs[idx], xs.unsqueeze(2) * cum)                                       # (N, k, L)
    rho = torch.rsqrt(((xs * xs) @ cum).clamp_min(1e-24))       # (N, L): 1 / max(||x[:m]||, 1e-12)
    return raw * rho.unsqueeze(1) * rho[idx]


class MatryoshkaDistillLoss(nn.Module):
    """Eq. 11 with the A5 choices: ``L_Dist = sum_{m in dims, m != d} mean_{i, j in N_i}
    |sim^(d)(x_i, x_j) - sim^(m)(x_i, x_j)|``, ``N_i`` = the ``k_eff = min(k, N-1)`` nearest neighbours of
    x_i at full dim (cosine, self excluded), the mean over the N*k_eff pairs per level, summed over levels.
    ``detach_teacher=True`` (default): no gradient through the full-dim similarities.

    ``forward(x (N, d))`` raw embeddings (every embedding encoded in the step). Gather form: the teacher
    top-k runs on the N x N full-dim cosine matrix in row blocks of ``block`` rows (no gradient; memory
    O(block*N)); the student similarities are the N*k_eff gathered prefix cosines per level, all levels from
    one (N, k, max m) gather and one batched product with a 0/1 prefix matrix (no N x N matrix per level).
    N = 1 gives 0 (graph kept). Computed in float32 for half inputs, float64 for float64.

    ``reduction``: ``"mean"`` (default, A5: the mean over the N*k_eff pairs of each level, summed over levels) or
    ``"sum"`` (Eq. 11 literally: the sum over every pair i, j in N_i and every level — N*k_eff times the mean
    form, so its weight beta acts at the paper's scale)."""

    REDUCTIONS = ("mean", "sum")

    def __init__(self, dims: Sequence[int], k: int = 10, detach_teacher: bool = True, block: int = 1024,
                 reduction: str = "mean"):
        super().__init__()
        if reduction not in self.REDUCTIONS:
            raise ValueError(f"reduction must be one of {self.REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction
        self.dims = _check_dims(dims)
        self.k = _positive_int("k", k)
        if not isinstance(detach_teacher, bool):
            raise TypeError(f"detach_teacher must be a bool, got {type(detach_teacher).__name__}")
        self.detach_teacher = detach_teacher
        self.block = _positive_int("block", block)

    def extra_repr(self) -> str:
        return f"dims={self.dims}, k={self.k}, detach_teacher={self.detach_teacher}, reduction={self.reduction!r}"

    @torch.no_grad()
    def neighbours(self, xn: torch.Tensor, k: int):
        """(values (N, k), indices (N, k)) of the k most cosine-similar other rows of the unit rows xn."""
        N = xn.shape[0]
        vals, idx = [], []
        for s in range(0, N, self.block):
            e = min(N, s + self.block)
            sim = xn[s:e] @ xn.t()
            sim[torch.arange(e - s, device=xn.device), torch.arange(s, e, device=xn.device)] = float("-inf")
            v, i = sim.topk(k, dim=1)
            vals.append(v)
            idx.append(i)
        return torch.cat(vals), torch.cat(idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _float_tensor("x", x, 2)
        N, d = x.shape
        students = _student_levels(self.dims, d)
        k = min(self.k, N - 1)
        if k <= 0 or not students:
            return x.sum() * 0.0
        with torch.autocast(x.device.type, enabled=False):
            xw = x.to(_work_dtype(x))
            full = F.normalize(xw, dim=-1)
            tv, idx = self.neighbours(full.detach(), k)                 # (N, k)
            levels = list(students) if self.detach_teacher else list(students) + [d]
            sims = _pair_prefix_cosines(xw, idx, levels)                # (N, k, L)
            teacher = tv if self.detach_teacher else sims[..., -1]
            diff = (teacher.unsqueeze(-1) - sims[..., :len(students)]).abs()
            if self.reduction == "sum":
                return diff.sum()
            return diff.mean(dim=(0, 1)).sum()


# ---------------------------------------------------------------------------------------------------------
# T8 / A6: structural self-distillation (linear CKA)


def _centre(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(dim=0, keepdim=True)


class MatryoshkaCKALoss(nn.Module):
    """Eqs. 12-14 with the A6 choices: ``L_CKA = sum_{m in dims, m != d} (1 - CKA(X^(d), X^(m)))``,
    ``X^(m)`` = the row-normalised prefixes ``normalize(x[:, :m])``, centred over the N rows;
    ``CKA(X, Y) = ||X~^T Y~||_F^2 / (||X~^T X~||_F ||Y~^T Y~||_F)``.

    ``forward(x (N, d))``. ``form``: "feature" (d x m cross-covariances: 2N(d m + m^2) flops per level and
    2N d^2 once), "gram" (N x N Gram matrices: ~2N^2 m per level and 2N^2 d once), or "auto" (default:
    "gram" when N < d, else "feature"); the two are equal in exact arithmetic. Computed in float32 (float64
    for float64 input) with autocast off. A level whose centred prefix (or the full-dim teacher) has no
    variance — N < 2, or identical rows (relative centred energy ``||X~||_F^2 / N <= (64 eps)^2``) — adds 0 (no
    NaN, gradient 0)."""

    FORMS = ("auto", "feature", "gram")

    def __init__(self, dims: Sequence[int], form: str = "auto"):
        super().__init__()
        self.dims = _check_dims(dims)
        if form not in self.FORMS:
            raise ValueError(f"form must be one of {self.FORMS}, got {form!r}")
        self.form = form

    def extra_repr(self) -> str:
        return f"dims={self.dims}, form={self.form!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _float_tensor("x", x, 2)
        N, d = x.shape
        students = _student_levels(self.dims, d)
        if N < 2 or not students:
            return x.sum() * 0.0
        gram = self.form == "gram" or (self.form == "auto" and N < d)
        with torch.autocast(x.device.type, enabled=False):
            xw = x.to(_work_dtype(x))
            tiny = (64 * torch.finfo(xw.dtype).eps) ** 2 * N           # rows have unit norm: ||X||_F^2 = N
            a = _centre(F.normalize(xw, dim=-1))
            a_ok = a.pow(2).sum() > tiny
            if gram:
                ka = a @ a.t()
                aa2 = ka.pow(2).sum()
            else:
                aa2 = (a.t() @ a).pow(2).sum()
            total = xw.new_zeros(())
            for m in students:
                b = _centre(F.normalize(xw[:, :m], dim=-1))
                if gram:
                    kb = b @ b.t()
                    num, bb2 = (ka * kb).sum(), kb.pow(2).sum()
                else:
                    num, bb2 = (a.t() @ b).pow(2).sum(), (b.t() @ b).pow(2).sum()
                ok = a_ok & (b.pow(2).sum() > tiny)
                den2 = (aa2 * bb2).clamp_min(torch.finfo(xw.dtype).tiny)
                cka = torch.where(ok, num * torch.rsqrt(den2), torch.zeros_like(num))
                total = total + torch.where(ok, 1.0 - cka, torch.zeros_like(cka))
        return total


# ---------------------------------------------------------------------------------------------------------
# T9: the objective


class TMRLLoss(nn.Module):
    """Eq. 15: ``L = L_MRL + alpha L_Temp + beta L_Dist + gamma L_CKA``.

    * ``L_MRL``: ``tempokern.matryoshka_infonce(q, p, dims, temperature, weights, extra_neg=neg_p, q_span,
      d_span)`` — query anchors, candidates = the B positives then the hard-negative passages (Tevatron layout,
      A1, one direction, A8).
    * ``L_Temp`` (``TemporalSubspaceLoss(t, temperature)``) with the passages as anchors: needs p_T (and
      p_has), qc (B, 1+n, d) = each passage's positive query (index 0, the row's query) and its negative
      queries, qc_T / qc_has; skipped (0) when ``alpha == 0`` or ``p_T is None``.
    * ``L_Dist`` (``MatryoshkaDistillLoss(dims, k, detach_teacher)``) and ``L_CKA`` (``MatryoshkaCKALoss(dims)``)
      on X = every embedding encoded in the step, each once: ``cat(q, p, neg_p, qc[:, 1:])`` (A5;
      ``qc[:, 0]`` is the row's query, already in q); skipped (0) when beta / gamma is 0.

    ``mrl_anchor="passage"`` (A1's other consistent reading): ``L_MRL`` anchors are the positive passages
    p (B, d); candidates = the B in-batch positive queries ``qc[:, 0]`` (p_i's positive is qc[i, 0], the
    diagonal) followed by every negative query ``qc[:, 1:]`` as hard negatives (``extra_neg``, in the
    denominators of every anchor), through the same fused ``matryoshka_infonce`` (all levels in one pass).
    qc is then required even when alpha == 0; neg_p takes no part in L_MRL (it still joins X of
    L_Dist / L_CKA when given); spans swap roles (anchor spans = d_span, candidate spans = q_span).
    ``qc_valid`` (B, 1+n) bool, optional: which negative-query slots are real (False = padding, e.g. the
    repeats that fill a row with fewer than n negative queries). Padded slots are left out everywhere: of
    L_Temp's candidates (both directions), of the passage-anchored L_MRL's denominators and of X in
    L_Dist / L_CKA — a batch with repeats gives the loss of the same batch without them. Column 0 must be
    True.

    ``aux_scale``: how L_Dist and L_CKA are scaled. ``"mean"`` (default, design notes A5): L_Dist is the mean
    over the N*k_eff neighbour pairs of each level, summed over levels. ``"literal"``: Eq. 11 as printed, the
    sum over every pair and level (N*k_eff times the mean form; at beta = 0.1 it is no longer a small
    fraction of the gradient). L_CKA (Eq. 14, a sum over levels of 1 - CKA) is the same in both.

    ``forward(q, p, neg_p=None, *, p_T=None, p_has=None, qc=None, qc_T=None, qc_has=None, qc_valid=None,
    q_span=None, d_span=None) -> (loss, parts)``; parts: detached tensors "mrl" (the weighted sum), "mrl@<m>"
    per dim (that level's mean InfoNCE, unweighted), "temp", "dist", "cka" (unweighted) and "total" (= loss).
    ``return_terms=True`` adds a third value: the differentiable weighted terms {"mrl", "temp" (alpha L_Temp),
    "dist" (beta L_Dist), "cka" (gamma L_CKA)} (a skipped term is a constant 0), whose sum is the loss.
    ``alpha`` is required (paper: 0.1-0.25); ``beta = gamma = 0.1`` (paper, all experiments)."""

    #: the two readings of A1 (design notes §2.2): which side anchors L_MRL
    MRL_ANCHORS = ("query", "passage")
    #: the scalings of L_Dist / L_CKA: A5's mean over pairs, or Eq. 11's sum as printed
    AUX_SCALES = ("mean", "literal")

    def __init__(self, dims: Sequence[int], t: int, *, alpha: float, beta: float = 0.1, gamma: float = 0.1,
                 temperature: float = 0.05, weights: Optional[Sequence[float]] = None, k: int = 10,
                 detach_teacher: bool = True, mrl_anchor: str = "query", aux_scale: str = "mean"):
        super().__init__()
        if mrl_anchor not in self.MRL_ANCHORS:
            raise ValueError(f"mrl_anchor must be one of {self.MRL_ANCHORS}, got {mrl_anchor!r}")
        if aux_scale not in self.AUX_SCALES:
            raise ValueError(f"aux_scale must be one of {self.AUX_SCALES}, got {aux_scale!r}")
        self.mrl_anchor, self.aux_scale = mrl_anchor, aux_scale
        self.dims = _check_dims(dims)
        if weights is not None:
            if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
                raise TypeError(f"weights must be a sequence of numbers, got {type(weights).__name__}")
            if len(weights) != len(dims):
                raise ValueError(f"weights must have one entry per dim ({len(dims)}), got {len(weights)}")
            wmap = {m: _nonneg("weights", w) for m, w in zip(dims, weights)}
            weights = tuple(wmap[m] for m in self.dims)                # ascending with their dims
        self.weights = weights
        self.t = _positive_int("t", t)
        if self.t > self.dims[-1]:
            raise ValueError(f"t={t} must be <= the largest dim {self.dims[-1]}")
        self.alpha, self.beta, self.gamma = _nonneg("alpha", alpha), _nonneg("beta", beta), _nonneg("gamma", gamma)
        self.temperature = check_reciprocal("temperature", temperature, torch.float64)  # forward: its dtype
        self.temporal = TemporalSubspaceLoss(self.t, self.temperature)
        self.distill = MatryoshkaDistillLoss(self.dims, k=k, detach_teacher=detach_teacher,
                                             reduction="sum" if aux_scale == "literal" else "mean")
        self.cka = MatryoshkaCKALoss(self.dims)

    def extra_repr(self) -> str:
        return (f"dims={self.dims}, t={self.t}, alpha={self.alpha}, beta={self.beta}, gamma={self.gamma}, "
                f"temperature={self.temperature}, weights={self.weights}, mrl_anchor={self.mrl_anchor!r}, "
                f"aux_scale={self.aux_scale!r}")

    def _passage_candidates(self, p, qc, qc_valid):
        """(positive queries (B, d), negative queries (N, d) or None) of the passage-anchored L_MRL."""
        if qc is None:
            raise ValueError("mrl_anchor='passage' needs qc (B, 1+n, d): each passage's positive query (index 0) "
                             "and its negative queries, the candidates of the passage-anchored L_MRL")
        _float_tensor("qc", qc, 3)
        if qc.shape[0] != p.shape[0] or qc.shape[-1] != p.shape[-1] or qc.shape[1] < 1:
            raise ValueError(f"qc must have shape (B={p.shape[0]}, 1+n, d={p.shape[-1]}), got {tuple(qc.shape)}")
        pos = qc[:, 0]
        negs = qc[:, 1:]
        if qc_valid is not None:
            negs = negs[qc_valid[:, 1:]]                 # (N, d), row-major: row 0's negatives first
        negs = negs.reshape(-1, qc.shape[-1])
        return pos, (negs if negs.shape[0] else None)

    def forward(self, q, p, neg_p=None, *, p_T=None, p_has=None, qc=None, qc_T=None, qc_has=None,
                qc_valid=None, q_span=None, d_span=None, return_terms: bool = False):
        _float_tensor("q", q, 2)
        _float_tensor("p", p, 2)
        if neg_p is not None:
            _float_tensor("neg_p", neg_p, 2)
        if qc_valid is not None:
            if qc is None:
                raise ValueError("qc_valid was given without qc")
            _float_tensor("qc", qc, 3)
            _check_valid(qc_valid, tuple(qc.shape[:2]))
            if qc_valid.device != qc.device:
                raise ValueError(f"qc_valid must be on qc's device {qc.device}, got {qc_valid.device}")
        use_temp = self.alpha != 0 and p_T is not None
        if use_temp and (qc is None or qc_T is None):
            raise ValueError("p_T was given (alpha > 0) but qc and qc_T, the passages' positive and negative "
                             "queries and their temporal tokens, are missing")
        w = None if self.weights is None else list(self.weights)
        if self.mrl_anchor == "passage":
            pos_q, neg_q = self._passage_candidates(p, qc, qc_valid)
            mrl, levels = matryoshka_infonce(p, pos_q, list(self.dims), temperature=self.temperature, weights=w,
                                             extra_neg=neg_q, q_span=d_span, d_span=q_span, return_levels=True)
        else:
            mrl, levels = matryoshka_infonce(q, p, list(self.dims), temperature=self.temperature, weights=w,
                                             extra_neg=neg_p, q_span=q_span, d_span=d_span, return_levels=True)
        zero = mrl.detach().new_zeros(())
        loss = mrl
        temp = dist = cka = zero
        if use_temp:
            temp = self.temporal(p, p_T, p_has, qc, qc_T, qc_has, qc_valid)
            loss = loss + self.alpha * temp
        if self.beta != 0 or self.gamma != 0:
            parts = [q, p]
            if neg_p is not None:
                parts.append(neg_p)
            if qc is not None:
                _float_tensor("qc", qc, 3)
                if qc.shape[-1] != q.shape[-1]:
                    raise ValueError(f"qc must end in the embedding size {q.shape[-1]}, got {tuple(qc.shape)}")
                negq = qc[:, 1:] if qc_valid is None else qc[:, 1:][qc_valid[:, 1:]]   # repeats left out
                parts.append(negq.reshape(-1, qc.shape[-1]))
            x = torch.cat([t.to(q.dtype) for t in parts], dim=0)
            if self.beta != 0:
                dist = self.distill(x)
                loss = loss + self.beta * dist
            if self.gamma != 0:
                cka = self.cka(x)
                loss = loss + self.gamma * cka
        out = {"mrl": mrl.detach().float()}
        for m, v in zip(self.dims, levels.detach().float().unbind(0)):
            out[f"mrl@{m}"] = v
        out.update(temp=temp.detach().float(), dist=dist.detach().float(), cka=cka.detach().float(),
                   total=loss.detach().float())
        if return_terms:   # the weighted, differentiable terms (their sum is loss): for gradient diagnostics
            return loss, out, {"mrl": mrl, "temp": self.alpha * temp, "dist": self.beta * dist,
                               "cka": self.gamma * cka}
        return loss, out
