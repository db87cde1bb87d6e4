"""Re3Loss: Re³'s training objective (Cao et al., ACL 2026, Eqs. 10-13) on the fused multi-positive InfoNCE
kernel. The symmetric InfoNCE and each row's hardest in-batch negative come out of one fused forward
(``multipos_infonce(..., return_hardest=True)``: O(B) extra state, no B x B buffer); the two margins are
O(B * D) torch on top (two row gathers and three row dot products)."""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Tuple

import torch

from .._ops.common import check_reciprocal, check_same_device, check_tensor, compiling, scalar_value
from .._ops.multipos_blocked import none_flags, spans32
from .._ops.routing import multipos_infonce, multipos_infonce_partial
from .ctd_loss import _gather, _sizes


def _check_float(name: str, value, *, positive: bool = False) -> float:
    v = scalar_value(name, value)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and v <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if positive:
        check_reciprocal(name, v, torch.float64)   # the forward checks 1 / v against its own dtype
    if not positive and name.startswith("lambda") and v < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return v


class Re3Loss(torch.nn.Module):
    """L = L_nce + lambda_hard * L_hard + lambda_tw * L_tw (Re³, Eqs. 10-13), fused.

    ``forward(q, d, d_tw=None, doc_ids=None) -> (loss, parts)``: q (B, D) query embeddings, d (B, D) their
    positive documents, d_tw (B, D) each query's time-wrong negative or None, doc_ids (B,) integer ids of
    the documents in d or None (all distinct). Inputs are the final, already L2-normalised embeddings (not
    normalised here), so <q, d> is a cosine.

    * L_nce: the symmetric multi-positive InfoNCE on s = <q_i, d_j> / temperature with spans
      (doc_id, doc_id): row i's positives are the documents equal to its own (``dedup=True``: a document
      twice in a batch is a positive of both rows, not a negative; ``dedup=False``: the pure diagonal).
      ``tw_in_nce=True`` adds d_tw to the q->d denominators (extra negatives).
    * L_hard = (1/B) sum_i relu(margin + <q_i, d_{j*_i}> - <q_i, d_i>), j*_i the in-batch column with the
      largest logit that is not a positive of row i (lowest index among ties; never a time-wrong
      document), from the fused kernel. A row without any negative (B = 1, or every document in the batch
      the same) contributes 0 and still counts in the 1/B (Eq. 11's normalisation: the mean is over all
      rows, so a batch's duplicates do not up-weight the other rows' hinges).
    * L_tw = (1/B) sum_i relu(margin + <q_i, d_tw_i> - <q_i, d_i>); 0 without d_tw. A row whose d_tw equals
      its d gives a constant hinge of ``margin`` (no gradient): warned once per module.

    Margins are in cosine units (design notes B7). parts: "nce", "hard", "tw", "total" (detached 0-d) and
    "hardest_col" ((B,) int64, -1 for a row without negative; with gather, indices into the gathered
    documents). ``gather=True`` with an initialised torch.distributed group: documents (and d_tw when
    ``tw_in_nce``) are all-gathered as in ``CTDLoss(gather=True)``'s "tempokern" mode: this rank's queries
    against all documents and its documents against all queries, each rank's terms weighted by
    W * B_r / T so that the mean over ranks equals the single-process loss on the concatenated batch;
    L_hard's negatives are then all gathered documents."""

    def __init__(self, temperature: float = 0.05, margin: float = 0.1, lambda_hard: float = 0.1,
                 lambda_tw: float = 0.1, tw_in_nce: bool = False, gather: bool = False, dedup: bool = True):
        super().__init__()
        self.temperature = _check_float("temperature", temperature, positive=True)
        self.margin = _check_float("margin", margin)
        self.lambda_hard = _check_float("lambda_hard", lambda_hard)
        self.lambda_tw = _check_float("lambda_tw", lambda_tw)
        for name, v in (("tw_in_nce", tw_in_nce), ("gather", gather), ("dedup", dedup)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
        self.tw_in_nce, self.gather, self.dedup = tw_in_nce, gather, dedup
        self._warned_tw = False

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}, margin={self.margin}, lambda_hard={self.lambda_hard}, "
                f"lambda_tw={self.lambda_tw}, tw_in_nce={self.tw_in_nce}, gather={self.gather}, dedup={self.dedup}")

    def _validate(self, q, d, d_tw, doc_ids):
        check_tensor("q", q, ndim=2, floating=True)
        check_tensor("d", d, ndim=2, floating=True)
        if d.shape != q.shape:
            raise ValueError(f"d must have the shape of q {tuple(q.shape)} (one positive per query), "
                             f"got {tuple(d.shape)}")
        if d.dtype != q.dtype:
            raise TypeError(f"d has dtype {d.dtype}, expected {q.dtype} like q")
        if q.shape[1] < 1:
            raise ValueError("q and d must have an embedding size >= 1")
        if d_tw is not None:
            check_tensor("d_tw", d_tw, ndim=2, floating=True)
            if d_tw.shape != q.shape:
                raise ValueError(f"d_tw must have the shape of q {tuple(q.shape)} (one time-wrong negative per "
                                 f"query), got {tuple(d_tw.shape)}")
            if d_tw.dtype != q.dtype:
                raise TypeError(f"d_tw has dtype {d_tw.dtype}, expected {q.dtype} like q")
        if doc_ids is not None:
            check_tensor("doc_ids", doc_ids, ndim=1, integer=True)
            if doc_ids.shape[0] != q.shape[0]:
                raise ValueError(f"doc_ids has length {doc_ids.shape[0]}, expected {q.shape[0]} (one id per "
                                 "document of d)")
        check_same_device(q=q, d=d, d_tw=d_tw, doc_ids=doc_ids)

    def _ids(self, B: int, doc_ids, device, offset: int = 0) -> torch.Tensor:
        if self.dedup and doc_ids is not None:
            return doc_ids.to(torch.int64)
        return torch.arange(offset, offset + B, dtype=torch.int64, device=device)

    def _warn_tw(self, d, d_tw):
        if self._warned_tw or compiling(False):
            return
        if bool((d_tw == d).all(dim=1).any()):
            self._warned_tw = True
            warnings.warn("Re3Loss: some d_tw rows are identical to their positive d: their time-wrong hinge is "
                          "the constant margin (no gradient); is the time-wrong negative built correctly?",
                          stacklevel=3)

    def forward(self, q: torch.Tensor, d: torch.Tensor, d_tw: Optional[torch.Tensor] = None,
                doc_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        self._validate(q, d, d_tw, doc_ids)
        if d_tw is not None:
            self._warn_tw(d, d_tw)
        dist = torch.distributed
        if self.gather and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return self._gathered(q, d, d_tw, doc_ids)
        B = q.shape[0]
        ids = self._ids(B, doc_ids, q.device)
        extra = d_tw if (self.tw_in_nce and d_tw is not None) else None
        l_nce, hard = multipos_infonce(q, d, (ids, ids), (ids, ids), temperature=self.temperature, extra_neg=extra,
                                       symmetric=True, return_hardest=True)
        s_pos = (q * d).sum(dim=1)
        l_hard, l_tw = self._margins(q, d, d_tw, hard, s_pos, 1.0)
        return self._finish(l_nce, l_hard, l_tw, hard)

    def _margins(self, q, d_cand, d_tw, hard, s_pos, w: float):
        """(L_hard, L_tw) as sum over rows / (B / w): the rank's share when gathered (w = W B_r / T)."""
        B = q.shape[0]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        zero = q.new_zeros((), dtype=acc)
        l_hard = l_tw = zero
        if B and self.lambda_hard != 0.0:
            has = hard >= 0
            s_neg = (q * d_cand.index_select(0, hard.clamp(min=0))).sum(dim=1)
            hinge = torch.relu(self.margin + s_neg - s_pos) * has.to(s_pos.dtype)
            l_hard = hinge.to(acc).sum() * (w / B)
        if B and d_tw is not None and self.lambda_tw != 0.0:
            l_tw = torch.relu(self.margin + (q * d_tw).sum(dim=1) - s_pos).to(acc).sum() * (w / B)
        return l_hard, l_tw

    def _finish(self, l_nce, l_hard, l_tw, hard):
        total = l_nce + self.lambda_hard * l_hard + self.lambda_tw * l_tw
        parts = {"nce": l_nce.detach(), "hard": l_hard.detach(), "tw": l_tw.detach(), "total": total.detach(),
                 "hardest_col": hard}
        return total, parts

    def _gathered(self, q, d, d_tw, doc_ids):
        dist = torch.distributed
        group, rank, world = None, dist.get_rank(), dist.get_world_size()
        B = q.shape[0]
        sizes = _sizes(B, world, group, q.device)
        start, total = sum(sizes[:rank]), sum(sizes)
        if total == 0:
            raise ValueError("gather=True: every rank has an empty batch")
        g = lambda x: _gather(x, rank, world, group, sizes)  # noqa: E731
        ids = self._ids(B, doc_ids, q.device, offset=start)
        ids_all, d_all, q_all = g(ids), g(d), g(q)
        extra = None
        if self.tw_in_nce and d_tw is not None:
            extra = g(d_tw)
        w = world * B / total
        loss, hard = multipos_infonce_partial(q, d_all, ids, ids, ids_all, ids_all, temperature=self.temperature,
                                              extra_neg=extra, row_weight=0.5 * w, col_weight=0.0,
                                              diag_offset=start, return_hardest=True)
        row_none = none_flags(*spans32(ids_all, ids_all, ids_all, ids_all))[0].bool()
        loss = loss + multipos_infonce_partial(q_all, d, ids_all, ids_all, ids, ids, temperature=self.temperature,
                                               row_weight=0.0, col_weight=0.5 * w, diag_offset=-start,
                                               row_none=row_none)
        s_pos = (q * d).sum(dim=1)
        l_hard, l_tw = self._margins(q, d_all, d_tw, hard, s_pos, w)
        return self._finish(loss, l_hard, l_tw, hard)
