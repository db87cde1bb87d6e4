"""Baseline scorers for :func:`tempokern.eval.evaluate`: BM25 (bm25s, optional dependency) and
the ChunQiuTR paper's BM25+TimeKDE temporal prior."""
from .bm25 import BM25Scorer, char_ngram_tokenize
from .timekde import TimeKDEScorer, time_kde_prior

__all__ = ["BM25Scorer", "TimeKDEScorer", "char_ngram_tokenize", "time_kde_prior"]
