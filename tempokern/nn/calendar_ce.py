"""Training objectives: the retrieval loss (fused CTDLoss, multi-positive or single-positive)
and the calendar cross-entropy on records (label smoothing or neighbour smoothing)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

IGNORE = -1  # a level whose label is unknown for a record (e.g. no month given)


def calendar_ce(logits: Sequence[torch.Tensor], labels: torch.Tensor, *, smoothing: float = 0.2,
                neighbor: bool = False) -> torch.Tensor:
    """Mean over levels of the cross-entropy of level logits (B, n_l) against labels (B, L).

    neighbor=False: uniform label smoothing `smoothing`. neighbor=True: the target keeps
    1 - smoothing and its adjacent classes (c-1, c+1, those that exist) share `smoothing`, as in
    ChunQiuTR's time_ce_loss_with_neighbor_smoothing. Rows labelled IGNORE (-1) are skipped.

    Float labels may be fractional: c + f (0 < f < 1) is the mixture (1 - f) * target(c) + f *
    target(c + 1) (cross-entropy is linear in the target). :func:`record_labels` uses c + 0.5 for an
    intercalary month after month c + 1, so the calendar heads learn a u between the two months
    (chronological order; see docs/models.md)."""
    if labels.ndim != 2 or labels.shape[1] != len(logits):
        raise ValueError(f"labels must be (B, {len(logits)}), got {tuple(labels.shape)}")
    losses = []
    for l, x in enumerate(logits):
        y = labels[:, l]
        keep = y >= 0
        if not bool(keep.any()):
            continue
        x, y = x[keep].float(), y[keep]
        lo = torch.floor(y).long() if y.is_floating_point() else y
        frac = (y - lo).float() if y.is_floating_point() else None
        C = x.shape[1]
        row = _row_ce(x, lo, C, smoothing, neighbor)
        if frac is not None and bool((frac > 0).any()):
            hi = (lo + 1).clamp_max(C - 1)
            row = (1 - frac) * row + frac * _row_ce(x, hi, C, smoothing, neighbor)
        losses.append(row.mean())
    if not losses:
        return logits[0].new_zeros(()).float()
    return torch.stack(losses).mean()


def _row_ce(x: torch.Tensor, y: torch.Tensor, C: int, smoothing: float, neighbor: bool) -> torch.Tensor:
    """Per-row cross-entropy of logits x (B, C) against integer classes y under the smoothing."""
    if not neighbor or smoothing <= 0 or C <= 1:
        return F.cross_entropy(x, y, label_smoothing=smoothing if not neighbor else 0.0, reduction="none")
    target = torch.zeros_like(x)
    rows = torch.arange(x.shape[0], device=x.device)
    left, right = (y - 1) >= 0, (y + 1) < C
    share = smoothing / (left.float() + right.float()).clamp_min(1)
    target[rows, y] = 1.0 - smoothing
    target[rows[left], y[left] - 1] += share[left]
    target[rows[right], y[right] + 1] += share[right]
    # a class with no neighbour (C == 1 handled above) keeps all the mass
    target[rows, y] += torch.where(left | right, torch.zeros_like(share), torch.full_like(share, smoothing))
    return -(target * F.log_softmax(x, dim=-1)).sum(-1)
