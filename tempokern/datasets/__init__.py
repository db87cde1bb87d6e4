"""Loaders for time-keyed retrieval data: ChunQiuTR format, Zizhi Tongjian jsonl, BEIR-style folders,
TimeQA (packaged, real English).

Every loader returns a :class:`RetrievalDataset` (records = gallery, queries with gold ids,
calendar, load report). Malformed rows raise :class:`DataFormatError` naming file and line, or
with ``on_error="skip"`` are skipped and counted in ``dataset.report``.
"""
from .base import (QUERY_FAMILIES, RECORD_TYPES, DataFormatError, LoadReport, Query, Record,
                   RetrievalDataset)
from .beir import load_beir
from .chunqiutr import POS_SOURCES, gold_from_interval, load_chunqiutr, load_chunqiutr_release
from .re2 import NEGATIVE_KINDS, Re2Data, Re2Triple, load_re2
from .zztj import PAPER_TEMPLATE, ZZTJ_TEMPLATES, load_zztj, load_zztj_sample, zztj_time_text
from .synth import SynthSet, TrainRow, load_synth
from .timeqa import export_beir, load_timeqa, timeqa_hard_negatives, timeqa_page_split
from .negatives import bm25_negatives, group_negatives

__all__ = ["Record", "Query", "RetrievalDataset", "LoadReport", "DataFormatError", "RECORD_TYPES",
           "QUERY_FAMILIES", "load_zztj", "load_zztj_sample", "zztj_time_text", "ZZTJ_TEMPLATES",
           "PAPER_TEMPLATE", "load_beir", "load_chunqiutr", "load_chunqiutr_release",
           "gold_from_interval", "POS_SOURCES"]
__all__ += ["load_re2", "Re2Data", "Re2Triple", "NEGATIVE_KINDS"]
__all__ += ["load_synth", "SynthSet", "TrainRow"]
__all__ += ["load_timeqa", "timeqa_hard_negatives", "timeqa_page_split", "export_beir", "bm25_negatives",
            "group_negatives"]
