"""TimeParserHeads: the paper's learned temporal parser (Re³ §3.2) as CTD-style heads on a pooled vector.

Parallel linear heads give year / month / day-of-month logits from ``h_CLS`` (any (B, H) pooled vector), plus
one presence logit per part. Trained with ``calendar_ce`` (absent parts labelled ``IGNORE = -1``) and a binary
cross-entropy on presence; labels come from generation metadata or from the rule parser. Optional: the rule
parser (:func:`tempokern.text.parse_time`) is the default and the tested path of the encoder.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..text.time import TimeTuple

IGNORE = -1


class TimeParserHeads(nn.Module):
    """``TimeParserHeads(hidden, calendar=None, *, first_year=None, last_year=None)``: year classes
    ``first_year..last_year`` (from a ``Calendar.gregorian`` when given), 12 months, 31 days.

    ``forward(h (B, H)) -> (logits [year (B, n_y), month (B, 12), day (B, 31)], presence (B, 3))``;
    :meth:`labels` turns TimeTuples into ``(labels (B, 3) int64 with IGNORE, present (B, 3) float)``;
    :meth:`loss` = calendar CE + BCE on presence; :meth:`predict` -> TimeTuples (a part is observed when its
    presence probability exceeds ``threshold``; an impossible day is masked)."""

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

    def forward(self, h: torch.Tensor) -> Tuple[List[torch.Tensor], torch.Tensor]:
        if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != self.hidden:
            raise ValueError(f"h must be a (B, {self.hidden}) tensor, got "
                             f"{tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__}")
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
        from ..training.losses import calendar_ce
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
