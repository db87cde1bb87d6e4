"""BM25 baseline on bm25s (optional dependency), character-level for Classical Chinese.

Tokens: every CJK character plus the character bigrams of each CJK run (as the ChunQiuTR BM25
baseline does), and lower-cased alphanumeric words for other scripts."""
from __future__ import annotations

import re
from typing import Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["BM25Scorer", "char_ngram_tokenize"]

_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ebef"
_TOKEN = re.compile(f"[{_CJK}]+|[^\\W_]+", re.UNICODE)
_IS_CJK = re.compile(f"[{_CJK}]")


def char_ngram_tokenize(text: str, ngram: int = 2, keep_unigram: bool = True) -> List[str]:
    """CJK runs -> characters (if ``keep_unigram``) and character n-grams up to ``ngram``;
    other scripts -> lower-cased words."""
    toks: List[str] = []
    for run in _TOKEN.findall(text):
        if _IS_CJK.match(run):
            if keep_unigram or ngram < 2:
                toks.extend(run)
            for n in range(2, ngram + 1):
                toks.extend(run[i:i + n] for i in range(len(run) - n + 1))
        else:
            toks.append(run.lower())
    return toks


def _import_bm25s():
    try:
        import bm25s
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the BM25 baseline needs the 'bm25s' package: pip install bm25s "
                          "(or the tempokern[bm25] extra)") from e
    return bm25s


class BM25Scorer:
    """A scorer for :func:`tempokern.eval.evaluate`: ``scorer(queries, gallery) -> (Q, G) scores``.

    The index is built once per distinct gallery (cached by its record ids), so the protocol's
    gallery variants each get their own document statistics, as in the paper's baseline.
    ``method``: a bm25s variant (``"lucene"``, ``"robertson"``, ``"atire"``, ``"bm25l"``, ``"bm25+"``)."""

    def __init__(self, k1: float = 1.5, b: float = 0.75, method: str = "lucene", ngram: int = 2,
                 keep_unigram: bool = True, tokenizer=None):
        if ngram < 1:
            raise ValueError(f"ngram must be >= 1, got {ngram}")
        self.k1, self.b, self.method = float(k1), float(b), method
        self.tokenizer = tokenizer or (lambda t: char_ngram_tokenize(t, ngram, keep_unigram))
        self._cache: Dict[Tuple[str, ...], object] = {}

    def index(self, gallery: Sequence) -> object:
        ids = tuple(r.id for r in gallery)
        if ids not in self._cache:
            bm25s = _import_bm25s()
            retr = bm25s.BM25(k1=self.k1, b=self.b, method=self.method)
            retr.index([self.tokenizer(r.text) or ["<empty>"] for r in gallery], show_progress=False)
            self._cache = {ids: retr}  # keep one: galleries come one after another
        return self._cache[ids]

    def __call__(self, queries: Sequence, gallery: Sequence) -> np.ndarray:
        retr = self.index(gallery)
        out = np.zeros((len(queries), len(gallery)), dtype=np.float32)
        for i, q in enumerate(queries):
            toks = self.tokenizer(q.text if hasattr(q, "text") else str(q))
            if toks:
                out[i] = retr.get_scores(toks)
        return out
