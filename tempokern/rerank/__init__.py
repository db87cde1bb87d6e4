"""Post-retrieval reranking and filtering: Re³'s conflict-aware recency filter (design notes §3.4–3.5).

- :class:`RecencyFilter` ``(extractor, policy="conflict"|"latest_only", mode="filter"|"rerank")``: Eq. 14
  (group facts by (head, relation), the latest ``published`` value wins, documents that state another
  value are voted −1 and removed); never reorders survivors, never drops silently.
- extractors: :class:`MetadataExtractor` (``meta["facts"]`` of structured records, the oracle),
  :class:`RuleExtractor` (alias table, metric gazetteer, numbers with units, categorical words),
  :class:`LLMExtractor` (``generate: str -> str``, the paper's listwise prompt; no model shipped).
- :class:`TimePrior` ``(match="any_inside"|"first_date"|"timekde", c=None)``: a retriever's score plus ``c``
  times a rule match between the query's interval and the document's dated expressions, ``c`` fitted on a
  training run (:meth:`TimePrior.fit`), then :meth:`TimePrior.rerank` any retriever's run.
"""
from .recency import (DEFAULT_ALIASES, DEFAULT_CATEGORIES, DEFAULT_METRICS, POLICIES, MODES, Candidate,
                      Extraction, ExtractionError, Extractor, Fact, FilterResult, LLMExtractor,
                      MetadataExtractor, RecencyFilter, RuleExtractor, build_prompt, date_parts, default_equal,
                      fact_key, find_dates, normalize_text, parse_facts_json, parse_number, qualified_relation)
from .time_prior import MATCHES, RELATIONS, TimePrior, month_span, query_span, record_spans

__all__ = ["Candidate", "Fact", "Extraction", "ExtractionError", "Extractor", "FilterResult", "RecencyFilter",
           "MetadataExtractor", "RuleExtractor", "LLMExtractor", "build_prompt", "parse_facts_json",
           "default_equal", "normalize_text", "parse_number", "find_dates", "date_parts", "fact_key",
           "qualified_relation", "TimePrior", "MATCHES", "RELATIONS", "month_span", "query_span", "record_spans",
           "POLICIES", "MODES",
           "DEFAULT_ALIASES", "DEFAULT_METRICS", "DEFAULT_CATEGORIES"]
