"""TimeParserHeads: the paper's learned temporal parser (Re³ §3.2) as CTD-style heads on a pooled vector.

Parallel linear heads give year / month / day-of-month logits from ``h_CLS`` (any (B, H) pooled vector), plus
one presence logit per part. Trained with ``calendar_ce`` (absent parts labelled ``IGNORE = -1``) and a binary
cross-entropy on presence; labels come from generation metadata or from the rule parser. Used by
``Re3Encoder(time_parser="learned")`` on the backbone's [CLS] state (fitted by
``tempokern.training.re3.fit_time_parser``); the rule parser is the encoder's default.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..nn.calendar_ce import calendar_ce
from ..text.time import TimeTuple

IGNORE = -1


class TimeParserHeads(nn.Module):
    """``TimeParserHeads(hidden, calendar=None, *, first_year=None, last_year=None)``: year classes
    ``first_year..last_year`` (from a ``Calendar.gregorian`` when given), 12 months, 31 days.

    ``forward(h (B, H)) -> (logits [year (B, n_y), month (B, 12), day (B, 31)], presence (B, 3))``;
    :meth:`labels` turns TimeTuples into ``(labels (B, 3) int64 with IGNORE, present (B, 3) float)``;
    :meth:`loss` = calendar CE + BCE on presence; :meth:`predict` -> TimeTuples (a part is observed when its
    presence probability exceeds ``threshold``; an impossible day is masked). The inputs are standardised
    per feature by buffers that :meth:`set_feature_stats` fits (identity until then)."""

    def __init__(self, hidden: int, calendar=None, *, first_year: Optional[int] = None,
                 last_year: Optional[int] = None):
        super().__init__()
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"hidden must be a positive int, got {hidden!r}")
        if calendar is not None:
            years = [int(y) for y in calendar.levels[0].labels]
            first_year, last_year = min(years), max(years)
        if first_year is None or last_year is None or not first_year <= last_year:
            raise ValueError(f"need calendar= or first_year <= last_year, got {first_year!r}, {last_year!r}")
        self.hidden, self.first_year, self.last_year = hidden, int(first_year), int(last_year)
        self.heads = nn.ModuleList([nn.Linear(hidden, self.last_year - self.first_year + 1), nn.Linear(hidden, 12),
                                    nn.Linear(hidden, 31)])
        self.presence = nn.Linear(hidden, 3)
        # per-feature standardisation of h (identity until set_feature_stats): a frozen backbone's [CLS]
        # states can vary little across texts around a large common offset
        self.register_buffer("h_mean", torch.zeros(hidden))
        self.register_buffer("h_std", torch.ones(hidden))

    @torch.no_grad()
    def set_feature_stats(self, h: torch.Tensor, eps: float = 1e-6) -> "TimeParserHeads":
        """Standardise the inputs by the mean and std (floored at ``eps``) of the training states ``h``
        (buffers, saved with the state dict)."""
        self.h_mean.copy_(h.float().mean(0))
        self.h_std.copy_(h.float().std(0, unbiased=False).clamp_min(eps))
        return self

    def forward(self, h: torch.Tensor) -> Tuple[List[torch.Tensor], torch.Tensor]:
        if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != self.hidden:
            raise ValueError(f"h must be a (B, {self.hidden}) tensor, got "
                             f"{tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__}")
        h = (h - self.h_mean.to(h.dtype)) / self.h_std.to(h.dtype)
        return [head(h) for head in self.heads], self.presence(h)

    def labels(self, times: Sequence[Optional[TimeTuple]], device=None):
        lab, pres = [], []
        for i, t in enumerate(times):
            if t is None:
                t = TimeTuple()
            if not isinstance(t, TimeTuple):
                raise TypeError(f"times[{i}]: expected TimeTuple or None, got {type(t).__name__}")
            vy, vm, vd = t.mask
            y = t.year - self.first_year if vy and self.first_year <= t.year <= self.last_year else IGNORE
            lab.append([y, t.month - 1 if vm else IGNORE, t.day - 1 if vd else IGNORE])
            pres.append([float(vy), float(vm), float(vd)])
        return (torch.tensor(lab, dtype=torch.int64, device=device).reshape(-1, 3),
                torch.tensor(pres, dtype=torch.float32, device=device).reshape(-1, 3))

    def loss(self, h: torch.Tensor, times: Sequence[Optional[TimeTuple]], *, smoothing: float = 0.0,
             presence_weight: float = 1.0) -> torch.Tensor:
        if len(times) != h.shape[0]:
            raise ValueError(f"times: expected {h.shape[0]} entries (one per row of h), got {len(times)}")
        logits, pres = self(h)
        labels, present = self.labels(times, device=h.device)
        ce = calendar_ce(logits, labels, smoothing=smoothing)
        return ce + presence_weight * F.binary_cross_entropy_with_logits(pres.float(), present)

    @torch.no_grad()
    def predict(self, h: torch.Tensor, *, threshold: float = 0.5) -> List[TimeTuple]:
        logits, pres = self(h)
        on = torch.sigmoid(pres.float()) > threshold
        y = logits[0].argmax(1) + self.first_year
        m = logits[1].argmax(1) + 1
        d = logits[2].argmax(1) + 1
        out = []
        for i in range(h.shape[0]):
            vy, vm, vd = on[i].tolist()
            out.append(TimeTuple.partial(int(y[i]) if vy else None, int(m[i]) if vm else None,
                                         int(d[i]) if vd else None))
        return out


__all__ = ["TimeParserHeads", "IGNORE"]
