"""BM25+TimeKDE: the ChunQiuTR paper's temporal-prior baseline.

For each query, a Gaussian kernel density over the time axis (ranks of the calendar's units) is
estimated from the times of the base scorer's top-K documents; every document's score becomes
``s(q, d) + lam * log(p_q(t(d)) + 1e-8)``. Defaults follow the paper's script: K = 200,
sigma = 3 units, kernel half-width max(1, int(3 sigma)), lam = 1."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .bm25 import BM25Scorer

__all__ = ["TimeKDEScorer", "time_kde_prior"]


def time_kde_prior(scores: np.ndarray, doc_times: np.ndarray, num_bins: int, topk: int = 200,
                   sigma: float = 3.0) -> np.ndarray:
    """(D,) prior p_q(t(d)) from one query's base scores; ``doc_times`` are integer time bins
    (-1 = untimed: those get the mean density 1/num_bins)."""
    D = scores.shape[0]
    timed = doc_times >= 0
    k = min(topk, D)
    if k <= 0 or not np.any(scores != 0) or not timed.any():
        return np.full(D, 1.0 / num_bins, dtype=np.float64)
    top = np.argpartition(-scores, k - 1)[:k]
    centers = doc_times[top]
    centers = centers[centers >= 0]
    W = max(1, int(3 * sigma))
    offs = np.arange(-W, W + 1)
    kern = np.exp(-(offs.astype(np.float64) ** 2) / (2.0 * sigma ** 2))
    density = np.zeros(num_bins, dtype=np.float64)
    pos = centers[:, None] + offs[None, :]
    ok = (pos >= 0) & (pos < num_bins)           # the kernel is truncated at the ends of the axis
    np.add.at(density, pos[ok], np.broadcast_to(kern, pos.shape)[ok])
    total = density.sum()
    density = density / total if total > 0 else np.full(num_bins, 1.0 / num_bins)
    out = np.full(D, 1.0 / num_bins, dtype=np.float64)
    out[timed] = density[doc_times[timed]]
    return out


class TimeKDEScorer:
    """``scorer(queries, gallery)``: base scores (default :class:`BM25Scorer`) plus
    ``lam * log(p_q(t(d)) + 1e-8)``. A record's time bin is the middle rank of its interval."""

    def __init__(self, base=None, topk: int = 200, sigma: float = 3.0, lam: float = 1.0,
                 num_bins: Optional[int] = None):
        if topk < 1 or sigma <= 0:
            raise ValueError(f"need topk >= 1 and sigma > 0, got {topk}, {sigma}")
        self.base = base if base is not None else BM25Scorer()
        self.topk, self.sigma, self.lam, self.num_bins = int(topk), float(sigma), float(lam), num_bins

    def __call__(self, queries: Sequence, gallery: Sequence) -> np.ndarray:
        scores = np.asarray(self.base(queries, gallery), dtype=np.float64)
        times = np.asarray([-1 if r.interval is None else (r.interval.start + r.interval.end) // 2
                            for r in gallery], dtype=np.int64)
        nb = self.num_bins or (int(times.max()) + 1 if (times >= 0).any() else 1)
        out = np.empty_like(scores)
        for i in range(scores.shape[0]):
            prior = time_kde_prior(scores[i], times, nb, self.topk, self.sigma)
            out[i] = scores[i] + self.lam * np.log(prior + 1e-8)
        return out.astype(np.float32)
