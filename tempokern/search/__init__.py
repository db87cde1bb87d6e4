"""Temporal retrieval over a persisted gallery: exact fused scan or faiss first stage + CTD rerank."""
from ._format import IndexFormatError
from .index import BACKENDS, TemporalIndex

__all__ = ["TemporalIndex", "IndexFormatError", "BACKENDS"]
