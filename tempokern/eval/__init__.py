"""Evaluation: ChunQiuTR / TEMPO / Re3 metrics and the protocol runner.

- :func:`retrieval_metrics` ``(run, qrels, ks)``: R@k (hit rate), recall@k, MRR@10, nDCG@10, MRR
- :func:`re3_metrics`: Re3-style R@k and MRR
- :func:`temporal_metrics` ``(run, verdicts, ks, periods)``: TEMPO TP@k, TR@k, TC@k, NDCG|FC@k
- :func:`evaluate` ``(scorer_or_index, dataset, protocol=...)``: ChunQiuTR protocol table
- :func:`write_run` / :func:`read_run`: TREC run files (``tempokern eval --run-out``), for trec_eval, ranx and
  paired comparisons between systems
"""
from .metrics import re3_metrics, rank_documents, retrieval_metrics
from .runner import CHUNQIU_MODES, EvalTable, Mode, evaluate, parse_protocol
from .temporal import interval_periods, interval_verdicts, temporal_metrics
from .recency import compare_evidence, recency_metrics, recency_report, version_truth
from .trec import TrecFormatError, read_run, write_run

__all__ = ["retrieval_metrics", "re3_metrics", "rank_documents", "temporal_metrics", "interval_verdicts",
           "interval_periods", "evaluate", "EvalTable", "Mode", "parse_protocol", "CHUNQIU_MODES"]
__all__ += ["recency_metrics", "compare_evidence", "recency_report", "version_truth"]
__all__ += ["write_run", "read_run", "TrecFormatError"]
